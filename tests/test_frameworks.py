"""Programs with no jax.checkpoint: ``residuals`` and ``plan`` say in one line how many residual
bytes no policy can move and which switch of the program's framework turns checkpointing on.
The bytes are checked against the residual rows' own sum (``hloopt residuals --json``)."""

from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner

from hloopt.cli import cli
from hloopt.frameworks import GENERIC_SWITCH, framework_of, remat_switch
from hloopt.units import format_bytes

PLAIN = """
    import jax, jax.numpy as jnp

    def make():
        def step(x, w):
            def loss(w):
                h = x
                for _ in range(3):
                    h = jnp.tanh(h @ w)
                return jnp.sum(h)
            return jax.value_and_grad(loss)(w)
        s = jax.ShapeDtypeStruct((256, 256), jnp.float32)
        return step, (s, s)
"""

FLAX = """
    import jax, jax.numpy as jnp
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = jnp.tanh(nn.Dense(256)(x))
            return x

    def make():
        model = Model()
        x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
        params = jax.eval_shape(model.init, jax.random.key(0), x)
        def step(p, x):
            return jax.value_and_grad(lambda p: jnp.sum(model.apply(p, x)))(p)
        return step, (params, x)
"""


# layers under lax.scan without a checkpoint: the loop stacks every residual of its body, and no
# policy governs them (a scan is no checkpoint)
PLAIN_SCAN = """
    import jax, jax.numpy as jnp

    def make():
        def step(x, ws):
            def loss(ws):
                h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
                return jnp.sum(h)
            return jax.value_and_grad(loss)(ws)
        return step, (jax.ShapeDtypeStruct((256, 256), jnp.float32),
                      jax.ShapeDtypeStruct((3, 256, 256), jnp.float32))
"""

HAIKU = """
    import jax, jax.numpy as jnp
    import haiku as hk

    def forward(x):
        layer = lambda h: jnp.tanh(hk.Linear(256)(h))
        return hk.experimental.layer_stack(3)(layer)(x)

    def make():
        net = hk.without_apply_rng(hk.transform(forward))
        x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
        params = jax.eval_shape(net.init, jax.random.key(0), x)
        def step(p, x):
            return jax.value_and_grad(lambda p: jnp.sum(net.apply(p, x)))(p)
        return step, (params, x)
"""


def _write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path) + ":make"


def _cli(*argv):
    return CliRunner().invoke(cli, list(argv))


@pytest.mark.parametrize(("source", "switch"), [(PLAIN, GENERIC_SWITCH), (PLAIN_SCAN, GENERIC_SWITCH),
                                               (FLAX, remat_switch("flax")), (HAIKU, remat_switch("haiku"))],
                         ids=["jax", "jax-scan", "flax", "haiku"])
def test_residuals_says_what_no_policy_moves_and_what_to_turn_on(tmp_path, source, switch) -> None:
    if source is FLAX:
        pytest.importorskip("flax.linen")  # a third-party requirement, not a dev one
    if source is HAIKU:
        pytest.importorskip("haiku")
    target = _write(tmp_path, "step.py", source)
    rows = json.loads(_cli("residuals", target, "--json", "--no-names").output)
    assert rows and not any(r["under_checkpoint"] for r in rows)
    total = sum(r["bytes"] for r in rows)
    out = _cli("residuals", target, "--no-names").output
    line = [ln for ln in out.splitlines() if "no policy can move" in ln]
    assert line == [f"{format_bytes(total)} of residuals no policy can move: the step saves them outside "
                    f"any jax.checkpoint; to let hloopt plan them, {switch}"]


def test_plan_below_the_floor_says_so_in_one_line(tmp_path) -> None:
    target = _write(tmp_path, "step.py", PLAIN)
    r = _cli("plan", target, "--device", "tpu-v5e", "--budget", "50%", "-q")
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no policy can move" in lines[0] and GENERIC_SWITCH in lines[0]


def test_a_program_with_checkpoints_gets_no_such_line() -> None:
    out = _cli("residuals", "fixtures/zoo/mlp.py:tiny", "--no-names").output
    assert "no policy can move" not in out


def test_the_most_specific_framework_wins() -> None:
    # a transformers Flax model is also a flax model: its own switch is the one to give
    assert framework_of(["transformers/models/bert/modeling_flax_bert.py:10", "flax/linen/module.py:3"],
                        modules=[]) == "transformers"
    assert framework_of([], modules=["flax", "equinox", "haliax"]) == "haliax"
    assert framework_of(["model.py:3"], modules=["jax"]) is None


# -- non-array arguments: what the step's own jit would keep static ----------------------------

EQX = """
    import equinox as eqx
    import jax, jax.numpy as jnp

    class Net(eqx.Module):
        lin: eqx.nn.Linear
        scale: float                      # a Python float leaf: static under eqx.filter_jit
        act: object = jax.nn.gelu         # a function leaf

        def __call__(self, x):
            return self.act(self.lin(x)) * self.scale

    def make(donate="none"):
        net = Net(eqx.nn.Linear(64, 64, key=jax.random.PRNGKey(0)), 0.5)

        @eqx.filter_jit(donate=donate)
        def step(net, x):
            loss, g = eqx.filter_value_and_grad(lambda n: jnp.sum(jax.vmap(n)(x)))(net)
            return eqx.apply_updates(net, jax.tree.map(lambda u: -1e-3 * u, g)), loss

        return step, (net, jnp.ones((8, 64)))
"""


