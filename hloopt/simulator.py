"""The one simulator: replay a :class:`~hloopt.problem.Problem` under :class:`~hloopt.problem.Decisions`.

Every strategy (MILP, heuristic, a JAX built-in policy) is judged here; it is the only place
bytes and seconds are added up. ``simulate(problem, decisions)`` gives the memory timeline
(device bytes per step), the step time with stalls, and every host transfer.

Model (times in seconds, steps run in schedule order)::

    step        p        p+1      ...  lfu  ...          f-1        f=fbu     ...  lu
    compute  [=======][=======]      [=====]         [=======]  |stall|[=====]     [=====]
    d2h               [~~~lat+B/bw~~~]                    (engine FIFO, production order)
    h2d                                           [~~~lat+B/bw~~~]  ends by start of step f
    device   [=================================]  [=================================]
             produced   max(lfu, d2h done)        h2d start                 last_use

* Step ``t`` takes ``duration_s`` plus, for remat, ``remat_s / len(instances)`` of each REMAT
  candidate whose instance has its first backward use at ``t``, less ``keep_s / len(instances)``
  of each OFFLOAD candidate's there. Step ``t`` *spans*
  ``[S[t], S[t+1])``: a stall before step ``t+1`` belongs to step ``t``'s span.
* **Offload (D2H)** of an instance starts when its producing step ends (or later, when all
  ``dma_engines`` D2H engines are busy: engines serve offloads first come first served in
  production order). It lasts ``latency + bytes / rate``.
* **Reload (H2D)** must end before its first backward use step starts; otherwise that step waits
  (the wait is *exposed transfer time*). Reloads are planned **as late as possible** so reloaded
  buffers sit on device the shortest time: in the stall-free ("nominal") timeline, reloads are
  taken in decreasing deadline order and each is placed on the H2D engine that is free latest,
  ending at ``min(deadline, that engine's next planned start)`` (backward list scheduling, so on
  each engine the order is earliest-deadline-first). At run time a reload starts at
  ``max(planned start, its D2H end, start of step fbu - prefetch_window_steps, engine free)``;
  planned times are kept relative to the step they fall in, so earlier stalls move them along.
* **Duplex**: a transfer whose interval overlaps any transfer in the other direction runs, all
  of it, at the duplex rate (``duplex_*_bytes_per_s``). This charges a partial overlap as a full
  one (conservative). It is reached by a fixpoint: simulate, mark every transfer that overlaps
  the other direction, re-simulate with marked transfers at the duplex rate; marks only grow, and
  after ``_MAX_DUPLEX_PASSES`` every transfer is marked (fully conservative).
* **Device bytes** of an instance are live on the steps whose span meets them:
  DEVICE ``[produced, last_use]``; OFFLOAD ``[produced, max(last_forward_use, step where the
  D2H ends)]`` and ``[step where the H2D starts, last_use]``; REMAT ``[produced,
  last_forward_use]`` and ``[first_backward_use, last_use]`` (only the first when the candidate's
  recomputation is fused into its readers, ``remat_fused``; neither when its values are
  temporaries of the loop iterations computing them, ``remat_transient``, which the steps' base
  holds). Where the two intervals touch or
  overlap, the instance counts once (their union). An OFFLOAD instance with
  ``first_backward_use <= last_forward_use`` moves nothing and stays on device.
* Memory at step ``t`` = ``max(base_bytes[t] + live instance bytes, floor_bytes[t] + live argument
  group bytes)`` (live
  bytes summed with numpy difference arrays; the floor is the side of libtpu's accounting no
  decision lowers, 0 when there is none). Step time = end of the last step = compute time + exposed transfer time.

Invariants: ``Decisions.all_device()`` gives ``peak = max_t(max(base[t] + live instances, floor[t]))`` and
``step_time = sum(duration_s)``; no result is below :func:`lower_bound_peak` /
:func:`lower_bound_time`. Cost: ``O((steps + instances) log instances)`` per pass, a handful of
passes.
"""

from __future__ import annotations

import bisect
import heapq
import math
import weakref
from dataclasses import dataclass

import numpy as np

from hloopt.problem import Action, Decisions, Problem, SimResult

__all__ = ["simulate", "lower_bound_peak", "lower_bound_time", "instance_intervals"]

#: Duplex fixpoint passes before every transfer is charged the duplex rate.
_MAX_DUPLEX_PASSES = 6


