"""One time model: the planner's step time for a policy is the cost model's time for the step
lowered with that policy.

The Problem is built from the step lowered with every residual saved. A policy's time is that
module's modeled compute plus, per recomputed residual, what recomputing it re-runs net of what
keeping it cost (hloopt/pipeline.py ``_recompute_seconds`` and ``_stack_keep_s``). The independent
figure is :class:`~hloopt.passes.cost.CostAnalysis` of the module JAX lowers with the policy
itself, whose recomputation and missing stacks are in its HLO. Cases: layers under ``lax.scan``
(the zoo Llama), unrolled layers (the zoo GPT-2), and transformers' Flax BERT with dropout (a
recomputed mask re-runs the threefry hash of its key).
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from hloopt.anchors import ANCHORS
from hloopt.devices import load_profile

PLAIN = dataclasses.replace(load_profile("tpu-v5e"), compute_efficiency={})


@pytest.mark.parametrize("spec,size", [
    ("fixtures/zoo/llama.py:small", None),
    ("fixtures/zoo/gpt2.py:tiny", None),
    ("fixtures/thirdparty/hf_bert.py:make", "mid"),
])
def test_a_policys_planned_time_is_the_time_of_the_step_lowered_with_it(spec: str, size: str | None) -> None:
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.passes.cost import CostAnalysis
    from hloopt.passes.inline import inline_for_assignment
    from hloopt.pipeline import analyze_target
    from hloopt.problem import Decisions
    from hloopt.simulator import simulate
    from hloopt.targets import resolve

    if "thirdparty" in spec:
        from tests.test_thirdparty import load

        load(spec.split("/")[-1].split(".py")[0])  # its library, or the skip test_thirdparty.py gives
    target = resolve(spec, size=size)

    def lowered_seconds(policy: object) -> float:
        step, args, kwargs = target.with_policy(policy)
        module = inline_for_assignment(parse_module(lower(step, *args, platform="tpu", **kwargs).hlo_text))
        return CostAnalysis(profile=PLAIN).run(module).totals.seconds

    _, problem = analyze_target(target, PLAIN)
    anchors = {a.name: a for a in ANCHORS}
    everything = simulate(problem, Decisions.all_device()).step_time_s
    assert everything == pytest.approx(lowered_seconds(jax.checkpoint_policies.everything_saveable), rel=0.01)
    for name, policy in (("nothing_saveable", jax.checkpoint_policies.nothing_saveable),
                         ("dots_saveable", jax.checkpoint_policies.dots_saveable)):
        planned = simulate(problem, anchors[name].decisions(problem)).step_time_s
        lowered = lowered_seconds(policy)
        assert planned == pytest.approx(lowered, rel=0.05), (name, planned, lowered)
        # the recomputation is the step's, not noise: full remat differs from all-saved by more
        if name == "nothing_saveable":
            assert abs(lowered - everything) > 0.05 * everything
