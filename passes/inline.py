"""Call inlining (XLA's ``CallInliner``): a transform, not an analysis.

JAX wraps pieces of a step in ``call`` instructions (``closed_call``, ``take_along_axis``,
``jit(relu)``...). XLA inlines every such call before it fuses and assigns buffers, so a value a
callee returns through its root tuple is not a buffer of its own in the compiled program. Memory
analyses of pre-optimization HLO therefore run on the inlined module.

``inline_calls(module)`` returns a NEW module (the input is not changed) in which every ``call``
of every computation is replaced by a copy of its callee's instructions: the callee's parameters
become the call's operands, and the call's users read the copy of the callee's root. Copies are
named ``<call name>.<callee instruction name>`` (unique: a computation's names are unique and so
are call names). Calls inside the inlined code are inlined too (the callee is rebuilt first).
Other called computations (fusions, loop bodies, reducers) are kept and rebuilt the same way.

Invariants: no ``call`` remains in a computation reachable from the entry; every other
instruction keeps its name, opcode, shape, attributes and metadata; the entry's parameters and
the shape of its root are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from hloopt.ir import Computation, Instruction, Metadata, Module, Shape, gc_paused

_new_instruction = object.__new__


def _copy(inst: Instruction, name: str, shape: Shape | None = None) -> Instruction:
    """A new instruction with ``inst``'s opcode, attributes, literal, metadata and span (every
    field of ``Instruction.__init__`` set once: a module copy makes one per instruction)."""
    new = _new_instruction(Instruction)
    new.name = name
    new.opcode = inst.opcode
    new.shape = inst.shape if shape is None else shape
    new.operands = []
    new.attrs = dict(inst.attrs)
    new.called = {}
    new.is_root = False
    new.parent = None
    new.index = -1
    new.operand_shapes = None
    new._metadata_text = inst._metadata_text
    new._metadata = inst._metadata
    new.literal = inst.literal
    new.users = []
    new.control_predecessors = ()
    new.span = inst.span
    new.is_unknown = inst.is_unknown
    return new


def _locate_at(inst: Instruction, site: Metadata) -> None:
    """Give an inlined instruction that carries no source location its call's: JAX writes none
    for some ops of a function it lowers once and calls (``take_along_axis``'s select), and the
    call site is where the user's program asked for them."""
    md = inst.metadata
    if md.source_file or md.stack_frame_id:
        return
    inst._metadata = dataclasses.replace(md, source_file=site.source_file, source_line=site.source_line,
                                         stack_frame_id=site.stack_frame_id)


class _Inliner:
    def __init__(self, module: Module, order: Mapping[Computation, Sequence[Instruction]] | None = None,
                 shape_of: Callable[[Instruction], Shape] | None = None, inline: bool = True) -> None:
        self.old = module
        #: per old computation, the order to copy its instructions in (default: text order)
        self.order = order or {}
        #: the shape each copy takes (default: the original's)
        self.shape_of = shape_of
        #: whether calls are inlined (else copied as calls of copied computations)
        self.inline = inline
        self.new = Module(
            name=module.name, is_scheduled=module.is_scheduled,
            input_output_alias=list(module.input_output_alias), entry_layout=module.entry_layout,
            frontend_attributes=dict(module.frontend_attributes), header_attrs=dict(module.header_attrs),
            file_names=dict(module.file_names), function_names=dict(module.function_names),
            file_locations=dict(module.file_locations), stack_frames=dict(module.stack_frames),
            filename=module.filename,
        )
        #: instructions whose called computations still name the OLD computations
        self.pending_calls: list[tuple[Instruction, Instruction]] = []

    def _emit(self, comp: Computation, inst: Instruction, env: dict[Instruction, Instruction],
              prefix: str) -> None:
        """Append a copy of ``inst`` (or, for a call, its callee's body) to ``comp``."""
        callee = inst.callee("to_apply", "calls") if inst.opcode == "call" and self.inline else None
        if callee is not None:
            inner: dict[Instruction, Instruction] = {}
            params = {p.parameter_number: p for p in callee.instructions if p.opcode == "parameter"}
            for num, p in params.items():
                inner[p] = env[inst.operands[num]]
            site = inst.metadata
            for ci in callee.instructions:
                if ci.opcode == "parameter":
                    continue
                self._emit(comp, ci, inner, f"{prefix}{inst.name}.")
                if (site.source_file or site.stack_frame_id) and ci.opcode != "call":
                    _locate_at(comp.instructions[-1], site)
            env[inst] = inner[callee.root]  # type: ignore[index]
            return
        new = _copy(inst, prefix + inst.name, self.shape_of(inst) if self.shape_of is not None else None)
        new.operands = [env[o] for o in inst.operands]
        if inst.control_predecessors:
            new.control_predecessors = [env[p] for p in inst.control_predecessors if p in env]
        comp.instructions.append(new)
        env[inst] = new
        if inst.called:
            self.pending_calls.append((new, inst))

    def computation(self, comp: Computation) -> Computation:
        out = Computation(comp.name)
        out.is_entry = comp.is_entry
        out.execution_thread = comp.execution_thread
        out.signature = comp.signature
        out.span = comp.span
        out.module = self.new
        env: dict[Instruction, Instruction] = {}
        for inst in self.order.get(comp, comp.instructions):
            self._emit(out, inst, env, "")
        out.root = env[comp.root]  # type: ignore[index]
        return out

    def run(self) -> Module:
        reachable = _reachable(self.old)
        for comp in self.old.computations.values():
            if comp.name not in reachable:
                continue
            if self.inline and comp is not self.old.entry and comp.callers \
                    and all(c.opcode == "call" for c in comp.callers):
                continue  # only ever inlined
            self.new.computations[comp.name] = self.computation(comp)
        self.new.entry = self.new.computations[self.old.entry.name]  # type: ignore[union-attr]
        for new, old in self.pending_calls:
            for role, comps in old.called.items():
                new.called[role] = [self.new.computations[c.name] for c in comps]
                for c in new.called[role]:
                    c.callers.append(new)
        for comp in self.new.computations.values():
            _finish(comp)
        return self.new


def _reachable(module: Module) -> set[str]:
    seen: set[str] = set()
    stack = [module.entry] if module.entry is not None else []
    while stack:
        c = stack.pop()
        if c.name in seen:
            continue
        seen.add(c.name)
        for i in c.instructions:
            if i.called:
                for comps in i.called.values():
                    stack.extend(comps)
    return seen


def _finish(comp: Computation) -> None:
    """Recompute indices, names, users, parameters and the root flag."""
    by_name: dict[str, Instruction] = {}
    comp.by_name = by_name
    params = {}
    insts = comp.instructions
    for k, inst in enumerate(insts):
        inst.index = k
        inst.parent = comp
        inst.is_root = False
        inst.users = []
        by_name[inst.name] = inst
        if inst.opcode == "parameter":
            params[inst.parameter_number] = inst
    for inst in insts:
        for o in inst.operands:
            o.users.append(inst)
    if comp.root is not None:
        comp.root.is_root = True
    comp.parameters = [params[i] for i in sorted(params)]


def inline_calls(module: Module) -> Module:
    """A copy of ``module`` with every ``call`` inlined (see the module docstring)."""
    if not any(i.opcode == "call" for i in module.instructions()):
        return module
    with gc_paused():
        return _Inliner(module).run()


def reordered(module: Module, order: Mapping[Computation, Sequence[Instruction]], *,
              owned: bool = False) -> Module:
    """A copy of ``module`` whose computations list their instructions in ``order`` (a
    topological order of each computation's instructions; computations it does not name keep
    their text order), with every ``call`` inlined as :func:`inline_calls` does. The input is not
    changed; shapes, attributes and metadata are shared with it. ``owned``: the caller has just
    built ``module`` and nothing else holds it, so when there is nothing to inline or drop (no
    call, every computation reachable) it is reordered where it is (the same module the copy
    would be, without copying ~100k instructions)."""
    with gc_paused():
        if owned and _reorderable(module):
            return _reorder_in_place(module, order)
        return _Inliner(module, order).run()


def _reorderable(module: Module) -> bool:
    """Whether the copy :func:`reordered` makes has the same computations and instructions as
    ``module`` (no call to inline, no unreachable computation to drop)."""
    if module.entry is None or len(_reachable(module)) != len(module.computations):
        return False
    return not any(i.opcode == "call" for i in module.instructions())


def _reorder_in_place(module: Module, order: Mapping[Computation, Sequence[Instruction]]) -> Module:
    """:func:`reordered`'s copy, made by rewriting ``module`` (see :func:`_reorderable`): the
    instruction lists in ``order``, and what the copy recomputes (indices, users, parameters,
    names, callers in the copy's order: computations in module order, callers in their new order)."""
    comps = list(module.computations.values())
    for comp in comps:
        seq = order.get(comp)
        if seq is not None:
            if len(seq) != len(comp.instructions):
                raise ValueError(f"order of {comp.name} has {len(seq)} of its {len(comp.instructions)} instructions")
            comp.instructions = list(seq)
        comp.callers = []
    for comp in comps:
        if comp in order:  # the others keep their instructions, and with them what _finish derives
            _finish(comp)
        for inst in comp.instructions:
            if inst.called:
                for callees in inst.called.values():
                    for c in callees:
                        c.callers.append(inst)
    return module


def with_shapes(module: Module, shape_of: Callable[[Instruction], Shape]) -> Module:
    """A copy of ``module`` (same computations, same names) in which every instruction has the
    shape ``shape_of`` gives it. The input is not changed. Transforms that re-type values (TPU
    layouts, host memory space) build their module with this."""
    with gc_paused():
        return _Inliner(module, None, shape_of, inline=False).run()


@dataclass(frozen=True)
class InlineCalls:
    """Transform: inline every ``call`` (returns a new module)."""

    name: ClassVar[str] = "inline-calls"

    def run(self, module: Module) -> Module:
        return inline_calls(module)


def inline_for_assignment(module: Module) -> Module:
    """What XLA does to calls before it assigns buffers: :func:`inline_calls`, then
    :func:`forward_tuple_reads` (on the new module). ``module`` itself when it has no calls."""
    inlined = inline_calls(module)
    return module if inlined is module else _forward_tuple_reads(inlined)


def forward_tuple_reads(module: Module) -> Module:
    """A copy of ``module`` in which every read of ``get-tuple-element(tuple(...), k)`` reads the
    element itself (see :func:`_forward_tuple_reads`). The input is not changed."""
    return _forward_tuple_reads(reordered(module, {}))


def _forward_tuple_reads(module: Module) -> Module:
    """In place, on a module the caller has just built: every read of
    ``get-tuple-element(tuple(a0, ..., an), k)`` reads ``ak`` itself, and tuples and
    get-tuple-elements left without readers (not roots) are removed.

    XLA's tuple simplification does this after call inlining, so a value an inlined callee
    returned through its root tuple is read directly by its consumers (and can be fused into
    them) instead of being held as a tuple element. Reads through ``opt-barrier`` are kept: the
    barrier is what keeps ``jax.checkpoint``'s saved values apart. Returns ``module``.
    """
    with gc_paused():
        for comp in module.computations.values():
            changed = False
            for inst in comp.instructions:
                for k, o in enumerate(inst.operands):
                    while (o.opcode == "get-tuple-element" and o.operands[0].opcode == "tuple"
                           and 0 <= o.tuple_index < len(o.operands[0].operands)):
                        o = o.operands[0].operands[o.tuple_index]
                    if o is not inst.operands[k]:
                        inst.operands[k] = o
                        changed = True
            if not changed:
                continue
            # tuples and get-tuple-elements left without readers go, and so do those only they
            # read (one worklist over reader counts, then the indices and users once)
            uses: dict[Instruction, int] = {}
            for inst in comp.instructions:
                for o in inst.operands:
                    uses[o] = uses.get(o, 0) + 1
            root = comp.root
            todo = [i for i in comp.instructions if i.opcode in _TUPLE_READS and i is not root and not uses.get(i)]
            dead: set[Instruction] = set()
            while todo:
                i = todo.pop()
                if i in dead:
                    continue
                dead.add(i)
                for o in i.operands:
                    uses[o] -= 1
                    if not uses[o] and o.opcode in _TUPLE_READS and o is not root:
                        todo.append(o)
            if dead:
                comp.instructions = [i for i in comp.instructions if i not in dead]
            _finish(comp)
    return module


_TUPLE_READS = ("tuple", "get-tuple-element")
