"""Read a JAX profiler trace: per-HLO-op execution events, module runs and host<->device copies.

``jax.profiler.trace(DIR)`` writes ``DIR/plugins/profile/<run>/<host>.xplane.pb`` (an XSpace
protobuf) and, converted from it by the same profiler, ``<host>.trace.json.gz``: Chrome's Trace
Event Format (``{"traceEvents": [...]}``; complete events ``"ph": "X"`` with ``ts``/``dur`` in
microseconds, metadata events ``"ph": "M"`` naming processes and threads). We read the JSON file:
its format is public and Python reads it with ``json``, whereas the XSpace messages' Python classes
ship in no package on PyPI that jax depends on (``xprof``'s wheel carries other protos only).

What we take from it (names as XLA's profilers write them, jax 0.10.2):

* **op events**: complete events whose ``args`` carry ``hlo_op`` (the instruction name in the
  *compiled* module) and ``hlo_module`` (the module's name). The CPU backend's
  ``ThunkExecutor`` writes one per thunk on the executing thread (and an ``end: <op>`` marker
  without ``hlo_op``, ignored); the GPU puts them on the device's ``XLA Ops`` line. The TPU
  (libtpu 0.0.42, read off a v5e) writes neither key: its ``XLA Ops`` events are named by the
  instruction and carry its text as ``long_name`` (with ``hlo_category``, ``model_flops``,
  ``bytes_accessed``); their module is the run on the same device's ``XLA Modules`` line that
  holds them, whose event is named ``<module>(<fingerprint>)``.
* **module runs**: the CPU backend's ``ThunkExecutor::Execute`` events (outermost only: a loop
  body's executor nests inside), or events on a thread named ``XLA Modules`` (GPU/TPU). One run
  is one execution of a compiled module: the step's wall time on the device, which the op events
  inside it cannot exceed when they run one after another.
* **steps**: events whose ``args`` carry ``step_num``, which
  ``jax.profiler.StepTraceAnnotation(name, step_num=N)`` writes around what the program calls a
  step. On the CPU backend a step's thunks run on several threads and the executor's events do not
  span it (with ``lax.scan`` a step is a dozen short runs), so its wall time is read from these.
* **transfers**: XLA's CUPTI collector names device copies ``MemcpyH2D``/``MemcpyD2H`` with a
  ``memcpy_details`` stat ``"kind_src:... kind_dst:... size:<bytes> dest:... async:..."``
  (xla/backends/profiler/gpu/cupti_collector.cc). The CPU backend writes none.

Op events nested in another op event on the same thread (a ``while`` thunk around its body's) are
kept, and :func:`leaf_ops` drops the enclosing ones so no time is counted twice.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hloopt.errors import UserError

_MODULE_EVENT = "ThunkExecutor::Execute"
_MODULE_LINE = "XLA Modules"
_OPS_LINE = "XLA Ops"
_FINGERPRINT = re.compile(r"\(\d+\)$")
_MEMCPY = {"MemcpyH2D": "h2d", "MemcpyD2H": "d2h"}
_SIZE = re.compile(r"(?:^|\s)(?:size|num_bytes):(\d+)")


@dataclass(frozen=True)
class OpEvent:
    """One execution of one HLO instruction."""

    module: str
    op: str
    start_us: float
    dur_us: float
    pid: int
    tid: int

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class ModuleRun:
    """One execution of a compiled module (a step)."""

    start_us: float
    dur_us: float
    pid: int
    tid: int
    #: True for an ``XLA Modules`` line event (its ops are on other lines of the same process)
    device_line: bool
    #: the module's name where the event gives it (device lines: ``jit_step`` of ``jit_step(123)``)
    module: str = ""

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class Transfer:
    """One host<->device copy."""

    #: ``h2d`` or ``d2h``
    direction: str
    bytes: int
    dur_us: float


@dataclass(frozen=True)
class Step:
    """A ``jax.profiler.StepTraceAnnotation(name, step_num=N)`` event: one step as the program marked it."""

    name: str
    step_num: str
    start_us: float
    dur_us: float


@dataclass(frozen=True)
class Trace:
    """What :func:`read_trace` found in one trace file."""

    path: Path
    ops: tuple[OpEvent, ...]
    runs: tuple[ModuleRun, ...]
    transfers: tuple[Transfer, ...]
    #: the program's own step markers (StepTraceAnnotation), in time order
    steps: tuple[Step, ...] = ()


def find_trace_file(where: str | Path) -> Path:
    """The ``*.trace.json.gz`` under ``where``: a ``jax.profiler.trace`` folder (its newest run), a
    run folder, or the file itself. Raises UserError naming ``where``."""
    p = Path(where)
    if p.is_file():
        if not p.name.endswith((".trace.json.gz", ".trace.json")):
            raise UserError(f"{where}: not a profiler trace (<host>.trace.json.gz expected)")
        return p
    if not p.is_dir():
        raise UserError(f"{where}: no such folder")
    found = sorted(p.glob("*.trace.json.gz")) or sorted(p.glob("plugins/profile/*/*.trace.json.gz")) \
        or sorted(p.glob("**/*.trace.json.gz"))
    if not found:
        xplanes = list(p.glob("**/*.xplane.pb"))
        if xplanes:
            raise UserError(f"{where}: has {xplanes[0].name} but no <host>.trace.json.gz beside it; record with "
                            "jax.profiler.trace(DIR), which writes both")
        raise UserError(f"{where}: no profiler trace found (jax.profiler.trace(DIR) writes "
                        "DIR/plugins/profile/<run>/<host>.trace.json.gz)")
    # the newest run: run folders are named by start time (2026_12_03_08_36_01)
    newest = max(f.parent.name for f in found)
    return sorted(f for f in found if f.parent.name == newest)[0]


def read_trace(where: str | Path) -> Trace:
    """Parse the trace file under ``where`` (see :func:`find_trace_file`)."""
    path = find_trace_file(where)
    try:
        raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
        data = json.loads(raw)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not a readable Chrome trace: {err}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise UserError(f"{path}: no traceEvents list")
    thread_names: dict[tuple[Any, Any], str] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name", ""))
    ops: list[OpEvent] = []
    runs: list[ModuleRun] = []
    transfers: list[Transfer] = []
    steps: list[Step] = []
    #: TPU op events, their module not yet known: (name, start, duration, pid, tid)
    unnamed: list[tuple[str, float, float, int, int]] = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e or "dur" not in e:
            continue
        args = e.get("args") or {}
        ts, dur = float(e["ts"]), float(e["dur"])
        pid, tid = e.get("pid", 0), e.get("tid", 0)
        name = str(e.get("name", ""))
        if "hlo_op" in args and "hlo_module" in args:
            ops.append(OpEvent(str(args["hlo_module"]), str(args["hlo_op"]), ts, dur, pid, tid))
        elif "step_num" in args and dur > 0:
            steps.append(Step(name, str(args["step_num"]), ts, dur))
        elif name == _MODULE_EVENT:
            runs.append(ModuleRun(ts, dur, pid, tid, device_line=False))
        elif thread_names.get((pid, tid)) == _MODULE_LINE:
            runs.append(ModuleRun(ts, dur, pid, tid, device_line=True, module=_FINGERPRINT.sub("", name)))
        elif "long_name" in args and thread_names.get((pid, tid)) == _OPS_LINE:
            unnamed.append((name, ts, dur, pid, tid))
        if name in _MEMCPY:
            m = _SIZE.search(str(args.get("memcpy_details", "")))
            if m and dur > 0:
                transfers.append(Transfer(_MEMCPY[name], int(m.group(1)), dur))
    if unnamed:
        ops.extend(_in_module_runs(unnamed, runs))
    return Trace(path, tuple(ops), tuple(_outermost(runs)), tuple(transfers),
                 tuple(sorted(steps, key=lambda s: s.start_us)))


def _in_module_runs(unnamed: list[tuple[str, float, float, int, int]], runs: list[ModuleRun]) -> list[OpEvent]:
    """Op events given the module of the device-line run on their process that holds them (those
    outside every run are dropped: no module to match them to)."""
    by_pid: dict[int, list[ModuleRun]] = {}
    for r in runs:
        if r.device_line and r.module:
            by_pid.setdefault(r.pid, []).append(r)
    starts: dict[int, list[float]] = {}
    for pid, rs in by_pid.items():
        rs.sort(key=lambda r: r.start_us)
        starts[pid] = [r.start_us for r in rs]
    out: list[OpEvent] = []
    for name, ts, dur, pid, tid in unnamed:
        held = by_pid.get(pid)
        if not held:
            continue
        i = bisect.bisect_right(starts[pid], ts) - 1
        # timestamps are microseconds with sub-nanosecond digits: allow the last one's rounding
        if i >= 0 and ts + dur <= held[i].end_us + 1e-3:
            out.append(OpEvent(held[i].module, name, ts, dur, pid, tid))
    return out


def _outermost(runs: list[ModuleRun]) -> list[ModuleRun]:
    """Module runs not inside another run on the same thread (a loop body's executor nests)."""
    out: list[ModuleRun] = []
    for r in sorted(runs, key=lambda r: (r.pid, r.tid, r.start_us, -r.dur_us)):
        last = out[-1] if out else None
        if last is not None and (last.pid, last.tid) == (r.pid, r.tid) and r.end_us <= last.end_us:
            continue
        out.append(r)
    return out


def leaf_ops(ops: Iterable[OpEvent]) -> list[OpEvent]:
    """The op events that enclose no other op event on their thread (each moment counted once)."""
    by_thread: dict[tuple[int, int], list[OpEvent]] = {}
    for o in ops:
        by_thread.setdefault((o.pid, o.tid), []).append(o)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda o: (o.start_us, -o.dur_us))
        for i, o in enumerate(evs):
            nxt = evs[i + 1] if i + 1 < len(evs) else None
            if nxt is not None and nxt.start_us < o.end_us and nxt.end_us <= o.end_us:
                continue  # encloses the next event: a control-flow thunk around its body
            out.append(o)
    return out


def ops_in_run(trace: Trace, run: ModuleRun, ops: Iterable[OpEvent] | None = None) -> list[OpEvent]:
    """The op events inside ``run``: on its thread (CPU), or anywhere in its process (device lines)."""
    cand = trace.ops if ops is None else ops
    return [o for o in cand
            if o.pid == run.pid and (run.device_line or o.tid == run.tid)
            and o.start_us >= run.start_us and o.end_us <= run.end_us + 1e-3]
