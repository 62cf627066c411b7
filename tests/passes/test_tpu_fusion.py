"""The TPU fusion model's bound on what one fusion reads (``passes/tpu/fusion.py``), on
hand-written modules whose answer is counted by hand."""

from __future__ import annotations

import pytest

from hloopt.hlo.parser import parse_module
from hloopt.passes import AnalysisManager
from hloopt.passes.schedule import list_schedule
from hloopt.passes.tpu import TpuFusion
from hloopt.passes.tpu.fusion import MAX_FUSION_INPUTS, cap_fusion_inputs, fused_instructions


def global_norm_step(leaves: int) -> str:
    """``clip_by_global_norm``'s shape: every leaf reduced to a scalar, the scalars summed by a
    chain of adds (``add.1`` reads two reductions, ``add.k`` the chain and one more), and every
    leaf scaled by the total."""
    lines = ["HloModule norm", "", "sum {", "  a = f32[] parameter(0)", "  b = f32[] parameter(1)",
             "  ROOT s = f32[] add(a, b)", "}", "", "ENTRY main {", "  zero = f32[] constant(0)"]
    for k in range(leaves):
        lines.append(f"  p.{k} = f32[8,128] parameter({k})")
        lines.append(f"  r.{k} = f32[] reduce(p.{k}, zero), dimensions={{0,1}}, to_apply=sum")
    prev = "r.0"
    for k in range(1, leaves):
        lines.append(f"  add.{k} = f32[] add({prev}, r.{k})")
        prev = f"add.{k}"
    outs = []
    for k in range(leaves):
        lines.append(f"  b.{k} = f32[8,128] broadcast({prev}), dimensions={{}}")
        lines.append(f"  m.{k} = f32[8,128] multiply(p.{k}, b.{k})")
        outs.append(f"m.{k}")
    lines.append(f"  ROOT t = ({', '.join(['f32[8,128]'] * leaves)}) tuple({', '.join(outs)})")
    lines.append("}")
    return "\n".join(lines) + "\n"


def test_a_chain_within_the_bound_fuses_whole() -> None:
    # MAX_FUSION_INPUTS leaves: the last add reads all of them, exactly the bound
    mod = parse_module(global_norm_step(MAX_FUSION_INPUTS))
    fused = fused_instructions(mod)
    assert {f"add.{k}" for k in range(1, MAX_FUSION_INPUTS)} <= {i.name for i in fused}
    assert cap_fusion_inputs(mod, fused) == set()


@pytest.mark.parametrize("leaves", [MAX_FUSION_INPUTS + 1, 2 * MAX_FUSION_INPUTS + 5])
def test_a_chain_over_the_bound_is_materialized_where_it_reaches_it(leaves: int) -> None:
    # add.k reads k + 1 reductions, so add.MAX is the first over the bound; materialized, it is
    # one read of the adds after it, which reach the bound again MAX - 1 adds later
    mod = parse_module(global_norm_step(leaves))
    over = {i.name for i in cap_fusion_inputs(mod, fused_instructions(mod))}
    expected = {f"add.{k}" for k in range(MAX_FUSION_INPUTS, leaves, MAX_FUSION_INPUTS)}
    assert over == expected
    plan = TpuFusion().run(mod, AnalysisManager(mod))
    assert {i.name for i in plan.fused} & expected == set()
    # so no materialized instruction reads more than the bound through fused chains, and the
    # list schedule still orders every instruction
    assert len(list_schedule(mod.entry, plan.fused)) == len(mod.entry.instructions)


MARKED = """
HloModule marked

ENTRY main {
  x = f32[256,512] parameter(0)
  w = f32[512,1024] parameter(1)
  h = f32[256,1024] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  m = f32[256,1024] reduce-precision(h), exponent_bits=8, mantissa_bits=23
  t = (f32[256,1024]) tuple(m)
  b = (f32[256,1024]) opt-barrier(t)
  g = f32[256,1024] get-tuple-element(b), index=0
  ROOT r = f32[256,1024] READ
}
"""


