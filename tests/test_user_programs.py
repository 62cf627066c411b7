"""Training steps written the way users write them, outside this repository's zoo and third-party
set, each compiled by libtpu for v5e: the pre-optimization prediction within 5% of libtpu's
``peak_memory_in_bytes`` and the compiled module's figure within 0.5% of it (issue "One memory
model", items 3 and 4). Each factory is what a user would pass as ``file.py:make``.

- :func:`linen_named_bf16`: flax linen, bf16 compute, ``nn.remat(policy=save_only_these_names)``
  with ``checkpoint_name`` on q/k/v (the user's own policy), a Python loop over 4 blocks.
- :func:`nnx_scan`: flax NNX, blocks stacked with ``nnx.vmap``, run with ``nnx.scan`` over
  ``nnx.remat``, ``nnx.Optimizer`` (split/merge state passing).
- :func:`equinox_checkpoint`: Equinox, ``eqx.filter_checkpoint`` per block, ``eqx.filter_jit`` step.
- :func:`sharded_mesh`: plain JAX over a 2x2 v5e mesh (data x model), weights and batch sharded
  with ``NamedSharding``, ``jax.checkpoint`` with the user's policy.
- :func:`mlp_adamw`: a plain f32 MLP stack, ``jax.checkpoint(policy=dots_saveable)``, ``optax.adamw``.
- :func:`flash_attention`: bf16 transformer layers calling the Pallas TPU flash-attention kernel
  (``jax.experimental.pallas.ops.tpu``) under ``jax.checkpoint`` with a dots policy.
- :func:`shard_map_fsdp`: FSDP written by hand with ``jax.shard_map`` over the 4 chips (weights
  all-gathered per layer inside ``jax.checkpoint``), from ``tests/test_shard_map.py``.
- :func:`grad_accumulation`: gradients summed over microbatches by ``lax.scan`` around
  ``jax.grad``, per-layer ``jax.checkpoint``, momentum SGD by hand.

Measured with libtpu 0.0.42.1, jax 0.10.2 (2026-12-08): predicted vs libtpu -1.7% (sharded) to +2.1%
(NNX), the MLP with AdamW -0.0%; strict xfails: linen +5.8%, flash attention
-10.0% (what libtpu's memory-space assignment keeps in VMEM); compiled modules exact.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.tiers import ci_sample

pytestmark = [pytest.mark.slow, pytest.mark.tpu]


def linen_named_bf16() -> tuple[Any, tuple[Any, ...]]:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.ad_checkpoint import checkpoint_name

    class Block(nn.Module):
        d: int

        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
            q = checkpoint_name(nn.Dense(self.d, dtype=jnp.bfloat16, name="q")(h), "query")
            k = checkpoint_name(nn.Dense(self.d, dtype=jnp.bfloat16, name="k")(h), "key")
            v = checkpoint_name(nn.Dense(self.d, dtype=jnp.bfloat16, name="v")(h), "value")
            a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / 16.0, axis=-1)
            o = checkpoint_name(jnp.einsum("bts,bsd->btd", a, v), "attn_out")
            x = x + nn.Dense(self.d, dtype=jnp.bfloat16)(o)
            h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
            h = checkpoint_name(nn.gelu(nn.Dense(4 * self.d, dtype=jnp.bfloat16)(h)), "mlp_hidden")
            return x + nn.Dense(self.d, dtype=jnp.bfloat16)(h)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tok):  # type: ignore[no-untyped-def]
            x = nn.Embed(2048, 384)(tok)
            remat = nn.remat(Block, policy=jax.checkpoint_policies.save_only_these_names("query", "key", "value"))
            for _ in range(4):
                x = remat(384)(x)
            return nn.Dense(2048)(nn.LayerNorm()(x))

    m = Model()
    params = jax.eval_shape(lambda: m.init(jax.random.PRNGKey(0), jnp.zeros((8, 512), jnp.int32)))
    opt = optax.adam(1e-3)

    def step(params, st, tok):  # type: ignore[no-untyped-def]
        def loss(p):  # type: ignore[no-untyped-def]
            return optax.softmax_cross_entropy_with_integer_labels(m.apply(p, tok), tok).mean()

        value, g = jax.value_and_grad(loss)(params)
        u, st = opt.update(g, st)
        return optax.apply_updates(params, u), st, value

    return step, (params, jax.eval_shape(opt.init, params), jax.ShapeDtypeStruct((8, 512), jnp.int32))


def nnx_scan() -> tuple[Any, tuple[Any, ...]]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    d, layers = 256, 4

    class Block(nnx.Module):
        def __init__(self, rngs):  # type: ignore[no-untyped-def]
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x):  # type: ignore[no-untyped-def]
            return x + self.down(jax.nn.gelu(self.up(self.ln(x))))

    class Model(nnx.Module):
        def __init__(self, rngs):  # type: ignore[no-untyped-def]
            self.emb = nnx.Embed(1024, d, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):  # type: ignore[no-untyped-def]
                return Block(rngs)

            self.blocks = blocks(rngs)
            self.head = nnx.Linear(d, 1024, rngs=rngs)

        def __call__(self, tok):  # type: ignore[no-untyped-def]
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def body(x, blk):  # type: ignore[no-untyped-def]
                return blk(x)

            return self.head(body(self.emb(tok), self.blocks))

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))

    def step(state, tok):  # type: ignore[no-untyped-def]
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(m):  # type: ignore[no-untyped-def]
            return optax.softmax_cross_entropy_with_integer_labels(m(tok), tok).mean()

        value, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return value, nnx.state((model, opt))

    return step, (state, jnp.zeros((8, 256), jnp.int32))


def equinox_checkpoint() -> tuple[Any, tuple[Any, ...]]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    d = 256

    class Block(eqx.Module):
        ln: eqx.nn.LayerNorm
        l1: eqx.nn.Linear
        l2: eqx.nn.Linear

        def __init__(self, key):  # type: ignore[no-untyped-def]
            k1, k2 = jax.random.split(key)
            self.ln = eqx.nn.LayerNorm(d)
            self.l1 = eqx.nn.Linear(d, 4 * d, key=k1)
            self.l2 = eqx.nn.Linear(4 * d, d, key=k2)

        def __call__(self, x):  # type: ignore[no-untyped-def]
            h = jax.nn.relu(jax.vmap(self.l1)(jax.vmap(self.ln)(x)))
            return x + jax.vmap(self.l2)(h)

    class Model(eqx.Module):
        blocks: list
        out: eqx.nn.Linear

        def __init__(self, key):  # type: ignore[no-untyped-def]
            ks = jax.random.split(key, 5)
            self.blocks = [Block(k) for k in ks[:4]]
            self.out = eqx.nn.Linear(d, 10, key=ks[-1])

        def __call__(self, x):  # type: ignore[no-untyped-def]
            for b in self.blocks:
                x = eqx.filter_checkpoint(b)(x)
            return jax.vmap(self.out)(x).mean(0)

    model = Model(jax.random.PRNGKey(0))
    opt = optax.adam(1e-3)

    @eqx.filter_jit
    def step(model, opt_state, x, y):  # type: ignore[no-untyped-def]
        def loss(m):  # type: ignore[no-untyped-def]
            return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(x), y).mean()

        value, g = eqx.filter_value_and_grad(loss)(model)
        upd, opt_state = opt.update(g, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, upd), opt_state, value

    return step, (model, opt.init(eqx.filter(model, eqx.is_array)), jnp.zeros((8, 128, d)), jnp.zeros((8,), jnp.int32))


def sharded_mesh() -> tuple[Any, tuple[Any, ...]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.ad_checkpoint import checkpoint_name
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    d = 1024
    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = Mesh(np.array(topo.devices).reshape(2, 2), ("data", "model"))

    def layer(x, w1, w2):  # type: ignore[no-untyped-def]
        return x + checkpoint_name(jnp.tanh(x @ w1), "hidden") @ w2

    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("hidden"))

    def loss(ws, x):  # type: ignore[no-untyped-def]
        for w1, w2 in ws:
            x = layer(x, w1, w2)
        return (x**2).mean()

    def step(ws, x):  # type: ignore[no-untyped-def]
        value, g = jax.value_and_grad(loss)(ws, x)
        return value, jax.tree.map(lambda a, b: a - 1e-3 * b, ws, g)

    up, down = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None))
    ws = [(jax.ShapeDtypeStruct((d, 4 * d), jnp.float32, sharding=up),
           jax.ShapeDtypeStruct((4 * d, d), jnp.float32, sharding=down)) for _ in range(6)]
    return jax.jit(step), (ws, jax.ShapeDtypeStruct((64, d), jnp.float32, sharding=NamedSharding(mesh, P("data", None))))


def grad_accumulation() -> tuple[Any, tuple[Any, ...]]:
    """Gradients summed over 4 microbatches by ``lax.scan``, each layer under ``jax.checkpoint``
    with ``dots_with_no_batch_dims_saveable`` and a named matmul, momentum SGD written by hand.
    libtpu zeroes the scan's gradient carry with ``AllocateBuffer`` calls the buffer assigner
    places by its own post order, not the schedule's (-2.9% read off the compiled module before)."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    micro, b, t, d, layers = 4, 4, 512, 768, 8

    def layer(p, x):  # type: ignore[no-untyped-def]
        return x + jax.nn.gelu(checkpoint_name(x @ p["w1"], "up")) @ p["w2"]

    def loss(params, x, y):  # type: ignore[no-untyped-def]
        for p in params:
            x = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)(p, x)
        return jnp.mean((x - y) ** 2)

    def step(params, mom, xs, ys):  # type: ignore[no-untyped-def]
        def one(g, xy):  # type: ignore[no-untyped-def]
            return jax.tree.map(jnp.add, g, jax.grad(loss)(params, *xy)), None

        g, _ = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, params), (xs, ys))
        mom = jax.tree.map(lambda m, gg: 0.9 * m + gg / micro, mom, g)
        return jax.tree.map(lambda p, m: p - 1e-2 * m, params, mom), mom

    params = [{"w1": jax.ShapeDtypeStruct((d, 4 * d), jnp.float32),
               "w2": jax.ShapeDtypeStruct((4 * d, d), jnp.float32)} for _ in range(layers)]
    xs = jax.ShapeDtypeStruct((micro, b, t, d), jnp.float32)
    return step, (params, params, xs, xs)


