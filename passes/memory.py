"""Device memory over the schedule: the timeline, the peak, what is live there and why.

From :class:`~hloopt.passes.liveness.LiveRanges`, bytes live at every flat step are summed per
memory space (device = space 0; host ``S(5)`` apart; on-chip scratch ignored) with a difference
array: O(buffers + steps). The peak is the first step of maximum device bytes.

How XLA counts, and the switches that reproduce it (measured on the zoo, see tests):

* XLA CPU (``compile="cpu"``): live-out buffers share the heap with temporaries; the figure to
  compare is the no-fragmentation peak of the live ranges (:class:`PeakMemory` defaults).
* TPU (libtpu): ``peak_memory_in_bytes`` = arguments + outputs + constants + thread-local
  scratch + the peak of temporaries + generated code. Outputs get their own allocations (live the
  whole program: ``outputs_whole_program``), every HBM buffer is 512-byte aligned
  (``alignment_bytes`` in Liveness), constants and the scalars of reducer computations
  ("thread-local") are static allocations (``static_allocations``), and the program's code
  (``generated_code_size_in_bytes``) lives in HBM too (``code_bytes``).

Categories of a buffer (heuristics from the entry's structure and ``op_name`` metadata):
``parameters`` / ``optimizer state`` / ``inputs`` (entry parameters, by name: ``opt_state``,
``batch``), ``outputs`` (module outputs that are not donated parameters), ``activations``
(defined in the forward pass, read by the backward pass: ``transpose(`` in a reader's op_name),
``gradients`` (defined in the backward pass with the dims of a parameter), ``temporaries``
(the rest), ``static`` (constants and scratch); host bytes are reported apart.

Invariant: ``timeline_bytes[peak_step] == peak_bytes`` and the categories at the peak sum to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import ClassVar

from hloopt.ir import HOST_MEMORY_SPACE, Instruction, Module
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.aliasing import Buffer
from hloopt.passes.liveness import LiveRanges, Liveness

CATEGORIES: tuple[str, ...] = ("parameters", "optimizer state", "inputs", "gradients", "activations",
                               "temporaries", "outputs", "static")

#: ops whose called computations run per element as scalars: XLA gives their values thread-local
#: scratch rather than heap buffers
_SCALAR_CALLERS = frozenset({"reduce", "reduce-window", "scatter", "select-and-scatter", "sort", "map",
                             "all-reduce", "all-reduce-start", "reduce-scatter"})


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """One buffer as a report shows it."""

    name: str
    shape: str
    bytes: int
    category: str
    op_name: str
    #: "file:line" of the defining instruction, or ""
    source: str
    start: int
    end: int

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "shape": self.shape, "bytes": self.bytes, "category": self.category,
                "op_name": self.op_name, "source": self.source, "start": self.start, "end": self.end}


@dataclass(eq=False)
class MemoryProfile:
    """Result of :class:`PeakMemory`."""

    module: str
    ranges: LiveRanges
    #: device bytes live at each flat step (static allocations and code included)
    timeline_bytes: list[int]
    #: host (``S(5)``) bytes live at each flat step
    host_timeline_bytes: list[int]
    peak_bytes: int
    peak_step: int
    #: device bytes of entry parameters / of module outputs that are not parameters
    argument_bytes: int
    output_bytes: int
    #: peak of host bytes live at once
    host_bytes: int
    #: constants + thread-local scratch (when modeled), and code bytes added to every step
    static_bytes: int
    code_bytes: int
    #: device bytes by category at the peak
    categories: dict[str, int]
    #: the largest buffers live at the peak
    top: list[BufferInfo]
    category_of: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def peak_instruction(self) -> Instruction:
        return self.ranges.steps[self.peak_step]

    @property
    def temp_peak_bytes(self) -> int:
        """Peak minus what is live throughout (arguments, outputs, static, code)."""
        return self.peak_bytes - self.argument_bytes - self.output_bytes - self.static_bytes - self.code_bytes

    def entry_timeline_bytes(self) -> list[int]:
        """Per entry-computation step: the peak over each call site's nested steps."""
        return self.ranges.entry_timeline(self.timeline_bytes)


