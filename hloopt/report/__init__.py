"""Reports for people: the data a report shows, and where to find the renderers.

:class:`ReportData` is the one input of every report (terminal tables, the HTML page): plain,
frozen numbers and strings, already computed by the analyses, the simulator and the search. The
renderers never compute memory: they lay out what they are given. The pipeline (or a test) builds
a ReportData; :mod:`hloopt.report.html` turns it into one self-contained HTML file and
:mod:`hloopt.report.terminal` into rich tables.

Invariants (checked by :meth:`ReportData.validate`): every timeline has one value per step; peak
indices lie inside the schedule; transfer directions are ``"d2h"`` or ``"h2d"``.

All figures are per device: for an SPMD-partitioned module (``num_partitions > 1``) each device
holds its shard, and ``mesh`` says how the devices are arranged.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence

__all__ = [
    "LiveBuffer",
    "ReportData",
    "ResidualRow",
    "Transfer",
    "mesh_of",
]


@dataclass(frozen=True)
class LiveBuffer:
    """One buffer live at the peak."""

    name: str
    shape: str
    bytes: int
    #: Category of the timeline it counts in (``parameter``, ``temporary``, ``residual``...).
    category: str
    op_name: str = ""
    #: ``file:line`` of the JAX code that made it, when known.
    source: str = ""
    #: What the plan does with it when it is a residual candidate (``offload``, ``remat``, ``device``).
    action: str = ""


@dataclass(frozen=True)
class ResidualRow:
    """One residual candidate and what the plan decided for it."""

    key: str
    name: str
    shape: str
    #: Bytes of all instances together.
    bytes: int
    #: Number of instances (layers).
    layers: int
    #: ``device``, ``offload`` or ``remat``.
    action: str
    #: Why the search chose this action (one short phrase).
    reason: str = ""
    source: str = ""


@dataclass(frozen=True)
class Transfer:
    """One host transfer of the plan's replay."""

    key: str
    instance: int
    #: ``"d2h"`` or ``"h2d"``.
    direction: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ReportData:
    """Everything a report shows about one module on one device (see the module docstring)."""

    module_name: str
    #: ``DeviceProfile.to_dict()``: name, hbm_bytes, rates, sources...
    device: Mapping[str, Any]
    #: Device-memory budget the plan aims at (None: no plan asked for one).
    budget_bytes: int | None
    #: One label per schedule step (instruction name, loop iteration).
    step_labels: Sequence[str]
    #: Baseline (everything kept on device) bytes per step, by category, in stacking order.
    baseline_by_category: Mapping[str, Sequence[int]]
    baseline_peak_step: int
    baseline_peak_bytes: int
    #: The plan's device bytes per step (None: no plan).
    plan_timeline: Sequence[int] | None = None
    plan_peak_step: int | None = None
    plan_peak_bytes: int | None = None
    #: The plan's transfers, and the start time of each step of its replay (seconds).
    transfers: Sequence[Transfer] = ()
    step_start_s: Sequence[float] = ()
    #: Whether each step belongs to the backward pass (empty: unknown).
    step_backward: Sequence[bool] = ()
    live_at_peak: Sequence[LiveBuffer] = ()
    residuals: Sequence[ResidualRow] = ()
    #: What the figures rest on (``{"d2h rate": "25.0 GB/s (measured)", ...}``).
    assumptions: Mapping[str, str] = field(default_factory=dict)
    #: Modeled step time without and with the plan (None: unknown).
    baseline_step_time_s: float | None = None
    plan_step_time_s: float | None = None
    #: SPMD partitions (devices) the module runs on; figures are per device.
    num_partitions: int = 1
    #: Device mesh shape, e.g. ``(2, 4)``; () when unknown or unsharded.
    mesh: Sequence[int] = ()
    #: What was analyzed, as the user named it (``fixtures/zoo/llama.py:small``, a file); "" unknown.
    target: str = ""
    #: Host memory the plan holds per step (argument groups placed there, offloaded residuals;
    #: None: state not planned), and the host memory it may fill.
    host_timeline: Sequence[int] | None = None
    host_budget_bytes: int | None = None
    #: Modeled compute seconds of one step on the device (with the plan's recomputation) and on
    #: the host's CPU (the optimizer update, where the plan computes it there); None: unknown.
    device_compute_s: float | None = None
    host_compute_s: float | None = None

    # -- derived -----------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self.step_labels)

    @property
    def baseline_timeline(self) -> list[int]:
        """Total baseline bytes per step (sum over categories)."""
        total = [0] * self.num_steps
        for values in self.baseline_by_category.values():
            for i, v in enumerate(values):
                total[i] += int(v)
        return total

    def validate(self) -> "ReportData":
        """Check the invariants; raise ValueError naming the first broken one. Returns self."""
        n = self.num_steps
        for cat, values in self.baseline_by_category.items():
            if len(values) != n:
                raise ValueError(f"category {cat!r}: {len(values)} values for {n} steps")
        if n and not 0 <= self.baseline_peak_step < n:
            raise ValueError(f"baseline_peak_step {self.baseline_peak_step} outside 0..{n - 1}")
        if self.plan_timeline is not None:
            if len(self.plan_timeline) != n:
                raise ValueError(f"plan_timeline: {len(self.plan_timeline)} values for {n} steps")
            if self.plan_peak_step is not None and not 0 <= self.plan_peak_step < n:
                raise ValueError(f"plan_peak_step {self.plan_peak_step} outside 0..{n - 1}")
        if self.host_timeline is not None and len(self.host_timeline) != n:
            raise ValueError(f"host_timeline: {len(self.host_timeline)} values for {n} steps")
        if self.step_start_s and len(self.step_start_s) not in (n, n + 1):
            raise ValueError(f"step_start_s: {len(self.step_start_s)} values for {n} steps")
        if self.step_backward and len(self.step_backward) != n:
            raise ValueError(f"step_backward: {len(self.step_backward)} values for {n} steps")
        for t in self.transfers:
            if t.direction not in ("d2h", "h2d"):
                raise ValueError(f"transfer {t.key}#{t.instance}: direction {t.direction!r}")
        return self

    # -- serialisation (so a report can be re-rendered from a file) -----------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["baseline_by_category"] = {k: list(v) for k, v in self.baseline_by_category.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ReportData":
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["transfers"] = tuple(Transfer(**t) for t in d.get("transfers", ()))
        kw["live_at_peak"] = tuple(LiveBuffer(**b) for b in d.get("live_at_peak", ()))
        kw["residuals"] = tuple(ResidualRow(**r) for r in d.get("residuals", ()))
        return cls(**kw).validate()


