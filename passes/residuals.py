"""Residuals: the activations a training step's forward pass leaves for its backward pass.

A *residual* is a value the forward computation produces and the backward computation reads.
Found by dataflow over the entry computation, never by op_name text alone (other frontends and
compiled modules do not carry ``jvp(``/``transpose(``):

1. **Loss.** The step's loss is the scalar floating-point output of the entry root with the most
   ancestors (a train step returns ``(params, opt_state, loss)``; the gradient update depends on
   the whole forward pass but the loss is the only scalar that does). Steps that also return
   metrics of the gradients (a gradient norm) have scalars with more ancestors: where JAX's
   op_names mark backward ops (``transpose(``), scalars computed from one are not candidates.
   ``loss_output=`` overrides.
2. **Forward set F** = the loss and its transitive operands, closed under

   * ``get-tuple-element`` or ``bitcast`` of a value in F (a piece or view of a forward value);
   * an ``annotate_device_placement`` custom-call to ``pinned_host`` of a value in F, or a copy
     (``copy-start``/``copy-done``) into host memory ``S(5)`` (the forward half of an offload's
     round trip: the residual is then the host copy); a copy between device memories
     (memory-space assignment's prefetch/evict) of a value in F, which is the same value;
   * a forward-only derivation the loss does not need -- an instruction whose operands are all
     in F or static and whose op_name says ``jvp(`` but not ``transpose(`` (JAX's linearization
     computes e.g. ``x >= 0`` for ``abs``'s derivative in the forward pass). This is the one
     place metadata is used, and only to move the cut forward, never to find F.

   The gradient seed is no instruction to start a backward set from: JAX folds the seed ``1.0``
   into constants (``0.125`` for a mean over 8). So backward = what is not forward.
3. **Static values** (parameters, constants, iota, anything computed from them alone, and a
   while output that its body passes through unchanged) are not residuals: they are inputs or
   free to recompute. They are reported apart (``ResidualSet.static``) since JAX's
   ``saved_residuals`` lists them (``from the argument ...``, broadcast targets, gather indices).
4. A **residual** is a non-static value in F with a user outside F (the entry root excepted:
   outputs are not residuals).

Loops (``lax.scan``): the forward loop is a ``while`` in F; the per-layer activations it saves are
tuple elements its body writes with ``dynamic-update-slice`` at the induction variable (stacked
``[L, ...]`` buffers), read by the backward ``while``. Such a residual has ``layers = L``: layer
``i`` is written in forward iteration ``i`` and read in backward iteration ``L-1-i`` (JAX's
transposed scan runs in reverse; the backward body's ``dynamic-slice`` index ``L-1-i`` is checked).

Offloaded residuals (already moved by a policy) are recognized by a host memory space (``S(5)``)
in their shape, or by an ``annotate_device_placement`` to ``pinned_host`` producing them (directly
or as the update written into a stacked buffer).

Invariants: every residual is an entry-level array value (non-tuple), in F, non-static, with at
least one backward user; ``position <= forward_last_use``, ``position < first_backward_use <=
last_use`` in schedule order (entry text order, which is the schedule in a scheduled module; in
JAX's unscheduled text the loss's last ops may come after the first backward ops, so there
``forward_last_use`` can exceed ``first_backward_use``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from hloopt.errors import UserError
from hloopt.frameworks import FRAMEWORK_PACKAGES, plumbing_paths
from hloopt.ir import Computation, Instruction, Module, Shape, gc_paused
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.loops import trip_count
from hloopt.passes.opcodes import ASYNC_COPIES, BARRIERS, CONTROL_FLOW, VIEWS, is_identity_call, is_shard_map_boundary

#: path fragments of library frames skipped when looking for the user's source line: JAX and the
#: frameworks models are built with, by package path (``flax/linen/module.py``: lowering writes
#: installed files so, and :func:`hloopt.ir.package_path` reads a dump's absolute paths so). A
#: model library's own layers (``transformers/``, ``levanter/``, ``maxtext/``, ``keras/src/layers/``)
#: are not skipped: they are the lines a user recognizes; a layer library's plumbing is
LIBRARY_PATHS: tuple[str, ...] = ("jax/_src/", "jaxlib/", *(f"{p}/" for p in FRAMEWORK_PACKAGES), *plumbing_paths())

#: ops that only re-view or move a value (looked through to find the producing op)
_VIEW_OPS = VIEWS | ASYNC_COPIES | BARRIERS | {"copy", "transpose", "convert", "get-tuple-element"}
#: opcodes never moved into F by the metadata hint (they join forward and backward values)
_NO_EXTEND = CONTROL_FLOW | BARRIERS | {"tuple", "parameter"}
_SIDE_EFFECT_SOURCES = frozenset({"rng", "rng-bit-generator", "infeed", "recv", "recv-done",
                                  "custom-call", "after-all"})
_DTYPE_FLOAT = re.compile(r"^(f|bf)\d")


_BARRIERS = ("opt-barrier", "optimization-barrier")
#: op_name fragments of values computed inside a checkpoint region
_CHECKPOINT_HINTS = ("checkpoint", "remat")


#: primitives that take a piece of an array
_SLICES = frozenset({"dynamic_slice", "slice", "gather"})


def input_slice_residuals(rs: "ResidualSet") -> list[Residual]:
    """Stacked residuals that are a loop's per-iteration slices of one of the step's inputs.

    A ``fori_loop`` over layers that indexes stacked weights (``w = ws[i]``) outside the
    ``jax.checkpoint`` it then calls hands the checkpoint the slice as an input: JAX saves every
    iteration's slice for the backward pass, a second copy of the weights. Told by the producer
    (a slice) and the stack's dims, which are an entry parameter's (layers leading)."""
    entry = rs.module.entry
    if entry is None:
        return []
    inputs = {(p.shape.element_type, tuple(p.shape.dims)) for p in entry.instructions
              if p.opcode == "parameter" and p.shape.is_array}
    return [r for r in rs if r.layers > 1 and r.primitive in _SLICES
            and (r.dtype, (r.layers, *r.per_layer_dims)) in inputs]


def under_checkpoint(res: Residual) -> bool:
    """Whether a policy governs the residual: ``jax.checkpoint`` hands its saved values to the
    backward pass through an optimization barrier (``remat2``), and scanned layers are saved as
    stacked loop outputs; values outside any checkpoint take neither path.

    ``jax.checkpoint(f, prevent_cse=False)`` emits no barrier; there the backward ops that read
    the value say it: JAX names the transpose of a checkpoint ``transpose(...)/checkpoint/...``
    (flax: ``remat``), whose inputs are what the checkpoint saved (under its policy) or its own
    arguments, as the barrier's are."""
    if res.name:
        return True
    if res.forward_loop is not None:
        return _checkpointed_loop(res.backward_loop or res.forward_loop)
    for u in res.backward_users:
        if u.opcode in _BARRIERS:
            return True
        if u.opcode == "tuple" and any(w.opcode in _BARRIERS for w in u.users):
            return True
        if u.opcode == "while":
            return True
    text = " ".join([res.producer.metadata.op_name, res.inst.metadata.op_name,
                     *(u.metadata.op_name for u in res.backward_users)]).lower()
    return any(h in text for h in _CHECKPOINT_HINTS)


