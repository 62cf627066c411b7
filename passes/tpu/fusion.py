"""Which values libtpu materializes in HBM, predicted from a pre-optimization module.

``hloopt plan`` and ``hloopt analyze --platform tpu`` work on the HLO JAX lowers (no layouts, no
fusions, global shapes of an SPMD program). :class:`TpuFusion` says, for every instruction of such
a module, whether libtpu will give its value an HBM buffer and how many bytes per device that
buffer takes: the :class:`FusionPlan` generic liveness takes
(``Liveness(fusion=TpuFusion(...))``) and counts buffers with.

* **Fusion** (:func:`fused_instructions`): an instruction is *fused away* (holds no HBM buffer;
  its readers read its inputs instead) when it is a cheap element-wise or data-movement op that
  XLA's instruction fusion puts into its consumers (:data:`hloopt.passes.opcodes.FUSIBLE`), a
  sharding marker, or the one-hot scatter of ``take_along_axis``'s gradient
  (:func:`is_one_hot_scatter`), which XLA rewrites into a compare/select, or a dot that contracts
  nothing (:func:`is_elementwise_dot`), which it rewrites into a multiply. It stays materialized
  when it feeds loop state, a tuple or the root (XLA writes the last fused op there), unless it is
  a scalar or a constant, or a reshape that only regroups major dimensions (a bitcast under TPU
  tiling) of a value loops read unchanged (:func:`is_invariant_state_view`: a scan with
  ``unroll`` > 1 over stacked weights), and when one of its readers is a select-and-scatter (the max-pool
  gradient), into which nothing fuses: XLA fuses a producer into all its readers or none.
  A fusion reads a bounded number of buffers (:func:`cap_fusion_inputs`): a chain of cheap ops
  over more than :data:`MAX_FUSION_INPUTS` materialized values (an optimizer's global gradient
  norm, a sum of squares over every parameter leaf) is computed once into a buffer of its own,
  not into each of its readers.
  Reductions, dots, convolutions, gathers/scatters, dynamic-(update-)slices, sorts, loops and
  calls are fusion roots: they hold their result, except a dynamic-slice read only by static
  slices (:func:`is_sliced_window`), which XLA folds into them, and a matmul whose every reader
  is a fused-away element-wise op (:func:`output_fusions`): libtpu computes it in one output
  fusion with that element-wise chain and writes only the chain's end.
* **Model inputs copied for convolutions** (:func:`convolution_input_copies`): a convolution reads
  its input with the contracted dimension tiled; an entry parameter read (through transposes)
  with that dimension elsewhere, an NCHW image, is copied once into the convolutions' layout.
* **Layout boundaries** (:func:`layout_boundaries`): libtpu rewrites a forward convolution over a
  batch below the 8 sublanes into another layout (spatial rows folded into the batch, ``0b1f``)
  and computes the element-wise values after it in that layout; a value of that region read
  outside it cannot fuse across the layout change: libtpu materializes it and copies it to the
  batch/feature-minor layout. Those values are materialized here, laid out like the convolution.
* **Sizes**: each materialized value at its per-device shape (:func:`hloopt.spmd.shard_dims` of
  the propagated sharding), in the most compact tiled layout (:mod:`hloopt.passes.tpu.layout`)
  or the one its convolutions read it in, bf16 where libtpu stores it so
  (:mod:`hloopt.passes.tpu.storage`).

Code size: libtpu's ``peak_memory_in_bytes`` includes the program's generated code, which is
unknowable before compiling (15-60% of the tiny zoo models' peak, well under 1% of a real
model's). The model predicts the peak *without* code; tests compare it with XLA's peak minus
XLA's code size.

Invariants: a fused-away instruction is never an entry parameter, a module output, loop state or
a computation's root; ``value_bytes`` is a positive multiple of ``alignment_bytes`` for arrays,
and never more than the global unsharded tiled size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from hloopt.ir import Instruction, Module
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.aliasing import Buffer
from hloopt.passes.opcodes import CONTROL_FLOW, FUSIBLE, is_elementwise_dot, is_identity_call, is_shard_map_boundary
from hloopt.passes.residuals import offloaded_source
from hloopt.passes.tpu.layout import activation_minor_dims, tpu_compact_bytes, tpu_layout_bytes
from hloopt.passes.tpu.storage import bf16_stacks, bf16_stored, offloaded_into_stack
from hloopt.spmd import Split, propagate_shardings, shard_dims, split_element


def is_one_hot_scatter(inst: Instruction) -> bool:
    """A scatter XLA turns into an elementwise compare/select: the gradient of ``take_along_axis``.

    It scatters scalars (no update window) into a broadcast scalar along ONE dimension, every
    other dimension a batching dimension: each slice along that dimension receives exactly one
    update, so the result is ``select(iota == index, update, fill)``, elementwise, and fuses into
    its readers like one (libtpu's compiled zoo has no such scatter and no buffer for it).
    """
    if inst.opcode != "scatter" or len(inst.operands) != 3 or not inst.shape.is_array:
        return False
    base = inst.operands[0]
    if base.opcode != "broadcast" or not base.operands or base.operands[0].shape.dims:
        return False
    if inst.attr_ints("update_window_dims"):
        return False
    scattered = inst.attr_ints("scatter_dims_to_operand_dims")
    batching = inst.attr_ints("input_batching_dims")
    rank = len(inst.shape.dims)
    return len(scattered) == 1 and sorted(list(scattered) + list(batching)) == list(range(rank))



#: readers no producer fuses into on TPU: the max-pool gradient (libtpu's compiled ResNet writes
#: the relu output its pool and that pool's gradient read to a buffer of its own)
_NOT_FUSION_CONSUMERS = frozenset({"select-and-scatter"})

#: readers through which a value becomes loop state or a tuple element (with the root: stays materialized)
_STATE_READERS = CONTROL_FLOW | {"tuple", "parameter"}


#: the most materialized values one fused computation reads. XLA bounds a fusion's operands (its
#: GPU backend at 96, ``kMaxOperandsAndOutputsPerFusion``; libtpu's bound is not published): a
#: fused chain reading more is materialized where the bound is reached. Real steps reach it only
#: in reductions over every parameter leaf (the global norm of ``clip_by_global_norm``), whose
#: value is a scalar, so the bytes it moves are nil; without it every reader of such a scalar
#: would read all the leaves, which no fusion does, and the schedule's work grows as leaves x
#: readers.
MAX_FUSION_INPUTS = 96


def cap_fusion_inputs(module: Module, fused: set[Instruction]) -> set[Instruction]:
    """The members of ``fused`` that would read more than :data:`MAX_FUSION_INPUTS` materialized
    values if computed inside their readers (through chains of fused operands): libtpu gives
    them a buffer. Linear in the module: a read set stops growing at the bound."""
    over: set[Instruction] = set()
    for comp in module.computations.values():
        reads: dict[Instruction, set[Instruction]] = {}
        for inst in comp.instructions:  # operands come first in the text
            if inst not in fused:
                continue
            acc: set[Instruction] = set()
            for o in inst.operands:
                if o in reads:
                    acc |= reads[o]
                else:
                    acc.add(o)
                if len(acc) > MAX_FUSION_INPUTS:
                    over.add(inst)
                    break
            else:
                reads[inst] = acc
    return over


def fused_instructions(module: Module) -> set[Instruction]:
    """Instructions XLA fuses into all their readers (module docstring): they hold no buffer."""
    entry = module.entry
    out: set[Instruction] = set()
    for comp in module.computations.values():
        for inst in comp.instructions:
            fusible = inst.opcode in FUSIBLE or is_identity_call(inst) or is_one_hot_scatter(inst) \
                or is_elementwise_dot(inst) or offloaded_into_stack(inst) or is_sliced_window(inst)
            if not fusible or inst.shape.is_tuple or inst.is_root:
                continue
            if any(u.opcode in _NOT_FUSION_CONSUMERS for u in inst.users):
                continue  # read where it cannot fuse: XLA fuses a producer into all readers or none
            # one walk over the users: does one of them hold loop state or the output (a
            # root, a loop, a tuple), and is one of them the root
            feeds_root = feeds_state = False
            for u in inst.users:
                if u.is_root:
                    feeds_root = feeds_state = True
                    break
                if u.opcode in _STATE_READERS or is_shard_map_boundary(u):
                    feeds_state = True  # a shard_map boundary is a tuple of its operands
            if feeds_root and comp is entry:
                continue  # a module output has its own allocation
            if feeds_state:
                # Feeding loop state or the output: XLA materializes the last fused op there,
                # unless it is a scalar or a constant, or a reshape that is a bitcast only
                # loops read unchanged (:func:`is_invariant_state_view`).
                if inst.shape.num_elements > 1 and inst.opcode != "constant" \
                        and not is_invariant_state_view(inst):
                    continue
            if entry is not None and comp is not entry and comp.root is inst:
                continue
            out.add(inst)
    return out


def marked_matmuls(module: Module, fused: set[Instruction]) -> set[Instruction]:
    """Dots and convolutions whose only reader is a materialized ``reduce-precision``: libtpu
    computes the two as one output fusion (``convolution_reduce-precision_fusion`` in its
    compiled modules) whose buffer is the reduce-precision's, so the matmul holds none. JAX writes
    this pattern for every value a checkpoint policy saves (the identity ``reduce-precision`` that
    keeps XLA from merging it with its recomputation)."""
    out: set[Instruction] = set()
    for comp in module.computations.values():
        for inst in comp.instructions:
            if inst.opcode != "reduce-precision" or inst in fused or not inst.operands:
                continue
            src = inst.operands[0]
            if src.opcode in ("dot", "convolution") and len(src.users) == 1 and not src.is_root \
                    and src.shape == inst.shape:
                out.add(src)
    return out


#: how far :func:`output_fusions` follows a matmul's fused element-wise readers
_MAX_OUTPUT_CHAIN = 400


def output_fusions(module: Module, fused: set[Instruction]) -> tuple[set[Instruction], set[Instruction]]:
    """Matmuls libtpu computes inside an output fusion, and the values those fusions write.

    A dot or convolution whose readers are all fused-away element-wise ops (a bias add, an
    activation's derivative times the incoming gradient) is not written out: libtpu fuses the
    chain of element-wise ops after it into one ``kOutput`` fusion with the matmul, which writes
    the chain's end, the one value of the chain that a materialized instruction reads, and
    computes the reductions reading that end in the same fusion as further outputs. In its
    compiled module of a flax.nnx GELU MLP under ``nnx.remat`` (libtpu 0.0.42) the backward's
    ``g @ W_down^T`` is such a matmul: ``fusion.918`` computes it, the GELU derivative and the
    product, and outputs the bias gradient (a reduce) and the product, as bf16 since only matmuls
    read it further (:func:`~hloopt.passes.tpu.storage.bf16_stored`'s ``multi_output``). The f32
    matmul result the model materialized otherwise (64 MiB there) never exists.

    A fusion holds one matmul: where several feed one chain end, the one defined last (the
    matmul the chain follows; in the MLP's backward the recomputed up-projection ``h`` is
    materialized and read by the fusion that computes ``g @ W_down^T``) is fused. Applied where
    it was observed: the chain has one end, of the matmul's shape, read only by matmuls and
    reductions. Returns ``(matmuls, ends)``: the matmuls to fuse away and the chain ends to
    materialize.

    The entry computation only, where the rule was read off (unrolled layers) and where
    :func:`~hloopt.passes.tpu.storage.bf16_stored` narrows. In a scan's body no compiled module
    has shown it, and there it changes what the planner's replay of recomputed stacks counts
    (a jax 0.12 scan recomputing its stacks no longer replays below the all-saved step by their
    bytes: ``tests/test_one_accountant.py``).
    """
    by_end: dict[Instruction, Instruction] = {}
    for d in module.entry.instructions if module.entry is not None else ():  # definition order:
        # a later matmul feeding the same end takes it over
        if d.opcode not in ("dot", "convolution") or d in fused or d.is_root or not d.users \
                or not d.shape.is_array or not all(u in fused for u in d.users):
            continue
        chain: set[Instruction] = set()
        found: set[Instruction] = set()
        todo, ok = [d], True
        while todo and ok:
            v = todo.pop()
            for u in v.users:
                if u in fused:
                    if u not in chain:
                        chain.add(u)
                        todo.append(u)
                        ok = len(chain) <= _MAX_OUTPUT_CHAIN
                else:
                    found.add(v)  # v is not d: d's users are all fused
        if not ok or len(found) != 1:
            continue
        end = next(iter(found))
        if end.shape.dims != d.shape.dims or end.is_root:
            continue
        if all(u in fused or u.opcode in ("dot", "convolution", "reduce") for u in end.users):
            by_end[end] = d
    return set(by_end.values()), set(by_end)


def is_sliced_window(inst: Instruction) -> bool:
    """A dynamic-slice read only by static slices (through reshapes): XLA's algebraic simplifier folds each
    ``slice(dynamic-slice(x))`` into a dynamic-slice of ``x``, so the window itself is never
    written (a scan with ``unroll`` > 1 reads its ``[L/u, u, ...]`` stacks so: one window per
    loop step, sliced into the ``u`` layers)."""
    if inst.opcode != "dynamic-slice":
        return False
    todo, found = [inst], False
    while todo:
        v = todo.pop()
        for u in v.users:
            if u.opcode in ("reshape", "bitcast") and not u.is_root:
                todo.append(u)
            elif u.opcode == "slice":
                found = True
            else:
                return False
    return found


def is_tiled_bitcast(inst: Instruction) -> bool:
    """A reshape that only splits or merges the major dimensions of an array, the two minor ones
    (tiled on the sublanes and lanes) unchanged: XLA's layout assignment makes it a bitcast of its
    operand's buffer (``ReshapeIsBitcast``), such as a scan over ``unroll`` > 1 grouping its
    ``[L, ...]`` stacks into ``[L/u, u, ...]``."""
    if inst.opcode not in ("reshape", "bitcast") or not inst.operands:
        return False
    src, dst = inst.operands[0].shape, inst.shape
    if not (src.is_array and dst.is_array) or src.element_type != dst.element_type:
        return False
    a, b = src.dims, dst.dims
    if len(a) < 2 or len(b) < 2:
        return False
    return a[-2:] == b[-2:]


def is_invariant_state_view(inst: Instruction) -> bool:
    """A tiled bitcast (:func:`is_tiled_bitcast`) of a value whose every reader is a loop's initial
    state that the loop body passes through unchanged (read-only loop state): the loop reads the
    operand's buffer in place, and XLA's copy insertion adds no copy for state the loop never
    writes. A scan over stacked parameters with ``unroll`` > 1 hands each loop such a view."""
    if not is_tiled_bitcast(inst) or not inst.users:
        return False
    for u in inst.users:
        if u.opcode != "tuple" or not u.users or any(w.opcode != "while" for w in u.users):
            return False
        for w in u.users:
            body = w.callee("body")
            if body is None or body.root is None or body.root.opcode != "tuple":
                return False
            for k, o in enumerate(u.operands):
                if o is not inst:
                    continue
                out = body.root.operands[k] if k < len(body.root.operands) else None
                if out is None or out.opcode != "get-tuple-element" or out.tuple_index != k \
                        or not out.operands or out.operands[0].opcode != "parameter":
                    return False
    return True


def _rewritten_convolution(inst: Instruction) -> bool:
    """A forward 2-D convolution over a batch smaller than the 8 sublanes, which libtpu rewrites
    (spatial rows folded into the batch, ``0b1f``) and computes its elementwise readers in that
    layout."""
    if inst.opcode != "convolution" or not inst.shape.is_array or len(inst.shape.dims) != 4:
        return False
    if inst.attrs.get("dim_labels", "") != "b01f_01io->b01f" or "rhs_reversal" in inst.attrs.get("window", ""):
        return False
    return 0 < inst.shape.dims[0] < 8


def layout_boundaries(module: Module, fused: set[Instruction]) -> set[Instruction]:
    """Fused-away values libtpu materializes because they cross from a rewritten convolution's
    layout (:func:`_rewritten_convolution`) to the batch/feature-minor one: an elementwise value
    computed only from such a convolution's result (and vectors) that a reader outside that
    region reads (the pooling gradient's operand, a fusion mixing in a value of the other layout)."""
    def vector_like(o: Instruction, n: int) -> bool:
        # a per-channel statistic or constant, broadcast or not: no layout of its own to cross
        if o.opcode == "broadcast" and o.operands:
            o = o.operands[0]
        return o.opcode == "constant" or not o.shape.is_array or o.shape.num_elements * 8 <= n

    region: set[Instruction] = set()
    todo = [i for i in module.instructions() if _rewritten_convolution(i)]
    while todo:
        v = todo.pop()
        if v in region:
            continue
        region.add(v)
        for u in v.users:
            if u in region or u not in fused or not u.shape.is_array or u.shape.dims != v.shape.dims:
                continue
            if all(o in region or vector_like(o, v.shape.num_elements) for o in u.operands):
                todo.append(u)
    out: set[Instruction] = set()
    for v in region:
        if v not in fused:
            continue
        for u in v.users:
            if u in region:
                continue
            if u.opcode == "reduce" or u.opcode == "reduce-window":
                continue  # reduced in the rewritten layout (the normalization's statistics, the pool)
            out.add(v)
            break
    return out






#: ops a model input passes through, unchanged in value, on its way to a convolution
_INPUT_VIEWS = frozenset({"transpose", "convert", "copy", "bitcast"})


def _lhs_pair(conv: Instruction) -> tuple[int, int] | None:
    """(feature, batch) dimensions of a convolution's input (``dim_labels``' left of ``_``)."""
    lhs = conv.attrs.get("dim_labels", "").split("_")[0]
    if "f" not in lhs or "b" not in lhs or len(lhs) != len(conv.operands[0].shape.dims):
        return None
    return lhs.index("f"), lhs.index("b")


def convolution_input_copies(module: Module) -> dict[Instruction, tuple[int, int]]:
    """Model inputs libtpu copies into a convolution's layout: value -> (lane, sublane) dims.

    A convolution contracts its input's feature dimension on the MXU, so that dimension must be
    one of the two tiled (minor) dimensions of the buffer it reads. An entry parameter keeps the
    layout it is passed in; when a convolution reads it (through transposes and converts) with the
    feature dimension elsewhere (an NCHW image made NHWC, whose channels are the parameter's
    third-minor dimension), libtpu writes the value the convolutions read into a buffer of its
    own: one copy, shared by every convolution reading that value (the forward convolution and
    its kernel gradient), live from the first to the last. Its layout puts one reader's feature
    and batch dimensions on the lanes and sublanes, the order and reader with the fewest padded
    bytes (libtpu's compiled ResNet: ``bf16[8,3,32,32]{0,1,3,2:T(4,128)(2,1)}``, batch on the
    lanes and channels on the sublanes, for an ``f32[8,3,32,32]{3,2,1,0}`` image). Where the
    feature dimension is already minor (Whisper's mel frames) the convolution reads the
    parameter as it is."""
    entry = module.entry
    if entry is None:
        return {}
    pairs: dict[Instruction, list[tuple[int, int]]] = {}
    for conv in entry.instructions:
        if conv.opcode != "convolution" or len(conv.operands) != 2:
            continue
        lhs = conv.operands[0]
        pair = _lhs_pair(conv)
        if pair is None or lhs.opcode not in _INPUT_VIEWS or not lhs.shape.is_array:
            continue
        feature = pair[0]
        v = lhs
        while v.opcode in _INPUT_VIEWS and v.operands:
            if v.opcode == "bitcast" and v.operands[0].shape.dims != v.shape.dims:
                break
            if v.opcode == "transpose":
                perm = v.attr_ints("dimensions")
                if len(perm) != len(v.shape.dims):
                    break
                feature = perm[feature]
            v = v.operands[0]
        if v.opcode != "parameter" or not v.shape.is_array:
            continue
        rank = len(v.shape.dims)
        layout = v.shape.layout
        m2m = layout.minor_to_major if layout is not None and layout.minor_to_major else tuple(range(rank - 1, -1, -1))
        if feature in m2m[:2]:
            continue
        pairs.setdefault(lhs, []).append(pair)
    out: dict[Instruction, tuple[int, int]] = {}
    for value, found in pairs.items():
        # sized as bf16, as default-precision convolutions store it (the order is the same in f32)
        options = [(f, b) for f, b in found] + [(b, f) for f, b in found]
        out[value] = min(options, key=lambda p: (tpu_layout_bytes("bf16", value.shape.dims, *p, alignment_bytes=1), p))
    return out


@dataclass(eq=False)
class FusionPlan:
    """Result of :class:`TpuFusion`."""

    module: Module
    #: instructions that hold no HBM buffer
    fused: frozenset[Instruction]
    #: tile counts per instruction (absent: replicated)
    shardings: dict[Instruction, Split] = field(repr=False)
    alignment_bytes: int = 512
    #: f32 values stored as bf16 (:func:`bf16_stored`)
    narrowed: frozenset[Instruction] = frozenset()
    #: values laid out for the convolutions that read them: (lane, sublane) dims
    #: (:func:`convolution_input_copies`)
    conv_layouts: dict[Instruction, tuple[int, int]] = field(default_factory=dict, repr=False)

    def value_bytes(self, inst: Instruction, index: tuple[int, ...] = (), *, narrowed: bool = False) -> int:
        """Per-device HBM bytes of the value at ``inst``'s shape ``index`` (0 when fused away);
        ``narrowed``: the value is stored as bf16 (a forwarding position of a narrowed value)."""
        if inst in self.fused:
            return 0
        shape = inst.shape
        s = self.shardings.get(inst)
        for k in index:
            shape = shape.tuple_shapes[k]
            s = split_element(s, k)
        if shape.is_tuple:
            return max(self.alignment_bytes, 8 * len(shape.tuple_shapes))
        if not shape.is_array:
            return 0
        narrow = narrowed or (not index and inst in self.narrowed)
        dtype = "bf16" if narrow and shape.element_type == "f32" else shape.element_type
        if not index and inst.opcode == "custom-call" and inst.operands:
            # an offloaded convolution result keeps its batch/feature-minor layout in host memory,
            # and so does its copy back on the device
            src = inst.operands[0] if shape.on_host else getattr(offloaded_source(inst), "operands", [None])[0]
            dims = activation_minor_dims(src) if src is not None else None
            if dims is not None:
                return tpu_layout_bytes(dtype, shard_dims(shape, s), *dims, alignment_bytes=self.alignment_bytes)
        if not index and inst in self.conv_layouts:
            return tpu_layout_bytes(dtype, shard_dims(shape, s), *self.conv_layouts[inst],
                                    alignment_bytes=self.alignment_bytes)
        return tpu_compact_bytes(dtype, shard_dims(shape, s), alignment_bytes=self.alignment_bytes)

    def buffer_bytes(self, buffer: Buffer) -> int:
        """Per-device bytes of an aliasing :class:`~hloopt.passes.aliasing.Buffer`: its largest value."""
        values = buffer.values
        # a narrowed value keeps its bf16 size through the tuples and barriers that forward it
        narrowed = bool(self.narrowed) and any(not ix and i in self.narrowed for i, ix in values)
        return max((self.value_bytes(i, tuple(ix), narrowed=narrowed) for i, ix in values), default=0)


@dataclass(frozen=True)
class TpuFusion(Analysis[FusionPlan]):
    """Which values libtpu materializes in HBM, and their per-device tiled sizes (module docstring)."""

    name: ClassVar[str] = "tpu-fusion"
    #: HBM allocation granularity
    alignment_bytes: int = 512
    #: also narrow a scan's stacks read back only by matmuls (:func:`bf16_stacks`). On for
    #: ``hloopt analyze``'s TPU prediction; off for the planner's Problem, whose decisions change
    #: which stacks exist (a stack narrowed in the all-saved step may be offloaded or recomputed)
    narrow_stacks: bool = False

    def run(self, module: Module, am: AnalysisManager) -> FusionPlan:
        if self.narrow_stacks:  # the plan without narrowed stacks, and those stacks
            base = am.get(replace(self, narrow_stacks=False))
            return replace(base, narrowed=base.narrowed | frozenset(bf16_stacks(module)))
        fused = fused_instructions(module)
        fused -= layout_boundaries(module, fused)
        copies = convolution_input_copies(module)
        fused -= copies.keys()
        fused -= cap_fusion_inputs(module, fused)
        in_outputs, ends = output_fusions(module, fused)
        fused = (fused | in_outputs) - ends
        fused |= marked_matmuls(module, fused)
        narrowed = bf16_stored(module, fused, multi_output=frozenset(ends))
        return FusionPlan(module, frozenset(fused), propagate_shardings(module), self.alignment_bytes,
                          frozenset(narrowed), copies)


__all__ = ["MAX_FUSION_INPUTS", "FusionPlan", "TpuFusion", "cap_fusion_inputs", "convolution_input_copies",
           "fused_instructions", "is_invariant_state_view", "is_one_hot_scatter", "is_sliced_window",
           "is_tiled_bitcast", "layout_boundaries", "marked_matmuls", "output_fusions"]
