"""Analyses over the HLO IR, one per module, and a lazy registry of them by kebab-case name.

An *analysis* builds a result object that others only read (XLA's ``HloLiveRange::Run``); it is a
small frozen dataclass whose fields are its options, with ``name`` (kebab-case) as a ClassVar.
Analyses ask for the results they depend on through an :class:`AnalysisManager`, which runs each
(analysis, options) once per module and caches the result::

    am = AnalysisManager(module)
    ranges = am.get(Liveness(schedule="module"))      # runs BufferAliasing once, through am

The registry maps names to ``module:Class`` strings so that listing passes imports nothing heavy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from hloopt.ir import Module

R = TypeVar("R")

#: kebab-case name -> "module:Class" inside this package
PASSES: dict[str, str] = {
    "buffer-aliasing": "aliasing:BufferAliasing",
    "schedule": "schedule:Schedule",
    "liveness": "liveness:Liveness",
    "peak-memory": "memory:PeakMemory",
    "residuals": "residuals:FindResiduals",
    "cost": "cost:CostAnalysis",
}


@dataclass(frozen=True)
class Analysis(Generic[R]):
    """Base of every analysis: a frozen dataclass of options with a ``run`` method."""

    name: ClassVar[str] = ""

    def run(self, module: Module, am: "AnalysisManager") -> R:  # pragma: no cover - every analysis overrides it
        raise TypeError(f"analysis {type(self).__name__} defines no run()")


class AnalysisManager:
    """Runs analyses on one module and caches each result by the analysis (its options included)."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self._cache: dict[Analysis[Any], Any] = {}

    def get(self, analysis: Analysis[R]) -> R:
        if analysis not in self._cache:
            self._cache[analysis] = analysis.run(self.module, self)
        return self._cache[analysis]  # type: ignore[no-any-return]


def get_pass(name: str) -> type[Analysis[Any]]:
    """The analysis class registered under ``name`` (imported on first use)."""
    try:
        spec = PASSES[name]
    except KeyError:
        from hloopt.errors import UserError

        raise UserError(f"unknown pass {name!r}: expected one of {', '.join(sorted(PASSES))}") from None
    mod, attr = spec.split(":")
    cls: type[Analysis[Any]] = getattr(importlib.import_module(f"hloopt.passes.{mod}"), attr)
    return cls


__all__ = ["Analysis", "AnalysisManager", "PASSES", "get_pass"]
