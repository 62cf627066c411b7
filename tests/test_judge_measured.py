"""``hloopt plan --judge measured``: the plan and the built-in policies run on the device, the
fastest beyond the plan's spread taken (:func:`hloopt.pipeline.measured_choice`).

The device here is the CPU backend (CI has no accelerator): the choice is checked on a real
measurement of the zoo's tiny Llama against the rule computed from the same medians, and on
hand-made timings where the answer is known; the plan file keeps what was measured."""

from __future__ import annotations

import json

import jax
import pytest

from hloopt import pipeline
from hloopt.devices import load_profile
from hloopt.emit import policy as plan_policy
from hloopt.measure import Measurement, PolicyRow, StepTimes, measure
from hloopt.plan import BUILTIN_POLICIES, OFFLOADING_BUILTINS, Plan
from hloopt.targets import resolve

V5E = load_profile("tpu-v5e")


@pytest.fixture(scope="module")
def planned():
    tgt = resolve("fixtures/zoo/llama.py:tiny")
    outcome = pipeline.plan(tgt, profile=V5E, budget="90%")  # within reach under jax 0.10 and 0.12

    def build(problem, decisions, result):
        return pipeline.make_plan(tgt.name, outcome.analyzed, problem, V5E, budget_spec="90%",
                                  budget_bytes=outcome.plan.budget.bytes, mode="budget", decisions=decisions,
                                  result=result, baseline=outcome.baseline,
                                  solver={"name": "milp", "status": "optimal", "gap": 0.0, "time_s": 0.0})

    return tgt, outcome, build


def _same_after_roundtrip(p: Plan) -> bool:
    """The plan file keeps what was measured (floats as the file rounds them)."""
    back = Plan.from_dict(json.loads(p.to_json()))
    return back.to_json() == p.to_json() and back.measured is not None and \
        (back.measured.chosen, [r.name for r in back.measured.rows]) == \
        (p.measured.chosen, [r.name for r in p.measured.rows])


def test_a_real_measurement_takes_the_fastest_row_beyond_the_plans_spread(planned) -> None:
    tgt, outcome, build = planned
    m = measure(tgt, profile=V5E, plan=outcome.plan, steps=5, warmup=1)
    ran = [r for r in m.rows if r.measured is not None]
    assert any(r.kind == "plan" for r in ran) and len(ran) >= 3
    p, acts, res, note, _ = pipeline.measured_choice(outcome.problem, outcome.plan, m, build)
    ours = next(r for r in ran if r.kind == "plan")
    best = min((r for r in ran if r.kind == "jax" and r.name in BUILTIN_POLICIES + OFFLOADING_BUILTINS),
               key=lambda r: (r.measured.median_s, r.name))
    expect = best.name if best.measured.median_s < ours.measured.q1_s else "plan"
    assert p.measured is not None and p.measured.chosen == expect
    assert {r.name for r in p.measured.rows} == {r.name for r in ran}
    assert p.measured.platform == "cpu" and p.measured.steps == 5
    if expect == "plan":
        assert note is None and p.decisions == outcome.plan.decisions
    else:
        assert note is not None and expect in note
    assert _same_after_roundtrip(p)


def _row(name: str, kind: str, times: tuple[float, ...]) -> PolicyRow:
    return PolicyRow(name=name, kind=kind, code=name, predicted_step_time_s=1e-3, predicted_peak_bytes=1000,
                     measured=StepTimes(times))


def _measurement(rows: list[PolicyRow]) -> Measurement:
    return Measurement(target="t", device_kind="TPU v5 lite", platform="tpu", profile="tpu-v5e", steps=4,
                       warmup=2, budget_bytes=None, rows=tuple(rows), device_peak_note=None, rank_agreement=None)


