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


_LOOP = """
HloModule m{alias}
body {{
  s = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = f32[16] get-tuple-element(s), index=1
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  x2 = f32[16] exponential(x)
  ROOT t = (s32[], f32[16]) tuple(i2, x2)
}}
cond {{
  s = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(4)
  ROOT lt = pred[] compare(i, n), direction=LT
}}
ENTRY e {{
  p = f32[16] parameter(0)
  z = s32[] constant(0)
  init = (s32[], f32[16]) tuple(z, {x0})
  w = (s32[], f32[16]) while(init), condition=cond, body=body
  ROOT out = f32[16] get-tuple-element(w), index=1
}}"""


def test_while_state_is_one_buffer_per_index() -> None:
    # the init value dies at the loop: it becomes the loop state (XLA removes the copy)
    m, a = alias(_LOOP.format(alias="", x0="n0").replace("  z = s32[] constant(0)",
                                                         "  z = s32[] constant(0)\n  n0 = f32[16] negate(p)"))
    body, cond, e = m.computations["body"], m.computations["cond"], m.entry
    state = a.buffer_at(e["w"], (1,))
    for inst, idx in [(e["init"], (1,)), (e["n0"], ()), (body.parameters[0], (1,)), (body["x2"], ()),
                      (body.root, (1,)), (cond.parameters[0], (1,)), (e["out"], ())]:
        assert a.buffer_at(inst, idx) is state
    assert a.buffer_at(e["w"], (0,)) is a.buffer_at(body["i2"])
    assert a.buffer_at(e["w"], (0,)) is not state
    # the counter starts from a constant, which is read-only: the state is a copy
    assert a.buffer_at(e["w"], (0,)) is not a.buffer_at(e["z"])


def test_while_copies_an_undonated_parameter_and_takes_a_donated_one() -> None:
    m, a = alias(_LOOP.format(alias="", x0="p"))
    body, e = m.computations["body"], m.entry
    state = a.buffer_at(e["w"], (1,))
    assert a.buffer_at(e["p"]) is not state  # the caller's array must survive the loop
    assert a.buffer_at(e["init"], (1,)) is a.buffer_at(e["p"])
    for inst, idx in [(body.parameters[0], (1,)), (body["x2"], ()), (e["out"], ())]:
        assert a.buffer_at(inst, idx) is state
    m, a = alias(_LOOP.format(alias=", input_output_alias={ {}: (0, {}, may-alias) }", x0="p"))
    assert a.buffer_at(m.entry["p"]) is a.buffer_at(m.entry["w"], (1,))


_SLOTS = """
HloModule m
body {
  s = (s32[], f32[16], f32[16], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = f32[16] get-tuple-element(s), index=1
  y = f32[16] get-tuple-element(s), index=2
  k = f32[16] get-tuple-element(s), index=3
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  x2 = f32[16] add(x, k)
  y2 = f32[16] multiply(y, k)
  ROOT t = (s32[], f32[16], f32[16], f32[16]) tuple(i2, x2, y2, k)
}
cond {
  s = (s32[], f32[16], f32[16], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(4)
  ROOT lt = pred[] compare(i, n), direction=LT
}
ENTRY e {
  p = f32[16] parameter(0)
  z = s32[] constant(0)
  c = f32[] constant(0)
  zeros = f32[16] broadcast(c), dimensions={}
  init = (s32[], f32[16], f32[16], f32[16]) tuple(z, zeros, zeros, p)
  w = (s32[], f32[16], f32[16], f32[16]) while(init), condition=cond, body=body
  a = f32[16] get-tuple-element(w), index=1
  b = f32[16] get-tuple-element(w), index=2
  ROOT r = f32[16] add(a, b)
}"""


def test_while_gives_each_slot_its_own_buffer_when_one_value_starts_several() -> None:
    # one zeros array starts two accumulators (XLA: copy insertion copies the second): two
    # buffers of 64 bytes, not one; the read-only weight k passes through in place
    m, a = alias(_SLOTS)
    body, e = m.computations["body"], m.entry
    x, y = a.buffer_at(e["w"], (1,)), a.buffer_at(e["w"], (2,))
    assert x is not y
    assert {a.buffer_at(e["zeros"]).id} & {x.id, y.id} and len({x.id, y.id, a.buffer_at(e["zeros"]).id}) == 2
    assert a.buffer_at(body["x2"]) is x and a.buffer_at(body["y2"]) is y
    assert a.buffer_at(e["w"], (3,)) is a.buffer_at(e["p"]) is a.buffer_at(body["k"])
    assert a.buffer_at(e["a"]) is x and a.buffer_at(e["b"]) is y


