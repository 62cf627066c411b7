"""Values and buffers: which HLO positions share storage (XLA's HloDataflow/HloAliasAnalysis, simplified).

A *position* is (instruction, shape index): every node of an instruction's shape, tuple nodes
included (a tuple's own storage is its index table, 8 bytes per element). A position either
*defines* a new value or *aliases* a position it takes its storage from. A *buffer* is a set of
positions that must share one allocation; its size is its largest defining value.

What aliases (everything else defines a value):

* ``tuple`` {i,...} = operand i {...} (its {} is a fresh index table), and so a Shardy
  ``shard_map`` boundary's (``GlobalToLocalShape``, ``LocalToGlobalShape``: per device the
  operand is its own shard); ``get-tuple-element`` {...}
  = operand {k,...}; ``bitcast``, ``opt-barrier``, ``domain``, ``add-dependency`` = operand 0.
* ``while``: body parameter, body root, condition parameter and the while's result share one
  buffer per shape index (the loop state), as XLA's copy insertion leaves them
  (``AddCopiesForWhile`` copies every slot the body changes, ``RemoveUnnecessaryCopies`` drops
  the copies whose live ranges do not interfere). The init value *is* the slot's buffer when the
  body hands the slot back unchanged, or when the value is free to be overwritten; the slot gets
  a buffer of its own (the init is copied in) when the init value is read-only (an entry
  parameter that is not donated, a constant), starts another slot too (one zeros array starting
  several accumulators), or is read after the loop. The body root's value becomes the slot in
  place unless it is another slot's value or read-only (a swap, a constant): then it is copied.
  Loops are resolved after every other instruction, outer loops first.
  ``conditional``: each branch parameter = its operand,
  the result = every branch root; ``call``: callee parameters = operands, result = callee root.
* fusions allocate only their outputs (their computations are not visited), except in place:
  a fusion whose root (or root tuple element) is ``dynamic-update-slice`` / ``scatter`` updating a
  fusion parameter writes into that operand's buffer, as do unfused ``dynamic-update-slice`` /
  ``scatter`` and custom-calls with ``output_to_operand_aliasing``. In-place sharing is skipped
  when the operand is an entry parameter that is not donated (XLA would insert a copy).
* the module's ``input_output_alias`` (donation): the output position and the parameter share.
* async pairs: ``copy-start`` is (destination, source, context): {1} = the operand, {0} and {2}
  are new; ``copy-done`` = start {0}. Generic ``async-start`` ((operands), outputs, context):
  {0,k} = operand k; ``*-done`` = start {1} (or the start itself when it is not a tuple). An
  async in-place update (``dynamic-update-slice-start``, or an ``async-start`` wrapping a
  dynamic-update-slice/scatter of its parameter 0) also has {1} = operand 0: always, not only with
  ``in_place``, since the start holds its operand until the done (buffer assignment's one
  allocation for the pair).

Only computations reached from the entry through ``while``/``conditional``/``call`` are visited;
reducers, fusion bodies and async-wrapped computations are code, not storage.

Memory spaces come from the defining value's layout: 0 is device memory (HBM), ``S(5)`` host
memory (a buffer with several definitions is host memory when any is: loop state a body writes in
host memory, as a scan's offloaded stack); other spaces (TPU VMEM ``S(1)``, SMEM ``S(2)``...) are on-chip
scratch and counted apart.

Invariant: every position of a visited instruction belongs to exactly one buffer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from hloopt.ir import HOST_MEMORY_SPACE, Computation, Instruction, Module, Shape, gc_paused
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.opcodes import BARRIERS, CONTROL_FLOW, is_shard_map_boundary

ShapeIndex = tuple[int, ...]

#: opcodes whose whole shape is the operand's storage
_PASS_THROUGH = BARRIERS | {"bitcast", "domain", "add-dependency"}
#: opcodes :meth:`_Builder.visit` aliases (with the async ``*-start``/``*-done``; everything
#: else defines its own values unless ``in_place``)
_ALIASING_OPS = _PASS_THROUGH | {"get-tuple-element", "tuple", "conditional", "call", "copy-start", "async-update"}
_ASYNC_SUFFIXES = ("-start", "-done")
#: opcodes updating operand 0 in place
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})

@dataclass(frozen=True, slots=True, eq=False)
class Buffer:
    """One allocation: positions that share storage."""

    id: int
    #: bytes of the allocation (largest defining value)
    size_bytes: int
    #: layout memory space: 0 device, 5 host, others on-chip scratch
    memory_space: int
    #: the defining position that names the buffer (entry computation preferred)
    instruction: Instruction
    index: ShapeIndex
    shape: Shape
    #: every defining position (instruction, shape index)
    values: tuple[tuple[Instruction, ShapeIndex], ...]
    #: entry parameter number when the buffer holds an entry parameter, else -1
    parameter: int = -1
    #: entry output indices this buffer is part of (empty: not a module output)
    output_indices: tuple[ShapeIndex, ...] = ()

    @property
    def on_host(self) -> bool:
        return self.memory_space == HOST_MEMORY_SPACE

    @property
    def on_device(self) -> bool:
        return self.memory_space == 0

    @property
    def is_tuple_table(self) -> bool:
        return self.shape.is_tuple

    def __repr__(self) -> str:
        idx = "{" + ",".join(map(str, self.index)) + "}"
        return f"<Buffer {self.id} {self.instruction.name}{idx} {self.shape} {self.size_bytes}B>"


_BUFFER_FIELDS = ("id", "size_bytes", "memory_space", "instruction", "index", "shape", "values", "parameter",
                  "output_indices")
(_set_id, _set_size, _set_space, _set_inst, _set_index, _set_shape, _set_values, _set_param,
 _set_outputs) = (getattr(Buffer, f).__set__ for f in _BUFFER_FIELDS)


def _new_buffer(id: int, size_bytes: int, memory_space: int, instruction: Instruction, index: ShapeIndex,
                shape: Shape, values: tuple[tuple[Instruction, ShapeIndex], ...], parameter: int,
                output_indices: tuple[ShapeIndex, ...]) -> Buffer:
    """``Buffer(...)`` without the frozen dataclass's ``object.__setattr__`` per field (the slots'
    own setters): a training step has tens of thousands of buffers."""
    buf = object.__new__(Buffer)
    _set_id(buf, id)
    _set_size(buf, size_bytes)
    _set_space(buf, memory_space)
    _set_inst(buf, instruction)
    _set_index(buf, index)
    _set_shape(buf, shape)
    _set_values(buf, values)
    _set_param(buf, parameter)
    _set_outputs(buf, output_indices)
    return buf


@dataclass(eq=False)
class Aliasing:
    """Result of :class:`BufferAliasing`: the buffers and which buffer each position uses."""

    module: Module
    buffers: list[Buffer]
    #: computations whose instructions hold storage (entry and control-flow callees)
    computations: list[Computation]
    #: per visited instruction, the buffer id of each of its positions (pre-order of its shape)
    position_buffers: dict[Instruction, tuple[int, ...]] = field(default_factory=dict)

    def buffer_at(self, inst: Instruction, index: ShapeIndex = ()) -> Buffer:
        """The buffer holding ``inst`` at shape ``index``."""
        return self.buffers[self.position_buffers[inst][_offsets(inst.shape)[1][index]]]

    def buffers_of(self, inst: Instruction) -> list[Buffer]:
        """Distinct buffers of every position of ``inst``."""
        return [self.buffers[b] for b in dict.fromkeys(self.position_buffers[inst])]


# Shape -> (indices in pre-order, index -> offset); shapes are interned by the parser.
_OFFSETS: dict[Shape, tuple[list[ShapeIndex], dict[ShapeIndex, int]]] = {}
#: the offsets of every array shape: one position, {}
_ARRAY_OFFSETS: tuple[list[ShapeIndex], dict[ShapeIndex, int]] = ([()], {(): 0})


def _offsets(shape: Shape) -> tuple[list[ShapeIndex], dict[ShapeIndex, int]]:
    if shape.element_type != "tuple":
        return _ARRAY_OFFSETS
    got = _OFFSETS.get(shape)
    if got is None:
        idx = [i for i, _ in shape.subshapes()]
        got = (idx, {i: k for k, i in enumerate(idx)})
        if len(_OFFSETS) < 200_000:
            _OFFSETS[shape] = got
    return got


_IO_ALIAS = re.compile(r"\{([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{([\d,\s]*)\}")


def _ints(text: str) -> ShapeIndex:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


@dataclass(frozen=True)
class BufferAliasing(Analysis[Aliasing]):
    """Group HLO positions into buffers (see the module docstring)."""

    name: ClassVar[str] = "buffer-aliasing"
    #: merge in-place updates (dynamic-update-slice/scatter roots, custom-call aliasing) into
    #: their operand's buffer. XLA's alias analysis keeps them apart (buffer assignment shares
    #: them later when the operand dies there; see Liveness(share=...)), so off by default.
    in_place: bool = False

    def run(self, module: Module, am: AnalysisManager) -> Aliasing:
        with gc_paused():
            return _Builder(module, in_place=self.in_place).build()


class _Builder:
    def __init__(self, module: Module, *, in_place: bool) -> None:
        self.module = module
        self.in_place = in_place
        self.base: dict[Instruction, int] = {}
        self.slot_inst: list[Instruction] = []
        self.slot_index: list[ShapeIndex] = []
        self.parent: list[int] = []
        self.defines: list[bool] = []
        #: instruction -> _offsets(its shape): hashing a large tuple Shape on every lookup was a
        #: third of the aliasing time on 40k-instruction modules; instructions hash by identity
        self.offsets: dict[Instruction, tuple[list[ShapeIndex], dict[ShapeIndex, int]]] = {}

    def _offsets(self, inst: Instruction) -> tuple[list[ShapeIndex], dict[ShapeIndex, int]]:
        got = self.offsets.get(inst)
        if got is None:
            got = self.offsets[inst] = _offsets(inst.shape)
        return got

    # -- union-find ------------------------------------------------------------------------------
    def find(self, s: int) -> int:
        parent = self.parent
        root = s
        while parent[root] != root:
            root = parent[root]
        while parent[s] != root:
            parent[s], s = root, parent[s]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            if ra < rb:
                self.parent[rb] = ra
            else:
                self.parent[ra] = rb

    def slot(self, inst: Instruction, index: ShapeIndex = ()) -> int | None:
        base = self.base.get(inst)
        if base is None:
            return None
        off = self._offsets(inst)[1].get(index)
        return None if off is None else base + off

    def alias(self, inst: Instruction, index: ShapeIndex, src: Instruction, src_index: ShapeIndex) -> None:
        """Position (inst, index) takes its storage from (src, src_index)."""
        a, b = self.slot(inst, index), self.slot(src, src_index)
        if a is None or b is None:
            return
        self.defines[a] = False
        self.union(a, b)

    def alias_all(self, inst: Instruction, src: Instruction, prefix: ShapeIndex = ()) -> None:
        for idx in self._offsets(inst)[0]:
            self.alias(inst, idx, src, prefix + idx)

    def share(self, a_inst: Instruction, a_idx: ShapeIndex, b_inst: Instruction, b_idx: ShapeIndex) -> None:
        """Both positions keep defining values but share one buffer (loop state, branch results)."""
        a, b = self.slot(a_inst, a_idx), self.slot(b_inst, b_idx)
        if a is not None and b is not None:
            self.union(a, b)

    # -- build -----------------------------------------------------------------------------------
    def build(self) -> Aliasing:
        comps = control_flow_computations(self.module)
        base, slot_inst, slot_index = self.base, self.slot_inst, self.slot_index
        for comp in comps:
            for inst in comp.instructions:
                base[inst] = len(slot_inst)
                if inst.shape.element_type != "tuple":
                    slot_inst.append(inst)
                    slot_index.append(())
                else:
                    indices = self._offsets(inst)[0]
                    slot_inst.extend([inst] * len(indices))
                    slot_index.extend(indices)
        self.parent = list(range(len(slot_inst)))
        self.defines = [True] * len(slot_inst)
        entry = self.module.entry
        whiles: list[Instruction] = []
        visit_all = self.in_place
        for comp in comps:
            for inst in comp.instructions:
                op = inst.opcode
                if op == "while":
                    whiles.append(inst)
                elif visit_all or op in _ALIASING_OPS or op.endswith(_ASYNC_SUFFIXES) \
                        or is_shard_map_boundary(inst):
                    self.visit(inst)  # others define their values: nothing to alias
        # Loop state last, outer loops first: whether a slot needs a copy depends on which
        # buffers the init and the body root already are (copy insertion, module docstring).
        for inst in whiles:
            self.visit_while(inst)
        if entry is not None and entry.root is not None:
            self.donations(entry)
        return self.collect(comps)

    def visit(self, inst: Instruction) -> None:
        op = inst.opcode
        ops = inst.operands
        if op == "get-tuple-element" and ops:
            self.alias_all(inst, ops[0], (inst.tuple_index,))
        elif op == "tuple" or is_shard_map_boundary(inst):
            for k, o in enumerate(ops):
                for idx in self._offsets(o)[0]:
                    self.alias(inst, (k,) + idx, o, idx)
        elif op in _PASS_THROUGH and ops:
            self.alias_all(inst, ops[0])
        elif op == "while":
            self.visit_while(inst)
        elif op == "conditional":
            for k, branch in enumerate(inst.called.get("branch_computations", [])):
                if branch.parameters and k + 1 < len(ops):
                    self.alias_all(branch.parameters[0], ops[k + 1])
                if branch.root is not None:
                    for idx in self._offsets(inst)[0]:
                        self.share(inst, idx, branch.root, idx)
        elif op == "call":
            for callee in inst.called.get("calls", []) or inst.called.get("to_apply", []):
                for p in callee.parameters:
                    if p.parameter_number < len(ops):
                        self.alias_all(p, ops[p.parameter_number])
                if callee.root is not None:
                    self.alias_all(inst, callee.root)
        elif op == "copy-start" and ops:
            self.alias(inst, (1,), ops[0], ())
        elif op.endswith("-start") and ops and inst.shape.is_tuple:
            first = inst.shape.tuple_shapes[0]
            # async-start's {0} is the tuple of its operands (even of one operand: ``((f32[..]),
            # out, ctx)``, as libtpu's slice-start), {0} itself is a fresh index table
            if first.is_tuple and len(first.tuple_shapes) == len(ops):
                for k, o in enumerate(ops):
                    for idx in self._offsets(o)[0]:
                        self.alias(inst, (0, k) + idx, o, idx)
            elif len(ops) == 1 or op != "async-start":
                for idx in self._offsets(ops[0])[0]:
                    self.alias(inst, (0,) + idx, ops[0], idx)
            # An asynchronous in-place update (libtpu's dynamic-update-slice-start into a host
            # stack) writes its result into operand 0's buffer. Unlike the synchronous one it is
            # shared even without ``in_place``: the start keeps its operand alive until the done,
            # so two buffers would overlap for the whole transfer, and buffer assignment gives
            # them one allocation (libtpu's dump: the AllocateBuffer and every update of the stack
            # at one offset).
            if len(inst.shape.tuple_shapes) >= 2 and _async_in_place(inst):
                self.share_in_place(inst, (1,), ops[0])
        elif op == "async-update" and ops:
            self.alias_all(inst, ops[0])
        elif op.endswith("-done") and ops:
            start = ops[0]
            if start.shape.is_tuple and len(start.shape.tuple_shapes) >= 2:
                src = (0,) if start.opcode == "copy-start" else (1,)
                self.alias_all(inst, start, src)
            else:
                self.alias_all(inst, start)
        elif self.in_place:
            self.visit_in_place(inst)

    def visit_while(self, inst: Instruction) -> None:
        """Loop state: one buffer per shape index, with XLA's copy insertion (module docstring)."""
        if not inst.operands:
            return
        init = inst.operands[0]
        body = inst.callee("body")
        cond = inst.callee("condition")
        params = [c.parameters[0] for c in (body, cond) if c is not None and c.parameters]
        root = body.root if body is not None else None
        body_param = body.parameters[0] if body is not None and body.parameters else None
        indices = self._offsets(inst)[0]
        leaves = [idx for idx in indices if not inst.shape.at(idx).is_tuple]
        readonly = self._readonly_roots()

        def passes_through(idx: ShapeIndex) -> bool:
            # the body hands the slot back unchanged (root {idx} is the parameter's {idx})
            if root is None or body_param is None:
                return False
            a, b = self.slot(root, idx), self.slot(body_param, idx)
            return a is not None and b is not None and self.find(a) == self.find(b)

        def init_root(idx: ShapeIndex) -> int | None:
            s = self.slot(init, idx)
            return None if s is None else self.find(s)

        through = {idx for idx in leaves if passes_through(idx)}
        # A value the body never changes stays where it is; every other slot writes its buffer,
        # so it needs its own unless the init value is free to take: not read-only (an entry
        # parameter that is not donated, a constant), not already another slot's, not read
        # after the loop.
        claimed = {init_root(idx) for idx in through}
        copied: set[ShapeIndex] = set()
        for idx in leaves:
            if idx in through:
                continue
            r = init_root(idx)
            if r is None or r in claimed or r in readonly or self._read_after(init, idx, inst):
                copied.add(idx)
            claimed.add(r)
        for idx in indices:
            if idx in copied:
                for p in params:  # the state's own buffer, defined by the loop
                    self.alias(p, idx, inst, idx)
            else:
                self.alias(inst, idx, init, idx)
                for p in params:
                    self.alias(p, idx, init, idx)
        if root is None:
            return
        # The body's result becomes the next iteration's state in place, unless it is another
        # slot's value, or read-only: then XLA copies it into the slot.
        state = {self.find(s) for idx in leaves if (s := self.slot(inst, idx)) is not None}
        for idx in indices:
            a, b = self.slot(inst, idx), self.slot(root, idx)
            if a is None or b is None:
                continue
            ra, rb = self.find(a), self.find(b)
            if ra == rb:
                continue
            if idx in leaves and (rb in state or rb in readonly):
                continue
            self.union(a, b)
            if ra in state:
                state.discard(ra)
                state.add(self.find(a))

    def _readonly_roots(self) -> set[int]:
        """Buffers nothing may write: undonated entry parameters and constants."""
        if not hasattr(self, "_readonly_slots"):
            entry = self.module.entry
            donated = {a.parameter_number for a in self.module.input_output_alias}
            slots: list[int] = []
            for inst, base in self.base.items():
                if inst.opcode == "constant" or (inst.opcode == "parameter" and inst.parent is entry
                                                 and inst.parameter_number not in donated):
                    slots.extend(range(base, base + len(self._offsets(inst)[0])))
            self._readonly_slots = slots
        return {self.find(s) for s in self._readonly_slots}

    def _read_after(self, init: Instruction, idx: ShapeIndex, loop: Instruction) -> bool:
        """Whether the value at ``init`` {idx} has a reader after ``loop`` in its computation."""
        src = init
        while src.opcode == "tuple" and idx and idx[0] < len(src.operands):
            src, idx = src.operands[idx[0]], idx[1:]
        comp = loop.parent
        if src.parent is not comp or comp is None:
            return False
        order = self._order(comp)
        at = order.get(loop, -1)
        return any(u is not init and order.get(u, -1) > at for u in src.users)

    def _order(self, comp: Computation) -> dict[Instruction, int]:
        cache: dict[Computation, dict[Instruction, int]] = self.__dict__.setdefault("_orders", {})
        got = cache.get(comp)
        if got is None:
            got = cache[comp] = {inst: k for k, inst in enumerate(comp.instructions)}
        return got

    def visit_in_place(self, inst: Instruction) -> None:
        op = inst.opcode
        if op in _IN_PLACE and inst.operands and not inst.shape.is_tuple:
            self.share_in_place(inst, (), inst.operands[0])
        elif op == "fusion":
            comp = inst.callee("calls")
            if comp is None or comp.root is None:
                return
            root = comp.root
            outs = list(enumerate(root.operands)) if root.opcode == "tuple" else [(None, root)]
            for k, out in outs:
                out = _through_bitcasts(out)
                if out.opcode in _IN_PLACE and out.operands:
                    src = _through_bitcasts(out.operands[0])
                    if src.opcode == "parameter" and 0 <= src.parameter_number < len(inst.operands):
                        operand = inst.operands[src.parameter_number]
                        if operand.shape.byte_size >= (inst.shape.at((k,)) if k is not None else inst.shape).byte_size:
                            self.share_in_place(inst, () if k is None else (k,), operand)
        elif op == "custom-call" and "output_to_operand_aliasing" in inst.attrs:
            for out_idx, k, op_idx in _IO_ALIAS.findall(inst.attrs["output_to_operand_aliasing"]):
                k_ = int(k)
                if k_ < len(inst.operands):
                    self.share_in_place(inst, _ints(out_idx), inst.operands[k_], _ints(op_idx))

    def share_in_place(self, inst: Instruction, index: ShapeIndex, operand: Instruction,
                       operand_index: ShapeIndex = ()) -> None:
        b = self.slot(operand, operand_index)
        if b is None:
            return
        if self._holds_undonated_parameter(self.find(b)):
            return
        self.share(inst, index, operand, operand_index)

    def _holds_undonated_parameter(self, root: int) -> bool:
        # Cheap check through the root's defining instruction chain: walk the slots only once.
        if not hasattr(self, "_param_roots"):
            entry = self.module.entry
            donated = {a.parameter_number for a in self.module.input_output_alias}
            self._param_roots: list[tuple[int, bool]] = []
            if entry is not None:
                for p in entry.parameters:
                    s = self.base.get(p)
                    if s is not None:
                        for off in range(len(self._offsets(p)[0])):
                            self._param_roots.append((s + off, p.parameter_number in donated))
        return any(not d and self.find(s) == root for s, d in self._param_roots)

    def donations(self, entry: Computation) -> None:
        root = entry.root
        assert root is not None
        params = {p.parameter_number: p for p in entry.parameters}
        for a in self.module.input_output_alias:
            p = params.get(a.parameter_number)
            if p is not None:
                self.share(root, a.output_index, p, a.parameter_index)

    def collect(self, comps: list[Computation]) -> Aliasing:
        n = len(self.slot_inst)
        parent, defines = self.parent, self.defines
        # Buffers are numbered by their smallest slot. union() hangs the larger root under the
        # smaller and find() only shortens paths, so a slot's parent is never a larger slot:
        # one forward pass gives every slot its buffer (its parent's, already known), and a
        # root (its own parent) starts the next buffer.
        bid = [0] * n
        members_def: list[list[int]] = []
        for s in range(n):
            p = parent[s]
            if p == s:
                bid[s] = len(members_def)
                members_def.append([s] if defines[s] else [])
            else:
                b = bid[s] = bid[p]
                if defines[s]:
                    members_def[b].append(s)
        entry = self.module.entry
        param_of: dict[int, int] = {}
        outputs: dict[int, list[ShapeIndex]] = {}
        if entry is not None:
            for param in entry.parameters:
                base = self.base[param]
                for off in range(len(self._offsets(param)[0])):
                    param_of.setdefault(bid[base + off], param.parameter_number)
            if entry.root is not None:
                base = self.base[entry.root]
                for off, idx in enumerate(self._offsets(entry.root)[0]):
                    outputs.setdefault(bid[base + off], []).append(idx)
        buffers: list[Buffer] = []
        inst_of, index_of = self.slot_inst, self.slot_index
        for b, defs in enumerate(members_def):
            if not defs:  # only aliases of something outside the visited code (should not happen)
                defs = [s for s in range(n) if bid[s] == b][:1]
            main = defs[0]
            if len(defs) == 1:
                main_shape = inst_of[main].shape.at(index_of[main])
                size = main_shape.byte_size
                values: tuple[tuple[Instruction, ShapeIndex], ...] = ((inst_of[main], index_of[main]),)
            else:
                for s in defs:
                    if inst_of[s].parent is entry:
                        main = s
                        break
                main_shape = inst_of[main].shape.at(index_of[main])
                size = max(inst_of[s].shape.at(index_of[s]).byte_size for s in defs)
                values = tuple((inst_of[s], index_of[s]) for s in defs)
            space = main_shape.memory_space
            if len(defs) > 1 and not main_shape.on_host and any(inst_of[s].shape.at(index_of[s]).on_host for s in defs):
                space = HOST_MEMORY_SPACE  # loop state a body writes in host memory (a scan's offloaded stack)
            out = outputs.get(b)
            buffers.append(_new_buffer(b, size, space, inst_of[main], index_of[main], main_shape, values,
                                       param_of.get(b, -1), tuple(out) if out else ()))
        ends = list(self.base.values())[1:] + [n]
        position_buffers = {inst: tuple(bid[base:end]) for (inst, base), end in zip(self.base.items(), ends)}
        return Aliasing(self.module, buffers, comps, position_buffers)


