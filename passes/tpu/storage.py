"""Where and in what type libtpu stores a value: bf16 storage of f32 values, host stacks.

* **bf16 storage** (:func:`bf16_stored`): TPU runs an f32 dot or convolution at default precision
  as one bf16 MXU pass on ``convert(operand)`` (:func:`is_bf16_matmul`). When every reader of a
  materialized f32 value (through tuples, get-tuple-elements and the optimization barriers of
  ``jax.checkpoint``) is such a matmul, the converts are one CSE'd instruction that fuses into the
  value's producer, and the buffer holds bf16: half the bytes. libtpu's compiled small zoo stores
  exactly these as bf16: mlp's relu outputs and convnet's block inputs and max-pool outputs.
  :func:`bf16_stacks`: a scan's stacked residual that the backward loop only slices for such
  matmuls is stored bf16 too (libtpu's llama steps carry them as ``bf16[L,...]`` loop state);
  ``hloopt analyze``'s prediction counts them (``TpuFusion(narrow_stacks=True)``).
  :func:`bf16_loop_weight`: stacked f32 weights loops read the same way get a bf16 copy the
  loops carry (the convert hoisted out of the loop); :mod:`hloopt.passes.tpu.msa` places it.
* **Host stacks** (:func:`host_stack_updates`): XLA's host offloader writes an offloaded value
  that a scan stacks (a ``pinned_host`` annotation read through reshapes by a
  dynamic-update-slice) straight into a stack it allocates in host memory.

Invariant: a narrowed (bf16-stored) value is an f32 array that is neither a parameter nor an
output: defined in the entry, or a bf16 stack's read in a loop body and the windows sliced from it.
"""

from __future__ import annotations

from collections.abc import Callable

from hloopt.ir import Instruction, Module
from hloopt.passes.opcodes import BARRIERS, CONTROL_FLOW, TUPLE_OPS, VIEWS, is_elementwise_dot
from hloopt.passes.residuals import is_host_annotation

#: views an offloaded value passes through on its way into a scan's stack
_HOST_VIEWS = VIEWS


def host_stack_updates(annotation: Instruction) -> tuple[list[Instruction], bool]:
    """The dynamic-update-slices a ``pinned_host`` annotation's value is written into as the update
    (through reshapes and bitcasts): a scan's stack, which XLA's host offloader puts in host
    memory. Also whether they are all its readers (then the annotation's own host array never
    exists: XLA copies the device value straight into the stack)."""
    updates, only = [], True
    for u, v in _view_readers(annotation, lambda u, v: u.opcode in _HOST_VIEWS and u.operands[0] is v) or ():
        if u.opcode == "dynamic-update-slice" and len(u.operands) > 1 and u.operands[1] is v \
                and u.operands[0] is not v:
            updates.append(u)
        else:
            only = False
    return updates, only


def _view_readers(value: Instruction, is_view: Callable[[Instruction, Instruction], bool],
                  limit: int | None = None) -> list[tuple[Instruction, Instruction]] | None:
    """``(reader, what it reads)`` for every user of ``value`` that is not a view of it, looking
    through the views (``is_view(user, read)``); None when the walk grows past ``limit`` users."""
    todo, seen, out = [value], set(), []
    while todo:
        v = todo.pop()
        for u in v.users:
            if u in seen:
                continue
            seen.add(u)
            if limit is not None and len(seen) > limit:
                return None
            if is_view(u, v):
                todo.append(u)
            else:
                out.append((u, v))
    return out


def offloaded_into_stack(inst: Instruction) -> bool:
    """A ``pinned_host`` annotation written straight into a scan's stack and read by nothing else."""
    if not is_host_annotation(inst):
        return False
    updates, only = host_stack_updates(inst)
    return bool(updates) and only

_ONE_PASS = frozenset({"default", "DEFAULT"})