_IOTA_DIMS = re.compile(r"<=\[([\d,]+)\]")
_TILE_DIMS = re.compile(r"devices=\[([\d,]+)\]")


def mesh_of(shardings: Sequence[str], num_partitions: int) -> tuple[int, ...]:
    """The device mesh a module's sharding attributes imply, e.g. ``(2, 4)``; () when unknown.

    Iota tile assignments (``devices=[1,4,2]<=[2,4]T(1,0)``) name the mesh as the reshape dims
    after ``<=``; the longest whose product is ``num_partitions`` wins. Without iota forms, the
    largest tile assignment ``devices=[a,b,...]`` (size-1 dims dropped) stands for the mesh.
    """
    if num_partitions <= 1:
        return ()
    best: tuple[int, ...] = ()
    for s in shardings:
        for m in _IOTA_DIMS.finditer(s):
            dims = tuple(int(x) for x in m.group(1).split(","))
            if _prod(dims) == num_partitions and len(dims) > len(best):
                best = dims
    if best:
        return best
    for s in shardings:
        for m in _TILE_DIMS.finditer(s):
            dims = tuple(int(x) for x in m.group(1).split(",") if int(x) > 1)
            if _prod(dims) == num_partitions and len(dims) > len(best):
                best = dims
    return best or (num_partitions,)


def _prod(xs: Sequence[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p
