"""Analyses over the HLO IR, one per module, and the manager that runs and caches them.

An *analysis* builds a result object that others only read (XLA's ``HloLiveRange::Run``); it is a
small frozen dataclass whose fields are its options, with ``name`` (kebab-case) as a ClassVar.
Analyses ask for the results they depend on through an :class:`AnalysisManager`, which runs each
(analysis, options) once per module and caches the result::

    am = AnalysisManager(module)
    ranges = am.get(Liveness(schedule="module"))      # runs BufferAliasing once, through am
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from hloopt.ir import Module

R = TypeVar("R")


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


__all__ = ["Analysis", "AnalysisManager"]