def mlp_adamw() -> tuple[Any, tuple[Any, ...]]:
    import jax
    import jax.numpy as jnp
    import optax

    d, layers = 1024, 4

    def mlp(x, w1, w2):  # type: ignore[no-untyped-def]
        return x + jax.nn.relu(x @ w1) @ w2

    layer = jax.checkpoint(mlp, policy=jax.checkpoint_policies.dots_saveable)

    def loss(ws, x):  # type: ignore[no-untyped-def]
        for w1, w2 in ws:
            x = layer(x, w1, w2)
        return (x**2).mean()

    opt = optax.adamw(1e-3)

    def step(ws, st, x):  # type: ignore[no-untyped-def]
        value, g = jax.value_and_grad(loss)(ws, x)
        u, st = opt.update(g, st, ws)
        return optax.apply_updates(ws, u), st, value

    ws = [(jax.ShapeDtypeStruct((d, 4 * d), jnp.float32), jax.ShapeDtypeStruct((4 * d, d), jnp.float32))
          for _ in range(layers)]
    return jax.jit(step), (ws, jax.eval_shape(opt.init, ws), jax.ShapeDtypeStruct((8, 512, d), jnp.float32))


def flash_attention() -> tuple[Any, tuple[Any, ...]]:
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention as attend

    b, h, s, dh, layers = 4, 8, 1024, 128, 4
    d = h * dh

    def heads(t):  # type: ignore[no-untyped-def]
        return t.reshape(b, s, h, dh).transpose(0, 2, 1, 3)

    def layer(x, wq, wk, wv, wo, w1, w2):  # type: ignore[no-untyped-def]
        a = attend(heads(x @ wq), heads(x @ wk), heads(x @ wv), causal=True)
        x = x + checkpoint_name(a.transpose(0, 2, 1, 3).reshape(b, s, d), "attn") @ wo
        return x + jax.nn.gelu(x @ w1) @ w2

    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

    def loss(ws, x):  # type: ignore[no-untyped-def]
        for w in ws:
            x = layer(x, *w)
        return (x.astype(jnp.float32) ** 2).mean()

    def step(ws, x):  # type: ignore[no-untyped-def]
        value, g = jax.value_and_grad(loss)(ws, x)
        return value, jax.tree.map(lambda p, q: p - 1e-3 * q, ws, g)

    def w(*shape: int) -> Any:
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    ws = [(w(d, d), w(d, d), w(d, d), w(d, d), w(d, 4 * d), w(4 * d, d)) for _ in range(layers)]
    return jax.jit(step), (ws, w(b, s, d))


