"""hloopt.analysis: what analyze tells the user about the step itself (``step_notes``)."""

from __future__ import annotations

from typing import Any

import pytest

from hloopt.analysis import analyze, step_notes, undonated_bytes
from hloopt.hlo.parser import parse_module


def _step(donate: tuple[int, ...]) -> Any:
    """An SGD-with-momentum step: w f32[256,256] and its momentum m (256 KiB each) come back
    updated, with a scalar loss; ``donate`` goes to ``jax.jit``."""
    import jax
    import jax.numpy as jnp

    def step(w, m, x):  # type: ignore[no-untyped-def]
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        m = 0.9 * m + g
        return w - 0.1 * m, m, loss

    from hloopt.lowering import lower

    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    return parse_module(lower(jax.jit(step, donate_argnums=donate), w, w, x, platform="cpu").hlo_text)


@pytest.mark.parametrize("donate, expected", [((), 2 * 256 * 256 * 4), ((0,), 256 * 256 * 4), ((0, 1), 0)])
def test_outputs_that_could_reuse_undonated_arguments_are_counted_and_named(donate: tuple[int, ...],
                                                                           expected: int) -> None:
    # the new w and m have the shape and type of the arguments w and m; the loss and x match
    # nothing. Donated arguments are the outputs' own buffers (input_output_alias)
    report = analyze(_step(donate))
    assert undonated_bytes(report.profile) == expected
    notes = [n for n in report.notes if "donate" in n]
    if expected:
        assert notes == step_notes(report.profile) and len(notes) == 1
        assert notes[0].startswith(f"{expected // 1024} KiB of the step's outputs") and "donate_argnums" in notes[0]
    else:
        assert notes == []


@pytest.mark.slow
@pytest.mark.tpu
def test_a_host_heap_larger_than_the_devices_temporaries_is_the_figure_libtpu_reports() -> None:
    """Zoo Llama small with ``offload_dot_with_no_batch_dims``: the projections it offloads
    inside the scan outgrow the device's temporaries at the peak, and libtpu's
    ``peak_memory_in_bytes`` is its fixed bytes plus that host heap. The TPU prediction models
    the device and says so, with the figure libtpu will report; with nothing offloaded it says
    nothing of the kind."""
    import re

    import jax

    from hloopt.lowering import has_libtpu, lower
    from hloopt.targets import resolve

    if not has_libtpu():
        pytest.skip("needs libtpu (pip install 'hloopt[tpu]')")
    tgt = resolve("fixtures/zoo/llama.py:small")
    offload = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    low = lower(tgt, platform="tpu", policy=offload, compile="tpu-v5e")
    assert low.memory is not None
    report = analyze(parse_module(low.hlo_text), platform="tpu")
    notes = [n for n in report.notes if "outgrow the device's temporaries" in n]
    assert len(notes) == 1, report.notes
    expected = int(re.search(r"near ([\d,]+) B", notes[0]).group(1).replace(",", ""))  # type: ignore[union-attr]
    real = low.memory["peak_memory_in_bytes"]
    assert low.memory["host_temp_size_in_bytes"] > 0
    assert abs(expected - real) <= 1e-4 * real, (expected, real)
    assert report.peak_bytes < real  # the device's need, below libtpu's figure
    plain = lower(tgt, platform="tpu", policy=jax.checkpoint_policies.nothing_saveable)
    assert not [n for n in analyze(parse_module(plain.hlo_text), platform="tpu").notes if "outgrow" in n]
