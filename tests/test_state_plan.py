"""The step's arguments in the one search (``hloopt plan --state``): parameter groups and the
optimizer's state as candidates beside the residuals, judged by the one simulator.

Truth: bytes hand-computed from the step's shapes (a wide MLP trained with AdamW,
``fixtures/state/wide_adamw.py``), the analyzed timeline (the all-device replay must reproduce
it), the host profile's own figures for the host update's time, the CPU backend's numbers for a
plan applied to the unmodified step, and libtpu's ``memory_analysis()`` for why TPU plans keep the
arguments on device.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fixtures.state import wide_adamw
from hloopt.cli import cli
from hloopt.devices import load_profile
from hloopt.errors import UserError
from hloopt.hosts import load_host_profile, optimizer_update_host_s
from hloopt.pipeline import OPTIMIZER_KEY, analyze_target, plan
from hloopt.plan import Plan
from hloopt.problem import Action, Decisions
from hloopt.simulator import simulate
from hloopt.targets import resolve
from tests.tiers import ci_sample

TARGET = "fixtures/state/wide_adamw.py:make"
SMALL = {"d": 256, "n_layers": 2, "batch": 8}
F32 = 256 * 256 * 4  # one d x d f32 matrix: 262,144 B


@pytest.fixture(scope="module")
def gpu_problem():  # type: ignore[no-untyped-def]
    tgt = resolve(TARGET, factory_kwargs=SMALL)
    an, problem = analyze_target(tgt, load_profile("h200"), platform="cuda", state=True, host="xeon-spr-8480")
    return an, problem


@pytest.fixture(scope="module")
def host_plan(gpu_problem):  # type: ignore[no-untyped-def]
    """``(budget, outcome)``: the small step planned with its arguments at a budget half the
    optimizer's state under the all-on-device peak (planned once for the tests that read it)."""
    an, problem = gpu_problem
    budget = an.peak_bytes - problem.candidate(OPTIMIZER_KEY).bytes // 2
    tgt = resolve(TARGET, factory_kwargs=SMALL)
    return budget, plan(tgt, profile=load_profile("h200"), platform="cuda", budget=str(budget), state=True)


def test_argument_groups_are_candidates_with_their_bytes(gpu_problem) -> None:  # type: ignore[no-untyped-def]
    an, problem = gpu_problem
    state = {c.key: c for c in problem.candidates if c.state is not None}
    assert sorted(state) == ["state:optimizer", "state:params[0]", "state:params[1]"]
    for k in ("state:params[0]", "state:params[1]"):
        c = state[k]
        # read by the differentiated forward pass: parameters, which can only be placed
        assert c.bytes == F32 and c.allowed == {Action.DEVICE, Action.OFFLOAD}
    opt = state[OPTIMIZER_KEY]
    assert opt.state == "opt_state[0].count, opt_state[0].mu, opt_state[0].nu"
    assert Action.REMAT in opt.allowed and opt.remat_transient
    # mu and nu: two d x d f32 moments each (the count is a scalar)
    assert int(problem.notes["state-bytes:opt_state[0].mu"]) == 2 * F32
    assert int(problem.notes["state-bytes:opt_state[0].nu"]) == 2 * F32
    assert 4 * F32 <= opt.bytes <= 4 * F32 + 512
    # the optimizer's state is first read after the parameters are
    assert opt.instances[0].first_backward_use > max(state[k].instances[0].first_backward_use
                                                     for k in ("state:params[0]", "state:params[1]"))


def test_all_device_is_the_analyzed_timeline_and_the_host_update_frees_the_state_at_every_step(
        gpu_problem) -> None:  # type: ignore[no-untyped-def]
    an, problem = gpu_problem
    base = simulate(problem, Decisions.all_device())
    assert base.peak_bytes == an.peak_bytes
    opt = problem.candidate(OPTIMIZER_KEY)
    host = simulate(problem, Decisions({OPTIMIZER_KEY: Action.REMAT}))
    freed = np.asarray(base.timeline_bytes) - np.asarray(host.timeline_bytes)
    assert set(freed.tolist()) == {opt.bytes}
    # ... and the host holds it the whole step; nothing is on the host with everything on device
    assert set(host.host_timeline_bytes) == {opt.bytes} and set(base.host_timeline_bytes) == {0}
    # placed in host memory instead: freed before its first read, back on device from there
    placed = simulate(problem, Decisions({OPTIMIZER_KEY: Action.OFFLOAD}))
    freed = np.asarray(base.timeline_bytes) - np.asarray(placed.timeline_bytes)
    assert set(freed.tolist()) <= {0, opt.bytes} and freed[-1] == 0