#: loop -> whether its body computes under a checkpoint (the loop is held so its id stays its own)
_checkpointed_loops: dict[int, tuple[Instruction, bool]] = {}


def _checkpointed_loop(loop: Instruction) -> bool:
    """Whether a scan's body runs under ``jax.checkpoint``: JAX names the ops of a checkpoint's
    backward ``checkpoint/rematted_computation/...`` and ``remat``. A scan without one stacks
    every residual of its body too, and no policy moves those."""
    hit = _checkpointed_loops.get(id(loop))
    if hit is not None and hit[0] is loop:
        return hit[1]
    todo, seen, found = [c for cs in loop.called.values() for c in cs], set(), False
    while todo and not found:
        comp = todo.pop()
        if comp.name in seen:
            continue
        seen.add(comp.name)
        for inst in comp.instructions:
            text = inst.metadata.op_name
            if "checkpoint" in text or "remat" in text:
                found = True
                break
            for callees in inst.called.values():
                todo.extend(callees)
    if len(_checkpointed_loops) > 256:
        _checkpointed_loops.clear()
    _checkpointed_loops[id(loop)] = (loop, found)
    return found


def _placement(inst: Instruction) -> str | None:
    """Where an ``annotate_device_placement`` custom-call puts its value (``_xla_buffer_placement``)."""
    if inst.opcode != "custom-call" or inst.custom_call_target != "annotate_device_placement":
        return None
    return inst.frontend_attributes.get("_xla_buffer_placement")


def is_host_annotation(inst: Instruction) -> bool:
    """``custom-call(...) annotate_device_placement`` to ``pinned_host`` (JAX's offload marker)."""
    return _placement(inst) == "pinned_host"


def is_device_annotation(inst: Instruction) -> bool:
    """``custom-call(...) annotate_device_placement`` to ``device``: JAX's read of an offloaded
    value back into device memory (where the backward pass uses it)."""
    return _placement(inst) == "device"


def offloaded_source(inst: Instruction) -> Instruction | None:
    """The ``pinned_host`` annotation a ``device`` annotation reads back, in the same computation,
    through ``jax.checkpoint``'s optimization barriers and the tuples around them; None when the
    value comes from elsewhere (a scan's stack sliced inside a loop body, a parameter)."""
    if not is_device_annotation(inst) or not inst.operands:
        return None
    v, path = inst.operands[0], []
    for _ in range(64):
        op = v.opcode
        if op == "get-tuple-element" and v.operands:
            path.append(v.tuple_index)
            v = v.operands[0]
        elif op in ("opt-barrier", "optimization-barrier") and v.operands:
            v = v.operands[0]
        elif op == "tuple" and path and path[-1] < len(v.operands):
            v = v.operands[path.pop()]
        else:
            break
    if path or not is_host_annotation(v) or v.parent is not inst.parent:
        return None
    return v


def moves_to_host(inst: Instruction) -> bool:
    """An offload: a pinned_host annotation, or a copy whose destination is host memory (S(5))."""
    if is_host_annotation(inst):
        return True
    if inst.opcode in ("copy", "copy-done") and inst.shape.on_host:
        return True
    return (inst.opcode == "copy-start" and inst.shape.is_tuple and bool(inst.shape.tuple_shapes)
            and inst.shape.tuple_shapes[0].on_host)


def _host_stack_write(inst: Instruction) -> bool:
    """A write into a host buffer: per-layer offloads of an unrolled scan into one [L, ...] buffer."""
    op = inst.opcode
    if op in ("dynamic-update-slice", "dynamic-update-slice-done"):
        return inst.shape.on_host
    if op == "dynamic-update-slice-start":
        return inst.shape.is_tuple and any(s.on_host for s in inst.shape.tuple_shapes[:2] if not s.is_tuple)
    return False


def _is_device_copy(inst: Instruction) -> bool:
    """A copy between device memories (memory-space assignment's prefetch/evict): same value."""
    if inst.opcode == "copy-done":
        src = inst.operands[0] if inst.operands else None
        return src is not None and src.opcode == "copy-start" and _is_device_copy(src)
    if inst.opcode in ("copy", "copy-start") and inst.operands:
        return not inst.operands[0].shape.on_host
    return False


def primitive_of(inst: Instruction) -> str:
    """The JAX primitive behind an instruction: the last op_name segment, else the HLO opcode.

    ``jit(step)/jvp()/dot_general`` -> ``dot_general``; ``.../jit(relu)`` -> ``jit(relu)``.
    """
    op_name = inst.metadata.op_name
    if op_name:
        tail = op_name.rstrip("/").rsplit("/", 1)[-1]
        if tail and "[" not in tail:
            return tail
    return inst.opcode


