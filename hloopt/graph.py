"""The liveness graph of one step, for users: :func:`liveness_graph` returns a ``networkx`` graph.

Nodes are the buffers :class:`~hloopt.passes.liveness.Liveness` gives bytes and a live range
(positions that share storage after aliasing, :mod:`hloopt.passes.aliasing`), over the schedule
and with the settings ``hloopt analyze`` uses for the same TARGET and platform
(:func:`hloopt.analysis.profile_module`): for a pre-optimization module and ``platform="tpu"``,
calls inlined, the fusion model's buffers only (what XLA fuses away holds nothing), TPU tiled and
512-byte aligned sizes, a memory-aware list schedule. Nothing here recomputes liveness.

The graph is a :class:`networkx.MultiDiGraph`, because a producer and its consumer are both a
data dependence and (live together at the consumer's step) an interference: two edges between
one pair, told apart by their key, which is also their ``kind``:

* ``(u, v, "data")``: an instruction that defines ``v`` reads ``u`` (producer -> consumer).
  Instructions that only forward storage (``tuple``, ``get-tuple-element``, ``bitcast``,
  ``while``...) move no data and add no edge: the readers of what they forward read its buffers.
  A reader of a value fused away reads that value's inputs. No self loops (an in-place update
  writes the buffer it reads). Attribute ``step``: the first step where the read happens.
* ``(u, v, "interference")``: the closed live intervals of ``u`` and ``v`` overlap and both are
  in the same memory space (buffers in different spaces never share storage), so no allocator can
  give them the same bytes. Undirected in meaning: one edge per pair, from the buffer that starts
  first to the other (ties: the one that ends first, then the lower ``buffer_id``). Found by a
  sweep over intervals sorted by start, so the cost is O(n log n + edges); edges can still be
  quadratic in the buffers (a parameter live throughout interferes with everything), hence
  ``interference=False``.

Node ids are the defining instruction's name, plus ``{i,j}`` for a tuple element (the names
``hloopt analyze`` lists), suffixed ``#<buffer id>`` only if two buffers would share one. Node
attributes (None where unknown):

===================  =============================================================================
``buffer_id``        the buffer's id in :class:`~hloopt.passes.aliasing.Aliasing`
``instruction``      defining instruction (the buffer's first defining position), ``index`` its
                     shape index ("" or "{0,1}"), ``opcode``, ``shape`` (HLO text), ``computation``
``bytes``            bytes the model counts (fusion model sizes, TPU tiling, alignment)
``start``, ``end``   live interval, closed, in flat schedule steps (``Liveness``)
``counted_start``,   the steps ``PeakMemory`` counts it over (outputs from step 0 under TPU
``counted_end``      accounting...); -1 when it counts it nowhere (constants as static
                     allocations, temporaries inside an output's allocation, VMEM values when
                     the HBM heap is the one reported); host buffers count in the host timeline
``memory_space``     0 device, 5 host, 1 TPU VMEM...
``category``         :func:`hloopt.passes.memory.categorize`: parameters, optimizer state,
                     inputs, gradients, activations, temporaries, outputs, static
``residual``         holds a forward value the backward pass reads (:mod:`hloopt.passes.residuals`,
                     found on the module as lowered; one the fusion model fuses away is no node)
``checkpoint_name``  the ``checkpoint_name`` that selects the residual (:mod:`hloopt.naming`: JAX
                     targets with ``names=True`` only; None for HLO files and dumps)
``source``           "file:line" of the defining instruction's metadata (relative to the current
                     folder when inside it)
``op_name``          the metadata's op_name ("" when none)
``parameter``        entry parameter number, or -1; ``output``: part of the module's output
``tuple_table``      the buffer is a tuple's index table (8 bytes per element)
===================  =============================================================================

Graph attributes: ``module``, ``kind`` (the accounting, as in ``analyze --json``'s settings),
``platform``, ``schedule``, ``num_steps``, ``peak_bytes``, ``peak_step``.

:func:`graphml_text` and :func:`node_link_json` write a graph the way ``hloopt graph`` does:
nodes sorted by id, edges by (u, v, key), None as "" in GraphML (its attributes are scalars).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hloopt.errors import UserError
from hloopt.ir import Instruction, Module

if TYPE_CHECKING:
    import networkx as nx

    from hloopt.passes.liveness import LiveRanges
    from hloopt.passes.memory import MemoryProfile
    from hloopt.passes.residuals import ResidualSet

__all__ = ["graphml_text", "liveness_graph", "node_link_json"]


def liveness_graph(target: str | Path | Module, *, platform: str = "tpu", size: str | None = None,
                   schedule: str | None = None, interference: bool = True, names: bool = True) -> nx.MultiDiGraph:
    """The buffers of one step of ``target`` as a graph (see the module docstring).

    ``target`` is a TARGET as the CLI takes it (an HLO file, an XLA dump folder, ``file.py:factory``)
    or a parsed :class:`~hloopt.ir.Module`. ``platform``: what a JAX TARGET is lowered for and
    what pre-optimization HLO is predicted for ("tpu", "cuda", "cpu"), as in ``hloopt analyze``.
    ``size`` goes to a JAX TARGET's factory; ``schedule`` ("module", "list") overrides the
    default. ``names``: learn the ``checkpoint_name`` of each residual of a JAX TARGET (lowers
    it again, :func:`hloopt.naming.name_residuals`). ``interference=False`` leaves the
    interference edges out.
    """
    from hloopt.analysis import analyze

    if isinstance(target, Module):
        module = target
        residuals = _residuals(module)
    else:
        from hloopt.targets import resolve

        t = resolve(str(target), size=size)
        if t.kind == "jax":
            from hloopt.naming import lower_module, name_residuals

            module = lower_module(t, platform=platform)
            residuals = _residuals(module)
            if names and residuals is not None:
                residuals = name_residuals(t, baseline=residuals, platform=platform).residuals
        else:
            from hloopt.hlo.parser import parse_module

            assert t.text is not None
            module = parse_module(t.text, filename=str(t.path or target))
            residuals = _residuals(module)
    # residuals are found on the module as lowered (as ``hloopt residuals`` does); the analysis
    # may run on a copy with calls inlined, where a value a call returns has the copied name
    checkpoint: dict[str, str | None] = {}
    for r in residuals or ():
        checkpoint[r.inst.name] = checkpoint[_inlined_name(r.inst)] = r.name
    report = analyze(module, platform=platform, schedule=schedule, top=0)
    return _build(report.profile, report.settings, platform=platform, residuals=checkpoint,
                  interference=interference)


def _residuals(module: Module) -> ResidualSet | None:
    """The module's residuals; None when it has no loss to grow the forward pass from (a module
    that is not a training step)."""
    from hloopt.passes.residuals import find_residuals

    try:
        return find_residuals(module)
    except UserError:
        return None


def _inlined_name(inst: Instruction) -> str:
    """The name ``inst``'s value has once calls are inlined (:func:`hloopt.passes.inline.inline_for_assignment`):
    a call's is its callee root's copy, ``<call>.<root>``; an element of a call's root tuple is
    read from the copy of that element."""
    if inst.opcode == "call":
        callee = inst.callee("to_apply", "calls")
        if callee is not None and callee.root is not None:
            return f"{inst.name}.{_inlined_name(callee.root)}"
    if inst.opcode == "get-tuple-element" and inst.operands and inst.operands[0].opcode == "call":
        call = inst.operands[0]
        callee = call.callee("to_apply", "calls")
        root = callee.root if callee is not None else None
        k = int(inst.attrs.get("index", -1))
        if root is not None and root.opcode == "tuple" and 0 <= k < len(root.operands):
            return f"{call.name}.{_inlined_name(root.operands[k])}"
    return inst.name


def _build(prof: MemoryProfile, settings: dict[str, Any], *, platform: str, residuals: dict[str, str | None],
           interference: bool) -> nx.MultiDiGraph:
    """The graph of ``prof``'s buffers; ``residuals``: instruction name -> checkpoint_name (or None)
    of the residuals, named as in ``prof``'s module."""
    import networkx as nx

    lr = prof.ranges
    module = lr.module
    nodes = sorted(lr.ranges(), key=lambda r: (r.start, r.end, r.buffer.id))
    node_of: dict[int, str] = {}
    taken: set[str] = set()
    for r in nodes:
        name = _buffer_name(r.buffer.instruction, r.buffer.index)
        if name in taken:
            name = f"{name}#{r.buffer.id}"
        taken.add(name)
        node_of[r.buffer.id] = name
    residual_of = _residual_buffers(lr, node_of, residuals)

    g = nx.MultiDiGraph(module=module.name, kind=settings.get("kind", ""), platform=platform,
                        schedule=settings.get("schedule", ""), num_steps=lr.num_steps,
                        peak_bytes=prof.peak_bytes, peak_step=prof.peak_step)
    cwd = os.getcwd()
    for r in nodes:
        b = r.buffer
        inst = b.instruction
        src = module.source_of(inst)
        counted = _counted(prof, b.id)
        g.add_node(
            node_of[b.id], buffer_id=b.id, instruction=inst.name, index=_index_text(b.index),
            opcode=inst.opcode, shape=b.shape.to_text(),
            computation=inst.parent.name if inst.parent is not None else "",
            bytes=lr.size_bytes[b.id], start=r.start, end=r.end,
            counted_start=counted[0], counted_end=counted[1],
            memory_space=b.memory_space, category=prof.category_of.get(b.id, "temporaries"),
            residual=b.id in residual_of, checkpoint_name=residual_of.get(b.id),
            source=f"{_relative(src[0], cwd)}:{src[1]}" if src else None, op_name=inst.metadata.op_name,
            parameter=b.parameter, output=bool(b.output_indices), tuple_table=b.is_tuple_table,
        )
    for src, dst, step in _data_edges(lr, node_of):
        g.add_edge(src, dst, key="data", kind="data", step=step)
    if interference:
        for a, b in _interference(lr, nodes):
            g.add_edge(node_of[a], node_of[b], key="interference", kind="interference")
    return g