def is_bf16_matmul(inst: Instruction) -> bool:
    """An f32 dot or convolution at default precision: TPU converts its operands to bf16.

    The MXU multiplies bf16; at ``DEFAULT`` precision libtpu feeds it ``convert(operand)`` (one
    pass) rather than splitting f32 into several bf16 passes as ``HIGH``/``HIGHEST`` do.
    """
    if inst.opcode not in ("dot", "convolution") or len(inst.operands) != 2:
        return False
    if is_elementwise_dot(inst):
        return False  # contracts nothing: XLA makes it a multiply, no MXU pass
    if any(o.shape.element_type != "f32" for o in inst.operands):
        return False
    prec = inst.attrs.get("operand_precision")
    if prec:
        names = [x.strip() for x in prec.strip("{}").split(",") if x.strip()]
        if any(n not in _ONE_PASS for n in names):
            return False
    return True


#: instructions through which a value reaches its readers unchanged (storage forwarding)
_PASS_THROUGH = TUPLE_OPS | BARRIERS


def _final_readers(inst: Instruction, limit: int = 64,
                   positions: dict[Instruction, dict[int, list[int]]] | None = None,
                   views: frozenset[str] = frozenset()) -> list[Instruction] | None:
    """The instructions that read ``inst``'s value, looking through tuples, get-tuple-elements and
    optimization barriers (index by index), and ops in ``views`` that read a whole array; None when
    the value leaves through anything else (a loop, a call, the root) or the walk grows past
    ``limit``. ``positions`` caches, per tuple, where each operand sits in it (a training step's
    tuples of thousands of leaves are read by each of them)."""
    if positions is None:
        positions = {}
    out: list[Instruction] = []
    todo: list[tuple[Instruction, tuple[int, ...]]] = [(inst, ())]
    seen: set[tuple[Instruction, tuple[int, ...]]] = set()
    while todo:
        node, index = todo.pop()
        if (node, index) in seen:
            continue
        seen.add((node, index))
        if len(seen) > limit or node.is_root:
            return None
        for u in node.users:
            op = u.opcode
            if op in views and not index:
                todo.append((u, ()))
            elif op == "tuple":
                where = positions.get(u)
                if where is None:
                    where = positions[u] = {}
                    for k, o in enumerate(u.operands):
                        where.setdefault(id(o), []).append(k)
                todo.extend((u, (k,) + index) for k in where.get(id(node), ()))
            elif op == "get-tuple-element":
                if not index:
                    return None
                if u.tuple_index == index[0]:
                    todo.append((u, index[1:]))
            elif op in ("opt-barrier", "optimization-barrier"):
                todo.append((u, index))
            elif index or op in CONTROL_FLOW or op == "parameter":
                return None
            else:
                out.append(u)
    return out


_STORED_VIEWS = frozenset({"bitcast", "reshape", "slice", "transpose"})


def bf16_stored(module: Module, fused: set[Instruction],
                multi_output: frozenset[Instruction] = frozenset()) -> set[Instruction]:
    """Materialized f32 values XLA stores as bf16: every reader (through tuples, optimization
    barriers and the views in ``_STORED_VIEWS``) is an f32 dot/convolution at default precision
    (:func:`is_bf16_matmul`). A value in ``multi_output`` is written by a fusion that also
    computes the reductions reading it (:func:`hloopt.passes.tpu.fusion.output_fusions`): those
    read it inside the fusion, in f32, and are no readers of the buffer, but at least one matmul
    must read it.

    A convert commutes with a reshape, slice or transpose, and XLA moves narrowing converts up
    through such ops (its ConvertMover pass) to the value itself: a fused q/k/v projection
    saved whole and sliced three ways into the attention matmuls is stored bf16 like a value
    the matmuls read directly (a flax ViT's saved ``qkv`` under ``dots_saveable``).

    TPU rewrites such readers to read ``convert(value)``; the converts, one per reader, are CSE'd
    into one, which fuses into the value's producer (a kLoop or kOutput fusion then writes bf16),
    and the f32 value is never written. This is what libtpu stores between a relu and the next
    layer's matmul or convolution, and for a rematerialized block's saved input (compiled small
    zoo: mlp's relu outputs, convnet's block inputs and max-pool outputs are bf16 buffers).
    """
    out: set[Instruction] = set()
    positions: dict[Instruction, dict[int, list[int]]] = {}
    # the entry only: loop bodies are not narrowed (their state keeps the loop's types)
    for inst in module.entry.instructions if module.entry is not None else ():
        if inst in fused or inst.opcode == "parameter" or inst.opcode in _PASS_THROUGH \
                or inst.opcode in ("bitcast", "copy") or not inst.shape.is_array \
                or inst.shape.element_type != "f32" or inst.shape.num_elements <= 1:
            continue  # forwarders and views carry their source's storage
        readers = _final_readers(inst, positions=positions, views=_STORED_VIEWS)
        if readers and inst in multi_output:
            readers = [r for r in readers if not (r.opcode == "reduce" and inst in r.operands)]
        if readers and all(is_bf16_matmul(r) for r in readers):
            out.add(inst)
    return out


