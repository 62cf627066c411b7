"""What ``hloopt inspect`` shows: a summary of one parsed module (counts, bytes, offload, sharding).

:func:`summarize` walks the module once. Counts are over every computation (fusion bodies
included) unless the name says ``entry_``. Byte figures use :attr:`Shape.total_byte_size`
(layout-aware: tiles, ``E(n)``). Offload facts are what XLA's host-offloading passes read or
write: ``custom-call`` ``annotate_device_placement`` with ``_xla_buffer_placement`` (before the
passes), shapes in memory space ``S(5)`` and ``copy-start``/``copy-done`` pairs (after them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from hloopt.ir import HOST_MEMORY_SPACE, Module


@dataclass(frozen=True)
class ModuleSummary:
    """Facts about one module; ``to_dict()`` is the JSON that ``hloopt inspect --json`` prints."""

    module: str
    filename: str
    computations: int
    #: Computations called by a fusion instruction.
    fused_computations: int
    instructions: int
    entry_instructions: int
    #: opcode -> count over all computations, most frequent first.
    opcodes: dict[str, int]
    entry_parameters: int
    #: Entry parameter bytes in device memory / in host memory (``S(5)``).
    parameter_bytes: int
    host_parameter_bytes: int
    #: Bytes of the entry root's leaves.
    output_bytes: int
    fusions: int
    #: ``annotate_device_placement`` custom-calls by ``_xla_buffer_placement`` value.
    placement_annotations: dict[str, int]
    #: Instructions whose shape (any leaf) lives in host memory space S(5).
    host_memory_instructions: int
    copy_starts: int
    copy_dones: int
    #: Instructions with a ``sharding`` attribute.
    sharded_instructions: int
    num_partitions: int
    replica_count: int
    is_scheduled: bool
    entry_computation: str = ""
    #: Opcodes hloopt does not know -> count (parsed generically: a value of the instruction's
    #: shape, no flops; see :mod:`hloopt.hlo.checks`). Empty when every opcode is known.
    unknown_opcodes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        return d


def summarize(mod: Module) -> ModuleSummary:
    """Count what :class:`ModuleSummary` reports, in one pass over the module."""
    opcodes: Counter[str] = Counter()
    placements: Counter[str] = Counter()
    unknown: Counter[str] = Counter()
    host_insts = sharded = 0
    fused: set[str] = set()
    for comp in mod.computations.values():
        for inst in comp.instructions:
            op = inst.opcode
            opcodes[op] += 1
            if inst.is_unknown:
                unknown[op] += 1
            if op == "fusion":
                for c in inst.called_computations:
                    fused.add(c.name)
            elif op == "custom-call" and inst.custom_call_target == "annotate_device_placement":
                placements[inst.frontend_attributes.get("_xla_buffer_placement", "")] += 1
            if "sharding" in inst.attrs:
                sharded += 1
            shape = inst.shape
            if shape.is_tuple:
                if any(s.memory_space == HOST_MEMORY_SPACE for _, s in shape.leaves()):
                    host_insts += 1
            elif shape.layout is not None and shape.layout.memory_space == HOST_MEMORY_SPACE:
                host_insts += 1
    entry = mod.entry
    assert entry is not None and entry.root is not None
    params = entry.parameters
    dev_bytes = sum(p.shape.total_byte_size for p in params if not p.shape.on_host)
    host_bytes = sum(p.shape.total_byte_size for p in params if p.shape.on_host)
    rc = mod.header_attrs.get("replica_count", "1")
    return ModuleSummary(
        module=mod.name,
        filename=mod.filename,
        computations=len(mod.computations),
        fused_computations=len(fused),
        instructions=sum(opcodes.values()),
        entry_instructions=len(entry.instructions),
        opcodes=dict(sorted(opcodes.items(), key=lambda kv: (-kv[1], kv[0]))),
        entry_parameters=len(params),
        parameter_bytes=dev_bytes,
        host_parameter_bytes=host_bytes,
        output_bytes=entry.root.shape.total_byte_size,
        fusions=opcodes.get("fusion", 0),
        placement_annotations=dict(sorted(placements.items())),
        host_memory_instructions=host_insts,
        copy_starts=opcodes.get("copy-start", 0),
        copy_dones=opcodes.get("copy-done", 0),
        sharded_instructions=sharded,
        num_partitions=mod.num_partitions,
        replica_count=int(rc) if rc.isdecimal() else 1,
        is_scheduled=mod.is_scheduled,
        entry_computation=entry.name,
        unknown_opcodes=dict(sorted(unknown.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


__all__ = ["ModuleSummary", "summarize"]
