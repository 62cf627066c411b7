"""Exact solver: a MILP over the schedule's memory constraints and the link's queues (HiGHS).

Variables: binary ``x[c, a]`` per candidate and allowed non-device action (at most one per
candidate; none means DEVICE); continuous ``Q[s]`` = seconds of copy-out work still queued at the
start of step ``s``; continuous ``W[t]`` = seconds of reload work that must be done before step
``t`` starts.

    min   sum_c,a added_s[c, a] * x[c, a]                  (recompute + nominal reload stalls)
    s.t.  sum_a x[c, a] <= 1
          Q[s] >= Q[s-1] - dur[s-1] + sum_{i produced at s-1} d2h_s[i] * x[c(i), OFF],  Q >= 0
          W[t] >= W[t+1] - dur[t]   + sum_{i first read at t} h2d_s[i] * x[c(i), OFF],  W >= 0
          for each binding step s:
            dev[s] - sum_{i: lfu_i < s < fbu_i} bytes_i * (x[c(i), OFF] + x[c(i), REM])
                   + d2h_rate * Q[s] + h2d_rate * W[s+1]  <=  target[s]

The two recursions are Lindley's queue equations: a FIFO copy-out queue (the simulator serves
copies out in production order) and the as-late-as-possible reload plan (the simulator plans
reloads backwards from their deadlines), so bytes still waiting to leave, or already brought
back early, count against the budget. Queued bytes are counted as a fraction of their instance
(the simulator counts an instance in flight whole), so the model can be short by about one
instance per step; and bytes queued before their last forward use are counted twice (safe).

Binding steps (dominance pruning): the all-device excess ``dev - target`` changes coverage only
where some instance's gap starts or ends; within each such segment only the step of largest
excess is kept. Replay decides: steps the simulator finds over budget are added and their target
lowered by the excess, and the MILP is solved again (a few rounds). The result names the HiGHS
model status and mip_gap of the last solve; the plan is always a replayed one within budget.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import highspy
import numpy as np

from hloopt.problem import Decisions, Problem, SimResult
from hloopt.simulator import simulate
from hloopt.solvers import new_highs
from hloopt.solvers._model import DEV, OFF, REM, Model

__all__ = ["MilpResult", "solve_milp"]

_ROUNDS = 6


@dataclass(frozen=True)
class MilpResult:
    decisions: Decisions
    sim: SimResult
    choice: np.ndarray
    #: HiGHS model status of the last solve ("Optimal", "Time limit reached", ...).
    status: str
    #: Relative gap between the incumbent and the dual bound of the last solve (0 when optimal).
    mip_gap: float
    #: Modeled added seconds of the last solve's incumbent and its proven lower bound.
    objective_s: float
    bound_s: float
    #: Whether the last solve proved optimality *and* its plan replayed within budget as is.
    optimal: bool
    #: "milp" when the plan is the MILP's own, "incumbent" when the seeded plan replayed better.
    source: str
    rounds: int
    solve_s: float
    n_binary: int
    n_rows: int


def _binding_steps(m: Model, target: np.ndarray, extra: set[int]) -> np.ndarray:
    excess = m.dev_bytes - target
    events = np.unique(np.concatenate([
        [0], m.gap0[:, REM] if m.n_cands else [], m.first_bwd, [m.n_steps]]).astype(np.int64))
    events = events[(events >= 0) & (events <= m.n_steps)]
    keep: list[int] = []
    for lo, hi in zip(events[:-1].tolist(), events[1:].tolist()):
        if hi <= lo:
            continue
        seg = excess[lo:hi]
        k = int(np.argmax(seg))
        if seg[k] > 0:
            keep.append(lo + k)
    keep.extend(s for s in extra if excess[s] > 0 or True)
    return np.unique(np.array(keep, dtype=np.int64))


def _build(m: Model, target: np.ndarray, steps: np.ndarray, added: np.ndarray):
    T = m.n_steps
    cols_c, cols_a = np.nonzero(m.allowed[:, 1:])
    cols_a = cols_a + 1
    nx = len(cols_c)
    xcol = -np.ones((m.n_cands, 3), dtype=np.int64)
    xcol[cols_c, cols_a] = np.arange(nx)
    use_link = bool(m.allowed[:, OFF].any())
    q0 = nx
    w0 = nx + (T if use_link else 0)
    ncol = w0 + ((T + 1) if use_link else 0)
    cost = np.zeros(ncol)
    cost[:nx] = added[cols_c, cols_a]
    lower = np.zeros(ncol)
    upper = np.ones(ncol)
    upper[nx:] = math.inf
    if use_link:
        upper[w0 + T] = 0.0

    rr: list[np.ndarray] = []
    cc: list[np.ndarray] = []
    vv: list[np.ndarray] = []
    rlo: list[np.ndarray] = []
    rhi: list[np.ndarray] = []
    nrow = 0

    def add(rows, cols, vals, lo, hi):
        nonlocal nrow
        rr.append(np.asarray(rows, dtype=np.int64) + nrow)
        cc.append(np.asarray(cols, dtype=np.int64))
        vv.append(np.asarray(vals, dtype=np.float64))
        rlo.append(np.asarray(lo, dtype=np.float64))
        rhi.append(np.asarray(hi, dtype=np.float64))
        nrow += len(lo)

    # One action per candidate.
    two = np.nonzero((xcol[:, OFF] >= 0) & (xcol[:, REM] >= 0))[0]
    if len(two):
        k = np.arange(len(two))
        add(np.concatenate([k, k]), np.concatenate([xcol[two, OFF], xcol[two, REM]]),
            np.ones(2 * len(two)), np.full(len(two), -math.inf), np.ones(len(two)))

    inst_off = xcol[m.inst_cand, OFF]
    has_off = inst_off >= 0
    if use_link:
        # Q[s] - Q[s-1] - sum d x >= -dur[s-1]  and  Q[s] - sum d x >= 0, for s = 1..T-1.
        s = np.arange(1, T)
        sel = has_off & (m.produced + 1 < T)
        qs = m.produced[sel] + 1  # queue step where the copy is released
        for with_prev in (True, False):
            rows = [s - 1]
            cols = [q0 + s]
            vals = [np.ones(T - 1)]
            if with_prev:
                rows.append(s - 1)
                cols.append(q0 + s - 1)
                vals.append(-np.ones(T - 1))
            rows.append(qs - 1)
            cols.append(inst_off[sel])
            vals.append(-m.d2h_s[sel])
            lo = -m.duration_s[:-1] if with_prev else np.zeros(T - 1)
            add(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), lo, np.full(T - 1, math.inf))
        # W[t] - W[t+1] - sum h x >= -dur[t]  and  W[t] - sum h x >= 0, for t = 0..T-1.
        t = np.arange(T)
        ft = m.first_bwd[has_off]
        for with_next in (True, False):
            rows = [t, ft]
            cols = [w0 + t, inst_off[has_off]]
            vals = [np.ones(T), -m.h2d_s[has_off]]
            if with_next:
                rows.append(t)
                cols.append(w0 + t + 1)
                vals.append(-np.ones(T))
            lo = -m.duration_s if with_next else np.zeros(T)
            add(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), lo, np.full(T, math.inf))

    # Memory at binding steps: sum b x - rate_d Q - rate_h W >= dev - target.
    if len(steps):
        g0 = m.gap0[:, REM]
        g1 = m.first_bwd - 1
        rows, cols, vals = [], [], []
        for a in (OFF, REM):
            xc = xcol[m.inst_cand, a]
            ok = xc >= 0
            if not ok.any():
                continue
            lo_idx = np.searchsorted(steps, g0[ok], side="left")
            hi_idx = np.searchsorted(steps, g1[ok], side="right")
            n = np.maximum(hi_idx - lo_idx, 0)
            if n.sum() == 0:
                continue
            inst = np.repeat(np.arange(ok.sum()), n)
            offs = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
            rows.append(np.repeat(lo_idx, n) + offs)
            cols.append(xc[ok][inst])
            vals.append(m.inst_bytes[ok][inst].astype(np.float64))
        k = np.arange(len(steps))
        if use_link:
            rows += [k, k]
            cols += [q0 + steps, w0 + steps + 1]
            vals += [np.full(len(steps), -m.problem.d2h_bytes_per_s),
                     np.full(len(steps), -m.problem.h2d_bytes_per_s)]
        add(np.concatenate(rows) if rows else np.zeros(0, np.int64),
            np.concatenate(cols) if cols else np.zeros(0, np.int64),
            np.concatenate(vals) if vals else np.zeros(0), (m.dev_bytes[steps] - target[steps]).astype(np.float64),
            np.full(len(steps), math.inf))

    R = np.concatenate(rr) if rr else np.zeros(0, np.int64)
    Cc = np.concatenate(cc) if cc else np.zeros(0, np.int64)
    V = np.concatenate(vv) if vv else np.zeros(0)
    # Merge duplicates (several instances of one candidate in one row), column-wise storage.
    key = Cc * max(nrow, 1) + R
    uk, inv = np.unique(key, return_inverse=True)
    val = np.bincount(inv, weights=V, minlength=len(uk))
    col = uk // max(nrow, 1)
    row = uk % max(nrow, 1)
    nz = val != 0
    col, row, val = col[nz], row[nz], val[nz]
    start = np.searchsorted(col, np.arange(ncol + 1))

    lp = highspy.HighsLp()
    lp.num_col_ = ncol
    lp.num_row_ = nrow
    lp.col_cost_ = cost
    lp.col_lower_ = lower
    lp.col_upper_ = upper
    lp.row_lower_ = np.concatenate(rlo) if rlo else np.zeros(0)
    lp.row_upper_ = np.concatenate(rhi) if rhi else np.zeros(0)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start
    lp.a_matrix_.index_ = row
    lp.a_matrix_.value_ = val
    lp.a_matrix_.num_col_ = ncol
    lp.a_matrix_.num_row_ = nrow
    integ = [highspy.HighsVarType.kContinuous] * ncol
    for j in range(nx):
        integ[j] = highspy.HighsVarType.kInteger
    lp.integrality_ = integ
    return lp, cols_c, cols_a, nx, nrow, (q0, w0, use_link)


def _link_values(m: Model, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q and W of the recursions at their least values for ``choice`` (for a warm start)."""
    T = m.n_steps
    off = choice[m.inst_cand] == OFF
    rel = np.bincount(m.produced[off] + 1, weights=m.d2h_s[off], minlength=T + 1)
    due = np.bincount(m.first_bwd[off], weights=m.h2d_s[off], minlength=T + 1)
    Q = np.zeros(T)
    for s in range(1, T):
        Q[s] = max(rel[s], Q[s - 1] - m.duration_s[s - 1] + rel[s])
    W = np.zeros(T + 1)
    for t in range(T - 1, -1, -1):
        W[t] = max(due[t], W[t + 1] - m.duration_s[t] + due[t])
    return Q, W


