"""The order instructions run in: the module's own schedule, text order, or a memory-aware list schedule.

* ``"module"``: each computation's text order. For a scheduled module (``is_scheduled=true``, what
  XLA prints after optimization) this *is* the schedule XLA executes; for a pre-optimization
  module it is the order JAX emitted, usually close to program order.
* ``"list"``: a greedy list scheduler in the spirit of XLA's ``ListMemoryScheduler``, for
  pre-optimization modules: among ready instructions pick the one that frees the most device
  bytes minus the device bytes it defines (ties: text order; a value in host memory, ``S(5)``,
  defines none, so an offload runs as soon as it can). Priorities only change when another user of an operand
  is scheduled: a popped instruction whose priority went stale is pushed back (lazy heap), and
  when a value is down to its last reader, that reader, if ready, is pushed again with the better
  priority (each value once): O(n log n) overall.

``in_schedule_order(module, schedule)`` is the transform that writes a schedule down: a new
module whose computations list their instructions in the schedule's order, so that its text
order (``"module"``) is that schedule. The memory model and the planner count one module that
way (:func:`hloopt.analysis.prepare_for_profile`): their steps are the same instructions in the
same order, and a residual's position is its step.

Invariant: every sequence is a topological order of operands and control predecessors that
contains each instruction of its computation exactly once.
"""

from __future__ import annotations

import heapq
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import ClassVar

from hloopt.errors import UserError
from hloopt.ir import Computation, Instruction, Module
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.opcodes import BARRIERS, TUPLE_OPS

KINDS: tuple[str, ...] = ("module", "list")

#: opcodes that allocate nothing of their own (they forward an operand's storage)
_FORWARDING = TUPLE_OPS | BARRIERS | {"bitcast", "domain", "add-dependency", "parameter"}


@dataclass(frozen=True)
class ScheduleResult:
    """A sequence of instructions per computation."""

    kind: str
    sequences: dict[Computation, list[Instruction]]

    def sequence(self, comp: Computation) -> list[Instruction]:
        return self.sequences.get(comp) or comp.instructions


