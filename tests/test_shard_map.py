"""A step written with ``jax.shard_map`` (FSDP by hand: each layer all-gathers its weight shards
inside ``jax.checkpoint``, the loss is a ``pmean``), lowered as JAX lowers it by default (Shardy:
the body is a ``call`` between ``xla.sdy.GlobalToLocalShape`` and ``LocalToGlobalShape``).

Checked against hand-computed facts of the program: per device the arguments are the shards
(global / devices), the outputs the updated shards, and the residuals are what the user's policy
saves, in per-device shapes. Its peak against libtpu's is in ``tests/test_user_programs.py``.
Before these rules hloopt counted every argument at its global size (4x) and found no residual.
"""

from __future__ import annotations

from typing import Any

import pytest

D, LAYERS, B, S = 256, 3, 4, 128  # per device: batch B, sequence S, model width D, hidden 4D


def shard_map_fsdp(devices: Any = None, *, d: int = D, layers: int = LAYERS, batch: int = B,
                   seq: int = S) -> tuple[Any, tuple[Any, ...]]:
    """The step over ``devices`` (default: the first 4 JAX devices), as a user writes it; ``batch``
    is per device."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = list(devices if devices is not None else jax.devices()[:4])
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))

    def layer(x, w1, w2):  # type: ignore[no-untyped-def]
        w1 = jax.lax.all_gather(w1, "data", tiled=True)
        w2 = jax.lax.all_gather(w2, "data", tiled=True)
        h = checkpoint_name(jax.nn.gelu(x @ w1), "mlp_hidden")
        return x + h @ w2

    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

    def local_loss(ws, x):  # type: ignore[no-untyped-def]
        for w1, w2 in ws:
            x = layer(x, w1, w2)
        return jax.lax.pmean((x**2).mean(), "data")

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P("data")))
    def step(ws, x):  # type: ignore[no-untyped-def]
        value, g = jax.value_and_grad(local_loss)(ws, x)
        return value, jax.tree.map(lambda a, b: a - 1e-3 * b, ws, g)

    sh = NamedSharding(mesh, P("data"))
    ws = [(jax.ShapeDtypeStruct((d, 4 * d), jnp.float32, sharding=sh),
           jax.ShapeDtypeStruct((4 * d, d), jnp.float32, sharding=sh)) for _ in range(layers)]
    return jax.jit(step), (ws, jax.ShapeDtypeStruct((batch * n, seq, d), jnp.float32, sharding=sh))


@pytest.fixture(scope="module", params=["shardy", "gspmd"])
def module(request: Any) -> Any:
    """The step's pre-optimization module as JAX lowers it by default (Shardy) and with the GSPMD
    partitioner users can still select (``Sharding``/``SPMDFullToShardShape`` markers)."""
    import jax

    from hloopt import lowering
    from hloopt.hlo.parser import parse_module

    shardy = request.param == "shardy"
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        if not shardy:
            pytest.skip(f"jax {jax.__version__} has no GSPMD lowering to select")
        before = None
    else:
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        step, args = shard_map_fsdp()
        text = lowering.lower(step, *args, platform="tpu").hlo_text
    finally:
        if before is not None:
            jax.config.update("jax_use_shardy_partitioner", before)
    # what this test is about: the markers of a shard_map body in each partitioner's text
    assert ("xla.sdy.GlobalToLocalShape" if shardy else "SPMDFullToShardShape") in text
    return parse_module(text)


def test_arguments_and_outputs_are_counted_per_device(module: Any) -> None:
    from hloopt.analysis import analyze

    prof = analyze(module, platform="tpu").profile
    weights = LAYERS * 2 * (D * 4 * D // 4) * 4  # each device holds a quarter of every weight, f32
    assert prof.argument_bytes == weights + B * S * D * 4
    # the updated weight shards, the loss and the output tuple's index table (512-byte allocations
    # each, the latter two as each partitioner's text places them)
    assert weights < prof.output_bytes <= weights + 2 * 512


def test_residuals_are_what_the_policy_saves_inside_the_body(module: Any) -> None:
    from hloopt.passes.inline import inline_for_assignment
    from hloopt.passes.residuals import find_residuals

    rs = find_residuals(inline_for_assignment(module))
    shapes = sorted(str(r.inst.shape.dims) + r.inst.shape.element_type for r in rs.residuals)
    # dots_with_no_batch_dims_saveable saves each layer's x @ w1 ([B, S, 4D]; gelu and h are
    # recomputed from it) and h @ w2's input x is each layer's input: the step's x (an argument,
    # not a residual) and the outputs of layers 1..L-1; (x**2).mean() saves 2x... as x itself.
    # The all-gathered weights are not dots: recomputed (gathered again) in the backward pass.
    expected = sorted([str((B, S, 4 * D)) + "f32"] * LAYERS + [str((B, S, D)) + "f32"] * LAYERS)
    assert shapes == expected
    assert not any(r.inst.opcode == "all-gather" for r in rs.residuals)
