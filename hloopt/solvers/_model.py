"""The solvers' vectorized view of a Problem: what each decision frees, and when, in numpy arrays.

The simulator (:mod:`hloopt.simulator`) is the judge of every plan; the solvers need a model they
can evaluate thousands of times per second and write as linear constraints. This module builds it
once per Problem under *nominal* timing (every step takes its ``duration_s``, no stalls, every
transfer has the link to itself):

  * all-device timeline: ``dev_bytes[t] = base_bytes[t] + sum of instances live at t``;
  * for each instance and each non-device action, one *gap* ``[g0, g1]`` of steps (inclusive,
    empty when ``g0 > g1``) during which the action removes the instance's bytes from device:

        OFFLOAD: freed after the step in which both its last forward use and its device-to-host
                 copy (issued at the end of ``produced``: latency + bytes / d2h rate) are done;
                 back from the step in which its host-to-device copy must start to finish by the
                 start of ``first_backward_use`` (started no earlier than that copy needs).
        REMAT:   freed after ``last_forward_use``, recomputed at ``first_backward_use``.

  * transfer seconds per instance (``d2h_s``, ``h2d_s``) and each reload's nominal *lateness*:
    a reload cannot start before its copy out ends nor before
    ``start(first_backward_use - prefetch_window_steps)``; when that is later than
    ``deadline - h2d_s`` the backward step waits. As in the simulator, reloads are planned as
    late as possible, so link contention costs memory (reloads start earlier, copies out end
    later), not time; the solvers treat contention through replay and per-step cuts.

So the timeline under decisions is ``dev_bytes - sum(bytes over chosen gaps)``: linear in the
decisions, which is what the MILP needs and what lets the heuristic update it with one slice.
Invariant: ``timeline(all device) == dev_bytes``, which the simulator also reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hloopt.problem import Action, Decisions, Problem

#: Column order of the per-candidate action arrays.
ACTIONS: tuple[Action, ...] = (Action.DEVICE, Action.OFFLOAD, Action.REMAT)
DEV, OFF, REM = 0, 1, 2


@dataclass(frozen=True, eq=False)
class Model:
    """Numpy arrays describing one Problem (see the module docstring)."""

    problem: Problem
    n_steps: int
    n_cands: int
    duration_s: np.ndarray      # (T,)
    start_s: np.ndarray         # (T,) nominal
    end_s: np.ndarray           # (T,) nominal
    base_bytes: np.ndarray      # (T,) int64
    dev_bytes: np.ndarray       # (T,) int64, all-device timeline
    inst_cand: np.ndarray       # (I,) candidate index of each instance
    inst_bytes: np.ndarray      # (I,) int64
    produced: np.ndarray        # (I,)
    last_fwd: np.ndarray        # (I,) last forward use
    last_use: np.ndarray        # (I,)
    first_bwd: np.ndarray       # (I,)
    d2h_s: np.ndarray           # (I,)
    h2d_s: np.ndarray           # (I,)
    reload_release_s: np.ndarray  # (I,) earliest start of the reload (nominal)
    reload_deadline_s: np.ndarray  # (I,) start of first_backward_use (nominal)
    late_s: np.ndarray          # (I,) nominal stall if offloaded alone
    gap0: np.ndarray            # (I, 3) first freed step per action (DEVICE column unused)
    gap1: np.ndarray            # (I, 3) last freed step per action
    allowed: np.ndarray         # (C, 3) bool
    remat_s: np.ndarray         # (C,)
    keep_s: np.ndarray          # (C,) what an offload spares the device (Candidate.keep_s)
    cand_inst: tuple[np.ndarray, ...]  # per candidate: its instance indices
    compute_s: float

    @staticmethod
    def build(problem: Problem) -> "Model":
        steps = problem.steps
        T = len(steps)
        dur = np.array([s.duration_s for s in steps], dtype=np.float64)
        base = np.array([s.base_bytes for s in steps], dtype=np.int64)
        end = np.cumsum(dur)
        start = end - dur
        cands = problem.candidates
        C = len(cands)
        counts = np.array([len(c.instances) for c in cands], dtype=np.int64)
        inst_cand = np.repeat(np.arange(C), counts)
        flat = [i for c in cands for i in c.instances]
        ib = np.array([i.bytes for i in flat], dtype=np.int64)
        prod = np.array([i.produced for i in flat], dtype=np.int64)
        lfu = np.array([i.last_forward_use for i in flat], dtype=np.int64)
        fbu = np.array([i.first_backward_use for i in flat], dtype=np.int64)
        last = np.array([i.last_use for i in flat], dtype=np.int64)
        lat = problem.transfer_latency_s
        d2h_s = lat + ib / problem.d2h_bytes_per_s
        h2d_s = lat + ib / problem.h2d_bytes_per_s

        # All-device timeline with a difference array.
        diff = np.zeros(T + 1, dtype=np.int64)
        np.add.at(diff, prod, ib)
        np.add.at(diff, last + 1, -ib)
        dev = base + np.cumsum(diff[:-1])

        gap0 = np.zeros((len(flat), 3), dtype=np.int64)
        gap1 = np.full((len(flat), 3), -1, dtype=np.int64)
        # OFFLOAD: the copy out ends at end[prod] + d2h; the step holding that instant keeps it.
        d2h_done = end[prod] + d2h_s
        hold = np.searchsorted(end, d2h_done, side="left")
        gap0[:, OFF] = np.maximum(lfu, hold) + 1
        # The copy back must start h2d seconds before fbu starts; every step ending after that
        # instant holds it.
        deadline = start[fbu]
        reload_start = deadline - h2d_s
        gap1[:, OFF] = np.minimum(np.searchsorted(end, reload_start, side="right"), fbu) - 1
        # REMAT: dead after the last forward use, recomputed at fbu (the simulator's convention);
        # a candidate recomputed inside its readers (``remat_fused``) is never stored again, and
        # one whose values are temporaries of the loop iterations computing them
        # (``remat_transient``) is never counted apart from those iterations.
        fused = np.array([c.remat_fused or c.remat_transient for c in cands for _ in c.instances], dtype=bool)
        transient = np.array([c.remat_transient for c in cands for _ in c.instances], dtype=bool)
        gap0[:, REM] = np.where(transient, prod, lfu + 1)
        gap1[:, REM] = np.where(fused, last, fbu - 1)
        window = problem.prefetch_window_steps
        if window is None:
            release = d2h_done
        else:
            release = np.maximum(d2h_done, start[np.maximum(fbu - window, 0)])
        late = np.maximum(0.0, release + h2d_s - deadline)
        late[fbu <= lfu] = 0.0

        allowed = np.zeros((C, 3), dtype=bool)
        for ci, c in enumerate(cands):
            for a, act in enumerate(ACTIONS):
                allowed[ci, a] = act in c.allowed
        allowed[:, DEV] = True
        remat = np.array([c.remat_s for c in cands], dtype=np.float64)
        keep = np.array([c.keep_s for c in cands], dtype=np.float64)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        cand_inst = tuple(np.arange(offsets[ci], offsets[ci + 1]) for ci in range(C))
        return Model(
            problem=problem, n_steps=T, n_cands=C, duration_s=dur, start_s=start, end_s=end,
            base_bytes=base, dev_bytes=dev, inst_cand=inst_cand, inst_bytes=ib, produced=prod, last_fwd=lfu,
            last_use=last, first_bwd=fbu, d2h_s=d2h_s, h2d_s=h2d_s, reload_release_s=release,
            reload_deadline_s=deadline, late_s=late, gap0=gap0, gap1=gap1, allowed=allowed, remat_s=remat, keep_s=keep,
            cand_inst=cand_inst, compute_s=float(dur.sum()),
        )

    # -- decisions <-> arrays ---------------------------------------------------------------

    def choice_of(self, decisions: Decisions) -> np.ndarray:
        """Action column per candidate (0 device, 1 offload, 2 remat)."""
        idx = {a: i for i, a in enumerate(ACTIONS)}
        return np.array([idx[decisions.action(c.key)] for c in self.problem.candidates], dtype=np.int64)

    def decisions_of(self, choice: np.ndarray) -> Decisions:
        cands = self.problem.candidates
        return Decisions({cands[ci].key: ACTIONS[int(a)] for ci, a in enumerate(choice) if a != DEV})

    # -- evaluation under the nominal model -------------------------------------------------

    def timeline(self, choice: np.ndarray) -> np.ndarray:
        """Device bytes per step under ``choice`` (nominal timing)."""
        act = choice[self.inst_cand]
        sel = act != DEV
        diff = np.zeros(self.n_steps + 1, dtype=np.int64)
        if sel.any():
            rows = np.nonzero(sel)[0]
            g0 = self.gap0[rows, act[rows]]
            g1 = self.gap1[rows, act[rows]]
            ok = g0 <= g1
            np.add.at(diff, g0[ok], -self.inst_bytes[rows][ok])
            np.add.at(diff, g1[ok] + 1, self.inst_bytes[rows][ok])
        return self.dev_bytes + np.cumsum(diff[:-1])

    def added_s(self) -> np.ndarray:
        """(C, 3) modeled seconds each action adds on its own, as the search weighs them: the
        compute a recomputation re-runs, or the reloads' stalls. Not net of the stack writes and
        reads either move spares the device (``keep_s``, which the replay and the step time
        count): the search moves a residual to meet the budget, and a recomputation weighed net
        of them could look free, and be chosen, where it only adds FLOPs."""
        out = np.zeros((self.n_cands, 3))
        out[:, REM] = self.remat_s + self.keep_s
        out[:, OFF] = self.problem.stall_weight * np.bincount(self.inst_cand, weights=self.late_s,
                                                              minlength=self.n_cands)
        return out

    def step_time(self, choice: np.ndarray) -> float:
        """Nominal step time: compute + recompute + reload stalls (each alone)."""
        return self.compute_s + float(self.added_s()[np.arange(self.n_cands), choice].sum())


    # -- evaluation with the link's queues ----------------------------------------------------

    def link_eval(self, choice: np.ndarray) -> "LinkEval":
        """Timeline and step time under ``choice`` with the link's queues (see :class:`LinkEval`)."""
        return LinkEval.of(self, choice)


