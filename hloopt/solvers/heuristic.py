"""Fast heuristic: the plan that fits a budget, greedily, for Problems too large for the MILP.

Algorithm (all on the numpy model of :mod:`hloopt.solvers._model`, one replay per round):

1. *Cover the peak.* Find the step ``p`` most over its target; rank every move at ``p`` (a
   candidate going DEVICE->OFFLOAD/REMAT, or OFFLOAD->REMAT) by added seconds per byte it frees
   at ``p`` (ties: more bytes first) and take moves in that order until ``p`` is covered. Apply
   them with one slice update of the timeline each; repeat until no step is over target.
2. *Undo what is not needed.* Walk the chosen moves from the most expensive down and revert each
   one whose gap can take its bytes back without going over target (a range max per move).
3. *Replay.* The simulator judges the plan. Link contention (copies out queued behind each
   other, reloads started earlier) can keep bytes on device longer than the model says; steps
   the replay finds over budget get their target lowered by the excess and the loop continues
   from the current plan (a few rounds). If rounds run out, the least-peak plan (every candidate
   off device the way that frees the most) is replayed as the last resort.

Invariant: a returned plan has been replayed by :func:`hloopt.simulator.simulate` and its peak
is within the budget; otherwise :class:`HeuristicFailed` is raised (the caller turns it into
an InfeasibleBudget with the floor).
Cost: O((steps + instances) * peaks) numpy work; ~10k candidates in well under a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hloopt.problem import Decisions, Problem, SimResult
from hloopt.simulator import simulate
from hloopt.solvers._model import DEV, OFF, REM, Model

__all__ = ["HeuristicFailed", "HeuristicResult", "solve_heuristic"]

_ROUNDS = 12


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


def _apply(m: Model, tl: np.ndarray, ci: int, old: int, new: int) -> None:
    """Update timeline ``tl`` in place for candidate ``ci`` moving from action ``old`` to ``new``."""
    for i in m.cand_inst[ci]:
        b = int(m.inst_bytes[i])
        if old != DEV and m.gap0[i, old] <= m.gap1[i, old]:
            tl[m.gap0[i, old]:m.gap1[i, old] + 1] += b
        if new != DEV and m.gap0[i, new] <= m.gap1[i, new]:
            tl[m.gap0[i, new]:m.gap1[i, new] + 1] -= b


def _greedy(m: Model, choice: np.ndarray, tl: np.ndarray, target: np.ndarray, added: np.ndarray) -> bool:
    """Add moves until ``tl <= target`` everywhere; False when some step cannot be covered."""
    cur_idx = np.arange(m.n_cands)
    while True:
        slack = tl - target
        p = int(np.argmax(slack))
        deficit = int(slack[p])
        if deficit <= 0:
            return True
        # Bytes each action frees at p, per candidate.
        sav = np.zeros((m.n_cands, 3))
        for a in (OFF, REM):
            cov = (m.gap0[:, a] <= p) & (p <= m.gap1[:, a])
            if cov.any():
                sav[:, a] = np.bincount(m.inst_cand[cov], weights=m.inst_bytes[cov], minlength=m.n_cands)
        cur_sav = sav[cur_idx, choice]
        cur_cost = added[cur_idx, choice]
        gain = sav - cur_sav[:, None]
        cost = added - cur_cost[:, None]
        ok = m.allowed & (gain > 0)
        ok[:, DEV] = False
        ok[choice == REM, OFF] = False  # never step back from remat to offload here
        cs, acts = np.nonzero(ok)
        if len(cs) == 0:
            return False
        g = gain[cs, acts]
        c = np.maximum(cost[cs, acts], 0.0)
        order = np.lexsort((-g, c / g))
        taken: set[int] = set()
        for k in order.tolist():
            ci = int(cs[k])
            if ci in taken:
                continue
            a = int(acts[k])
            taken.add(ci)
            _apply(m, tl, ci, int(choice[ci]), a)
            choice[ci] = a
            deficit -= int(g[k])
            if deficit <= 0:
                break
        if deficit > 0:
            return False


def _prune(m: Model, choice: np.ndarray, tl: np.ndarray, target: np.ndarray, added: np.ndarray) -> None:
    """Revert moves (most expensive first) that the timeline does not need."""
    chosen = np.nonzero(choice != DEV)[0]
    if len(chosen) == 0:
        return
    order = chosen[np.lexsort((-chosen, -added[chosen, choice[chosen]]))]
    for ci in order.tolist():
        a = int(choice[ci])
        # Downgrades to try, cheapest first: back to device, or remat -> offload.
        options = [DEV] + ([OFF] if a == REM and m.allowed[ci, OFF] else [])
        options.sort(key=lambda o: added[ci, o])
        for new in options:
            if added[ci, new] >= added[ci, a] and new != DEV:
                continue
            trial = tl.copy() if len(m.cand_inst[ci]) > 1 else None
            if trial is not None:
                _apply(m, trial, ci, a, new)
                if (trial > target).any():
                    continue
                tl[:] = trial
            else:
                i = int(m.cand_inst[ci][0])
                b = int(m.inst_bytes[i])
                lo, hi = int(m.gap0[i, a]), int(m.gap1[i, a])
                if lo <= hi:
                    seg = tl[lo:hi + 1] + b
                    if new != DEV:
                        lo2, hi2 = int(m.gap0[i, new]), int(m.gap1[i, new])
                        if lo2 <= hi2:
                            seg[max(lo2, lo) - lo:max(min(hi2, hi) - lo + 1, 0)] -= b
                            if lo2 < lo or hi2 > hi:  # new gap wider than old: general path
                                trial = tl.copy()
                                _apply(m, trial, ci, a, new)
                                if (trial > target).any():
                                    continue
                                tl[:] = trial
                                choice[ci] = new
                                break
                    if (seg > target[lo:hi + 1]).any():
                        continue
                    tl[lo:hi + 1] = seg
            choice[ci] = new
            break


def least_peak_choice(m: Model) -> np.ndarray:
    """Every candidate off device the way that frees the most bytes in total (REMAT first)."""
    choice = np.zeros(m.n_cands, dtype=np.int64)
    choice[m.allowed[:, OFF]] = OFF
    choice[m.allowed[:, REM]] = REM
    return choice


def solve_heuristic(
    problem: Problem,
    *,
    budget_bytes: int,
    model: Model | None = None,
    start: np.ndarray | None = None,
) -> HeuristicResult:
    """A plan whose replayed peak is <= ``budget_bytes`` at low modeled step time (module doc)."""
    t0 = time.perf_counter()
    m = model if model is not None else Model.build(problem)
    added = m.added_s()
    target = np.full(m.n_steps, budget_bytes, dtype=np.int64)
    choice = np.zeros(m.n_cands, dtype=np.int64) if start is None else start.copy()
    tl = m.timeline(choice)
    best: tuple[float, np.ndarray, SimResult] | None = None
    for rnd in range(1, _ROUNDS + 1):
        ok = _greedy(m, choice, tl, target, added)
        _prune(m, choice, tl, target, added)
        dec = m.decisions_of(choice)
        sim = simulate(problem, dec)
        if sim.peak_bytes <= budget_bytes:
            if best is None or sim.step_time_s < best[0]:
                best = (sim.step_time_s, choice.copy(), sim)
            return HeuristicResult(dec, sim, choice, rnd, time.perf_counter() - t0)
        if not ok:
            break
        # Cut: the model under-counts these steps by the replay's excess.
        real = np.asarray(sim.timeline_bytes, dtype=np.int64)
        over = real > budget_bytes
        target[over] -= real[over] - budget_bytes
        tl = m.timeline(choice)
    choice = least_peak_choice(m)
    dec = m.decisions_of(choice)
    sim = simulate(problem, dec)
    if sim.peak_bytes <= budget_bytes:
        # Feasible but slow; undo what the replay shows is not needed.
        real = np.asarray(sim.timeline_bytes, dtype=np.int64)
        target = np.full(m.n_steps, budget_bytes, dtype=np.int64) - np.maximum(real - m.timeline(choice), 0)
        tl = m.timeline(choice)
        trial = choice.copy()
        _prune(m, trial, tl, target, added)
        sim2 = simulate(problem, m.decisions_of(trial))
        if sim2.peak_bytes <= budget_bytes:
            choice, sim, dec = trial, sim2, m.decisions_of(trial)
        return HeuristicResult(dec, sim, choice, _ROUNDS + 1, time.perf_counter() - t0)
    raise HeuristicFailed(
        f"no plan found within {budget_bytes} bytes (least-peak plan replays at {sim.peak_bytes})")