# -- per-problem arrays (cached: the search simulates one Problem many times) -----------------


@dataclass(frozen=True)
class _Arrays:
    duration_s: np.ndarray  # float64 [T]
    base_bytes: np.ndarray  # int64 [T]
    floor_bytes: np.ndarray  # int64 [T]
    #: Flattened instances of all candidates, in candidate then instance order.
    cand: np.ndarray  # int64 [N] candidate index
    inst: np.ndarray  # int64 [N] instance index within its candidate
    bytes: np.ndarray  # int64 [N]
    produced: np.ndarray
    lfu: np.ndarray
    fbu: np.ndarray
    last_use: np.ndarray
    #: per instance: its candidate's ``remat_fused``
    remat_fused: np.ndarray  # bool [N]
    #: per instance: its candidate's ``remat_transient``
    remat_transient: np.ndarray  # bool [N]
    #: per instance: its candidate is an argument group (``Candidate.state``)
    state: np.ndarray  # bool [N]
    #: per instance: its share of its candidate's ``remat_s`` and ``keep_s``
    remat_share_s: np.ndarray  # float64 [N]
    keep_share_s: np.ndarray  # float64 [N]
    #: Row ranges of each candidate in the flat arrays.
    starts: np.ndarray  # int64 [C+1]
    key_index: dict[str, int]


_cache: dict[int, tuple[weakref.ref, _Arrays]] = {}


def _arrays(problem: Problem) -> _Arrays:
    hit = _cache.get(id(problem))
    if hit is not None and hit[0]() is problem:
        return hit[1]
    T = len(problem.steps)
    rows = [(ci, ii, x) for ci, c in enumerate(problem.candidates) for ii, x in enumerate(c.instances)]
    starts = np.zeros(len(problem.candidates) + 1, dtype=np.int64)
    np.cumsum([len(c.instances) for c in problem.candidates], out=starts[1:])

    def col(f) -> np.ndarray:
        return np.fromiter((f(r) for r in rows), dtype=np.int64, count=len(rows))

    a = _Arrays(
        duration_s=np.fromiter((s.duration_s for s in problem.steps), dtype=np.float64, count=T),
        base_bytes=np.fromiter((s.base_bytes for s in problem.steps), dtype=np.int64, count=T),
        floor_bytes=np.fromiter((s.floor_bytes for s in problem.steps), dtype=np.int64, count=T),
        cand=col(lambda r: r[0]),
        inst=col(lambda r: r[1]),
        bytes=col(lambda r: r[2].bytes),
        produced=col(lambda r: r[2].produced),
        lfu=col(lambda r: r[2].last_forward_use),
        fbu=col(lambda r: r[2].first_backward_use),
        last_use=col(lambda r: r[2].last_use),
        remat_fused=np.fromiter((problem.candidates[r[0]].remat_fused for r in rows), dtype=bool, count=len(rows)),
        remat_transient=np.fromiter((problem.candidates[r[0]].remat_transient for r in rows), dtype=bool,
                                    count=len(rows)),
        state=np.fromiter((problem.candidates[r[0]].state is not None for r in rows), dtype=bool, count=len(rows)),
        remat_share_s=np.fromiter((problem.candidates[r[0]].remat_s / len(problem.candidates[r[0]].instances)
                                   for r in rows), dtype=np.float64, count=len(rows)),
        keep_share_s=np.fromiter((problem.candidates[r[0]].keep_s / len(problem.candidates[r[0]].instances)
                                  for r in rows), dtype=np.float64, count=len(rows)),
        starts=starts,
        key_index={c.key: i for i, c in enumerate(problem.candidates)},
    )
    _validate(problem, a)
    if len(_cache) > 64:
        for k in [k for k, (r, _) in _cache.items() if r() is None]:
            del _cache[k]
    try:
        _cache[id(problem)] = (weakref.ref(problem), a)
    except TypeError:  # pragma: no cover - Problem always supports weak references
        pass
    return a


