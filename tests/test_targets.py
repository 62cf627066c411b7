"""hloopt.targets: every kind of TARGET, and one clear UserError for every bad one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hloopt.errors import UserError
from hloopt.targets import resolve

ROOT = Path(__file__).resolve().parents[1]
HLO = "HloModule m, entry_computation_layout={()->f32[]}\n\nENTRY e {\n  ROOT c = f32[] constant(1)\n}\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    """A module of pure-Python factories (no jax) covering good and bad returns."""
    return write(tmp_path / "facts.py", """
        CALLS = []

        def step(x, y=0):
            return x + y

        def good(**kw):
            CALLS.append(kw)
            return step, (1,)

        def with_kwargs():
            return step, [1], {"y": 2}

        def make(size="tiny"):
            return step, (len(size),)

        def raises():
            raise ValueError("no weights for you\\nsecond line")

        def returns_int():
            return 3

        def returns_one():
            return (step,)

        def not_callable_step():
            return 3, ()

        def args_not_tuple():
            return step, 1

        def kwargs_not_dict():
            return step, (), [1]

        NOT_A_FUNCTION = 5
        """)


def test_file_factory_returns_step_args_kwargs(factories: Path) -> None:
    target = resolve(f"{factories}:with_kwargs")
    assert target.kind == "jax" and target.args == (1,) and dict(target.kwargs) == {"y": 2}
    assert target.step_fn is not None and target.step_fn(*target.args, **target.kwargs) == 3


def test_size_and_factory_kwargs_reach_the_factory_and_rebuild(factories: Path) -> None:
    target = resolve(f"{factories}:good", size="small", factory_kwargs={"policy": "p1"})
    module = sys.modules[target.factory.__module__]  # type: ignore[union-attr]
    assert module.CALLS[-1] == {"policy": "p1", "size": "small"}
    again = target.rebuild(policy="p2")
    assert module.CALLS[-1] == {"policy": "p2", "size": "small"}
    assert again.factory_kwargs == {"policy": "p2", "size": "small"}


def test_a_bare_py_file_means_its_make_factory(factories: Path) -> None:
    assert resolve(str(factories), size="large").args == (len("large"),)


def test_a_file_in_a_package_keeps_its_relative_imports(tmp_path: Path) -> None:
    write(tmp_path / "pkgzoo" / "__init__.py", "")
    write(tmp_path / "pkgzoo" / "_shared.py", "ARGS = (7,)\n")
    model = write(tmp_path / "pkgzoo" / "model.py", """
        from . import _shared

        def tiny():
            return (lambda x: x), _shared.ARGS
        """)
    assert resolve(f"{model}:tiny").args == (7,)


def test_a_file_outside_a_package_imports_the_modules_beside_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder it adds goes with the test
    write(tmp_path / "proj" / "sibling_model_cfg.py", "ARGS = (11,)\n")
    train = write(tmp_path / "proj" / "train.py", """
        import sibling_model_cfg

        def make():
            return (lambda x: x), sibling_model_cfg.ARGS
        """)
    assert resolve(f"{train}:make").args == (11,)


def test_dotted_module_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "dotted_pkg" / "__init__.py", "")
    write(tmp_path / "dotted_pkg" / "steps.py", "def tiny():\n    return print, ()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve("dotted_pkg.steps:tiny").step_fn is print


@pytest.mark.parametrize(("suffix", "message"), [
    (":nope", "{f}:nope: {f} has no attribute 'nope'"),
    (":NOT_A_FUNCTION", "{f}:NOT_A_FUNCTION: NOT_A_FUNCTION is a int, not a factory function"),
    (":raises", "{f}:raises: raises() raised ValueError: no weights for you"),
    (":returns_int", "{f}:returns_int: returns_int() must return (step_fn, args) or (step_fn, args, kwargs), got a int"),
    (":returns_one", "{f}:returns_one: returns_one() must return (step_fn, args) or (step_fn, args, kwargs), "
                     "got a tuple of 1"),
    (":not_callable_step", "{f}:not_callable_step: not_callable_step() returned a int as step_fn, not a function"),
    (":args_not_tuple", "{f}:args_not_tuple: args_not_tuple() returned args as a int, not a tuple"),
    (":kwargs_not_dict", "{f}:kwargs_not_dict: kwargs_not_dict() returned kwargs as a list, not a dict"),
])
def test_bad_factory_targets(factories: Path, suffix: str, message: str) -> None:
    with pytest.raises(UserError) as err:
        resolve(f"{factories}{suffix}")
    assert str(err.value) == message.format(f=factories)


def test_factory_that_does_not_take_policy(factories: Path) -> None:
    with pytest.raises(UserError) as err:
        resolve(f"{factories}:with_kwargs", factory_kwargs={"policy": None})
    assert str(err.value).startswith(f"{factories}:with_kwargs: with_kwargs(policy=...) does not take these arguments: ")
    assert "unexpected keyword argument 'policy'" in str(err.value)


def test_a_type_error_inside_the_factory_is_the_programs(tmp_path: Path) -> None:
    """A library inside the factory calling an API with a keyword it no longer takes (transformers'
    Flax T5 calls ``jnp.clip(a_max=...)``, gone in jax 0.10) is the program's TypeError, not a
    factory that does not take hloopt's arguments."""
    path = write(tmp_path / "lib_call.py", """
        def clip(x, max=None):
            return x

        def make(size="tiny"):
            clip(1, a_max=2)
        """)
    with pytest.raises(UserError) as err:
        resolve(f"{path}:make", size="tiny")
    assert str(err.value) == (f"{path}:make: make(size=...) raised TypeError: "
                              "clip() got an unexpected keyword argument 'a_max'")


