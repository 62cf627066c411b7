"""Plans held to the real TPU compiler (issue 8): plan a small zoo step for tpu-v5e (llama: the
README's 75% budget), compile the step with the emitted policy through libtpu, and check that XLA
offloads exactly the plan, that its real peak fits the budget, and that the predicted peak is
within 3%."""

from __future__ import annotations

import pytest

from hloopt.lowering import has_libtpu

pytestmark = [pytest.mark.slow, pytest.mark.tpu,
              pytest.mark.skipif(not has_libtpu(), reason="needs libtpu (pip install 'hloopt[tpu]')")]


@pytest.mark.parametrize("model, mode", [("llama", {"budget": "75%"}), ("gpt2", {"max_slowdown": 0.05}),
                                         ("mlp", {"max_slowdown": 0.05}),
                                         ("convnet", {"max_slowdown": 0.05})])
def test_small_plan_fits_and_predicts_libtpus_peak(model, mode):
    from hloopt import pipeline
    from hloopt.devices import load_profile
    from hloopt.verify import verify

    target = f"fixtures/zoo/{model}.py:small"
    outcome = pipeline.plan(target, profile=load_profile("tpu-v5e"), **mode)
    plan = outcome.plan
    if "budget" in mode:
        assert plan.of("offload"), "a 75% budget must move something"
    result = verify(target, plan, compile="tpu-v5e")
    assert result.ok, result.problems
    real = result.memory["peak_memory_in_bytes"]
    if plan.budget is not None:
        assert real <= plan.budget.bytes
    predicted = plan.predicted.peak_bytes
    # measured: llama -0.86%, gpt2 +1.21%, mlp +0.28% (its peak is libtpu's VMEM heap, which no
    # offload lowers: the plan keeps everything), convnet +0.36% (its rematerialized relu masks
    # are fused into their readers, never stored: Candidate.remat_fused)
    assert abs(predicted - real) / real <= 0.03, (predicted, real)
    # verify's second opinion, the memory model on the re-lowered step (no compiler): measured
    # llama -0.04% (+10% before libtpu's bf16 scan stacks were modeled), gpt2 +2.04%, mlp +0.28%;
    # convnet +27.2%: JAX's var() recomputes the normalization's x - mean through another
    # reshape chain, which XLA merges after simplification and the model keeps apart
    modeled = result.modeled_peak_bytes
    assert modeled is not None
    if model != "convnet":
        assert abs(modeled - real) / real <= 0.03, (modeled, real)
    else:
        assert modeled > real
