"""``hloopt diff A B``: what changed in device memory between two programs or two plans.

Each side is an HLO module file (or XLA dump / TARGET that resolves to one) or a plan file
(``hloopt.plan/1`` JSON). A side is reduced to a :class:`Side`: the peak, bytes by category at the
peak, the buffers live at the peak, the buffers placed in host memory (``S(5)``), and for plans the
decision per residual. :func:`diff_sides` compares two Sides.

Buffers of two different compiles have different instruction names, so a buffer's identity is
its ``op_name`` metadata (the JAX operation that made it; empty when there is none, since
instruction names are not stable) and its logical shape (element type and dims, no layout). Matching is a
multiset match on that
identity; unmatched buffers with the same op_name but another shape are *resized*, the rest
*added* / *removed*. A host buffer of B *moved to host* when A has a device buffer of the same
logical shape (one-to-one, same op_name preferred).

The memory analysis of an HLO side is injected (``analyzer=``): the default is the memory model
(:func:`memory_side`, what ``hloopt analyze`` computes). Invariant:
``peak_delta_bytes == b.peak_bytes - a.peak_bytes`` and category deltas sum, over the union of
categories, to the peak delta when both sides report categories.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from hloopt.errors import UserError
from hloopt.ir import Module
from hloopt.report import LiveBuffer, mesh_of

__all__ = ["Analyzer", "BufferChange", "DecisionChange", "MemoryDiff", "Side", "memory_side", "diff_sides",
           "load_side", "diff_paths"]


@dataclass(frozen=True)
class Side:
    """One side of a diff."""

    label: str
    #: "hlo" or "plan"
    kind: str
    peak_bytes: int
    #: device bytes by category at the peak ({} when unknown, e.g. for plans)
    bytes_by_category: Mapping[str, int] = field(default_factory=dict)
    #: device buffers live at the peak, largest first
    live_at_peak: Sequence[LiveBuffer] = ()
    #: buffers in host memory (S(5)) anywhere in the program
    host_buffers: Sequence[LiveBuffer] = ()
    #: device buffers anywhere in the program (to tell where a host buffer came from)
    device_buffers: Sequence[LiveBuffer] = ()
    #: plans: candidate key -> (action, bytes)
    decisions: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    step_time_s: float | None = None
    num_partitions: int = 1
    mesh: Sequence[int] = ()
    #: which memory analysis produced the figures ("" for plans: the plan's own prediction)
    model: str = ""


#: Turns a parsed module into a Side (label and kind filled in by the caller).
Analyzer = Callable[[Module, str], Side]


@dataclass(frozen=True)
class BufferChange:
    #: "added", "removed", "resized", "moved to host"
    status: str
    a: LiveBuffer | None
    b: LiveBuffer | None

    @property
    def delta_bytes(self) -> int:
        return (self.b.bytes if self.b else 0) - (self.a.bytes if self.a else 0)


@dataclass(frozen=True)
class DecisionChange:
    key: str
    a_action: str | None
    b_action: str | None
    bytes: int


@dataclass(frozen=True)
class MemoryDiff:
    a: Side
    b: Side
    peak_delta_bytes: int
    #: category -> (a bytes, b bytes) at each side's peak
    categories: Mapping[str, tuple[int, int]]
    #: largest live buffers at the peak that differ
    buffer_changes: Sequence[BufferChange]
    moved_to_host: Sequence[BufferChange]
    decision_changes: Sequence[DecisionChange]

    def to_dict(self) -> dict[str, Any]:
        def buf(b: LiveBuffer | None) -> dict[str, Any] | None:
            return None if b is None else {"name": b.name, "shape": b.shape, "bytes": b.bytes, "category": b.category,
                                           "op_name": b.op_name, "source": b.source}

        def side(s: Side) -> dict[str, Any]:
            return {"label": s.label, "kind": s.kind, "peak_bytes": s.peak_bytes,
                    "bytes_by_category": dict(s.bytes_by_category), "step_time_s": s.step_time_s,
                    "host_bytes": sum(b.bytes for b in s.host_buffers), "num_partitions": s.num_partitions,
                    "mesh": list(s.mesh), "model": s.model}

        return {
            "a": side(self.a), "b": side(self.b),
            "peak_delta_bytes": self.peak_delta_bytes,
            "categories": {k: {"a": va, "b": vb, "delta": vb - va} for k, (va, vb) in self.categories.items()},
            "moved_to_host": [{"a": buf(c.a), "b": buf(c.b)} for c in self.moved_to_host],
            "buffers": [{"status": c.status, "a": buf(c.a), "b": buf(c.b), "delta_bytes": c.delta_bytes}
                        for c in self.buffer_changes],
            "decisions": [{"key": d.key, "a": d.a_action, "b": d.b_action, "bytes": d.bytes}
                          for d in self.decision_changes],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


# -- building sides --------------------------------------------------------------------------------

_LAYOUT = re.compile(r"\{[^{}]*\}$")


def logical_shape(shape: str) -> str:
    """``f32[2,64]{1,0:T(8,128)S(5)}`` -> ``f32[2,64]``."""
    return _LAYOUT.sub("", shape.strip())


def memory_side(module: Module, label: str) -> Side:
    """A Side from the memory model (:func:`hloopt.analysis.analyze`: the compiler's counting rules;
    a snapshot's ``.json`` beside ``label`` supplies XLA's generated-code size, as ``hloopt analyze`` does)."""
    from hloopt.analysis import analyze
    from hloopt.passes.memory import _info, categorize

    xla = None
    side_json = Path(label).with_suffix(".json")
    if side_json.is_file():
        try:
            mem = json.loads(side_json.read_text()).get("memory")
            xla = {k: int(v) for k, v in mem.items()} if isinstance(mem, dict) else None
        except (ValueError, AttributeError, TypeError):
            xla = None
    prof = analyze(module, top=1_000_000, xla=xla).profile
    lr = prof.ranges
    cats = prof.category_of or categorize(lr)

    def lb(info: Any) -> LiveBuffer:
        return LiveBuffer(name=info.name, shape=info.shape, bytes=info.bytes, category=info.category,
                          op_name=info.op_name, source=info.source)

    host: list[LiveBuffer] = []
    device: list[LiveBuffer] = []
    for r in lr.ranges():
        b = r.buffer
        if b.is_tuple_table:
            continue
        info = lb(_info(module, b, lr.size_bytes[b.id], cats.get(b.id, "temporaries"), r.start, r.end))
        (host if b.on_host else device if b.on_device else []).append(info)
    host.sort(key=lambda x: (-x.bytes, x.name))
    shardings = [i.sharding for i in module.instructions() if i.sharding]
    return Side(label=label, kind="hlo", peak_bytes=prof.peak_bytes, bytes_by_category=dict(prof.categories),
                live_at_peak=tuple(lb(x) for x in prof.top), host_buffers=tuple(host), device_buffers=tuple(device),
                num_partitions=module.num_partitions, mesh=mesh_of(shardings, module.num_partitions),
                model="memory model (hloopt analyze)")


def plan_side(path: str) -> Side:
    from hloopt.plan import Plan

    plan = Plan.load(path)
    return Side(label=path, kind="plan", peak_bytes=plan.predicted.peak_bytes,
                decisions={d.key: (d.action, d.bytes) for d in plan.decisions},
                step_time_s=plan.predicted.step_time_s)


def _is_plan_file(path: Path) -> bool:
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        with path.open(encoding="utf-8") as f:
            head = f.read(4096)
    except (OSError, UnicodeDecodeError):  # not a readable text file: not a plan
        return False
    return '"schema"' in head or "hloopt.plan/" in head or head.lstrip().startswith("{")


def load_side(spec: str, *, analyzer: Analyzer = memory_side) -> Side:
    """A Side for ``spec``: a plan file, an HLO text file, or an XLA dump folder (via TARGET resolution)."""
    path = Path(spec)
    if _is_plan_file(path):
        return plan_side(spec)
    from hloopt.hlo.parser import parse_module
    from hloopt.targets import resolve

    target = resolve(spec)
    if target.kind == "jax" or target.text is None:
        raise UserError(f"{spec}: diff reads HLO files, XLA dump folders and plan files; lower a JAX TARGET "
                        "first (hloopt lower ... -o step.hlo) or diff its plans")
    module = parse_module(target.text, filename=str(target.path or spec))
    if module.entry is None:
        raise UserError(f"{spec}: the HLO module has no ENTRY computation")
    return analyzer(module, spec)


# -- comparing -------------------------------------------------------------------------------------


def _identity(b: LiveBuffer) -> tuple[str, str]:
    # instruction names are not stable across compiles: a buffer without op_name is known by its shape
    return (b.op_name, logical_shape(b.shape))


def _match(a: Sequence[LiveBuffer], b: Sequence[LiveBuffer]) -> list[BufferChange]:
    pool: dict[tuple[str, str], list[LiveBuffer]] = defaultdict(list)
    for x in a:
        pool[_identity(x)].append(x)
    added: list[LiveBuffer] = []
    for y in b:
        lst = pool.get(_identity(y))
        if lst:
            lst.pop(0)
        else:
            added.append(y)
    removed = [x for lst in pool.values() for x in lst]
    changes: list[BufferChange] = []
    by_op: dict[str, list[LiveBuffer]] = defaultdict(list)
    for x in removed:
        by_op[x.op_name].append(x)
    for y in added:
        lst = by_op.get(y.op_name) if y.op_name else None
        if lst:
            x = lst.pop(0)
            changes.append(BufferChange("resized", x, y))
        else:
            changes.append(BufferChange("added", None, y))
    changes += [BufferChange("removed", x, None) for lst in by_op.values() for x in lst]
    return changes


def _moved_to_host(a: Side, b: Side) -> list[BufferChange]:
    """B's host buffers that A kept on device (same logical shape; same op_name preferred)."""
    a_host = Counter(logical_shape(x.shape) for x in a.host_buffers)
    pool: dict[str, list[LiveBuffer]] = defaultdict(list)
    for x in sorted(a.device_buffers, key=lambda x: (-x.bytes, x.name)):
        pool[logical_shape(x.shape)].append(x)
    out = []
    for y in b.host_buffers:
        shape = logical_shape(y.shape)
        if a_host[shape]:
            a_host[shape] -= 1  # already on host in A: not a move
            continue
        cands = pool.get(shape, [])
        pick = next((x for x in cands if x.op_name and x.op_name == y.op_name), cands[0] if cands else None)
        if pick is not None:
            cands.remove(pick)
        out.append(BufferChange("moved to host", pick, y))
    return out


