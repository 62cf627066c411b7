"""hloopt.passes.residuals: forward->backward values found by dataflow, checked against hand-built
modules (where the residuals are known by construction) and XLA's own figures for the zoo."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hloopt.hlo.parser import parse_file, parse_module
from hloopt.passes.residuals import find_residuals, group_by_selector

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "fixtures" / "hlo" / "zoo"

# loss = sum(relu(x @ w)^2); backward by hand: dr = 2 r (the seed 1.0 folded into the constant 2),
# dh = select(h > 0, dr, 0), dw = x^T dh; returns (w - 0.1 dw, loss). No metadata at all.
# Residuals by construction: h (read by the backward compare) and r (read by the backward
# multiply). x and w are parameters: inputs, not residuals.
MLP = """
HloModule fwd_bwd, entry_computation_layout={(f32[8,16]{1,0}, f32[16,32]{1,0})->(f32[16,32]{1,0}, f32[])}

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  x = f32[8,16]{1,0} parameter(0)
  w = f32[16,32]{1,0} parameter(1)
  h = f32[8,32]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  zero = f32[] constant(0)
  zeros = f32[8,32]{1,0} broadcast(zero), dimensions={}
  r = f32[8,32]{1,0} maximum(h, zeros)
  sq = f32[8,32]{1,0} multiply(r, r)
  loss = f32[] reduce(sq, zero), dimensions={0,1}, to_apply=add
  two = f32[] constant(2)
  twos = f32[8,32]{1,0} broadcast(two), dimensions={}
  dr = f32[8,32]{1,0} multiply(r, twos)
  pos = pred[8,32]{1,0} compare(h, zeros), direction=GT
  dh = f32[8,32]{1,0} select(pos, dr, zeros)
  dw = f32[16,32]{1,0} dot(x, dh), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  lr = f32[] constant(0.1)
  lrs = f32[16,32]{1,0} broadcast(lr), dimensions={}
  step = f32[16,32]{1,0} multiply(dw, lrs)
  w2 = f32[16,32]{1,0} subtract(w, step)
  ROOT out = (f32[16,32]{1,0}, f32[]) tuple(w2, loss)
}
"""

# A 3-layer scan: the forward loop carries x and writes each layer's input into a zero-initialized
# [3,4,8] stack at the induction variable; the backward loop reads layer 2-i in iteration i. The
# stack (3 * 4*8 f32 = 384 bytes) is the residual, 3 layers; the layer input is offloaded to
# pinned_host before it is stacked.
SCAN = """
HloModule scan, entry_computation_layout={(f32[4,8]{1,0}, f32[8,8]{1,0})->(f32[8,8]{1,0}, f32[])}

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

fcond {
  p = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}

fbody {
  p = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[4,8]{1,0} get-tuple-element(p), index=1
  stack = f32[3,4,8]{2,1,0} get-tuple-element(p), index=2
  w = f32[8,8]{1,0} get-tuple-element(p), index=3
  off = f32[4,8]{1,0} custom-call(x), custom_call_target="annotate_device_placement", custom_call_has_side_effect=true, frontend_attributes={_xla_buffer_placement="pinned_host"}
  upd = f32[1,4,8]{2,1,0} reshape(off)
  z = s32[] constant(0)
  stack2 = f32[3,4,8]{2,1,0} dynamic-update-slice(stack, upd, i, z, z)
  y = f32[4,8]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  ROOT t = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}) tuple(i2, y, stack2, w)
}

bcond {
  p = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}

bbody {
  p = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  g = f32[4,8]{1,0} get-tuple-element(p), index=1
  stack = f32[3,4,8]{2,1,0} get-tuple-element(p), index=2
  w = f32[8,8]{1,0} get-tuple-element(p), index=3
  dw = f32[8,8]{1,0} get-tuple-element(p), index=4
  last = s32[] constant(2)
  j = s32[] subtract(last, i)
  z = s32[] constant(0)
  xs = f32[1,4,8]{2,1,0} dynamic-slice(stack, j, z, z), dynamic_slice_sizes={1,4,8}
  xl = f32[4,8]{1,0} reshape(xs)
  dwl = f32[8,8]{1,0} dot(xl, g), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  dw2 = f32[8,8]{1,0} add(dw, dwl)
  g2 = f32[4,8]{1,0} dot(g, w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  ROOT t = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}, f32[8,8]{1,0}) tuple(i2, g2, stack, w, dw2)
}

