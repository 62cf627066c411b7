"""Measure the host<->device link of the current JAX device and fit ``latency + bytes / bandwidth``.

For each size we time copies device->host (D2H) and host->device (H2D) alone, then both at once
from two threads (duplex). Per direction we fit ``t(n) = latency_s + n / bytes_per_s`` by least
squares over the sizes; duplex rates are the bytes each thread moved over its own wall time at the
largest size. Copies go to pinned host memory (``memory_kind="pinned_host"``) when the backend
offers it, which is where XLA's host offload puts activations; otherwise through numpy.

jax is imported lazily, inside :func:`measure_link`, so importing this module stays cheap.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hloopt.devices import DeviceProfile
from hloopt.errors import UserError
from hloopt.units import format_bytes

DEFAULT_SIZES_BYTES: tuple[int, ...] = (1 << 20, 8 << 20, 64 << 20, 256 << 20)


class NoAcceleratorError(UserError):
    """JAX's default backend is the CPU: there is no host<->device link to measure."""


@dataclass(frozen=True)
class LinkFit:
    """``t(n) = latency_s + n / bytes_per_s`` for one direction."""

    #: Fixed cost per transfer, seconds (clamped at 0).
    latency_s: float
    #: Asymptotic transfer rate, bytes/s.
    bytes_per_s: float


@dataclass(frozen=True)
class Calibration:
    """What :func:`measure_link` found on one device."""

    #: ``jax.Device.device_kind`` of the measured device, e.g. ``"TPU v5 lite"``.
    device_kind: str
    #: Platform: ``"tpu"`` or ``"gpu"``.
    platform: str
    d2h: LinkFit
    h2d: LinkFit
    #: Rates with both directions busy at once, bytes/s; None where not measured (copies inside
    #: one program: the base profile's duplex ratio is kept)
    duplex_d2h_bytes_per_s: float | None
    duplex_h2d_bytes_per_s: float | None
    #: Whether copies used pinned host memory.
    pinned_host: bool
    #: (direction, bytes, median seconds) for every measurement, for reports.
    samples: tuple[tuple[str, int, float], ...]