def test_while_keeps_slots_apart_when_the_body_swaps_them() -> None:
    # the body returns slot 2 in slot 1 and slot 1 in slot 2: both cannot be one buffer
    text = _SLOTS.replace("tuple(i2, x2, y2, k)", "tuple(i2, y, x, k)") \
        .replace("tuple(z, zeros, zeros, p)", "tuple(z, zeros, n1, p)") \
        .replace("  c = f32[] constant(0)", "  c = f32[] constant(0)\n  n1 = f32[16] negate(p)")
    m, a = alias(text)
    e = m.entry
    assert a.buffer_at(e["w"], (1,)) is not a.buffer_at(e["w"], (2,))
    assert a.buffer_at(e["w"], (1,)) is not a.buffer_at(e["p"])


def test_while_copies_an_init_value_read_after_the_loop() -> None:
    text = _SLOTS.replace("ROOT r = f32[16] add(a, b)", "s2 = f32[16] add(a, b)\n  ROOT r = f32[16] add(s2, n1)") \
        .replace("tuple(z, zeros, zeros, p)", "tuple(z, zeros, n1, p)") \
        .replace("  c = f32[] constant(0)", "  c = f32[] constant(0)\n  n1 = f32[16] negate(p)")
    m, a = alias(text)
    e = m.entry
    assert a.buffer_at(e["w"], (2,)) is not a.buffer_at(e["n1"])
    assert a.buffer_at(e["w"], (1,)) is a.buffer_at(e["zeros"])  # zeros dies at the loop


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


_ASYNC_DUS = """
HloModule m
upd {
  q = f32[4,16]{1,0:S(5)} parameter(0)
  u = f32[1,16]{1,0} parameter(1)
  i = s32[] parameter(2)
  z = s32[] parameter(3)
  ROOT d = f32[4,16]{1,0:S(5)} dynamic-update-slice(q, u, i, z)
}
ENTRY e {
  x = f32[1,16]{1,0} parameter(0)
  c0 = s32[] constant(0)
  buf = f32[4,16]{1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer"
  st = ((f32[4,16]{1,0:S(5)}, f32[1,16]{1,0}, s32[], s32[]), f32[4,16]{1,0:S(5)}, u32[]) %OP%(buf, x, c0, c0)%CALLS%
  ROOT d = f32[4,16]{1,0:S(5)} %DONE%(st)
}"""


def test_async_in_place_update_writes_into_its_operand_buffer() -> None:
    """libtpu's offload into a host stack: AllocateBuffer, then dynamic-update-slice-start/done.
    The result is the allocated buffer (one host allocation in libtpu's buffer assignment), with
    or without ``in_place``; an async-start wrapping a non-in-place op gets a fresh {1}."""
    for op, calls, done in (("dynamic-update-slice-start", "", "dynamic-update-slice-done"),
                            ("async-start", ", calls=upd", "async-done")):
        for in_place in (False, True):
            m, a = alias(_ASYNC_DUS.replace("%OP%", op).replace("%CALLS%", calls).replace("%DONE%", done),
                         in_place=in_place)
            e = m.entry
            assert a.buffer_at(e["st"], (1,)) is a.buffer_at(e["buf"]), (op, in_place)
            assert a.buffer_at(e["d"]) is a.buffer_at(e["buf"])
            assert a.buffer_at(e["buf"]).memory_space == 5
    # the same wrapper around an op that is not in place: the output is its own buffer
    text = _ASYNC_DUS.replace("%OP%", "async-start").replace("%CALLS%", ", calls=upd").replace("%DONE%", "async-done")
    text = text.replace("ROOT d = f32[4,16]{1,0:S(5)} dynamic-update-slice(q, u, i, z)",
                        "ROOT d = f32[4,16]{1,0:S(5)} negate(q)")
    m, a = alias(text)
    assert a.buffer_at(m.entry["st"], (1,)) is not a.buffer_at(m.entry["buf"])
