"""Buffers and aliasing: small HLO modules in, which positions share a buffer out (hand-checked)."""

from __future__ import annotations

from hloopt.hlo.parser import parse_module
from hloopt.passes import AnalysisManager
from hloopt.passes.aliasing import BufferAliasing


def alias(text: str, **kw):  # type: ignore[no-untyped-def]
    m = parse_module(text)
    return m, AnalysisManager(m).get(BufferAliasing(**kw))


def test_tuple_gte_bitcast_share_the_operand_buffer() -> None:
    m, a = alias("""
HloModule m
ENTRY e {
  p = f32[4,8] parameter(0)
  n = f32[4,8] negate(p)
  b = f32[32] bitcast(n)
  t = (f32[32], f32[4,8]) tuple(b, p)
  g = f32[32] get-tuple-element(t), index=0
  ROOT r = f32[32] add(g, g)
}""")
    e = m.entry
    assert a.buffer_at(e["b"]) is a.buffer_at(e["n"])
    assert a.buffer_at(e["g"]) is a.buffer_at(e["n"])
    assert a.buffer_at(e["t"], (1,)) is a.buffer_at(e["p"])
    table = a.buffer_at(e["t"], ())
    assert table.is_tuple_table and table.size_bytes == 16  # two 8-byte pointers
    # p, n, the tuple table, r: four buffers
    assert len(a.buffers) == 4


def test_while_state_is_one_buffer_per_index() -> None:
    m, a = alias("""
HloModule m
body {
  s = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = f32[16] get-tuple-element(s), index=1
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  x2 = f32[16] exponential(x)
  ROOT t = (s32[], f32[16]) tuple(i2, x2)
}
cond {
  s = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(4)
  ROOT lt = pred[] compare(i, n), direction=LT
}
ENTRY e {
  p = f32[16] parameter(0)
  z = s32[] constant(0)
  init = (s32[], f32[16]) tuple(z, p)
  w = (s32[], f32[16]) while(init), condition=cond, body=body
  ROOT out = f32[16] get-tuple-element(w), index=1
}""")
    body, cond, e = m.computations["body"], m.computations["cond"], m.entry
    state = a.buffer_at(e["w"], (1,))
    for inst, idx in [(e["init"], (1,)), (e["p"], ()), (body.parameters[0], (1,)), (body["x2"], ()),
                      (body.root, (1,)), (cond.parameters[0], (1,)), (e["out"], ())]:
        assert a.buffer_at(inst, idx) is state
    assert a.buffer_at(e["w"], (0,)) is a.buffer_at(body["i2"])
    assert a.buffer_at(e["w"], (0,)) is not state


def test_copy_start_holds_destination_source_context() -> None:
    m, a = alias("""
HloModule m
ENTRY e {
  p = f32[128]{0} parameter(0)
  cs = (f32[128]{0:S(5)}, f32[128]{0}, u32[]) copy-start(p)
  ROOT cd = f32[128]{0:S(5)} copy-done(cs)
}""")
    e = m.entry
    assert a.buffer_at(e["cs"], (1,)) is a.buffer_at(e["p"])
    dest = a.buffer_at(e["cs"], (0,))
    assert a.buffer_at(e["cd"]) is dest and dest.on_host and dest.size_bytes == 512
    assert a.buffer_at(e["cs"], (2,)) is not dest


def test_donation_shares_parameter_and_output() -> None:
    m, a = alias("""
HloModule m, input_output_alias={ {0}: (1, {}, may-alias) }
ENTRY e {
  p0 = f32[8] parameter(0)
  p1 = f32[8] parameter(1)
  s = f32[8] add(p0, p1)
  ROOT t = (f32[8]) tuple(s)
}""")
    e = m.entry
    assert a.buffer_at(e["s"]) is a.buffer_at(e["p1"])
    assert a.buffer_at(e["s"]).parameter == 1
    assert a.buffer_at(e["p0"]) is not a.buffer_at(e["p1"])


def test_in_place_fusion_shares_its_updated_operand_only_when_asked() -> None:
    text = """
HloModule m
fused {
  a = f32[64] parameter(0)
  u = f32[8] parameter(1)
  i = s32[] parameter(2)
  ROOT d = f32[64] dynamic-update-slice(a, u, i)
}
ENTRY e {
  p = f32[64] parameter(0)
  q = f32[8] parameter(1)
  i = s32[] parameter(2)
  x = f32[64] negate(p)
  ROOT f = f32[64] fusion(x, q, i), kind=kLoop, calls=fused
}"""
    m, a = alias(text, in_place=True)
    assert a.buffer_at(m.entry["f"]) is a.buffer_at(m.entry["x"])
    m, a = alias(text)
    assert a.buffer_at(m.entry["f"]) is not a.buffer_at(m.entry["x"])
    # fusion internals are not buffers
    assert all(b.instruction.parent is m.entry for b in a.buffers)


def test_conditional_branches_share_the_result() -> None:
    m, a = alias("""
HloModule m
b0 {
  x = f32[4] parameter(0)
  ROOT n = f32[4] negate(x)
}
b1 {
  x = f32[4] parameter(0)
  ROOT n = f32[4] exponential(x)
}
ENTRY e {
  k = s32[] parameter(0)
  p = f32[4] parameter(1)
  ROOT c = f32[4] conditional(k, p, p), branch_computations={b0, b1}
}""")
    c = m.entry["c"]
    assert a.buffer_at(c) is a.buffer_at(m.computations["b0"].root)
    assert a.buffer_at(c) is a.buffer_at(m.computations["b1"].root)
    assert a.buffer_at(m.computations["b1"].parameters[0]) is a.buffer_at(m.entry["p"])


def test_async_start_of_one_operand_holds_it_at_0_0() -> None:
    # libtpu's slice-start: ((operand), result, context); {0} is a fresh index table
    m, a = alias("""
HloModule m
sl {
  q = f32[64]{0} parameter(0)
  ROOT s = f32[16]{0} slice(q), slice={[0:16]}
}
ENTRY e {
  p = f32[64]{0} parameter(0)
  st = ((f32[64]{0}), f32[16]{0}, s32[]) async-start(p), calls=sl
  ROOT d = f32[16]{0} async-done(st)
}""")
    e = m.entry
    assert a.buffer_at(e["st"], (0, 0)) is a.buffer_at(e["p"])
    assert a.buffer_at(e["st"], (0,)).is_tuple_table
    assert a.buffer_at(e["d"]) is a.buffer_at(e["st"], (1,))
    assert a.buffer_at(e["d"]).size_bytes == 64