@dataclass(frozen=True, eq=False)
class Residual:
    """One forward->backward value (for a scan: the stacked buffer of every layer)."""

    #: the entry-level instruction whose value crosses from forward to backward
    inst: Instruction
    #: the op that computes the data: through views/annotations, and for a stacked buffer the
    #: update written into it inside the forward loop body
    producer: Instruction
    #: total bytes of the buffer (all layers), in the module's layout
    bytes: int
    #: 1, or L for a stacked per-layer buffer written by a forward loop
    layers: int
    #: schedule index (entry) of ``inst``
    position: int
    #: last forward (F) user's schedule index (``position`` when only backward reads it)
    forward_last_use: int
    #: first backward user's schedule index
    first_backward_use: int
    #: last user's schedule index
    last_use: int
    #: entry-level backward users (a tuple feeding a while is replaced by that while)
    backward_users: tuple[Instruction, ...]
    #: the forward ``while`` that writes a stacked buffer (None when not stacked)
    forward_loop: Instruction | None = None
    #: the backward ``while`` that reads it, when the first backward user is one
    backward_loop: Instruction | None = None
    #: axis of the layer dimension in a stacked buffer
    layer_axis: int | None = None
    #: whether the backward loop reads layer i in iteration L-1-i (None: not seen, assumed)
    reversed_in_backward: bool | None = None
    #: already in host memory (S(5) layout or an annotate_device_placement to pinned_host)
    offloaded: bool = False
    #: the checkpoint_name selecting it, when known (set by :mod:`hloopt.naming`)
    name: str | None = None
    #: (file, line) in user code of the producer, when the module has debug info
    source: tuple[str, int] | None = None
    #: the ``annotate_device_placement`` to pinned_host that offloads it (pre-optimization HLO)
    offload_marker: Instruction | None = None

    # -- derived ---------------------------------------------------------------------------
    @property
    def shape(self) -> Shape:
        return self.inst.shape

    @property
    def stacked(self) -> bool:
        """One ``[L, ...]`` buffer a forward loop fills, a layer per iteration (a scan's residual)."""
        return self.forward_loop is not None and self.layers > 1

    @property
    def per_layer_bytes(self) -> int:
        return self.bytes // max(self.layers, 1)

    @property
    def per_layer_dims(self) -> tuple[int, ...]:
        dims = self.shape.dims
        if self.layer_axis is None:
            return dims
        return dims[: self.layer_axis] + dims[self.layer_axis + 1:]

    @property
    def dtype(self) -> str:
        return self.shape.element_type

    @property
    def primitive(self) -> str:
        return primitive_of(self.producer)

    @property
    def op_name(self) -> str:
        return self.producer.metadata.op_name or self.inst.metadata.op_name

    @property
    def source_text(self) -> str:
        return f"{self.source[0]}:{self.source[1]}" if self.source else ""

    @property
    def key(self) -> str:
        """The selector key of :class:`hloopt.problem.Candidate` (``name:x`` / ``prim:p@f.py:3``)."""
        if self.name:
            return f"name:{self.name}"
        loc = f"@{self.source_text}" if self.source else ""
        return f"prim:{self.primitive}{loc}"

    def iteration_map(self) -> list[tuple[int, int, int]]:
        """``(layer, forward iteration, backward iteration)`` per layer; ``[(0, 0, 0)]`` unstacked."""
        if self.forward_loop is None:
            return [(0, 0, 0)]
        L = self.layers
        rev = self.reversed_in_backward is not False
        return [(i, i, (L - 1 - i) if rev else i) for i in range(L)]


@dataclass(frozen=True)
class ResidualSet:
    """Every residual of one module, in schedule order of definition."""

    module: Module
    residuals: tuple[Residual, ...]
    #: values JAX would list but hloopt does not count: static (input-derived) forward values read
    #: by the backward pass (parameters, constants, views of them)
    static: tuple[Instruction, ...]
    #: the loss output the forward set was grown from
    loss: Instruction
    #: number of entry instructions in the forward set
    forward_size: int
    #: schedule index of the first backward instruction (min over residual first uses)
    backward_start: int

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.residuals)

    def __len__(self) -> int:
        return len(self.residuals)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.residuals)

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.bytes for r in self.residuals if r.offloaded)

    def with_names(self, names: dict[str, str]) -> "ResidualSet":
        """A copy with ``Residual.name`` set from ``{inst name: checkpoint_name}``."""
        return dataclasses.replace(self, residuals=tuple(
            dataclasses.replace(r, name=names.get(r.inst.name, r.name)) for r in self.residuals))


@dataclass(frozen=True)
class ResidualGroup:
    """Residuals one policy rule selects: one checkpoint_name, or one primitive at one source line."""

    key: str
    name: str | None
    selector: str
    residuals: tuple[Residual, ...]
    source: str = ""

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.residuals)

    @property
    def layers(self) -> int:
        return sum(r.layers for r in self.residuals)


@dataclass(frozen=True)
class FindResiduals(Analysis[ResidualSet]):
    """Analysis: the :class:`ResidualSet` of a module (see the module docstring)."""

    name: ClassVar[str] = "residuals"
    #: index of the loss in the entry root tuple (None: the scalar float output with most ancestors)
    loss_output: int | None = None
    #: use op_name ``jvp(``/``transpose(`` to move forward-only derivations into F
    metadata_hints: bool = True

    def run(self, module: Module, am: AnalysisManager | None = None) -> ResidualSet:
        with gc_paused():
            return _find(module, loss_output=self.loss_output, hints=self.metadata_hints)


def find_residuals(module: Module, *, loss_output: int | None = None, metadata_hints: bool = True) -> ResidualSet:
    """Residuals of ``module`` (see the module docstring)."""
    return FindResiduals(loss_output=loss_output, metadata_hints=metadata_hints).run(module)


