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