def _entry_parameters(text: str) -> list[str]:
    from hloopt.hlo.parser import parse_module

    module = parse_module(text)
    return sorted(str(p.shape).split("{")[0] for p in module.entry.parameters)


@pytest.mark.parametrize("donate", ["none", "all"])
def test_an_equinox_step_lowers_as_its_filter_jit_does(tmp_path, donate) -> None:
    """An ``eqx.filter_jit`` step whose model holds a Python float and a function: hloopt lowers
    it with the same array parameters (and donation) as equinox's own ``.lower`` does; under a
    plain ``jax.jit`` the float would become an array that ``eqx.is_array`` takes for a
    parameter."""
    pytest.importorskip("equinox")
    from hloopt.lowering import lower
    from hloopt.targets import resolve

    target = resolve(_write(tmp_path, "eqx_step.py", EQX), factory_kwargs={"donate": donate})
    ours = lower(target, platform="cpu").hlo_text
    import sys

    module = sys.modules[target.factory.__module__]  # type: ignore[union-attr]
    step, args = module.make(donate)
    theirs = step.lower(*args).lowered.as_text(dialect="hlo")  # equinox's Lowered wraps jax's
    assert _entry_parameters(ours) == _entry_parameters(theirs) == ["f32[64,64]", "f32[64]", "f32[8,64]"]
    assert ("input_output_alias" in ours) == ("input_output_alias" in theirs) == (donate == "all")


def test_a_leaf_jax_cannot_trace_is_held_by_the_step() -> None:
    """A plain function given a string among its arrays: the string stays with the step, the
    arrays keep their tree paths, and the step computes what it computes when called directly."""
    import jax
    import jax.numpy as jnp

    from hloopt.frameworks import jittable

    def step(cfg, x):
        return x * 2 if cfg["mode"] == "double" else x

    cfg = {"mode": "double", "w": jnp.ones(3)}
    fn, args, kwargs = jittable(step, (cfg, jnp.arange(3.0)), {})
    assert args[0] == {"mode": None, "w": cfg["w"]} and kwargs == {}
    assert jnp.array_equal(jax.jit(fn)(*args), step(cfg, jnp.arange(3.0)))
    # only traceable leaves: returned as given
    assert jittable(step, (1.0, jnp.ones(2)), {})[0] is step


def test_a_python_flag_is_held_by_the_step_and_a_number_traced() -> None:
    """A factory's keyword flag (``train=True``) steers the step's Python: traced, it could not
    (``if train:`` on a tracer raises). Held by the step, the step computes what it computes when
    called directly; a Python float stays an argument of the jitted step."""
    import jax
    import jax.numpy as jnp

    from hloopt.frameworks import jittable

    def step(w, *, train, scale):
        return w * scale * 0.5 if train else w * scale

    fn, args, kwargs = jittable(step, (jnp.ones(3),), {"train": True, "scale": 3.0})
    assert kwargs == {"train": None, "scale": 3.0}
    assert jnp.array_equal(jax.jit(fn)(*args, **kwargs), step(jnp.ones(3), train=True, scale=3.0))
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(step)(jnp.ones(3), train=True, scale=3.0)


def test_the_hloopt_launcher_is_no_source_line(tmp_path, monkeypatch) -> None:
    """Ops whose frames are all framework plumbing must not be located at the ``hloopt`` console
    script (its absolute path); a user's own script stays a source."""
    from hloopt.lowering import _console_script

    launcher = tmp_path / "bin" / "hloopt"
    launcher.parent.mkdir()
    launcher.write_text("from hloopt.cli import run\nrun()\n")
    monkeypatch.setattr("sys.argv", [str(launcher), "analyze"])
    assert _console_script() == [str(launcher)]
    monkeypatch.setattr("sys.argv", [str(tmp_path / "train.py")])
    assert _console_script() == []


def test_a_transformers_model_without_checkpointing_is_not_told_to_turn_it_on() -> None:
    """transformers' Flax ViT defines no ``enable_gradient_checkpointing`` (calling the base
    class's raises NotImplementedError); BERT's does. The hint for residuals in ViT's layer file
    says so instead of naming a switch ViT lacks."""
    transformers = pytest.importorskip("transformers")  # a third-party requirement, not a dev one
    from hloopt.frameworks import transformers_without_checkpointing, unmovable_line

    vit, bert = "transformers/models/vit/modeling_flax_vit.py", "transformers/models/bert/modeling_flax_bert.py"
    assert transformers_without_checkpointing([vit, bert, "flax/linen/module.py"]) == ["vit"]
    with pytest.raises(NotImplementedError):
        transformers.FlaxViTModel(transformers.ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                         intermediate_size=64), _do_init=False).enable_gradient_checkpointing()
    line = unmovable_line(1024, "transformers", [vit])
    assert line is not None and "Flax vit implements no gradient checkpointing" in line
    assert unmovable_line(1024, "transformers", [bert]) == unmovable_line(1024, "transformers")
    assert remat_switch("transformers") in (unmovable_line(1024, "transformers", [bert]) or "")
