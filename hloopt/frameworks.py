"""What hloopt knows of the frameworks models are written in: how each turns checkpointing on, and
how each passes a step's non-array arguments.

A policy governs only values saved inside a ``jax.checkpoint`` region. A program that saves its
residuals outside any (transformers' Flax models by default, a flax module without ``nn.remat``)
leaves hloopt nothing to move; the one useful answer is which switch of *that* framework puts its
layers under ``jax.checkpoint``. The framework is recognised by the packages the program imported
and by the package paths of its residuals' source lines, most specific first (a transformers
model is also a flax model; its own switch is the one to give).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hloopt.units import format_bytes

#: packages models are built with, whose frames never locate an op for a user (the model's own
#: files, transformers' or levanter's or MaxText's, are not among them)
FRAMEWORK_PACKAGES: tuple[str, ...] = (
    "flax", "equinox", "haliax", "haiku", "penzai", "optax", "chex", "jaxtyping", "jmp", "orbax", "qwix", "aqt",
)

#: frameworks whose layer library is model code a user recognizes, with the parts of them that are
#: plumbing (package-relative paths; a folder ends in "/"). Keras 3 runs a functional model by its
#: own graph walker, so no line of the user's is on the stack when an op is traced: the layer's
#: ``call`` (``keras/src/layers/core/dense.py``) is the line to show, not the backend op it calls
#: (``keras/src/backend/jax/numpy.py``) nor the walker (``keras/src/models/functional.py``).
FRAMEWORK_PLUMBING: dict[str, tuple[str, ...]] = {
    "keras": tuple(f"src/{p}" for p in (
        "backend/", "ops/", "models/", "trainers/", "utils/", "activations/", "optimizers/", "random/", "tree/",
        "dtype_policies/", "quantizers/", "distribution/", "initializers/", "regularizers/", "constraints/",
        "legacy/", "export/", "saving/", "callbacks/", "metrics/", "distillation/", "wrappers/", "layers/layer.py",
        "layers/input_spec.py", "layers/activations/", "api_export.py")),
}


def plumbing_paths() -> tuple[str, ...]:
    """Package paths (``keras/src/backend/``) of :data:`FRAMEWORK_PLUMBING`."""
    return tuple(f"{pkg}/{p}" for pkg, parts in FRAMEWORK_PLUMBING.items() for p in parts)


#: (package, how to turn checkpointing on), most specific first
REMAT_SWITCHES: tuple[tuple[str, str], ...] = (
    ("maxtext", "set remat_policy to anything but 'none' in the MaxText config"),
    ("levanter", "set gradient_checkpointing: true in the model config (Haliax Stacked layers)"),
    ("haliax", "build the layer stack with hax.nn.Stacked(..., gradient_checkpointing=True)"),
    ("transformers", "build the model with gradient_checkpointing=True (FlaxModel(config, "
                     "gradient_checkpointing=True) or model.enable_gradient_checkpointing())"),
    ("equinox", "wrap each layer's call in eqx.filter_checkpoint (or jax.checkpoint)"),
    ("flax", "wrap each layer in flax.linen.remat (nn.remat(Block)) or flax.nnx.remat"),
    ("haiku", "wrap each layer's function in hk.remat (hk.remat(block), also under hk.layer_stack)"),
    ("keras", "build the layers inside keras.RematScope(mode='full') or wrap their calls in keras.remat"),
)
GENERIC_SWITCH = "wrap each layer in jax.checkpoint (jax.remat)"


def framework_of(sources: Iterable[str] = (), modules: Iterable[str] | None = None) -> str | None:
    """The most specific known framework among the source paths' packages and imported modules."""
    imported = set(sys.modules if modules is None else modules)
    tops = {s.split("/", 1)[0] for s in sources if "/" in s}
    for package, _ in REMAT_SWITCHES:
        if package in tops or package in imported:
            return package
    return None


def imported_by(fn: object) -> set[str]:
    """Top-level packages a function's module uses: its global modules, and the modules of its
    global classes and functions (``from transformers import FlaxBertModel`` -> transformers)."""
    found: set[str] = set()
    for value in dict(getattr(fn, "__globals__", None) or {}).values():
        name = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
        if isinstance(name, str) and name:
            found.add(name.split(".", 1)[0])
    return found


def remat_switch(framework: str | None) -> str:
    return dict(REMAT_SWITCHES).get(framework or "", GENERIC_SWITCH)


def transformers_without_checkpointing(sources: Iterable[str]) -> list[str]:
    """The transformers Flax models among the source paths (``transformers/models/vit/
    modeling_flax_vit.py`` -> ``vit``) that implement no gradient checkpointing: no class of their
    module defines ``enable_gradient_checkpointing`` (FlaxPreTrainedModel's own raises
    NotImplementedError; transformers 4.57: ViT, GPT-2 and Llama among them), so the switch
    :data:`REMAT_SWITCHES` names does not exist for them."""
    import importlib

    out: list[str] = []
    for model in sorted({parts[2] for parts in (s.split("/") for s in sources)
                         if len(parts) == 4 and parts[:2] == ["transformers", "models"]
                         and parts[3] == f"modeling_flax_{parts[2]}.py"}):
        try:
            mod = importlib.import_module(f"transformers.models.{model}.modeling_flax_{model}")
        except Exception:  # noqa: BLE001 - a model file that no longer imports: say nothing of it
            continue
        if not any(isinstance(v, type) and v.__module__ == mod.__name__ and "enable_gradient_checkpointing" in vars(v)
                   for v in vars(mod).values()):
            out.append(model)
    return out