def test_a_saved_matmul_and_its_precision_marker_are_one_buffer() -> None:
    from hloopt.passes.tpu.fusion import marked_matmuls

    # h has a second reader: libtpu keeps its buffer, and the marker (read by the checkpoint's
    # tuple) has one of its own
    mod = parse_module(MARKED.replace("READ", "add(g, h)"))
    assert marked_matmuls(mod, fused_instructions(mod)) == set()
    # the marker is h's only reader: the dot is computed into the marker's buffer (libtpu's
    # convolution_reduce-precision_fusion), one buffer where there were two
    mod = parse_module(MARKED.replace("READ", "negate(g)"))
    plan = AnalysisManager(mod).get(TpuFusion())
    assert mod.entry["m"] not in plan.fused and mod.entry["h"] in plan.fused
    assert plan.value_bytes(mod.entry["h"]) == 0 and plan.value_bytes(mod.entry["m"]) == 256 * 1024 * 4


#: an MLP layer's backward in miniature: ``d = g @ w^T`` (f32[256,512]) is read only by the
#: element-wise chain ``e = d * tanh(h)`` (h a materialized matmul of its own), whose end ``e`` is
#: read by two matmuls (the input and weight gradients) and the bias gradient's reduce. EXTRA
#: adds a reader of ``e`` in the variants below.
OUTPUT_FUSION = """HloModule out
sum {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY main {
  g = f32[256,128] parameter(0)
  w = f32[512,128] parameter(1)
  x = f32[256,128] parameter(2)
  v = f32[128,512] parameter(3)
  h = f32[256,512] dot(x, v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  d = f32[256,512] dot(g, w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  t = f32[256,512] tanh(h)
  e = f32[256,512] multiply(d, t)
  zero = f32[] constant(0)
  db = f32[512] reduce(e, zero), dimensions={0}, to_apply=sum
  dx = f32[256,128] dot(e, v), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  dw = f32[128,512] dot(x, e), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  EXTRA
  ROOT r = (f32[512], READERS) tuple(db, OUTS)
}
"""


@pytest.mark.parametrize("extra, in_output", [
    # matmuls and the bias reduce read e: one of the two matmuls feeding the chain is computed in
    # e's output fusion, e is written as bf16 (the reduce is that fusion's second output; only
    # the matmuls read the buffer)
    ("", True),
    # e is also read by a negate the step returns: not the chain the rule was measured on
    ("n = f32[256,512] negate(e)", False),
])
def test_a_matmul_read_only_by_an_element_wise_chain_is_computed_in_its_output_fusion(
        extra: str, in_output: bool) -> None:
    from hloopt.passes.tpu.fusion import output_fusions

    readers, outs = ("f32[256,128], f32[128,512], f32[256,512]", "dx, dw, n") if extra else \
        ("f32[256,128], f32[128,512]", "dx, dw")
    mod = parse_module(OUTPUT_FUSION.replace("EXTRA", extra).replace("READERS", readers).replace("OUTS", outs))
    e = mod.entry
    fused = fused_instructions(mod)
    # without the output fusion the model recomputes the chain in each of its readers, each
    # reading d and h: both matmul results held, f32
    assert e["e"] in fused and e["t"] in fused and e["d"] not in fused and e["h"] not in fused
    matmuls, ends = output_fusions(mod, fused)
    if not in_output:
        assert (matmuls, ends) == (set(), set())
        return
    # one matmul per fusion: the one the chain follows (d, defined last); h keeps its buffer
    assert matmuls == {e["d"]} and ends == {e["e"]}
    plan = AnalysisManager(mod).get(TpuFusion())
    assert e["d"] in plan.fused and e["e"] not in plan.fused and e["h"] not in plan.fused
    assert plan.value_bytes(e["d"]) == 0
    # 256 x 512 values of two bytes (bf16) where the model held two f32 matmul results
    assert plan.value_bytes(e["e"]) == 256 * 512 * 2 and e["e"] in plan.narrowed
    assert plan.value_bytes(e["h"]) == 256 * 512 * 4