def shard_map_fsdp() -> tuple[Any, tuple[Any, ...]]:
    from jax.experimental import topologies

    from tests.test_shard_map import shard_map_fsdp as program

    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    return program(topo.devices, d=512, layers=4, batch=16, seq=256)


#: at the HBM peak (the last layer's forward flash-attention call) libtpu's VMEM holds 66 of its
#: 112 MiB; the earlier layers' saved x @ w1 (32 MiB each) are evicted to HBM
FLASH_VMEM = ("-10.0% (-6.0% until libtpu's output fusions were modeled, 2026-12-08): Pallas flash attention in "
              "bf16; at the HBM peak libtpu's memory-space assignment holds 66 MiB in VMEM, the model 112 MiB "
              "(the earlier layers' saved x @ w1 go to HBM)")
#: libtpu keeps q/k/v of the last two blocks in VMEM through the backward and evicts the first
#: two's; its VMEM heap peaks at 95 MiB where the model fills the 112 MiB MSA may use
LINEN_VMEM = ("+5.8%: the peak is libtpu's VMEM heap (95 MiB); the model fills the 112 MiB memory-space "
              "assignment may use, where MSA evicts long-lived residuals and leaves room unused")

PROGRAMS = {"linen_named_bf16": linen_named_bf16, "nnx_scan": nnx_scan, "equinox_checkpoint": equinox_checkpoint,
            "sharded_mesh": sharded_mesh, "shard_map_fsdp": shard_map_fsdp, "flash_attention": flash_attention,
            "mlp_adamw": mlp_adamw, "grad_accumulation": grad_accumulation}


