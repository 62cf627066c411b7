"""Fast heuristic: the plan that fits a budget, greedily, for Problems too large for the MILP.

Everything runs on the solvers' model (:mod:`hloopt.solvers._model`) *with the link's queues*
(:class:`~hloopt.solvers._model.LinkEval`: copies out served first come first served, reloads
planned as late as possible, stalls when a reload cannot make its deadline), which tracks the
simulator closely; the simulator judges the result.

1. *Cover the peak.* Evaluate the plan; take the step ``p`` most over its target. For every move
   (a candidate going DEVICE->OFFLOAD/REMAT, or OFFLOAD->REMAT) estimate the bytes it frees at
   ``p`` and the seconds it adds, with an offloaded instance *inserted into the current queues*:
   its copy out starts behind the copies already queued before it, its reload is planned before
   the next reload's planned start. Rank by added seconds per byte freed (ties: the copy that
   ends earliest, so pushing the queue hurts least) and take moves until ``p`` is covered; then
   re-evaluate (queued copies pushed later may uncover ``p`` again) and repeat.
2. *Undo what is not needed.* Revert moves, most expensive first, whose bytes fit back under
   target on their gap. Reverting an offload only shortens the queues, so the check is safe.
3. *Improve.* While reloads stall: take the candidate whose reloads stall most, forbid its
   offload (REMAT if that is allowed and cheaper than the stall, else DEVICE), re-cover and
   prune; keep the change when the modeled step time drops (a bounded number of tries).
4. *Replay.* The simulator judges the plan. Steps it finds over budget (duplex rates, stalls the
   model places differently) get their target lowered by the excess and the loop continues from
   the current plan (a few rounds). When rounds run out, the least-peak plan (every candidate
   off device the way that frees the most) is replayed and, when it fits, improved by pruning
   against its own replayed timeline.

Invariant: a returned plan has been replayed by :func:`hloopt.simulator.simulate` and its peak
is within the budget; otherwise :class:`HeuristicFailed` is raised (the caller turns it into an
InfeasibleBudget with the floor).
Cost: one evaluation is O((steps + instances) log instances) numpy plus one Python pass over the
offloaded instances; ~10k candidates in under a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hloopt.problem import Decisions, Problem, SimResult
from hloopt.simulator import simulate
from hloopt.solvers._model import DEV, OFF, REM, LinkEval, Model

__all__ = ["HeuristicFailed", "HeuristicResult", "least_peak_choice", "solve_heuristic"]

_ROUNDS = 12
#: Improvement tries (step 3) per replay round.
_IMPROVE_TRIES = 40


class HeuristicFailed(Exception):
    """No plan the heuristic found replays within the budget."""


@dataclass(frozen=True)
class HeuristicResult:
    decisions: Decisions
    sim: SimResult
    #: Action column per candidate (0 device, 1 offload, 2 remat).
    choice: np.ndarray
    rounds: int
    solve_s: float


def least_peak_choice(m: Model) -> np.ndarray:
    """Every candidate off device the way that frees the most bytes in total (REMAT first)."""
    choice = np.zeros(m.n_cands, dtype=np.int64)
    choice[m.allowed[:, OFF]] = OFF
    choice[m.allowed[:, REM]] = REM
    return choice


def _insertion(m: Model, ev: LinkEval, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per instance, if offloaded (inserted into the current queues): whether it is off device at
    ``p``, the stall its own reload would take, and when its copy out would end."""
    k = max(1, m.problem.dma_engines)
    off = ev.off
    # Copy out: behind the last queued copy produced at or before it.
    order = np.argsort(m.produced[off], kind="stable")
    prod_sorted = m.produced[off][order]
    end_sorted = ev.d2h_end_s[order]
    idx = np.searchsorted(prod_sorted, m.produced, side="right") - 1
    prev_end = np.full(len(idx), -np.inf)
    if len(end_sorted):
        prev_end = np.where(idx >= 0, end_sorted[np.maximum(idx, 0)], -np.inf)
    ready = m.end_s[m.produced]
    d2h_end = np.maximum(ready, prev_end) + m.d2h_s / k + m.d2h_s * (1 - 1 / k)
    # Reload: planned to end by its deadline and by the next reload's planned start.
    eorder = np.argsort(m.first_bwd[off], kind="stable")
    fbu_sorted = m.first_bwd[off][eorder]
    start_sorted = ev.reload_start_s[eorder]
    j = np.searchsorted(fbu_sorted, m.first_bwd, side="left")
    nxt = np.full(len(j), np.inf)
    if len(fbu_sorted):
        nxt = np.where(j < len(fbu_sorted), start_sorted[np.minimum(j, len(fbu_sorted) - 1)], np.inf)
    plan_end = np.minimum(m.reload_deadline_s, nxt)
    plan_start = plan_end - m.h2d_s
    hold = np.searchsorted(m.end_s, d2h_end, side="left")
    lfu = m.last_fwd
    g0 = np.maximum(lfu, hold) + 1
    g1 = np.minimum(np.searchsorted(m.end_s, plan_start, side="right"), m.first_bwd) - 1
    covers = (g0 <= p) & (p <= g1)
    release = d2h_end
    window = m.problem.prefetch_window_steps
    if window is not None:
        release = np.maximum(release, m.start_s[np.maximum(m.first_bwd - window, 0)])
    late = np.maximum(0.0, release - plan_start)
    late[lfu + 1 > m.first_bwd - 1] = 0.0
    return covers, late, d2h_end


