"""TPU array layouts: how many HBM (and VMEM) bytes libtpu gives an array.

A pre-optimization module has no layouts. TPU layout assignment gives an array the most compact
tiled layout (:func:`tpu_compact_bytes`): of all choices of the two minor dimensions, the one with
the fewest padded bytes, with tiles ``(h, 128)`` where ``h`` is the second-minor size rounded up
to a power of two, at most 8 (``T(2,128)``, ``T(4,128)``, ``T(8,128)``), times the packing of
sub-32-bit types (``(8,128)(2,1)`` for bf16). Every HBM buffer is a multiple of 512 bytes; rank-1
arrays take ``T(n)`` with ``n`` the power of two that holds them, from 128 to 1024 elements
(f32[768] is ``T(1024)``: 4 KiB). Checked against the HBM array shapes of libtpu's compiled zoo
modules (``fixtures/hlo/zoo``): all but convolution activations whose feature dimension layout
assignment keeps minor, which :func:`activation_minor_dims` describes.

:func:`assign_tpu_layouts` is a transform (it returns a new module): layout-less shapes take TPU's
default tiles (``(8,128)``, rank-1 ``(128)``), and what JAX offloads is put in host memory
(``S(5)``) as XLA's host offloader will: the value of a ``pinned_host`` annotation and a scan's
stack such a value is written into (:func:`hloopt.passes.tpu.storage.host_stack_updates`). This
is the module ``hloopt analyze --platform tpu`` and the planner count.
"""

from __future__ import annotations

import functools
import math
import re

from hloopt.ir import HOST_MEMORY_SPACE, STORAGE_BITS, Instruction, Layout, Module, Shape
from hloopt.passes.opcodes import FUSIBLE


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


def tpu_tiled_shape(s: Shape) -> Shape:
    """``s`` with TPU's default tiles where it has none (``(8,128)`` on the two minor dims, rank
    <= 1 ``(128)``), keeping its dimension order and memory space; tuples element by element."""
    if s.is_tuple:
        return Shape("tuple", tuple_shapes=tuple(tpu_tiled_shape(x) for x in s.tuple_shapes))
    if not s.is_array or (s.layout is not None and s.layout.tiles):
        return s
    rank = len(s.dims)
    m2m = s.layout.minor_to_major if s.layout is not None and s.layout.minor_to_major \
        else tuple(range(rank - 1, -1, -1))
    tiles = ((8, 128),) if rank >= 2 else ((128,),)
    space = s.layout.memory_space if s.layout is not None else 0
    return Shape(s.element_type, s.dims, s.dynamic, Layout(m2m, tiles, memory_space=space))


def in_host_memory(shape: Shape) -> Shape:
    """An array ``shape`` in host memory (``S(5)``), keeping its layout; other shapes unchanged."""
    if not shape.is_array:
        return shape
    lay = shape.layout
    m2m = lay.minor_to_major if lay is not None else tuple(range(len(shape.dims) - 1, -1, -1))
    tiles = lay.tiles if lay is not None else ()
    return Shape(shape.element_type, shape.dims, shape.dynamic, Layout(m2m, tiles, memory_space=HOST_MEMORY_SPACE))


def assign_tpu_layouts(module: Module, *, owned: bool = False) -> Module:
    """A new module: TPU's default tiles on every layout-less shape, offloaded values and the scan
    stacks they are written into in host memory (module docstring). The input is not changed,
    unless ``owned``: the caller has just built ``module`` and nothing else holds it (call
    inlining's copy), and its shapes are rewritten where they are rather than copied again."""
    from hloopt.passes.inline import with_shapes
    from hloopt.passes.residuals import is_host_annotation
    from hloopt.passes.tpu.storage import host_stack_updates

    host: set[Instruction] = set()
    for inst in module.instructions():
        if is_host_annotation(inst):
            host.add(inst)
            # XLA's host offloader writes the value into a host buffer: a scan's stacked residual
            # (the loop state these update) is allocated in host memory
            host.update(host_stack_updates(inst)[0])
    cache: dict[Shape, Shape] = {}

    def shape_of(inst: Instruction) -> Shape:
        got = cache.get(inst.shape)
        if got is None:
            got = cache[inst.shape] = tpu_tiled_shape(inst.shape)
        return in_host_memory(got) if inst in host else got

    if not owned:
        return with_shapes(module, shape_of)
    for inst in list(module.instructions()):
        inst.shape = shape_of(inst)
    return module


__all__ = ["activation_minor_dims", "assign_tpu_layouts", "in_host_memory", "tpu_compact_bytes", "tpu_layout_bytes",
           "tpu_tiled_shape"]