@dataclass(frozen=True)
class PeakMemory(Analysis[MemoryProfile]):
    """Peak device bytes over the schedule (no-fragmentation bound), categorized."""

    name: ClassVar[str] = "peak-memory"
    liveness: Liveness = Liveness()
    #: how many buffers live at the peak to describe
    top: int = 10
    #: outputs have their own allocations from step 0 (TPU), instead of from their definition
    outputs_whole_program: bool = False
    #: add constants and reducer scalars as static allocations (TPU)
    static_allocations: bool = False
    #: generated code resident in device memory (XLA's generated_code_size_in_bytes)
    code_bytes: int = 0

    def run(self, module: Module, am: AnalysisManager) -> MemoryProfile:
        lr = am.get(self.liveness)
        n_steps = len(lr.steps)
        last = n_steps - 1
        align = max(self.liveness.alignment_bytes, 1)
        sizes = lr.size_bytes
        start, end = list(lr.start), list(lr.end)
        static = 0
        if self.static_allocations:
            for b in lr.buffers:
                if start[b.id] >= 0 and b.on_device and all(i.opcode == "constant" for i, _ in b.values):
                    static += sizes[b.id]
                    start[b.id] = -1  # counted as static, not in the timeline
            static += _thread_local_bytes(module, align)
        if self.outputs_whole_program:
            for b in lr.buffers:
                if start[b.id] >= 0 and b.output_indices:
                    start[b.id], end[b.id] = 0, last

        diff = [0] * (n_steps + 1)
        hdiff = [0] * (n_steps + 1)
        for b in lr.buffers:
            s = start[b.id]
            if s < 0:
                continue
            if b.memory_space == 0:
                diff[s] += sizes[b.id]
                diff[end[b.id] + 1] -= sizes[b.id]
            elif b.memory_space == HOST_MEMORY_SPACE:
                hdiff[s] += sizes[b.id]
                hdiff[end[b.id] + 1] -= sizes[b.id]
        base = static + self.code_bytes
        timeline = [base + x for x in accumulate(diff[:-1])]
        host_timeline = list(accumulate(hdiff[:-1]))
        peak = max(timeline) if timeline else base
        peak_step = timeline.index(peak) if timeline else 0

        cats = categorize(lr)
        arg = sum(sizes[b.id] for b in lr.buffers if b.parameter >= 0 and b.on_device and start[b.id] >= 0)
        out = sum(sizes[b.id] for b in lr.buffers
                  if b.output_indices and b.parameter < 0 and b.on_device and start[b.id] >= 0)
        by_cat = dict.fromkeys(CATEGORIES, 0)
        live = []
        for b in lr.buffers:
            if b.on_device and 0 <= start[b.id] <= peak_step <= end[b.id] and sizes[b.id]:
                by_cat[cats[b.id]] += sizes[b.id]
                live.append(b)
        by_cat["static"] += base
        live.sort(key=lambda b: (-sizes[b.id], b.id))
        top = [_info(module, b, sizes[b.id], cats[b.id], start[b.id], end[b.id]) for b in live[: self.top]]
        return MemoryProfile(
            module=module.name, ranges=lr, timeline_bytes=timeline, host_timeline_bytes=host_timeline,
            peak_bytes=peak, peak_step=peak_step, argument_bytes=arg, output_bytes=out,
            host_bytes=max(host_timeline, default=0), static_bytes=static, code_bytes=self.code_bytes,
            categories={k: v for k, v in by_cat.items() if v}, top=top, category_of=cats,
        )


def _thread_local_bytes(module: Module, align: int) -> int:
    """Bytes of the instructions of scalar computations (reducers) XLA gives thread-local scratch."""
    comps = {}
    for inst in module.instructions():
        if inst.opcode in _SCALAR_CALLERS:
            for c in inst.called.get("to_apply", []):
                comps[c] = None
    total = 0
    for c in comps:
        for inst in c.instructions:
            if inst.opcode in ("tuple", "get-tuple-element", "bitcast"):
                continue
            for _, leaf in inst.shape.leaves():
                total += -(-leaf.byte_size // align) * align
    return total


def categorize(lr: LiveRanges) -> dict[int, str]:
    """Category of every buffer (see the module docstring)."""
    entry = lr.module.entry
    param_dims = set()
    out: dict[int, str] = {}
    if entry is not None:
        for p in entry.parameters:
            for _, leaf in p.shape.leaves():
                param_dims.add((leaf.element_type, leaf.dims))
    for b in lr.buffers:
        out[b.id] = _category(b, lr, param_dims)
    return out


def _category(b: Buffer, lr: LiveRanges, param_dims: set[tuple[str, tuple[int, ...]]]) -> str:
    if b.parameter >= 0:
        p = b.instruction
        text = (p.name + " " + p.metadata.op_name).lower()
        if "opt_state" in text or "opt-state" in text:
            return "optimizer state"
        if "batch" in text or "input" in text:
            return "inputs"
        return "parameters"
    if b.output_indices:
        return "outputs"
    if all(i.opcode == "constant" for i, _ in b.values):
        return "static"
    op_name = b.instruction.metadata.op_name
    backward = "transpose(" in op_name
    if backward:
        if (b.shape.element_type, b.shape.dims) in param_dims:
            return "gradients"
        return "temporaries"
    # Forward value: an activation when a backward-pass instruction reads it.
    for inst, _ in b.values:
        for u in inst.users:
            if "transpose(" in u.metadata.op_name:
                return "activations"
    if "jvp(" in op_name and lr.end[b.id] - lr.start[b.id] > max(8, lr.num_steps // 20):
        return "activations"
    return "temporaries"


def _info(module: Module, b: Buffer, size: int, cat: str, start: int, end: int) -> BufferInfo:
    inst = b.instruction
    src = module.source_of(inst)
    idx = "{" + ",".join(map(str, b.index)) + "}" if b.index else ""
    return BufferInfo(name=inst.name + idx, shape=b.shape.to_text(), bytes=size, category=cat,
                      op_name=inst.metadata.op_name, source=f"{src[0]}:{src[1]}" if src else "",
                      start=start, end=end)


__all__ = ["BufferInfo", "CATEGORIES", "MemoryProfile", "PeakMemory", "categorize"]