def unmovable_line(unmovable_bytes: int, framework: str | None, sources: Iterable[str] = ()) -> str | None:
    """One line saying how many residual bytes no policy can move and what to turn on, or None."""
    if unmovable_bytes <= 0:
        return None
    head = (f"{format_bytes(unmovable_bytes)} of residuals no policy can move: the step saves them outside "
            "any jax.checkpoint")
    if framework == "transformers":
        missing = transformers_without_checkpointing(sources)
        if missing:
            return (f"{head}, and transformers' Flax {', '.join(missing)} implements no gradient checkpointing "
                    "(no enable_gradient_checkpointing); to let hloopt plan them, wrap its layer modules in "
                    "flax.linen.remat or use a model that has gradient_checkpointing=True")
    return f"{head}; to let hloopt plan them, {remat_switch(framework)}"


def _is_equinox_jit(step_fn: object) -> bool:
    return type(step_fn).__name__ == "_JitWrapper" and type(step_fn).__module__.startswith("equinox")


def _is_array(x: object) -> bool:
    """An array leaf in equinox's sense (``eqx.is_array``), or its abstract stand-in."""
    import jax
    import numpy as np

    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _is_traceable(x: object) -> bool:
    """A leaf ``jax.jit`` traces: an array, its abstract stand-in, or a Python number."""
    return _is_array(x) or isinstance(x, (bool, int, float, complex))


def _is_traced_by_jit(x: object) -> bool:
    """A leaf hloopt's ``jax.jit`` of a step traces: :func:`_is_traceable`, but a Python ``bool``.
    A flag (``train=True``) steers the step's Python (``if train:``), which a traced bool cannot;
    numbers stay traced (a learning rate is a value of the step)."""
    return _is_traceable(x) and not isinstance(x, bool)


def jittable(step_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``(step_fn, args, kwargs)`` as ``jax.jit`` takes them: non-array leaves held by the step.

    hloopt lowers, compiles and runs a step through ``jax.jit``, which traces every leaf of its
    arguments. Programs pass more than arrays: an Equinox model holds its activation functions and
    Python-number hyperparameters as leaves, and ``eqx.filter_jit`` keeps every non-array leaf
    static (a Python float traced instead becomes an array that ``eqx.is_array`` then takes for a
    parameter). So the leaves the step's own jit would keep static are taken out of the arguments
    and put back inside the step: for an ``eqx.filter_jit`` step (unwrapped; its ``donate=`` kept as
    ``donate_argnums``), every leaf that is not an array; for any other step, the leaves ``jax.jit``
    cannot trace at all (functions, strings, objects) and Python bools (flags such as
    ``train=True``, which the step's Python branches on). The arguments keep their tree paths, so the
    HLO parameters keep their names; such leaves of the step's result are dropped (constants, no
    buffers). A step with only traceable leaves is returned as it is.
    """
    import jax

    if _is_equinox_jit(step_fn):
        fn: Callable[..., Any] = step_fn.__wrapped__  # type: ignore[attr-defined]
        dynamic = _is_array
        first = bool(getattr(step_fn, "donate_first", False))
        rest = bool(getattr(step_fn, "donate_rest", False))
        donate = tuple(i for i in range(len(args)) if (first if i == 0 else rest))
    else:
        fn, dynamic, donate = step_fn, _is_traced_by_jit, ()
        if all(dynamic(x) for x in jax.tree.leaves((args, dict(kwargs)))):
            return step_fn, tuple(args), dict(kwargs)

    def split(tree: Any, keep: bool) -> Any:
        return jax.tree.map(lambda x: x if dynamic(x) == keep else None, tree)

    static_args, static_kwargs = split((tuple(args), dict(kwargs)), False)
    dyn_args, dyn_kwargs = split((tuple(args), dict(kwargs)), True)

    def combine(dyn: Any, static: Any) -> Any:
        return jax.tree.map(lambda d, s: s if d is None else d, dyn, static, is_leaf=lambda x: x is None)

    @functools.wraps(fn)
    def step(*a: Any, **kw: Any) -> Any:
        out = fn(*combine(a, static_args), **combine(kw, static_kwargs))
        # the non-array leaves of what it returns (the updated model's functions) are constants
        # the compiled step does not hold either
        return jax.tree.map(lambda x: x if _is_traceable(x) else None, out)

    try:
        step.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    if donate:
        return jax.jit(step, donate_argnums=donate), dyn_args, dyn_kwargs
    return step, dyn_args, dyn_kwargs
