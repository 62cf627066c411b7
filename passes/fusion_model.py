"""What XLA's TPU pipeline will materialize in HBM, predicted from a pre-optimization module.

``hloopt plan`` works on the HLO JAX lowers (no layouts, no fusions, global shapes of an SPMD
program). :class:`TpuFusion` says, for every instruction of such a module, whether libtpu will
give its value an HBM buffer and how many bytes per device that buffer takes. Liveness
(``materialize="tpu-fusion"``) counts only those buffers, at those sizes.

Three models, each checked against libtpu's compiled modules of the zoo (``fixtures/hlo/zoo``,
``<m>.tpu.hlo`` vs ``<m>.tpu-v5e.hlo``) rather than fitted per model:

* **Layout** (:func:`tpu_compact_bytes`): TPU layout assignment gives an array the most compact
  tiled layout: of all choices of the two minor dimensions, the one with the fewest padded bytes,
  with tiles ``(h, 128)`` where ``h`` is the second-minor size rounded up to a power of two, at
  most 8 (``T(2,128)``, ``T(4,128)``, ``T(8,128)``) — times the packing of sub-32-bit types
  (``(8,128)(2,1)`` for bf16). Every HBM buffer is a multiple of
  512 bytes; rank-1 arrays take ``T(n)`` with ``n`` the power of two that holds them, from 128 to
  1024 elements (f32[768] is ``T(1024)``: 4 KiB). Measured: 3665 of the 3674 HBM array shapes in the compiled
  zoo modules have exactly
  this size; the 9 others are convolution activations whose feature dimension layout assignment
  keeps minor (``{3,0,2,1}``), which costs more padding.
* **Shards** (:func:`propagate_shardings`): an SPMD module's per-device shape of a value is its
  global shape divided by the tile counts of its sharding. Shardings are written on entry
  parameters and ``Sharding`` custom-calls; they are propagated forward (elementwise ops take the
  most-split operand, broadcast/transpose/reshape/reduce/dot map dimensions, a
  dynamic-update-slice takes its update's split, tuples carry them through). Loop state is the
  most split of the init and the body's result, to a fixed point (a scan's gradient accumulator
  starts as replicated zeros and is added sharded gradients: it is sharded, and so are the zeros
  broadcast into it), the way XLA's sharding propagation resolves the common cases. Reshards
  the SPMD partitioner adds (all-gathers of a weight before a matmul) are not modeled. A module
  that is already partitioned (:func:`is_partitioned`: XLA's per-device module, shapes already
  shards) is not divided again.
* **Fusion** (:func:`fused_instructions`): an instruction is *fused away* (holds no HBM buffer;
  its readers read its inputs instead) when it is a cheap elementwise or data-movement op that
  XLA's instruction fusion puts into its consumers: elementwise math, converts, broadcasts, iotas,
  constants, reshapes/bitcasts/transposes, slices, and the identity markers JAX emits
  (``Sharding`` custom-calls, ``checkpoint_name``'s ``opt-barrier``-free names), and the one-hot
  scatter of ``take_along_axis``'s gradient (:func:`is_one_hot_scatter`), which XLA rewrites into
  a compare/select. It stays
  materialized when it feeds loop state, a tuple or the root (XLA writes the last fused op there),
  unless it is a scalar or a constant. Reductions, dots, convolutions, gathers/scatters,
  dynamic-(update-)slices, sorts, loops and calls are fusion roots: they hold their result.
  **Layout boundaries** (:func:`layout_boundaries`): libtpu rewrites a forward convolution over a
  batch below the 8 sublanes into another layout (spatial rows folded into the batch, ``0b1f``)
  and computes the elementwise values after it in that layout (the normalization, the relu); a
  value of that region read outside it (the backward's fusions that mix in the pooling gradient,
  ``select-and-scatter``) cannot fuse across the layout change: libtpu materializes it and copies
  it to the batch/feature-minor layout (its compiled tiny convnet: ``x - mean``, the normalized
  ``x`` and the relu mask, each as a multi-output fusion's output then a ``copy``). Those values
  are materialized here, laid out like the convolution (:func:`activation_minor_dims`). The
  statistics' reductions and the forward pooling stay in the region.
* **Storage type** (:func:`bf16_stored`): TPU runs an f32 dot or convolution at default
  precision as one bf16 MXU pass on ``convert(operand)``. When every reader of a materialized
  f32 value (through tuples, get-tuple-elements and the optimization barriers of
  ``jax.checkpoint``) is such a matmul, the converts are one CSE'd instruction that fuses into the
  value's producer, and the buffer holds bf16: half the bytes. libtpu's compiled small zoo stores
  exactly these as bf16: mlp's relu outputs and convnet's block inputs and max-pool outputs, each
  read by the next layer and by the rematerialized block in the backward pass. With
  ``narrow_stacks`` (``hloopt analyze``'s prediction), a scan's stacked residual that the backward
  loop only slices for such matmuls is stored bf16 too (:func:`bf16_stacks`; libtpu's llama
  steps carry them as ``bf16[L,...]`` loop state).

Code size: libtpu's ``peak_memory_in_bytes`` includes the program's generated code
(``generated_code_size_in_bytes``), which is unknowable before compiling (it is 15-60% of the
tiny zoo models' peak, well under 1% of a real model's). The model predicts the peak *without*
code; tests compare it with XLA's peak minus XLA's code size.

Invariants: a fused-away instruction is never an entry parameter, a module output, loop state or
a computation's root; a narrowed (bf16-stored) value is an f32 array defined in the entry that
is neither a parameter nor an output; ``value_bytes`` is a positive multiple of
``alignment_bytes`` for arrays, and never more than the global unsharded tiled size.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Union

from hloopt.ir import STORAGE_BITS, Computation, Instruction, Module, Shape
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.residuals import is_host_annotation, offloaded_source

#: a sharding as tile counts: per array dimension, or nested per tuple element
Split = Union[tuple[int, ...], tuple["Split", ...], None]

#: elementwise and data-movement ops that XLA fuses into their consumers
FUSIBLE = frozenset({
    "abs", "add", "and", "atan2", "broadcast", "cbrt", "ceil", "clamp", "compare", "complex",
    "convert", "cos", "divide", "exp", "expm1", "floor", "imag", "iota", "is-finite", "log",
    "log1p", "logistic", "maximum", "minimum", "multiply", "negate", "not", "or", "popcnt", "power",
    "real", "reduce-precision", "remainder", "reshape", "round-nearest-afz", "round-nearest-even",
    "rsqrt", "select", "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sin",
    "slice", "sqrt", "subtract", "tan", "tanh", "transpose", "xor", "bitcast", "bitcast-convert",
    "erf", "pad", "reverse", "constant", "stochastic-convert", "exponential", "exponential-minus-one",
    "log-plus-one", "cosine", "sine", "count-leading-zeros",
})

#: custom-calls that are identities after SPMD partitioning
_IDENTITY_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})

_CONTROL_FLOW = frozenset({"while", "conditional", "call"})


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _tiled_bytes(ds: list[int], minor: int, second: int, bits: int) -> int:
    """Unaligned bytes of ``ds`` tiled with dimension ``minor`` on the 128 lanes and ``second`` on
    the sublanes (a ``T(h,128)`` tile, ``h`` the power of two up to 8 per 32-bit word that holds it)."""
    pack = 32 // bits if bits < 32 else 1
    rest = math.prod(d for k, d in enumerate(ds) if k != minor and k != second)
    h = min(8 * pack, max(pack, _pow2_at_least(ds[second])))
    n = rest * (-(-ds[second] // h) * h) * (-(-ds[minor] // 128) * 128)
    return (n * bits + 7) // 8


def _aligned(size: int, alignment_bytes: int) -> int:
    if alignment_bytes > 1:
        return max(alignment_bytes, -(-size // alignment_bytes) * alignment_bytes)
    return size


@functools.lru_cache(maxsize=1 << 16)
def _compact_bytes(element_type: str, dims: tuple[int, ...], alignment_bytes: int) -> int:
    bits = STORAGE_BITS.get(element_type, 32)
    if bits == 0:
        return 0
    ds = [max(d, 0) for d in dims]
    if len(ds) <= 1:
        n = ds[0] if ds else 1
        tile = min(1024, max(128, _pow2_at_least(n)))  # T(128) .. T(1024)
        size = (-(-n // tile) * tile * bits + 7) // 8
    else:
        size = min(_tiled_bytes(ds, i, j, bits) for i in range(len(ds)) for j in range(len(ds)) if i != j)
    return _aligned(size, alignment_bytes)


def tpu_compact_bytes(element_type: str, dims: tuple[int, ...] | list[int], *, alignment_bytes: int = 512) -> int:
    """Bytes of an array in the most compact TPU tiled layout (module docstring), aligned."""
    return _compact_bytes(element_type, tuple(dims), alignment_bytes)


def tpu_layout_bytes(element_type: str, dims: tuple[int, ...] | list[int], minor: int, second: int, *,
                     alignment_bytes: int = 512) -> int:
    """Bytes of an array tiled with dimension ``minor`` on the 128 lanes and ``second`` on the
    sublanes (a ``T(h,128)`` tile, ``h`` the power of two up to 8 that holds it), aligned."""
    bits = STORAGE_BITS.get(element_type, 32)
    if bits == 0:
        return 0
    return _aligned(_tiled_bytes([max(d, 0) for d in dims], minor, second, bits), alignment_bytes)


def activation_minor_dims(inst: Instruction) -> tuple[int, int] | None:
    """(lane, sublane) dimensions of a value libtpu lays out with its batch and feature dimensions
    minor on chip: a 2-D convolution's result and the pooling windows over such values
    (``reduce-window``/``select-and-scatter`` that do not window the first and last dims), and the
    elementwise values computed from such a result (:func:`_from_convolution`). Of the
    two orders, the one with fewer padded bytes: feature on the lanes when the batch fills the
    sublanes (``f32[4,16,16,8]{3,0,2,1:T(4,128)S(1)}``, ``f32[32,64,64,64]{3,0,2,1:T(8,128)}``),
    batch on the lanes when that pads less (``f32[16,16,16,8]{0,3,2,1:T(8,128)S(1)}``)."""
    shape = inst.shape
    if not shape.is_array or len(shape.dims) != 4:
        return None
    pair: tuple[int, int] | None = None
    if inst.opcode == "convolution":
        labels = inst.attrs.get("dim_labels", "")
        out = labels.split("->")[-1]
        if len(out) == 4 and "f" in out and "b" in out:
            pair = out.index("f"), out.index("b")
    elif inst.opcode in ("reduce-window", "select-and-scatter"):
        m = re.search(r"size=(\d+)x\d+x\d+x(\d+)", inst.attrs.get("window", ""))
        if m and m.group(1) == "1" and m.group(2) == "1":
            pair = 3, 0
    elif inst.opcode in FUSIBLE and _from_convolution(inst):
        pair = 3, 0
    if pair is None:
        return None
    f, b = pair
    dims = [max(d, 0) for d in shape.dims]
    bits = STORAGE_BITS.get(shape.element_type, 32)
    if bits and _tiled_bytes(dims, b, f, bits) < _tiled_bytes(dims, f, b, bits):
        return b, f
    return f, b


def _from_convolution(inst: Instruction, limit: int = 16) -> bool:
    """An elementwise value computed (through elementwise ops of its dims) from a ``b01f``
    convolution's result: it keeps that result's layout."""
    seen: set[Instruction] = set()
    todo = [inst]
    while todo and len(seen) < limit:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for o in v.operands:
            if not o.shape.is_array or o.shape.dims != inst.shape.dims:
                continue
            if o.opcode == "convolution":
                return o.attrs.get("dim_labels", "").endswith("->b01f")
            if o.opcode in FUSIBLE and o.opcode != "broadcast":
                todo.append(o)
    return False


# --------------------------------------------------------------------------------------------
# Shardings
# --------------------------------------------------------------------------------------------

_DEVICES = re.compile(r"devices=\[([\d,]+)\]")
_LAST_TILE_DIMS = re.compile(r"last_tile_dims=\{([^}]*)\}")


def parse_sharding(text: str | None, shape: Shape) -> Split:
    """Tile counts of an HLO ``sharding={...}`` attribute for ``shape`` (None: replicated/unknown)."""
    if not text:
        return None
    body = text.strip()
    if shape.is_tuple:
        inner = body[1:-1].strip() if body.startswith("{") and body.endswith("}") else body
        parts = _split_top(inner) if inner.startswith("{") else []
        if len(parts) != len(shape.tuple_shapes):
            return None
        return tuple(parse_sharding(p, s) for p, s in zip(parts, shape.tuple_shapes))
    m = _DEVICES.search(body)
    if m is None or not shape.is_array:
        return None
    tiles = [int(x) for x in m.group(1).split(",")]
    if "last_tile_dim_replicate" in body:
        tiles = tiles[:-1]
    lt = _LAST_TILE_DIMS.search(body)
    if lt is not None:
        tiles = tiles[: len(tiles) - len([x for x in lt.group(1).split(",") if x.strip()])]
    if len(tiles) != len(shape.dims):
        return None
    return tuple(tiles)


def _split_top(text: str) -> list[str]:
    """``{a}, {b, {c}}`` -> ``["{a}", "{b, {c}}"]``."""
    out, depth, start = [], 0, 0
    for k, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = k
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                out.append(text[start: k + 1])
    return out


def _factor(s: Split) -> int:
    if s is None:
        return 1
    if s and isinstance(s[0], tuple | type(None)):
        return 1
    return math.prod(s)  # type: ignore[arg-type]


def _array_split(s: Split, rank: int) -> tuple[int, ...]:
    if s is None or len(s) != rank or (s and not isinstance(s[0], int)):
        return (1,) * rank
    return s  # type: ignore[return-value]


def _reshape_split(src: tuple[int, ...], src_dims: tuple[int, ...], dst_dims: tuple[int, ...]) -> tuple[int, ...]:
    """Carry a split through a reshape: dims grouped into equal-product runs; a group's split goes
    to its major-most dim on the other side when it divides that dim."""
    out = [1] * len(dst_dims)
    i = j = 0
    while i < len(src_dims) and j < len(dst_dims):
        gi, gj = [i], [j]
        pi, pj = src_dims[i], dst_dims[j]
        while pi != pj:
            if pi < pj and i + len(gi) < len(src_dims):
                pi *= src_dims[i + len(gi)]
                gi.append(i + len(gi))
            elif j + len(gj) < len(dst_dims):
                pj *= dst_dims[j + len(gj)]
                gj.append(j + len(gj))
            else:
                break
        f = math.prod(src[k] for k in gi)
        if f > 1:
            for k in gj:
                if dst_dims[k] % f == 0 and dst_dims[k] >= f:
                    out[k] = f
                    break
        i += len(gi)
        j += len(gj)
    return tuple(out)


#: what only an SPMD-partitioned (per-device) module holds: the partitioner's collectives and
#: partition ids (a global module's are inside ``shard_map`` bodies, between the Sharding markers)
_PARTITIONED_OPS = frozenset({"partition-id", "all-reduce", "all-reduce-start", "all-gather", "all-gather-start",
                              "reduce-scatter", "all-to-all", "collective-permute", "collective-permute-start"})


def is_partitioned(module: Module) -> bool:
    """Whether ``module`` is already per-device (XLA's module after ``spmd-partitioning``): its
    shapes are shards and its ``sharding=`` attributes describe them, not divide them. Told by
    collectives or a partition id without the ``Sharding`` markers of the global text."""
    seen_partitioned = False
    for inst in module.instructions():
        if inst.opcode == "custom-call" and inst.custom_call_target in _IDENTITY_CALLS:
            return False
        if inst.opcode in _PARTITIONED_OPS:
            seen_partitioned = True
    return seen_partitioned


def propagate_shardings(module: Module) -> dict[Instruction, Split]:
    """Tile counts of every instruction's value (module docstring); absent/None: replicated.
    Nothing for a module that is already partitioned (:func:`is_partitioned`)."""
    split: dict[Instruction, Split] = {}
    if is_partitioned(module):
        return split
    #: the parameter splits each computation was last visited with (a loop body is visited again
    #: when its state's sharding grows)
    seen: dict[Computation, list[Split] | None] = {}

    def array(inst: Instruction, k: int = 0) -> tuple[int, ...]:
        o = inst.operands[k]
        return _array_split(split.get(o), len(o.shape.dims) if o.shape.is_array else 0)

    def visit(comp: Computation, params: list[Split] | None) -> None:
        if comp in seen and seen[comp] == params:
            return
        seen[comp] = params
        for inst in comp.instructions:
            s = _infer(inst, params)
            if s is not None:
                split[inst] = s

    def _infer(inst: Instruction, params: list[Split] | None) -> Split:
        explicit = parse_sharding(inst.sharding, inst.shape)
        op = inst.opcode
        if explicit is not None:
            return explicit
        if op == "parameter":
            if params is not None and 0 <= inst.parameter_number < len(params):
                return params[inst.parameter_number]
            return None
        if not inst.operands and not inst.called:
            return None
        if op == "get-tuple-element":
            s = split.get(inst.operands[0])
            k = inst.tuple_index
            return s[k] if isinstance(s, tuple) and 0 <= k < len(s) and not _is_leaf(s) else None
        if op == "tuple":
            return tuple(split.get(o) for o in inst.operands)
        if op == "while":
            # Loop state takes the most split of what enters and what the body hands back (a
            # gradient accumulator starts as replicated zeros and is added sharded gradients),
            # to a fixed point; zeros broadcast into the init take the state's sharding too.
            init = split.get(inst.operands[0]) if inst.operands else None
            state = init
            body = inst.callee("body")
            for _ in range(4):
                for c in inst.called.get("condition", []) + inst.called.get("body", []):
                    visit(c, [state])
                merged = _merge_split(state, split.get(body.root) if body is not None and body.root else None)
                if merged == state:
                    break
                state = merged
            if state != init and inst.operands and inst.operands[0].opcode == "tuple":
                for k, o in enumerate(inst.operands[0].operands):
                    leaf = state[k] if isinstance(state, tuple) and not _is_leaf(state) and k < len(state) else None
                    if _is_leaf(leaf) and o.opcode in ("broadcast", "constant") and o.sharding is None \
                            and math.prod(_array_split(split.get(o), len(leaf))) < math.prod(leaf):
                        split[o] = leaf
                split[inst.operands[0]] = state
            return state
        if op in ("call", "conditional"):
            result: Split = None
            callees = inst.called.get("to_apply", []) + inst.called.get("calls", [])
            for c in callees:  # a callee shared by call sites takes each site's shardings in turn
                visit(c, [split.get(o) for o in inst.operands])
                if c.root is not None:
                    result = split.get(c.root)
            return result
        if op == "opt-barrier" or op == "optimization-barrier":
            return split.get(inst.operands[0])
        if not inst.shape.is_array:
            return None
        rank = len(inst.shape.dims)
        if op == "broadcast":
            src = array(inst)
            out = [1] * rank
            for k, d in enumerate(inst.attr_ints("dimensions")):
                if k < len(src) and d < rank:
                    out[d] = src[k]
            return tuple(out)
        if op == "transpose":
            src = array(inst)
            perm = inst.attr_ints("dimensions")
            return tuple(src[p] for p in perm) if len(perm) == rank == len(src) else None
        if op in ("reshape", "bitcast") and inst.operands[0].shape.is_array:
            return _reshape_split(array(inst), inst.operands[0].shape.dims, inst.shape.dims)
        if op in ("reduce", "reduce-window") and op == "reduce":
            src = array(inst)
            red = set(inst.attr_ints("dimensions"))
            kept = tuple(f for k, f in enumerate(src) if k not in red)
            return kept if len(kept) == rank else None
        if op == "dot":
            lhs, rhs = array(inst, 0), array(inst, 1)
            lb, rb = inst.attr_ints("lhs_batch_dims"), inst.attr_ints("rhs_batch_dims")
            lc, rc = inst.attr_ints("lhs_contracting_dims"), inst.attr_ints("rhs_contracting_dims")
            out = [max(lhs[a], rhs[b]) for a, b in zip(lb, rb)]
            out += [f for k, f in enumerate(lhs) if k not in lb and k not in lc]
            out += [f for k, f in enumerate(rhs) if k not in rb and k not in rc]
            return tuple(out) if len(out) == rank else None
        if op == "gather":
            idx = array(inst, 1)
            ivd = inst.attr_ints("index_vector_dim")
            batch = [f for k, f in enumerate(idx) if not ivd or k != ivd[0]]
            offsets = set(inst.attr_ints("offset_dims"))
            out, it = [], iter(batch)
            for d in range(rank):
                out.append(1 if d in offsets else next(it, 1))
            return tuple(out)
        if op == "dynamic-update-slice" and len(inst.operands) > 1 and inst.operands[1].shape.is_array \
                and len(inst.operands[1].shape.dims) == rank:
            # the buffer takes the update's split where the update's dims allow it (a scan's
            # stacked gradients: replicated zeros updated by each layer's sharded gradient)
            base, upd = array(inst, 0), array(inst, 1)
            udims = inst.operands[1].shape.dims
            return tuple(max(b, u if udims[k] % u == 0 else 1) for k, (b, u) in enumerate(zip(base, upd)))
        # Elementwise and everything that keeps an operand's dims: the most split operand.
        best: tuple[int, ...] | None = None
        for o in inst.operands:
            if o.shape.is_array and o.shape.dims == inst.shape.dims:
                s = _array_split(split.get(o), rank)
                if best is None or math.prod(s) > math.prod(best):
                    best = s
        if best is not None and op in ("concatenate", "pad", "slice", "dynamic-slice"):
            best = tuple(f if f <= d else 1 for f, d in zip(best, inst.shape.dims))
        if best is None and op in ("slice", "dynamic-slice", "pad", "concatenate", "reverse") \
                and inst.operands[0].shape.is_array and len(inst.operands[0].shape.dims) == rank:
            best = tuple(1 if inst.shape.dims[k] % f else f for k, f in enumerate(array(inst)))
        return best

    if module.entry is not None:
        visit(module.entry, None)
    return split


def _merge_split(a: Split, b: Split) -> Split:
    """The more split of two shardings of one value, leaf by leaf (tuples element-wise)."""
    if a is None:
        return b
    if b is None:
        return a
    if _is_leaf(a) or _is_leaf(b) or not a or not b:
        if _is_leaf(a) and _is_leaf(b) and len(a) == len(b):
            return b if math.prod(b) > math.prod(a) else a  # type: ignore[arg-type]
        return a
    if len(a) != len(b):
        return a
    return tuple(_merge_split(x, y) for x, y in zip(a, b))


def _is_leaf(s: Split) -> bool:
    return isinstance(s, tuple) and bool(s) and isinstance(s[0], int)


def shard_dims(shape: Shape, s: Split) -> tuple[int, ...]:
    """Per-device dims of an array under tile counts ``s`` (ceil division)."""
    sp = _array_split(s, len(shape.dims))
    return tuple(-(-d // f) for d, f in zip(shape.dims, sp))


# --------------------------------------------------------------------------------------------
# Fusion
# --------------------------------------------------------------------------------------------


def _is_identity_marker(inst: Instruction) -> bool:
    return inst.opcode == "custom-call" and inst.custom_call_target in _IDENTITY_CALLS


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


#: views an offloaded value passes through on its way into a scan's stack
_HOST_VIEWS = frozenset({"reshape", "bitcast"})


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


def _offloaded_into_stack(inst: Instruction) -> bool:
    """A ``pinned_host`` annotation written straight into a scan's stack and read by nothing else."""
    if not is_host_annotation(inst):
        return False
    updates, only = host_stack_updates(inst)
    return bool(updates) and only


def fused_instructions(module: Module) -> set[Instruction]:
    """Instructions XLA fuses into all their readers (module docstring): they hold no buffer."""
    entry = module.entry
    out: set[Instruction] = set()
    for comp in module.computations.values():
        for inst in comp.instructions:
            fusible = inst.opcode in FUSIBLE or _is_identity_marker(inst) or is_one_hot_scatter(inst) \
                or _offloaded_into_stack(inst)
            if not fusible or inst.shape.is_tuple or inst.is_root:
                continue
            if comp is entry and any(u.is_root for u in inst.users):
                continue  # a module output has its own allocation
            if any(u.opcode in _CONTROL_FLOW or u.opcode == "tuple" or u.is_root or u.opcode == "parameter"
                   for u in inst.users):
                # Feeding loop state or the output: XLA materializes the last fused op there,
                # unless it is a scalar or a constant.
                if inst.shape.num_elements > 1 and inst.opcode != "constant":
                    continue
            if entry is not None and comp is not entry and comp.root is inst:
                continue
            out.add(inst)
    return out


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


#: ``operand_precision`` values that let TPU run an f32 dot/convolution as one bf16 MXU pass
_ONE_PASS = frozenset({"default", "DEFAULT"})


def is_bf16_matmul(inst: Instruction) -> bool:
    """An f32 dot or convolution at default precision: TPU converts its operands to bf16.

    The MXU multiplies bf16; at ``DEFAULT`` precision libtpu feeds it ``convert(operand)`` (one
    pass) rather than splitting f32 into several bf16 passes as ``HIGH``/``HIGHEST`` do.
    """
    if inst.opcode not in ("dot", "convolution") or len(inst.operands) != 2:
        return False
    if any(o.shape.element_type != "f32" for o in inst.operands):
        return False
    prec = inst.attrs.get("operand_precision")
    if prec:
        names = [x.strip() for x in prec.strip("{}").split(",") if x.strip()]
        if any(n not in _ONE_PASS for n in names):
            return False
    return True


#: instructions through which a value reaches its readers unchanged (storage forwarding)
_PASS_THROUGH = frozenset({"tuple", "get-tuple-element", "opt-barrier", "optimization-barrier"})


def _final_readers(inst: Instruction, limit: int = 64,
                   positions: dict[Instruction, dict[int, list[int]]] | None = None) -> list[Instruction] | None:
    """The instructions that read ``inst``'s value, looking through tuples, get-tuple-elements and
    optimization barriers (index by index); None when the value leaves through anything else
    (a loop, a call, the root) or the walk grows past ``limit``. ``positions`` caches, per tuple,
    where each operand sits in it (a training step's tuples of thousands of leaves are read by
    each of them)."""
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
            if op == "tuple":
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
            elif index or op in _CONTROL_FLOW or op == "parameter":
                return None
            else:
                out.append(u)
    return out


def bf16_stored(module: Module, fused: set[Instruction]) -> set[Instruction]:
    """Materialized f32 values XLA stores as bf16: every reader (through tuples and optimization
    barriers) is an f32 dot/convolution at default precision (:func:`is_bf16_matmul`).

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
        readers = _final_readers(inst, positions=positions)
        if readers and all(is_bf16_matmul(r) for r in readers):
            out.add(inst)
    return out


#: ops a value passes through unchanged in storage on its way to a matmul (views)
_VIEWS = frozenset({"bitcast", "reshape"})


def _matmul_readers_only(value: Instruction, limit: int = 64) -> bool:
    """Every reader of ``value`` (through bitcasts and reshapes) is a default-precision f32
    matmul (:func:`is_bf16_matmul`); False when there is none or the walk grows past ``limit``."""
    readers = _view_readers(value, lambda u, v: u.opcode in _VIEWS, limit)
    if not readers:
        return False
    return all(is_bf16_matmul(u) for u, _ in readers)


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
                    reads.append(g)
    return reads or None


# --------------------------------------------------------------------------------------------
# The analysis
# --------------------------------------------------------------------------------------------


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

    def value_bytes(self, inst: Instruction, index: tuple[int, ...] = (), *, narrowed: bool = False) -> int:
        """Per-device HBM bytes of the value at ``inst``'s shape ``index`` (0 when fused away);
        ``narrowed``: the value is stored as bf16 (a forwarding position of a narrowed value)."""
        if inst in self.fused:
            return 0
        shape = inst.shape
        s = self.shardings.get(inst)
        for k in index:
            shape = shape.tuple_shapes[k]
            s = s[k] if isinstance(s, tuple) and not _is_leaf(s) and k < len(s) else None
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
        return tpu_compact_bytes(dtype, shard_dims(shape, s), alignment_bytes=self.alignment_bytes)

    def buffer_bytes(self, buffer: object) -> int:
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
    #: ``hloopt analyze``'s TPU prediction; the planner's Problem does not model them yet (its
    #: prediction of the README's llama plan moved from -0.86% to -14% of libtpu with them)
    narrow_stacks: bool = False

    def run(self, module: Module, am: AnalysisManager) -> FusionPlan:
        fused = fused_instructions(module)
        fused -= layout_boundaries(module, fused)
        narrowed = bf16_stored(module, fused) | (bf16_stacks(module) if self.narrow_stacks else set())
        return FusionPlan(module, frozenset(fused), propagate_shardings(module), self.alignment_bytes,
                          frozenset(narrowed))


__all__ = ["FUSIBLE", "FusionPlan", "is_one_hot_scatter", "Split", "TpuFusion", "bf16_stored", "fused_instructions",
           "layout_boundaries",
           "activation_minor_dims", "bf16_stacks", "host_stack_updates", "is_bf16_matmul", "is_partitioned",
           "parse_sharding", "propagate_shardings", "shard_dims", "tpu_compact_bytes", "tpu_layout_bytes"]