def test_a_builtin_clearly_faster_becomes_the_plan_and_is_emitted_whole(planned) -> None:
    _, outcome, build = planned
    rows = [_row("plan", "plan", (10.0, 10.2, 10.4, 10.6)), _row("dots_saveable", "jax", (8.0, 8.1, 8.2, 8.3)),
            _row("nothing_saveable", "jax", (9.0, 9.1, 9.2, 9.3))]
    p, _, _, note, _ = pipeline.measured_choice(outcome.problem, outcome.plan, _measurement(rows), build)
    assert p.builtin == "dots_saveable" and p.measured.chosen == "dots_saveable"
    assert plan_policy(p) is jax.checkpoint_policies.dots_saveable
    assert p.predicted.peak_bytes == 1000 and p.predicted.step_time_s == 1e-3  # the row's own prediction
    assert "dots_saveable" in note and "8.1" in note
    assert _same_after_roundtrip(p)


def test_a_builtin_within_the_plans_quartiles_leaves_the_plan(planned) -> None:
    _, outcome, build = planned
    # dots_saveable's median (10.15) is under the plan's (10.3) but not under its first quartile (10.15)
    rows = [_row("plan", "plan", (10.0, 10.2, 10.4, 10.6)), _row("dots_saveable", "jax", (10.1, 10.15, 10.2))]
    p, acts, _, note, _ = pipeline.measured_choice(outcome.problem, outcome.plan, _measurement(rows), build)
    assert note is None and acts is None
    assert p.measured.chosen == "plan" and p.decisions == outcome.plan.decisions and p.builtin == outcome.plan.builtin


def test_a_plan_that_did_not_run_gives_way_to_the_fastest_that_did(planned) -> None:
    _, outcome, build = planned
    failed = PolicyRow(name="plan", kind="plan", code="plan", predicted_step_time_s=1e-3, predicted_peak_bytes=1,
                       error="RESOURCE_EXHAUSTED")
    rows = [failed, _row("nothing_saveable", "jax", (9.0, 9.1)), _row("dots_saveable", "jax", (9.5, 9.6))]
    p, _, _, note, _ = pipeline.measured_choice(outcome.problem, outcome.plan, _measurement(rows), build)
    assert p.builtin == "nothing_saveable" and "did not run" in note
    with pytest.raises(Exception, match="no policy hloopt can emit ran"):
        pipeline.measured_choice(outcome.problem, outcome.plan, _measurement([failed]), build)


def test_a_plan_file_whose_measured_choice_is_no_measured_row_is_refused(planned) -> None:
    from hloopt.errors import UserError

    _, outcome, build = planned
    rows = [_row("plan", "plan", (10.0, 10.2, 10.4, 10.6)), _row("dots_saveable", "jax", (8.0, 8.1, 8.2))]
    data = json.loads(pipeline.measured_choice(outcome.problem, outcome.plan, _measurement(rows), build)[0].to_json())
    data["measured"]["chosen"] = "offload_all_names"
    with pytest.raises(UserError, match=r"plan\.json: measured\.chosen: chosen 'offload_all_names' is none"):
        Plan.from_dict(data, origin="plan.json")
    data["measured"]["rows"][0]["median_s"] = -1
    with pytest.raises(UserError, match=r"measured\.rows\[0\]\.median_s"):
        Plan.from_dict(data, origin="plan.json")


def test_a_maxtext_preset_that_ran_fastest_is_advice_not_the_plan(planned) -> None:
    """A preset's names replayed as decisions lower to another step than the preset's, so the plan
    cannot be it: the fastest built-in JAX emits whole is taken, and the preset is named."""
    _, outcome, build = planned
    rows = [_row("plan", "plan", (10.0, 10.2, 10.4, 10.6)), _row("minimal_offloaded", "maxtext", (7.0, 7.1, 7.2)),
            _row("nothing_saveable", "jax", (9.0, 9.1, 9.2))]
    p, _, _, note, advice = pipeline.measured_choice(outcome.problem, outcome.plan, _measurement(rows), build)
    assert p.builtin == "nothing_saveable" and "nothing_saveable" in note
    assert advice is not None and "remat_policy: minimal_offloaded" in advice
    # and none when a built-in JAX emits is at least as fast
    rows[2] = _row("nothing_saveable", "jax", (6.0, 6.1, 6.2))
    assert pipeline.measured_choice(outcome.problem, outcome.plan, _measurement(rows), build)[4] is None