def _cover(m: Model, choice: np.ndarray, target: np.ndarray, frozen: np.ndarray,
           deadline_s: float) -> tuple[bool, LinkEval]:
    """Add moves until the link model's timeline is within ``target`` (step 1)."""
    C = m.n_cands
    cur = np.arange(C)
    while True:
        ev = LinkEval.of(m, choice)
        slack = ev.timeline - target
        p = int(np.argmax(slack))
        deficit = int(slack[p])
        if deficit <= 0:
            return True, ev
        if time.perf_counter() > deadline_s:
            return False, ev
        covers, late, d2h_end = _insertion(m, ev, p)
        act = choice[m.inst_cand]
        # Bytes freed at p and seconds added, per candidate and action.
        gain = np.zeros((C, 3))
        cost = np.zeros((C, 3))
        rem_cov = (m.gap0[:, REM] <= p) & (p <= m.gap1[:, REM])
        gain[:, REM] = np.bincount(m.inst_cand, weights=m.inst_bytes * rem_cov, minlength=C)
        cost[:, REM] = m.remat_s + m.keep_s  # as Model.added_s weighs it
        off_now = act == OFF
        ev_cov = np.zeros(len(act), dtype=bool)
        # Instances already offloaded: do they free p now?
        if len(ev.off):
            hold = np.searchsorted(m.end_s, ev.d2h_end_s, side="left")
            g0 = np.maximum(m.last_fwd[ev.off], hold) + 1
            g1 = np.minimum(np.searchsorted(m.end_s, ev.reload_start_s, side="right"), m.first_bwd[ev.off]) - 1
            ev_cov[ev.off] = (g0 <= p) & (p <= g1)
        off_cov = np.where(off_now, ev_cov, covers)
        gain[:, OFF] = np.bincount(m.inst_cand, weights=m.inst_bytes * off_cov, minlength=C)
        late_now = np.zeros(len(act))
        late_now[ev.off] = ev.late_s
        cost[:, OFF] = m.problem.stall_weight * np.bincount(m.inst_cand, weights=np.where(off_now, late_now, late),
                                                            minlength=C)
        first_end = np.full(C, np.inf)
        np.minimum.at(first_end, m.inst_cand, d2h_end)
        cur_gain = gain[cur, choice]
        cur_cost = np.where(choice == DEV, 0.0, cost[cur, choice])
        dg = gain - cur_gain[:, None]
        dc = np.maximum(cost - cur_cost[:, None], 0.0)
        ok = m.allowed & (dg > 0)
        ok[:, DEV] = False
        ok[choice == REM, OFF] = False
        ok[frozen[:, 0], OFF] = False
        ok[frozen[:, 1], REM] = False
        cs, acts = np.nonzero(ok)
        if len(cs) == 0:
            return False, ev
        g = dg[cs, acts]
        c = dc[cs, acts]
        tie = np.where(acts == OFF, first_end[cs], -np.inf)
        order = np.lexsort((-g, tie, c / g))
        taken: set[int] = set()
        for q in order.tolist():
            ci = int(cs[q])
            if ci in taken:
                continue
            taken.add(ci)
            choice[ci] = int(acts[q])
            deficit -= int(g[q])
            if deficit <= 0:
                break
        if deficit > 0:
            return False, ev


