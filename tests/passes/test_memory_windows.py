"""The one-pass parameter prefetch windows and the output-allocation search against the
straightforward per-step walks they replace (passes/memory.py), on a hand-written step and the
zoo's pre-optimization snapshots, under the TPU prediction's fusion model and schedule."""

from __future__ import annotations

from bisect import bisect_left
from pathlib import Path

import pytest

from hloopt.analysis import profile_module
from hloopt.hlo.parser import parse_module
from hloopt.passes.memory import _NO_OPERAND_SHARING, _is_constant, output_allocation_reuse
from hloopt.passes.tpu.msa import _NO_PREFETCH, prefetch_windows

ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "zoo"

# two layers whose bias adds and residual adds are elementwise (fused away into their readers),
# a loop over a stacked weight, and an optimizer update that reads its moment (both outputs)
STEP = """
HloModule m

body {
  p = (s32[], f32[4,128]{1,0}, f32[8,128]{1,0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  ws = f32[4,128]{1,0} get-tuple-element(p), index=1
  h = f32[8,128]{1,0} get-tuple-element(p), index=2
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  zero = s32[] constant(0)
  row = f32[1,128]{1,0} dynamic-slice(ws, i, zero), dynamic_slice_sizes={1,128}
  rb = f32[8,128]{1,0} broadcast(row), dimensions={0,1}
  h2 = f32[8,128]{1,0} multiply(h, rb)
  ROOT t = (s32[], f32[4,128]{1,0}, f32[8,128]{1,0}) tuple(i2, ws, h2)
}

cond {
  p = (s32[], f32[4,128]{1,0}, f32[8,128]{1,0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(4)
  ROOT lt = pred[] compare(i, n), direction=LT
}

ENTRY e {
  w1 = f32[128,128]{1,0} parameter(0)
  b1 = f32[128]{0} parameter(1)
  w2 = f32[128,128]{1,0} parameter(2)
  b2 = f32[128]{0} parameter(3)
  ws = f32[4,128]{1,0} parameter(4)
  mu = f32[128,128]{1,0} parameter(5)
  x = f32[8,128]{1,0} parameter(6)
  h1 = f32[8,128]{1,0} dot(x, w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  bb1 = f32[8,128]{1,0} broadcast(b1), dimensions={1}
  a1 = f32[8,128]{1,0} add(h1, bb1)
  r1 = f32[8,128]{1,0} add(a1, x)
  h2 = f32[8,128]{1,0} dot(r1, w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  bb2 = f32[8,128]{1,0} broadcast(b2), dimensions={1}
  a2 = f32[8,128]{1,0} add(h2, bb2)
  r2 = f32[8,128]{1,0} add(a2, r1)
  zero = s32[] constant(0)
  init = (s32[], f32[4,128]{1,0}, f32[8,128]{1,0}) tuple(zero, ws, r2)
  loop = (s32[], f32[4,128]{1,0}, f32[8,128]{1,0}) while(init), condition=cond, body=body
  y = f32[8,128]{1,0} get-tuple-element(loop), index=2
  g = f32[128,128]{1,0} dot(r1, y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  mu2 = f32[128,128]{1,0} add(mu, g)
  w1n = f32[128,128]{1,0} subtract(w1, mu2)
  ROOT out = (f32[128,128]{1,0}, f32[128,128]{1,0}, f32[8,128]{1,0}) tuple(w1n, mu2, y)
}
"""


def reference_windows(lr):  # type: ignore[no-untyped-def]
    """The walk per step prefetch_windows replaces: from each reader through its operands."""
    buffers, at = lr.buffers, lr.aliasing.position_buffers
    held = [lr.start[b.id] >= 0 for b in buffers]

    def parameter_reads(inst):  # type: ignore[no-untyped-def]
        out, through, seen, todo = set(), [], set(), list(inst.operands)
        while todo:
            o = todo.pop()
            if o in seen:
                continue
            seen.add(o)
            bids = at.get(o, ())
            if o.opcode == "parameter":
                out.update(b for b in bids if buffers[b].parameter >= 0)
            elif o.opcode in ("tuple", "get-tuple-element") or not any(held[b] for b in bids):
                todo.extend(o.operands)
            elif any(buffers[b].output_indices for b in bids):
                if o.shape.is_array and inst.shape.is_array and o.shape.dims == inst.shape.dims:
                    through.append(o)
                todo.extend(o.operands)
        return out, through

    group_first, reads, compute = {}, [], []
    for t, inst in enumerate(lr.steps):
        if inst.opcode == "while" and inst in lr.segments:
            reads.append((lr.segments[inst][0], parameter_reads(inst)[0]))
        if inst.opcode in _NO_PREFETCH or not any(held[b] for b in at.get(inst, ())):
            continue
        bids, through = parameter_reads(inst)
        g = min([t] + [group_first.get(lr.time[o], lr.time[o]) for o in through if o in lr.time])
        group_first[t] = g
        reads += [(g, bids), (t, bids)]
        compute.append(t)
    first, last = {}, {}
    for t, bids in sorted(reads, key=lambda r: r[0]):
        k = bisect_left(compute, t)
        prev = compute[k - 1] if k > 0 else 0
        for b in bids:
            first.setdefault(b, prev)
            last[b] = max(last.get(b, t), t)
    return first, last, compute


