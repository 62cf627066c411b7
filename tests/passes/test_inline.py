"""Call inlining: HLO in, facts out."""

from __future__ import annotations

import pytest

from hloopt.hlo.parser import parse_file, parse_module
from hloopt.hlo.printer import print_module
from hloopt.passes.inline import inline_calls

HLO = """
HloModule m

inner {
  a = f32[4] parameter(0)
  b = f32[4] parameter(1)
  ROOT t = (f32[4], f32[4]) tuple(a, b)
}

callee {
  x = f32[4] parameter(0)
  y = f32[4] parameter(1)
  n = f32[4] negate(x)
  s = f32[4] add(n, y)
  ROOT c2 = (f32[4], f32[4]) call(s, x), to_apply=inner
}

ENTRY e {
  p = f32[4] parameter(0)
  q = f32[4] parameter(1)
  c = (f32[4], f32[4]) call(p, q), to_apply=callee
  g = f32[4] get-tuple-element(c), index=0
  ROOT r = f32[4] multiply(g, p)
}
"""


def test_inlines_nested_calls_and_rewires_users():
    mod = parse_module(HLO)
    new = inline_calls(mod)
    entry = new.entry
    assert [i.opcode for i in entry.instructions] == [
        "parameter", "parameter", "negate", "add", "tuple", "get-tuple-element", "multiply"]
    by = entry.by_name
    assert [o.name for o in by["c.n"].operands] == ["p"]          # callee param 0 -> operand p
    assert [o.name for o in by["c.s"].operands] == ["c.n", "q"]
    assert [o.name for o in by["c.c2.t"].operands] == ["c.s", "p"]  # nested call, renamed twice
    assert by["g"].operands[0] is by["c.c2.t"]                     # users read the inlined root
    assert entry.root.name == "r" and entry.root.is_root
    assert "callee" not in new.computations and "inner" not in new.computations
    # the input module is not changed
    assert any(i.opcode == "call" for i in mod.instructions())
    # the result prints and re-parses (verifier included)
    assert parse_module(print_module(new)).entry.root.shape.dims == (4,)


@pytest.mark.parametrize("model", ["mlp", "convnet", "gpt2", "llama", "sharded"])
def test_zoo_has_no_calls_after_inlining(model):
    mod = parse_file(f"fixtures/hlo/zoo/{model}.tpu.hlo")
    new = inline_calls(mod)
    assert not any(i.opcode == "call" for i in new.instructions())
    assert [p.shape for p in new.entry.parameters] == [p.shape for p in mod.entry.parameters]
    assert new.entry.root.shape == mod.entry.root.shape
    kept = {i.name for i in mod.entry.instructions if i.opcode != "call"}
    assert kept <= set(new.entry.by_name)


def test_an_inlined_instruction_without_a_location_takes_its_calls() -> None:
    # JAX writes no location on some ops of a function it lowers once and calls (take_along_axis'
    # select): inlined, they are where the call is; ops with their own location keep it
    mod = parse_module("""
HloModule m

f {
  a = f32[4] parameter(0)
  s = f32[4] negate(a)
  ROOT t = f32[4] exponential(s), metadata={op_name="exp" source_file="lib.py" source_line=7}
}

ENTRY e {
  p = f32[4] parameter(0)
  ROOT c = f32[4] call(p), to_apply=f, metadata={op_name="jit(f)" source_file="model.py" source_line=42}
}
""")
    out = inline_calls(mod)
    assert out.source_of(out.entry["c.s"]) == ("model.py", 42)
    assert out.source_of(out.entry["c.t"]) == ("lib.py", 7)