ENTRY main {
  x0 = f32[4,8]{1,0} parameter(0)
  w = f32[8,8]{1,0} parameter(1)
  c0 = s32[] constant(0)
  zero = f32[] constant(0)
  stack0 = f32[3,4,8]{2,1,0} broadcast(zero), dimensions={}
  init = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}) tuple(c0, x0, stack0, w)
  fw = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}) while(init), condition=fcond, body=fbody
  y = f32[4,8]{1,0} get-tuple-element(fw), index=1
  stack = f32[3,4,8]{2,1,0} get-tuple-element(fw), index=2
  loss = f32[] reduce(y, zero), dimensions={0,1}, to_apply=add
  one = f32[] constant(1)
  seed = f32[4,8]{1,0} broadcast(one), dimensions={}
  dw0 = f32[8,8]{1,0} broadcast(zero), dimensions={}
  binit = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}, f32[8,8]{1,0}) tuple(c0, seed, stack, w, dw0)
  bw = (s32[], f32[4,8]{1,0}, f32[3,4,8]{2,1,0}, f32[8,8]{1,0}, f32[8,8]{1,0}) while(binit), condition=bcond, body=bbody
  dw = f32[8,8]{1,0} get-tuple-element(bw), index=4
  w2 = f32[8,8]{1,0} subtract(w, dw)
  ROOT out = (f32[8,8]{1,0}, f32[]) tuple(w2, loss)
}
"""


def test_hand_built_fwd_bwd_residuals_are_h_and_r() -> None:
    rs = find_residuals(parse_module(MLP))
    assert rs.loss.name == "loss"
    assert sorted(r.inst.name for r in rs) == ["h", "r"]
    assert rs.total_bytes == 2 * 8 * 32 * 4
    # inputs and a broadcast constant the backward pass reads: static, not residuals
    assert {i.name for i in rs.static} == {"x", "w", "zeros"}
    by = {r.inst.name: r for r in rs}
    # entry order: x0 w1 h2 zero3 zeros4 r5 sq6 loss7 two8 twos9 dr10 pos11 ...
    # r: defined at 5, read forward by sq (6), first read backward by dr (10)
    assert (by["r"].position, by["r"].forward_last_use, by["r"].first_backward_use) == (5, 6, 10)
    assert by["h"].first_backward_use == 11  # pos = compare(h, zeros)
    assert not any(r.offloaded for r in rs) and all(r.layers == 1 for r in rs)


def test_hand_built_scan_stack_is_one_residual_of_three_layers_read_in_reverse() -> None:
    rs = find_residuals(parse_module(SCAN))
    assert [r.inst.name for r in rs] == ["stack"]
    r = rs.residuals[0]
    assert (r.layers, r.layer_axis, r.bytes, r.per_layer_bytes) == (3, 0, 384, 128)
    assert r.per_layer_dims == (4, 8)
    assert r.forward_loop is not None and r.forward_loop.name == "fw"
    assert r.backward_loop is not None and r.backward_loop.name == "bw"
    assert r.reversed_in_backward is True
    assert r.iteration_map() == [(0, 0, 2), (1, 1, 1), (2, 2, 0)]
    assert r.offloaded  # the update is annotated to pinned_host
    assert r.producer.opcode == "get-tuple-element"  # the carried layer input x


def test_loss_output_option_and_bad_index() -> None:
    from hloopt.errors import UserError

    rs = find_residuals(parse_module(MLP), loss_output=1)
    assert rs.loss.name == "loss"
    with pytest.raises(UserError, match="loss output 5"):
        find_residuals(parse_module(MLP), loss_output=5)


def test_a_metric_of_the_gradients_is_not_taken_for_the_loss() -> None:
    """A step that also returns its gradients' norm (as MaxText's does) has a scalar with more
    ancestors than the loss; the residuals are still the forward pass's: those of the same step
    returning the loss alone (JAX's HLO of both as truth)."""
    import jax
    import jax.numpy as jnp

    from hloopt.lowering import lower

    def loss_fn(w, x):
        h = jnp.tanh(x @ w[0])
        return jnp.sum(jnp.tanh(h @ w[1]) ** 2)

    def step_alone(w, x):
        loss, g = jax.value_and_grad(loss_fn)(w, x)
        return [wi - 0.1 * gi for wi, gi in zip(w, g)], loss

    def step_with_norm(w, x):
        loss, g = jax.value_and_grad(loss_fn)(w, x)
        norm = jnp.sqrt(sum(jnp.sum(gi * gi) for gi in g))
        return [wi - 0.1 * gi for wi, gi in zip(w, g)], loss, norm

    w = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 2
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)

    def residuals(step):
        rs = find_residuals(parse_module(lower(step, w, x, platform="tpu").hlo_text))
        return rs, sorted((r.dtype, r.per_layer_dims) for r in rs)

    alone, want = residuals(step_alone)
    with_norm, got = residuals(step_with_norm)
    assert want and got == want
    assert with_norm.loss.opcode == alone.loss.opcode