def group_by_selector(residuals: Iterable[Residual]) -> list[ResidualGroup]:
    """Group residuals by :attr:`Residual.key`, largest first (ties by key)."""
    groups: dict[str, list[Residual]] = {}
    for r in residuals:
        groups.setdefault(r.key, []).append(r)
    out = []
    for key, rs in groups.items():
        r0 = rs[0]
        if r0.name:
            selector = f"checkpoint_name {r0.name!r}"
        else:
            selector = f"{r0.primitive} at {r0.source_text}" if r0.source else r0.primitive
        out.append(ResidualGroup(key=key, name=r0.name, selector=selector, residuals=tuple(rs),
                                 source=r0.source_text))
    out.sort(key=lambda g: (-g.bytes, g.key))
    return out


def describe(rs: ResidualSet, *, peak_bytes: int | None = None) -> list[dict[str, object]]:
    """One JSON-able row per residual (largest first), for reports and ``hloopt residuals --json``."""
    entry = rs.module.entry
    assert entry is not None
    order = entry.instructions
    rows: list[dict[str, object]] = []
    for r in sorted(rs.residuals, key=lambda r: (-r.bytes, r.position)):
        first = order[r.first_backward_use]
        rows.append({
            "name": r.name,
            "key": r.key,
            "selectable_by": (f"checkpoint_name {r.name!r}" if r.name else
                              f"{r.primitive} at {r.source_text}" if r.source else None),
            "shape": r.shape.to_text(layout=False),
            "per_layer_shape": f"{r.dtype}[{','.join(map(str, r.per_layer_dims))}]",
            "bytes": r.bytes,
            "per_layer_bytes": r.per_layer_bytes,
            "layers": r.layers,
            "producer": r.primitive,
            "op_name": r.op_name,
            "source": r.source_text or None,
            "instruction": r.inst.name,
            "forward_interval": [r.position, r.forward_last_use],
            "first_backward_use": r.first_backward_use,
            "first_backward_user": first.name,
            "last_use": r.last_use,
            "offloaded": r.offloaded,
            # saved inside a jax.checkpoint region: a policy can offload or recompute it
            "under_checkpoint": under_checkpoint(r),
            # host bytes are not device memory: no share of the (device) peak
            "peak_share": (r.bytes / peak_bytes) if peak_bytes and not r.offloaded else None,
        })
    return rows


# ----------------------------------------------------------------------------------------------
# The algorithm
# ----------------------------------------------------------------------------------------------


def _find(module: Module, *, loss_output: int | None, hints: bool) -> ResidualSet:
    entry = module.entry
    if entry is None or entry.root is None:
        raise UserError(f"{module.filename}: module {module.name} has no entry computation")
    order = entry.instructions
    pos = {inst: i for i, inst in enumerate(order)}
    root = entry.root
    _check_not_in_loop(module)
    loss = _pick_loss(entry, loss_output, module)

    static = _static_values(order)

    # F: the loss and its ancestors ...
    fwd: set[Instruction] = set()
    stack = [loss]
    while stack:
        inst = stack.pop()
        if inst in fwd:
            continue
        fwd.add(inst)
        if inst.opcode == "get-tuple-element" and inst.operands:
            src = inst.operands[0]
            deps = _element_operands(src, inst.tuple_index)
            if deps is not None:
                # XLA combines independent values into one tuple op (a variadic all-reduce of the
                # loss and the gradients, a multi-output fusion): only this element's inputs count.
                stack.extend(deps)
                continue
        stack.extend(inst.operands)
    # ... closed under pieces, offload annotations and (hinted) forward-only derivations.
    for inst in order:
        if inst in fwd or inst in static or not inst.operands:
            continue
        if inst.opcode in ("get-tuple-element", "bitcast") and inst.operands[0] in fwd:
            fwd.add(inst)
        elif (moves_to_host(inst) or _is_device_copy(inst)) and inst.operands[0] in fwd:
            fwd.add(inst)
        elif _host_stack_write(inst) and all(o in fwd or o in static for o in inst.operands) \
                and any(o in fwd for o in inst.operands):
            fwd.add(inst)
        elif hints and inst.opcode not in _NO_EXTEND and _forward_hint(inst) and all(
                o in fwd or o in static for o in inst.operands):
            fwd.add(inst)

    # The root and the tuples, their elements and the shard_map boundaries that only pass values
    # to it: reading a value there is returning it, not a backward use.
    to_root = {root}
    stack = [root]
    while stack:
        for o in stack.pop().operands:
            if o not in to_root and (o.opcode in ("tuple", "get-tuple-element") or is_shard_map_boundary(o)) \
                    and all(u in to_root for u in o.users):
                to_root.add(o)
                stack.append(o)

    residuals: list[Residual] = []
    static_res: list[Instruction] = []
    for inst in order:
        if inst not in fwd or inst is root:
            continue
        bwd_users = [u for u in inst.users if u not in fwd and u not in to_root and u.parent is entry]
        if not bwd_users:
            continue
        if inst in static or inst.opcode in ("parameter", "constant", "iota"):
            static_res.append(inst)
            continue
        if inst.shape.is_tuple or not inst.shape.is_array:
            continue  # its pieces (get-tuple-element) are the residuals
        residuals.append(_residual(module, inst, bwd_users, fwd, pos, root))
    backward_start = min((r.first_backward_use for r in residuals), default=len(order))
    return ResidualSet(module=module, residuals=tuple(residuals), static=tuple(static_res), loss=loss,
                       forward_size=len(fwd), backward_start=backward_start)


_PER_ELEMENT_COLLECTIVES = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                      "collective-permute", "all-reduce-done", "all-gather-done"})


