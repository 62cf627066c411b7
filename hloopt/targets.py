"""TARGET resolution: what a user names on the command line, turned into a program to analyse.

A TARGET is one of

* ``path/to/file.py:factory`` or ``package.module:factory`` -- a JAX program. ``factory(**kw)``
  returns ``(step_fn, args)`` or ``(step_fn, args, kwargs)``; args may hold arrays or
  ``jax.ShapeDtypeStruct``. ``size=`` and ``factory_kwargs`` are passed to the factory. The
  factory need not know about checkpoint policies: hloopt imposes one while tracing the step
  (:mod:`hloopt.policy_override`). A factory that declares ``policy=`` (:attr:`Target.takes_policy`)
  is instead called again with it (:meth:`Target.rebuild`). The step and arguments are kept as
  ``jax.jit`` takes them: leaves the step's own jit keeps static (an ``eqx.filter_jit`` model's
  functions and Python numbers, strings) are held by the step (:func:`hloopt.frameworks.jittable`).
  ``file.py`` alone means ``file.py:make``. A file inside a package (folders with ``__init__.py``)
  is imported under its dotted name, with the folder above the package on ``sys.path``, so its
  relative imports work; a file outside a package has its own folder on ``sys.path``, as
  ``python file.py`` would, so the modules beside it import.
* an HLO text file (``HloModule ...``; ``.hlo`` or ``.txt``). MLIR/StableHLO is not read.
* an XLA dump folder (``--xla_dump_to``): one ``module_NNNN.<name>...<stage>.txt`` is picked,
  by default the ``jit_*`` module with the largest text at the stage (the train step, not the
  small helper computations jax also compiles); ``module=`` picks by name (``jit_step``), number
  (``0001``) or prefix (``module_0001.jit_step``); ``stage`` is ``"before"`` (pre-optimization,
  the default) or ``"after"``.

Every problem with a TARGET is a :class:`UserError` naming the TARGET. Resolving HLO files and dump
folders does not import jax.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hloopt.errors import UserError

KINDS: tuple[str, ...] = ("jax", "hlo", "dump")
STAGES: Mapping[str, str] = MappingProxyType({"before": "before_optimizations", "after": "after_optimizations"})
HLO_SUFFIXES: tuple[str, ...] = (".hlo", ".txt")

# module_0001.jit_step.before_optimizations.txt, module_0001.jit_step.cpu_after_optimizations.txt,
# module_0001.jit_step.sm_8.0_gpu_after_optimizations.txt, module_0000.jit_step.cl_123.after_optimizations.txt
_DUMP_FILE = re.compile(
    r"^module_(?P<number>\d+)\.(?P<name>[^.]+)(?:\..*?)?[._](?P<stage>before_optimizations|after_optimizations)\.txt$")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclasses.dataclass(frozen=True)
class Target:
    """A resolved TARGET."""

    #: the TARGET as the user wrote it
    name: str
    #: "jax" (a step function to lower), "hlo" (an HLO text file) or "dump" (a file in an XLA dump)
    kind: str
    #: jax: the step function
    step_fn: Callable[..., Any] | None = None
    #: jax: positional arguments (arrays or ShapeDtypeStruct pytrees)
    args: tuple[Any, ...] = ()
    #: jax: keyword arguments of the step
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    #: jax: the factory that built the step, for :meth:`rebuild`
    factory: Callable[..., Any] | None = None
    #: jax: the keywords the factory was called with
    factory_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    #: hlo/dump: the HLO text file read
    path: Path | None = None
    #: hlo/dump: its text
    text: str | None = None

    @property
    def takes_policy(self) -> bool:
        """Whether the factory declares a ``policy`` parameter (:func:`declares_policy`)."""
        return self.factory is not None and declares_policy(self.factory)

    def with_policy(self, policy: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """``(step_fn, args, kwargs)`` with every ``jax.checkpoint`` taking ``policy``: the factory
        called again when it declares ``policy=``, else the step traced under the policy
        (:func:`hloopt.apply.apply_policy`)."""
        if self.takes_policy:
            t = self.rebuild(policy=policy)
            assert t.step_fn is not None
            return t.step_fn, tuple(t.args), dict(t.kwargs)
        from hloopt.apply import apply_policy

        assert self.step_fn is not None
        return apply_policy(policy, self.step_fn), tuple(self.args), dict(self.kwargs)

    def rebuild(self, **factory_kwargs: Any) -> Target:
        """Call the factory again with these keywords added (e.g. ``policy=``)."""
        if self.kind != "jax" or self.factory is None:
            raise UserError(f"{self.name}: only a jax TARGET can be rebuilt (with policy= ...); this is {self.kind}")
        return _call_factory(self.name, self.factory, {**self.factory_kwargs, **factory_kwargs})


def declares_policy(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` declares a ``policy`` parameter (a ``**kwargs`` catch-all does not count: a
    factory forwarding keywords into a config would choke on a function)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("policy")
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def resolve(target: str, *, size: str | None = None, factory_kwargs: Mapping[str, Any] | None = None,
            module: str | None = None, stage: str = "before") -> Target:
    """Resolve ``target`` (see the module docstring). ``size`` and ``factory_kwargs`` go to a factory."""
    spec, sep, attr = target.rpartition(":")
    if not sep or os.sep in attr or "/" in attr:
        spec, attr = target, ""
    if spec.endswith(".py") or (attr and _DOTTED.match(spec) and not Path(spec).exists()):
        kw = dict(factory_kwargs or {})
        if size is not None:
            kw["size"] = size
        factory = _load_factory(target, spec, attr or "make")
        return _call_factory(target, factory, kw)
    if size is not None or factory_kwargs:
        raise UserError(f"{target}: size= and factory keywords apply to a JAX TARGET (file.py:factory) only")
    path = Path(target)
    if path.is_dir():
        return _resolve_dump(target, path, module=module, stage=stage)
    if path.is_file():
        return _resolve_hlo_file(target, path)
    if attr and _DOTTED.match(attr):
        raise UserError(f"{target}: no such file {spec!r}")
    raise UserError(f"{target}: no such file or folder (a TARGET is file.py:factory, "
                    "package.module:factory, an HLO text file or an XLA dump folder)")


def _load_factory(target: str, spec: str, attr: str) -> Callable[..., Any]:
    # The program imports jax: hloopt.lowering must set JAX_PLATFORMS=cpu first, or jax starts
    # every backend, libtpu among them (log noise on stderr, and its machine-wide lockfile).
    import hloopt.lowering  # noqa: F401

    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"{target}: no such file {spec!r}")
        module = _import_file(target, path.resolve())
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(spec)
        except ModuleNotFoundError as err:
            if err.name is not None and (spec == err.name or spec.startswith(err.name + ".")):
                raise UserError(f"{target}: no module named {spec!r}") from err
            raise UserError(f"{target}: importing {spec} failed: {type(err).__name__}: {err}") from err
        except Exception as err:
            raise UserError(f"{target}: importing {spec} failed: {type(err).__name__}: {_one_line(err)}") from err
    factory = getattr(module, attr, None)
    if factory is None:
        raise UserError(f"{target}: {spec} has no attribute {attr!r}")
    if not callable(factory):
        raise UserError(f"{target}: {attr} is a {type(factory).__name__}, not a factory function")
    return factory


def _import_file(target: str, path: Path) -> Any:
    """Import ``path`` under its dotted package name when it sits in a package, else standalone."""
    parts = [path.stem]
    root = path.parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    dotted = ".".join(parts)
    try:
        if len(parts) > 1:
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            module = importlib.import_module(dotted)
            if Path(getattr(module, "__file__", "") or "").resolve() != path:
                raise UserError(f"{target}: module {dotted!r} is already imported from {module.__file__}")
            return module
        # as `python file.py` does: the file's folder first on sys.path, so the modules beside it
        # (a model.py next to train.py) import
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        name = f"_hloopt_target_{abs(hash(str(path)))}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"{target}: importing {path.name} failed: {type(err).__name__}: {_one_line(err)}") from err


def _call_factory(target: str, factory: Callable[..., Any], kw: Mapping[str, Any]) -> Target:
    fname = getattr(factory, "__name__", "factory")
    shown = ", ".join(f"{k}=..." for k in kw)
    try:
        result = factory(**kw)
    except TypeError as err:
        msg = _one_line(err)
        # a signature mismatch is raised by the call itself (no frame of the factory's body): a
        # TypeError from deeper down is the program's own (a library calling a removed jax API)
        at_call = err.__traceback__ is None or err.__traceback__.tb_next is None
        if at_call and ("unexpected keyword" in msg or "positional argument" in msg):
            raise UserError(f"{target}: {fname}({shown}) does not take these arguments: {msg}") from err
        raise UserError(f"{target}: {fname}({shown}) raised TypeError: {msg}") from err
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"{target}: {fname}({shown}) raised {type(err).__name__}: {_one_line(err)}") from err
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise UserError(f"{target}: {fname}() must return (step_fn, args) or (step_fn, args, kwargs), "
                        f"got {_describe(result)}")
    step_fn, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if not callable(step_fn):
        raise UserError(f"{target}: {fname}() returned a {type(step_fn).__name__} as step_fn, not a function")
    if not isinstance(args, (tuple, list)):
        raise UserError(f"{target}: {fname}() returned args as a {type(args).__name__}, not a tuple")
    if not isinstance(kwargs, Mapping):
        raise UserError(f"{target}: {fname}() returned kwargs as a {type(kwargs).__name__}, not a dict")
    from hloopt.frameworks import jittable

    step_fn, args, kwargs = jittable(step_fn, tuple(args), kwargs)
    return Target(name=target, kind="jax", step_fn=step_fn, args=tuple(args), kwargs=MappingProxyType(dict(kwargs)),
                  factory=factory, factory_kwargs=MappingProxyType(dict(kw)))


#: the first line of HLO text: the module header, or a computation's (``ENTRY main {``,
#: ``fused (p: f32[4]) -> f32[4] {``)
_HLO_START = re.compile(r"^\s*(HloModule\s|(ENTRY\s+)?%?[\w.\-]+\s*(\([^)]*\)\s*->\s*\S[^{]*)?\{\s*$)",
                        re.MULTILINE)


def _resolve_hlo_file(target: str, path: Path) -> Target:
    if path.suffix == ".mlir":
        raise UserError(f"{target}: MLIR/StableHLO is not read; give HLO text "
                        "(lowered.as_text(dialect='hlo') or an XLA dump)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"{target}: not a text file (HLO text expected)") from None
    except OSError as err:
        raise UserError(f"{target}: cannot read: {err.strerror}") from err
    # XLA's parser also takes a module without its header line: computations, the ENTRY one
    # marked or the last
    if not _HLO_START.search(text):
        raise UserError(f"{target}: not HLO text (no 'HloModule' line or computation)")
    return Target(name=target, kind="hlo", path=path, text=text)


def dump_modules(folder: Path, stage: str = "before") -> dict[str, Path]:
    """``{"module_NNNN.name": path}`` of the dump files at ``stage`` in an XLA dump folder."""
    wanted = STAGES[stage]
    found: dict[str, Path] = {}
    for entry in sorted(folder.iterdir()):
        m = _DUMP_FILE.match(entry.name)
        if m and m["stage"] == wanted and entry.is_file():
            found[f"module_{m['number']}.{m['name']}"] = entry
    return found


def _resolve_dump(target: str, folder: Path, *, module: str | None, stage: str) -> Target:
    if stage not in STAGES:
        raise UserError(f"{target}: unknown stage {stage!r}: expected one of {', '.join(STAGES)}")
    modules = dump_modules(folder, stage)
    if not modules:
        raise UserError(f"{target}: no module_*.{STAGES[stage]}.txt files: not an XLA dump folder "
                        "(dump with XLA_FLAGS='--xla_dump_to=DIR --xla_dump_hlo_as_text')")
    if module is not None:
        def number(key: str) -> int:
            return int(key.split(".", 1)[0].removeprefix("module_"))

        picked = [key for key in modules
                  if module in (key, key.split(".", 1)[1]) or (module.isdigit() and int(module) == number(key))]
        if not picked:
            raise UserError(f"{target}: no module {module!r} at stage {stage} (have: {', '.join(modules)})")
        if len(picked) > 1:
            raise UserError(f"{target}: module {module!r} is ambiguous ({', '.join(picked)}); name it by number")
        key = picked[0]
    else:
        jitted = [key for key in modules if key.split(".", 1)[1].startswith("jit_")] or list(modules)
        key = max(jitted, key=lambda k: modules[k].stat().st_size)
    path = modules[key]
    return Target(name=target, kind="dump", path=path, text=path.read_text())


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"