def _async_in_place(start: Instruction) -> bool:
    """Whether an async start wraps an update of its operand 0 in place (its output {1} is that
    operand's buffer): ``dynamic-update-slice-start`` / ``scatter-start``, or a generic
    ``async-start`` whose computation's root is such an update of parameter 0."""
    out = start.shape.tuple_shapes[1]
    if out.is_tuple or start.operands[0].shape.is_tuple or start.operands[0].shape.dims != out.dims:
        return False
    if start.opcode in ("dynamic-update-slice-start", "scatter-start"):
        return True
    if start.opcode != "async-start":
        return False
    comp = start.callee("calls")
    root = None if comp is None or comp.root is None else _through_bitcasts(comp.root)
    if root is None or root.opcode not in _IN_PLACE or not root.operands:
        return False
    src = _through_bitcasts(root.operands[0])
    return src.opcode == "parameter" and src.parameter_number == 0


def _through_bitcasts(inst: Instruction) -> Instruction:
    while inst.opcode in ("bitcast", "reshape") and inst.operands:
        inst = inst.operands[0]
    return inst


def control_flow_computations(module: Module) -> list[Computation]:
    """The entry and every computation it reaches through ``while``/``conditional``/``call``
    (the computations whose instructions hold storage; reducers and fusion bodies are code), in
    discovery order."""
    entry = module.entry
    if entry is None:
        return []
    seen: dict[Computation, None] = {entry: None}
    stack = [entry]
    while stack:
        comp = stack.pop()
        for inst in comp.instructions:
            if inst.opcode in CONTROL_FLOW:
                for callee in inst.called_computations:
                    if callee not in seen:
                        seen[callee] = None
                        stack.append(callee)
    return list(seen)


__all__ = ["Aliasing", "Buffer", "BufferAliasing", "CONTROL_FLOW", "ShapeIndex", "control_flow_computations"]
