"""Exact solver: a MILP over the schedule's memory constraints and the link's queues (HiGHS).

Columns: binary ``x[c, a]`` per candidate and allowed non-device action (none set: DEVICE);
continuous ``F[k]`` = bytes the decisions free at kept step ``s_k``; ``Q[s]`` = seconds of
copy-out work queued at the start of step ``s``; ``W[t]`` = seconds of reload work that must be
done before step ``t`` starts. Bytes are in units of the largest instance, seconds in units of
the mean step, the objective in units of compute time (offset 1), so HiGHS's relative gap is
relative to the modeled step time.

    min   1 + sum_c,a added_s[c, a] * x[c, a] / compute_s   (recompute + nominal reload stalls)
    s.t.  sum_a x[c, a] <= 1
          F[k] = F[k-1] + sum_{i: gap_i starts covering s_k} b_i x_i - sum_{i: gap_i stopped} b_i x_i
                 (gap_i = (last_forward_use_i, first_backward_use_i), for OFFLOAD and REMAT)
          Q[j] >= Q[j-1] - engines * (start[j] - start[j-1]) + sum_{i released at j} d2h_s[i] x_i,
          Q[j] >= sum_{i released at j} d2h_s[i] x_i          (released: end of the producing step)
          W[j] >= W[j+1] - engines * (start[j+1] - start[j]) + sum_{i first read at j} h2d_s[i] x_i,
          W[j] >= sum_{i first read at j} h2d_s[i] x_i
          dev[s_k] - F[k] + d2h_rate * Q[s_k] + h2d_rate * W[s_k + 1] <= target[s_k]   per kept step

The Q and W recursions are Lindley's queue equations, linear because Q and W only appear with
a positive sign in the memory rows (their least values are the exact queue lengths): a FIFO
copy-out queue (the simulator serves copies out in production order) and the as-late-as-possible
reload plan (the simulator plans reloads backwards from their deadlines), so bytes still waiting
to leave, or already brought back early, count against the budget. Q is a column only at release
steps and kept steps, W only at first-read steps and after kept steps: between two such steps
nothing is released or due, so one recursion over the interval is exact. With an ideal link
(infinite rate) there is no queue term.

What the model leaves out (the replay judges): queued bytes count as ``rate * seconds``, so the
copy at the head of a queue counts as the fraction not yet moved (the simulator counts it whole:
up to one instance per direction short); a copy out that overlaps its own forward uses, or its
own reload, counts twice (safe); duplex slowdowns; stalls from queueing (the objective charges
each reload's stall as if it had the link alone).

Rows (exact pruning): a memory row is written only at *kept* steps. Between two consecutive
events (a gap starting or ending, a copy released, a reload due) F is constant and the least Q
and W are convex in time (``max(0, Q0 - elapsed)``), so a step whose excess ``dev - target`` is
at most that of some earlier and some later step of its interval is implied by those two rows;
kept are the prefix and suffix records of the excess per interval. Steps where even every copy
queued (``excess + rate * (Q, W with every offload) <= 0``) cannot exceed are dropped too. F's
running-sum chain keeps the matrix at ``O(instances + steps)`` entries where a row per step
listing every covering instance had ``O(instances * steps)`` (1M at 1k candidates).

Rounds: the MILP's plan is replayed by the simulator. When it exceeds the budget, the heuristic's
covering step (:mod:`hloopt.solvers.heuristic`, with the queues as the simulator runs them)
completes it into a replayed plan ("milp+repair"), the steps over budget get their target lowered
by the excess and the MILP is solved again while time is left (a solve that could be followed by
another one gets ``_ROUND_SHARE`` of the time left). Model building counts inside the time limit.
The result names the HiGHS status and gap of the last solve; the plan is always a replayed one
within budget: the MILP's own, its repair, or the seeded incumbent, whichever replays fastest.
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
from hloopt.solvers._model import OFF, REM, Model
from hloopt.solvers.heuristic import HeuristicFailed, solve_heuristic

__all__ = ["MilpResult", "solve_milp"]

_ROUNDS = 6
#: Share of the time left that a solve may use when later rounds could still follow.
_ROUND_SHARE = 0.6
#: Seconds the heuristic may spend completing a MILP plan the replay rejects.
_REPAIR_S = 2.0


@dataclass(frozen=True)
class MilpResult:
    decisions: Decisions
    sim: SimResult
    choice: np.ndarray
    #: HiGHS model status of the last solve ("Optimal", "Time limit reached", ...).
    status: str
    #: Gap between the last solve's incumbent and its dual bound, relative to the incumbent's
    #: modeled step time (compute + added); at most ``mip_rel_gap`` when status is "Optimal".
    mip_gap: float
    #: Modeled added seconds of the last solve's incumbent and its proven lower bound.
    objective_s: float
    bound_s: float
    #: Whether the last solve proved optimality *and* its plan replayed within budget as is.
    optimal: bool
    #: "milp" when the plan is the MILP's own, "milp+repair" when the heuristic completed a MILP
    #: plan the replay rejected, "incumbent" when the seeded plan replayed faster.
    source: str
    rounds: int
    solve_s: float
    n_binary: int
    n_rows: int


def _lindley_steps(start_s: np.ndarray, rel_s: np.ndarray, engines: int) -> np.ndarray:
    """Least ``Q`` of ``Q[s] = rel[s] + max(0, Q[s-1] - engines * dur[s-1])`` at every step.

    ``Q[s] = max_{j<=s} (sum rel[j..s] - engines * (start[s] - start[j]))``, vectorized.
    """
    if len(rel_s) == 0:
        return np.zeros(0)
    p = np.cumsum(rel_s) - engines * start_s[: len(rel_s)]
    return p - np.minimum.accumulate(p - rel_s)


def _reload_steps(start_s: np.ndarray, due_s: np.ndarray, engines: int) -> np.ndarray:
    """Least ``W`` of ``W[t] = due[t] + max(0, W[t+1] - engines * dur[t])`` for t = 0..T."""
    if len(due_s) == 0:
        return np.zeros(0)
    rev = slice(None, None, -1)
    return _lindley_steps(-start_s[rev], due_s[rev], engines)[rev]


def _kept_steps(excess: np.ndarray, events: np.ndarray, ceiling: np.ndarray) -> np.ndarray:
    """Steps whose memory row is not implied by others (module doc, "Rows").

    Between consecutive ``events`` a step is kept when its excess beats every earlier step's of
    its segment (a prefix record) or every later one's (a suffix record), and when it can bind at
    all: ``excess + ceiling > 0`` (``ceiling``: the queue terms with every copy queued).
    """
    T = len(excess)
    if T == 0:
        return np.zeros(0, dtype=np.int64)
    seg = np.zeros(T, dtype=np.int64)
    inner = events[(events > 0) & (events < T)]
    np.add.at(seg, inner, 1)
    seg = np.cumsum(seg)
    # Rank-transform so a segment offset cannot overflow or round.
    _, rank = np.unique(excess, return_inverse=True)
    v = seg * (T + 1) + rank.astype(np.int64)
    first = np.ones(T, dtype=bool)
    first[1:] = seg[1:] != seg[:-1]
    last = np.ones(T, dtype=bool)
    last[:-1] = seg[1:] != seg[:-1]
    pre = np.maximum.accumulate(v)
    prefix = first.copy()
    prefix[1:] |= v[1:] > pre[:-1]
    suf = np.maximum.accumulate(v[::-1])[::-1]
    suffix = last.copy()
    suffix[:-1] |= v[:-1] > suf[1:]
    keep = (prefix | suffix) & (excess + ceiling > 0)
    return np.nonzero(keep)[0].astype(np.int64)


@dataclass(frozen=True, eq=False)
class _Formulation:
    """One MILP (module doc) and where its columns sit."""

    lp: "highspy.HighsLp"
    cols_c: np.ndarray      # candidate of each x column
    cols_a: np.ndarray      # action (OFF/REM) of each x column
    kept: np.ndarray        # steps with a memory row
    link: np.ndarray        # instances whose offload moves bytes over the link
    q_steps: np.ndarray     # steps where Q is a column (column q0 + index)
    w_steps: np.ndarray     # step starts where W is a column (column w0 + index)
    f0: int
    q0: int
    w0: int
    time_unit_s: float
    n_rows: int

    @property
    def nx(self) -> int:
        return len(self.cols_c)


def _formulate(m: Model, target: np.ndarray, added: np.ndarray) -> _Formulation:
    T = m.n_steps
    p = m.problem
    engines = max(1, p.dma_engines)
    cols_c, cols_a = np.nonzero(m.allowed[:, 1:])
    cols_a = cols_a + 1
    nx = len(cols_c)
    xcol = -np.ones((m.n_cands, 3), dtype=np.int64)
    xcol[cols_c, cols_a] = np.arange(nx)
    lfu = m.last_fwd
    fbu = m.first_bwd
    x_off = xcol[m.inst_cand, OFF]
    x_rem = xcol[m.inst_cand, REM]
    movable = (x_off >= 0) | (x_rem >= 0)
    finite = math.isfinite(p.d2h_bytes_per_s) and math.isfinite(p.h2d_bytes_per_s)
    # Offloads that move bytes (the simulator skips an offload with no forward/backward gap).
    link = np.nonzero((x_off >= 0) & (fbu > lfu))[0] if finite else np.zeros(0, dtype=np.int64)
    rel_step = m.produced[link] + 1
    on_q = rel_step < T  # a copy released after the last step holds no step's memory
    link_q = link[on_q]
    rel_step = rel_step[on_q]

    # Scales: bytes in units of the largest instance, seconds in units of the mean step.
    byte_unit = float(max(int(m.inst_bytes.max(initial=0)), 1))
    time_unit = m.compute_s / T if T and m.compute_s > 0 else 1.0
    start_ext = np.append(m.start_s, m.compute_s) if T else np.zeros(1)
    d_u = m.d2h_s / time_unit
    h_u = m.h2d_s / time_unit
    st_u = start_ext / time_unit

    excess = m.dev_bytes - target
    ceiling = np.zeros(T)
    if len(link):
        rel = np.bincount(rel_step, weights=m.d2h_s[link_q], minlength=T)[:T]
        due = np.bincount(fbu[link], weights=m.h2d_s[link], minlength=T + 1)[: T + 1]
        ceiling = (p.d2h_bytes_per_s * _lindley_steps(start_ext, rel, engines)
                   + p.h2d_bytes_per_s * _reload_steps(start_ext, due, engines)[1:])
    rem_end = m.gap1[:, REM] + 1  # fbu, or past the last use where recomputing is fused
    events = np.concatenate([lfu[movable] + 1, fbu[movable], m.gap0[x_rem >= 0, REM], rem_end[x_rem >= 0],
                             rel_step]).astype(np.int64)
    kept = _kept_steps(excess, np.unique(events), ceiling)
    nk = len(kept)
    use_link = len(link) > 0 and nk > 0
    q_steps = np.unique(np.concatenate([kept, rel_step])) if use_link else np.zeros(0, np.int64)
    w_steps = np.unique(np.concatenate([kept + 1, fbu[link]])) if use_link else np.zeros(0, np.int64)
    f0 = nx
    q0 = f0 + nk
    w0 = q0 + len(q_steps)
    ncol = w0 + len(w_steps)

    cost = np.zeros(ncol)
    scale = m.compute_s if m.compute_s > 0 else 1.0
    cost[:nx] = added[cols_c, cols_a] / scale
    lower = np.zeros(ncol)
    upper = np.full(ncol, math.inf)
    upper[:nx] = 1.0

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

    if nk:
        # F chain: F[k] - F[k-1] - (bytes whose gap starts covering kept[k]) + (bytes whose
        # gap stopped covering since kept[k-1]) = 0. An instance covers kept steps a..b.
        k = np.arange(nk)
        rows, cols, vals = [k, k[1:]], [f0 + k, f0 + k[:-1]], [np.ones(nk), -np.ones(nk - 1)]
        for xc, g_start, g_end in ((x_off, lfu + 1, fbu - 1), (x_rem, m.gap0[:, REM], m.gap1[:, REM])):
            ok = (xc >= 0) & (g_start <= g_end)
            a = np.searchsorted(kept, g_start[ok], side="left")
            b = np.searchsorted(kept, g_end[ok], side="right") - 1
            cover = a <= b
            w = m.inst_bytes[ok][cover] / byte_unit
            a, b, xcv = a[cover], b[cover], xc[ok][cover]
            rows.append(a)
            cols.append(xcv)
            vals.append(-w)
            out = b + 1 < nk
            rows.append(b[out] + 1)
            cols.append(xcv[out])
            vals.append(w[out])
        add(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), np.zeros(nk), np.zeros(nk))

    if use_link:
        # Copy-out queue at q_steps: Q[j] >= Q[j-1] - engines * elapsed + released at j; Q[j] >= released at j.
        nq = len(q_steps)
        j = np.arange(nq)
        jr = np.searchsorted(q_steps, rel_step)
        xr = x_off[link_q]
        wr = -d_u[link_q]
        elapsed = engines * np.diff(st_u[q_steps])
        add(np.concatenate([j[1:] - 1, j[1:] - 1, jr[jr >= 1] - 1]),
            np.concatenate([q0 + j[1:], q0 + j[:-1], xr[jr >= 1]]),
            np.concatenate([np.ones(nq - 1), -np.ones(nq - 1), wr[jr >= 1]]),
            -elapsed, np.full(nq - 1, math.inf))
        add(np.concatenate([j, jr]), np.concatenate([q0 + j, xr]), np.concatenate([np.ones(nq), wr]),
            np.zeros(nq), np.full(nq, math.inf))
        # Reload plan at w_steps: W[j] >= W[j+1] - engines * elapsed + due at j; W[j] >= due at j.
        nw = len(w_steps)
        j = np.arange(nw)
        jd = np.searchsorted(w_steps, fbu[link])
        xd = x_off[link]
        wd = -h_u[link]
        elapsed = engines * np.diff(st_u[w_steps])
        last = jd < nw - 1
        add(np.concatenate([j[:-1], j[:-1], jd[last]]),
            np.concatenate([w0 + j[:-1], w0 + j[1:], xd[last]]),
            np.concatenate([np.ones(nw - 1), -np.ones(nw - 1), wd[last]]),
            -elapsed, np.full(nw - 1, math.inf))
        add(np.concatenate([j, jd]), np.concatenate([w0 + j, xd]), np.concatenate([np.ones(nw), wd]),
            np.zeros(nw), np.full(nw, math.inf))

    if nk:
        # Memory at kept steps: F - rate_d Q - rate_h W >= excess (in byte units).
        k = np.arange(nk)
        rows, cols, vals = [k], [f0 + k], [np.ones(nk)]
        if use_link:
            rows += [k, k]
            cols += [q0 + np.searchsorted(q_steps, kept), w0 + np.searchsorted(w_steps, kept + 1)]
            vals += [np.full(nk, -p.d2h_bytes_per_s * time_unit / byte_unit),
                     np.full(nk, -p.h2d_bytes_per_s * time_unit / byte_unit)]
        add(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals),
            excess[kept] / byte_unit, np.full(nk, math.inf))

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

    lp = highspy.HighsLp()
    lp.num_col_ = ncol
    lp.num_row_ = nrow
    lp.offset_ = 1.0
    lp.col_cost_ = cost
    lp.col_lower_ = lower
    lp.col_upper_ = upper
    lp.row_lower_ = np.concatenate(rlo) if rlo else np.zeros(0)
    lp.row_upper_ = np.concatenate(rhi) if rhi else np.zeros(0)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.searchsorted(col, np.arange(ncol + 1))
    lp.a_matrix_.index_ = row
    lp.a_matrix_.value_ = val
    lp.a_matrix_.num_col_ = ncol
    lp.a_matrix_.num_row_ = nrow
    integ = [highspy.HighsVarType.kContinuous] * ncol
    for jx in range(nx):
        integ[jx] = highspy.HighsVarType.kInteger
    lp.integrality_ = integ
    return _Formulation(lp, cols_c, cols_a, kept, link, q_steps, w_steps, f0, q0, w0, time_unit, nrow)


def _start_values(m: Model, f: _Formulation, choice: np.ndarray) -> np.ndarray:
    """Column values of ``choice`` with F, Q and W at their least (a start for HiGHS)."""
    x = np.zeros(f.lp.num_col_)
    x[: f.nx] = (choice[f.cols_c] == f.cols_a).astype(float)
    lfu = m.last_fwd
    act = choice[m.inst_cand]
    off = (act == OFF) | (act == REM)
    nk = len(f.kept)
    if nk:
        g_start = np.where(act == REM, m.gap0[:, REM], lfu + 1)
        g_end = np.where(act == REM, m.gap1[:, REM], m.first_bwd - 1)
        ok = off & (g_start <= g_end)
        a = np.searchsorted(f.kept, g_start[ok], side="left")
        b = np.searchsorted(f.kept, g_end[ok], side="right")
        diff = np.zeros(nk + 1)
        byte_unit = float(max(int(m.inst_bytes.max(initial=0)), 1))
        np.add.at(diff, a, m.inst_bytes[ok] / byte_unit)
        np.add.at(diff, b, -m.inst_bytes[ok] / byte_unit)
        x[f.f0:f.f0 + nk] = np.maximum(np.cumsum(diff[:-1]), 0.0)
    if len(f.q_steps):
        T = m.n_steps
        engines = max(1, m.problem.dma_engines)
        sel = f.link[act[f.link] == OFF]
        start_ext = np.append(m.start_s, m.compute_s) / f.time_unit_s
        rs = m.produced[sel] + 1
        rq = rs < T
        rel = np.bincount(rs[rq], weights=m.d2h_s[sel][rq] / f.time_unit_s, minlength=T)[:T]
        due = np.bincount(m.first_bwd[sel], weights=m.h2d_s[sel] / f.time_unit_s, minlength=T + 1)[: T + 1]
        x[f.q0:f.q0 + len(f.q_steps)] = _lindley_steps(start_ext, rel, engines)[f.q_steps]
        x[f.w0:f.w0 + len(f.w_steps)] = _reload_steps(start_ext, due, engines)[f.w_steps]
    return x


def solve_milp(
    problem: Problem,
    *,
    budget_bytes: int,
    time_limit_s: float = 30.0,
    model: Model | None = None,
    incumbent: np.ndarray | None = None,
    mip_rel_gap: float = 1e-3,
) -> MilpResult:
    """Least modeled step time with replayed peak <= ``budget_bytes`` (see the module doc).

    ``time_limit_s`` covers everything (model build, HiGHS, replays). ``mip_rel_gap``: HiGHS
    stops when its plan is proven within this fraction of the least modeled step time.
    ``incumbent``: a known plan (action column per candidate) given to HiGHS as a start and kept
    when it replays faster than the MILP's own plan. Raises RuntimeError when no plan replays
    within the budget.
    """
    t0 = time.perf_counter()
    m = model if model is not None else Model.build(problem)
    added = m.added_s()
    target = np.full(m.n_steps, budget_bytes, dtype=np.int64)
    best: tuple[float, np.ndarray, SimResult, str] | None = None
    if incumbent is not None:
        sim_inc = simulate(problem, m.decisions_of(incumbent))
        if sim_inc.peak_bytes <= budget_bytes:
            best = (sim_inc.objective_s, incumbent.copy(), sim_inc, "incumbent")
    status, gap, obj, bound, optimal = "not run", math.inf, math.nan, math.nan, False
    nx = nrow = 0
    rounds = 0
    scale = m.compute_s if m.compute_s > 0 else 1.0
    for rounds in range(1, _ROUNDS + 1):
        if time_limit_s - (time.perf_counter() - t0) <= 0.05:
            break
        f = _formulate(m, target, added)
        nx, nrow = f.nx, f.n_rows
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0.05:
            break
        h = new_highs()
        h.setOptionValue("output_flag", False)
        # A plan the replay rejects leaves time for the rounds after it.
        h.setOptionValue("time_limit", float(left if rounds == _ROUNDS else left * _ROUND_SHARE))
        h.setOptionValue("mip_rel_gap", mip_rel_gap)
        h.setOptionValue("threads", 1)
        h.passModel(f.lp)
        if best is not None:
            sol = highspy.HighsSolution()
            sol.col_value = _start_values(m, f, best[1]).tolist()
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
        obj = (float(info.objective_function_value) - 1.0) * scale
        bound = (float(info.mip_dual_bound) - 1.0) * scale
        xv = np.asarray(h.getSolution().col_value[:nx])
        choice = np.zeros(m.n_cands, dtype=np.int64)
        on = xv > 0.5
        choice[f.cols_c[on]] = f.cols_a[on]
        sim = simulate(problem, m.decisions_of(choice))
        optimal = ms == highspy.HighsModelStatus.kOptimal
        if sim.peak_bytes <= budget_bytes:
            if best is None or sim.objective_s <= best[0] + 1e-12:
                best = (sim.objective_s, choice, sim, "milp")
            break
        optimal = False
        # Repair: the heuristic's covering step (queues as the simulator runs them) completes
        # the MILP's plan, so every round leaves a replayed plan.
        try:
            rep = solve_heuristic(problem, budget_bytes=budget_bytes, model=m, start=choice,
                                  time_limit_s=max(0.1, min(_REPAIR_S, time_limit_s - (time.perf_counter() - t0))))
            if best is None or rep.sim.objective_s < best[0] - 1e-12:
                best = (rep.sim.objective_s, rep.choice, rep.sim, "milp+repair")
        except HeuristicFailed:
            pass
        # Replay cut: the model under-counts these steps by the replay's excess.
        real = np.asarray(sim.timeline_bytes, dtype=np.int64)
        over = np.nonzero(real > budget_bytes)[0]
        target[over] -= real[over] - budget_bytes
    if best is None:
        raise RuntimeError(f"MILP found no plan that replays within {budget_bytes} bytes ({status})")
    _, choice, sim, source = best
    return MilpResult(
        decisions=m.decisions_of(choice), sim=sim, choice=choice, status=status, mip_gap=gap,
        objective_s=obj, bound_s=bound, optimal=optimal and source == "milp", source=source,
        rounds=rounds, solve_s=time.perf_counter() - t0, n_binary=nx, n_rows=nrow)
