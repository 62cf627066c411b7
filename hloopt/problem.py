"""The offload problem: the one data contract between analyses, the simulator and the solvers.

Analyses (liveness, residuals, cost model) build a :class:`Problem`; every strategy (MILP,
heuristic, a JAX built-in policy, a MaxText preset) produces :class:`Decisions` over its
candidates; one simulator (:mod:`hloopt.simulator`) replays a Problem under Decisions into a
memory timeline and a step time. It is the only place bytes and seconds are added up.

Time is a sequence of *steps* (the schedule: top-level instructions of the entry computation,
with while loops expanded into one step per known iteration so per-layer transfers can overlap
per-layer compute). ``Step.base_bytes`` is device memory live during the step that no decision
can change; candidate residuals add their own bytes on top, according to their decision:

    step:        0    1    2    3    4    5    6    7
    device:      [====produced ..........last use]          keep on device
    offload:     [=d2h=]                   [=h2d=|use]      device bytes only while moving
    remat:       [=fwd=]                        [re|use]    recomputed before the backward use

Invariant: simulating ``Decisions.all_device()`` reproduces the analyzed peak exactly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence


class Action(str, enum.Enum):
    """What to do with a candidate's residual(s)."""

    DEVICE = "device"
    OFFLOAD = "offload"
    REMAT = "remat"


@dataclass(frozen=True)
class Step:
    """One point of the schedule."""

    #: Modeled compute time of the step in seconds (roofline of the instruction).
    duration_s: float
    #: Device bytes live during the step that no decision changes (parameters, temporaries...):
    #: the analyzed timeline less the candidates' instances live there. Negative where the
    #: timeline counts less than those instances' sum (libtpu's accounting of a TPU prediction
    #: counts the larger of two heaps, and residuals in VMEM at most its capacity; hloopt.pipeline).
    base_bytes: int
    #: Human label: the instruction name (and loop iteration) the step stands for.
    label: str = ""
    #: Whether the step belongs to the backward pass (for reports; the solvers do not need it).
    backward: bool = False
    #: Bytes counted at this step whatever the decisions: libtpu reports the larger of its HBM and
    #: on-chip (VMEM) heaps, and offloading lowers only the first (passes/memory.py). Memory at
    #: the step is ``max(base_bytes + live instances, floor_bytes)``; 0 where there is no such side.
    floor_bytes: int = 0


@dataclass(frozen=True)
class Instance:
    """One residual buffer (one layer's copy of a candidate)."""

    #: Bytes on device while the buffer is live there.
    bytes: int
    #: Step whose end produces the buffer.
    produced: int
    #: Last forward step that reads it (>= produced). After it the buffer only waits for backward.
    last_forward_use: int
    #: First backward step that reads it; it must be on device by the start of this step.
    first_backward_use: int
    #: Last step that reads it; the buffer is freed after this step.
    last_use: int


@dataclass(frozen=True)
class Candidate:
    """A group of residuals one policy rule selects (one ``checkpoint_name``, or one primitive rule)."""

    #: Stable key, e.g. ``name:query_proj`` or ``prim:dot_general@model.py:42``.
    key: str
    #: What a JAX policy uses to select it: the checkpoint_name, or None when unnamed.
    name: str | None
    #: Human description of how to select it (``checkpoint_name 'query_proj'``, ``dot_general at f.py:3``).
    selector: str
    instances: tuple[Instance, ...]
    #: Actions a JAX policy can express for this candidate.
    allowed: frozenset[Action] = frozenset({Action.DEVICE, Action.OFFLOAD})
    #: Extra compute seconds to recompute all instances (if REMAT is allowed), net of what keeping
    #: them costs the step as lowered (``keep_s``): negative where recomputing is cheaper than keeping.
    remat_s: float = 0.0
    #: FLOPs recomputing all instances re-runs (the same cone ``remat_s`` times; the ``"flops"``
    #: objective's cost of REMAT, :func:`hloopt.pipeline.for_objective`).
    remat_flops: float = 0.0
    #: Seconds the step as lowered (every residual saved) spends keeping the instances in device
    #: memory for the backward pass: a scanned residual's stack write, the views before it and the
    #: backward's slice. A plan that recomputes them (counted in ``remat_s``) or offloads them
    #: (the stack then lives in host memory and the link moves it) does not spend them.
    keep_s: float = 0.0
    #: Of ``remat_s``, the seconds the host's CPU computes (the optimizer update on the host:
    #: REMAT of the optimizer-state candidate); reports show them beside the device's compute.
    host_compute_s: float = 0.0
    #: Source location for reports (file:line), if known.
    source: str = ""
    #: Shape text of one instance, for reports.
    shape: str = ""
    #: JAX primitive that produces it (``dot_general``, ``tanh``...), from op_name metadata; lets
    #: primitive-based policies (``dots_saveable``...) be expressed as Decisions.
    primitive: str = ""
    #: For dot_general producers: whether the dot has batch dimensions.
    dot_has_batch_dims: bool = False
    #: The recomputation is elementwise, which XLA fuses into every backward reader: under REMAT
    #: the value is never stored again after its last forward use (no second device interval).
    remat_fused: bool = False
    #: Every instance is one layer of a scanned stack, read in an iteration of the backward loop
    #: (where a recomputation happens inside that iteration).
    in_loop: bool = False
    #: Under REMAT the values are temporaries of the loop iterations that compute them (forward)
    #: and recompute them (backward), held by those iterations' own working set (the steps'
    #: base): not counted apart from it (set where the memory model says so).
    remat_transient: bool = False
    #: A group of the step's arguments (parameters, optimizer state: :mod:`hloopt.state`) rather
    #: than residuals: its one instance is the group's device bytes from the step's start
    #: (``produced`` 0, no forward use) to its end, first read at ``first_backward_use`` (the
    #: optimizer update, for optimizer state). OFFLOAD keeps the group in host memory
    #: (``pinned_host``) and brings it to the device before that read, as libtpu does (the whole
    #: group at once); its updated value goes back to the host after the step's last read. The
    #: simulator moves the same bytes over the link each way (a copy out at the start stands for
    #: the write-back of the update at the end). No checkpoint policy selects it: ``name`` is
    #: None and ``primitive`` empty, so every policy anchor leaves it on device.
    state: str | None = None

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.instances)