def _element_operands(src: Instruction, index: int) -> list[Instruction] | None:
    """The operands element ``index`` of a tuple-valued op depends on, when narrower than all."""
    if not src.shape.is_tuple or index < 0:
        return None
    op = src.opcode
    if (op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all") or is_shard_map_boundary(src)) \
            and len(src.operands) == len(src.shape.tuple_shapes):
        return [src.operands[index]]
    if op == "fusion":
        comp = src.callee("calls")
        if comp is None or comp.root is None or comp.root.opcode != "tuple" or index >= len(comp.root.operands):
            return None
        params: set[int] = set()
        seen: set[Instruction] = set()
        st = [comp.root.operands[index]]
        while st:
            x = st.pop()
            if x in seen:
                continue
            seen.add(x)
            if x.opcode == "parameter":
                params.add(x.parameter_number)
            st.extend(x.operands)
        return [src.operands[n] for n in sorted(params) if n < len(src.operands)]
    return None


def _forward_hint(inst: Instruction) -> bool:
    op_name = inst.metadata.op_name
    return "jvp(" in op_name and "transpose(" not in op_name


def differentiated_in_loop(module: Module) -> Instruction | None:
    """The entry's loop whose body computes a backward pass (JAX's ``transpose(`` op names) when
    the entry computes none outside loops, forward or backward: gradient accumulation over
    microbatches (``lax.fori_loop``/``scan`` around ``jax.grad``), whose accumulated gradients an
    optimizer reads after the loop would otherwise pass for residuals. A scan over layers
    differentiates at its top level too (the embedding, the loss). Residuals are found at the top
    level only."""
    entry = module.entry
    if entry is None:
        return None
    loops = []
    for inst in entry.instructions:
        if inst.opcode == "while":
            loops.append(inst)
        elif "transpose(" in inst.metadata.op_name or "jvp(" in inst.metadata.op_name:
            return None  # the step differentiates at its top level
    for loop in loops:
        todo, seen = [c for c in loop.called.get("body", [])], set()
        while todo:
            comp = todo.pop()
            if comp.name in seen:
                continue
            seen.add(comp.name)
            for inst in comp.instructions:
                if "transpose(" in inst.metadata.op_name:
                    return loop
                for callees in inst.called.values():
                    todo.extend(callees)
    return None


def _check_not_in_loop(module: Module) -> None:
    loop = differentiated_in_loop(module)
    if loop is None:
        return
    src = module.user_source_of(loop, skip=LIBRARY_PATHS)
    where = f"the loop at {src[0]}:{src[1]}" if src else f"loop {loop.name}"
    raise UserError(f"{module.filename}: the step differentiates inside a loop ({where}: gradient "
                    "accumulation over microbatches?), and hloopt finds residuals at a step's top level "
                    "only: make the TARGET the step of one microbatch (its loss and gradient); its plan "
                    "applies unchanged inside the loop")


def _pick_loss(entry: Computation, loss_output: int | None, module: Module) -> Instruction:
    root = entry.root
    assert root is not None
    outputs = list(root.operands) if root.opcode == "tuple" else [root]
    if loss_output is not None:
        if not 0 <= loss_output < len(outputs):
            raise UserError(f"{module.filename}: loss output {loss_output} is not among the entry's "
                            f"{len(outputs)} outputs")
        return outputs[loss_output]
    scalars = [o for o in outputs if o.shape.is_array and o.shape.rank == 0
               and _DTYPE_FLOAT.match(o.shape.element_type) and o.opcode != "parameter"]
    if not scalars:
        raise UserError(f"{module.filename}: no scalar floating-point output to take as the loss "
                        "(a train step returns its loss)")
    if len(scalars) == 1:
        return scalars[0]
    ancestors = {o: _ancestors(o) for o in scalars}
    # Steps also report metrics computed from the gradients (MaxText's grad_norm, the new params'
    # norm): they have more ancestors than the loss. Where op_names carry JAX's transposition
    # (``transpose(jvp(...))`` on every backward op), a scalar computed from one is no loss.
    forward_only = [o for o in scalars if not any("transpose(" in a.metadata.op_name for a in ancestors[o])]
    if forward_only and len(forward_only) < len(scalars):
        scalars = forward_only
    return max(scalars, key=lambda o: (len(ancestors[o]), -outputs.index(o)))


def _ancestors(inst: Instruction) -> set[Instruction]:
    return ancestors_of([inst])


def ancestors_of(outputs: Iterable[Instruction]) -> set[Instruction]:
    """``outputs`` and every instruction they read, transitively, in their computation."""
    seen: set[Instruction] = set()
    stack = list(outputs)
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(i.operands)
    return seen


def _static_values(order: Sequence[Instruction]) -> set[Instruction]:
    """Inputs and what is cheap to derive from them, in topological (= text) order.

    Static: parameters; anything computed from constants alone (masks, rope tables: XLA folds or
    recomputes them); views of one static value (broadcast, reshape, convert, slice,
    dynamic-slice, copies between memories, ...) and elementwise ops between one static value and
    constants (a scaled weight); a fusion of only such ops on static operands; a while result
    element computed in the body from static elements only (a passed-through or converted
    weight), found by a fixed point over the loop-carried elements.
    """
    return _static_in(order, lambda inst: inst.opcode == "parameter")


def static_values_of(loop: Instruction | None, entry_static: set[Instruction]) -> set[Instruction]:
    """:func:`_static_values` of a ``while``'s body (``loop``; ``entry_static`` the entry's):
    the loop state elements that stay static through every iteration (a scan's stacked weights)
    and what is cheap to derive from them."""
    if loop is None:
        return set()
    body = loop.callee("body")
    if body is None:
        return set()
    elements = _static_loop_elements(loop, entry_static, 0)
    return _static_in(body.instructions, lambda i: i.opcode == "get-tuple-element" and i.tuple_index in elements)


def _static_in(order: Sequence[Instruction], param_static, depth: int = 0) -> set[Instruction]:  # type: ignore[no-untyped-def]
    const_only: set[Instruction] = set()
    static: set[Instruction] = set()
    for inst in order:
        op = inst.opcode
        if op in ("constant", "iota", "partition-id", "replica-id") or (
                op == "custom-call" and inst.custom_call_target == "AllocateBuffer"):
            const_only.add(inst)
            static.add(inst)
        elif op == "parameter" or (op == "get-tuple-element" and inst.operands
                                   and inst.operands[0].opcode == "parameter"):
            if param_static(inst):
                static.add(inst)
        elif op == "get-tuple-element" and inst.operands and inst.operands[0].opcode == "while":
            if inst.tuple_index in _static_loop_elements(inst.operands[0], static, depth):
                static.add(inst)
        elif (viewed := _sharding_view_of(inst)) is not None:
            if viewed in static:
                static.add(inst)
                if viewed in const_only:
                    const_only.add(inst)
        elif op in _SIDE_EFFECT_SOURCES or not inst.operands:
            continue
        elif all(o in const_only for o in inst.operands):
            const_only.add(inst)
            static.add(inst)
        elif op == "fusion":
            comp = inst.callee("calls")
            if (comp is not None and all(o in static for o in inst.operands)
                    and all(c.opcode in _CHEAP_OPS or c.opcode in _ELEMENTWISE
                            or c.opcode in ("parameter", "constant", "iota", "tuple")
                            for c in comp.instructions)):
                static.add(inst)
        elif op in _CHEAP_OPS or op in _ELEMENTWISE:
            varying = [o for o in inst.operands if o not in const_only]
            if len(varying) == 1 and varying[0] in static and (
                    op in _CHEAP_OPS or len(inst.operands) > 1 or op in ("convert", "negate")):
                static.add(inst)
    return static


def _sharding_view_of(inst: Instruction) -> Instruction | None:
    """The value a sharding marker stands for as XLA partitions it: a GSPMD marker's (``Sharding``,
    ``SPMDFullToShardShape``) operand, or operand k for element k of a Shardy ``shard_map``
    boundary (a weight's shard inside the body). None for anything else."""
    if is_identity_call(inst) and inst.operands:
        return inst.operands[0]
    if inst.opcode == "get-tuple-element" and inst.operands and is_shard_map_boundary(inst.operands[0]):
        src = inst.operands[0].operands
        return src[inst.tuple_index] if 0 <= inst.tuple_index < len(src) else None
    return None


def _static_loop_elements(loop: Instruction, outer_static: set[Instruction], depth: int) -> frozenset[int]:
    """Tuple indices of a while whose values stay static through every iteration."""
    body = loop.callee("body")
    init = loop.operands[0] if loop.operands else None
    if body is None or body.root is None or body.root.opcode != "tuple" or init is None or depth > 4:
        return frozenset()
    if init.opcode == "tuple":
        cand = {k for k, o in enumerate(init.operands) if o in outer_static}
    else:
        cand = set()
    while True:
        fixed = frozenset(cand)
        inner = _static_in(body.instructions, lambda i, f=fixed: i.opcode == "get-tuple-element"
                           and i.tuple_index in f, depth + 1)
        nxt = {k for k in cand if body.root.operands[k] in inner}
        if nxt == cand:
            return frozenset(cand)
        cand = nxt


#: ops that re-view, move or cut a value: cheap to redo from a static operand
_CHEAP_OPS = frozenset({"broadcast", "reshape", "bitcast", "copy", "transpose", "convert", "slice",
                        "dynamic-slice", "get-tuple-element", "pad", "reverse", "concatenate",
                        "bitcast-convert", "copy-start", "copy-done", "dynamic-update-slice"})
_ELEMENTWISE = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum", "select",
                          "compare", "and", "or", "negate", "clamp"})