def solve_milp(
    problem: Problem,
    *,
    budget_bytes: int,
    time_limit_s: float = 30.0,
    model: Model | None = None,
    incumbent: np.ndarray | None = None,
    mip_rel_gap: float = 1e-6,
) -> MilpResult:
    """Least modeled step time with replayed peak <= ``budget_bytes`` (see the module doc).

    ``incumbent``: a known plan (action column per candidate) given to HiGHS as a start and kept
    when it replays better than the MILP's own plan. Raises RuntimeError when no plan replays
    within the budget.
    """
    t0 = time.perf_counter()
    m = model if model is not None else Model.build(problem)
    added = m.added_s()
    target = np.full(m.n_steps, budget_bytes, dtype=np.int64)
    extra: set[int] = set()
    best: tuple[float, np.ndarray, SimResult, str] | None = None
    if incumbent is not None:
        sim_inc = simulate(problem, m.decisions_of(incumbent))
        if sim_inc.peak_bytes <= budget_bytes:
            best = (sim_inc.step_time_s, incumbent.copy(), sim_inc, "incumbent")
    status, gap, obj, bound, optimal = "not run", math.inf, math.nan, math.nan, False
    nx = nrow = 0
    rounds = 0
    for rounds in range(1, _ROUNDS + 1):
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0.05:
            break
        steps = _binding_steps(m, target, extra)
        lp, cols_c, cols_a, nx, nrow, (q0, w0, use_link) = _build(m, target, steps, added)
        h = new_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(left))
        h.setOptionValue("mip_rel_gap", mip_rel_gap)
        h.setOptionValue("threads", 1)
        h.passModel(lp)
        if best is not None:
            start = np.zeros(lp.num_col_)
            ch = best[1]
            start[:nx] = (ch[cols_c] == cols_a).astype(float)
            if use_link:
                Q, W = _link_values(m, ch)
                start[q0:q0 + m.n_steps] = Q
                start[w0:w0 + m.n_steps + 1] = W
            sol = highspy.HighsSolution()
            sol.col_value = start.tolist()
            sol.value_valid = True
            h.setSolution(sol)
        h.run()
        ms = h.getModelStatus()
        status = h.modelStatusToString(ms)
        info = h.getInfo()
        if info.primal_solution_status != 2:  # no feasible point
            optimal = False
            break
        gap = float(info.mip_gap)
        obj = float(info.objective_function_value)
        bound = float(info.mip_dual_bound)
        xv = np.asarray(h.getSolution().col_value[:nx])
        choice = np.zeros(m.n_cands, dtype=np.int64)
        on = xv > 0.5
        choice[cols_c[on]] = cols_a[on]
        sim = simulate(problem, m.decisions_of(choice))
        optimal = ms == highspy.HighsModelStatus.kOptimal
        if sim.peak_bytes <= budget_bytes:
            if best is None or sim.step_time_s < best[0] - 1e-12 or best[3] != "incumbent" \
                    or sim.step_time_s <= best[0] + 1e-12:
                if best is None or sim.step_time_s <= best[0] + 1e-12:
                    best = (sim.step_time_s, choice, sim, "milp")
            break
        optimal = False
        real = np.asarray(sim.timeline_bytes, dtype=np.int64)
        over = np.nonzero(real > budget_bytes)[0]
        target[over] -= real[over] - budget_bytes
        extra.update(over.tolist())
    if best is None:
        raise RuntimeError(f"MILP found no plan that replays within {budget_bytes} bytes ({status})")
    _, choice, sim, source = best
    return MilpResult(
        decisions=m.decisions_of(choice), sim=sim, choice=choice, status=status, mip_gap=gap,
        objective_s=obj, bound_s=bound, optimal=optimal and source == "milp", source=source,
        rounds=rounds, solve_s=time.perf_counter() - t0, n_binary=nx, n_rows=nrow)
