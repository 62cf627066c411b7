"""Lower bounds: the least peak any policy reaches, and the least step time at a budget.

* Peak: the simulator's :func:`~hloopt.simulator.lower_bound_peak` (every movable residual off
  device between its last forward and first backward use, as with an ideal link).
* Time at a budget: compute time plus the optimum of a linear relaxation, when it is small
  enough to solve (at most ``_LP_MAX_NONZEROS`` matrix entries), else compute time alone (no
  policy beats running every step once with no stall: :func:`~hloopt.simulator.lower_bound_time`).
  The relaxation: ``x[c, a]`` in [0, 1], one action per candidate; a REMAT instance is off device
  exactly on ``(last_forward_use, first_backward_use)`` and costs its share of ``remat_s``; an
  OFFLOAD instance costs nothing but gives back its share of ``keep_s``, and is off device on
  its *single-instance nominal gap* (its copy out alone on the link, its reload alone, as late
  as possible: the widest a queue lets
  it be off in the stall-free timeline); every step whose all-device bytes exceed the budget
  must be brought under it. It is a bound of the nominal model: stalls that shift a reload's
  start into a later step could free a few more steps than the model grants.

:func:`check_budget` raises :class:`~hloopt.errors.InfeasibleBudget` with the floor in words.
"""

from __future__ import annotations

from hloopt.errors import InfeasibleBudget
from hloopt.problem import Problem
from hloopt.simulator import lower_bound_peak, lower_bound_time
from hloopt.units import format_bytes

__all__ = ["check_budget", "least_peak_bytes", "least_time_s"]


def least_peak_bytes(problem: Problem) -> int:
    """Least peak any policy can reach (bytes)."""
    return lower_bound_peak(problem)


#: Largest LP (constraint matrix entries) :func:`least_time_s` solves; beyond it, compute time.
_LP_MAX_NONZEROS = 2_000_000


def least_time_s(problem: Problem, *, budget_bytes: int | None = None, model=None) -> float:
    """Least step time (seconds) at ``budget_bytes``: compute time plus the LP relaxation's
    optimum (module doc); compute time alone without a budget or when the LP is too large."""
    base = lower_bound_time(problem)
    if budget_bytes is None or not problem.candidates:
        return base
    import math

    import highspy
    import numpy as np

    from hloopt.solvers import new_highs
    from hloopt.solvers._model import OFF, REM, Model

    m = model if model is not None else Model.build(problem)
    over = np.nonzero(m.dev_bytes > budget_bytes)[0]
    if len(over) == 0:
        return base
    cols_c, cols_a = np.nonzero(m.allowed[:, 1:])
    cols_a = cols_a + 1
    nx = len(cols_c)
    if nx == 0:
        return base
    xcol = -np.ones((m.n_cands, 3), dtype=np.int64)
    xcol[cols_c, cols_a] = np.arange(nx)
    rows, cols, vals = [], [], []
    for a in (OFF, REM):
        xc = xcol[m.inst_cand, a]
        ok = (xc >= 0) & (m.gap0[:, a] <= m.gap1[:, a])
        lo = np.searchsorted(over, m.gap0[ok, a], side="left")
        hi = np.searchsorted(over, m.gap1[ok, a], side="right")
        n = np.maximum(hi - lo, 0)
        if n.sum() > _LP_MAX_NONZEROS:
            return base
        inst = np.repeat(np.arange(ok.sum()), n)
        offs = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        rows.append(np.repeat(lo, n) + offs)
        cols.append(xc[ok][inst])
        vals.append(m.inst_bytes[ok][inst].astype(np.float64))
    two = np.nonzero((xcol[:, OFF] >= 0) & (xcol[:, REM] >= 0))[0]
    nrow = len(over) + len(two)
    rows.append(len(over) + np.repeat(np.arange(len(two)), 2))
    cols.append(np.stack([xcol[two, OFF], xcol[two, REM]], axis=1).ravel())
    vals.append(np.ones(2 * len(two)))
    R, Cc, V = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    if len(V) > _LP_MAX_NONZEROS:
        return base
    key = Cc * nrow + R
    uk, inv = np.unique(key, return_inverse=True)
    val = np.bincount(inv, weights=V, minlength=len(uk))
    col, row = uk // nrow, uk % nrow
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = nx, nrow
    lp.col_cost_ = np.where(cols_a == REM, m.remat_s[cols_c], np.where(cols_a == OFF, -m.keep_s[cols_c], 0.0))
    lp.col_lower_ = np.zeros(nx)
    lp.col_upper_ = np.ones(nx)
    lp.row_lower_ = np.concatenate([(m.dev_bytes[over] - budget_bytes).astype(np.float64),
                                    np.full(len(two), -math.inf)])
    lp.row_upper_ = np.concatenate([np.full(len(over), math.inf), np.ones(len(two))])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.searchsorted(col, np.arange(nx + 1))
    lp.a_matrix_.index_ = row
    lp.a_matrix_.value_ = val  # type: ignore[assignment]  # bincount(weights=) is float64; its stub says int
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = nx, nrow
    h = new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", 10.0)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return base
    # Dual-feasible objective rounded down a hair: the bound must not exceed the LP optimum.
    return base + max(0.0, float(h.getInfo().objective_function_value) * (1 - 1e-9))


def check_budget(problem: Problem, budget_bytes: int) -> int:
    """Return the least peak; raise InfeasibleBudget when ``budget_bytes`` is below it."""
    floor = least_peak_bytes(problem)
    if budget_bytes < floor:
        raise InfeasibleBudget(below_least_peak(budget_bytes, floor))
    return floor


def below_least_peak(budget_bytes: int, least_bytes: int) -> str:
    """The one line for a budget under the least peak (exact bytes where both round alike)."""
    b, f = format_bytes(budget_bytes), format_bytes(least_bytes)
    if b == f:
        b, f = f"{budget_bytes:,} B", f"{least_bytes:,} B"
    return f"budget {b} is below the least peak any policy reaches: needs at least {f}"
