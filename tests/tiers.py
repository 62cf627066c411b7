"""CI's sample of a side-by-side comparison and the full tier (``pytest --full``, tests/conftest.py).

A comparison parametrized over steps, sizes or budgets runs in CI on the cases in ``ci``; the others
are marked ``full``: every code path they take is taken by a CI case, and they add compile minutes
that would put CI past its limit on 2 cores."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from _pytest.mark.structures import ParameterSet


def _key(p: Any) -> Any:
    if isinstance(p, ParameterSet):
        return p.values[0] if len(p.values) == 1 else tuple(p.values)
    return p


def ci_sample(params: Iterable[Any], ci: Iterable[Any]) -> list[Any]:
    """``params`` (values, ``pytest.param``, or tuples: the values of several argnames) with every
    one whose value is not in ``ci`` marked ``full``. ``ci`` must name at least one case and only
    cases of ``params`` (a renamed case is an error); a test with no CI case is marked ``full``."""
    params, ci = list(params), list(ci)
    keys = [_key(p) for p in params]
    missing = [c for c in ci if c not in keys]
    if not ci or missing:
        raise ValueError(f"CI cases {ci} are not a non-empty subset of {keys}")
    out = []
    for p, k in zip(params, keys):
        if k in ci:
            out.append(p)
        elif isinstance(p, ParameterSet):
            out.append(pytest.param(*p.values, marks=[*p.marks, pytest.mark.full], id=p.id))
        else:
            out.append(pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.full))
    return out