def _lowered(name: str, compile: str | None = None):  # type: ignore[no-untyped-def]
    """The step ``name`` lowered for TPU (and compiled by libtpu with ``compile``), once per
    module run: the prediction and the compiled-module tests read the same compile."""
    from hloopt import lowering

    if not lowering.has_libtpu():
        pytest.skip("needs libtpu (pip install 'hloopt[tpu]')")
    return _lower_once(name, compile)


@functools.lru_cache(maxsize=None)
def _lower_once(name: str, compile: str | None):  # type: ignore[no-untyped-def]
    from hloopt import lowering
    from hloopt.frameworks import jittable

    step, args = PROGRAMS[name]()
    step, args, kwargs = jittable(step, args, {})
    return lowering.lower(step, *args, platform="tpu", compile=compile, **kwargs)


#: the programs CI compiles (each compile serves both libtpu tests); the full tier compiles all
CI_PROGRAMS = ["nnx_scan", "equinox_checkpoint", "grad_accumulation"]


@pytest.mark.parametrize("name", ci_sample([
    pytest.param("linen_named_bf16", marks=pytest.mark.xfail(strict=True, reason=LINEN_VMEM)),
    "nnx_scan", "equinox_checkpoint", "sharded_mesh", "shard_map_fsdp",
    pytest.param("flash_attention", marks=pytest.mark.xfail(strict=True, reason=FLASH_VMEM)),
    "mlp_adamw", "grad_accumulation"], CI_PROGRAMS))
def test_a_users_step_is_predicted_within_5_percent_of_libtpu(name: str) -> None:
    """Measured (2026-12-08): NNX +2.1%, Equinox +0.7%, sharded -1.7% (per device, 4 chips),
    shard_map -0.00%, linen +5.8%, flash attention -10.0%, MLP with AdamW -0.0% (+6.6% until
    libtpu's output fusions were modeled: passes/tpu/fusion.py). Where the peak rests on what the
    model places in VMEM, ``analyze`` says so (the misses)."""
    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module

    predicted = analyze(parse_module(_lowered(name).hlo_text), platform="tpu").peak_bytes
    low = _lowered(name, compile="tpu-v5e")
    assert low.memory is not None
    real = low.memory["peak_memory_in_bytes"]
    assert predicted == pytest.approx(real, rel=0.05), f"predicted {predicted:,} vs libtpu {real:,}"


@pytest.mark.parametrize("name, note", [("linen_named_bf16", "the peak is libtpu's on-chip VMEM heap"),
                                         ("flash_attention", "the HBM peak assumes memory-space assignment holds"),
                                         ("mlp_adamw", "the HBM peak assumes memory-space assignment holds")])
def test_where_a_miss_rests_on_vmem_analyze_says_so(name: str, note: str) -> None:
    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module

    notes = analyze(parse_module(_lowered(name).hlo_text), platform="tpu").notes
    assert any(n.startswith(note) for n in notes), notes


@pytest.mark.parametrize("name", ci_sample([
    "linen_named_bf16", "nnx_scan", "equinox_checkpoint", "sharded_mesh", "shard_map_fsdp", "flash_attention", "mlp_adamw",
    "grad_accumulation"], CI_PROGRAMS))
def test_a_users_compiled_step_reads_as_libtpu_reports_it(name: str) -> None:
    """hloopt's figure for libtpu's own compiled module vs its ``memory_analysis()``: exact to
    1 KiB for linen, NNX, Equinox and the sharded step (NNX's VMEM heap counts its scan's
    in-place updates twice, as libtpu's trace does: -3.0% before)."""
    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module

    low = _lowered(name, compile="tpu-v5e")
    assert low.memory is not None and low.compiled_text is not None
    got = analyze(parse_module(low.compiled_text)).peak_bytes
    real = low.memory["peak_memory_in_bytes"]
    assert got == pytest.approx(real, rel=0.005), f"hloopt {got:,} vs libtpu {real:,}"