def test_module_without_scalar_loss_is_a_user_error() -> None:
    from hloopt.errors import UserError

    text = "HloModule m\n\nENTRY e {\n  p = f32[4]{0} parameter(0)\n  ROOT n = f32[4]{0} negate(p)\n}\n"
    with pytest.raises(UserError, match="no scalar floating-point output"):
        find_residuals(parse_module(text))


@pytest.mark.parametrize("returns_loss, optimizer", [(False, False), (True, False), (True, True)])
def test_a_step_that_differentiates_inside_a_loop_is_told_what_to_plan(returns_loss: bool, optimizer: bool) -> None:
    """Gradient accumulation: ``jax.grad`` under ``lax.fori_loop`` over microbatches. Its residuals
    are the loop body's, not the step's: with or without a loss output, the user is told to plan
    the step of one microbatch, and where the loop is. With an optax optimizer after a ``scan``
    that reads the parameters (clipping by global norm, AdamW's weight decay), the parameters the
    loop passes through and the accumulated gradients are read after it: still no residuals."""
    import jax
    import jax.numpy as jnp

    from hloopt.errors import UserError
    from hloopt.lowering import lower

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    import optax

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def step(w, xs):
        if optimizer:
            grads, losses = jax.lax.scan(lambda acc, x: (acc + jax.grad(loss)(w, x), loss(w, x)), jnp.zeros_like(w), xs)
            u, _ = opt.update(grads, opt.init(w), w)
            return optax.apply_updates(w, u), losses.mean()
        grads = jax.lax.fori_loop(0, 4, lambda i, acc: acc + jax.grad(loss)(w, xs[i]), jnp.zeros_like(w))
        return (w - grads, jnp.float32(0)) if returns_loss else w - grads

    w, xs = jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((4, 8, 64), jnp.float32)
    module = parse_module(lower(step, w, xs, platform="cpu").hlo_text)
    with pytest.raises(UserError, match=r"differentiates inside a loop \(the loop at .*test_residuals.py:\d+: "
                                        r"gradient accumulation.*the step of one microbatch"):
        find_residuals(module)
    # the step of one microbatch has its residuals at the top level
    one = parse_module(lower(jax.value_and_grad(loss), w, xs.update(shape=(8, 64)), platform="cpu").hlo_text)
    assert len(find_residuals(one)) > 0


@pytest.mark.parametrize("model", ["mlp", "convnet", "gpt2", "llama"])
def test_offloaded_residual_bytes_equal_xla_host_temp(model: str) -> None:
    """XLA's host_temp_size_in_bytes (libtpu memory_analysis) is exactly the offloaded residuals."""
    rs = find_residuals(parse_file(str(ZOO / f"{model}.offload.tpu-v5e.hlo")))
    xla = json.loads((ZOO / f"{model}.offload.tpu-v5e.json").read_text())["memory"]["host_temp_size_in_bytes"]
    assert rs.offloaded_bytes == xla > 0


def _name_lines(path: Path, names: tuple[str, ...]) -> set[int]:
    """Lines of ``checkpoint_name(..., "<name>")`` calls, read from the source itself."""
    lines = set()
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if any(re.search(rf'checkpoint_name\(.*"{n}"\)', text) for n in names):
            lines.add(i)
    return lines


@pytest.mark.parametrize("stem", ["llama.offload.tpu", "llama.offload.tpu-v5e"])
def test_llama_offloaded_stacks_come_from_the_named_lines(stem: str) -> None:
    from fixtures.zoo import OFFLOAD_NAMES

    rs = find_residuals(parse_file(str(ZOO / f"{stem}.hlo")))
    off = [r for r in rs if r.offloaded]
    assert len(off) == len(OFFLOAD_NAMES["llama"])
    assert all(r.layers == 2 and r.reversed_in_backward for r in off)
    assert {r.source[1] for r in off if r.source} == _name_lines(ROOT / "fixtures/zoo/llama.py",
                                                                OFFLOAD_NAMES["llama"])


@pytest.mark.parametrize("stem", ["llama.tpu", "llama.cpu-compiled", "llama.tpu-v5e", "sharded.tpu",
                                  "sharded.cpu-compiled"])
def test_scan_layer_inputs_are_one_stacked_residual(stem: str) -> None:
    """Default policy (save nothing but layer inputs): one [L, B, S, D] stack, L = 2 layers."""
    rs = find_residuals(parse_file(str(ZOO / f"{stem}.hlo")))
    stacked = [r for r in rs if r.layers > 1]
    assert len(stacked) == 1
    r = stacked[0]
    assert r.layers == 2 and r.reversed_in_backward is True and not r.offloaded
    assert r.first_backward_use == r.position + [i for i in r.inst.parent.instructions[r.position:]].index(
        r.backward_loop)