def _validate(problem: Problem, a: _Arrays) -> None:
    T = len(problem.steps)
    if (a.duration_s < 0).any() or not np.isfinite(a.duration_s).all():
        raise ValueError("step durations must be finite and >= 0")
    if (a.bytes < 0).any():
        raise ValueError("instance bytes must be >= 0")
    ok = (
        (a.produced >= 0)
        & (a.produced <= a.lfu)
        & (a.lfu <= a.last_use)
        & (a.fbu <= a.last_use)
        & (a.fbu > a.produced)
        & (a.last_use < T)
    )
    if not ok.all():
        j = int(np.flatnonzero(~ok)[0])
        c = problem.candidates[int(a.cand[j])]
        raise ValueError(
            f"candidate {c.key!r} instance {int(a.inst[j])}: need 0 <= produced <= last_forward_use "
            f"<= last_use < {T} steps and produced < first_backward_use <= last_use; got {c.instances[int(a.inst[j])]}"
        )
    for name in ("d2h_bytes_per_s", "h2d_bytes_per_s", "duplex_d2h_bytes_per_s", "duplex_h2d_bytes_per_s"):
        if not getattr(problem, name) > 0:
            raise ValueError(f"{name} must be > 0 (math.inf for an ideal link)")
    if problem.transfer_latency_s < 0 or problem.dma_engines < 1:
        raise ValueError("transfer_latency_s must be >= 0 and dma_engines >= 1")
    if problem.prefetch_window_steps is not None and problem.prefetch_window_steps < 1:
        raise ValueError("prefetch_window_steps must be >= 1 (or None)")


def _action_codes(problem: Problem, a: _Arrays, decisions: Decisions) -> np.ndarray:
    """Per flat instance: 0 device, 1 offload, 2 remat. Rejects unknown keys and disallowed actions."""
    code = np.zeros(len(a.bytes), dtype=np.int8)
    for key, action in decisions.actions.items():
        action = Action(action)
        ci = a.key_index.get(key)
        if ci is None:
            raise ValueError(f"decision for unknown candidate {key!r}")
        if action is Action.DEVICE:
            continue
        if action not in problem.candidates[ci].allowed:
            raise ValueError(f"candidate {key!r} does not allow {action.value}")
        code[a.starts[ci] : a.starts[ci + 1]] = 1 if action is Action.OFFLOAD else 2
    return code