def reference_reuse(lr):  # type: ignore[no-untyped-def]
    """output_allocation_reuse's search without the skip over crossed outputs."""
    sizes, start, end = lr.size_bytes, lr.start, lr.end
    order = [b for b in lr.buffers if start[b.id] >= 0 and sizes[b.id] > 0 and b.memory_space == 0]
    order.sort(key=lambda b: (-sizes[b.id], not b.output_indices, start[b.id], b.id))
    allocs, alloc_of, absorbed, at = [], {}, set(), lr.aliasing.position_buffers

    def shares(user, operand):  # type: ignore[no-untyped-def]
        inst = lr.steps[start[user]]
        if inst.opcode in _NO_OPERAND_SHARING or sizes[user] != sizes[operand]:
            return False
        return any(operand in at.get(o, ()) for o in inst.operands)

    def fits(k, b):  # type: ignore[no-untyped-def]
        size, ranges = allocs[k]
        s, e = start[b.id], end[b.id]
        return sizes[b.id] <= size and all(
            e < s2 or e2 < s or e == s2 and shares(o, b.id) or e2 == s and shares(b.id, o) for s2, e2, o in ranges)

    for b in order:
        if b.output_indices and not b.is_tuple_table:
            alloc_of[b.id] = len(allocs)
            allocs.append((sizes[b.id], [(start[b.id], end[b.id], b.id)]))
            continue
        if b.output_indices or b.parameter >= 0 or b.is_tuple_table or _is_constant(b):
            continue
        tried = dict.fromkeys(alloc_of[ob] for inst, _ in b.values for o in inst.operands
                              for ob in at.get(o, ()) if ob in alloc_of)
        chosen = next((k for k in tried if fits(k, b)), None)
        if chosen is None:
            chosen = next((k for k in range(len(allocs) - 1, -1, -1) if fits(k, b)), None)
        if chosen is not None:
            allocs[chosen][1].append((start[b.id], end[b.id], b.id))
            alloc_of[b.id] = chosen
            absorbed.add(b.id)
    return absorbed


def tpu_ranges(text: str):  # type: ignore[no-untyped-def]
    return profile_module(parse_module(text), platform="tpu")[0].ranges


def test_windows_on_a_hand_written_step_reach_through_fused_producers() -> None:
    lr = tpu_ranges(STEP)
    first, last, compute = prefetch_windows(lr)
    assert (first, last, compute) == reference_windows(lr)
    e = lr.module.entry
    bid = {n: lr.aliasing.buffer_at(e[n]).id for n in ("w1", "b1", "w2", "mu", "x")}
    assert set(first) == {lr.aliasing.buffer_at(p).id for p in e.parameters}
    t = {n: lr.time[e[n]] for n in ("h1", "h2", "g", "mu2", "w1n")}
    assert [n for n in ("a1", "r1") if lr.start[lr.aliasing.buffer_at(e[n]).id] >= 0] == []  # fused away

    def before(step: int) -> int:
        return max((c for c in compute if c < step), default=0)

    # b1's add and the residual add are fused into their readers: the second layer's dot reads b1
    # (through a1 and r1), and so does the gradient dot g (through r1)
    assert (first[bid["b1"]], last[bid["b1"]]) == (before(t["h2"]), t["g"])
    assert (first[bid["w2"]], last[bid["w2"]]) == (before(t["h2"]), t["h2"])
    # w1n reads the moment mu2, a module output of its dims: it joins mu2's fusion, so mu's copy
    # lives from before mu2 to w1n, and w1's from before h1 (the first step) to w1n
    assert (first[bid["mu"]], last[bid["mu"]]) == (before(t["mu2"]), t["w1n"])
    assert (first[bid["w1"]], last[bid["w1"]]) == (0, t["w1n"])


@pytest.mark.parametrize("name", ["gpt2.tpu.hlo", "llama.tpu.hlo", "mlp.tpu.hlo", "convnet.offload.tpu.hlo",
                                  "sharded.tpu.hlo"])
def test_windows_and_output_reuse_match_the_walks_on_zoo_steps(name: str) -> None:
    lr = tpu_ranges((ZOO / name).read_text())
    first, last, compute = prefetch_windows(lr)
    assert first and (first, last, compute) == reference_windows(lr)
    assert output_allocation_reuse(lr) == reference_reuse(lr)