def _counted(prof: MemoryProfile, bid: int) -> tuple[int, int]:
    """(start, end) the device timeline counts buffer ``bid`` over, (-1, -1) when not in it."""
    s, e = prof.counted_start, prof.counted_end
    return (s[bid], e[bid]) if bid < len(s) and s[bid] >= 0 else (-1, -1)


def _data_edges(lr: LiveRanges, node_of: dict[int, str]) -> list[tuple[str, str, int]]:
    """(producer, consumer, first step) per pair, in schedule order (module docstring)."""
    from hloopt.passes.liveness import FORWARDS

    at = lr.aliasing.position_buffers
    sources: dict[Instruction, tuple[int, ...]] = {}

    def read_by(o: Instruction) -> tuple[int, ...]:
        # the node buffers a reader of ``o`` reads: ``o``'s own, or, fused away, its inputs'
        got = sources.get(o)
        if got is not None:
            return got
        own = tuple(dict.fromkeys(b for b in at.get(o, ()) if b in node_of))
        if own:
            got = own
        else:  # fused away, or a view of something fused away
            sources[o] = ()  # cycle guard (HLO is acyclic; a malformed graph must not recurse forever)
            got = tuple(dict.fromkeys(b for x in o.operands for b in read_by(x)))
        sources[o] = got
        return got

    edges: dict[tuple[int, int], int] = {}
    for t, inst in enumerate(lr.steps):
        if inst.opcode == "while":
            _loop_copies(lr, inst, node_of, edges)
        if inst.opcode in FORWARDS:
            continue
        defined = [b for b in dict.fromkeys(at.get(inst, ())) if b in node_of]
        if not defined:
            continue  # fused away: its readers read its inputs
        for o in inst.operands:
            for src in read_by(o):
                for dst in defined:
                    if src != dst:
                        edges.setdefault((src, dst), t)
    return [(node_of[u], node_of[v], t) for (u, v), t in edges.items()]


