"""Device memory over the schedule: the timeline, the peak, what is live there and why.

From :class:`~hloopt.passes.liveness.LiveRanges`, bytes live at every flat step are summed per
memory space (device = space 0; host ``S(5)`` apart; on-chip scratch ignored unless
``on_chip_heap``) with a difference array: O(buffers + steps). The peak is the first step of maximum device bytes.

How XLA counts, and the switches that reproduce it (measured on the zoo, see tests):

* XLA CPU (``compile="cpu"``): live-out buffers share the heap with temporaries; the figure to
  compare is the no-fragmentation peak of the live ranges (:class:`PeakMemory` defaults).
* TPU (libtpu): ``peak_memory_in_bytes`` = arguments + outputs + constants + the peak of ONE
  temporaries heap, found allocation by allocation in libtpu's buffer-assignment dumps (zoo, tiny
  and small): XLA's memory viewer adds the allocations with an indefinite lifetime to the peak of
  a heap-simulator trace, and libtpu reports the device (HBM) heap, the on-chip S(1) (VMEM)
  heap or the host S(5) heap, whichever peaks higher (``on_chip_heap``): for the tiny zoo models
  it is VMEM; at size ``small`` VMEM for mlp and gpt2, HBM for convnet and llama; the host heap
  where a scan offloads a stack inside its loop larger than either (a user's own
  ``save_and_offload_only_these_names`` over 8 bf16 layers: 180,362,240 B, exact). That last case
  is read from compiled modules only: the prediction and the planner model the device (HBM and
  VMEM), since host bytes are not what a budget of device memory limits (``analyze`` notes where
  the host heap would be libtpu's figure, :func:`hloopt.analysis.prediction_notes`). The VMEM figure replays
  memory-space assignment's heap trace, one allocation per value and no sharing, so a value a
  loop carries lives per value, and one written in place counts twice where it is written
  (:func:`on_chip_value_ranges`). Generated
  code and thread-local scratch are not in it. Outputs get their
  own allocations (live the whole program: ``outputs_whole_program``), every HBM buffer is
  512-byte aligned (``alignment_bytes`` in Liveness), constants are static allocations
  (``static_allocations``), and XLA's buffer assigner puts temporaries inside output
  allocations whenever their live ranges allow (``reuse_output_allocations``, see
  :func:`output_allocation_reuse`), which costs them nothing. ``code_bytes`` can still add
  the program's code (``generated_code_size_in_bytes``) to every step when a caller wants the
  resident total.

Memory-space assignment, predicted (``on_chip_heap`` on a module without ``S(1)`` buffers, i.e.
pre-optimization; ``on_chip_bytes`` the VMEM libtpu's memory-space assignment may fill): the TPU
compiler model's :mod:`hloopt.passes.tpu.msa` gives both sides of libtpu's accounting per step
(HBM heap with what does not fit VMEM spilled; VMEM heap of the packed temporaries, the
temporaries inside output allocations and the prefetched parameters), and the timeline is
``fixed + max(HBM heap, VMEM heap)``, libtpu's accounting of the device.

Offloads (``prefetch_at_offload``): libtpu starts copying an offloaded value back to the device
right after it has copied it to the host, wherever the backward pass reads it: in its compiled
modules every host->device ``copy-start`` of a value offloaded outside a loop directly follows
the ``copy-done`` of its offload (zoo gpt2 and convnet, tiny and small; libtpu 0.0.42 and
0.0.52), and it does so even when that no longer fits HBM (convnet small at batch 4096 with
``conv`` offloaded needs 24.2 GB and fails to compile; without the policy it needs 13.9 GB).
So the device copy a ``device`` annotation makes is counted live from its ``pinned_host``
annotation on (:func:`~hloopt.passes.residuals.offloaded_source`): an offload outside a loop
saves no HBM under libtpu. A scan's stacked residual (the stack in host memory, one slice read
back per backward iteration) is not affected. And libtpu lands every copy from host memory in HBM,
never in VMEM (all 94 host->device ``copy-start``/``dynamic-slice-start`` of the compiled zoo,
tiny and small): such a device copy (``hbm_pinned`` in
:func:`~hloopt.passes.tpu.msa.msa_sides`) is no VMEM relief for HBM; MSA prefetches it on
into VMEM for its readers, so from the compute step before its first reader to its last one it
takes that much of ``on_chip_bytes`` away from the temporaries packed there.
An offloaded convolution result keeps its layout in host memory and in its copy back
(:meth:`~hloopt.passes.tpu.fusion.FusionPlan.value_bytes`).

How close each rule brings the prediction to libtpu's figures, per model and size, is measured by
``tests/passes/test_preopt_accuracy.py`` and ``tests/passes/test_memory_accuracy.py`` and
tabulated in ``docs/measurements.md``.

Categories of a buffer (heuristics from the entry's structure and ``op_name`` metadata):
``parameters`` / ``optimizer state`` / ``inputs`` (entry parameters, by name: ``opt_state``,
``batch``), ``outputs`` (module outputs that are not donated parameters), ``activations``
(defined in the forward pass, read by the backward pass: ``transpose(`` in a reader's op_name),
``gradients`` (defined in the backward pass with the dims of a parameter), ``temporaries``
(the rest), ``static`` (constants and code); host bytes are reported apart.

Invariant: ``timeline_bytes[peak_step] == peak_bytes`` and the categories at the peak sum to it.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from typing import ClassVar

import numpy as np

from hloopt.ir import HOST_MEMORY_SPACE, ON_CHIP_MEMORY_SPACE, Computation, Instruction, Module, gc_paused
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.aliasing import Buffer
from hloopt.passes.liveness import Liveness, LiveRanges
from hloopt.passes.opcodes import ELEMENTWISE, TRANSCENDENTAL
from hloopt.passes.residuals import is_device_annotation, offloaded_source

CATEGORIES: tuple[str, ...] = ("parameters", "optimizer state", "inputs", "gradients", "activations",
                               "temporaries", "outputs", "static")


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
    #: per buffer id, the steps it is counted in the timeline (start -1: not in it: static,
    #: inside an output's allocation, another memory space)
    counted_start: list[int] = field(default_factory=list, repr=False)
    counted_end: list[int] = field(default_factory=list, repr=False)
    #: (buffer id, start, end, +/-bytes) counted besides those intervals: the per-value lives of
    #: a compiled module's loop-carried VMEM buffers (:func:`on_chip_value_ranges`)
    counted_corrections: tuple[tuple[int, int, int, int], ...] = field(default=(), repr=False)
    #: ids of temporaries placed inside module outputs' allocations (``reuse_output_allocations``)
    absorbed: frozenset[int] = frozenset()
    #: predicted memory-space assignment only: per flat step, the VMEM side of the accounting
    #: (``fixed + VMEM heap(t)``, module docstring), which no HBM decision lowers
    on_chip_timeline_bytes: list[int] | None = field(default=None, repr=False)
    #: predicted memory-space assignment only: the HBM bytes the temporaries placed in VMEM take
    #: off the device heap at the peak step
    on_chip_relief_bytes: int = 0

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
    #: constants are static allocations for the whole program (TPU), not timeline buffers
    static_allocations: bool = False
    #: generated code resident in device memory (XLA's generated_code_size_in_bytes)
    code_bytes: int = 0
    #: XLA's buffer assigner places a temporary inside a module output's allocation when their
    #: live ranges do not meet (:func:`output_allocation_reuse`); such temporaries cost nothing
    reuse_output_allocations: bool = False
    #: libtpu's peak_memory_in_bytes reports one temporaries heap: the device (HBM) heap or the
    #: on-chip S(1) (VMEM) heap, whichever peaks higher; count the S(1) temporaries instead of the
    #: device ones when theirs is the higher peak
    on_chip_heap: bool = False
    #: VMEM that memory-space assignment fills (bytes); used to predict the VMEM heap of a
    #: pre-optimization module (module docstring). v5e: 128 MiB per TensorCore less the 16 MiB
    #: scoped VMEM limit; the largest VMEM heap in libtpu's compiled small zoo is exactly this
    on_chip_bytes: int = 112 * 2**20
    #: names of instructions whose values are taken off the device (not counted anywhere): what
    #: the memory would be with those residuals offloaded at no cost (the planner's floor)
    off_device: frozenset[str] = frozenset()
    #: libtpu starts reading an offloaded value back to the device right after it has offloaded
    #: it (outside loops; module docstring): the device copy a ``device`` annotation makes is
    #: live from its ``pinned_host`` annotation on, not from where the backward pass reads it
    prefetch_at_offload: bool = False
    #: XLA's heap simulator gives a fusion's output the buffer of an operand that dies there when
    #: the fused computation reads that operand only elementwise (:func:`heap_shared_operands`):
    #: the two are one allocation, counted once at the fusion (compiled modules, whose fusions
    #: are known)
    share_dying_operands: bool = False

    def run(self, module: Module, am: AnalysisManager) -> MemoryProfile:
        lr = am.get(self.liveness)
        with gc_paused():  # per-step lists and sets by the ten thousand, freed together
            return self._run(module, lr)

    def _run(self, module: Module, lr: LiveRanges) -> MemoryProfile:
        n_steps = len(lr.steps)
        last = n_steps - 1
        sizes = lr.size_bytes
        start, end = list(lr.start), list(lr.end)
        static = 0
        if self.share_dying_operands:
            for bid in heap_shared_operands(lr):
                at = start[bid]
                start[bid] = at + 1 if end[bid] > at else -1  # the operand's allocation holds it at ``at``
        if self.static_allocations:
            for b in lr.buffers:
                if start[b.id] >= 0 and b.on_device and _is_constant(b):
                    static += sizes[b.id]
                    start[b.id] = -1  # counted as static, not in the timeline
        if self.off_device:
            for b in lr.buffers:
                if start[b.id] >= 0 and any(i.name in self.off_device for i, _ in b.values):
                    start[b.id] = -1
        if self.prefetch_at_offload:
            for b in lr.buffers:
                if start[b.id] < 0:
                    continue
                for inst, index in b.values:
                    src = None if index else offloaded_source(inst)
                    if src is not None and src in lr.time:
                        start[b.id] = min(start[b.id], lr.time[src])
        absorbed: set[int] = set()
        #: (start, end, bytes) of the temporaries inside output allocations: free in HBM, but
        #: memory-space assignment still places them in VMEM (they are S(1) in libtpu's module)
        absorbed_ranges: list[tuple[int, int, int]] = []
        if self.reuse_output_allocations:
            absorbed = output_allocation_reuse(lr)
            absorbed_ranges = [(start[bid], end[bid], sizes[bid]) for bid in absorbed
                               if lr.buffers[bid].memory_space == 0]
            for bid in absorbed:
                start[bid] = -1  # inside an output's allocation, which is counted whole
        if self.outputs_whole_program:
            for b in lr.buffers:
                if start[b.id] >= 0 and b.output_indices:
                    start[b.id], end[b.id] = 0, last
        spaces: tuple[int, ...] = (0,)
        #: (buffer id, start, end, +/-bytes) counted besides the buffers' own intervals
        corrections: list[tuple[int, int, int, int]] = []
        diff = [0] * (n_steps + 1)
        hdiff = [0] * (n_steps + 1)
        predicted_msa = self.on_chip_heap and self.on_chip_bytes > 0 and \
            not any(b.memory_space == ON_CHIP_MEMORY_SPACE for b in lr.buffers)
        movable: set[int] = set()
        if predicted_msa:
            movable = {b.id for b in lr.buffers if start[b.id] >= 0 and b.memory_space == 0 and b.parameter < 0
                       and not b.output_indices and 0 < sizes[b.id] <= self.on_chip_bytes}
        elif self.on_chip_heap:
            temp = [b for b in lr.buffers if start[b.id] >= 0 and b.parameter < 0 and not b.output_indices]
            device_peak = _peak([(start[b.id], end[b.id], sizes[b.id]) for b in temp if b.memory_space == 0])
            per_value = on_chip_value_ranges(lr, start, end)
            chip_peak = _peak([(start[b.id], end[b.id], sizes[b.id]) for b in temp
                               if b.memory_space == ON_CHIP_MEMORY_SPACE] + [r[1:] for r in per_value])
            host_peak = _peak([(start[b.id], end[b.id], sizes[b.id]) for b in temp
                               if b.memory_space == HOST_MEMORY_SPACE])
            # libtpu reports the heap that peaks highest; the host one where a scan's stack
            # offloaded inside the loop outgrows the other two
            heap = max((device_peak, 0), (chip_peak, ON_CHIP_MEMORY_SPACE), (host_peak, HOST_MEMORY_SPACE),
                       key=lambda p: p[0])[1]
            if heap != 0:
                spaces = (0, heap)
                for b in temp:
                    if b.memory_space == 0:
                        start[b.id] = -1
            if heap == ON_CHIP_MEMORY_SPACE:
                corrections = per_value
                for _, first, last, n in corrections:
                    diff[first] += n
                    diff[last + 1] -= n

        for b in lr.buffers:
            s = start[b.id]
            if s < 0:
                continue
            if b.memory_space in spaces:
                diff[s] += sizes[b.id]
                diff[end[b.id] + 1] -= sizes[b.id]
            if b.memory_space == HOST_MEMORY_SPACE:
                hdiff[s] += sizes[b.id]
                hdiff[end[b.id] + 1] -= sizes[b.id]
            elif b.memory_space not in spaces:
                start[b.id] = -1  # not in the timeline
        base = static + self.code_bytes
        if predicted_msa:
            # libtpu's memory-space assignment, predicted (the TPU compiler model's, imported
            # only when a TPU accounting asks for it)
            from hloopt.passes.tpu.msa import activation_minor_sizes, msa_sides

            # copies from host memory land in HBM (module docstring): counted there, not packed
            pinned = {bid for bid in movable if any(is_device_annotation(i) for i, _ in lr.buffers[bid].values)}
            unplaced = list(accumulate(diff[:-1]))  # every temporary in HBM: what VMEM relieves is measured against it
            for bid in movable - pinned:  # counted by the MSA model, not as HBM bytes
                diff[start[bid]] -= sizes[bid]
                diff[end[bid] + 1] += sizes[bid]
            hbm_side, on_chip_side = msa_sides(lr, start, end, movable, [base + x for x in accumulate(diff[:-1])],
                                               hbm_pinned=pinned,
                                               capacity_bytes=self.on_chip_bytes, base_bytes=base,
                                               on_chip_only=absorbed_ranges,
                                               on_chip_sizes=activation_minor_sizes(lr, movable))
            timeline = [max(h, v) for h, v in zip(hbm_side, on_chip_side)]
        else:
            unplaced = None
            on_chip_side = None
            timeline = [base + x for x in accumulate(diff[:-1])]
        host_timeline = list(accumulate(hdiff[:-1]))
        peak = max(timeline) if timeline else base
        peak_step = timeline.index(peak) if timeline else 0

        cats = categorize(lr)
        arg = sum(sizes[b.id] for b in lr.buffers if b.parameter >= 0 and b.on_device and start[b.id] >= 0)
        out = sum(sizes[b.id] for b in lr.buffers
                  if b.output_indices and b.parameter < 0 and b.on_device and start[b.id] >= 0)
        by_cat = dict.fromkeys(CATEGORIES, 0)
        at_peak: dict[int, int] = {}
        for b in lr.buffers:
            if b.memory_space in spaces and 0 <= start[b.id] <= peak_step <= end[b.id] and sizes[b.id]:
                at_peak[b.id] = sizes[b.id]
        for bid, first, last, n in corrections:
            if first <= peak_step <= last:
                at_peak[bid] = at_peak.get(bid, 0) + n
        live = []
        for bid, n in at_peak.items():
            by_cat[cats[bid]] += n
            if n > 0:
                live.append(lr.buffers[bid])
        by_cat["static"] += base
        if predicted_msa and timeline:
            _settle(by_cat, timeline[peak_step] - sum(by_cat.values()))
        live.sort(key=lambda b: (-sizes[b.id], b.id))
        top = [_info(module, b, sizes[b.id], cats[b.id], start[b.id], end[b.id]) for b in live[: self.top]]
        return MemoryProfile(
            module=module.name, ranges=lr, timeline_bytes=timeline, host_timeline_bytes=host_timeline,
            peak_bytes=peak, peak_step=peak_step, argument_bytes=arg, output_bytes=out,
            host_bytes=max(host_timeline, default=0), static_bytes=static, code_bytes=self.code_bytes,
            categories={k: v for k, v in by_cat.items() if v}, top=top, category_of=cats,
            counted_start=start, counted_end=end, counted_corrections=tuple(corrections),
            absorbed=frozenset(absorbed), on_chip_timeline_bytes=on_chip_side,
            on_chip_relief_bytes=max(0, base + unplaced[peak_step] - hbm_side[peak_step])
            if unplaced and timeline else 0,
        )




def _settle(by_cat: dict[str, int], delta: int) -> None:
    """Make the categories at the peak add up to the modeled peak: VMEM/spill bytes are
    temporaries; bytes MSA took out of HBM come off temporaries first, then activations."""
    if delta >= 0:
        by_cat["temporaries"] += delta
        return
    for k in ("temporaries", "activations", "gradients"):
        take = min(by_cat[k], -delta)
        by_cat[k] -= take
        delta += take
        if not delta:
            return


def _is_constant(b: Buffer) -> bool:
    return all(i.opcode == "constant" for i, _ in b.values)


def _peak(intervals: list[tuple[int, int, int]]) -> int:
    """Largest sum of sizes live at once over closed [start, end] intervals."""
    events = sorted([(s, size) for s, _, size in intervals] + [(e + 1, -size) for _, e, size in intervals])
    run = peak = 0
    for _, delta in events:
        run += delta
        peak = max(peak, run)
    return peak


def on_chip_value_ranges(lr: LiveRanges, start: list[int], end: list[int]) -> list[tuple[int, int, int, int]]:
    """Corrections (buffer id, start, end, +/-bytes) that turn the on-chip (``S(1)``) buffers holding
    several values into one interval per value.

    libtpu's VMEM heap figure replays memory-space assignment's heap trace, which has one
    allocation per value and no sharing (read off the trace in libtpu's buffer-assignment proto:
    a flax NNX scan step, 308 events, a Levanter GPT-2 step, 1,158; each replay plus arguments,
    outputs and constants is ``peak_memory_in_bytes`` to the byte). A loop's carried buffer holds
    several values: in the flattened schedule value k lives from its definition to the last read
    of the buffer up to the next value's definition (a loop's carry is free between its last read
    and its next write, where libtpu puts other temporaries), and the last value to the buffer's
    end. A value written in place (a scan's ``dynamic-update-slice`` into its stack) is allocated
    before the value it overwrites is freed: at its writer the buffer counts twice."""
    multi = {b.id: b for b in lr.buffers
             if b.memory_space == ON_CHIP_MEMORY_SPACE and start[b.id] >= 0 and len(b.values) > 1
             and b.parameter < 0 and not b.output_indices}
    if not multi:
        return []
    reads: dict[int, list[int]] = {bid: [] for bid in multi}
    buffer_at = lr.aliasing.position_buffers
    for t, inst in enumerate(lr.steps):
        for op in inst.operands:
            for bid in buffer_at.get(op, ()):
                if bid in reads:
                    reads[bid].append(t)
    out: list[tuple[int, int, int, int]] = []
    for bid, b in multi.items():
        defs = sorted({lr.time[inst] for inst, _ in b.values if inst in lr.time})
        if len(defs) < 2:
            continue
        size = lr.size_bytes[bid]
        out.append((bid, start[bid], end[bid], -size))
        rs = sorted(reads[bid])
        defs[0] = min(defs[0], start[bid])
        for k, t in enumerate(defs):
            if k + 1 < len(defs):
                j = bisect_right(rs, defs[k + 1]) - 1  # the last read up to the next definition
                last = rs[j] if j >= 0 and rs[j] >= t else t
            else:
                last = max(end[bid], t)
            out.append((bid, t, last, size))
    return out


def heap_shared_operands(lr: LiveRanges) -> list[int]:
    """Buffers defined by a fusion that takes the buffer of one of its operands dying there.

    XLA's heap simulator lets an instruction's output share the chunk of an operand buffer freed
    at that instruction when ``CanShareOperandBufferWithUser`` holds. For a fusion libtpu allows
    it when the fused computation reads that operand only through element-wise ops (the generic
    ``AreTransitiveUsesElementwiseOrTuple``), whatever the fusion's kind: a transformer's MLP
    backward, a ``kOutput`` fusion of the second matmul's gradient with the gelu derivative,
    writes its bf16 ``[B, S, 4D]`` result over the saved ``x @ w1`` it reads (one allocation for
    both in libtpu 0.0.42's buffer assignment). Operand and output must have one shape, layout
    and memory space; the operand a temporary (not an argument, output or constant), read by
    nothing later. Each operand buffer is taken once. HBM only: memory-space assignment places
    the VMEM (``S(1)``) values itself, and counting such shares there takes 1% off the VMEM-bound
    tiny sharded step libtpu 0.0.52 compiles exactly as counted without them."""
    taken: set[int] = set()
    out: list[int] = []
    buffer_at = lr.aliasing.position_buffers
    for b in lr.buffers:
        s = lr.start[b.id]
        if s < 0 or b.memory_space != 0 or b.parameter >= 0 or b.output_indices or b.is_tuple_table \
                or b.index != () or len(b.values) != 1:
            continue
        inst = lr.steps[s]
        if inst is not b.instruction or inst.opcode != "fusion":
            continue
        comp = inst.callee("calls")
        if comp is None:
            continue
        shape_text = str(inst.shape)
        for k, operand in enumerate(inst.operands):
            obs = buffer_at.get(operand, ())
            if len(obs) != 1 or obs[0] in taken:
                continue
            ob = lr.buffers[obs[0]]
            if lr.end[ob.id] != s or ob.parameter >= 0 or ob.output_indices or ob.memory_space != b.memory_space \
                    or lr.size_bytes[ob.id] != lr.size_bytes[b.id] or str(operand.shape) != shape_text \
                    or operand.opcode in ("constant", "parameter"):
                continue
            if k < len(comp.parameters) and _elementwise_uses(comp.parameters[k]):
                taken.add(ob.id)
                out.append(b.id)
                break
    return out


#: what a fused parameter may pass through and still be read element-wise
_ELEMENTWISE_READS = ELEMENTWISE | TRANSCENDENTAL


def _elementwise_uses(param: Instruction) -> bool:
    """Whether every transitive use of ``param`` in its computation is element-wise (same dims)
    or the root tuple (XLA's ``AreTransitiveUsesElementwiseOrTuple``)."""
    todo, seen = [param], {param}
    while todo:
        v = todo.pop()
        for u in v.users:
            if u in seen:
                continue
            if u.opcode == "tuple" and u.is_root:
                continue
            if u.opcode not in _ELEMENTWISE_READS or not u.shape.is_array or u.shape.dims != param.shape.dims:
                return False
            seen.add(u)
            todo.append(u)
    return True


#: instructions that never write over their operand's buffer
_NO_OPERAND_SHARING = frozenset({"copy", "copy-start", "copy-done", "parameter", "constant", "while",
                                 "conditional", "call", "tuple", "get-tuple-element", "custom-call"})


def post_order_positions(computations: list[Computation]) -> dict[Instruction, int]:
    """Each instruction's position in the order XLA's buffer assigner sorts equal-sized buffers by.

    ``BufferAssigner::AssignBuffersForComputations`` numbers instructions computation by
    computation, callers before callees (the entry first), and within a computation in
    ``MakeInstructionPostOrder``: a depth-first walk from each instruction without users, in
    instruction order, that emits an instruction after its operands (first operand first) and
    its control predecessors. The schedule order is not it: an operand-less instruction (an
    ``AllocateBuffer`` custom call, a constant) comes where its first reader's walk reaches it,
    wherever the schedule put it.
    """
    position: dict[Instruction, int] = {}
    for comp in computations:
        for root in comp.instructions:
            if root.users or root in position:
                continue
            stack: list[tuple[Instruction, bool]] = [(root, False)]
            while stack:
                inst, expanded = stack.pop()
                if inst in position:
                    continue
                if expanded:
                    position[inst] = len(position)
                    continue
                stack.append((inst, True))
                # pushed last, walked first: control predecessors, then the operands in order
                for o in reversed(inst.operands):
                    if o not in position:
                        stack.append((o, False))
                for o in reversed(tuple(inst.control_predecessors)):
                    if o not in position:
                        stack.append((o, False))
    return position


def output_allocation_reuse(lr: LiveRanges) -> set[int]:
    """Temporaries XLA's buffer assigner places inside module outputs' allocations.

    XLA (``BufferAssigner::AssignBuffersForComputations``) walks buffers by decreasing size,
    live-out first among equals, then by definition order. Entry parameters, constants and index
    tables get their own allocations; a live-out buffer gets a new allocation, kept for reuse; a
    temporary first tries its defining instruction's operands' allocations, then the reusable
    allocations from the smallest, and takes the first that is at least its size and whose
    buffers' live ranges all end before its own starts or start after its own ends
    (``MaybeAssignBuffer``); only temporaries that fit nowhere go to the heap. Donated parameters
    share their output's buffer here, so their allocation is reusable too. Device memory only.
    """
    sizes, start, end = lr.size_bytes, lr.start, lr.end
    order = [b for b in lr.buffers if start[b.id] >= 0 and sizes[b.id] > 0 and b.memory_space == 0]
    # XLA's order among equal sizes is its post-order of the module it assigns. Of a compiled
    # (scheduled) module that is this module's post-order; of a module hloopt predicts from, XLA
    # assigns a fused and rewritten module whose post-order this one's does not give, and the
    # schedule hloopt built for it is the nearer stand-in
    if lr.module.is_scheduled:
        position = post_order_positions(lr.aliasing.computations)
        far = len(position)

        def first_position(b: Buffer) -> int:
            return min((position.get(inst, far) for inst, _ in b.values), default=far)
    else:
        def first_position(b: Buffer) -> int:
            return start[b.id]

    order.sort(key=lambda b: (-sizes[b.id], not b.output_indices, first_position(b), b.id))
    #: allocation index -> (size, [(start, end, buffer id)]); per buffer id, its allocation
    allocs: list[tuple[int, list[tuple[int, int, int]]]] = []
    alloc_of: dict[int, int] = {}
    # per allocation its output's live range: a temporary whose range crosses the
    # output's (not only touching an end) cannot go there, so the smallest-first search skips
    # those allocations without looking at what else each holds (training steps have thousands
    # of outputs)
    n_out = sum(1 for b in order if b.output_indices and not b.is_tuple_table)
    out_start = np.empty(n_out, dtype=np.int64)
    out_end = np.empty(n_out, dtype=np.int64)
    out_bid: list[int] = []
    min_out_end = len(lr.steps)
    # the temporaries placed so far (range, allocation, buffer id), as arrays: the allocations
    # one of them blocks for the next temporary are found in one pass over them, instead of
    # trying allocation after allocation (a layer's temporaries are live together, so each
    # tried all the allocations its neighbours took first: temporaries x outputs)
    n_tmp = 0
    tmp_start = np.empty(len(order), dtype=np.int64)
    tmp_end = np.empty(len(order), dtype=np.int64)
    tmp_alloc = np.empty(len(order), dtype=np.int64)
    tmp_bid: list[int] = []
    absorbed: set[int] = set()
    buffer_at = lr.aliasing.position_buffers

    def shares_operand(user: int, operand: int) -> bool:
        # XLA lets a value take its operand's buffer at the step where the operand dies when the
        # defining instruction reads it and may write over it (CanShareOperandBufferWithUser:
        # an elementwise/in-place user of the same size, never a copy)
        inst = lr.steps[start[user]]
        if inst.opcode in _NO_OPERAND_SHARING or sizes[user] != sizes[operand]:
            return False
        return any(operand in buffer_at.get(o, ()) for o in inst.operands)

    def compatible(s: int, e: int, bid: int, s2: int, e2: int, other: int) -> bool:
        # the live ranges do not meet, or meet where one takes the other's buffer as its operand dies
        if e < s2 or e2 < s:
            return True
        return e == s2 and shares_operand(other, bid) or e2 == s and shares_operand(bid, other)

    def fits(k: int, b: Buffer) -> bool:
        size, ranges = allocs[k]
        if sizes[b.id] > size:
            return False
        s, e = start[b.id], end[b.id]
        return all(compatible(s, e, b.id, s2, e2, other) for s2, e2, other in ranges)

    def smallest_open(b: Buffer, m: int) -> int | None:
        # the last allocation (smallest, latest output) that fits: whose output the temporary
        # does not cross and none of whose temporaries it meets (the walk over allocations
        # ``fits`` makes, from the last, answered for all of them at once; every allocation so
        # far is at least the temporary's size: buffers come largest first)
        s, e = start[b.id], end[b.id]
        os_, oe = out_start[:m], out_end[:m]
        ok = os_ >= e
        if s >= min_out_end:
            ok |= oe <= s
        if not ok.any():
            return None
        if n_tmp:
            ts, te = tmp_start[:n_tmp], tmp_end[:n_tmp]
            ok[tmp_alloc[np.flatnonzero((ts < e) & (te > s))]] = False  # overlapping, not only touching
            for j in np.flatnonzero((ts == e) | (te == s)).tolist():  # touching: one may take the other's buffer
                k = int(tmp_alloc[j])
                if ok[k] and not compatible(s, e, b.id, int(ts[j]), int(te[j]), tmp_bid[j]):
                    ok[k] = False
        touch = os_ == e
        if s >= min_out_end:
            touch |= oe == s
        for k in np.flatnonzero(ok & touch).tolist():
            if not compatible(s, e, b.id, int(out_start[k]), int(out_end[k]), out_bid[k]):
                ok[k] = False
        left = np.flatnonzero(ok)
        return int(left[-1]) if left.size else None

    for b in order:
        if b.output_indices and not b.is_tuple_table:
            new = len(allocs)
            out_start[new], out_end[new] = start[b.id], end[b.id]
            min_out_end = min(min_out_end, end[b.id])
            out_bid.append(b.id)
            alloc_of[b.id] = new
            allocs.append((sizes[b.id], [(start[b.id], end[b.id], b.id)]))
            continue
        if b.output_indices or b.parameter >= 0 or b.is_tuple_table or _is_constant(b):
            continue
        tried: dict[int, None] = {}
        for inst, _ in b.values:
            for o in inst.operands:
                for ob in buffer_at.get(o, ()):
                    k = alloc_of.get(ob)
                    if k is not None:
                        tried[k] = None
        chosen = next((k for k in tried if fits(k, b)), None)
        if chosen is None:
            chosen = smallest_open(b, len(allocs))
        if chosen is not None:
            allocs[chosen][1].append((start[b.id], end[b.id], b.id))
            alloc_of[b.id] = chosen
            absorbed.add(b.id)
            tmp_start[n_tmp], tmp_end[n_tmp], tmp_alloc[n_tmp] = start[b.id], end[b.id], chosen
            tmp_bid.append(b.id)
            n_tmp += 1
    return absorbed


def categorize(lr: LiveRanges) -> dict[int, str]:
    """Category of every buffer (see the module docstring)."""
    entry = lr.module.entry
    param_dims = set()
    out: dict[int, str] = {}
    if entry is not None:
        for p in entry.parameters:
            for _, leaf in p.shape.leaves():
                param_dims.add((leaf.element_type, leaf.dims))
    backward: dict[str, bool] = {}
    for b in lr.buffers:
        out[b.id] = _category(b, lr, param_dims, backward)
    return out


def _in_backward(inst: Instruction, memo: dict[str, bool]) -> bool:
    """``transpose(`` in ``inst``'s op_name (the backward pass), memoized per metadata text: a
    step's instructions share a few hundred texts."""
    text = inst._metadata_text
    if not text:
        return "transpose(" in inst.metadata.op_name
    got = memo.get(text)
    if got is None:
        got = memo[text] = "transpose(" in inst.metadata.op_name
    return got


#: pytree path keys of optimizer state: optax's state fields (Adam's ``mu``/``nu``, SGD momentum's
#: ``trace``) and the usual names of the optimizer argument
_OPTIMIZER_KEYS = frozenset({"mu", "nu", "trace", "momentum", "opt", "optimizer", "opt_state"})
#: the keys under which such keys are the model's own (a VAE's ``params['mu']``)
_PARAMETER_ROOTS = frozenset({"params", "param", "model", "variables", "weights"})


def _optimizer_path(op_name: str) -> bool:
    """Whether a parameter's JAX path (its ``op_name``: ``st[0].mu.layers.w1``,
    ``state.opt_state[0].nu['Dense_0']``) runs through optimizer state: the first of its keys that
    is an optimizer key (:data:`_OPTIMIZER_KEYS`) or a model's (:data:`_PARAMETER_ROOTS`: a flax
    TrainState's ``state.params['mu']`` is a layer named mu) is an optimizer key."""
    for key in re.split(r"[.\[\]'\" ]+", op_name.lower()):
        if key in _OPTIMIZER_KEYS:
            return True
        if key in _PARAMETER_ROOTS:
            return False
    return False


def _category(b: Buffer, lr: LiveRanges, param_dims: set[tuple[str, tuple[int, ...]]],
              backward_memo: dict[str, bool] | None = None) -> str:
    memo: dict[str, bool] = {} if backward_memo is None else backward_memo
    if b.parameter >= 0:
        p = b.instruction
        text = (p.name + " " + p.metadata.op_name).lower()
        if "opt_state" in text or "opt-state" in text or _optimizer_path(p.metadata.op_name):
            return "optimizer state"
        if "batch" in text or "input" in text:
            return "inputs"
        return "parameters"
    if b.output_indices:
        return "outputs"
    values = b.values
    if values[0][0].opcode == "constant" if len(values) == 1 else all(i.opcode == "constant" for i, _ in values):
        return "static"
    op_name = b.instruction.metadata.op_name
    backward = "transpose(" in op_name
    if backward:
        if (b.shape.element_type, b.shape.dims) in param_dims:
            return "gradients"
        return "temporaries"
    # Forward value: an activation when a backward-pass instruction reads it.
    for inst, _ in values:
        for u in inst.users:
            if _in_backward(u, memo):
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


__all__ = ["BufferInfo", "CATEGORIES", "MemoryProfile", "PeakMemory", "categorize", "output_allocation_reuse",
           "post_order_positions"]
