"""An entry-level liveness approximation of device memory, for reports until the memory model lands.

Algorithm: walk the scheduled entry computation; every instruction that does not alias its operand
(``bitcast``, ``get-tuple-element``, ``tuple``, ``while``, ``copy-done``... do) defines one buffer
per array leaf of its shape; a buffer lives from its defining step to the last step that reads it
through any alias; parameters live from step 0, buffers reachable from the root to the end. Leaves in
host memory (``S(5)``) are listed apart and never counted as device bytes.

It is deliberately simple: loop bodies and fusion temporaries are not looked into, so it
under-counts XLA's peak. :mod:`hloopt.passes.memory` is the real model; this exists so reports and
diffs can be built and tested against snapshots before it is wired in.

Invariant: ``timeline_by_category`` sums, at every step, to the bytes of the device buffers live at
that step, and ``peak_bytes == max(total)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from hloopt.ir import Instruction, Module, Shape

#: Opcodes whose result is (part of) an operand's buffer, not a new allocation.
_ALIASING = {"bitcast", "get-tuple-element", "tuple", "while", "optimization-barrier", "copy-done",
             "conditional", "call"}


@dataclass(frozen=True)
class ApproxBuffer:
    name: str
    shape: str
    bytes: int
    category: str
    defined: int
    last_use: int
    on_host: bool
    op_name: str
    source: str


@dataclass(frozen=True)
class ApproxMemory:
    """Per-step device bytes by category and the buffers behind them."""

    step_labels: tuple[str, ...]
    timeline_by_category: Mapping[str, Sequence[int]]
    peak_step: int
    peak_bytes: int
    buffers: tuple[ApproxBuffer, ...]

    def live_at(self, step: int) -> list[ApproxBuffer]:
        """Device buffers live at ``step``, largest first."""
        out = [b for b in self.buffers if not b.on_host and b.defined <= step <= b.last_use]
        return sorted(out, key=lambda b: (-b.bytes, b.name))

    @property
    def host_buffers(self) -> list[ApproxBuffer]:
        return sorted((b for b in self.buffers if b.on_host), key=lambda b: (-b.bytes, b.name))


def approximate_memory(module: Module) -> ApproxMemory:
    """Entry-level liveness of ``module`` (see the module docstring)."""
    entry = module.entry
    if entry is None:
        raise ValueError(f"module {module.name} has no entry computation")
    insts = entry.instructions
    step_of = {id(inst): i for i, inst in enumerate(insts)}
    n = len(insts)

    # buffer id -> [inst, index, shape, defined, last_use]
    buffers: list[list] = []
    by_def: dict[tuple[int, tuple[int, ...]], int] = {}

    def source(inst: Instruction, index: tuple[int, ...]) -> int | None:
        op = inst.opcode
        if op == "get-tuple-element" and inst.operands:
            return source(inst.operands[0], (inst.tuple_index, *index))
        if op == "tuple" and index:
            return source(inst.operands[index[0]], index[1:]) if index[0] < len(inst.operands) else None
        if op in ("bitcast", "while", "optimization-barrier") and inst.operands:
            return source(inst.operands[0], index)
        if op == "copy-done" and inst.operands:
            return source(inst.operands[0], (0, *index))
        if op.endswith("-done") and inst.operands:
            return source(inst.operands[0], (1, *index))
        if op == "copy-start" and index[:1] == (1,):
            return source(inst.operands[0], index[1:])
        if op.endswith("-start") and op != "copy-start" and index[:1] == (0,) and len(index) >= 2:
            return source(inst.operands[index[1]], index[2:])
        return by_def.get((id(inst), index))

    def leaves(shape: Shape) -> list[tuple[tuple[int, ...], Shape]]:
        return list(shape.leaves()) if shape.is_tuple else [((), shape)]

    for step, inst in enumerate(insts):
        if inst.opcode in _ALIASING:
            continue
        for index, leaf in leaves(inst.shape):
            if inst.opcode == "copy-start" and index[:1] == (1,):
                continue
            if inst.opcode.endswith("-start") and index[:1] == (0,) and inst.opcode != "copy-start":
                continue
            if not leaf.is_array:
                continue
            by_def[(id(inst), index)] = len(buffers)
            start = 0 if inst.opcode == "parameter" else step
            buffers.append([inst, index, leaf, start, step])

    def touch(inst: Instruction, step: int) -> None:
        for index, _ in leaves(inst.shape):
            b = source(inst, index)
            if b is not None and buffers[b][4] < step:
                buffers[b][4] = step

    for step, inst in enumerate(insts):
        for operand in inst.operands:
            if id(operand) in step_of:
                touch(operand, step)
    outputs: set[int] = set()
    if entry.root is not None:
        for index, _ in leaves(entry.root.shape):
            b = source(entry.root, index)
            if b is not None:
                outputs.add(b)
                buffers[b][4] = n - 1

    cats = ("parameter", "output", "temporary")
    series = {c: [0] * (n + 1) for c in cats}
    result: list[ApproxBuffer] = []
    for i, (inst, index, leaf, start, end) in enumerate(buffers):
        cat = "parameter" if inst.opcode == "parameter" else "output" if i in outputs else "temporary"
        src = module.source_of(inst)
        name = inst.name + ("" if not index else "{" + ",".join(map(str, index)) + "}")
        buf = ApproxBuffer(name=name, shape=leaf.to_text(layout=False), bytes=leaf.byte_size,
                           category=cat, defined=start, last_use=end, on_host=leaf.on_host,
                           op_name=inst.metadata.op_name, source=f"{src[0]}:{src[1]}" if src else "")
        result.append(buf)
        if not buf.on_host:
            series[cat][start] += buf.bytes
            series[cat][end + 1] -= buf.bytes
    timeline: dict[str, list[int]] = {}
    for c in cats:
        acc, vals = 0, []
        for d in series[c][:n]:
            acc += d
            vals.append(acc)
        timeline[c] = vals
    total = [sum(timeline[c][i] for c in cats) for i in range(n)]
    peak_step = max(range(n), key=lambda i: (total[i], -i)) if n else 0
    return ApproxMemory(step_labels=tuple(inst.name for inst in insts), timeline_by_category=timeline,
                        peak_step=peak_step, peak_bytes=total[peak_step] if n else 0,
                        buffers=tuple(result))


def report_data_from_module(module: Module, device: Mapping[str, object], *, budget_bytes: int | None = None,
                            top: int = 50, memory: ApproxMemory | None = None):
    """A baseline-only :class:`~hloopt.report.ReportData` for ``module`` (no plan, no residuals)."""
    from hloopt.report import LiveBuffer, ReportData, mesh_of

    mem = memory if memory is not None else approximate_memory(module)
    live = [LiveBuffer(name=b.name, shape=b.shape, bytes=b.bytes, category=b.category, op_name=b.op_name,
                       source=b.source) for b in mem.live_at(mem.peak_step)[:top]]
    shardings = [i.sharding for i in module.instructions() if i.sharding]
    return ReportData(
        module_name=module.name, device=dict(device), budget_bytes=budget_bytes,
        step_labels=mem.step_labels, baseline_by_category=mem.timeline_by_category,
        baseline_peak_step=mem.peak_step, baseline_peak_bytes=mem.peak_bytes, live_at_peak=tuple(live),
        assumptions={"memory model": "entry-level liveness approximation (loop bodies not looked into)",
                     "schedule": "entry computation in text order"
                     + (" (scheduled module)" if module.is_scheduled else "")},
        num_partitions=module.num_partitions, mesh=mesh_of(shardings, module.num_partitions),
    ).validate()