@pytest.mark.parametrize("model", ["mlp", "convnet", "gpt2", "llama", "sharded"])
@pytest.mark.parametrize("kind", ["tpu", "cpu-compiled", "tpu-v5e"])
def test_invariants_on_every_zoo_snapshot(model: str, kind: str) -> None:
    mod = parse_file(str(ZOO / f"{model}.{kind}.hlo"))
    rs = find_residuals(mod)
    assert len(rs) > 0
    for r in rs:
        assert not r.shape.is_tuple and r.inst.opcode not in ("parameter", "constant")
        assert r.position <= r.forward_last_use and r.position < r.first_backward_use <= r.last_use
        assert r.bytes == r.shape.byte_size and r.bytes % r.layers == 0
    groups = group_by_selector(rs)
    assert sum(g.bytes for g in groups) == rs.total_bytes
    assert all(g.key.startswith(("name:", "prim:")) for g in groups)


def test_group_keys_follow_candidate_format() -> None:
    rs = find_residuals(parse_file(str(ZOO / "mlp.tpu.hlo")))
    keys = {g.key for g in group_by_selector(rs)}
    # both relu outputs (layer inputs of layers 1 and 2) come from one line: one group
    assert "prim:jit(relu)@fixtures/zoo/mlp.py:56" in keys or "prim:max@fixtures/zoo/mlp.py:56" in keys


@pytest.mark.parametrize("inside", [False, True])
def test_a_loop_that_slices_the_steps_inputs_outside_its_checkpoint_saves_the_slices(inside: bool) -> None:
    """``fori_loop`` over 4 layers indexing stacked weights ``ws[i]`` (f32[4,64,128], 128 KiB)
    outside ``jax.checkpoint``: JAX stacks every iteration's slice as a residual, the whole 128 KiB
    again; sliced inside the checkpointed function, the backward pass reads ``ws`` itself."""
    import jax
    import jax.numpy as jnp

    from hloopt.lowering import lower
    from hloopt.passes.residuals import input_slice_residuals

    def layer(x, w):
        return jnp.tanh(x @ w @ w.T)

    def loss(ws, x):
        def body(i, x):
            if inside:
                return jax.checkpoint(lambda x, ws, i: layer(x, ws[i]))(x, ws, i)
            return jax.checkpoint(layer)(x, ws[i])
        return jnp.mean(jax.lax.fori_loop(0, 4, body, x) ** 2)

    ws, x = jax.ShapeDtypeStruct((4, 64, 128), jnp.float32), jax.ShapeDtypeStruct((8, 64), jnp.float32)
    rs = find_residuals(parse_module(lower(jax.value_and_grad(loss), ws, x, platform="cpu").hlo_text))
    found = input_slice_residuals(rs)
    if inside:
        assert found == []
    else:
        assert [(r.dtype, r.layers, r.per_layer_dims, r.bytes) for r in found] == [("f32", 4, (64, 128), 4 * 64 * 128 * 4)]


@pytest.mark.parametrize("prevent_cse", [True, False])
def test_what_a_checkpoint_saves_is_under_it_with_or_without_cse_barriers(prevent_cse: bool) -> None:
    """``jax.checkpoint(f, prevent_cse=False)`` hands its saved values to the backward pass with
    no optimization barrier; they are still the policy's to move. Truth is JAX's own HLO: the
    bytes ``nothing_saveable`` stops saving (vs ``everything_saveable``) are all residuals
    ``under_checkpoint`` finds under a checkpoint, and what stays saved outside any checkpoint
    (the head's input, a layer's own argument aside) survives ``nothing_saveable``."""
    import jax
    import jax.numpy as jnp

    from hloopt.lowering import lower
    from hloopt.passes.residuals import under_checkpoint

    def layer(x, w):
        h = x @ w
        return x + jnp.tanh(h) * jnp.sin(h)

    def residuals(policy):
        f = jax.checkpoint(layer, prevent_cse=prevent_cse, policy=policy)

        def loss(w, head, x):
            for _ in range(3):
                x = f(x, w)
            return jnp.sum(jnp.tanh(x @ head))

        s = jax.ShapeDtypeStruct((128, 128), jnp.float32)
        return [r for r in find_residuals(parse_module(lower(jax.value_and_grad(loss), s, s, s,
                                                             platform="tpu").hlo_text))
                if not r.offloaded]

    saved = residuals(jax.checkpoint_policies.everything_saveable)
    kept = residuals(jax.checkpoint_policies.nothing_saveable)
    governed = sum(r.bytes for r in saved if under_checkpoint(r))
    outside = sum(r.bytes for r in saved if not under_checkpoint(r))
    moved = sum(r.bytes for r in saved) - sum(r.bytes for r in kept)
    assert moved > 0
    assert governed >= moved
    assert outside <= sum(r.bytes for r in kept)
