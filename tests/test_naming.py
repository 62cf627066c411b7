"""hloopt.naming: residual names recovered by re-lowering, checked against JAX's own saved_residuals.

Agreement (every zoo model, tiny): lowered with ``save_only_these_names(every name)``, the bytes
hloopt attributes to each checkpoint_name in the pre-optimization HLO equal the bytes
``jax._src.ad_checkpoint.saved_residuals`` reports as ``named '<name>'`` for the same loss.

* Scan stacking: for llama/sharded (``lax.scan`` over layers) JAX's saved_residuals only sees the
  scan's stacked outputs (``output of scan``), so JAX's side is computed on the same model with
  ``scan_layers=False`` (same parameters, math and names, one checkpoint per unrolled layer); the
  HLO side sees one ``[L, ...]`` stack per name, and L x per-layer bytes must equal the sum over
  the unrolled layers.
* Unnamed residuals (loss internals: ``exp``, ``abs``, ``ge`` of the cross-entropy; gather indices
  from the batch) are compared in tests/passes/test_residuals.py by structure, not by name; JAX also lists
  arguments (``from the argument params[...]``), which hloopt counts as static inputs.
* ``mlpwo`` (llama) is named but never a residual: the backward pass of the last matmul of a layer
  does not read its output, so neither JAX nor the HLO saves it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hloopt.lowering  # noqa: F401  (sets XLA_FLAGS before jax starts)
from hloopt.errors import UserError
from hloopt.targets import resolve

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mlp", "convnet", "gpt2", "llama", "sharded")


def _source_name_lines(path: Path) -> set[tuple[str, int]]:
    out = set()
    for i, text in enumerate(path.read_text().splitlines(), 1):
        for m in re.finditer(r'checkpoint_name\(.*,\s*"(\w+)"\)', text):
            out.add((m.group(1), i))
    return out


@pytest.mark.slow
def test_checkpoint_name_sites_are_the_calls_in_the_source() -> None:
    from hloopt.naming import checkpoint_names

    sites = checkpoint_names(resolve(str(ROOT / "fixtures/zoo/llama.py:tiny")))
    got = {(s.name, s.line) for s in sites if s.file.endswith("llama.py")}
    assert got == _source_name_lines(ROOT / "fixtures/zoo/llama.py")


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_bytes_per_name_equal_jax_saved_residuals(model: str) -> None:
    import jax

    from hloopt.naming import checkpoint_names, jax_bytes_by_name, jax_saved_residuals, name_residuals

    target = resolve(str(ROOT / f"fixtures/zoo/{model}.py:tiny"))
    names = sorted({s.name for s in checkpoint_names(target)})
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    saved = target.rebuild(policy=policy)
    ours: dict[str, int] = {}
    for r in name_residuals(saved).residuals:
        if r.name:
            ours[r.name] = ours.get(r.name, 0) + r.bytes
    unrolled = target.rebuild(policy=policy, scan_layers=False) if model in ("llama", "sharded") else saved
    theirs = jax_bytes_by_name(jax_saved_residuals(unrolled))
    assert theirs, "JAX reports named residuals under save_only_these_names"
    assert ours == theirs


@pytest.mark.slow
def test_default_policy_llama_layer_input_stack_is_selected_by_decoder_layer_input() -> None:
    """Default policy saves only each layer's input: the [L,B,S,D] stack, which offloading
    ``decoder_layer_input`` moves to host (the all-names probe no longer keeps it on device)."""
    from hloopt.naming import name_residuals

    probe = name_residuals(resolve(str(ROOT / "fixtures/zoo/llama.py:tiny")))
    stacked = [r for r in probe.residuals if r.layers > 1]
    assert [(r.name, r.layers, r.bytes) for r in stacked] == [("decoder_layer_input", 2, 2 * 2 * 32 * 64 * 4)]
    assert 0 < probe.coverage < 1
    # what offloading each name would move: per-layer query_proj is [B,S,H*hd] = [2,32,64] f32, 2 layers
    q = [v for v in probe.values if v.name == "query_proj"]
    assert [(v.per_layer_dims, v.layers, v.bytes) for v in q] == [((2, 32, 64), 2, 32768)]
    assert "mlpwo" not in probe.bytes_by_name()


def test_naming_an_hlo_target_is_a_user_error(tmp_path: Path) -> None:
    from hloopt.naming import name_residuals

    path = tmp_path / "m.hlo"
    path.write_text("HloModule m\n\nENTRY e {\n  ROOT c = f32[] constant(1)\n}\n")
    with pytest.raises(UserError, match="needs a JAX TARGET"):
        name_residuals(resolve(str(path)))


def _saved(model: str, kwargs: dict, names: list[str]) -> list:
    import jax

    from hloopt.naming import jax_saved_residuals

    policy = jax.checkpoint_policies.save_only_these_names(*names)
    return jax_saved_residuals(resolve(f"fixtures/zoo/{model}.py:tiny", factory_kwargs={**kwargs, "policy": policy}))


def _bytes(saved: list) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a, _ in saved)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2", "sharded"])
def test_checkpoint_input_names_are_those_whose_remat_saves_nothing(model: str) -> None:
    """Truth: JAX's saved_residuals with every name saved vs all but one. A saved name whose
    dropping saves no bytes is a checkpoint's own input (JAX then saves the input instead), and
    only those are :attr:`NameSite.of_input` at every site. JAX names scan residuals only as
    ``output of scan``, so the truth comes from the unrolled form (``scan_layers=False``: same
    math and names) and holds for the scanned one too."""
    from hloopt.naming import checkpoint_names, input_names, jax_bytes_by_name

    kwargs = {} if model == "gpt2" else {"scan_layers": False}
    sites = checkpoint_names(resolve(f"fixtures/zoo/{model}.py:tiny", factory_kwargs=kwargs))
    if model != "gpt2":
        scanned = checkpoint_names(resolve(f"fixtures/zoo/{model}.py:tiny", factory_kwargs={"scan_layers": True}))
        assert input_names(scanned) == input_names(sites)
    names = sorted({s.name for s in sites})
    everything = _saved(model, kwargs, names)
    saved_names = set(jax_bytes_by_name(everything))  # mlpwo (llama) is never a residual
    frees_nothing = {n for n in saved_names
                     if _bytes(_saved(model, kwargs, [m for m in names if m != n])) == _bytes(everything)}
    assert input_names(sites) == frees_nothing
    assert frees_nothing == {"decoder_layer_input"}


UNROLLED = """
    from functools import partial
    import jax, jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    def layer(x, w):
        h = checkpoint_name(jnp.tanh(x @ w["a"]), "pre")
        return x + h @ w["b"]

    def make(unroll=2):
        f = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("pre"))

        def loss(params, x):
            x, _ = jax.lax.scan(lambda c, w: (f(c, w), None), x, params, unroll=unroll)
            return jnp.mean(x ** 2)

        @partial(jax.jit, donate_argnums=(0,))
        def step(params, x):
            l, g = jax.value_and_grad(loss)(params, x)
            return jax.tree.map(lambda p, gi: p - 1e-3 * gi, params, g), l

        params = {"a": jax.ShapeDtypeStruct((4, 64, 256), jnp.float32),
                  "b": jax.ShapeDtypeStruct((4, 256, 64), jnp.float32)}
        return step, (params, jax.ShapeDtypeStruct((32, 64), jnp.float32))
