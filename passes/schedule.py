"""The order instructions run in: the module's own schedule, text order, or a memory-aware list schedule.

* ``"module"``: each computation's text order. For a scheduled module (``is_scheduled=true``, what
  XLA prints after optimization) this *is* the schedule XLA executes; for a pre-optimization
  module it is the order JAX emitted, usually close to program order.
* ``"list"``: a greedy list scheduler in the spirit of XLA's ``ListMemoryScheduler``, for
  pre-optimization modules: among ready instructions pick the one that frees the most bytes minus
  the bytes it defines (ties: text order). Priorities only change when another user of an operand
  is scheduled, so a popped instruction whose priority went stale is pushed back (lazy heap):
  O(n log n) overall.

Invariant: every sequence is a topological order of operands and control predecessors that
contains each instruction of its computation exactly once.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from hloopt.errors import UserError
from hloopt.ir import Computation, Instruction, Module
from hloopt.passes import Analysis, AnalysisManager

KINDS: tuple[str, ...] = ("module", "list")

#: opcodes that allocate nothing of their own (they forward an operand's storage)
_FORWARDING = frozenset({"get-tuple-element", "tuple", "bitcast", "opt-barrier", "domain",
                         "add-dependency", "parameter"})


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


def list_schedule(comp: Computation) -> list[Instruction]:
    """Greedy memory-aware topological order of ``comp`` (see the module docstring)."""
    insts = comp.instructions
    pos = {inst: i for i, inst in enumerate(insts)}
    remaining_uses: dict[Instruction, int] = {}
    deps_left: dict[Instruction, int] = {}
    succs: dict[Instruction, list[Instruction]] = {inst: [] for inst in insts}
    for inst in insts:
        preds = dict.fromkeys(o for o in inst.operands if o in pos)
        preds.update(dict.fromkeys(p for p in inst.control_predecessors if p in pos))
        deps_left[inst] = len(preds)
        for p in preds:
            succs[p].append(inst)
        for o in dict.fromkeys(inst.operands):
            if o in pos:
                remaining_uses[o] = remaining_uses.get(o, 0) + 1

    def size(inst: Instruction) -> int:
        return 0 if inst.opcode in _FORWARDING else inst.shape.total_byte_size

    def priority(inst: Instruction) -> int:
        freed = sum(size(o) for o in dict.fromkeys(inst.operands)
                    if o in pos and remaining_uses[o] == 1 and o is not comp.root)
        return size(inst) - freed  # smaller is better

    heap: list[tuple[int, int, Instruction]] = []
    for inst in insts:
        if deps_left[inst] == 0:
            heapq.heappush(heap, (priority(inst), pos[inst], inst))
    out: list[Instruction] = []
    done: set[Instruction] = set()
    while heap:
        pri, i, inst = heapq.heappop(heap)
        if inst in done:
            continue
        now = priority(inst)
        if now != pri:
            heapq.heappush(heap, (now, i, inst))
            continue
        done.add(inst)
        out.append(inst)
        for o in dict.fromkeys(inst.operands):
            if o in pos:
                remaining_uses[o] -= 1
        for s in succs[inst]:
            deps_left[s] -= 1
            if deps_left[s] == 0:
                heapq.heappush(heap, (priority(s), pos[s], s))
    if len(out) != len(insts):
        raise UserError(f"computation {comp.name} has a cycle: cannot schedule it")
    return out


__all__ = ["KINDS", "Schedule", "ScheduleResult", "list_schedule"]