def test_missing_file_and_module(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        resolve(f"{tmp_path}/absent.py:tiny")
    assert str(err.value) == f"{tmp_path}/absent.py:tiny: no such file '{tmp_path}/absent.py'"
    with pytest.raises(UserError) as err:
        resolve("no_such_pkg_hloopt.models:tiny")
    assert str(err.value) == "no_such_pkg_hloopt.models:tiny: no module named 'no_such_pkg_hloopt.models'"
    with pytest.raises(UserError) as err:
        resolve(f"{tmp_path}/model.hlo")
    assert str(err.value).startswith(f"{tmp_path}/model.hlo: no such file or folder (a TARGET is file.py:factory")


def test_module_that_fails_to_import(tmp_path: Path) -> None:
    broken = write(tmp_path / "broken.py", "import not_installed_anywhere_hloopt\n")
    with pytest.raises(UserError) as err:
        resolve(f"{broken}:tiny")
    assert str(err.value) == (f"{broken}:tiny: importing broken.py failed: ModuleNotFoundError: "
                              "No module named 'not_installed_anywhere_hloopt'")
    syntax = write(tmp_path / "syntax.py", "def tiny(:\n")
    with pytest.raises(UserError, match=r"syntax.py:tiny: importing syntax.py failed: SyntaxError: "):
        resolve(f"{syntax}:tiny")


# -- HLO files ---------------------------------------------------------------------------------

def test_hlo_file_target(tmp_path: Path) -> None:
    path = write(tmp_path / "m.hlo", HLO)
    target = resolve(str(path))
    assert (target.kind, target.path, target.text) == ("hlo", path, HLO)
    with pytest.raises(UserError, match="size= and factory keywords apply to a JAX TARGET"):
        resolve(str(path), size="tiny")


def test_hlo_file_target_does_not_import_jax() -> None:
    code = ("import sys; from hloopt.targets import resolve; "
            "t = resolve('fixtures/hlo/zoo/llama.tpu.hlo'); "
            "assert t.kind == 'hlo' and t.text.startswith('HloModule jit_step'); "
            "print(sorted(m for m in ('jax', 'jaxlib', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]", out.stderr


def test_not_hlo_and_mlir_files(tmp_path: Path) -> None:
    text = write(tmp_path / "notes.txt", "hello\n")
    with pytest.raises(UserError) as err:
        resolve(str(text))
    assert str(err.value) == f"{text}: not HLO text (no 'HloModule' line or computation)"
    # modules without their header line, as XLA's parser takes them (XLA's own test files)
    for body in ("ENTRY main {\n  ROOT p = f32[4] parameter(0)\n}\n",
                 "f {\n  ROOT p = f32[4] parameter(0)\n}\n",
                 "%f (a: f32[4]) -> f32[4] {\n  ROOT a = f32[4] parameter(0)\n}\n"):
        assert resolve(str(write(tmp_path / "headless.hlo", body))).kind == "hlo"
    for not_hlo in ('{"a": {"b": 1}}\n', "x = {\n}\n", "notes:\n- a\n"):
        with pytest.raises(UserError, match="not HLO text"):
            resolve(str(write(tmp_path / "other.hlo", not_hlo)))
    mlir = write(tmp_path / "m.mlir", "module @jit_f {}\n")
    with pytest.raises(UserError, match=r"m.mlir: MLIR/StableHLO is not read; give HLO text"):
        resolve(str(mlir))
    binary = tmp_path / "m.hlo"
    binary.write_bytes(b"\xff\xfe\x00HloModule")
    with pytest.raises(UserError, match=r"m.hlo: not a text file"):
        resolve(str(binary))


# -- XLA dump folders --------------------------------------------------------------------------

@pytest.fixture
def dump(tmp_path: Path) -> Path:
    """Names as XLA CPU, GPU and libtpu write them; the train step is the largest jit_ module."""
    d = tmp_path / "dump"
    write(d / "module_0001.jit__where.before_optimizations.txt", HLO)
    write(d / "module_0001.jit__where.cpu_after_optimizations.txt", HLO)
    write(d / "module_0007.jit_step.before_optimizations.txt", HLO + "\n// step\n" * 20)
    write(d / "module_0007.jit_step.cpu_after_optimizations.txt", HLO + "// after\n")
    write(d / "module_0007.jit_step.cpu_after_optimizations-buffer-assignment.txt", "BufferAssignment:\n" * 500)
    write(d / "module_0009.jit_step.sm_8.0_gpu_after_optimizations.txt", HLO + "// gpu\n")
    write(d / "module_0011.jit_step.cl_93374.after_optimizations.txt", HLO + "// tpu\n")
    write(d / "module_0012.big_non_jit.before_optimizations.txt", HLO * 100)
    return d


def test_dump_default_is_the_largest_jit_module(dump: Path) -> None:
    target = resolve(str(dump))
    assert target.kind == "dump"
    assert target.path == dump / "module_0007.jit_step.before_optimizations.txt"


@pytest.mark.parametrize(("module", "stage", "expected"), [
    ("0001", "before", "module_0001.jit__where.before_optimizations.txt"),
    ("jit__where", "after", "module_0001.jit__where.cpu_after_optimizations.txt"),
    ("module_0009.jit_step", "after", "module_0009.jit_step.sm_8.0_gpu_after_optimizations.txt"),
    ("11", "after", "module_0011.jit_step.cl_93374.after_optimizations.txt"),
    ("0011", "after", "module_0011.jit_step.cl_93374.after_optimizations.txt"),
])
def test_dump_module_and_stage_selection(dump: Path, module: str, stage: str, expected: str) -> None:
    target = resolve(str(dump), module=module, stage=stage)
    assert target.path is not None and target.path.name == expected


def test_dump_errors(dump: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        resolve(str(dump), module="jit_step", stage="after")
    assert str(err.value) == (f"{dump}: module 'jit_step' is ambiguous (module_0007.jit_step, "
                              "module_0009.jit_step, module_0011.jit_step); name it by number")
    with pytest.raises(UserError) as err:
        resolve(str(dump), module="12", stage="after")
    assert str(err.value) == (f"{dump}: no module '12' at stage after (have: module_0001.jit__where, "
                              "module_0007.jit_step, module_0009.jit_step, module_0011.jit_step)")
    with pytest.raises(UserError, match=r"unknown stage 'middle': expected one of before, after"):
        resolve(str(dump), stage="middle")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError) as err:
        resolve(str(empty))
    assert str(err.value).startswith(f"{empty}: no module_*.before_optimizations.txt files: not an XLA dump folder")
