"""Reports from the real analyses: the memory model for modules, the pipeline and simulator for plans.

Truth comes from outside the adapter: XLA's own figures in the snapshots' ``.json``, the memory
model's per-category bytes at its peak (computed by PeakMemory, not here), and the Problem's
candidate instances added up by hand for the residual category.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hloopt.analysis import analyze
from hloopt.cli import cli
from hloopt.devices import load_profile
from hloopt.report import ReportData
from hloopt.report.adapt import memory_category_timeline, report_data_from_memory, report_data_from_outcome
from hloopt.report.html import render_html

ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "zoo"
V5E = load_profile("tpu-v5e")


@pytest.mark.parametrize("stem", ["llama.tpu-v5e", "llama.offload.tpu-v5e", "sharded.tpu-v5e", "mlp.cpu-compiled",
                                  "gpt2.tpu"])
def test_category_split_sums_to_the_memory_model_and_matches_its_peak_categories(stem: str) -> None:
    rep = analyze(ZOO / f"{stem}.hlo", platform="tpu" if stem.endswith(".tpu") else None)
    prof = rep.profile
    split = memory_category_timeline(prof, rep.settings)
    total = sum(split.values())
    assert total.tolist() == list(prof.timeline_bytes)
    # PeakMemory's own bytes by category at its peak (a separate computation)
    at_peak = {c: int(v[prof.peak_step]) for c, v in split.items() if v[prof.peak_step]}
    assert at_peak == prof.categories


def test_sharded_snapshot_report_is_per_device_with_the_mesh(tmp_path: Path) -> None:
    xla = json.loads((ZOO / "sharded.tpu-v5e.json").read_text())["memory"]
    out = tmp_path / "s.html"
    r = CliRunner().invoke(cli, ["report", str(ZOO / "sharded.tpu-v5e.hlo"), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = ReportData.from_dict(json.loads(r.output))
    assert d.num_partitions == 8 and tuple(d.mesh) == (2, 4)
    # per device: the partitioned module's peak is XLA's per-device peak (within the model's 2%)
    assert d.baseline_peak_bytes == pytest.approx(xla["peak_memory_in_bytes"], rel=0.02)
    assert "XLA's own peak" in d.assumptions
    page = out.read_text()
    assert "SPMD program on 8 devices (mesh 2x4): every figure is per device." in page
    r = CliRunner().invoke(cli, ["report", str(ZOO / "sharded.tpu-v5e.hlo")])
    assert "devices                8 partitions, mesh 2x4; figures are per device" in r.output
    r = CliRunner().invoke(cli, ["analyze", str(ZOO / "sharded.tpu-v5e.hlo"), "--top", "1"])
    assert r.exit_code == 0 and "8 (mesh 2x4); figures are per device" in r.output


def test_analyze_html_is_the_memory_model(tmp_path: Path) -> None:
    out = tmp_path / "a.html"
    r = CliRunner().invoke(cli, ["analyze", str(ZOO / "llama.tpu-v5e.hlo"), "--html", str(out), "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    page = out.read_text()
    rep = analyze(ZOO / "llama.tpu-v5e.hlo", top=50)
    data = report_data_from_memory(rep, V5E.to_dict(), target=str(ZOO / "llama.tpu-v5e.hlo"))
    assert page == render_html(data)
    assert data.baseline_peak_bytes == j["peak_bytes"] == max(data.baseline_timeline)
    assert data.step_labels[data.baseline_peak_step].split("/")[-1] == j["peak_at"]["instruction"]
    # every category the model reports at the peak is drawn, and the backward pass is shaded
    assert set(j["categories"]) <= set(data.baseline_by_category)
    assert any(data.step_backward) and not data.step_backward[0]
    # existing files hloopt did not write are refused, its own are replaced
    other = tmp_path / "notes.html"
    other.write_text("<p>mine</p>")
    r = CliRunner().invoke(cli, ["analyze", str(ZOO / "mlp.tpu-v5e.hlo"), "--html", str(other), "-q"])
    assert r.exit_code == 2 and other.read_text() == "<p>mine</p>"
    r = CliRunner().invoke(cli, ["analyze", str(ZOO / "mlp.tpu-v5e.hlo"), "--html", str(out), "-q"])
    assert r.exit_code == 0 and r.output == "" and "mlp.tpu-v5e.hlo" in out.read_text()


# -- plans -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offload_everything():
    """llama tiny through the pipeline, then every movable candidate offloaded (not the search's choice,
    so the test does not depend on which plan the search finds)."""
    from hloopt import pipeline
    from hloopt.problem import Action, Decisions
    from hloopt.simulator import simulate

    o = pipeline.plan("fixtures/zoo/llama.py:tiny", profile=V5E, max_slowdown=0.05)
    dec = Decisions({c.key: Action.OFFLOAD for c in o.problem.candidates if Action.OFFLOAD in c.allowed})
    res = simulate(o.problem, dec)
    plan = pipeline.make_plan(o.plan.target, o.analyzed, o.problem, V5E, budget_spec=None, budget_bytes=None,
                              mode="budget", decisions=dec, result=res, baseline=o.baseline,
                              solver={"name": "test", "status": "given"})
    return dataclasses.replace(o, plan=plan, decisions=dec, result=res)


@pytest.mark.slow
def test_plan_report_stacks_to_the_simulator_and_counts_residuals_by_hand(offload_everything) -> None:
    o = offload_everything
    data = report_data_from_outcome(o)
    p = o.problem
    n = len(p.steps)
    assert data.num_steps == n
    assert data.baseline_timeline == list(o.baseline.timeline_bytes)
    # residuals by hand: every instance is on device from its production to its last use
    by_hand = np.zeros(n, dtype=np.int64)
    for c in p.candidates:
        for ins in c.instances:
            by_hand[ins.produced:ins.last_use + 1] += ins.bytes
    assert data.baseline_by_category["residuals"] == by_hand.tolist()
    # what the plan keeps on device is its own line; transfers: one out and one back per moving instance
    assert list(data.plan_timeline) == list(o.result.timeline_bytes)
    moving = sum(1 for c in p.candidates if o.decisions.action(c.key).value == "offload"
                 for ins in c.instances if ins.first_backward_use > ins.last_forward_use)
    assert moving > 0
    assert sum(t.direction == "d2h" for t in data.transfers) == moving
    assert sum(t.direction == "h2d" for t in data.transfers) == moving
    # parameters live the whole step
    assert min(data.baseline_by_category["parameters"]) > 0
    # the residual buffers live at the peak are marked with the plan's action for them
    marked = [b for b in data.live_at_peak if b.category == "residuals"]
    assert marked and all(b.action in ("device", "offload") for b in marked)
    page = render_html(data)
    assert page.count('class="d2h"') >= 1 and page.count('class="h2d"') >= 1
    assert "fixtures/zoo/llama.py:tiny" in page


@pytest.mark.slow
def test_report_of_a_plan_file_replays_the_plan(tmp_path: Path, offload_everything) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(offload_everything.plan.to_json())
    r = CliRunner().invoke(cli, ["report", str(plan_file), "--json"])
    assert r.exit_code == 0, r.output
    d = ReportData.from_dict(json.loads(r.output))
    pred = offload_everything.plan.predicted
    # a fresh lowering + analysis + simulation of the saved decisions gives the plan's own prediction
    assert (d.baseline_peak_bytes, d.plan_peak_bytes) == (pred.baseline_peak_bytes, pred.peak_bytes)
    assert d.plan_step_time_s == pytest.approx(pred.step_time_s, rel=1e-9)
    assert {r.key: r.action for r in d.residuals} == {x.key: x.action for x in offload_everything.plan.decisions}
    # a decision on a candidate the program does not have is one line, exit 2
    bad = json.loads(plan_file.read_text())
    bad["decisions"][0]["key"] = "name:not_in_the_program"
    bad["decisions"][0]["action"] = "offload"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = CliRunner().invoke(cli, ["report", str(tmp_path / "bad.json")])
    assert r.exit_code == 2 and "not_in_the_program" in r.output


def test_report_json_is_clean_and_bad_json_is_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["report", str(ZOO / "mlp.tpu-v5e.hlo"), "--json"])
    assert r.exit_code == 0 and r.stderr == ""
    assert json.loads(r.stdout)["module_name"]
    (tmp_path / "x.json").write_text('{"hello": 1}')
    r = CliRunner().invoke(cli, ["report", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and re.search(r"must be a plan", r.output) and len(r.output.strip().splitlines()) == 1


def test_memory_report_carries_the_predictions_notes() -> None:
    """The notes ``hloopt analyze`` prints for a TPU prediction reach the HTML report too."""
    rep = analyze(ZOO / "gpt2.offload.tpu.hlo", platform="tpu")
    data = report_data_from_memory(rep, V5E.to_dict())
    assert rep.notes and [data.assumptions[f"note {k}"] for k in range(1, len(rep.notes) + 1)] == rep.notes
    assert "libtpu copies them back" in render_html(data)