def _passthrough_init(loop: Instruction, index: int) -> Instruction | None:
    """The init value of tuple element ``index`` if the loop body passes it through unchanged."""
    body = loop.callee("body")
    if body is None or body.root is None or body.root.opcode != "tuple" or not loop.operands:
        return None
    if index >= len(body.root.operands):
        return None
    out = body.root.operands[index]
    if not (out.opcode == "get-tuple-element" and out.tuple_index == index
            and out.operands and out.operands[0].opcode == "parameter"):
        return None
    init = loop.operands[0]
    if init.opcode == "tuple" and index < len(init.operands):
        return init.operands[index]
    return None


def _deep_producer(inst: Instruction) -> tuple[Instruction, bool]:
    """(the op computing a value, whether a pinned_host annotation was passed on the way)."""
    producer, marker, host = _trace_producer(inst)
    return producer, host


def _trace_producer(inst: Instruction) -> tuple[Instruction, Instruction | None, bool]:
    """(the op computing a value, the first pinned_host annotation on the way, whether on host).

    Looks through views, annotations and into called computations (``call`` results, pieces of a
    ``call``/``fusion`` tuple), from a called computation's parameter back to its caller's
    operand, and through a concatenation of copies of one value (an unrolled scan's iterations).
    """
    callers: list[Instruction] = []
    host = False
    marker: Instruction | None = None
    for _ in range(128):
        if marker is None and is_host_annotation(inst):
            marker = inst
        host = host or is_host_annotation(inst) or inst.shape.on_host
        op = inst.opcode
        if (op in _VIEW_OPS and op != "get-tuple-element" or op == "custom-call" and
                inst.custom_call_target == "annotate_device_placement") and inst.operands:
            inst = inst.operands[0]
        elif op == "get-tuple-element" and inst.operands and inst.operands[0].opcode in ("call", "fusion"):
            call = inst.operands[0]
            comp = call.callee("to_apply", "calls")
            if comp is None or comp.root is None or comp.root.opcode != "tuple":
                return call, marker, host
            callers.append(call)
            inst = comp.root.operands[inst.tuple_index]
        elif op == "call" and inst.called.get("to_apply"):
            comp = inst.called["to_apply"][0]
            if comp.root is None or comp.root.opcode == "tuple":
                return inst, marker, host
            callers.append(inst)
            inst = comp.root
        elif op == "concatenate" and len(inst.operands) > 1:
            # An unrolled scan stacks the iterations' copies of one value (each a call of the same
            # body computation, or its inlined copy) before writing them into the loop's stack: a
            # concatenation whose pieces all trace to one op, or to copies of it, is that op's
            # value, on host when every piece is.
            pieces = [_trace_producer(o) for o in inst.operands]
            if any(not _same_op(p[0], pieces[0][0]) for p in pieces):
                return inst, marker, host
            return pieces[0][0], marker or pieces[0][1], host or all(p[2] for p in pieces)
        elif op == "parameter" and callers and inst.parent is not None and not inst.parent.is_entry:
            call = callers.pop()
            n = inst.parameter_number
            if n >= len(call.operands):
                return inst, marker, host
            inst = call.operands[n]
        else:
            return inst, marker, host
    return inst, marker, host


