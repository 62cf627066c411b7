"""libtpu's memory-space assignment (MSA), predicted: what of the step's working set VMEM holds.

libtpu reports one temporaries heap in ``peak_memory_in_bytes``: the device (HBM) heap or the
on-chip ``S(1)`` (VMEM) heap, whichever peaks higher. On a pre-optimization module (no ``S(1)``
buffers) :class:`~hloopt.passes.memory.PeakMemory` (``on_chip_heap``) predicts both sides with
:func:`msa_sides`. MSA moves temporaries into VMEM and prefetches the parameters the steps read.
Per step ``t``, with ``mov(t)`` the live temporaries of at most ``capacity_bytes`` each, ``pre(t)``
the parameters whose prefetched copy is live and ``hbm(t)`` everything else:

    HBM heap(t)   = hbm(t) + mov(t) - placed(t)       (what does not fit spills)
    VMEM heap(t)  = min(capacity_bytes, mov(t) + out(t) + pre(t))
    timeline(t)   = fixed + max(HBM heap(t), VMEM heap(t))

with ``placed(t)`` the bytes of the live movable temporaries VMEM holds for their whole live range,
placed in the order the schedule defines them, each where it fits beside the earlier ones at every
step of its range (:func:`placed_timeline`: a value MSA keeps in VMEM only around its accesses keeps
its HBM buffer between them), ``out(t)`` the live temporaries XLA's
buffer assigner puts inside output allocations (free in HBM, still S(1) values in VMEM), and a
parameter's prefetched copy live from the compute step before its first reader to its last reader
(:func:`prefetch_windows`). A stacked f32 weight the loops read only for default-precision
matmuls (:func:`hloopt.passes.tpu.storage.bf16_loop_weight`) also has a bf16 copy the loops carry
(libtpu hoists the convert out of the loop): a temporary over the parameter's prefetch window,
placed with the movable ones on the HBM side (:func:`loop_weight_copies`); on the VMEM side the
parameter's prefetch already stands for it. In VMEM a convolution's result and the pooling windows over it are laid
out with batch and feature minor (:func:`activation_minor_sizes`); HBM keeps them compact. libtpu
lands every copy from host memory in HBM, never in VMEM (``hbm_pinned``): MSA prefetches it on
into VMEM for its readers (:mod:`hloopt.passes.memory` says what libtpu's compiled modules show
of each rule; the accuracy is in ``docs/measurements.md``).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate

from hloopt.ir import ON_CHIP_MEMORY_SPACE, Instruction
from hloopt.passes.liveness import FORWARDS, LiveRanges
from hloopt.passes.opcodes import BARRIERS, CONTROL_FLOW, TUPLE_OPS
from hloopt.passes.tpu.layout import activation_minor_dims, tpu_layout_bytes


def msa_timeline(lr: LiveRanges, start: list[int], end: list[int], movable: set[int], hbm_bytes: list[int], *,
                 capacity_bytes: int, base_bytes: int = 0,
                 on_chip_only: list[tuple[int, int, int]] | tuple[()] = ()) -> list[int]:
    """Per step: libtpu's accounted bytes under the memory-space assignment model (module docstring).

    ``hbm_bytes`` is the timeline without the ``movable`` temporaries (``start``/``end`` are the
    counted ranges), ``base_bytes`` its constant part (static allocations, code); parameters and
    outputs are in it, and on the VMEM side too. ``on_chip_only`` are ``(start, end, bytes)`` of
    temporaries that cost nothing in HBM (inside output allocations) but fill VMEM like the
    movable ones.
    """
    hbm, vmem = msa_sides(lr, start, end, movable, hbm_bytes, capacity_bytes=capacity_bytes, base_bytes=base_bytes,
                          on_chip_only=on_chip_only)
    return [max(h, v) for h, v in zip(hbm, vmem)]


def msa_sides(lr: LiveRanges, start: list[int], end: list[int], movable: set[int], hbm_bytes: list[int], *,
              capacity_bytes: int, base_bytes: int = 0,
              on_chip_only: list[tuple[int, int, int]] | tuple[()] = (),
              on_chip_sizes: dict[int, int] | None = None,
              hbm_pinned: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
    """:func:`msa_timeline`'s two sides per step: ``fixed + HBM heap(t)`` and ``fixed + VMEM heap(t)``.
    ``on_chip_sizes`` gives a movable buffer's bytes in VMEM where its on-chip layout differs.
    ``hbm_pinned`` (a subset of ``movable``, already counted in ``hbm_bytes``) are the device
    copies of host values: on the VMEM side like the others, never packed off HBM, and their VMEM
    copies around their readers leave less room for the others (module docstring)."""
    n = len(lr.steps)
    sizes = lr.size_bytes
    chip = on_chip_sizes or {}
    mdiff = [0] * (n + 1)
    cdiff = [0] * (n + 1)
    fdiff = [0] * (n + 1)
    for b in lr.buffers:
        s = start[b.id]
        if s < 0 or b.memory_space != 0:
            continue
        if b.id in movable:
            if b.id not in hbm_pinned:
                mdiff[s] += sizes[b.id]
                mdiff[end[b.id] + 1] -= sizes[b.id]
            cdiff[s] += chip.get(b.id, sizes[b.id])
            cdiff[end[b.id] + 1] -= chip.get(b.id, sizes[b.id])
        elif b.parameter >= 0 or b.output_indices:
            fdiff[s] += sizes[b.id]
            fdiff[end[b.id] + 1] -= sizes[b.id]
    fixed = list(accumulate(fdiff[:-1]))
    for s, e, size in on_chip_only:
        cdiff[s] += size
        cdiff[e + 1] -= size
    at = lr.aliasing.position_buffers
    # parameters prefetched into VMEM, from the compute step before their first reader to their last
    first, last, compute = prefetch_windows(lr)
    # stacked weights the loops read as bf16: their hoisted bf16 copy is a temporary over the
    # same window, placed like the movable ones (module docstring). The VMEM side already holds
    # the parameter's prefetch over that window, the copy's place there: it is not counted twice.
    copies = {b: nbytes for b, nbytes in loop_weight_copies(lr).items() if b in first}
    pdiff = [0] * (n + 1)
    for b, s in first.items():
        pdiff[s] += sizes[b]
        pdiff[last[b] + 1] -= sizes[b]
    prefetched = list(accumulate(pdiff[:-1]))
    for b, nbytes in copies.items():
        mdiff[first[b]] += nbytes
        mdiff[last[b] + 1] -= nbytes
    mov = list(accumulate(mdiff[:-1]))
    on_chip_mov = list(accumulate(cdiff[:-1]))

    # VMEM copies of the pinned values (copies from host land in HBM; MSA prefetches them for
    # their readers), from the compute step before their first reader to their last: VMEM room
    # the movable temporaries cannot take
    first_read: dict[int, int] = {}
    if hbm_pinned:
        for t, inst in enumerate(lr.steps):
            if inst.opcode in FORWARDS:  # a forwarded buffer is read by the forwarder's readers
                continue
            for o in inst.operands:
                for bid in at.get(o, ()):
                    if bid in hbm_pinned and bid not in first_read and t > start[bid]:
                        first_read[bid] = t
    rdiff = [0] * (n + 1)
    for bid, t in first_read.items():
        k = bisect_left(compute, t)
        s = compute[k - 1] if k > 0 else 0
        rdiff[s] += sizes[bid]
        rdiff[end[bid] + 1] -= sizes[bid]
    reserved = list(accumulate(rdiff[:-1]))
    items = [(start[bid], end[bid], sizes[bid]) for bid in movable - hbm_pinned]
    items += [(first[b], last[b], nbytes) for b, nbytes in copies.items()]
    placed = placed_timeline(items, [max(0, capacity_bytes - r) for r in reserved], mov)
    hbm_side = [h + m - p for h, m, p in zip(hbm_bytes[:n], mov, placed)]
    vmem_side = [base_bytes + f + min(capacity_bytes, c + p) for f, c, p in zip(fixed, on_chip_mov, prefetched)]
    return hbm_side, vmem_side


def loop_weight_copies(lr: LiveRanges) -> dict[int, int]:
    """Entry parameter buffer id -> bytes of the bf16 copy libtpu makes of it for the loops that
    read it (:func:`hloopt.passes.tpu.storage.bf16_loop_weight`), tiled as the parameter is."""
    from hloopt.passes.tpu.layout import tpu_compact_bytes
    from hloopt.passes.tpu.storage import bf16_loop_weight

    out: dict[int, int] = {}
    for b in lr.buffers:
        inst = b.instruction
        if b.parameter < 0 or b.memory_space != 0 or inst.opcode != "parameter" or not inst.shape.is_array:
            continue
        if bf16_loop_weight(inst):
            f32 = tpu_compact_bytes("f32", inst.shape.dims)
            # per device: the parameter's (sharded) size, halved as bf16 halves the tiled bytes
            bf16 = tpu_compact_bytes("bf16", inst.shape.dims)
            out[b.id] = max(1, lr.size_bytes[b.id] * bf16 // max(f32, 1))
    return out


def prefetch_windows(lr: LiveRanges) -> tuple[dict[int, int], dict[int, int], list[int]]:
    """Per parameter buffer id the steps its prefetched VMEM copy is live from and to, and the compute steps.

    MSA copies a parameter into VMEM once, overlapping the copy with the compute step before its
    first reader, and keeps that copy until its last reader. Readers are the materialized steps
    (a fused-away instruction's reads are its consumer's), counted from the first step of the
    multi-output fusion they join, and loops, which read the parameters they carry from their
    first step on (libtpu hoists what the body does to the whole array, e.g. the bf16 cast of
    stacked weights, out of the loop). A step reads the parameters behind its operands through
    the producers fused into it, tuples, and the module outputs it reads: libtpu fuses an output
    with its later readers into one multi-output fusion (the optimizer's moment and parameter
    updates are one), when the two have the same dims (the same iteration space).

    Fused-away producers chain across layers (a residual stream of fused adds), so a step can
    reach many instructions through them. Nothing here walks that chain once per step: the
    instructions a step reads through are the same for every reader, so the earliest and latest
    reading step are pushed from readers down to operands once, in topological order, and the
    module outputs a step reaches are gathered once per instruction (few: the optimizer's). Time
    and memory are linear in the instructions and operand edges, plus the output sets.
    """
    buffers = lr.buffers
    at = lr.aliasing.position_buffers
    held = [lr.start[b.id] >= 0 for b in buffers]  # materialized (not fused away, not a view)
    when = lr.time
    #: per instruction: 0 reads stop there (a parameter, collected; a materialized value), 1 a step
    #: reads through it (a tuple, a fused-away producer), 2 through it and joins its fusion (an output)
    class Kinds(dict[Instruction, int]):
        def __missing__(self, o: Instruction) -> int:  # computed on first lookup (a dict read after)
            bids = at.get(o, ())
            if o.opcode == "parameter":
                k = 0
            elif o.opcode in ("tuple", "get-tuple-element") or not any([held[b] for b in bids]):
                k = 1
            elif any(buffers[b].output_indices for b in bids):
                k = 2
            else:
                k = 0
            self[o] = k
            return k

    kinds = Kinds()

    # the held module outputs behind each instruction read through (shared frozensets: most are empty)
    empty: frozenset[Instruction] = frozenset()
    outputs_behind: dict[Instruction, frozenset[Instruction]] = {}

    def behind(root: Instruction) -> frozenset[Instruction]:
        stack = [(root, False)]
        while stack:
            v, ready = stack.pop()
            if v in outputs_behind:
                continue
            if not ready:
                stack.append((v, True))
                stack.extend((o, False) for o in v.operands if kinds[o] and o not in outputs_behind)
                continue
            parts = [outputs_behind[o] for o in v.operands if o in outputs_behind]
            parts = [x for x in parts if x]
            outputs_behind[v] = _joined(frozenset((v,)) if kinds[v] == 2 else empty, parts)
        return outputs_behind[root]

    # every instruction read through, in the flat schedule's order (operands before readers in
    # each computation): what behind() finds, without a walk per reader
    for v in lr.steps:
        kv = kinds[v]
        if not kv or v in outputs_behind:
            continue
        parts: list[frozenset[Instruction]] = []
        missing = False
        for o in v.operands:
            if kinds[o]:
                x = outputs_behind.get(o)
                if x is None:  # not before its reader in the flat schedule: walk as before
                    missing = True
                    break
                if x:
                    parts.append(x)
        if missing:
            behind(v)
            continue
        outputs_behind[v] = _joined(frozenset((v,)) if kv == 2 else empty, parts)

    # reading times per step: (earliest, latest) over its read entries
    group_first: dict[int, int] = {}  # step -> first step of its multi-output fusion
    window: dict[Instruction, tuple[int, int]] = {}
    compute: list[int] = []
    for t, inst in enumerate(lr.steps):
        lo = hi = None
        if inst.opcode == "while" and inst in lr.segments:
            lo = hi = lr.segments[inst][0]
        if inst.opcode not in _NO_PREFETCH and any([held[b] for b in at.get(inst, ())]):
            g = t
            if inst.shape.is_array:
                dims = inst.shape.dims
                for o in inst.operands:
                    if kinds[o]:
                        outs = outputs_behind.get(o)
                        for out in behind(o) if outs is None else outs:
                            if out.shape.is_array and out.shape.dims == dims and out in when:
                                g = min(g, group_first.get(when[out], when[out]))
            group_first[t] = g
            lo = g if lo is None else min(lo, g)
            hi = t if hi is None else max(hi, t)
            compute.append(t)
        if lo is not None:
            window[inst] = (lo, hi)  # type: ignore[assignment]

    # push (earliest, latest) from the readers through what they read, users before operands
    low: dict[Instruction, int] = {}
    high: dict[Instruction, int] = {}

    def reach(o: Instruction, lo: int, hi: int) -> None:
        if o in low:
            if lo < low[o]:
                low[o] = lo
            if hi > high[o]:
                high[o] = hi
        else:
            low[o], high[o] = lo, hi

    for inst, (lo, hi) in window.items():
        for o in inst.operands:
            reach(o, lo, hi)
    # users before operands: the flat schedule backwards (each computation's steps are a
    # topological order of it, and operands are in their reader's computation)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    steps = lr.steps
    for t in range(len(steps) - 1, -1, -1):
        v = steps[t]
        if v not in low:
            continue
        lo, hi = low[v], high[v]
        if v.opcode == "parameter":
            k = bisect_left(compute, lo)
            prev = compute[k - 1] if k > 0 else 0
            for b in at.get(v, ()):
                if buffers[b].parameter >= 0:
                    first[b] = min(first.get(b, prev), prev)
                    last[b] = max(last.get(b, hi), hi)
        elif kinds[v]:
            for o in v.operands:
                reach(o, lo, hi)
    return first, last, compute


def _joined(own: frozenset[Instruction], parts: list[frozenset[Instruction]]) -> frozenset[Instruction]:
    """``own`` and every part together, sharing the one part when there is nothing to add to it."""
    if not parts:
        return own
    if len(parts) == 1 and not own:
        return parts[0]
    return own.union(*parts)


def activation_minor_sizes(lr: LiveRanges, movable: set[int]) -> dict[int, int]:
    """VMEM bytes of the movable buffers libtpu lays out with batch and feature minor on chip
    (convolution results and the pooling windows over them:
    :func:`~hloopt.passes.tpu.layout.activation_minor_dims`), where that layout is larger than
    the compact one they are counted at."""
    out: dict[int, int] = {}
    for bid in movable:
        for inst, index in lr.buffers[bid].values:
            if index:
                continue
            dims = activation_minor_dims(inst)
            if dims is not None:
                size = tpu_layout_bytes(inst.shape.element_type, inst.shape.dims, *dims)
                if size > lr.size_bytes[bid]:
                    out[bid] = max(out.get(bid, 0), size)
    return out


def placed_timeline(items: list[tuple[int, int, int]], room: list[int], mov: list[int]) -> list[int]:
    """Per step, the bytes of ``items`` (``(first step, last step, bytes)``, the movable
    temporaries) memory-space assignment holds in VMEM for their whole live range, given the
    VMEM ``room`` per step and the ``mov`` bytes of the items live at each step.

    A buffer relieves HBM only where VMEM holds it from its definition to its last reader: one
    MSA keeps in VMEM only around its accesses (prefetched before a read, evicted after its
    definition) keeps its HBM buffer between them. So items are placed whole, in the order the
    schedule defines them (an allocator walking the program), each where it fits beside those
    placed before it at every step of its range: at a step where the live temporaries exceed
    VMEM, what stays in HBM is not the largest-first packing of that step alone but what earlier
    placements, alive across it, left no room for. Where everything live fits (``mov <= room``)
    no placement is refused, so only the steps where it does not are tracked."""
    import numpy as np

    n = len(room)
    pressured = [t for t in range(n) if mov[t] > room[t]]
    diff = [0] * (n + 1)
    free = np.array([room[t] for t in pressured], dtype=np.int64)
    for s, e, size in sorted(items, key=lambda it: (it[0], it[1], -it[2])):
        i, j = bisect_left(pressured, s), bisect_right(pressured, e)
        if i < j:
            window = free[i:j]
            if int(window.min()) < size:
                continue
            window -= size
        diff[s] += size
        diff[e + 1] -= size
    return list(accumulate(diff[:-1]))


#: steps that move no data through the core (MSA prefetches nothing for them)
_NO_PREFETCH = CONTROL_FLOW | TUPLE_OPS | BARRIERS | {"parameter", "constant"}


__all__ = ["ON_CHIP_MEMORY_SPACE", "activation_minor_sizes", "loop_weight_copies", "msa_sides", "msa_timeline",
           "placed_timeline", "prefetch_windows"]