#: ops a value passes through unchanged in storage on its way to a matmul (views)
_VIEWS = VIEWS
#: and what a loop step's window passes through to its layers' matmuls
_WINDOW_VIEWS = VIEWS | {"slice"}


def _is_bf16_cast(inst: Instruction) -> bool:
    """``convert`` of an f32 value to bf16: a program's own cast (mixed precision, MaxText's
    ``dtype=bfloat16`` layers over f32 weights)."""
    return inst.opcode == "convert" and inst.shape.element_type == "bf16" and bool(inst.operands) \
        and inst.operands[0].shape.element_type == "f32"


def _matmul_readers_only(value: Instruction, limit: int = 64, *, casts: bool = False) -> bool:
    """Every reader of ``value`` (through bitcasts, reshapes and slices, and through the tuple and
    optimization barrier ``jax.checkpoint`` hands a rematerialized layer's saved slice through,
    element by element) is a default-precision f32 matmul (:func:`is_bf16_matmul`), or with
    ``casts`` a cast to bf16 (:func:`_is_bf16_cast`); False when there is none, the value leaves
    through anything else, or the walk grows past ``limit``."""
    readers = _final_readers(value, limit, views=_WINDOW_VIEWS)
    if not readers:
        return False
    return all(is_bf16_matmul(u) or casts and _is_bf16_cast(u) for u in readers)


def bf16_loop_weight(value: Instruction) -> bool:
    """An f32 value that loops carry unchanged and read only by slicing it for default-precision
    matmuls (:func:`_matmul_readers_only`), or casts to bf16 (mixed precision's own
    ``astype``): a scan's stacked weights. TPU feeds those matmuls ``convert(slice)``; libtpu
    hoists the convert (the program's or its own) out of the loop, so the loops carry one bf16
    copy of the whole stack (one copy for every loop reading it: libtpu's compiled scans carry
    ``bf16[L,...]`` weights from the forward loop into the backward one). The f32 value itself
    stays for its other readers (the optimizer update). Readers other than loops do not matter;
    a loop reading the value any other way does (no copy, it reads the f32 value)."""
    if not value.shape.is_array or value.shape.element_type != "f32" or value.shape.num_elements <= 1:
        return False
    loops = 0
    for u, v in _view_readers(value, lambda u, v: u.opcode in _VIEWS, 256) or ():
        if u.opcode != "tuple" or not u.users or any(w.opcode != "while" for w in u.users):
            continue
        for w in u.users:
            body = w.callee("body")
            if body is None or body.root is None or body.root.opcode != "tuple" or not body.parameters:
                return False
            for k, o in enumerate(u.operands):
                if o is not v:
                    continue
                for g in body.parameters[0].users:
                    if g.opcode != "get-tuple-element" or g.tuple_index != k:
                        continue
                    for r in g.users:
                        if r is body.root and k < len(r.operands) and r.operands[k] is g:
                            continue  # carried through unchanged
                        if r.opcode != "dynamic-slice" or r.operands[0] is not g \
                                or not _matmul_readers_only(r, casts=True):
                            return False
                if k >= len(body.root.operands) or not _is_slot(body.root.operands[k], k):
                    return False  # the loop writes the slot
            loops += 1
    return loops > 0


