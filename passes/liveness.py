"""Live ranges of buffers over a flattened schedule (XLA's HloLiveRange, simplified).

The schedule of the module is *flattened* into one sequence of steps: the entry computation's
sequence where each ``while``/``conditional``/``call`` is preceded by the sequences of its callees
(condition, then body; each branch in turn). A step is one instruction; its time is its position
in the flat sequence. A callee is flattened once (its first call site), as XLA does, so a while
body stands for one iteration, and the peak inside a callee is the peak at its call site.

A buffer's live range is the closed interval [start, end] of steps:

* start: the earliest step of a position holding it (its defining instruction; for loop state
  the init value's definition); entry parameters start at step 0;
* end: the latest step that holds or reads it (a user of any of its positions; the while
  instruction for loop state); entry outputs and entry parameters end at the last step.

::

    step:          0    1    2    3    4    5    6 (root)
    param p        [==============================]   parameters: whole program
    a = f(p)            [=========]                   a: defined at 1, last read at 3
    b = g(a)                 [====]                   b and a overlap at 2 and 3
    c = h(a, b)                   [=====]             an operand and its user's result
    out = k(c)                          [=========]   outputs: until the end
                       (a value being read and the value being written are both counted
                        at the step: the no-sharing bound, which XLA's live-range dump uses)

A pre-optimization module has no fusions and no layouts. Given a model of what the target compiler
will make of it (``fusion``: an analysis whose result is a :class:`Materialization`, such as the
TPU compiler model's ``hloopt.passes.tpu.TpuFusion()``), instructions the model fuses into their
consumers hold no buffer: their readers read the fused instruction's inputs instead, so the inputs
live until the last reader of anything fused from them; and each buffer takes the bytes the model
gives it (tiled, per device, in its storage type). Liveness knows nothing of any compiler: without
a model every instruction materializes at its shape's size.

Invariants: start <= end for every buffer; a buffer is live at every step between the definition
and each use of each of its positions; the flat sequence contains each instruction of every
visited computation exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, ClassVar, Iterator, Protocol

from hloopt.ir import Computation, Instruction, Module, gc_paused
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.aliasing import Aliasing, Buffer, BufferAliasing
from hloopt.passes.opcodes import BARRIERS, CONTROL_FLOW, TUPLE_OPS
from hloopt.passes.schedule import Schedule


class Materialization(Protocol):
    """What a compiler model says of a pre-optimization module (the result of ``Liveness.fusion``)."""

    #: instructions that hold no buffer (fused into their readers)
    fused: frozenset[Instruction]

    def buffer_bytes(self, buffer: Buffer) -> int:
        """Bytes the compiler gives ``buffer`` (its layout, shard and storage type)."""
        ...

#: readers that only forward storage: their own positions are in the same buffer and carry the
#: range on through their readers, so they do not read the operand themselves
FORWARDS = TUPLE_OPS | BARRIERS | CONTROL_FLOW | {"bitcast", "domain"}



@dataclass(frozen=True, slots=True)
class LiveRange:
    """One buffer's live interval over the flat schedule."""

    buffer: Buffer
    start: int
    end: int

    @property
    def size_bytes(self) -> int:
        return self.buffer.size_bytes


