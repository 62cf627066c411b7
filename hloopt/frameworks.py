"""What hloopt knows of the frameworks models are written in: how each turns checkpointing on.

A policy governs only values saved inside a ``jax.checkpoint`` region. A program that saves its
residuals outside any (transformers' Flax models by default, a flax module without ``nn.remat``)
leaves hloopt nothing to move; the one useful answer is which switch of *that* framework puts its
layers under ``jax.checkpoint``. The framework is recognised by the packages the program imported
and by the package paths of its residuals' source lines, most specific first (a transformers
model is also a flax model; its own switch is the one to give).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from hloopt.units import format_bytes

#: packages models are built with, whose frames never locate an op for a user (the model's own
#: files, transformers' or levanter's or MaxText's, are not among them)
FRAMEWORK_PACKAGES: tuple[str, ...] = (
    "flax", "equinox", "haliax", "optax", "chex", "jaxtyping", "jmp", "orbax", "qwix", "aqt",
)

#: (package, how to turn checkpointing on), most specific first
REMAT_SWITCHES: tuple[tuple[str, str], ...] = (
    ("maxtext", "set remat_policy to anything but 'none' in the MaxText config"),
    ("levanter", "set gradient_checkpointing: true in the model config (Haliax Stacked layers)"),
    ("haliax", "build the layer stack with hax.nn.Stacked(..., gradient_checkpointing=True)"),
    ("transformers", "build the model with gradient_checkpointing=True (FlaxModel(config, "
                     "gradient_checkpointing=True) or model.enable_gradient_checkpointing())"),
    ("equinox", "wrap each layer's call in eqx.filter_checkpoint (or jax.checkpoint)"),
    ("flax", "wrap each layer in flax.linen.remat (nn.remat(Block)) or flax.nnx.remat"),
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


def unmovable_line(unmovable_bytes: int, framework: str | None) -> str | None:
    """One line saying how many residual bytes no policy can move and what to turn on, or None."""
    if unmovable_bytes <= 0:
        return None
    return (f"{format_bytes(unmovable_bytes)} of residuals no policy can move: the step saves them outside "
            f"any jax.checkpoint; to let hloopt plan them, {remat_switch(framework)}")