def diff_sides(a: Side, b: Side, *, top: int = 20) -> MemoryDiff:
    """Compare two sides; ``top`` largest live buffers of each side take part in the buffer diff."""
    cats = {k: (int(a.bytes_by_category.get(k, 0)), int(b.bytes_by_category.get(k, 0)))
            for k in list(a.bytes_by_category) + [k for k in b.bytes_by_category if k not in a.bytes_by_category]}
    changes = _match(list(a.live_at_peak)[:top], list(b.live_at_peak)[:top])
    changes.sort(key=lambda c: (-abs(c.delta_bytes), c.status, (c.b or c.a).name))  # type: ignore[union-attr]
    decisions = []
    for key in list(a.decisions) + [k for k in b.decisions if k not in a.decisions]:
        da, db = a.decisions.get(key), b.decisions.get(key)
        if (da and da[0]) != (db and db[0]):
            decisions.append(DecisionChange(key, da[0] if da else None, db[0] if db else None,
                                            (db or da)[1]))  # type: ignore[index]
    return MemoryDiff(a=a, b=b, peak_delta_bytes=b.peak_bytes - a.peak_bytes, categories=cats,
                      buffer_changes=tuple(changes), moved_to_host=tuple(_moved_to_host(a, b)),
                      decision_changes=tuple(decisions))


def diff_paths(a: str, b: str, *, analyzer: Analyzer = memory_side, top: int = 20) -> MemoryDiff:
    """Load both sides and compare them."""
    return diff_sides(load_side(a, analyzer=analyzer), load_side(b, analyzer=analyzer), top=top)