@dataclass(eq=False)
class LiveRanges:
    """Result of :class:`Liveness`."""

    module: Module
    aliasing: Aliasing
    #: the flat schedule: one instruction per step
    steps: list[Instruction]
    #: step of each scheduled instruction
    time: dict[Instruction, int]
    #: per buffer id: first and last live step (-1 for buffers that hold nothing, e.g. fused away)
    start: list[int]
    end: list[int]
    #: per buffer id: bytes counted (0 for fused-away positions)
    size_bytes: list[int]
    #: per step: the entry-computation instruction index it belongs to (callee steps map to
    #: their call site)
    entry_step: list[int]
    #: control-flow instruction -> (first, last) step of its callees' flattened sequences
    segments: dict[Instruction, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def buffers(self) -> list[Buffer]:
        return self.aliasing.buffers

    def ranges(self) -> Iterator[LiveRange]:
        """Every buffer that holds bytes, with its interval."""
        for b in self.aliasing.buffers:
            if self.start[b.id] >= 0 and self.size_bytes[b.id] > 0:
                yield LiveRange(b, self.start[b.id], self.end[b.id])

    def live_at(self, step: int) -> list[LiveRange]:
        return [r for r in self.ranges() if r.start <= step <= r.end]

    def bytes_per_step(self, *, memory_space: int = 0) -> list[int]:
        """Bytes live at each step in one memory space (0: device, 5: host)."""
        diff = [0] * (len(self.steps) + 1)
        for b in self.aliasing.buffers:
            s = self.start[b.id]
            if s < 0 or b.memory_space != memory_space:
                continue
            size = self.size_bytes[b.id]
            diff[s] += size
            diff[self.end[b.id] + 1] -= size
        return list(accumulate(diff[:-1]))

    def entry_timeline(self, per_step: list[int]) -> list[int]:
        """Fold a per-step series onto entry steps: the max over each call site's callees."""
        entry = self.module.entry
        out = [0] * (len(entry.instructions) if entry is not None else 0)
        for t, v in enumerate(per_step):
            e = self.entry_step[t]
            if v > out[e]:
                out[e] = v
        return out

@dataclass(frozen=True)
class Liveness(Analysis[LiveRanges]):
    """Live range of every buffer over the flattened schedule (see the module docstring)."""

    name: ClassVar[str] = "liveness"
    #: "module" (text order = the schedule of a scheduled module) or "list" (memory-aware)
    schedule: str = "module"
    #: the target compiler's model of fusion and buffer sizes (an analysis whose result is a
    #: :class:`Materialization`); None: every instruction materializes at its shape's size
    fusion: Analysis[Any] | None = None
    #: round every buffer up to this many bytes (TPU allocates HBM in 512-byte units: an index
    #: table of a few pointers takes 512 bytes); 0 = exact sizes
    alignment_bytes: int = 0

    def run(self, module: Module, am: AnalysisManager) -> LiveRanges:
        with gc_paused():
            return self._run(module, am)

    def _run(self, module: Module, am: AnalysisManager) -> LiveRanges:
        from hloopt.errors import UserError

        aliasing = am.get(BufferAliasing())
        sched = am.get(Schedule(kind=self.schedule))
        entry = module.entry
        if entry is None:
            raise UserError(f"module {module.name} has no entry computation")

        steps: list[Instruction] = []
        entry_step: list[int] = []
        segments: dict[Instruction, tuple[int, int]] = {}
        flattened: set[Computation] = set()

        def flatten(comp: Computation, site: int | None) -> None:
            flattened.add(comp)
            for k, inst in enumerate(sched.sequence(comp)):
                here = k if site is None else site
                if inst.opcode in CONTROL_FLOW:
                    first = len(steps)
                    callees = inst.called.get("condition", []) + inst.called.get("body", []) + \
                        inst.called.get("branch_computations", []) + inst.called.get("calls", []) + \
                        (inst.called.get("to_apply", []) if inst.opcode == "call" else [])
                    for callee in callees:
                        if callee not in flattened:
                            flatten(callee, here)
                    if len(steps) > first:
                        segments[inst] = (first, len(steps) - 1)
                steps.append(inst)
                entry_step.append(here)

        flatten(entry, None)
        time = {inst: t for t, inst in enumerate(steps)}
        last = len(steps) - 1

        plan: Materialization | None = am.get(self.fusion) if self.fusion is not None else None
        fused = plan.fused if plan is not None else frozenset()
        views = storage_views(steps)
        fused = fused | views
        # Last step reading each instruction; a fused-away reader reads on behalf of its readers.
        last_read: dict[Instruction, int] = {}
        for inst in reversed(steps):
            t = time[inst]
            lr = t
            for u in inst.users:
                tu = time.get(u)
                if tu is None or (u.opcode in FORWARDS and u not in views):
                    continue  # a forwarding reader's reads count on its buffer, the same one
                if u in fused:
                    tu = max(tu, last_read.get(u, tu))
                if tu > lr:
                    lr = tu
            last_read[inst] = lr

        n = len(aliasing.buffers)
        start = [-1] * n
        end = [-1] * n
        for inst, bids in aliasing.position_buffers.items():
            at = time.get(inst)
            if at is None or inst in fused:
                continue
            e = last_read[inst]
            for b in bids:
                if start[b] < 0 or at < start[b]:
                    start[b] = at
                if e > end[b]:
                    end[b] = e
            if inst.opcode == "get-tuple-element" and inst.operands:
                # reading an element reads the operand's index table
                b = aliasing.position_buffers.get(inst.operands[0], (None,))[0]
                if b is not None and at > end[b]:
                    end[b] = at
        sizes = [0] * n
        for b in aliasing.buffers:
            if start[b.id] < 0:
                continue
            size = plan.buffer_bytes(b) if plan is not None else b.size_bytes
            if self.alignment_bytes > 1 and size:
                size = -(-size // self.alignment_bytes) * self.alignment_bytes
            sizes[b.id] = size
            if b.parameter >= 0:
                start[b.id] = 0
                end[b.id] = last
            if b.output_indices:
                end[b.id] = last
        return LiveRanges(module, aliasing, steps, time, start, end, sizes, entry_step, segments)


#: libtpu custom-calls whose result is a view of their operands' storage: ``ConcatBitcast``
#: concatenates operands that buffer assignment placed side by side
_VIEW_TARGETS = frozenset({"ConcatBitcast"})


def storage_views(steps: list[Instruction]) -> frozenset[Instruction]:
    """Instructions that hold no storage of their own: their readers read their operands. A
    bitcast of such a view is one too (libtpu's compiled BERT reads a ``ConcatBitcast`` of four
    prefetched weight slices through bitcasts: the slices' VMEM, not a fifth buffer)."""
    out: set[Instruction] = set()
    for i in steps:
        if (i.opcode == "custom-call" and i.custom_call_target in _VIEW_TARGETS) \
                or (i.opcode == "bitcast" and i.operands and i.operands[0] in out):
            out.add(i)
    return frozenset(out)


__all__ = ["LiveRange", "LiveRanges", "Liveness", "Materialization", "storage_views"]