@dataclass(frozen=True)
class Problem:
    """Everything the simulator and the solvers need; built once per module and device."""

    steps: tuple[Step, ...]
    candidates: tuple[Candidate, ...]
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    #: Rates when both directions run at once.
    duplex_d2h_bytes_per_s: float
    duplex_h2d_bytes_per_s: float
    transfer_latency_s: float
    dma_engines: int = 1
    #: A reload may start at most this many steps before its first backward use (None: any time
    #: after the offload finished).
    prefetch_window_steps: int | None = None
    #: Weight of the step's waits on the link in what the search minimises
    #: (:attr:`SimResult.objective_s`): 1 for the step time, 0 for recomputation alone (the
    #: ``"flops"`` objective, :func:`hloopt.pipeline.for_objective`). The timeline, and so the
    #: memory, counts every transfer at the link's rates either way.
    stall_weight: float = 1.0
    #: Device name and anything else a report should show about the assumptions.
    device: str = ""
    notes: Mapping[str, str] = field(default_factory=dict)

    def candidate(self, key: str) -> Candidate:
        for c in self.candidates:
            if c.key == key:
                return c
        raise KeyError(key)

    def compute_seconds(self, recomputed: Iterable[str], *, host_update: bool) -> tuple[float, float]:
        """Modeled compute of one step on the device (every step's roofline and the candidates
        ``recomputed``: residual keys the plan recomputes) and on the host's CPU (the optimizer
        update, when the plan computes it there: the host's part of its candidate's time)."""
        keys = set(recomputed)
        device_s = sum(s.duration_s for s in self.steps) + sum(c.remat_s for c in self.candidates if c.key in keys)
        host_s = sum(c.host_compute_s for c in self.candidates if c.state is not None) if host_update else 0.0
        return device_s, host_s


@dataclass(frozen=True)
class Decisions:
    """An action per candidate key; keys not mentioned stay on device."""

    actions: Mapping[str, Action] = field(default_factory=dict)

    @staticmethod
    def all_device() -> "Decisions":
        return Decisions({})

    def action(self, key: str) -> Action:
        return self.actions.get(key, Action.DEVICE)

    def of(self, action: Action) -> list[str]:
        return sorted(k for k, a in self.actions.items() if a == action)


@dataclass(frozen=True)
class SimResult:
    """What one replay of a Problem under Decisions gives."""

    peak_bytes: int
    peak_step: int
    step_time_s: float
    compute_time_s: float
    #: Compute stalled waiting for late reloads (non-overlapped transfer time).
    exposed_transfer_s: float
    #: Device bytes live at each step.
    timeline_bytes: Sequence[int]
    #: (candidate key, instance index, direction "d2h"/"h2d", start_s, end_s) per transfer.
    transfers: Sequence[tuple[str, int, str, float, float]] = ()
    #: Start time of each step in seconds (after stalls).
    step_start_s: Sequence[float] = ()
    #: Host bytes the plan holds at each step: an offloaded residual from the end of its copy out
    #: to its last read, an argument group in host memory (placed, or updated there) the whole step.
    host_timeline_bytes: Sequence[int] = ()
    #: :attr:`Problem.stall_weight` of the problem replayed
    stall_weight: float = 1.0

    @property
    def objective_s(self) -> float:
        """What the search minimises: the step time with its waits on the link weighted by
        :attr:`Problem.stall_weight` (the step time itself at weight 1)."""
        return self.step_time_s - (1.0 - self.stall_weight) * self.exposed_transfer_s