def _added(m: Model, choice: np.ndarray, ev: LinkEval) -> np.ndarray:
    """Seconds each chosen candidate adds (its remat, or its reloads' stalls)."""
    late: np.ndarray = np.zeros(m.n_cands)
    if len(ev.off):
        late = m.problem.stall_weight * np.bincount(m.inst_cand[ev.off], weights=ev.late_s, minlength=m.n_cands)
    return np.where(choice == REM, m.remat_s + m.keep_s, np.where(choice == OFF, late, 0.0))


class _RangeMin:
    """Sparse table: minimum of ``a[lo..hi]`` (inclusive) for arrays of ranges, O(1) each."""

    def __init__(self, a: np.ndarray) -> None:
        self.levels = [a]
        k = 1
        while 2 * k <= len(a):
            prev = self.levels[-1]
            self.levels.append(np.minimum(prev[:-k], prev[k:]))
            k *= 2

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        n = hi - lo + 1
        lev = np.floor(np.log2(np.maximum(n, 1))).astype(np.int64)
        out = np.empty(len(lo), dtype=self.levels[0].dtype)
        for L in np.unique(lev).tolist():
            sel = lev == L
            arr = self.levels[L]
            out[sel] = np.minimum(arr[lo[sel]], arr[hi[sel] - (1 << L) + 1])
        return out


def _gaps(m: Model, ev: LinkEval) -> tuple[np.ndarray, np.ndarray]:
    """Per instance: the steps it is off device under ``ev`` (offloads) or by recompute."""
    g0 = m.gap0[:, REM].copy()
    g1 = m.gap1[:, REM].copy()
    if len(ev.off):
        hold = np.searchsorted(m.end_s, ev.d2h_end_s, side="left")
        g0[ev.off] = np.maximum(m.last_fwd[ev.off], hold) + 1
        g1[ev.off] = np.minimum(np.searchsorted(m.end_s, ev.reload_start_s, side="right"),
                                m.first_bwd[ev.off]) - 1
    return g0, g1


def _prune(m: Model, choice: np.ndarray, target: np.ndarray) -> LinkEval:
    """Revert moves the link model's timeline does not need (step 2), most expensive first.

    Batches: walking the chosen candidates in order, one is reverted when the least slack over
    its gaps covers its bytes plus every byte reverted earlier in the batch (so the batch cannot
    overshoot anywhere); the slack is recomputed between batches.
    """
    ev = LinkEval.of(m, choice)
    chosen = np.nonzero(choice != DEV)[0]
    if len(chosen) == 0 or m.n_steps == 0:
        return ev
    added = _added(m, choice, ev)
    last_end = np.full(m.n_cands, -np.inf)
    if len(ev.off):
        np.maximum.at(last_end, m.inst_cand[ev.off], ev.d2h_end_s)
    g0, g1 = _gaps(m, ev)
    act = choice[m.inst_cand]
    moving = act == REM
    moving[ev.off] = True
    moving &= g0 <= g1
    cand_bytes = np.bincount(m.inst_cand[moving], weights=m.inst_bytes[moving], minlength=m.n_cands)
    tl = ev.timeline.copy()
    pending = chosen[np.lexsort((-last_end[chosen], -added[chosen]))]
    changed = False
    for _ in range(64):
        if len(pending) == 0:
            break
        slack = target - tl
        rm = _RangeMin(slack)
        rows = np.nonzero(moving & np.isin(m.inst_cand, pending))[0]
        least = np.full(m.n_cands, np.iinfo(np.int64).max)
        if len(rows):
            np.minimum.at(least, m.inst_cand[rows], rm.query(g0[rows], g1[rows]))
        b = cand_bytes[pending]
        cum = np.cumsum(b)
        ok = least[pending] >= cum
        # Walk in order: the cumulative bytes only count candidates accepted before.
        acc = np.zeros(len(pending), dtype=bool)
        total = 0
        for q in np.nonzero(least[pending] >= b)[0].tolist():
            if least[pending[q]] >= total + b[q]:
                acc[q] = True
                total += int(b[q])
        del ok
        if not acc.any():
            break
        done = pending[acc]
        choice[done] = DEV
        changed = True
        rows = np.nonzero(moving & np.isin(m.inst_cand, done))[0]
        diff = np.zeros(m.n_steps + 1, dtype=np.int64)
        np.add.at(diff, g0[rows], m.inst_bytes[rows])
        np.add.at(diff, g1[rows] + 1, -m.inst_bytes[rows])
        tl += np.cumsum(diff[:-1])
        pending = pending[~acc]
        if total == 0:
            break
    return LinkEval.of(m, choice) if changed else ev


