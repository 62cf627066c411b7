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
  a heap-simulator trace, and libtpu reports the device (HBM) heap or the on-chip S(1) (VMEM)
  heap, whichever peaks higher (``on_chip_heap``): for the tiny zoo models it is VMEM; at size
  ``small`` VMEM for mlp and gpt2, HBM for convnet and llama. Generated code and thread-local scratch are not
  in it. Outputs get their
  own allocations (live the whole program: ``outputs_whole_program``), every HBM buffer is
  512-byte aligned (``alignment_bytes`` in Liveness), constants are static allocations
  (``static_allocations``), and XLA's buffer assigner puts temporaries inside output
  allocations whenever their live ranges allow (``reuse_output_allocations``, see
  :func:`output_allocation_reuse`), which costs them nothing. ``code_bytes`` can still add
  the program's code (``generated_code_size_in_bytes``) to every step when a caller wants the
  resident total.

Memory-space assignment, predicted (``on_chip_heap`` on a module without ``S(1)`` buffers, i.e.
pre-optimization; ``on_chip_bytes`` the VMEM libtpu's memory-space assignment (MSA) may fill):
MSA moves temporaries into VMEM and prefetches the parameters the steps read. Per step ``t``,
with ``mov(t)`` the live temporaries of at most ``on_chip_bytes`` each, ``pre(t)`` the
parameters whose prefetched copy is live and ``hbm(t)`` everything else:

    HBM heap(t)   = hbm(t) + mov(t) - packed(t)       (what does not fit spills)
    VMEM heap(t)  = min(on_chip_bytes, mov(t) + out(t) + pre(t))
    timeline(t)   = fixed + max(HBM heap(t), VMEM heap(t))

with ``packed(t)`` the bytes of the live movable temporaries a largest-first placement of whole
buffers fits into ``on_chip_bytes`` (all of them when they fit), ``out(t)`` the live temporaries
XLA's buffer assigner puts inside output allocations (free in HBM, still S(1) values in VMEM:
the gradient accumulators a scan carries, its stacked residuals), and a parameter's prefetched
copy live from the compute step before its first reader to its last reader: one copy per
parameter, kept in between (libtpu keeps a layer's f32 weights in VMEM from the forward's bf16
cast to the optimizer update). A reader is a materialized step; a step that reads a module output
(same dims) joins that output's multi-output fusion and reads its parameters from the fusion's
first step (the optimizer's moment and parameter updates are one fusion); a loop reads the
parameters it carries from its first step. In VMEM a convolution's result and the pooling
windows over it are laid out with batch and feature minor, in the order that pads less
(:func:`~hloopt.passes.fusion_model.activation_minor_dims`:
``f32[4,16,16,8]{3,0,2,1:T(4,128)S(1)}`` is 512 KiB where the compact HBM layout takes 32 KiB;
``f32[16,16,16,8]{0,3,2,1:T(8,128)S(1)}`` puts the batch on the lanes), so ``mov(t)`` counts
them at that size (:func:`activation_minor_sizes`); HBM keeps them compact.
The peak is fixed + max(HBM heap, VMEM heap), libtpu's accounting.

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
tiny and small): such a device copy (``hbm_pinned`` in :func:`msa_sides`) is no VMEM relief for
HBM; MSA prefetches it on into VMEM for its readers, so from the compute step before its first
reader to its last one it takes that much of ``on_chip_bytes`` away from the temporaries packed
there. Convnet small with its offload policy: -20.5% -> -5.3% of libtpu's peak; other convnet
shapes over VMEM improve 2-7 points and stay 15-26% under (libtpu's schedule runs the previous
stage's backward tail alongside, ``bench/small_shapes.py``).

Measured against libtpu 0.0.42 (v5e; tests/test_preopt_accuracy.py): at size small, the VMEM
heap libtpu reports is 101-112 MiB whenever the step's working set exceeds VMEM (mlp, gpt2;
convnet's is exactly 112 MiB), all within 1.2%; at size tiny, where VMEM holds the whole working
set, the VMEM heap (libtpu's dumps: the S(1) values live at the peak, within 16 KiB) is predicted
within 8% for mlp, gpt2 and llama (offloaded or not) and sharded within 3%. For a convolution
over a batch smaller than the 8 sublanes, libtpu rewrites the convolution (spatial rows folded
into the batch, ``0b1f``), computes the elementwise values after it in that layout and copies
those a reader in the batch/feature-minor layout needs across: they are materialized
(:func:`~hloopt.passes.fusion_model.layout_boundaries`), at the batch/feature-minor size in VMEM.
The tiny zoo convnet (batch 4) is predicted +1.0% (-37.6% before); the 9 such shapes of
``bench/convnet_shapes.py`` -32% to +7% (were -56% to -2%; the four under -20%, batch 1 and
wider stages, are not explained yet); batch 8 to 64 from -12% to -1%.
An offloaded convolution result keeps its layout in host memory and in its copy back
(:meth:`FusionPlan.value_bytes`).

Categories of a buffer (heuristics from the entry's structure and ``op_name`` metadata):
``parameters`` / ``optimizer state`` / ``inputs`` (entry parameters, by name: ``opt_state``,
``batch``), ``outputs`` (module outputs that are not donated parameters), ``activations``
(defined in the forward pass, read by the backward pass: ``transpose(`` in a reader's op_name),
``gradients`` (defined in the backward pass with the dims of a parameter), ``temporaries``
(the rest), ``static`` (constants and code); host bytes are reported apart.

Invariant: ``timeline_bytes[peak_step] == peak_bytes`` and the categories at the peak sum to it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import ClassVar

import numpy as np

from hloopt.ir import HOST_MEMORY_SPACE, Instruction, Module, gc_paused
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.aliasing import Buffer
from hloopt.passes.liveness import FORWARDS, Liveness, LiveRanges
from hloopt.passes.residuals import is_device_annotation, offloaded_source

#: TPU VMEM, the on-chip memory space memory-space assignment moves temporaries into
ON_CHIP_MEMORY_SPACE = 1

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
    #: ids of temporaries placed inside module outputs' allocations (``reuse_output_allocations``)
    absorbed: frozenset[int] = frozenset()
    #: predicted memory-space assignment only: per flat step, the VMEM side of the accounting
    #: (``fixed + VMEM heap(t)``, module docstring), which no HBM decision lowers
    on_chip_timeline_bytes: list[int] | None = field(default=None, repr=False)

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
        predicted_msa = self.on_chip_heap and self.on_chip_bytes > 0 and \
            not any(b.memory_space == ON_CHIP_MEMORY_SPACE for b in lr.buffers)
        movable: set[int] = set()
        if predicted_msa:
            movable = {b.id for b in lr.buffers if start[b.id] >= 0 and b.memory_space == 0 and b.parameter < 0
                       and not b.output_indices and 0 < sizes[b.id] <= self.on_chip_bytes}
        elif self.on_chip_heap:
            temp = [b for b in lr.buffers if start[b.id] >= 0 and b.parameter < 0 and not b.output_indices]
            device_peak = _peak([(start[b.id], end[b.id], sizes[b.id]) for b in temp if b.memory_space == 0])
            chip_peak = _peak([(start[b.id], end[b.id], sizes[b.id]) for b in temp
                               if b.memory_space == ON_CHIP_MEMORY_SPACE])
            if chip_peak > device_peak:
                spaces = (0, ON_CHIP_MEMORY_SPACE)
                for b in temp:
                    if b.memory_space == 0:
                        start[b.id] = -1

        diff = [0] * (n_steps + 1)
        hdiff = [0] * (n_steps + 1)
        for b in lr.buffers:
            s = start[b.id]
            if s < 0:
                continue
            if b.memory_space in spaces:
                diff[s] += sizes[b.id]
                diff[end[b.id] + 1] -= sizes[b.id]
            elif b.memory_space == HOST_MEMORY_SPACE:
                hdiff[s] += sizes[b.id]
                hdiff[end[b.id] + 1] -= sizes[b.id]
            else:
                start[b.id] = -1  # not in the timeline
        base = static + self.code_bytes
        if predicted_msa:
            # copies from host memory land in HBM (module docstring): counted there, not packed
            pinned = {bid for bid in movable if any(is_device_annotation(i) for i, _ in lr.buffers[bid].values)}
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
        live = []
        for b in lr.buffers:
            if b.memory_space in spaces and 0 <= start[b.id] <= peak_step <= end[b.id] and sizes[b.id]:
                by_cat[cats[b.id]] += sizes[b.id]
                live.append(b)
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
            counted_start=start, counted_end=end, absorbed=frozenset(absorbed),
            on_chip_timeline_bytes=on_chip_side,
        )


def msa_timeline(lr: LiveRanges, start: list[int], end: list[int], movable: set[int], hbm_bytes: list[int], *,
                 capacity_bytes: int, base_bytes: int = 0,
                 on_chip_only: list[tuple[int, int, int]] | tuple[()] = ()) -> list[int]:
    """Per step: libtpu's accounted bytes under the memory-space assignment model (module docstring).

    ``hbm_bytes`` is the timeline without the ``movable`` temporaries (``start``/``end`` are the
    counted ranges), ``base_bytes`` its constant part (static allocations, code); parameters and
    outputs are in it, and on the VMEM side too. ``on_chip_only`` are ``(start, end, bytes)`` of
    temporaries that cost nothing in HBM (inside output allocations) but fill VMEM like the
    movable ones.
    """
    hbm, vmem = msa_sides(lr, start, end, movable, hbm_bytes, capacity_bytes=capacity_bytes, base_bytes=base_bytes,
                          on_chip_only=on_chip_only)
    return [max(h, v) for h, v in zip(hbm, vmem)]


def msa_sides(lr: LiveRanges, start: list[int], end: list[int], movable: set[int], hbm_bytes: list[int], *,
              capacity_bytes: int, base_bytes: int = 0,
              on_chip_only: list[tuple[int, int, int]] | tuple[()] = (),
              on_chip_sizes: dict[int, int] | None = None,
              hbm_pinned: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
    """:func:`msa_timeline`'s two sides per step: ``fixed + HBM heap(t)`` and ``fixed + VMEM heap(t)``.
    ``on_chip_sizes`` gives a movable buffer's bytes in VMEM where its on-chip layout differs.
    ``hbm_pinned`` (a subset of ``movable``, already counted in ``hbm_bytes``) are the device
    copies of host values: on the VMEM side like the others, never packed off HBM, and their VMEM
    copies around their readers leave less room for the others (module docstring)."""
    n = len(lr.steps)
    sizes = lr.size_bytes
    chip = on_chip_sizes or {}
    mdiff = [0] * (n + 1)
    cdiff = [0] * (n + 1)
    fdiff = [0] * (n + 1)
    for b in lr.buffers:
        s = start[b.id]
        if s < 0 or b.memory_space != 0:
            continue
        if b.id in movable:
            if b.id not in hbm_pinned:
                mdiff[s] += sizes[b.id]
                mdiff[end[b.id] + 1] -= sizes[b.id]
            cdiff[s] += chip.get(b.id, sizes[b.id])
            cdiff[end[b.id] + 1] -= chip.get(b.id, sizes[b.id])
        elif b.parameter >= 0 or b.output_indices:
            fdiff[s] += sizes[b.id]
            fdiff[end[b.id] + 1] -= sizes[b.id]
    mov = list(accumulate(mdiff[:-1]))
    fixed = list(accumulate(fdiff[:-1]))
    for s, e, size in on_chip_only:
        cdiff[s] += size
        cdiff[e + 1] -= size
    on_chip_mov = list(accumulate(cdiff[:-1]))
    at = lr.aliasing.position_buffers
    # parameters prefetched into VMEM, from the compute step before their first reader to their last
    first, last, compute = prefetch_windows(lr)
    pdiff = [0] * (n + 1)
    for b, s in first.items():
        pdiff[s] += sizes[b]
        pdiff[last[b] + 1] -= sizes[b]
    prefetched = list(accumulate(pdiff[:-1]))

    # Memory-space assignment places whole buffers: at a step whose movable temporaries exceed
    # VMEM, what stays in HBM is what a largest-first placement cannot fit.
    born: list[list[int]] = [[] for _ in range(n + 1)]
    dies: list[list[int]] = [[] for _ in range(n + 1)]
    # VMEM copies of the pinned values (copies from host land in HBM; MSA prefetches them for
    # their readers), from the compute step before their first reader to their last: VMEM room
    # the movable temporaries cannot take
    first_read: dict[int, int] = {}
    if hbm_pinned:
        for t, inst in enumerate(lr.steps):
            if inst.opcode in FORWARDS:  # a forwarded buffer is read by the forwarder's readers
                continue
            for o in inst.operands:
                for bid in at.get(o, ()):
                    if bid in hbm_pinned and bid not in first_read and t > start[bid]:
                        first_read[bid] = t
    rdiff = [0] * (n + 1)
    for bid, t in first_read.items():
        k = bisect_left(compute, t)
        s = compute[k - 1] if k > 0 else 0
        rdiff[s] += sizes[bid]
        rdiff[end[bid] + 1] -= sizes[bid]
    reserved = list(accumulate(rdiff[:-1]))
    for bid in movable - hbm_pinned:
        born[start[bid]].append(sizes[bid])
        dies[end[bid] + 1].append(sizes[bid])
    live: Counter[int] = Counter()
    hbm_side, vmem_side = [], []
    for t in range(len(lr.steps)):
        for s in dies[t]:
            live[s] -= 1
            if not live[s]:
                del live[s]
        for s in born[t]:
            live[s] += 1
        room = max(0, capacity_bytes - reserved[t])
        spilled = mov[t] - packed_bytes(live, room) if mov[t] > room else 0
        hbm_side.append(hbm_bytes[t] + spilled)
        vmem_side.append(base_bytes + fixed[t] + min(capacity_bytes, on_chip_mov[t] + prefetched[t]))
    return hbm_side, vmem_side


def prefetch_windows(lr: LiveRanges) -> tuple[dict[int, int], dict[int, int], list[int]]:
    """Per parameter buffer id the steps its prefetched VMEM copy is live from and to, and the compute steps.

    MSA copies a parameter into VMEM once, overlapping the copy with the compute step before its
    first reader, and keeps that copy until its last reader. Readers are the materialized steps
    (a fused-away instruction's reads are its consumer's), counted from the first step of the
    multi-output fusion they join, and loops, which read the parameters they carry from their
    first step on (libtpu hoists what the body does to the whole array, e.g. the bf16 cast of
    stacked weights, out of the loop). A step reads the parameters behind its operands through
    the producers fused into it, tuples, and the module outputs it reads: libtpu fuses an output
    with its later readers into one multi-output fusion (the optimizer's moment and parameter
    updates are one), when the two have the same dims (the same iteration space).

    Fused-away producers chain across layers (a residual stream of fused adds), so a step can
    reach many instructions through them. Nothing here walks that chain once per step: the
    instructions a step reads through are the same for every reader, so the earliest and latest
    reading step are pushed from readers down to operands once, in topological order, and the
    module outputs a step reaches are gathered once per instruction (few: the optimizer's). Time
    and memory are linear in the instructions and operand edges, plus the output sets.
    """
    buffers = lr.buffers
    at = lr.aliasing.position_buffers
    held = [lr.start[b.id] >= 0 for b in buffers]  # materialized (not fused away, not a view)
    when = lr.time
    #: per instruction: 0 reads stop there (a parameter, collected; a materialized value), 1 a step
    #: reads through it (a tuple, a fused-away producer), 2 through it and joins its fusion (an output)
    kinds: dict[Instruction, int] = {}

    def kind(o: Instruction) -> int:
        k = kinds.get(o)
        if k is None:
            bids = at.get(o, ())
            if o.opcode == "parameter":
                k = 0
            elif o.opcode in ("tuple", "get-tuple-element") or not any(held[b] for b in bids):
                k = 1
            elif any(buffers[b].output_indices for b in bids):
                k = 2
            else:
                k = 0
            kinds[o] = k
        return k

    # the held module outputs behind each instruction read through (shared frozensets: most are empty)
    empty: frozenset[Instruction] = frozenset()
    outputs_behind: dict[Instruction, frozenset[Instruction]] = {}

    def behind(root: Instruction) -> frozenset[Instruction]:
        stack = [(root, False)]
        while stack:
            v, ready = stack.pop()
            if v in outputs_behind:
                continue
            if not ready:
                stack.append((v, True))
                stack.extend((o, False) for o in v.operands if kind(o) and o not in outputs_behind)
                continue
            parts = [outputs_behind[o] for o in v.operands if o in outputs_behind]
            parts = [x for x in parts if x]
            own = frozenset((v,)) if kinds[v] == 2 else empty
            if not parts:
                outputs_behind[v] = own
            elif len(parts) == 1 and not own:
                outputs_behind[v] = parts[0]
            else:
                outputs_behind[v] = own.union(*parts)
        return outputs_behind[root]

    # reading times per step: (earliest, latest) over its read entries
    group_first: dict[int, int] = {}  # step -> first step of its multi-output fusion
    window: dict[Instruction, tuple[int, int]] = {}
    compute: list[int] = []
    for t, inst in enumerate(lr.steps):
        lo = hi = None
        if inst.opcode == "while" and inst in lr.segments:
            lo = hi = lr.segments[inst][0]
        if inst.opcode not in _NO_PREFETCH and any(held[b] for b in at.get(inst, ())):
            g = t
            if inst.shape.is_array:
                dims = inst.shape.dims
                for o in inst.operands:
                    if kind(o):
                        for out in behind(o):
                            if out.shape.is_array and out.shape.dims == dims and out in when:
                                g = min(g, group_first.get(when[out], when[out]))
            group_first[t] = g
            lo = g if lo is None else min(lo, g)
            hi = t if hi is None else max(hi, t)
            compute.append(t)
        if lo is not None:
            window[inst] = (lo, hi)  # type: ignore[assignment]

    # push (earliest, latest) from the readers through what they read, users before operands
    low: dict[Instruction, int] = {}
    high: dict[Instruction, int] = {}

    def reach(o: Instruction, lo: int, hi: int) -> None:
        if o in low:
            if lo < low[o]:
                low[o] = lo
            if hi > high[o]:
                high[o] = hi
        else:
            low[o], high[o] = lo, hi

    for inst, (lo, hi) in window.items():
        for o in inst.operands:
            reach(o, lo, hi)
    # topological order (users first) of everything reached through expanding instructions
    order: list[Instruction] = []
    state: dict[Instruction, bool] = {}
    for root in list(low):
        if root in state:
            continue
        stack = [(root, False)]
        while stack:
            v, done = stack.pop()
            if done:
                order.append(v)
                continue
            if v in state:
                continue
            state[v] = True
            stack.append((v, True))
            if kind(v):
                stack.extend((o, False) for o in v.operands if o not in state)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for v in reversed(order):  # a postorder reversed: every user before its operands
        if v not in low:
            continue
        lo, hi = low[v], high[v]
        if v.opcode == "parameter":
            k = bisect_left(compute, lo)
            prev = compute[k - 1] if k > 0 else 0
            for b in at.get(v, ()):
                if buffers[b].parameter >= 0:
                    first[b] = min(first.get(b, prev), prev)
                    last[b] = max(last.get(b, hi), hi)
        elif kind(v):
            for o in v.operands:
                reach(o, lo, hi)
    return first, last, compute


def activation_minor_sizes(lr: LiveRanges, movable: set[int]) -> dict[int, int]:
    """VMEM bytes of the movable buffers libtpu lays out with batch and feature minor on chip
    (convolution results and the pooling windows over them:
    :func:`~hloopt.passes.fusion_model.activation_minor_dims`), where that layout is larger than
    the compact one they are counted at."""
    from hloopt.passes.fusion_model import activation_minor_dims, tpu_layout_bytes

    out: dict[int, int] = {}
    for bid in movable:
        for inst, index in lr.buffers[bid].values:
            if index:
                continue
            dims = activation_minor_dims(inst)
            if dims is not None:
                size = tpu_layout_bytes(inst.shape.element_type, inst.shape.dims, *dims)
                if size > lr.size_bytes[bid]:
                    out[bid] = max(out.get(bid, 0), size)
    return out


def packed_bytes(live: Counter[int], capacity_bytes: int) -> int:
    """Bytes of the live buffers (``{size: count}``) that fit ``capacity_bytes`` placed whole,
    largest first."""
    free = capacity_bytes
    for size in sorted(live, reverse=True):
        if 0 < size <= free:
            free -= min(live[size], free // size) * size
    return capacity_bytes - free


#: steps that move no data through the core (MSA prefetches nothing for them)
_NO_PREFETCH = frozenset({"while", "conditional", "call", "tuple", "get-tuple-element", "parameter",
                          "constant", "opt-barrier", "optimization-barrier"})


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


#: instructions that never write over their operand's buffer
_NO_OPERAND_SHARING = frozenset({"copy", "copy-start", "copy-done", "parameter", "constant", "while",
                                 "conditional", "call", "tuple", "get-tuple-element", "custom-call"})


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
    order.sort(key=lambda b: (-sizes[b.id], not b.output_indices, start[b.id], b.id))
    #: allocation index -> (size, [(start, end, buffer id)]); per buffer id, its allocation
    allocs: list[tuple[int, list[tuple[int, int, int]]]] = []
    alloc_of: dict[int, int] = {}
    # per allocation its output's live range: a temporary whose range crosses it (not only
    # touching an end) cannot go there, so the smallest-first search skips those allocations
    # without looking at what else each holds (training steps have thousands of outputs)
    n_out = sum(1 for b in order if b.output_indices and not b.is_tuple_table)
    out_start = np.empty(n_out, dtype=np.int64)
    out_end = np.empty(n_out, dtype=np.int64)
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

    def fits(k: int, b: Buffer) -> bool:
        size, ranges = allocs[k]
        if sizes[b.id] > size:
            return False
        s, e = start[b.id], end[b.id]
        for s2, e2, other in ranges:
            if e < s2 or e2 < s:
                continue
            if e == s2 and shares_operand(other, b.id) or e2 == s and shares_operand(b.id, other):
                continue
            return False
        return True

    for b in order:
        if b.output_indices and not b.is_tuple_table:
            out_start[len(allocs)], out_end[len(allocs)] = start[b.id], end[b.id]
            alloc_of[b.id] = len(allocs)
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
            s, e, m = start[b.id], end[b.id], len(allocs)
            open_ = np.flatnonzero((out_start[:m] >= e) | (out_end[:m] <= s))
            chosen = next((int(k) for k in open_[::-1] if fits(int(k), b)), None)
        if chosen is not None:
            allocs[chosen][1].append((start[b.id], end[b.id], b.id))
            alloc_of[b.id] = chosen
            absorbed.add(b.id)
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


__all__ = ["BufferInfo", "CATEGORIES", "MemoryProfile", "ON_CHIP_MEMORY_SPACE", "PeakMemory", "categorize",
           "msa_sides", "msa_timeline", "output_allocation_reuse", "packed_bytes", "prefetch_windows"]