def _interval_sum(T: int, lo: np.ndarray, hi: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum of w over inclusive step intervals [lo, hi] (empty where hi < lo), as int64 [T]."""
    keep = hi >= lo
    diff = np.zeros(T + 1, dtype=np.int64)
    np.add.at(diff, lo[keep], w[keep])
    np.add.at(diff, hi[keep] + 1, -w[keep])
    return np.cumsum(diff[:T])


# -- bounds ----------------------------------------------------------------------------------


def lower_bound_time(problem: Problem) -> float:
    """Least step time any policy can reach: the sum of step durations (no stall), less what each
    candidate's cheapest allowed action can take off it (recomputing or offloading a scanned
    residual spares its stack's writes and reads, ``Candidate.keep_s``)."""
    credit = 0.0
    for c in problem.candidates:
        gains = [0.0]
        if Action.REMAT in c.allowed:
            gains.append(-c.remat_s)
        if Action.OFFLOAD in c.allowed:
            gains.append(c.keep_s)
        credit += max(gains)
    return math.fsum(s.duration_s for s in problem.steps) - credit


def lower_bound_peak(problem: Problem) -> int:
    """Least peak any policy can reach.

    Every candidate that allows OFFLOAD or REMAT is off device between its last forward use and
    its first backward use (what offload gives at infinite bandwidth and zero latency, and what
    remat gives); the others stay on device for their whole life.
    """
    return int(_lower_bound_timeline(problem).max(initial=0))


def _lower_bound_timeline(problem: Problem) -> np.ndarray:
    a = _arrays(problem)
    T = len(a.duration_s)
    movable = np.zeros(len(a.bytes), dtype=bool)
    gone = np.zeros(len(a.bytes), dtype=bool)  # fused remat: off device after the forward pass
    never = np.zeros(len(a.bytes), dtype=bool)  # transient remat: never counted apart from the base
    for ci, c in enumerate(problem.candidates):
        if c.allowed & {Action.OFFLOAD, Action.REMAT}:
            movable[a.starts[ci] : a.starts[ci + 1]] = True
        if Action.REMAT in c.allowed and (c.remat_fused or c.remat_transient):
            gone[a.starts[ci] : a.starts[ci + 1]] = True
        if Action.REMAT in c.allowed and c.remat_transient:
            never[a.starts[ci] : a.starts[ci + 1]] = True
    lo1, lo2 = a.produced, np.maximum(a.fbu, a.lfu + 1)
    hi1 = np.where(never, -1, np.where(movable, a.lfu, a.last_use))
    hi2 = np.where(movable & ~gone, a.last_use, -1)
    return np.maximum(a.base_bytes + _interval_sum(T, lo1, hi1, a.bytes) + _interval_sum(T, lo2, hi2, a.bytes),
                      _floor(a, T, lo1, hi1, lo2, hi2))


def _floor(a: _Arrays, T: int, lo1: np.ndarray, hi1: np.ndarray, lo2: np.ndarray, hi2: np.ndarray) -> np.ndarray:
    """The floor side of each step (``Step.floor_bytes``) plus the argument groups' instances live
    on the device: libtpu counts arguments and outputs on both of its heaps' sides, so an argument
    group in host memory lowers both (the problem's floor leaves them out)."""
    st = a.state
    if not st.any() or not a.floor_bytes.any():
        return a.floor_bytes
    w = a.bytes[st]
    return a.floor_bytes + _interval_sum(T, lo1[st], hi1[st], w) + _interval_sum(T, lo2[st], hi2[st], w)


def instance_intervals(problem: Problem) -> list[tuple[str, int, int, int, int, int]]:
    """(key, instance index, produced, last_forward_use, first_backward_use, last_use) rows, for reports."""
    return [
        (c.key, i, x.produced, x.last_forward_use, x.first_backward_use, x.last_use)
        for c in problem.candidates
        for i, x in enumerate(c.instances)
    ]


# -- simulation --------------------------------------------------------------------------------


def _rate_s(nbytes: np.ndarray, rate: float, latency: float) -> np.ndarray:
    if math.isinf(rate):
        return np.full(len(nbytes), latency, dtype=np.float64)
    return latency + nbytes.astype(np.float64) / rate


def _overlaps(s: np.ndarray, e: np.ndarray, os_: np.ndarray, oe: np.ndarray, tol: float) -> np.ndarray:
    """For each interval [s, e): does any interval [os_, oe) overlap it by more than ``tol``?"""
    if len(s) == 0 or len(os_) == 0:
        return np.zeros(len(s), dtype=bool)
    keep = oe > os_ + tol
    os_, oe = os_[keep], oe[keep]
    if len(os_) == 0:
        return np.zeros(len(s), dtype=bool)
    order = np.argsort(os_, kind="stable")
    os_, oe = os_[order], oe[order]
    prefix_max_end = np.maximum.accumulate(oe)
    n_before = np.searchsorted(os_, e - tol, side="left")  # others that start before e
    got = n_before > 0
    out = np.zeros(len(s), dtype=bool)
    idx = np.flatnonzero(got & (e > s + tol))
    out[idx] = prefix_max_end[n_before[idx] - 1] > s[idx] + tol
    return out


def _plan_reloads(S0: np.ndarray, fbu: np.ndarray, dur: np.ndarray, engines: int):
    """ALAP backward list scheduling in the nominal timeline: planned start and engine per reload."""
    n = len(fbu)
    deadline = S0[fbu]
    order = np.lexsort((np.arange(n), fbu))  # EDF order (ties: flat index)
    start = np.empty(n, dtype=np.float64)
    engine = np.zeros(n, dtype=np.int64)
    if engines == 1:
        free_before = math.inf
        for j in order[::-1].tolist():
            end = min(deadline[j], free_before)
            free_before = start[j] = end - dur[j]
    else:
        heap = [(-math.inf, e) for e in range(engines)]  # max-heap on free_before via negation
        for j in order[::-1].tolist():
            neg, e = heapq.heappop(heap)
            end = min(deadline[j], -neg)
            start[j] = end - dur[j]
            engine[j] = e
            heapq.heappush(heap, (-start[j], e))
    return order, start, engine


def _run(problem, S0, fbu, prod, d2h_dur, h2d_dur, tol):
    """One pass with fixed transfer durations. Returns stall per step, d2h and h2d intervals."""
    T = len(S0) - 1
    n = len(fbu)
    engines = problem.dma_engines
    w = problem.prefetch_window_steps
    order, plan_start, plan_engine = _plan_reloads(S0, fbu, h2d_dur, engines)
    plan_step = np.minimum(np.searchsorted(S0, plan_start, side="right") - 1, fbu)
    plan_step = np.maximum(plan_step, 0)
    plan_off = plan_start - S0[plan_step]

    bp_steps: list[int] = [0]
    bp_shift: list[float] = [0.0]

    def shift_at(t: int) -> float:
        return bp_shift[bisect.bisect_right(bp_steps, t) - 1]

    d2h_order = np.lexsort((np.arange(n), prod)).tolist()
    d2h_start = np.zeros(n)
    d2h_end = np.zeros(n)
    h2d_start = np.zeros(n)
    h2d_end = np.zeros(n)
    d2h_free = [0.0] * engines  # heap of engine free times
    h2d_free = [0.0] * engines
    prod_l = prod.tolist()
    S0_l = S0.tolist()
    d2h_dur_l = d2h_dur.tolist()
    h2d_dur_l = h2d_dur.tolist()
    ptr = 0

    def issue_d2h(i: int) -> None:
        p = prod_l[i]
        ready = S0_l[p + 1] + shift_at(p)
        free = heapq.heappop(d2h_free)
        s = ready if ready > free else free
        e = s + d2h_dur_l[i]
        d2h_start[i] = s
        d2h_end[i] = e
        heapq.heappush(d2h_free, e)

    for j in order.tolist():
        f = int(fbu[j])
        while ptr < n and prod_l[d2h_order[ptr]] < f:
            issue_d2h(d2h_order[ptr])
            ptr += 1
        cur = bp_shift[-1]
        deadline = S0_l[f] + cur
        release = d2h_end[j]
        if w is not None:
            ws = max(0, f - w)
            release = max(release, S0_l[ws] + shift_at(ws))
        ps = int(plan_step[j])
        planned = S0_l[ps] + float(plan_off[j]) + shift_at(ps)
        eng = int(plan_engine[j])
        s = max(planned, release, h2d_free[eng])
        e = s + h2d_dur_l[j]
        h2d_free[eng] = e
        h2d_start[j] = s
        h2d_end[j] = e
        if e > deadline + tol:
            stall = e - deadline
            if bp_steps[-1] == f:
                bp_shift[-1] = cur + stall
            else:
                bp_steps.append(f)
                bp_shift.append(cur + stall)
    while ptr < n:
        issue_d2h(d2h_order[ptr])
        ptr += 1

    shift = np.zeros(T + 1)
    prev = 0.0
    for st, sh in zip(bp_steps, bp_shift):
        shift[st] += sh - prev
        prev = sh
    shift = np.cumsum(shift)
    return S0 + shift, d2h_start, d2h_end, h2d_start, h2d_end


def simulate(problem: Problem, decisions: Decisions) -> SimResult:
    """Replay ``problem`` under ``decisions``: memory per step, step time, transfers (see module doc)."""
    a = _arrays(problem)
    T = len(a.duration_s)
    code = _action_codes(problem, a, decisions)

    # Remat: spread each candidate's remat_s over its instances, at their first backward use;
    # offload: likewise the keep_s its stack no longer costs the device.
    dur = a.duration_s.copy()
    per = np.where(code == 2, a.remat_share_s, np.where(code == 1, -a.keep_share_s, 0.0))
    sel = per != 0.0
    if sel.any():
        np.add.at(dur, a.fbu[sel], per[sel])
        # remat_s is net of the stack writes and reads a kept scanned residual costs, so it can
        # be negative; a step is never shorter than nothing
        np.maximum(dur, 0.0, out=dur)
    S0 = np.zeros(T + 1)
    np.cumsum(dur, out=S0[1:])
    compute_s = float(S0[T])

    # Offloads that move something (a gap between forward and backward use).
    offl_mask = (code == 1) & (a.fbu > a.lfu)
    offl = np.flatnonzero(offl_mask)
    S = S0
    transfers: list[tuple[str, int, str, float, float]] = []
    d2h_end_step = h2d_start_step = np.zeros(0, dtype=np.int64)
    if len(offl):
        nb = a.bytes[offl]
        fbu, prod = a.fbu[offl], a.produced[offl]
        lat = problem.transfer_latency_s
        rates = (
            _rate_s(nb, problem.d2h_bytes_per_s, lat),
            _rate_s(nb, problem.duplex_d2h_bytes_per_s, lat),
            _rate_s(nb, problem.h2d_bytes_per_s, lat),
            _rate_s(nb, problem.duplex_h2d_bytes_per_s, lat),
        )
        # Float slack for comparing times (cumulative sums of many durations round).
        tol = 1e-9 * max(float(S0[-1]), 1e-12)
        mark_d = np.zeros(len(offl), dtype=bool)
        mark_h = np.zeros(len(offl), dtype=bool)
        for npass in range(_MAX_DUPLEX_PASSES + 1):
            if npass == _MAX_DUPLEX_PASSES:
                mark_d[:] = True
                mark_h[:] = True
            d2h_dur = np.where(mark_d, rates[1], rates[0])
            h2d_dur = np.where(mark_h, rates[3], rates[2])
            S, ds, de, hs, he = _run(problem, S0, fbu, prod, d2h_dur, h2d_dur, tol)
            if npass == _MAX_DUPLEX_PASSES:
                break
            new_d = _overlaps(ds, de, hs, he, tol) & ~mark_d
            new_h = _overlaps(hs, he, ds, de, tol) & ~mark_h
            if not new_d.any() and not new_h.any():
                break
            mark_d |= new_d
            mark_h |= new_h
        # Step whose span [S[t], S[t+1]) holds the D2H end / H2D start.
        d2h_end_step = np.minimum(np.searchsorted(S[1:], de - tol, side="left"), fbu)
        h2d_start_step = np.minimum(np.searchsorted(S, hs + tol, side="right") - 1, fbu)
        keys = [c.key for c in problem.candidates]
        cand_l, inst_l = a.cand[offl].tolist(), a.inst[offl].tolist()
        for k in range(len(offl)):
            key, ii = keys[cand_l[k]], inst_l[k]
            transfers.append((key, ii, "d2h", float(ds[k]), float(de[k])))
            transfers.append((key, ii, "h2d", float(hs[k]), float(he[k])))
        transfers.sort(key=lambda x: (x[3], x[2] == "d2h"))

    # Device intervals per instance: [lo1, hi1] and [lo2, hi2] (second empty when hi2 < lo2).
    lo1 = a.produced
    hi1 = a.last_use.copy()
    lo2 = np.zeros_like(lo1)
    hi2 = np.full_like(lo1, -1)
    split = (code == 2) | offl_mask
    hi1[split] = a.lfu[split]
    lo2[split] = a.fbu[split]
    hi2[split] = a.last_use[split]
    if len(offl):
        # an argument group in host memory is not on the device before its reload: its copy out
        # (the previous step's write-back of its update) uses the link, not device memory
        hi1[offl] = np.where(a.state[offl], -1, np.maximum(a.lfu[offl], d2h_end_step))
        lo2[offl] = h2d_start_step
    hi2[(code == 2) & (a.remat_fused | a.remat_transient)] = -1  # recomputed inside each reader: never stored again
    hi1[(code == 2) & a.remat_transient] = -1  # a temporary of its iteration, which the base holds
    lo2 = np.maximum(lo2, hi1 + 1)
    timeline = np.maximum(a.base_bytes + _interval_sum(T, lo1, hi1, a.bytes) + _interval_sum(T, lo2, hi2, a.bytes),
                          _floor(a, T, lo1, hi1, lo2, hi2))
    # host memory: offloaded residuals from their copy out to their last read, argument groups
    # in host memory (placed there, or updated there) for the whole step
    host_lo = np.zeros(0, dtype=np.int64)
    host_hi = np.zeros(0, dtype=np.int64)
    host_w = np.zeros(0, dtype=np.int64)
    if len(offl):
        host_lo = np.where(a.state[offl], 0, d2h_end_step)
        host_hi = np.where(a.state[offl], T - 1, a.last_use[offl])
        host_w = a.bytes[offl]
    on_host = np.nonzero((code == 2) & a.state)[0]
    host_lo = np.concatenate([host_lo, np.zeros(len(on_host), dtype=np.int64)])
    host_hi = np.concatenate([host_hi, np.full(len(on_host), T - 1, dtype=np.int64)])
    host_w = np.concatenate([host_w, a.bytes[on_host]])
    host_timeline = _interval_sum(T, host_lo, host_hi, host_w) if T else np.zeros(0, dtype=np.int64)

    step_time = float(S[T]) if T else 0.0
    peak_step = int(np.argmax(timeline)) if T else 0
    return SimResult(
        peak_bytes=int(timeline[peak_step]) if T else 0,
        peak_step=peak_step,
        step_time_s=step_time,
        compute_time_s=compute_s,
        exposed_transfer_s=float(S[T] - S0[T]) if T else 0.0,
        timeline_bytes=timeline.tolist(),
        transfers=tuple(transfers),
        step_start_s=S[:T].tolist(),
        host_timeline_bytes=host_timeline.tolist(),
        stall_weight=problem.stall_weight,
    )
