"""Source lines a user recognizes: an op is located at the model's own line, not at the framework
it is built with, and installed files are written by package path wherever the virtualenv lies."""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest

from hloopt.lowering import lower, package_folders, relative_paths


def test_installed_files_are_written_by_package_path(monkeypatch) -> None:
    inside = os.path.join(os.getcwd(), ".venv", "lib", "python3.11", "site-packages")
    monkeypatch.setattr(sys, "path", [*sys.path, inside])
    folders = package_folders()
    assert inside + os.sep in folders
    for folder in folders:
        text = f'source_file="{folder}transformers/models/bert/modeling_flax_bert.py"'
        assert relative_paths(text) == 'source_file="transformers/models/bert/modeling_flax_bert.py"'
    # a file of the user's under the working directory: relative to it
    assert relative_paths(f'"{os.getcwd()}/model.py"') == '"model.py"'


def test_a_flax_model_is_located_at_its_own_lines_not_flax() -> None:
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(32)(x))  # the model's line

    model = Model()
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)

    def step(p, x):
        return jax.grad(lambda p: jnp.sum(model.apply(p, x)))(p)

    text = lower(step, params, x, platform="tpu").hlo_text
    files = set(re.findall(r'source_file="([^"]+)"', text))
    files |= set(re.findall(r'^\d+ "([^"]+)"$', text, re.MULTILINE))  # the stack-frame table
    here = os.path.relpath(__file__) if __file__.startswith(os.getcwd()) else __file__
    assert here in files
    assert not any(f.startswith(("flax/", "jax/")) or "site-packages" in f or "hloopt/lowering.py" in f
                   for f in files), files
    # the dots the Dense layer computes (forward and backward) are attributed to the line above
    from hloopt.hlo.parser import parse_module

    module = parse_module(text)
    line = next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if "# the model's line" in s)
    dots = [i for c in module.computations.values() for i in c.instructions if i.opcode == "dot"]
    assert len(dots) == 2 and {module.source_of(d) for d in dots} == {(here, line)}
