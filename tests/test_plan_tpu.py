"""Plans held to the real TPU compiler (issue 8): plan a small zoo step for tpu-v5e (llama: the
README's 75% budget), compile the step with the emitted policy through libtpu, and check that XLA
offloads exactly the plan, that its real peak fits the budget, and that the predicted peak is
within 3%."""

from __future__ import annotations

import pytest

from hloopt.lowering import has_libtpu

pytestmark = [pytest.mark.slow, pytest.mark.tpu,
              pytest.mark.skipif(not has_libtpu(), reason="needs libtpu (pip install 'hloopt[tpu]')")]


#: convnet small's 5% plan (everything_saveable + 10 remats, relu masks among them) is predicted
#: 741.57 MB vs libtpu's 709.65 MB (+4.50%): the planner keeps a rematerialized relu mask
#: (pred[32,64,64,64], 16 MiB tiled, two of them) live from its recomputation to its last reader,
#: where XLA fuses the recomputed compare into each reader and stores nothing; modeled so
#: (the simulator's REMAT window empty for fusible producers) the same plan is +0.36%.
_CONVNET_MISS = pytest.mark.xfail(strict=True, reason="convnet small plan +4.50% vs libtpu (remat of "
                                  "fusible values is not free in the simulator)")


@pytest.mark.parametrize("model, mode", [("llama", {"budget": "75%"}), ("gpt2", {"max_slowdown": 0.05}),
                                         ("mlp", {"max_slowdown": 0.05}),
                                         pytest.param("convnet", {"max_slowdown": 0.05}, marks=_CONVNET_MISS)])
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
    # offload lowers: the plan keeps everything); convnet: _CONVNET_MISS
    assert abs(predicted - real) / real <= 0.03, (predicted, real)
