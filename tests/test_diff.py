"""hloopt diff: HLO snapshots with and without offload, plans, the buffer matcher, the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import cli, main
from hloopt.diff import Side, diff_paths, diff_sides, load_side, logical_shape, memory_side
from hloopt.errors import UserError
from hloopt.plan import Bounds, Decision, Plan, Predicted, Selector, SolverInfo
from hloopt.report import LiveBuffer

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "hlo" / "zoo"
BASE, OFFLOAD = ZOO / "llama.tpu-v5e.hlo", ZOO / "llama.offload.tpu-v5e.hlo"


def xla(path: Path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())


def test_offloaded_buffers_moved_to_host_match_xla() -> None:
    d = diff_paths(str(BASE), str(OFFLOAD))
    # XLA: no host temporaries without offload, host_temp_size_in_bytes with it; one host buffer per
    # offloaded checkpoint name (the scan stacks each name's per-layer copies into one buffer)
    assert sum(b.bytes for b in d.a.host_buffers) == xla(BASE)["memory"]["host_temp_size_in_bytes"] == 0
    moved = d.moved_to_host
    assert sum(c.b.bytes for c in moved) == xla(OFFLOAD)["memory"]["host_temp_size_in_bytes"] == 262144
    assert len(moved) == len(xla(OFFLOAD)["offloaded_names"]) == 4
    # shapes: layers x batch x seq x features of q/k/v/context: [2 layers, 2 batch, 32 seq, 64 | 32]
    assert Counter(logical_shape(c.b.shape) for c in moved) == {"f32[2,2,32,64]": 2, "f32[2,2,32,32]": 2}
    assert d.peak_delta_bytes == d.b.peak_bytes - d.a.peak_bytes
    for side in (d.a, d.b):
        assert sum(side.bytes_by_category.values()) == side.peak_bytes


#: How close the memory model's peaks (and their change) must come to XLA's, as a share of XLA's peak.
TOLERANCE = 0.05


def test_peak_change_matches_xla_with_the_memory_model() -> None:
    d = diff_paths(str(BASE), str(OFFLOAD))  # default analyzer: the memory model
    assert d.a.model.startswith("memory model")
    xa, xb = xla(BASE)["memory"]["peak_memory_in_bytes"], xla(OFFLOAD)["memory"]["peak_memory_in_bytes"]
    # each side within the model's tolerance of XLA, and the change as well
    assert d.a.peak_bytes == pytest.approx(xa, rel=TOLERANCE)
    assert d.b.peak_bytes == pytest.approx(xb, rel=TOLERANCE)
    assert abs(d.peak_delta_bytes - (xb - xa)) <= TOLERANCE * xa


def test_same_module_has_no_changes() -> None:
    d = diff_paths(str(BASE), str(BASE))
    assert d.peak_delta_bytes == 0 and not d.buffer_changes and not d.moved_to_host
    assert all(a == b for a, b in d.categories.values())


def lb(name: str, shape: str, n: int, op: str = "") -> LiveBuffer:
    return LiveBuffer(name=name, shape=shape, bytes=n, category="temporary", op_name=op)


def test_buffer_matching_by_op_name_and_shape() -> None:
    a = Side("a", "hlo", 100, live_at_peak=(lb("fusion.1", "f32[8]{0}", 32, "jit(f)/dot"),
                                            lb("fusion.2", "f32[4]", 16, "jit(f)/exp"),
                                            lb("copy.3", "f32[2,2]", 16), lb("copy.4", "bf16[9]", 18)))
    b = Side("b", "hlo", 90, live_at_peak=(lb("fusion.9", "f32[8]{0:T(128)}", 512, "jit(f)/dot"),  # layout only
                                           lb("fusion.7", "f32[16]", 64, "jit(f)/exp"),  # same op, new shape
                                           lb("copy.12", "f32[2,2]", 16),  # renamed, same shape, no op_name
                                           lb("add.5", "f32[3]", 12, "jit(f)/add")))
    got = {(c.status, (c.a or c.b).name if c.status != "resized" else f"{c.a.name}->{c.b.name}")
           for c in diff_sides(a, b).buffer_changes}
    # f32[8] with a layout is the same buffer: its bytes change but the identity does not
    assert got == {("resized", "fusion.2->fusion.7"), ("added", "add.5"), ("removed", "copy.4")}


def make_plan(actions: dict[str, str], peak: int) -> Plan:
    decisions = tuple(Decision(key=f"name:{n}", name=n, selector=Selector.by_name(n), action=act, bytes=1 << 20,
                               layers=2, shape="bf16[2,64,64]") for n, act in actions.items())
    return Plan(target="t.hlo", module="jit_step", device={"name": "tpu-v5e"}, budget=None, mode="budget",
                decisions=decisions, predicted=Predicted(peak, 0.01, 0.0, 8 << 20, 0.01),
                bounds=Bounds(1 << 20, 0.01), solver=SolverInfo("milp", "optimal", 0.0, 0.1))


def test_plans_diff_decisions_and_peak(tmp_path: Path) -> None:
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    make_plan({"query_proj": "offload", "key_proj": "device", "mlp": "remat"}, 6 << 20).save(pa)
    make_plan({"query_proj": "offload", "key_proj": "offload", "context": "offload"}, 5 << 20).save(pb)
    d = diff_paths(str(pa), str(pb))
    assert d.a.kind == d.b.kind == "plan"
    assert d.peak_delta_bytes == -(1 << 20)
    assert [(c.key, c.a_action, c.b_action) for c in d.decision_changes] == [
        ("name:key_proj", "device", "offload"), ("name:mlp", "remat", None), ("name:context", None, "offload")]


def test_cli_json_and_text(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["diff", str(BASE), str(OFFLOAD), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["b"]["host_bytes"] - d["a"]["host_bytes"] == 262144
    assert d["peak_delta_bytes"] == d["b"]["peak_bytes"] - d["a"]["peak_bytes"]
    assert len(d["moved_to_host"]) == 4
    r = CliRunner().invoke(cli, ["diff", str(BASE), str(OFFLOAD)])
    assert r.exit_code == 0 and "\x1b[" not in r.output
    assert "Moved to host memory in B" in r.output and "+256 KiB" in r.output


def test_cli_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(BASE), str(tmp_path / "missing.hlo")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.hlo" in err[0]
    bad = tmp_path / "x.json"
    bad.write_text('{"schema": "hloopt.plan/1"}')
    with pytest.raises(UserError):
        load_side(str(bad))


def test_sharded_sides_carry_mesh() -> None:
    side = memory_side(__import__("hloopt.hlo.parser", fromlist=["parse_file"]).parse_file(ZOO / "sharded.tpu-v5e.hlo"),
                       "sharded")
    assert side.num_partitions == 8 and tuple(side.mesh) == (2, 4)