def _improve(m: Model, choice: np.ndarray, target: np.ndarray, ev: LinkEval, deadline_s: float) -> LinkEval:
    """Step 3: forbid the offloads whose reloads stall most, while the step time drops."""
    frozen = np.zeros((m.n_cands, 2), dtype=bool)  # [offload forbidden, remat forbidden]
    for _ in range(_IMPROVE_TRIES):
        if ev.stall_s <= 0 or m.problem.stall_weight <= 0 or time.perf_counter() > deadline_s:
            break
        late = np.bincount(m.inst_cand[ev.off], weights=ev.late_s, minlength=m.n_cands)
        late[frozen[:, 0]] = 0
        ci = int(np.argmax(late))
        if late[ci] <= 0:
            break
        frozen[ci, 0] = True
        trial = choice.copy()
        trial[ci] = REM if m.allowed[ci, REM] and m.remat_s[ci] + m.keep_s[ci] < late[ci] else DEV
        ok, _ = _cover(m, trial, target, frozen, deadline_s)
        if not ok:
            continue
        ev2 = _prune(m, trial, target)
        if (ev2.timeline <= target).all() and ev2.step_time_s < ev.step_time_s - 1e-15:
            choice[:] = trial
            ev = ev2
    return ev


def solve_heuristic(
    problem: Problem,
    *,
    budget_bytes: int,
    model: Model | None = None,
    start: np.ndarray | None = None,
    time_limit_s: float = 5.0,
) -> HeuristicResult:
    """A plan whose replayed peak is <= ``budget_bytes`` at low modeled step time (module doc).

    ``time_limit_s`` bounds the covering and improvement steps (the replays always run).
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    m = model if model is not None else Model.build(problem)
    target = np.full(m.n_steps, budget_bytes, dtype=np.int64)
    choice = np.zeros(m.n_cands, dtype=np.int64) if start is None else start.copy()
    no_frozen = np.zeros((m.n_cands, 2), dtype=bool)
    for rnd in range(1, _ROUNDS + 1):
        ok, ev = _cover(m, choice, target, no_frozen, deadline)
        if ok:
            ev = _prune(m, choice, target)
            ev = _improve(m, choice, target, ev, deadline)
        sim = simulate(problem, m.decisions_of(choice))
        if sim.peak_bytes <= budget_bytes:
            return HeuristicResult(m.decisions_of(choice), sim, choice, rnd, time.perf_counter() - t0)
        if not ok:
            break
        # Cut: the model under-counts these steps by the replay's excess.
        real = np.asarray(sim.timeline_bytes, dtype=np.int64)
        over = real > budget_bytes
        target[over] -= real[over] - budget_bytes
    choice = least_peak_choice(m)
    dec = m.decisions_of(choice)
    sim = simulate(problem, dec)
    if sim.peak_bytes <= budget_bytes:
        # Feasible but slow: prune against the replayed timeline and keep what still replays.
        real = np.asarray(sim.timeline_bytes, dtype=np.int64)
        ev = LinkEval.of(m, choice)
        target = np.full(m.n_steps, budget_bytes, dtype=np.int64) - np.maximum(real - ev.timeline, 0)
        trial = choice.copy()
        _prune(m, trial, target)
        sim2 = simulate(problem, m.decisions_of(trial))
        if sim2.peak_bytes <= budget_bytes and sim2.objective_s <= sim.objective_s:
            choice, sim, dec = trial, sim2, m.decisions_of(trial)
        return HeuristicResult(dec, sim, choice, _ROUNDS + 1, time.perf_counter() - t0)
    raise HeuristicFailed(
        f"no plan found within {budget_bytes} bytes (least-peak plan replays at {sim.peak_bytes})")
