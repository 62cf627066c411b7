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


def test_an_equinox_model_is_located_at_its_own_lines_not_equinox() -> None:
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        layer: eqx.nn.Linear

        def __call__(self, x):
            return jnp.tanh(self.layer(x))  # the model's line

    model = Model(eqx.nn.Linear(32, 32, key=jax.random.key(0)))
    x = jnp.ones((32,))

    def step(m, x):
        return eqx.filter_grad(lambda m: jnp.sum(m(x)))(m)

    text = lower(eqx.filter_jit(step), model, x, platform="tpu").hlo_text
    files = set(re.findall(r'source_file="([^"]+)"', text))
    files |= set(re.findall(r'^\d+ "([^"]+)"$', text, re.MULTILINE))  # the stack-frame table
    here = os.path.relpath(__file__) if __file__.startswith(os.getcwd()) else __file__
    assert here in files
    assert not any(f.startswith(("equinox/", "jax/")) or "site-packages" in f or "hloopt/lowering.py" in f
                   for f in files), files
    # the matmuls the Linear layer computes (forward and backward) are attributed to the line above
    from hloopt.hlo.parser import parse_module

    module = parse_module(text)
    line = next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if "# the model's line" in s)
    dots = [i for c in module.computations.values() for i in c.instructions if i.opcode == "dot"]
    assert dots and {module.source_of(d) for d in dots} == {(here, line)}


LAYERS = "import jax.numpy as jnp\n\n\ndef layer(x, w):\n    return jnp.tanh(x @ w)  # library line 5\n"


def _lower_through_installed_library(tmp_path, monkeypatch, package: str, files: dict[str, str],
                                     patch=None):  # type: ignore[no-untyped-def]
    """Write ``package`` (``files``, with ``layers.py``) to a site-packages folder that JAX's own
    rule skips (as an interpreter whose site-packages lies inside the standard library's folder,
    without a virtualenv), lower a step through its ``layer`` for TPU (``patch(modules)`` first,
    given the imported modules by file stem), and parse the module."""
    import importlib

    from jax._src import source_info_util as siu

    from hloopt.hlo.parser import parse_module

    site = tmp_path / "site-packages"
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text("")
    for name, text in files.items():
        (site / package / name).write_text(text)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(siu, "_exclude_paths", [*siu._exclude_paths, str(site) + os.sep])
    siu._exclude_path_regex.cache_clear()
    siu.is_user_filename.cache_clear()
    stems = [name[:-3] for name in files]
    try:
        modules = {stem: importlib.import_module(f"{package}.{stem}") for stem in stems}
        if patch is not None:
            patch(modules)
        layers = modules["layers"]

        def step(x, w):
            return jax.grad(lambda w: jnp.sum(layers.layer(x, w)))(w)

        step.__globals__["layers"] = layers  # the step's module uses the library
        s = jax.ShapeDtypeStruct((8, 8), jnp.float32)
        text = lower(step, s, s, platform="tpu").hlo_text
    finally:
        siu._exclude_path_regex.cache_clear()
        siu.is_user_filename.cache_clear()
        for name in [*(f"{package}.{stem}" for stem in stems), package]:
            sys.modules.pop(name, None)
    return parse_module(text)


def _sources(module, opcode: str):  # type: ignore[no-untyped-def]
    found = [i for c in module.computations.values() for i in c.instructions if i.opcode == opcode]
    assert found, opcode
    return {module.source_of(i) for i in found}


def test_a_library_models_ops_are_located_in_the_library_by_package_path(tmp_path, monkeypatch) -> None:
    """An installed model library (here a small one written to a site-packages folder) locates
    its ops at its own layer code, written by package path, even where JAX's own rule skips
    everything installed (an interpreter whose site-packages lies inside the standard library's
    folder, as without a virtualenv)."""
    module = _lower_through_installed_library(tmp_path, monkeypatch, "modellib", {"layers.py": LAYERS})
    assert _sources(module, "dot") == {("modellib/layers.py", 5)}


def test_a_librarys_replacement_of_a_jax_function_is_not_the_models_line(tmp_path, monkeypatch) -> None:
    """A library that replaces a JAX function at import (MaxText wraps
    ``jax.lax.with_sharding_constraint``) is plumbing: the ops that function emits are located at
    the layer that called it, not in the replacement's file, though both are the library's."""
    patch_py = "import jax.numpy as jnp\n\n_orig = jnp.tanh\n\n\ndef tanh(x):\n    return _orig(x)  # patch line 7\n"
    module = _lower_through_installed_library(
        tmp_path, monkeypatch, "shimlib", {"patch.py": patch_py, "layers.py": LAYERS},
        patch=lambda modules: monkeypatch.setattr(jnp, "tanh", modules["patch"].tanh))
    assert _sources(module, "tanh") == {("shimlib/layers.py", 5)}


def test_call_sites_and_hlo_locations_compare_by_package_path() -> None:
    from hloopt.pipeline import relative_source

    for folder in package_folders():
        assert relative_source(f"{folder}maxtext/layers/attentions.py") == "maxtext/layers/attentions.py"
    assert relative_source(os.path.join(os.getcwd(), "model.py")) == "model.py"


DUMPED = """HloModule dumped

FileNames
1 "/home/someone/.venv/lib/python3.11/site-packages/transformers/models/bert/modeling_flax_bert.py"
2 "/usr/lib/python3/dist-packages/flax/linen/linear.py"
3 "/opt/conda/lib/python3.12/site-packages/jax/_src/numpy/lax_numpy.py"

FunctionNames
1 "__call__"
2 "__call__"
3 "matmul"

FileLocations
1 {file_name_id=1 function_name_id=1 line=412 end_line=412 column=8 end_column=30}
2 {file_name_id=2 function_name_id=2 line=250 end_line=250 column=4 end_column=40}
3 {file_name_id=3 function_name_id=3 line=90 end_line=90 column=4 end_column=20}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=2}

ENTRY e {
  x = f32[8,8] parameter(0)
  w = f32[8,8] parameter(1)
  ROOT d = f32[8,8] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/dot_general" stack_frame_id=3}
}
"""


def test_hlo_written_in_another_environment_names_library_files_by_package_path() -> None:
    """An XLA dump a user brings names installed files by the absolute path of the environment
    it was written in; hloopt locates the op at the model library's line (transformers, not
    flax's Dense nor jax's matmul), by package path, and names each frame so."""
    from hloopt.hlo.parser import parse_module
    from hloopt.passes.residuals import LIBRARY_PATHS

    module = parse_module(DUMPED)
    dot = module.entry.root
    assert module.source_of(dot) == ("jax/_src/numpy/lax_numpy.py", 90)
    assert module.user_source_of(dot, skip=LIBRARY_PATHS) == ("transformers/models/bert/modeling_flax_bert.py", 412)
    # a user's own file outside any installed package keeps its path
    mine = DUMPED.replace("/home/someone/.venv/lib/python3.11/site-packages/transformers/models/bert/"
                          "modeling_flax_bert.py", "/home/someone/model.py")
    other = parse_module(mine)
    assert other.user_source_of(other.entry.root, skip=LIBRARY_PATHS) == ("/home/someone/model.py", 412)
