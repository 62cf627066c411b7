"""One accountant: the planner plans against the machine ``hloopt analyze --platform tpu`` describes.

For a TPU device and a pre-optimization module, the Problem's timeline is the profile analyze
computes (hloopt/pipeline.py, "One accountant"): replaying "everything on device" gives
analyze's TPU prediction of the same module byte for byte, on every zoo step, whether it comes
from the HLO snapshots (lowered with their own policy) or is lowered with every residual saved as
the planner lowers it. analyze's figure is itself checked against libtpu's
``peak_memory_in_bytes`` (tests/passes/test_preopt_accuracy.py, tests/passes/test_memory_accuracy.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hloopt import pipeline
from hloopt.devices import load_profile
from hloopt.problem import Decisions

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOTS = sorted((ROOT / "fixtures/hlo/zoo").glob("*.tpu.hlo"))
MODELS = ("mlp", "convnet", "gpt2", "llama", "sharded")
PROFILE = load_profile("tpu-v5e")


def _analyzed_and_problem(text: str, name: str):  # type: ignore[no-untyped-def]
    from hloopt import pipeline
    from hloopt.hlo.parser import parse_module

    an = pipeline.analyze_module(parse_module(text, filename=name), PROFILE)
    problem, smap = pipeline.build_problem(an, PROFILE)
    return an, problem, smap


def _analyze_peak(text: str, name: str) -> int:
    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module

    return analyze(parse_module(text, filename=name), platform="tpu").peak_bytes


def check_all_device_replay(text: str, name: str) -> None:
    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module
    from hloopt.simulator import lower_bound_peak, simulate

    report = analyze(parse_module(text, filename=name), platform="tpu")
    an, problem, smap = _analyzed_and_problem(text, name)
    base = simulate(problem, Decisions.all_device())
    assert base.peak_bytes == report.peak_bytes, (name, base.peak_bytes, report.peak_bytes)
    assert an.peak_bytes == report.peak_bytes
    # the steps are analyze's schedule: its entry instructions in its order, each the
    # instruction the Problem's step (first iteration of an expanded loop) stands for
    prof = report.profile
    entry_order = [i.name for i in prof.ranges.steps if i.parent is not None and i.parent.is_entry]
    labels = [problem.steps[smap.first[e]].label.split("[")[0] for e in range(len(smap.first))]
    assert labels == entry_order
    # and every step holds analyze's bytes at that instruction, less the layers of a scan's
    # stacks not written yet (the Problem holds a layer from its forward iteration on; XLA the
    # whole stack from before the forward loop): never more than analyze's, and equal throughout
    # without stacks
    entry_peak = prof.entry_timeline_bytes()
    stacks = any(r.stacked for r in an.residuals)
    for e, at in enumerate(entry_peak):
        got = [base.timeline_bytes[smap.at(e, k)] for k in range(smap.count[e])]
        assert max(got) <= at and (stacks or got[0] == at), (name, e)
    # no decision goes under the floor, and the floor is no higher than the all-device peak
    assert lower_bound_peak(problem) <= base.peak_bytes
    assert all(s.floor_bytes <= t for s, t in zip(problem.steps, base.timeline_bytes))


@pytest.mark.parametrize("path", SNAPSHOTS, ids=[p.stem for p in SNAPSHOTS])
def test_all_device_replay_is_analyzes_prediction_on_snapshots(path: Path) -> None:
    check_all_device_replay(path.read_text(), path.name)


def _lowered_for_plan(model: str, size: str) -> tuple[str, str]:
    from hloopt import pipeline
    from hloopt.hlo.printer import print_module
    from hloopt.targets import resolve

    tgt = resolve(f"fixtures/zoo/{model}.py:{size}")
    module, source = pipeline.lower_for_plan(tgt, PROFILE)
    return print_module(module), source


@pytest.mark.parametrize("model", MODELS)
def test_all_device_replay_is_analyzes_prediction_lowered_for_plan_tiny(model: str) -> None:
    """Lowered with ``everything_saveable``, as the planner lowers a JAX step."""
    text, source = _lowered_for_plan(model, "tiny")
    check_all_device_replay(text, f"<{model} {source}>")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "convnet", "gpt2", "llama"])
def test_all_device_replay_is_analyzes_prediction_lowered_for_plan_small(model: str) -> None:
    text, source = _lowered_for_plan(model, "small")
    check_all_device_replay(text, f"<{model} {source}>")


@pytest.mark.slow
def test_plans_baseline_is_analyzes_prediction() -> None:
    """``hloopt plan``'s all-on-device peak is ``hloopt analyze``'s TPU prediction of the module
    it plans (the step lowered with every residual saved)."""
    from hloopt import pipeline

    text, source = _lowered_for_plan("mlp", "tiny")
    out = pipeline.plan("fixtures/zoo/mlp.py:tiny", profile=PROFILE, budget="100%")
    assert out.plan.predicted.baseline_peak_bytes == _analyze_peak(text, source)


def test_taking_a_residual_off_takes_off_what_the_timeline_holds() -> None:
    """An instance is its buffer as analyze's profile counts it: the stored size (TPU layout), 0
    where it counts none in HBM (inside an output's allocation); taking every residual off lowers
    the replay by what they hold, down to no less than the floor."""
    from hloopt.pipeline import candidate_groups

    text, source = _lowered_for_plan("convnet", "tiny")
    an, problem, _ = _analyzed_and_problem(text, source)
    mem = an.memory
    groups = candidate_groups(an.residuals)
    checked = 0
    for c in problem.candidates:
        rs = groups[c.key]
        if len(rs) != 1 or rs[0].stacked:
            continue
        b = an.ranges.aliasing.buffer_at(rs[0].inst, ())
        want = an.ranges.size_bytes[b.id] if mem.counted_start[b.id] >= 0 else 0
        assert c.instances[0].bytes == want, c.key
        checked += want > 0
    assert checked
    from hloopt.problem import Action
    from hloopt.simulator import simulate

    off = Decisions({c.key: Action.OFFLOAD for c in problem.candidates if Action.OFFLOAD in c.allowed})
    assert simulate(problem, off).peak_bytes <= simulate(problem, Decisions.all_device()).peak_bytes


def test_a_budget_plan_is_within_the_budget_by_the_memory_models_figure_of_the_planned_step() -> None:
    """One accountant for the plan too: hloopt analyze's TPU prediction of the step lowered with a
    budget plan's policy is within the budget, or the outcome says it is not."""
    from hloopt.analysis import analyze
    from hloopt.emit import policy
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.targets import resolve
    from hloopt.units import format_bytes

    target = resolve("fixtures/zoo/gpt2.py:tiny")
    outcome = pipeline.plan(target, profile=load_profile("tpu-v5e"), budget="5.8MiB")
    plan = outcome.plan
    text = lower(target, platform="tpu", policy=policy(plan)).hlo_text
    modeled = analyze(parse_module(text), platform="tpu").peak_bytes
    assert plan.predicted.peak_bytes <= plan.budget.bytes
    assert modeled <= plan.budget.bytes or (outcome.settle_note is not None and
                                            f"{format_bytes(modeled)}" in outcome.settle_note)


def _third_party() -> list[str]:
    from tests.test_thirdparty import LIBRARY

    return list(LIBRARY)


@pytest.mark.parametrize("step", _third_party())
def test_all_device_replay_is_analyzes_prediction_on_third_party_steps(step: str) -> None:
    """Steps built from model libraries we did not write (fixtures/thirdparty/, tiny sizes),
    lowered with every residual saved as the planner lowers them: the plan's all-on-device peak is
    analyze's TPU prediction of the same module, byte for byte."""
    from hloopt.hlo.printer import print_module
    from hloopt.targets import resolve
    from tests.test_thirdparty import load

    load(step)
    tgt = resolve(f"fixtures/thirdparty/{step}.py:make", size="tiny")
    module, source = pipeline.lower_for_plan(tgt, PROFILE)
    check_all_device_replay(print_module(module), f"<{step} {source}>")


_SCAN_STEP = '''
import jax, jax.numpy as jnp

def make():
    def layer(h, w):
        w1, w2 = w
        return h + jnp.tanh(h @ w1) @ w2, None

    def loss(params, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, params)  # the program's own checkpoint
        return jnp.mean(h ** 2)

    def step(params, x):
        l, g = jax.value_and_grad(loss)(params, x)
        return l, jax.tree.map(lambda p, g: p - 1e-3 * g, params, g)

    params = (jax.ShapeDtypeStruct((4, 128, 512), jnp.float32), jax.ShapeDtypeStruct((4, 512, 128), jnp.float32))
    return step, (params, jax.ShapeDtypeStruct((8, 128, 128), jnp.float32))
'''


@pytest.fixture(scope="module")
def scan_step(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from hloopt.targets import resolve

    path = tmp_path_factory.mktemp("scan") / "scan_step.py"
    path.write_text(_SCAN_STEP)
    return resolve(f"{path}:make")


def test_the_floor_leaves_out_scanned_residual_stacks(scan_step) -> None:  # type: ignore[no-untyped-def]
    """A scanned layer's residuals live in [L, ...] stacks named by the loop's initial value and
    its in-place update, not by the loop output element the backward pass reads: the floor (the
    model's VMEM side with every residual off the device) holds none of them, so recomputing
    every value brings the replay down by the stacks' bytes (4 layers x 2 [8,128,512] stacks: with
    jax 0.10 both f32, 16 MiB; with jax 0.12 the tanh stack is bf16, as libtpu 0.0.50.1 stores it,
    12 MiB)."""
    from hloopt.problem import Action
    from hloopt.simulator import simulate

    an, problem = pipeline.analyze_target(scan_step, PROFILE)
    every = Decisions({c.key: Action.REMAT for c in problem.candidates if Action.REMAT in c.allowed})
    stacks = sum(c.bytes for c in problem.candidates if Action.REMAT in c.allowed and "[8,128,512]" in c.key)
    assert stacks >= 12 * 2**20
    saved = simulate(problem, Decisions.all_device()).peak_bytes
    assert saved - simulate(problem, every).peak_bytes >= stacks


def test_a_budget_the_model_meets_with_nothing_saved_is_planned(scan_step) -> None:  # type: ignore[no-untyped-def]
    """Where the replay's least peak is above the memory model's figure for the step with nothing
    saved (jax 0.10's lowering of this step), a budget between the two is planned (not refused);
    where they agree (jax 0.12's), a budget of that figure is. Either way the memory model puts the
    step lowered with the plan within it, and a budget under both is refused with the lower
    figure."""
    import jax

    from hloopt.analysis import analyze
    from hloopt.emit import policy
    from hloopt.errors import InfeasibleBudget
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.simulator import lower_bound_peak
    from hloopt.units import format_bytes

    nothing = analyze(parse_module(lower(scan_step, platform="tpu",
                                         policy=jax.checkpoint_policies.nothing_saveable).hlo_text),
                      platform="tpu").peak_bytes
    _, problem = pipeline.analyze_target(scan_step, PROFILE)
    replay_floor = lower_bound_peak(problem)
    assert nothing <= replay_floor, "the replay never counts less than the model with nothing saved"
    budget = (nothing + replay_floor) // 2
    outcome = pipeline.plan(scan_step, profile=PROFILE, budget=str(budget))
    modeled = analyze(parse_module(lower(scan_step, platform="tpu", policy=policy(outcome.plan)).hlo_text),
                      platform="tpu").peak_bytes
    assert modeled <= budget
    assert outcome.plan.predicted.model_peak_bytes == modeled
    assert outcome.plan.bounds.least_peak_bytes == nothing
    assert outcome.as_written_peak_bytes is not None
    with pytest.raises(InfeasibleBudget, match=f"needs at least {format_bytes(nothing)}"):
        pipeline.plan(scan_step, profile=PROFILE, budget=str(nothing - 2**20))
