"""Plans held to the real TPU compiler (issue 8): plan a small zoo step for tpu-v5e (llama: the
README's 75% budget), compile the step with the emitted policy through libtpu, and check that XLA
offloads exactly the plan, that its real peak fits the budget, and that the predicted peak is
within 3%."""

from __future__ import annotations

import pytest

from hloopt.lowering import has_libtpu
from tests.tiers import ci_sample

pytestmark = [pytest.mark.slow, pytest.mark.tpu,
              pytest.mark.skipif(not has_libtpu(), reason="needs libtpu (pip install 'hloopt[tpu]')")]


@pytest.mark.parametrize("model, mode", ci_sample([
    # 90%: the memory model's floor for llama small is 1.88 GiB (its peak is where no residual is
    # live), above 75% of its 2.32 GiB all-saved step; the linear replay's 1.63 GiB is not reached
    pytest.param("llama", {"budget": "90%"}, marks=pytest.mark.xfail(strict=True, reason=(
        "rules interact: with the whole plan checkpoint_name 'out_proj' annotates 0 values (8 alone) "
        "and the mul f32[4,512,512] rule 40 of 48; verify reports the count mismatch"))),
    # gpt2: its rules no longer interact (verify counts each rule's annotations as planned) since
    # the list schedule sees libtpu's fusion
    ("gpt2", {"max_slowdown": 0.05}),
    ("mlp", {"max_slowdown": 0.05}),
    pytest.param("convnet", {"max_slowdown": 0.05}, marks=pytest.mark.xfail(strict=True, reason=(
        "rules interact: with the whole plan the broadcast_in_dim f32[1,1,1,64] rule annotates 8 values "
        "(10 alone); verify reports the mismatch. The plan's replay is -6.7% of libtpu (382,487,040 B "
        "vs 409,754,112 B; +0.36% while the model fused the max pool's input, -15% on the all-saved "
        "step, which is now -2.5%)"))),
], [("mlp", {"max_slowdown": 0.05})]))
def test_small_plan_fits_and_predicts_libtpus_peak(model, mode):
    from hloopt import pipeline
    from hloopt.devices import load_profile
    from hloopt.verify import verify

    target = f"fixtures/zoo/{model}.py:small"
    outcome = pipeline.plan(target, profile=load_profile("tpu-v5e"), **mode)
    plan = outcome.plan
    if "budget" in mode:
        assert plan.of("offload") or plan.of("remat"), "a 90% budget must move something"
    result = verify(target, plan, compile="tpu-v5e")
    assert result.ok, result.problems
    real = result.memory["peak_memory_in_bytes"]
    if plan.budget is not None:
        assert real <= plan.budget.bytes
    predicted = plan.predicted.peak_bytes
    # measured: llama -0.86%, gpt2 +1.21%, mlp +0.28% (its peak is libtpu's VMEM heap, which no
    # offload lowers: the plan keeps everything), convnet -6.7% (xfail above)
    assert abs(predicted - real) / real <= 0.03, (predicted, real)
    # verify's second opinion, the memory model on the re-lowered step (no compiler): measured
    # llama -0.04% (+10% before libtpu's bf16 scan stacks were modeled), gpt2 +2.04%, mlp +0.28%;
    # convnet's is not held to it: JAX's var() recomputes the normalization's x - mean through
    # another reshape chain, which XLA merges after simplification and the model keeps apart
    modeled = result.modeled_peak_bytes
    assert modeled is not None
    if model != "convnet":
        assert abs(modeled - real) / real <= 0.03, (modeled, real)


#: measured on a TPU v5e (libtpu 0.0.42.1), convnet small, medians of 20 steps
#: (bench/results/2026-12-07-tpu-v5e/5-convnet-70pct.results.json)
CONVNET_V5E_MEDIAN_S = {"dots_saveable": 3.775e-3, "dots_with_no_batch_dims_saveable": 3.572e-3,
                        "nothing_saveable": 3.557e-3}


@pytest.mark.full
def test_judged_by_the_compiled_roofline_the_plan_is_a_policy_the_v5e_ran_faster() -> None:
    """Convnet small at 70%: by FLOPs the plan is ``dots_saveable`` (the fewest of the policies
    within the budget), which ran 6% slower on a v5e than recomputing everything; judged by the
    roofline of what libtpu compiles (``--judge compiled``), the plan is a policy the v5e ran
    faster, the fastest by that roofline of those libtpu's peak puts within the budget."""
    from hloopt import pipeline
    from hloopt.devices import load_profile

    target, profile = "fixtures/zoo/convnet.py:small", load_profile("tpu-v5e")
    by_flops = pipeline.plan(target, profile=profile, budget="70%")
    assert by_flops.plan.builtin == "dots_saveable"
    by_compile = pipeline.plan(target, profile=profile, budget="70%", judge="compiled")
    chosen = by_compile.plan.builtin
    assert chosen is not None
    assert CONVNET_V5E_MEDIAN_S[chosen] < CONVNET_V5E_MEDIAN_S["dots_saveable"]
    budget = by_compile.plan.budget.bytes
    fitting = {name: seconds for name, peak, seconds in by_compile.lowered_rows if peak <= budget}
    assert fitting[f"jax.checkpoint_policies.{chosen}"] == min(fitting.values())