def _same_op(a: Instruction, b: Instruction) -> bool:
    """``a`` is ``b``, or a copy of the same traced op (an inlined call's): same opcode, shape and
    JAX op metadata."""
    return a is b or (a.opcode == b.opcode and a.shape == b.shape and bool(a.metadata.op_name)
                      and a.metadata == b.metadata)


def _look_through(inst: Instruction) -> Instruction:
    """The op that computes a value: skip views, copies and offload annotations."""
    seen = 0
    while seen < 64 and inst.operands and (
            inst.opcode in _VIEW_OPS and inst.opcode != "get-tuple-element"
            or (inst.opcode == "custom-call" and inst.custom_call_target == "annotate_device_placement")):
        inst = inst.operands[0]
        seen += 1
    return inst


def _residual(module: Module, inst: Instruction, bwd_users: list[Instruction], fwd: set[Instruction],
              pos: dict[Instruction, int], root: Instruction) -> Residual:
    users = [u for u in inst.users if u.parent is inst.parent]
    fwd_uses = [pos[u] for u in users if u in fwd]
    consumers = [_consumer(u) for u in bwd_users]
    first_bwd = min(consumers, key=lambda u: pos[u])
    last_use = max(pos[u] for u in users if u is not root) if any(u is not root for u in users) else pos[inst]
    last_use = max([last_use] + [pos[c] for c in consumers])
    producer, marker, offloaded = _trace_producer(inst)
    layers, axis, fwd_loop, rev = 1, None, None, None
    bwd_loop = first_bwd if first_bwd.opcode == "while" else None

    loop, index = _while_element(inst)
    if loop is not None and loop in fwd:
        stacked = _stacked_update(loop, index)
        if stacked is not None:
            update, axis, inner_offload = stacked
            layers = inst.shape.dims[axis]
            fwd_loop = loop
            producer, up_marker, up_host = _trace_producer(update)
            marker = marker or up_marker
            offloaded = offloaded or inner_offload or up_host
            if bwd_loop is not None:
                rev = _reads_reversed(bwd_loop, inst)
    if fwd_loop is None and inst.opcode in ("dynamic-update-slice", "dynamic-update-slice-done"):
        writes = _host_stack_writes(inst)
        if writes:
            update = writes[0]
            axes = [d for d in range(inst.shape.rank) if d < update.shape.rank
                    and update.shape.dims[d] == 1 and inst.shape.dims[d] > 1]
            if axes and inst.shape.dims[axes[0]] == len(writes):
                layers, axis = len(writes), axes[0]
                producer, _ = _deep_producer(update)
                offloaded = True
    source = module.user_source_of(producer, skip=LIBRARY_PATHS) or module.user_source_of(
        inst, skip=LIBRARY_PATHS)
    return Residual(
        inst=inst, producer=producer, bytes=inst.shape.byte_size, layers=layers, position=pos[inst],
        forward_last_use=max(fwd_uses, default=pos[inst]), first_backward_use=pos[first_bwd],
        last_use=last_use, backward_users=tuple(dict.fromkeys(consumers)), forward_loop=fwd_loop,
        backward_loop=bwd_loop, layer_axis=axis, reversed_in_backward=rev, offloaded=offloaded,
        source=source, offload_marker=marker)


def _host_stack_writes(inst: Instruction) -> list[Instruction]:
    """Updates written, first to last, by a chain of dynamic-update-slices ending at ``inst``."""
    updates: list[Instruction] = []
    for _ in range(4096):
        if inst.opcode == "dynamic-update-slice-done" and inst.operands:
            inst = inst.operands[0]
        if inst.opcode in ("dynamic-update-slice", "dynamic-update-slice-start") and len(inst.operands) >= 2:
            updates.append(inst.operands[1])
            inst = inst.operands[0]
        else:
            break
    return updates[::-1]


def _consumer(user: Instruction) -> Instruction:
    """A tuple that only feeds a while (its init) stands for that while."""
    if user.opcode == "tuple" and len(user.users) == 1 and user.users[0].opcode == "while":
        return user.users[0]
    return user


def _is_offloaded_chain(inst: Instruction) -> bool:
    return _deep_producer(inst)[1]


def _while_element(inst: Instruction) -> tuple[Instruction | None, int]:
    """(while, tuple index) when ``inst`` is a piece of a while's result (through views)."""
    seen = 0
    while seen < 16 and inst.opcode in ("bitcast", "copy", "reshape") and inst.operands:
        inst = inst.operands[0]
        seen += 1
    if inst.opcode == "get-tuple-element" and inst.operands and inst.operands[0].opcode == "while":
        return inst.operands[0], inst.tuple_index
    return None, -1


def _param_element(inst: Instruction, index: int) -> bool:
    """Whether ``inst`` is element ``index`` of the body parameter (through views)."""
    seen = 0
    while seen < 16 and inst.opcode in ("bitcast", "copy", "reshape") and inst.operands:
        inst = inst.operands[0]
        seen += 1
    return (inst.opcode == "get-tuple-element" and inst.tuple_index == index and bool(inst.operands)
            and inst.operands[0].opcode == "parameter")


def _stacked_update(loop: Instruction, index: int) -> tuple[Instruction, int, bool] | None:
    """For a loop element written per iteration by a dynamic-update-slice: (update, axis, offloaded).

    Follows the body root's element through views, async ``dynamic-update-slice-start/done``
    and fusions whose root is (a tuple holding) a dynamic-update-slice of a fusion parameter.
    """
    body = loop.callee("body")
    if body is None or body.root is None or body.root.opcode != "tuple" or index >= len(body.root.operands):
        return None
    out = body.root.operands[index]
    dus = _find_dus(out, depth=0)
    if dus is None:
        return _stacked_by_trip_count(loop, index, out)
    base, update, upd = dus
    if not _param_element(base, index) and base.opcode != "parameter":
        # the buffer written must be the loop-carried element (or a fusion parameter standing for it)
        return None
    buf = out.shape
    if buf.is_tuple or upd.is_tuple or buf.rank != upd.rank:
        return None
    axes = [d for d in range(buf.rank) if upd.dims[d] == 1 and buf.dims[d] > 1]
    if not axes:
        return None
    offloaded = _is_offloaded_chain(update) or buf.on_host
    return update, axes[0], offloaded


