"""Our plan is never dominated by a JAX built-in policy or a MaxText preset, on the zoo models.

For each model and device the pipeline builds the Problem (``everything_saveable`` lowering,
names by re-lowering); every expressible anchor is replayed by the simulator. At a budget equal
to an anchor's own peak our plan must fit and be no slower than the anchor (the anchor itself
is a plan within that budget); at the 75%-of-the-way-from-floor-to-peak budget, no anchor may
have both a lower peak and a lower step time than our plan.
"""

from __future__ import annotations

import pytest

from hloopt.problem import Action, Decisions
from tests.tiers import ci_sample

pytestmark = pytest.mark.slow

MODELS = ("mlp", "convnet", "gpt2", "llama", "sharded")
DEVICES = ("tpu-v5e", "h100-sxm")
TOL = 1e-9

_problems: dict[tuple[str, str, str], object] = {}


def _problem(model: str, size: str, device: str):
    key = (model, size, device)
    if key not in _problems:
        from hloopt import pipeline
        from hloopt.devices import load_profile
        from hloopt.targets import resolve

        prof = load_profile(device)
        tgt = resolve(f"fixtures/zoo/{model}.py", size=size)
        module, source = pipeline.lower_for_plan(tgt, prof)
        names = pipeline._names_for(tgt, module, prof, platform=None)
        an = pipeline.analyze_module(module, prof, source=source, names=names)
        _problems[key] = pipeline.build_problem(an, prof)[0]
    return _problems[key]


def _check_never_dominated(problem) -> int:
    from hloopt.pipeline import run_anchors
    from hloopt.search import search
    from hloopt.simulator import lower_bound_peak, simulate

    anchors = run_anchors(problem)
    assert anchors[0].name == "everything_saveable"
    floor = lower_bound_peak(problem)
    base = simulate(problem, Decisions.all_device())
    budgets = {max(a.peak_bytes, floor) for a in anchors}
    budgets.add(int(floor + 0.75 * (base.peak_bytes - floor)))
    for budget in sorted(budgets):
        sr = search(problem, budget_bytes=budget, time_limit_s=10)
        replay = simulate(problem, sr.plan.decisions)
        assert replay.peak_bytes == sr.plan.peak_bytes <= budget
        for a in anchors:
            if a.peak_bytes <= budget:  # the anchor is itself a plan within this budget
                assert replay.step_time_s <= a.step_time_s * (1 + TOL), (a.name, budget)
            assert not (a.peak_bytes < replay.peak_bytes
                        and a.step_time_s < replay.step_time_s * (1 - TOL)), (a.name, budget)
    return len(budgets)


@pytest.mark.parametrize(("model", "device"), ci_sample(
    [(m, d) for m in MODELS for d in DEVICES], [("gpt2", "tpu-v5e"), ("llama", "tpu-v5e"), ("mlp", "h100-sxm")]))
def test_tiny_plan_never_dominated(model, device):
    problem = _problem(model, "tiny", device)
    assert _check_never_dominated(problem) >= 1


def test_anchor_decisions_follow_the_policies():
    """everything_saveable keeps all, nothing_saveable recomputes every governed candidate,
    offload_all_names offloads exactly the named ones (by hand from anchors' definitions)."""
    from hloopt.anchors import ANCHORS

    problem = _problem("llama", "tiny", "tpu-v5e")
    by = {a.name: a.decisions(problem) for a in ANCHORS}
    assert by["everything_saveable"].actions == {}
    governed = [c for c in problem.candidates if Action.REMAT in c.allowed]
    assert governed
    assert set(by["nothing_saveable"].of(Action.REMAT)) == {c.key for c in governed}
    offl = set(by["offload_all_names"].of(Action.OFFLOAD))
    assert offl == {c.key for c in problem.candidates if c.name and Action.OFFLOAD in c.allowed}
    assert by["minimal"].action("name:mlpwi_0") == Action.DEVICE  # minimal saves projections
    assert by["full"].action("name:mlpwi_0") == Action.REMAT
    # the scan carry is saved by the scan itself whatever the policy says
    assert by["full"].action("name:decoder_layer_input") == Action.DEVICE


def test_small_llama_never_dominated():
    problem = _problem("llama", "small", "tpu-v5e")
    assert _check_never_dominated(problem) >= 2


def test_offloading_every_name_applies_only_where_the_program_names_values() -> None:
    """``offload_all_names`` over a program without a ``checkpoint_name`` offloads nothing (it is
    ``nothing_saveable``): it is offered where some residual is named (the zoo Llama), not where
    none is (the zoo convnet)."""
    from hloopt.anchors import ANCHORS, expressible

    anchor = next(a for a in ANCHORS if a.name == "offload_all_names")
    llama, convnet = _problem("llama", "tiny", "tpu-v5e"), _problem("convnet", "tiny", "tpu-v5e")
    assert any(c.name for c in llama.candidates) and expressible(anchor, llama)
    assert not any(c.name for c in convnet.candidates) and not expressible(anchor, convnet)