def _is_slot(inst: Instruction, k: int) -> bool:
    return inst.opcode == "get-tuple-element" and inst.tuple_index == k and bool(inst.operands) \
        and inst.operands[0].opcode == "parameter"


def bf16_stacks(module: Module) -> set[Instruction]:
    """The dynamic-update-slices that write a scan's stacked residual libtpu stores as bf16, and
    the backward loop's reads of that stack: the stack a forward loop fills (loop state ``k``,
    updated in place by a dynamic-update-slice) is passed whole to a backward loop, which only
    slices it, and every slice is read by default-precision f32 matmuls alone. As for
    :func:`bf16_stored`, TPU feeds those matmuls ``convert(slice)``, and libtpu stores the stack
    converted (its compiled llama steps carry such stacks as ``bf16[L,...]`` loop state, allocated
    with ``AllocateBuffer``). Marking the update narrows the forward loop's state buffer; the
    backward loop's state is its own buffer, narrowed through its ``get-tuple-element``."""
    entry = module.entry
    if entry is None:
        return set()
    out: set[Instruction] = set()
    for w in entry.instructions:
        body = w.callee("body") if w.opcode == "while" else None
        if body is None or body.root is None or body.root.opcode != "tuple" or not body.parameters:
            continue
        param = body.parameters[0]
        for k, upd in enumerate(body.root.operands):
            if upd.opcode != "dynamic-update-slice" or upd.shape.element_type != "f32" or not upd.operands:
                continue
            base = upd.operands[0]
            if base.opcode != "get-tuple-element" or base.operands[0] is not param or base.tuple_index != k:
                continue
            reads = _backward_stack_reads(w, k)
            if reads:
                out.add(upd)
                out.update(reads)
    return out


def _backward_stack_reads(w: Instruction, k: int) -> list[Instruction] | None:
    """The ``get-tuple-element`` reads of stack ``k`` of forward loop ``w`` in the loops that
    consume it, when every use slices it for matmuls only (:func:`bf16_stacks`); else None."""
    results = [u for u in w.users if u.opcode == "get-tuple-element" and u.tuple_index == k]
    if not results or any(u.opcode != "get-tuple-element" for u in w.users):
        return None
    reads: list[Instruction] = []
    for r in results:
        for t in r.users:
            if t.opcode != "tuple" or len(t.users) != 1 or t.users[0].opcode != "while":
                return None
            w2 = t.users[0]
            body = w2.callee("body")
            if body is None or body.root is None or not body.parameters:
                return None
            for j, o in enumerate(t.operands):
                if o is not r:
                    continue
                gtes = [u for u in body.parameters[0].users if u.opcode == "get-tuple-element" and u.tuple_index == j]
                for g in gtes:
                    for u in g.users:
                        if u is body.root and body.root.operands[j] is g:
                            continue  # carried through unchanged
                        if u.opcode != "dynamic-slice" or u.operands[0] is not g or not _matmul_readers_only(u):
                            return None
                        reads.extend(_slices_of(u))
                    reads.append(g)
    return reads or None


def _slices_of(window: Instruction) -> list[Instruction]:
    """A bf16 stack's window and what views and slices of it a loop step materializes (the
    operands of a remat's barrier): bf16 as the stack is."""
    out, todo = [window], [window]
    while todo:
        v = todo.pop()
        for u in v.users:
            if (u.opcode in _VIEWS or u.opcode == "slice") and u not in out:
                out.append(u)
                todo.append(u)
    return out


__all__ = ["bf16_loop_weight", "bf16_stacks", "bf16_stored", "host_stack_updates", "is_bf16_matmul",
           "offloaded_into_stack"]