def _loop_copies(lr: LiveRanges, loop: Instruction, node_of: dict[int, str], edges: dict[tuple[int, int], int]) -> None:
    """Data edges of the copies a loop makes into its state (:mod:`hloopt.passes.aliasing`): an
    init value that is not the slot's buffer is copied in before the loop's first step, a body
    result that is not is copied in at the body root."""
    at = lr.aliasing.position_buffers
    slots = at.get(loop, ())
    body = loop.callee("body")
    sources = [(loop.operands[0], lr.segments.get(loop, (lr.time[loop],))[0])] if loop.operands else []
    if body is not None and body.root is not None and body.root in lr.time:
        sources.append((body.root, lr.time[body.root]))
    for src, step in sources:
        held = at.get(src, ())
        if len(held) != len(slots):
            continue
        for a, b in zip(held, slots):
            if a != b and a in node_of and b in node_of:
                edges.setdefault((a, b), step)


def _interference(lr: LiveRanges, nodes: list[Any]) -> list[tuple[int, int]]:
    """Pairs of buffers (ids) in one memory space whose closed intervals overlap: a sweep over
    ``nodes`` sorted by start, keeping per memory space the buffers still live."""
    active: dict[int, list[Any]] = {}
    out: list[tuple[int, int]] = []
    for r in nodes:  # sorted by (start, end, id)
        space = r.buffer.memory_space
        live = [a for a in active.get(space, ()) if a.end >= r.start]
        out.extend((a.buffer.id, r.buffer.id) for a in live)
        live.append(r)
        active[space] = live
    return out