def test_an_offloading_builtin_that_beats_the_searched_rules_is_the_plan_and_fits_as_libtpu_compiles_it() -> None:
    """Zoo Llama small for a TPU v6e at 70% of its all-saved peak: JAX's
    ``offload_dot_with_no_batch_dims`` keeps the q/k/v projections before the rotary embedding,
    which no rule over the all-saved step's residuals selects; lowered and judged it needs fewer
    FLOPs than the searched rules and no longer a step, so it is the plan. The plan's policy is
    that built-in (the HLO JAX emits with both is the same), ``verify`` passes, and libtpu
    compiles the step for v6e within the budget, with bytes on the host."""
    import jax

    from hloopt import pipeline
    from hloopt.devices import load_profile
    from hloopt.emit import policy
    from hloopt.lowering import lower
    from hloopt.targets import resolve
    from hloopt.verify import offload_annotations, verify

    target = "fixtures/zoo/llama.py:small"
    outcome = pipeline.plan(target, profile=load_profile("tpu-v6e"), budget="70%")
    plan = outcome.plan
    assert plan.builtin == "offload_dot_with_no_batch_dims", outcome.choice_note
    searched = outcome.judged_rows[0][1]
    assert outcome.judged_rows[0][0] == "hloopt's searched rules"
    assert plan.predicted.step_time_s <= searched.step_time_s
    tgt = resolve(target)
    ours = offload_annotations(lower(tgt, platform="tpu", policy=policy(plan)).hlo_text)
    jaxs = offload_annotations(lower(tgt, platform="tpu", policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host")).hlo_text)
    assert sorted((a.shape, a.count) for a in ours) == sorted((a.shape, a.count) for a in jaxs) != []
    v = verify(tgt, plan, compile="tpu-v6e")
    assert v.ok, v.problems
    assert v.memory is not None and v.memory["host_temp_size_in_bytes"] > 0
    assert v.memory["peak_memory_in_bytes"] <= plan.budget.bytes


#: the policies the flops-objective test compiles beside the plan in CI: those that fit zoo Llama
#: small's 80% budget with the fewest FLOPs (libtpu 0.0.42: offload_dot_with_no_batch_dims 248.39
#: GFLOP, 1.64 GB; dots_with_no_batch_dims_saveable 248.40, 1.80 GB) and the one with fewer still
#: that is over it (dots_saveable 246.35, 2.07 GB). The full tier compiles every anchor a policy
#: expresses.
FLOPS_CI_ANCHORS = ("offload_dot_with_no_batch_dims", "dots_with_no_batch_dims_saveable", "dots_saveable")
FLOPS_ALL_ANCHORS = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                     "offload_dot_with_no_batch_dims", "offload_all_names", "minimal", "minimal_offloaded")


@pytest.mark.parametrize("anchors", ci_sample([pytest.param(FLOPS_CI_ANCHORS, id="ci-anchors"),
                                               pytest.param(FLOPS_ALL_ANCHORS, id="every-anchor")],
                                              [FLOPS_CI_ANCHORS]))
def test_the_flops_objective_plan_fits_with_no_more_flops_than_any_policy_that_fits(anchors: tuple[str, ...]) -> None:
    """``hloopt plan --objective flops``, zoo Llama small for a TPU v5e at 80% of its all-saved
    peak: libtpu compiles the step with the plan's policy within the budget, and no JAX built-in
    or MaxText preset that libtpu compiles within the same budget needs fewer FLOPs
    (``cost_analysis``). Offloading is what gets it there: the plan moves bytes to host memory,
    which the time objective on v5e's 15 GB/s link does not."""
    from hloopt import pipeline
    from hloopt.anchors import ANCHORS, policy_object
    from hloopt.devices import load_profile
    from hloopt.emit import policy
    from hloopt.lowering import lower
    from hloopt.targets import resolve

    target = "fixtures/zoo/llama.py:small"
    outcome = pipeline.plan(target, profile=load_profile("tpu-v5e"), budget="80%", objective="flops")
    plan = outcome.plan
    assert plan.objective == "flops" and plan.of("offload")
    budget = plan.budget.bytes
    tgt = resolve(target)
    names = frozenset(c.name for c in outcome.problem.candidates if c.name)

    def compiled(pol: object) -> tuple[int, float, int]:
        low = lower(tgt, platform="tpu", policy=pol, compile="tpu-v5e")
        assert low.memory is not None and low.cost is not None
        return (int(low.memory["peak_memory_in_bytes"]), float(low.cost["flops"]),
                int(low.memory["host_temp_size_in_bytes"]))

    peak, flops, host = compiled(policy(plan))
    rows = {a.name: compiled(policy_object(a, names)) for a in ANCHORS if a.name in anchors}
    report = f"plan: {peak} B, {flops:.6g} FLOP, {host} B on host; " + "; ".join(
        f"{n}: {p} B, {f:.6g} FLOP, {h} B on host" for n, (p, f, h) in rows.items())
    print(report)
    assert peak <= budget and host > 0, report
    fitting = {n: f for n, (p, f, _) in rows.items() if p <= budget}
    assert fitting, report
    assert flops <= min(fitting.values()) * (1 + 1e-6), report