def test_host_update_time_from_the_host_profile(gpu_problem) -> None:  # type: ignore[no-untyped-def]
    _, problem = gpu_problem
    h200, spr = load_profile("h200"), load_host_profile("xeon-spr-8480")
    n = 2 * 256 * 256  # parameters the update touches
    share = max(1, round(spr.host_memory_bytes / h200.host_memory_bytes))
    expected = (optimizer_update_host_s(spr, n, 4) * share + n * 4 / h200.d2h_bytes_per_s
                + n * 4 / h200.h2d_bytes_per_s + 2 * h200.transfer_latency_s)
    assert problem.candidate(OPTIMIZER_KEY).remat_s == pytest.approx(expected, rel=1e-12)
    # the host's CPU's part of it, which reports show beside the device's compute
    assert problem.candidate(OPTIMIZER_KEY).host_compute_s == pytest.approx(optimizer_update_host_s(spr, n, 4) * share,
                                                                           rel=1e-12)


def test_plan_places_the_state_to_fit_a_budget_the_residuals_cannot(host_plan, tmp_path) -> None:  # type: ignore[no-untyped-def]
    tgt = resolve(TARGET, factory_kwargs=SMALL)
    h200 = load_profile("h200")
    budget, out = host_plan
    with pytest.raises(UserError):  # the residuals alone cannot reach it
        plan(tgt, profile=h200, platform="cuda", budget=str(budget))
    p = out.plan
    assert p.predicted.peak_bytes <= budget
    assert p.host_groups  # something left the device
    replay = simulate(out.problem, out.decisions)
    assert replay.peak_bytes == p.predicted.peak_bytes
    assert p.host_peak_bytes == max(replay.host_timeline_bytes) <= h200.host_memory_bytes
    assert p.host_peak_bytes >= sum(s.bytes for s in p.state if s.placement != "device")
    # the file keeps the placements
    path = tmp_path / "plan.json"
    p.save(path)
    again = Plan.load(path)
    assert again.state == p.state and again.host_budget_bytes == h200.host_memory_bytes
    assert again.host_peak_bytes == p.host_peak_bytes
    # JAX's documented recipe is among the anchors the plan is judged against
    names = {a.name for a in out.anchors}
    assert "optimizer on host (compute_on)" in names and "full + optimizer_memory_host_offload" in names


def test_host_budget_limits_what_goes_to_the_host(gpu_problem) -> None:  # type: ignore[no-untyped-def]
    tgt = resolve(TARGET, factory_kwargs=SMALL)
    h200 = load_profile("h200")
    _, problem = gpu_problem
    opt = problem.candidate(OPTIMIZER_KEY)
    # a host budget below the optimizer's state leaves it out of the candidates
    an2, small = analyze_target(tgt, h200, platform="cuda", state=True, host="xeon-spr-8480",
                                host_budget_bytes=opt.bytes - 1)
    assert OPTIMIZER_KEY not in {c.key for c in small.candidates}


def test_tpu_keeps_the_arguments_on_device_and_says_why() -> None:
    tgt = resolve(TARGET, factory_kwargs=SMALL)
    _, problem = analyze_target(tgt, load_profile("tpu-v5e"), state=True, host="xeon-spr-8480")
    state = [c for c in problem.candidates if c.state is not None]
    assert state and all(c.allowed == {Action.DEVICE} for c in state)
    assert all("libtpu" in problem.notes[f"kept:{c.key}"] for c in state)