def _strip_views(inst: Instruction) -> Instruction:
    seen = 0
    while seen < 16 and inst.opcode in ("bitcast", "copy", "reshape") and inst.operands:
        inst = inst.operands[0]
        seen += 1
    return inst


def _find_dus(inst: Instruction, depth: int) -> tuple[Instruction, Instruction, Shape] | None:
    """(buffer operand, update operand, update shape as written) of the dynamic-update-slice that produces ``inst``."""
    if depth > 8:
        return None
    seen = 0
    while seen < 16 and inst.opcode in ("bitcast", "copy", "reshape") and inst.operands:
        inst = inst.operands[0]
        seen += 1
    if inst.opcode == "dynamic-update-slice" and len(inst.operands) >= 2:
        return inst.operands[0], inst.operands[1], inst.operands[1].shape
    if inst.opcode == "dynamic-update-slice-done" and inst.operands:
        start = inst.operands[0]
        if start.opcode == "dynamic-update-slice-start" and len(start.operands) >= 2:
            return start.operands[0], start.operands[1], start.operands[1].shape
    if inst.opcode == "get-tuple-element" and inst.operands and inst.operands[0].opcode == "fusion":
        return _fusion_dus(inst.operands[0], inst.tuple_index, depth)
    if inst.opcode == "get-tuple-element" and inst.operands and inst.operands[0].opcode == "call":
        return _fusion_dus(inst.operands[0], inst.tuple_index, depth)
    if inst.opcode in ("fusion", "call"):
        return _fusion_dus(inst, None, depth)
    return None


def _fusion_dus(fusion: Instruction, index: int | None, depth: int) -> tuple[Instruction, Instruction, Shape] | None:
    comp = fusion.callee("calls", "to_apply")
    if comp is None or comp.root is None:
        return None
    r = comp.root
    if index is not None:
        if r.opcode != "tuple" or index >= len(r.operands):
            return None
        r = r.operands[index]
    inner = _find_dus(r, depth + 1)
    if inner is None:
        return None
    base, update = _strip_views(inner[0]), _strip_views(inner[1])
    # Map fusion parameters back to the fusion's operands in the body.
    if base.opcode == "parameter" and base.parameter_number < len(fusion.operands):
        base = fusion.operands[base.parameter_number]
    if update.opcode == "parameter" and update.parameter_number < len(fusion.operands):
        update = fusion.operands[update.parameter_number]
    return base, update, inner[2]


def _stacked_by_trip_count(loop: Instruction, index: int, out: Instruction) -> tuple[Instruction, int, bool] | None:
    """Fallback: a non-passthrough element whose leading dim is the trip count (layers > 1)."""
    trip = trip_count(loop)
    shape = out.shape
    if trip is None or trip <= 1 or shape.is_tuple or not shape.rank or shape.dims[0] != trip:
        return None
    if _param_element(out, index):
        return None
    init = loop.operands[0] if loop.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    if _look_through(init.operands[index]).opcode not in ("broadcast", "constant"):
        return None  # a stacked buffer starts as zeros; a carried activation does not
    return out, 0, shape.on_host


def _reads_reversed(bwd_loop: Instruction, inst: Instruction) -> bool | None:
    """Whether the backward loop body reads the stacked element at index ``L-1-i`` (a subtract)."""
    init = bwd_loop.operands[0] if bwd_loop.operands else None
    if init is None or init.opcode != "tuple":
        return None
    try:
        j = next(k for k, o in enumerate(init.operands) if o is inst)
    except StopIteration:
        return None
    body = bwd_loop.callee("body")
    if body is None:
        return None
    for b in body.instructions:
        if (b.opcode == "get-tuple-element" and b.tuple_index == j and b.operands
                and b.operands[0].opcode == "parameter"):
            for u in b.users:
                idx = _slice_index(u, b)
                if idx is not None:
                    return _involves_subtract(idx)
    return None


def _slice_index(user: Instruction, operand: Instruction) -> list[Instruction] | None:
    """Index operands of the dynamic-slice that reads ``operand`` in ``user`` (or inside it)."""
    if user.opcode in ("dynamic-slice", "dynamic-slice-start") and user.operands and user.operands[0] is operand:
        return list(user.operands[1:])
    if user.opcode in ("fusion", "call"):
        comp = user.callee("calls", "to_apply")
        if comp is None:
            return None
        numbers = {n for n, o in enumerate(user.operands) if o is operand}
        for c in comp.instructions:
            if c.opcode == "dynamic-slice" and c.operands and c.operands[0].opcode == "parameter" \
                    and c.operands[0].parameter_number in numbers:
                return [user.operands[i.parameter_number]
                        if i.opcode == "parameter" and i.parameter_number < len(user.operands) else i
                        for i in c.operands[1:]]
    return None


def _involves_subtract(idx: list[Instruction]) -> bool:
    for i in idx:
        stack, seen = [i], 0
        while stack and seen < 32:
            x = stack.pop()
            seen += 1
            if x.opcode == "subtract" or (x.opcode == "fusion" and "subtract" in x.name):
                return True
            if x.opcode in ("fusion", "call"):
                comp = x.callee("calls", "to_apply")
                if comp is not None and any(c.opcode == "subtract" for c in comp.instructions):
                    return True
            if x.opcode not in ("parameter", "constant", "get-tuple-element"):
                stack.extend(x.operands)
    return False


__all__ = ["FindResiduals", "describe", "under_checkpoint", "LIBRARY_PATHS", "Residual", "ResidualGroup",
           "ResidualSet", "find_residuals", "group_by_selector", "is_host_annotation", "moves_to_host", "primitive_of"]