"""


@pytest.mark.parametrize("unroll", [1, 2])
def test_a_name_saved_by_an_unrolled_scan_is_found(tmp_path: Path, unroll: int) -> None:
    """A scan with ``unroll`` 2 stacks its two iterations' copies of a named value with a
    concatenate before writing them into the loop's stack: the stack is still that name's (the
    program's own policy saves it), 4 layers x f32[32,256], as with ``unroll`` 1."""
    import textwrap

    from hloopt.naming import name_residuals

    path = tmp_path / "unrolled.py"
    path.write_text(textwrap.dedent(UNROLLED))
    probe = name_residuals(resolve(f"{path}:make", factory_kwargs={"unroll": unroll}))
    named = [r for r in probe.residuals if r.name == "pre"]
    assert len(named) == 1 and named[0].bytes == 4 * 32 * 256 * 4
    assert named[0].primitive != "concatenate"


ARGUMENTS = """
    import jax, jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    def layer(x, w):
        if NAME_INPUT:
            x = checkpoint_name(x, "layer_input")
        h = jnp.tanh(x @ w["a"])
        return x + h @ w["b"]

    def make(scan=True):
        f = jax.checkpoint(layer)  # JAX's default policy: save nothing, recompute everything

        def loss(params, x):
            if scan:
                x, _ = jax.lax.scan(lambda c, w: (f(c, w), None), x, params)
            else:
                for i in range(4):
                    x = f(x, jax.tree.map(lambda p: p[i], params))
            return jnp.mean(x ** 2)

        def step(params, x):
            return jax.value_and_grad(loss)(params, x)

        params = {"a": jax.ShapeDtypeStruct((4, 64, 256), jnp.float32),
                  "b": jax.ShapeDtypeStruct((4, 256, 64), jnp.float32)}
        return step, (params, jax.ShapeDtypeStruct((32, 64), jnp.float32))
"""


@pytest.mark.parametrize("scan", [True, False])
def test_a_checkpointed_functions_argument_is_saved_whatever_the_policy(tmp_path: Path, scan: bool) -> None:
    """Truth from the HLO JAX emits: with JAX's default policy the step saves only the layers'
    inputs (a scan's carry stack, or each unrolled layer's input), and no policy moves them:
    lowered with every value offloadable they are still device residuals. ``checkpoint_inputs``
    finds exactly those, with the layer's first use of its input (``x @ w["a"]``, line 8). Named
    there as the advice says, a policy offloading that name offloads them."""
    import textwrap

    from hloopt.naming import checkpoint_inputs, lower_module, offload_policy
    from hloopt.passes.residuals import find_residuals, under_checkpoint

    src = textwrap.dedent(ARGUMENTS)
    plain, named = tmp_path / "plain.py", tmp_path / "named.py"
    plain.write_text(src.replace("NAME_INPUT", "False"))
    named.write_text(src.replace("NAME_INPUT", "True"))
    target = resolve(f"{plain}:make", factory_kwargs={"scan": scan})
    baseline = find_residuals(lower_module(target))
    layer_inputs = [r for r in baseline if under_checkpoint(r)]
    assert all(r.per_layer_dims == (32, 64) for r in layer_inputs)
    # a scan stacks all 4 layers' inputs; unrolled, the first layer's input is the step's argument
    assert sum(r.layers for r in layer_inputs) == (4 if scan else 3)

    def everything_offloaded(prim, *_, **__):  # type: ignore[no-untyped-def]
        from jax.ad_checkpoint import Offloadable
        return Offloadable(src="device", dst="pinned_host")

    kept = find_residuals(lower_module(target, policy=everything_offloaded))
    assert sum(r.bytes for r in kept if not r.offloaded and under_checkpoint(r)) == \
        sum(r.bytes for r in layer_inputs)

    inputs = checkpoint_inputs(target, baseline)
    assert set(inputs) == {r.inst.name for r in layer_inputs}
    assert set(inputs.values()) == {f"{layer_inputs[0].source[0]}:8"}
    assert layer_inputs[0].source[0].endswith("plain.py")

    moved = find_residuals(lower_module(resolve(f"{named}:make", factory_kwargs={"scan": scan}),
                                        policy=offload_policy(["layer_input"])))
    assert not [r for r in moved if not r.offloaded and under_checkpoint(r)]
    # every layer's input, the first unrolled layer's (the step's argument) too once named
    assert sum(r.bytes for r in moved if r.offloaded) == 4 * 32 * 64 * 4
