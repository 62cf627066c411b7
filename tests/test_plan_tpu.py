"""The README's plan, held to the real TPU compiler (issue 8): plan llama small for tpu-v5e at a
75% budget, compile the step with the emitted policy through libtpu, and check that XLA offloads
exactly the plan, that its real peak fits the budget, and that the predicted peak is within 3%."""

from __future__ import annotations

import pytest

from hloopt.lowering import has_libtpu

pytestmark = [pytest.mark.slow, pytest.mark.tpu,
              pytest.mark.skipif(not has_libtpu(), reason="needs libtpu (pip install 'hloopt[tpu]')")]


def test_llama_small_plan_fits_and_predicts_libtpus_peak():
    from hloopt import pipeline
    from hloopt.devices import load_profile
    from hloopt.verify import verify

    target = "fixtures/zoo/llama.py:small"
    outcome = pipeline.plan(target, profile=load_profile("tpu-v5e"), budget="75%")
    plan = outcome.plan
    assert plan.of("offload"), "a 75% budget must move something"
    result = verify(target, plan, compile="tpu-v5e")
    assert result.ok, result.problems
    real = result.memory["peak_memory_in_bytes"]
    assert real <= plan.budget.bytes
    predicted = plan.predicted.peak_bytes
    assert abs(predicted - real) / real <= 0.03, (predicted, real)