@dataclass(frozen=True)
class Schedule(Analysis[ScheduleResult]):
    """Order the instructions of every computation (see the module docstring)."""

    name: ClassVar[str] = "schedule"
    kind: str = "module"

    def run(self, module: Module, am: AnalysisManager) -> ScheduleResult:
        if self.kind not in KINDS:
            raise UserError(f"unknown schedule {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.kind == "module":
            return ScheduleResult("module", {c: c.instructions for c in module.computations.values()})
        return ScheduleResult("list", {c: list_schedule(c) for c in module.computations.values()})


def in_schedule_order(module: Module, schedule: ScheduleResult, *, owned: bool = False) -> Module:
    """A new module whose computations' instructions are in ``schedule``'s order (the input is
    not changed, unless ``owned``: the caller has just built ``module`` and nothing else holds it,
    and it is reordered where it is, :func:`hloopt.passes.inline.reordered`). Scheduling it with
    ``"module"`` gives ``schedule``'s sequences back."""
    from hloopt.passes.inline import reordered

    return reordered(module, schedule.sequences, owned=owned)


def list_schedule(comp: Computation, fused: AbstractSet[Instruction] = frozenset()) -> list[Instruction]:
    """Greedy memory-aware topological order of ``comp`` (see the module docstring).

    ``fused``: instructions the target compiler computes inside their readers (its fusion
    model's): they define no storage, and the values they read are read in storage by the
    materialized instructions they are fused into, so an operand is freed by its last
    materialized reader. Without it an elementwise chain that ends in a small reduction looks
    like a run of large allocations, and the scheduler puts it, and the large value it frees,
    after everything else (a loss whose logits stay live through the backward loop)."""
    insts = comp.instructions
    n = len(insts)
    # Instructions are numbered by text position (also the tie-break); everything below is
    # indexed by that number.
    pos = {inst: i for i, inst in enumerate(insts)}
    root = pos.get(comp.root, -1) if comp.root is not None else -1
    #: bytes each instruction defines (0 for one that forwards its operand's storage)
    #: (device bytes: a value placed in host memory, an offload, costs none and frees its operand)
    is_fused = [inst in fused for inst in insts] if fused else [False] * n
    any_fused = any(is_fused)
    size = [0 if f or inst.opcode in _FORWARDING or inst.shape.on_host else inst.shape.total_byte_size
            for inst, f in zip(insts, is_fused)]
    #: distinct operands in this computation, in operand order
    operands: list[list[int]] = []
    remaining_uses = [0] * n
    deps_left = [0] * n
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, inst in enumerate(insts):
        inst_ops = inst.operands
        n_ops = len(inst_ops)
        if n_ops == 0:
            ops = []
        elif n_ops == 1:  # no duplicates to drop
            k = pos.get(inst_ops[0])
            ops = [] if k is None else [k]
        elif n_ops == 2:  # dict.fromkeys below, written out: distinct, in operand order
            k, k2 = pos.get(inst_ops[0]), pos.get(inst_ops[1])
            if k is None:
                ops = [] if k2 is None else [k2]
            else:
                ops = [k] if k2 is None or k2 == k else [k, k2]
        else:
            ops = list(dict.fromkeys(k for o in inst_ops if (k := pos.get(o)) is not None))
        operands.append(ops)
        if inst.control_predecessors:
            preds = dict.fromkeys(ops)
            preds.update(dict.fromkeys(k for p in inst.control_predecessors if (k := pos.get(p)) is not None))
            deps_left[i] = len(preds)
            for p in preds:
                succs[p].append(i)
        else:
            deps_left[i] = len(ops)
            for p in ops:
                succs[p].append(i)
        for o in ops:
            remaining_uses[o] += 1
    if any_fused:
        operands, remaining_uses = _storage_operands(insts, operands, is_fused)

    def priority(i: int) -> int:
        freed = 0
        for o in operands[i]:
            if remaining_uses[o] == 1 and o != root:
                freed += size[o]
        return size[i] - freed  # smaller is better

    #: per value, the instructions that read it (in storage): when all but one of them have run,
    #: the last one frees it, and its priority improves
    readers: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for o in operands[i]:
            readers[o].append(i)

    heap = [(priority(i), i) for i in range(n) if deps_left[i] == 0]
    heapq.heapify(heap)
    out: list[Instruction] = []
    done = [False] * n
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        pri, i = pop(heap)
        if done[i]:
            continue
        now = size[i]  # priority(i), written out: once per pop
        for o in operands[i]:
            if remaining_uses[o] == 1 and o != root:
                now -= size[o]
        if now != pri:
            push(heap, (now, i))
            continue
        done[i] = True
        out.append(insts[i])
        for o in operands[i]:
            remaining_uses[o] -= 1
            if remaining_uses[o] == 1 and size[o] and o != root:
                # the last reader of o now frees it: an entry already in the heap holds its older,
                # worse priority, which the staleness check above only ever raises
                for r in readers[o]:
                    if not done[r] and deps_left[r] == 0:
                        push(heap, (priority(r), r))
        for j in succs[i]:
            deps_left[j] -= 1
            if deps_left[j] == 0:
                push(heap, (priority(j), j))
    if len(out) != n:
        raise UserError(f"computation {comp.name} has a cycle: cannot schedule it")
    return out


def _storage_operands(insts: list[Instruction], operands: list[list[int]],
                      is_fused: list[bool]) -> tuple[list[list[int]], list[int]]:
    """Per instruction, the materialized values it frees when it runs, and per value how many
    materialized readers read it in storage: a fused instruction frees nothing (its reads are
    its readers'), a materialized one reads what its fused operands read, through chains of them."""
    # in text order (operands come first); each an ordered set, shared, never changed once made:
    # a fused instruction with one fused operand reads exactly what that operand reads
    reads: list[dict[int, None]] = []
    for i in range(len(insts)):
        ops = operands[i]
        if len(ops) == 1:
            o = ops[0]
            reads.append(reads[o] if is_fused[o] else {o: None})
            continue
        acc: dict[int, None] = {}
        for o in ops:
            if is_fused[o]:
                acc.update(reads[o])
            else:
                acc[o] = None
        reads.append(acc)
    storage: list[list[int]] = []
    uses = [0] * len(insts)
    for i in range(len(insts)):
        if is_fused[i]:
            storage.append([])
        else:
            r = list(reads[i])
            storage.append(r)
            for o in r:
                uses[o] += 1
    return storage, uses


__all__ = ["KINDS", "Schedule", "ScheduleResult", "in_schedule_order", "list_schedule"]