def _lindley(ready: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """End times of a FIFO server: ``e[k] = max(ready[k], e[k-1]) + dur[k]`` (vectorized).

    With ``C`` the running sum of ``dur``: ``e[k] = C[k] + max_{j<=k}(ready[j] - C[j-1])``.
    """
    if len(ready) == 0:
        return np.zeros(0)
    c = np.cumsum(dur)
    return c + np.maximum.accumulate(ready - (c - dur))


@dataclass(frozen=True, eq=False)
class LinkEval:
    """The nominal model plus the link's queues, as the simulator runs them (no duplex slowdown).

    * Copies out are served first come first served in production order (one queue; with ``k``
      DMA engines each copy occupies the queue for ``1/k`` of its time): Lindley's recursion,
      vectorized with a running maximum.
    * Reloads are planned as late as possible in earliest-deadline-first order, backwards from
      their deadlines (the same recursion on negated times), then run forward: a reload starts at
      ``max(planned + stall so far, its copy out's end, previous reload's end)`` and a late one
      stalls the backward step (one Python loop over the offloaded instances).

    ``gap0``/``gap1``: steps each offloaded instance is off device (the simulator's rule for the
    step holding the copy out's end and the planned reload start). Remat instances use the
    nominal gap. Used by the heuristic to rank and check moves; the simulator stays the judge.
    """

    timeline: np.ndarray     # (T,) device bytes
    stall_s: float           # total stall
    step_time_s: float
    off: np.ndarray          # offloaded instance indices (moving something)
    d2h_end_s: np.ndarray    # per offloaded instance, in ``off`` order
    reload_start_s: np.ndarray  # planned (nominal) reload start, in ``off`` order
    late_s: np.ndarray       # stall each reload caused, in ``off`` order

    @staticmethod
    def of(m: "Model", choice: np.ndarray) -> "LinkEval":
        act = choice[m.inst_cand]
        k = max(1, m.problem.dma_engines)
        off = np.nonzero((act == OFF) & (m.last_fwd + 1 <= m.first_bwd - 1))[0]
        # Copies out: FIFO in production order.
        order = off[np.argsort(m.produced[off], kind="stable")]
        ready = m.end_s[m.produced[order]]
        d = m.d2h_s[order]
        end = _lindley(ready, d / k) + d * (1 - 1 / k)
        d2h_end = np.empty(m.inst_bytes.shape[0])
        d2h_end[order] = end
        # Reloads: ALAP plan backwards in EDF order.
        edf = off[np.lexsort((off, m.first_bwd[off]))]
        dl = m.reload_deadline_s[edf]
        h = m.h2d_s[edf]
        rev = slice(None, None, -1)
        plan_start = np.empty(m.inst_bytes.shape[0])
        plan_start[edf] = -_lindley(-dl[rev], h[rev] / k)[rev] - h * (1 - 1 / k)
        # Run forward: stalls.
        window = m.problem.prefetch_window_steps
        release = d2h_end[edf]
        if window is not None:
            release = np.maximum(release, m.start_s[np.maximum(m.first_bwd[edf] - window, 0)])
        late = np.zeros(m.inst_bytes.shape[0])
        shift = 0.0
        free = -np.inf
        for j, p, r, hh, dd in zip(edf.tolist(), plan_start[edf].tolist(), release.tolist(),
                                   (h / k).tolist(), dl.tolist()):
            s = p + shift
            if r > s:
                s = r
            if free > s:
                s = free
            e = s + hh
            free = e
            over = e - (dd + shift)
            if over > 1e-15:
                late[j] = over
                shift += over
        tl = m.dev_bytes.copy()
        diff = np.zeros(m.n_steps + 1, dtype=np.int64)
        if len(off):
            hold = np.searchsorted(m.end_s, d2h_end[off], side="left")
            g0 = np.maximum(m.last_fwd[off], hold) + 1
            g1 = np.minimum(np.searchsorted(m.end_s, plan_start[off], side="right"), m.first_bwd[off]) - 1
            ok = g0 <= g1
            np.add.at(diff, g0[ok], -m.inst_bytes[off][ok])
            np.add.at(diff, g1[ok] + 1, m.inst_bytes[off][ok])
        rem = np.nonzero(act == REM)[0]
        if len(rem):
            g0, g1 = m.gap0[rem, REM], m.gap1[rem, REM]
            ok = g0 <= g1
            np.add.at(diff, g0[ok], -m.inst_bytes[rem][ok])
            np.add.at(diff, g1[ok] + 1, m.inst_bytes[rem][ok])
        tl += np.cumsum(diff[:-1])
        # as the replay times it: recomputation net of the stacks it spares, and offloads' spared stacks
        added = float(m.remat_s[choice == REM].sum()) - float(m.keep_s[choice == OFF].sum())
        # the stalls weighted as the search weighs them (Problem.stall_weight)
        return LinkEval(tl, shift, m.compute_s + added + m.problem.stall_weight * shift, off, d2h_end[off],
                        plan_start[off], late[off])