def test_apply_plan_refuses_a_host_plan_without_the_arguments(host_plan, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import hloopt

    _, out = host_plan
    path = tmp_path / "plan.json"
    out.plan.save(path)
    step, _ = wide_adamw.make(**SMALL)
    with pytest.raises(UserError, match="give the step's arguments"):
        hloopt.apply_plan(path, step)


def test_plan_applied_to_the_unmodified_step_computes_the_same_numbers(host_plan, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """CPU backend: the plan's placement applied with ``apply_plan(plan, step, args)`` to the step
    written with its update on the host (what the plan asks for) gives the original step's numbers."""
    import jax

    import hloopt

    p = host_plan[1].plan
    path = tmp_path / "plan.json"
    p.save(path)
    step, args = wide_adamw.make(**SMALL, abstract=False)
    hstep, _ = wide_adamw.make(**SMALL, abstract=False, host_update=p.host_update)
    want = jax.jit(step)(*args)
    step2, args2 = hloopt.apply_plan(path, hstep, args)
    got = step2(*args2)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_cli_prints_where_each_group_goes() -> None:
    tgt = resolve(TARGET)  # the command line builds the factory's default size
    h200 = load_profile("h200")
    an, problem = analyze_target(tgt, h200, platform="cuda", state=True, host="xeon-spr-8480")
    budget = an.peak_bytes - problem.candidate(OPTIMIZER_KEY).bytes // 2
    res = CliRunner().invoke(cli, ["plan", TARGET, "--state", "--platform", "cuda", "--device", "h200",
                                   "--budget", str(budget), "-q"])
    assert res.exit_code == 0, res.output
    assert "opt_state[0].mu" in res.output and "hloopt.apply_plan(" in res.output
    # the compute on each side: the update's host seconds where the plan computes it there
    from hloopt.units import format_seconds

    line = next(x for x in res.output.splitlines() if x.strip().startswith("compute per step:"))
    shown = problem.candidate(OPTIMIZER_KEY).host_compute_s if "host-compute" in res.output else 0.0
    assert f"host {format_seconds(shown)}" in line
    bad = CliRunner().invoke(cli, ["plan", TARGET, "--state", "--host-budget", "lots", "-q"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.skipif(not __import__("hloopt.lowering", fromlist=["has_libtpu"]).has_libtpu(),
                    reason="libtpu not installed")
def test_libtpu_agrees_that_moving_the_optimizer_state_off_a_tpu_raises_its_peak() -> None:
    """Why TPU plans keep the arguments on device (``TPU_STATE_EVIDENCE``): libtpu's own
    ``peak_memory_in_bytes`` for the wide AdamW step as written, with mu and nu in host memory,
    and with its update computed on the host (``hloopt.state.on_host``): each move raises it,
    while the host arguments are exactly the moved state (mu + nu, 2 x 4 x 2048 x 2048 f32)."""
    from hloopt.state import compile_placed

    step, args = wide_adamw.make()
    hstep, _ = wide_adamw.make(host_update=True)
    opt = {"opt_state[0].mu": "host", "opt_state[0].nu": "host"}
    written = compile_placed({}, step, args)
    placed = compile_placed(opt, step, args)
    updated = compile_placed({**opt, "opt_state[0].count": "host"}, hstep, args)
    moments = 2 * 4 * 2048 * 2048 * 4
    assert placed["host_argument_size_in_bytes"] == moments
    assert updated["host_argument_size_in_bytes"] == pytest.approx(moments, abs=512)
    assert placed["peak_memory_in_bytes"] > written["peak_memory_in_bytes"]
    assert updated["peak_memory_in_bytes"] > written["peak_memory_in_bytes"]


def test_html_report_shows_where_each_group_lives(host_plan) -> None:  # type: ignore[no-untyped-def]
    from hloopt.report.adapt import report_data_from_outcome
    from hloopt.report.html import render_html

    _, out = host_plan
    data = report_data_from_outcome(out)
    rows = {r.key: r for r in data.residuals if r.key.startswith("state:")}
    assert {s.group for s in out.plan.state} == {k[len("state:"):] for k in rows}
    for s in out.plan.state:
        assert rows[f"state:{s.group}"].action == s.placement and rows[f"state:{s.group}"].bytes == s.bytes
    assert data.assumptions["argument groups in host memory"] == ", ".join(out.plan.host_groups)
    # host memory over the step: the simulator's host timeline, whose most is the plan's figure
    assert data.host_timeline == list(out.result.host_timeline_bytes)
    assert max(data.host_timeline) == out.plan.host_peak_bytes > 0
    assert data.host_budget_bytes == out.plan.host_budget_bytes
    # compute on each side: the steps' roofline plus what the plan recomputes; the optimizer
    # update's host seconds where the plan computes it there
    recomputed = {d.key for d in out.plan.of("remat")}
    assert data.device_compute_s == pytest.approx(sum(s.duration_s for s in out.problem.steps) + sum(
        c.remat_s for c in out.problem.candidates if c.key in recomputed), rel=1e-12)
    opt = out.problem.candidate(OPTIMIZER_KEY)
    assert data.host_compute_s == (opt.host_compute_s if out.plan.host_update else 0.0)
    html = render_html(data)
    assert "opt_state[0].mu" in html and "argument groups in host memory" in html
    assert 'id="host-chart"' in html and "Compute, device / host" in html
    # 256 GiB of host budget beside 1 MiB used: written, not drawn; a budget near the use is drawn
    assert 'id="host-budget-label"' in html and 'id="host-budget-line"' not in html
    import dataclasses

    near = render_html(dataclasses.replace(data, host_budget_bytes=2 * max(data.host_timeline)))
    assert 'id="host-budget-line"' in near
    # a report re-rendered from its JSON is the same page
    from hloopt.report import ReportData

    assert render_html(ReportData.from_dict(json.loads(data.to_json()))) == html


OPT_GROUPS = ("opt_state[0].count", "opt_state[0].mu", "opt_state[0].nu")


@pytest.mark.parametrize("step", ["hf_gpt2", "levanter_llama"])
def test_third_party_optimizer_state_is_found_as_one_candidate(step: str) -> None:
    """On code we did not write (transformers' Flax GPT-2, Levanter's Llama; optax AdamW), the
    groups only the optimizer reads are exactly the optimizer's state, and each parameter group
    is a candidate of its own."""
    from tests.test_thirdparty import load

    load(step)
    tgt = resolve(f"fixtures/thirdparty/{step}.py:make", size="tiny")
    _, problem = analyze_target(tgt, load_profile("h200"), platform="cuda", state=True, host="xeon-spr-8480")
    state = {c.key: c for c in problem.candidates if c.state is not None}
    assert state[OPTIMIZER_KEY].state == ", ".join(OPT_GROUPS)
    params = sorted(k for k in state if k != OPTIMIZER_KEY)
    assert params and all(k.startswith("state:params") for k in params)


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.skipif(not __import__("hloopt.lowering", fromlist=["has_libtpu"]).has_libtpu(),
                    reason="libtpu not installed")
@pytest.mark.parametrize("step", ci_sample(["hf_gpt2", "levanter_llama"], ["hf_gpt2"]))
def test_third_party_optimizer_state_placed_on_the_host_is_what_libtpu_puts_there(step: str) -> None:
    """The placement part on TPU (where the planner keeps the state on device): the optimizer's
    groups placed in host memory on the unmodified step, compiled by libtpu 0.0.42 deviceless:
    its host arguments and outputs are those groups' bytes in libtpu's layout (hloopt state),
    within 3%."""
    from hloopt.state import compile_placed, state_groups
    from tests.test_thirdparty import load

    load(step)
    tgt = resolve(f"fixtures/thirdparty/{step}.py:make", size="tiny")
    step_fn, args = tgt.step_fn, tuple(tgt.args)
    groups = {g.name: g for g in state_groups(step_fn, args)}
    want = sum(groups[g].tpu_bytes for g in OPT_GROUPS)
    got = compile_placed(dict.fromkeys(OPT_GROUPS, "host"), step_fn, args)
    assert got["host_argument_size_in_bytes"] == pytest.approx(want, rel=0.03)
    assert got["host_output_size_in_bytes"] == pytest.approx(want, rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize("step", ci_sample(["hf_gpt2", "levanter_llama"], ["levanter_llama"]))
def test_third_party_step_with_its_optimizer_state_on_the_host_computes_the_same_numbers(step: str) -> None:
    """CPU backend: the unmodified third-party step, its optimizer state placed in host memory,
    gives the same numbers as the step as written."""
    import jax

    from hloopt.measure import materialize
    from hloopt.state import apply_state_plan
    from tests.test_thirdparty import load

    load(step)
    tgt = resolve(f"fixtures/thirdparty/{step}.py:make", size="tiny")
    args = materialize(tuple(tgt.args))
    want = jax.jit(tgt.step_fn)(*args)
    step2, args2 = apply_state_plan(dict.fromkeys(OPT_GROUPS, "host"), tgt.step_fn, args)
    got = step2(*args2)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_maxtext_fragment_carries_the_state_placement(host_plan) -> None:  # type: ignore[no-untyped-def]
    """MaxText's two booleans say where a whole role lives; a host update has no switch and is
    named in a comment. The fragment is read back with YAML as MaxText reads it."""
    import dataclasses

    import yaml

    from hloopt.emit import maxtext_yaml

    p = host_plan[1].plan
    assert {s.role for s in p.state} == {"parameters", "optimizer"}

    def placed(where: dict[str, str]) -> Plan:
        return dataclasses.replace(p, state=tuple(dataclasses.replace(s, placement=where[s.role]) for s in p.state))

    host_opt = yaml.safe_load(maxtext_yaml(placed({"optimizer": "host", "parameters": "device"}), strict=False))
    assert host_opt["optimizer_memory_host_offload"] is True and host_opt["parameter_memory_host_offload"] is False
    text = maxtext_yaml(placed({"optimizer": "host-compute", "parameters": "host"}), strict=False)
    both = yaml.safe_load(text)
    assert both["optimizer_memory_host_offload"] is True and both["parameter_memory_host_offload"] is True
    assert "NOT EXPRESSIBLE in MaxText: the optimizer update computed on the host" in text
    # the plan file keeps each group's role
    assert Plan.loads(p.to_json()).state == p.state