def fit_latency_bandwidth(sizes_bytes: Sequence[int], seconds: Sequence[float]) -> LinkFit:
    """Least-squares fit of ``t = latency + n / bandwidth`` over (size, time) points.

    Needs at least two distinct sizes. A negative intercept (noise) is clamped to zero latency and
    the bandwidth refit through the origin.
    """
    n = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if n.shape != t.shape or len(set(n.tolist())) < 2:
        raise ValueError("need times for at least two distinct sizes")
    slope, intercept = np.polyfit(n, t, 1)
    if intercept < 0:
        slope, intercept = float(np.dot(n, t) / np.dot(n, n)), 0.0
    if slope <= 0:
        raise UserError("calibration failed: transfer time did not grow with size; try larger --sizes")
    return LinkFit(latency_s=float(intercept), bytes_per_s=float(1.0 / slope))


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_link(*, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 5) -> Calibration:
    """Time host<->device copies on JAX's default device; raises NoAcceleratorError on CPU.

    Where the device has ``pinned_host`` memory, the copies are timed as a training step makes
    them: inside one compiled program, to and from a host buffer XLA allocates for it
    (:func:`_in_program_samples`). A ``device_put`` to a ``pinned_host`` array measures the
    runtime's allocation of that array as well: on a TPU v5e it read D2H 0.43 GB/s where the
    same bytes moved inside a program at 13.9 GB/s. Without pinned host memory (numpy buffers),
    ``device_put`` and ``np.asarray`` are timed.
    """
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "cpu":
        raise NoAcceleratorError("no accelerator: JAX's default backend is cpu; calibrate needs a TPU or GPU")
    dev = jax.devices()[0]
    if len(set(int(s) for s in sizes_bytes)) < 2:
        raise UserError("calibrate needs at least two distinct --sizes")
    kinds = {m.kind for m in dev.addressable_memories()} if hasattr(dev, "addressable_memories") else set()
    pinned = "pinned_host" in kinds
    if pinned:
        samples = _in_program_samples(dev, sizes_bytes, repeats)
        d2h = fit_latency_bandwidth([s[1] for s in samples if s[0] == "d2h"],
                                    [s[2] for s in samples if s[0] == "d2h"])
        h2d = fit_latency_bandwidth([s[1] for s in samples if s[0] == "h2d"],
                                    [s[2] for s in samples if s[0] == "h2d"])
        return Calibration(device_kind=str(dev.device_kind), platform=str(dev.platform), d2h=d2h, h2d=h2d,
                           duplex_d2h_bytes_per_s=None, duplex_h2d_bytes_per_s=None,
                           pinned_host=True, samples=tuple(samples))
    dev_sharding = jax.sharding.SingleDeviceSharding(dev)

    def to_host(x: Any) -> Any:
        return np.asarray(x)

    def to_device(h: Any) -> Any:
        return jax.device_put(h, dev_sharding).block_until_ready()

    samples = []
    for n in sorted(int(s) for s in sizes_bytes):
        count = max(n // 4, 1)
        on_device = [jnp.full((count,), i, dtype=jnp.float32, device=dev).block_until_ready()
                     for i in range(repeats + 1)]
        host = to_host(on_device[0])
        to_device(host)  # warm-up both paths
        it = iter(on_device[1:])
        # A fresh device array per repeat: numpy caches the host copy of an array it has seen.
        # (each lambda is called within its iteration: B023's late binding cannot bite)
        samples.append(("d2h", count * 4, _median_time(lambda: to_host(next(it)), repeats)))  # noqa: B023
        samples.append(("h2d", count * 4, _median_time(lambda: to_device(host), repeats)))  # noqa: B023
        del on_device

    d2h = fit_latency_bandwidth([s[1] for s in samples if s[0] == "d2h"], [s[2] for s in samples if s[0] == "d2h"])
    h2d = fit_latency_bandwidth([s[1] for s in samples if s[0] == "h2d"], [s[2] for s in samples if s[0] == "h2d"])

    # Duplex: both directions at once from two threads, at the largest size.
    n = max(int(s) for s in sizes_bytes)
    count = max(n // 4, 1)
    src_dev = [jnp.full((count,), i, dtype=jnp.float32, device=dev).block_until_ready() for i in range(repeats)]
    src_host = to_host(jnp.zeros((count,), jnp.float32, device=dev))
    barrier = threading.Barrier(2)
    elapsed: dict[str, float] = {}

    def worker(direction: str) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        for i in range(repeats):
            if direction == "d2h":
                to_host(src_dev[i])
            else:
                to_device(src_host)
        elapsed[direction] = time.perf_counter() - t0

    threads = [threading.Thread(target=worker, args=(d,)) for d in ("d2h", "h2d")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    moved = count * 4 * repeats
    return Calibration(
        device_kind=str(dev.device_kind),
        platform=str(dev.platform),
        d2h=d2h,
        h2d=h2d,
        duplex_d2h_bytes_per_s=min(moved / elapsed["d2h"], d2h.bytes_per_s),
        duplex_h2d_bytes_per_s=min(moved / elapsed["h2d"], h2d.bytes_per_s),
        pinned_host=False,
        samples=tuple(samples),
    )


def link_programs(dev: Any) -> tuple[Any, Any, Any]:
    """The jitted programs :func:`_in_program_samples` times on ``dev``: ``base``, ``h2d`` and
    ``round_trip``."""
    import jax

    host_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    dev_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    base = jax.jit(lambda x: x + 1)
    h2d = jax.jit(lambda h: jax.device_put(h, dev_sh) + 1)
    round_trip = jax.jit(lambda x: jax.device_put(jax.device_put(x + 1, host_sh), dev_sh))
    return base, h2d, round_trip


def _in_program_samples(dev: Any, sizes_bytes: Sequence[int], repeats: int) -> list[tuple[str, int, float]]:
    """(direction, bytes, seconds) per size, from compiled programs that move ``n`` bytes as an
    offloading step does:

    * ``base(x) = x + 1``;
    * ``h2d(h) = to_device(h) + 1``, ``h`` a ``pinned_host`` argument: H2D = t(h2d) - t(base);
    * ``round_trip(x) = to_device(to_host(x + 1))``: D2H = t(round_trip) - t(h2d).

    Each time is the median of ``repeats`` runs after one untimed run (compilation). Both
    directions at once are not measured this way: one program's copies run in the order its
    data needs them, and two programs do not run at once on a TPU core."""
    import jax
    import jax.numpy as jnp

    host_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    base, h2d, round_trip = link_programs(dev)

    def timed(f: Callable[..., Any], *a: Any) -> float:
        jax.block_until_ready(f(*a))
        return _median_time(lambda: jax.block_until_ready(f(*a)), repeats)

    samples: list[tuple[str, int, float]] = []
    for n in sorted(int(s) for s in sizes_bytes):
        count = max(n // 4, 1)
        x = jnp.full((count,), 1, dtype=jnp.float32, device=dev)
        h = jax.device_put(x, host_sh)
        t_base, t_h2d, t_rt = timed(base, x), timed(h2d, h), timed(round_trip, x)
        samples.append(("h2d", count * 4, max(t_h2d - t_base, 1e-9)))
        samples.append(("d2h", count * 4, max(t_rt - t_h2d, 1e-9)))
        del x, h
    return samples


def calibrated_profile(base: DeviceProfile, cal: Calibration, *, name: str | None = None,
                       when: _dt.datetime | None = None) -> DeviceProfile:
    """``base`` with the measured host-link numbers; sources say where and when they were measured."""
    stamp = (when or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
    sizes = sorted({s[1] for s in cal.samples})
    note = (f"measured by hloopt calibrate on {cal.device_kind} ({cal.platform}) at {stamp}, "
            f"{'pinned_host buffers inside one compiled program' if cal.pinned_host else 'numpy host buffers'}, sizes "
            f"{', '.join(format_bytes(s) for s in sizes)}")
    latency = (cal.d2h.latency_s + cal.h2d.latency_s) / 2
    p = base.with_overrides(
        d2h_bytes_per_s=cal.d2h.bytes_per_s,
        h2d_bytes_per_s=cal.h2d.bytes_per_s,
        # not measured: with_overrides keeps the base profile's duplex ratio (and says so)
        duplex_d2h_bytes_per_s=None if cal.duplex_d2h_bytes_per_s is None
        else min(cal.duplex_d2h_bytes_per_s, cal.d2h.bytes_per_s),
        duplex_h2d_bytes_per_s=None if cal.duplex_h2d_bytes_per_s is None
        else min(cal.duplex_h2d_bytes_per_s, cal.h2d.bytes_per_s),
        transfer_latency_s=latency,
        source=note,
    )
    p = keep_previous_sources(base, p, ("d2h_bytes_per_s", "h2d_bytes_per_s", "duplex_d2h_bytes_per_s",
                                        "duplex_h2d_bytes_per_s", "transfer_latency_s"))
    if name is not None:
        import dataclasses

        p = dataclasses.replace(p, name=name)
    return p


# -- from a profiler trace ------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassFit:
    """What the trace says about one op class (:data:`hloopt.devices.OP_CLASSES`)."""

    op_class: str
    #: op events of this class (executions), and distinct instructions among them
    events: int
    ops: int
    #: summed over the events: measured seconds, FLOPs (+ transcendentals), bytes accessed
    measured_s: float
    flops: float
    bytes: float
    #: the base profile's roofline seconds for the same events (no efficiency applied)
    roofline_s: float
    #: what the fit times: ``"compiled"`` (each event its compiled instruction, for predictions
    #: from the compiled module) or ``"lowered"`` (the step as lowered, which ``plan`` times; the
    #: figures above are then per step: the class's lowered instructions and the trace's time
    #: attributed to them, see :func:`fit_trace_lowered`)
    unit: str = "compiled"

    @property
    def efficiency(self) -> float:
        """Roofline time / measured time: the share of the roofline rate this class reaches."""
        return self.roofline_s / self.measured_s

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.measured_s

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes / self.measured_s


@dataclass(frozen=True)
class TraceCalibration:
    """Per-op-class fits and link rates from one profiler trace of one compiled module."""

    #: the trace file read
    trace: str
    module: str
    #: module runs (steps) in the trace, their wall seconds, and the op seconds inside each
    step_wall_s: tuple[float, ...]
    step_op_s: tuple[float, ...]
    fits: tuple[ClassFit, ...]
    #: op events of the module matched to an instruction / not matched (names)
    matched_events: int
    unmatched_ops: tuple[str, ...]
    #: measured rates from the trace's copies; None where it has none in that direction
    d2h_bytes_per_s: float | None
    h2d_bytes_per_s: float | None
    transfers: int


#: how XLA's GPU profiler names a command buffer's (CUDA graph's) event in place of its instructions
COMMAND_BUFFER_PREFIX = "command_buffer"


def _module_events(trace: Any, module: Any) -> tuple[list[Any], list[Any]]:
    """The leaf op events of ``module`` in ``trace`` and the module runs that hold them."""
    from hloopt.profile_trace import leaf_ops, ops_in_run

    mine = [o for o in trace.ops if o.module == module.name]
    if not mine:
        seen = sorted({o.module for o in trace.ops})
        raise UserError(f"{trace.path}: no op events of module {module.name!r} (the trace has "
                        f"{', '.join(seen) or 'no op events'}); give the TARGET whose step was traced")
    leaves = leaf_ops(mine)
    buffers = sorted({o.op for o in leaves if o.op.startswith(COMMAND_BUFFER_PREFIX)})
    if buffers:
        # XLA's GPU backend runs runs of a step's kernels as CUDA graphs (command buffers) by
        # default; the profiler then times each buffer, not the instructions inside it, and a fit
        # over what is left mistakes the rest of the step for the few ops it did see
        raise UserError(f"{trace.path}: {len(buffers)} op events are XLA command buffers ({', '.join(buffers[:3])}"
                        f"{', ...' if len(buffers) > 3 else ''}), which time many instructions as one; record "
                        f"the trace with XLA_FLAGS=--xla_gpu_enable_command_buffer= so that each instruction "
                        f"is its own event")
    runs = [r for r in trace.runs if ops_in_run(trace, r, leaves)]
    return leaves, runs


def fit_trace(trace: Any, module: Any, base: DeviceProfile) -> TraceCalibration:
    """Fit per-op-class efficiency from ``trace`` (:class:`hloopt.profile_trace.Trace`) of ``module``
    (the compiled module that ran, parsed): each op event is matched by name to an instruction
    whose FLOPs and bytes come from passes/cost.py, timed at the roofline of ``base``. The fit
    suits predictions from the compiled module (``--compile``); :func:`fit_trace_lowered` fits
    the step as lowered, which ``plan`` times."""
    import dataclasses

    from hloopt.passes.cost import CostAnalysis, op_class

    leaves, runs = _module_events(trace, module)
    plain = dataclasses.replace(base, compute_efficiency={})
    cost = CostAnalysis(profile=plain).run(module)
    insts = {i.name: i for c in module.computations.values() for i in c.instructions}
    acc: dict[str, list[float]] = {}
    names: dict[str, set[str]] = {}
    unmatched: set[str] = set()
    matched = 0
    for o in leaves:
        inst = insts.get(o.op)
        if inst is None or o.op not in cost.per_instruction or o.dur_us <= 0:
            unmatched.add(o.op)
            continue
        matched += 1
        c = cost.of(inst).xla  # one execution (a loop body's instruction: one iteration)
        cls = op_class(inst)
        a = acc.setdefault(cls, [0, 0.0, 0.0, 0.0, 0.0])
        a[0] += 1
        a[1] += o.dur_us * 1e-6
        a[2] += c.flops + c.transcendentals
        a[3] += c.bytes_accessed
        a[4] += c.seconds
        names.setdefault(cls, set()).add(o.op)
    fits = tuple(ClassFit(k, int(v[0]), len(names[k]), v[1], v[2], v[3], v[4])
                 for k, v in sorted(acc.items()) if v[1] > 0 and v[4] > 0)
    return _calibration(trace, module, leaves, runs, fits, matched, unmatched)


def _calibration(trace: Any, module: Any, leaves: list[Any], runs: list[Any], fits: tuple[ClassFit, ...],
                 matched: int, unmatched: set[str]) -> TraceCalibration:
    """A fit's result with what the trace says of every fit alike: the module's runs (wall time
    and op time each) and the link's rates per direction (bytes over summed copy time; None
    where the trace has no copy that way)."""
    from hloopt.profile_trace import ops_in_run

    rates: dict[str, float | None] = {}
    for d in ("d2h", "h2d"):
        ts = [t for t in trace.transfers if t.direction == d]
        rates[d] = sum(t.bytes for t in ts) / (sum(t.dur_us for t in ts) * 1e-6) if ts else None
    return TraceCalibration(
        trace=str(trace.path), module=module.name,
        step_wall_s=tuple(r.dur_us * 1e-6 for r in runs),
        step_op_s=tuple(sum(o.dur_us for o in ops_in_run(trace, r, leaves)) * 1e-6 for r in runs),
        fits=fits, matched_events=matched, unmatched_ops=tuple(sorted(unmatched)),
        d2h_bytes_per_s=rates["d2h"], h2d_bytes_per_s=rates["h2d"], transfers=len(trace.transfers))


def executions(module: Any, cost: Any) -> dict[str, float]:
    """Instruction name -> how many times one run of ``module`` executes it, as
    :class:`~hloopt.passes.cost.CostAnalysis` counts: a loop body's instruction its loop's trip
    count (once where unknown), a conditional's branch once (the cost model takes the larger
    branch), a fusion's body not entered (the fusion is one instruction)."""
    out: dict[str, float] = {}

    def walk(comp: Any, times: float) -> None:
        for inst in comp.instructions:
            out[inst.name] = out.get(inst.name, 0.0) + times
            if inst.opcode == "while":
                n = cost.of(inst).trip_count
                walk(inst.called["body"][0], times * (n if n is not None else 1))
                walk(inst.called["condition"][0], times * (n if n is not None else 1))
            elif inst.opcode in ("call", "conditional", "async-start"):
                for callee in inst.called_computations:
                    walk(callee, times)

    walk(module.entry, 1.0)
    return out


def _op_names(inst: Any) -> set[str]:
    """The JAX op names (metadata) of a compiled instruction and of everything fused into it."""
    names = {inst.metadata.op_name} if inst.metadata.op_name else set()
    if inst.opcode == "fusion":
        for x in inst.called["calls"][0].instructions:
            names |= _op_names(x)
    return names


def fit_trace_lowered(trace: Any, compiled: Any, lowered: Any, base: DeviceProfile) -> TraceCalibration:
    """Fit per-op-class efficiency for the step as lowered (``lowered``, pre-optimization, calls
    inlined: the module ``plan`` and ``measure`` time) from ``trace`` of ``compiled``.

    ``plan`` times each lowered instruction at its roofline over its class's efficiency. XLA fuses
    those instructions into kernels, so a kernel's time is no one instruction's: an element-wise
    op fused into a matmul costs no memory traffic of its own, where its unfused roofline charges
    it some. Fitting per kernel and applying the figures to unfused instructions over-predicts by
    the traffic fusion removes (10x on an H200 convnet). Here each kernel's measured time is
    split over the JAX op names fused into it (its instructions' ``metadata.op_name``), in
    proportion to the lowered roofline of the instructions bearing each name, and each name's
    share over those instructions; per class C, with R_C the class's lowered roofline seconds per
    step and A_C the time attributed to it, the efficiency is R_C / M_C, where M_C is A_C scaled
    so that the classes add up to the median step's wall time in the trace (time no op name
    reaches, and the gaps between kernels, are spread over the classes as the attributed time
    is). A class with lowered work but no attributed time gets the step's overall ratio
    sum(R) / wall. So the calibrated model predicts the traced step's wall time, and other
    policies of the same step by the rates the trace showed for each class."""
    import dataclasses
    import statistics

    from hloopt.passes.cost import CostAnalysis, op_class

    leaves, runs = _module_events(trace, compiled)
    if not runs and not trace.steps:
        raise UserError(f"{trace.path}: no step marker (jax.profiler.StepTraceAnnotation) and no run of module "
                        f"{compiled.name!r} holding its op events; a step's wall time is what the fit reproduces")
    per_step = len(trace.steps) or len(runs)
    plain = dataclasses.replace(base, compute_efficiency={})
    cost = CostAnalysis(profile=plain).run(lowered)
    times = executions(lowered, cost)
    control = {"while", "call", "conditional", "async-start", "async-done", "async-update"}
    # op name -> [(class, roofline seconds per step)] of the instructions bearing it
    by_name: dict[str, list[tuple[str, float]]] = {}
    roof: dict[str, list[float]] = {}  # class -> [seconds, flops, bytes, instructions]
    for comp in lowered.computations.values():
        for inst in comp.instructions:
            n = times.get(inst.name)
            if not n or inst.opcode in control or inst.name not in cost.per_instruction:
                continue
            c = cost.of(inst).xla
            if c.seconds <= 0:
                continue
            cls = op_class(inst)
            r = roof.setdefault(cls, [0.0, 0.0, 0.0, 0])
            r[0] += c.seconds * n
            r[1] += (c.flops + c.transcendentals) * n
            r[2] += c.bytes_accessed * n
            r[3] += 1
            by_name.setdefault(inst.metadata.op_name, []).append((cls, c.seconds * n))
    name_roof = {k: sum(x[1] for x in v) for k, v in by_name.items() if k}
    insts = {i.name: i for c in compiled.computations.values() for i in c.instructions}
    kernel_s: dict[str, float] = {}
    unmatched: set[str] = set()
    matched = 0
    for o in leaves:
        inst = insts.get(o.op)
        if inst is None:
            unmatched.add(o.op)
            continue
        matched += 1
        kernel_s[o.op] = kernel_s.get(o.op, 0.0) + o.dur_us * 1e-6 / per_step
    attributed: dict[str, float] = {}
    events: dict[str, int] = {}
    for k, t in kernel_s.items():
        weights = {nm: name_roof[nm] for nm in _op_names(insts[k]) if name_roof.get(nm, 0) > 0}
        total = sum(weights.values())
        for nm, w in weights.items():
            for cls, s in by_name[nm]:
                attributed[cls] = attributed.get(cls, 0.0) + t * (w / total) * (s / w)
                events[cls] = events.get(cls, 0) + 1
    # the step's time: the module's runs on an accelerator's device line (TPU and GPU traces have
    # an ``XLA Modules`` event per run), which time the device alone. A training loop dispatches
    # the next step while this one runs, so the device's time is its step time; a step marker
    # (StepTraceAnnotation) around a call waited for also holds the host's dispatch and the
    # profiler's own overhead (on a v5e, a 10.5 ms marker around an 8.7 ms run). Without a device
    # line (the CPU backend, whose executor runs a step's thunks on several threads and records
    # no one event spanning it) the markers are the only figure.
    device = [r.dur_us * 1e-6 for r in runs if r.device_line]
    marked = [s.dur_us * 1e-6 for s in trace.steps]
    wall = statistics.median(device or marked or [r.dur_us * 1e-6 for r in runs])
    overall = sum(r[0] for r in roof.values()) / wall  # roofline / measured, the whole step
    alone = {c for c in roof if attributed.get(c, 0.0) <= 0}
    rest = wall - sum(roof[c][0] for c in alone) / overall
    share = sum(attributed.values())
    measured = {c: (roof[c][0] / overall if c in alone or rest <= 0 or share <= 0 else attributed[c] * rest / share)
                for c in roof}
    fits = tuple(ClassFit(c, events.get(c, 0), int(r[3]), measured[c], r[1], r[2], r[0], unit="lowered")
                 for c, r in sorted(roof.items()) if measured[c] > 0)
    return _calibration(trace, compiled, leaves, runs, fits, matched, unmatched)


def _previous(base: DeviceProfile, field_name: str) -> str:
    """``base``'s figure for ``field_name`` and its source, for the ``<field>.previous`` entry."""
    from hloopt.units import format_rate

    v = getattr(base, field_name)
    shown = format_rate(v) if field_name.endswith("bytes_per_s") else f"{v:g}"
    return f"{shown} in {base.name}: {base.sources.get(field_name, 'no source given')}"


def keep_previous_sources(base: DeviceProfile, profile: DeviceProfile, fields: Sequence[str]) -> DeviceProfile:
    """``profile`` with ``sources["<field>.previous"]`` = ``base``'s figure and source, per field."""
    import dataclasses

    sources = dict(profile.sources)
    for f in fields:
        if getattr(base, f) != getattr(profile, f):
            sources[f"{f}.previous"] = _previous(base, f)
    return dataclasses.replace(profile, sources=sources)


def trace_calibrated_profile(base: DeviceProfile, cal: TraceCalibration, *, name: str | None = None,
                             when: _dt.datetime | None = None) -> DeviceProfile:
    """``base`` with the fitted efficiencies, and the link rates where the trace measured them.

    Every fitted number's source cites the trace, the date and the event counts; a replaced link
    figure keeps the figure it replaced, with that figure's source, under ``<field>.previous``.
    """
    import dataclasses

    from hloopt.units import format_rate

    stamp = (when or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
    where = f"hloopt calibrate --profile ({cal.trace}, module {cal.module}, {len(cal.step_wall_s)} steps) at {stamp}"
    sources = dict(base.sources)
    eff = {}
    for f in cal.fits:
        eff[f.op_class] = f.efficiency
        if f.unit == "lowered":
            sources[f"compute_efficiency.{f.op_class}"] = (
                f"MEASURED by {where}: {f.ops} {f.op_class} instructions of the step as lowered, {f.flops:.4g} "
                f"FLOP and {f.bytes:.4g} B per step, {f.measured_s:.4g} s of the median step's wall time "
                f"attributed to them by op name over {f.events} kernel shares; efficiency = {base.name} "
                f"roofline time {f.roofline_s:.4g} s / attributed time")
        else:
            sources[f"compute_efficiency.{f.op_class}"] = (
                f"MEASURED by {where}: {f.events} executions of {f.ops} {f.op_class} ops, {f.flops:.4g} FLOP and "
                f"{f.bytes:.4g} B in {f.measured_s:.4g} s ({f.achieved_flops_per_s:.4g} FLOP/s, "
                f"{format_rate(f.achieved_bytes_per_s)}); efficiency = {base.name} roofline time "
                f"{f.roofline_s:.4g} s / measured time")
    p = dataclasses.replace(base, compute_efficiency=eff, sources=sources)
    if cal.d2h_bytes_per_s is not None or cal.h2d_bytes_per_s is not None:
        p = p.with_overrides(d2h_bytes_per_s=cal.d2h_bytes_per_s, h2d_bytes_per_s=cal.h2d_bytes_per_s,
                             source=f"MEASURED by {where}: {cal.transfers} MemcpyH2D/MemcpyD2H events, "
                                    "bytes over summed copy time")
        p = keep_previous_sources(base, p, ("d2h_bytes_per_s", "h2d_bytes_per_s", "duplex_d2h_bytes_per_s",
                                            "duplex_h2d_bytes_per_s"))
    else:
        sources = dict(p.sources)
        sources["host_link.calibration"] = (
            f"NOT MEASURED by {where}: the trace has no MemcpyH2D/MemcpyD2H events (the CPU backend has no "
            f"host<->device link, and a TPU's trace writes none; hloopt calibrate without --profile times "
            f"it); d2h/h2d/duplex figures and their sources are {base.name}'s")
        p = dataclasses.replace(p, sources=sources)
    return dataclasses.replace(p, name=name) if name is not None else p


def lowered_module_for(target: Any, profile: DeviceProfile) -> Any:
    """The step as ``plan`` times it for ``profile``, under the policies it was traced with: a
    JAX TARGET lowered as written (not with every residual saved, as
    :func:`hloopt.pipeline.lower_for_plan` lowers it) for the profile's platform (TPU, else
    CUDA), parsed, calls inlined."""
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.passes.inline import inline_for_assignment

    platform = "tpu" if profile.kind == "tpu" else "cuda"
    low = lower(target, platform=platform)
    return inline_for_assignment(parse_module(low.hlo_text, filename=f"<{target.name} lowered:{platform}>"))


def compiled_module_for(target: Any) -> Any:
    """The compiled module a trace's op events name: a JAX TARGET compiled on the current JAX
    backend (what ran, compiled again: XLA names instructions deterministically), or an HLO file /
    XLA dump after optimizations as it is. Parsed with hloopt's parser."""
    from hloopt.hlo.parser import parse_module

    if target.kind == "jax":
        import jax

        from hloopt.lowering import relative_paths

        try:
            compiled = jax.jit(target.step_fn).trace(*target.args, **dict(target.kwargs)).lower().compile()
        except Exception as err:
            raise UserError(f"{target.name}: compiling the step on {jax.default_backend()} failed: "
                            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
        text = relative_paths(compiled.as_text())
    else:
        assert target.text is not None
        text = target.text
    module = parse_module(text, filename=f"<{target.name}>")
    if not module.is_scheduled:
        raise UserError(f"{target.name}: the trace names instructions of the compiled module; give the "
                        "optimized HLO (a dump's after_optimizations file) or a JAX TARGET")
    return module