def _residual_buffers(lr: LiveRanges, node_of: dict[int, str],
                      residuals: dict[str, str | None]) -> dict[int, str | None]:
    """Buffer id -> checkpoint_name (or None) of the node buffers holding a residual."""
    entry = lr.module.entry
    at = lr.aliasing.position_buffers
    by_name = {i.name: i for i in entry.instructions} if entry is not None else {}
    out: dict[int, str | None] = {}
    for name, checkpoint in sorted(residuals.items()):
        inst = by_name.get(name)
        bids = at.get(inst, ()) if inst is not None else ()
        if bids and bids[0] in node_of:
            out[bids[0]] = out.get(bids[0]) or checkpoint
    return out


def _buffer_name(inst: Instruction, index: tuple[int, ...]) -> str:
    return inst.name + _index_text(index)


def _index_text(index: tuple[int, ...]) -> str:
    return "{" + ",".join(map(str, index)) + "}" if index else ""


def _relative(path: str, cwd: str) -> str:
    """``path`` relative to ``cwd`` when it lies inside it (output that does not name the machine)."""
    if os.path.isabs(path):
        try:
            rel = os.path.relpath(path, cwd)
        except ValueError:
            return path
        if not rel.startswith(".."):
            return rel
    return path


# -- writing -------------------------------------------------------------------------------------

def _sorted(g: nx.MultiDiGraph, *, none_as: Any) -> nx.MultiDiGraph:
    """A copy with nodes in id order and edges in (u, v, key) order; None attributes -> ``none_as``."""
    import networkx as nx

    def clean(d: dict[str, Any]) -> dict[str, Any]:
        return {k: (none_as if v is None else v) for k, v in d.items()}

    out = nx.MultiDiGraph(**clean(dict(g.graph)))
    for n in sorted(g.nodes):
        out.add_node(n, **clean(g.nodes[n]))
    for u, v, k, d in sorted(g.edges(keys=True, data=True), key=lambda e: (e[0], e[1], e[2])):
        out.add_edge(u, v, key=k, **clean(d))
    return out


def graphml_text(g: nx.MultiDiGraph) -> str:
    """``g`` as GraphML (networkx's writer), sorted, None written as "" (module docstring)."""
    import networkx as nx

    from hloopt.fileio import MARKER

    # the marker lets ``-o`` replace a file hloopt wrote (hloopt.fileio)
    lines = ["<?xml version='1.0' encoding='utf-8'?>", f"<!-- {MARKER} (hloopt graph) -->"]
    lines += nx.generate_graphml(_sorted(g, none_as=""))
    return "\n".join(lines) + "\n"


def node_link_json(g: nx.MultiDiGraph) -> str:
    """``g`` as node-link JSON (``networkx.node_link_data``, edges under "edges"), sorted."""
    import networkx as nx

    from hloopt.fileio import MARKER

    data = nx.node_link_data(_sorted(g, none_as=None), edges="edges")
    return json.dumps({"generator": MARKER, **data}, indent=1) + "\n"
