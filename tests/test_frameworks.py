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


def _write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path) + ":make"


def _cli(*argv):
    return CliRunner().invoke(cli, list(argv))


@pytest.mark.parametrize(("source", "switch"), [(PLAIN, GENERIC_SWITCH), (FLAX, remat_switch("flax"))],
                         ids=["jax", "flax"])
def test_residuals_says_what_no_policy_moves_and_what_to_turn_on(tmp_path, source, switch) -> None:
    if source is FLAX:
        pytest.importorskip("flax.linen")  # a third-party requirement, not a dev one
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
