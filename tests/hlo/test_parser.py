"""HLO text in -> IR facts out: long and short form, comments, constants, tuples, dynamic dims,
layouts, element types; and malformed text -> one-line ``FILE:LINE:COL`` errors with a caret."""

from __future__ import annotations

import gc
import time

import pytest

from hloopt.errors import HloParseError, HloVerifyError, UserError
from hloopt.hlo.parser import parse_module, parse_modules, parse_shape
from hloopt.hlo.printer import print_module
from hloopt.ir import ELEMENT_TYPES

LONG = """HloModule long_form, entry_computation_layout={(f32[2,3]{1,0}, s32[])->f32[2,3]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (a: f32[2,3], i: s32[]) -> f32[2,3] {
  %a = f32[2,3]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %zero = f32[] constant(0)
  %r = f32[2]{0} reduce(f32[2,3]{1,0} %a, f32[] %zero), dimensions={1}, to_apply=%add
  ROOT %b = f32[2,3]{1,0} broadcast(f32[2]{0} %r), dimensions={0}, metadata={op_name="jit(f)/b" source_file="/x.py" source_line=7}
}
"""

SHORT = """HloModule short_form

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT sum = f32[] add(x, y)
}

ENTRY main {
  a = f32[2,3] parameter(0)
  i = s32[] parameter(1)
  zero = f32[] constant(0)
  r = f32[2] reduce(a, zero), dimensions={1}, to_apply=add
  ROOT b = f32[2,3] broadcast(r), dimensions={0}
}
"""


@pytest.mark.parametrize("text", [LONG, SHORT], ids=["long", "short"])
def test_long_and_short_form_give_the_same_graph(text: str) -> None:
    mod = parse_module(text)
    entry = mod.entry
    assert entry is not None and entry.is_entry and entry.name == "main"
    assert [i.opcode for i in entry] == ["parameter", "parameter", "constant", "reduce", "broadcast"]
    assert entry.root is entry["b"] and entry.root.is_root
    assert [p.name for p in entry.parameters] == ["a", "i"]
    red = entry["r"]
    assert [o.name for o in red.operands] == ["a", "zero"]
    assert red.called["to_apply"][0] is mod.computations["add"]
    assert red.attr_ints("dimensions") == (1,)
    assert entry["b"].users == [] and red.users == [entry["b"]]
    assert str(entry["a"].shape.to_text(layout=False)) == "f32[2,3]"
    assert mod.num_instructions == 8


def test_metadata_and_header() -> None:
    mod = parse_module(LONG)
    md = mod.entry.root.metadata
    assert (md.op_name, md.source_file, md.source_line) == ("jit(f)/b", "/x.py", 7)
    assert mod.source_of(mod.entry.root) == ("/x.py", 7)
    params, result = mod.entry_layout
    assert [str(p) for p in params] == ["f32[2,3]{1,0}", "s32[]"] and str(result) == "f32[2,3]{1,0}"


def test_index_comments_and_nested_and_empty_tuples() -> None:
    text = """HloModule t
ENTRY e {
  p = f32[2] parameter(0)
  e0 = () tuple()
  t = (f32[2], /*index=1*/(f32[2], ()), /*index=2*/()) tuple(p, /*index=1*/ tuple(p, e0), e0)
  ROOT g = (f32[2], ()) get-tuple-element(t), index=1
}
"""
    mod = parse_module(text)
    t = mod.entry["t"]
    assert t.shape.is_tuple and len(t.shape.tuple_shapes) == 3
    assert t.shape.tuple_shapes[2].tuple_shapes == () and t.shape.tuple_shapes[2].is_tuple
    assert t.shape.at((1, 0)).dims == (2,)
    assert [idx for idx, _ in t.shape.leaves()] == [(0,), (1, 0)]
    # the nested ``tuple(p, e0)`` became an instruction of its own, before ``t``
    nested = t.operands[1]
    assert nested.opcode == "tuple" and nested.index < t.index and nested.operands[1].name == "e0"
    assert mod.entry.root.shape.same_dims(t.shape.tuple_shapes[1])


def test_huge_constant_is_kept_elided() -> None:
    mod = parse_module("HloModule c\nENTRY e {\n  ROOT c = f32[1000000] constant({...})\n}\n")
    assert mod.entry.root.literal == "{...}"
    assert mod.entry.root.shape.byte_size == 4_000_000


def test_constant_literal_checks() -> None:
    ok = ("HloModule c\nENTRY e {\n  a = f32[2,3] constant({ { 1, 2, 3 }, /*i=1*/{ 4, 5, 6e3 } })\n"
          "  b = bf16[2] constant({-inf, nan})\n  c = c64[] constant((1, -2))\n"
          "  d = pred[2] constant({true, false})\n  f = u4[2] constant({0, 15})\n"
          "  ROOT t = (f32[2,3], bf16[2], c64[], pred[2], u4[2]) tuple(a, b, c, d, f)\n}\n")
    assert parse_module(ok).entry["a"].literal.startswith("{")
    for shape, lit, phrase in [
        ("f32[2]", "{1, 2, 3}", "expects 2 elements"),
        ("f32[2,2]", "{1, 2, 3, 4}", "expects nested array in rank 2"),
        ("s4[]", "8", "out of range for literal's primitive type S4"),
        ("u8[]", "256", "out of range"),
        ("f16[]", "70000", "out of range for literal's primitive type F16"),
        ("f8e4m3fn[1]", "{nan(0x1)}", "does not support payloads"),
    ]:
        text = f"HloModule c\nENTRY e {{\n  ROOT c = {shape} constant({lit})\n}}\n"
        with pytest.raises(HloParseError, match=phrase.replace("(", r"\(")) as info:
            parse_module(text, filename="c.hlo")
        assert info.value.line == 3


def test_dynamic_dims() -> None:
    s = parse_shape("f32[<=4,3,?]")
    assert s.dims == (4, 3, -1) and s.dynamic == (True, False, True)
    assert str(s) == "f32[<=4,3,?]"
    assert parse_shape("f32[<=4,3]").byte_size == 4 * 3 * 4  # the bound is allocated


def test_layouts_tiles_element_size_memory_space() -> None:
    s = parse_shape("bf16[256,8]{0,1:T(8,128)(2,1)E(16)S(5)}")
    lay = s.layout
    assert lay.minor_to_major == (0, 1)
    assert lay.tiles == ((8, 128), (2, 1))
    assert lay.element_size_bits == 16 and lay.memory_space == 5 and s.on_host
    assert str(s) == "bf16[256,8]{0,1:T(8,128)(2,1)E(16)S(5)}"
    assert parse_shape("f32[]{:T(256)S(2)}").memory_space == 2
    assert parse_shape("s4[10]{0:E(4)}").layout.element_size_bits == 4


@pytest.mark.parametrize("et", sorted(ELEMENT_TYPES - {"token", "opaque"}))
def test_every_element_type(et: str) -> None:
    text = f"HloModule m\nENTRY e {{\n  ROOT p = {et}[3]{{0}} parameter(0)\n}}\n"
    mod = parse_module(text)
    assert mod.entry.root.shape.element_type == et
    assert parse_module(print_module(mod)).entry.root.shape == mod.entry.root.shape


def test_token_and_complex() -> None:
    text = ("HloModule m\nENTRY e {\n  t = token[] after-all()\n  c = c128[2] parameter(0)\n"
            "  ROOT r = (token[], c128[2]) tuple(t, c)\n}\n")
    root = parse_module(text).entry.root
    assert root.shape.tuple_shapes[0].element_type == "token"
    assert root.shape.tuple_shapes[0].byte_size == 0
    assert root.shape.tuple_shapes[1].byte_size == 2 * 16


def test_multi_module_files() -> None:
    text = SHORT + "\n// -----\n" + LONG
    mods = parse_modules(text, filename="two.hlo")
    assert [m.name for m in mods] == ["short_form", "long_form"]
    with pytest.raises(HloParseError, match="several modules"):
        parse_module(text, filename="two.hlo")
    # line numbers of the second module stay true to the file
    bad = SHORT + "\n// -----\n" + LONG.replace("to_apply=%add", "to_apply=%add, foo=1")
    with pytest.raises(UserError, match="unexpected attribute 'foo'") as info:
        parse_modules(bad, filename="two.hlo")
    assert info.value.line == SHORT.count("\n") + 2 + LONG.split("%r =")[0].count("\n") + 1


# -- errors -----------------------------------------------------------------------------------

def _err(text: str) -> HloParseError:
    with pytest.raises(UserError) as info:
        parse_module(text, filename="bad.hlo")
    assert not isinstance(info.value, RecursionError)
    return info.value  # type: ignore[return-value]


def test_expected_found_with_caret() -> None:
    e = _err("HloModule m\nENTRY e {\n  ROOT p = f32[2] parameter(0),, \n}\n")
    assert str(e).startswith("bad.hlo:3:") and "expected attribute name, found ','" in str(e)
    src, caret = e.detail.splitlines()
    assert src == "  ROOT p = f32[2] parameter(0),, "
    assert caret == " " * (e.col - 1) + "^" and src[e.col - 1] == ","


@pytest.mark.parametrize("text,line,phrase", [
    ("HloModule m\nENTRY e {\n  ROOT p = g32[2] parameter(0)\n}\n", 3, "primitive type"),
    ("HloModule m\nENTRY e {\n  ROOT p = f32[2] parameter(0)\n", 4, "not closed"),
    ("HloModule m\nENTRY e {\n  ROOT a = f32[2] add(p, p)\n}\n", 3, "not defined"),
    ("HloModule m\nENTRY e {\n  p = f32[2] parameter(0)\n  p = f32[2] parameter(1)\n}\n", 4,
     "defined twice"),
    ("HloModule m\nENTRY e {\n  p = f32[2] parameter(0)\n  ROOT a = f32[2] add(p, p), foo=1\n}\n",
     4, "unexpected attribute 'foo'"),
    ("HloModule m\nENTRY e {\n  p = f32[2]{1} parameter(0)\n}\n", 3, "not a permutation"),
    # a bad operand shape in long form is reported in the file, not in a "<shape>" sub-parse
    ("HloModule m\nENTRY e {\n  p = f32[2] parameter(0)\n  ROOT a = f32[2] add(f32[-1] p, f32[2] p)\n}\n",
     4, "expected dimension, found '-1'"),
    ("HloModule m\nENTRY e {\n  ROOT p = f32[2] parameter(0), metadata={op_name=\"x}\n}\n", 3,
     "unterminated string"),
])
def test_malformed(text: str, line: int, phrase: str) -> None:
    e = _err(text)
    assert str(e).startswith("bad.hlo:"), str(e)
    assert e.line == line, str(e)
    assert phrase in str(e)
    assert "\n" not in str(e) and e.detail.splitlines()[-1].strip() == "^"


#: nested inputs at depth n (all malformed at line 3, or too deep to read)
NESTED = {
    "nested tuple parens": lambda n: "HloModule m\nENTRY e {\n  ROOT p = " + "(" * n + "f32[]" + ")" * n
    + " parameter(0)\n}\n",
    "deep braces, unclosed": lambda n: "HloModule m\nENTRY e {\n  ROOT p = f32[] parameter(0), backend_config="
    + "{" * (10 * n) + "\n}\n",
    "nested instructions": lambda n: "HloModule m\nENTRY e {\n  ROOT r = " + "negate(" * n + "f32[] parameter(0)"
    + ")" * n + "\n}\n",
    "nested constant braces": lambda n: "HloModule m\nENTRY e {\n  ROOT c = f32[1] constant(" + "{" * n + "1"
    + "}" * n + ")\n}\n",
}


@pytest.mark.parametrize("what", sorted(NESTED))
def test_deep_nesting_is_a_clean_error_in_linear_time(what: str) -> None:
    """100k-deep nesting (1M braces) is one clean error at its line, never a crash, and costs
    time linear in the depth: 4x the depth, measured side by side, costs under 12x the CPU time
    (quadratic work would cost 16x)."""
    make = NESTED[what]

    def cpu(n: int) -> float:
        text = make(n)
        gc.collect()
        gc.disable()  # the parser's own work: the collector's passes over the objects are not it
        try:
            t0 = time.process_time()  # CPU seconds: other processes on a shared machine do not count
            e = _err(text)
            spent = time.process_time() - t0
        finally:
            gc.enable()
        assert e.line == 3, what
        return spent

    small = min(cpu(25_000) for _ in range(3))  # the least of a few runs of each
    big = min(cpu(100_000) for _ in range(3))
    assert big < 12 * max(small, 0.01), (what, small, big)


def test_deep_but_balanced_backend_config_is_read() -> None:
    depth = 1_000_000
    text = ("HloModule m\nENTRY e {\n  ROOT p = f32[] parameter(0), backend_config="
            + "{" * depth + "}" * depth + "\n}\n")
    mod = parse_module(text)
    assert len(mod.entry.root.attrs["backend_config"]) == 2 * depth


def test_verifier_errors() -> None:
    cyc = "HloModule m\nENTRY e {\n  a = f32[] negate(b)\n  b = f32[] negate(a)\n  ROOT r = f32[] add(a, b)\n}\n"
    with pytest.raises(HloVerifyError, match="cycle") as info:
        parse_module(cyc, filename="c.hlo")
    assert info.value.detail.endswith("^")
    gte = ("HloModule m\nENTRY e {\n  p = (f32[2], s32[]) parameter(0)\n"
           "  ROOT g = f32[3] get-tuple-element(p), index=0\n}\n")
    with pytest.raises(HloVerifyError, match="element 0 of its operand is f32\\[2\\]") as info:
        parse_module(gte, filename="g.hlo")
    assert info.value.line == 4
    tup = ("HloModule m\nENTRY e {\n  p = f32[2] parameter(0)\n  ROOT t = (f32[2], f32[2]) tuple(p)\n}\n")
    with pytest.raises(HloVerifyError, match="tuple 't' has shape"):
        parse_module(tup)
    roots = "HloModule m\nENTRY e {\n  ROOT p = f32[2] parameter(0)\n  ROOT q = f32[2] parameter(1)\n}\n"
    with pytest.raises(UserError, match="more than one ROOT"):
        parse_module(roots)
    callee = ("HloModule m\nENTRY e {\n  p = f32[2] parameter(0)\n"
              "  ROOT c = f32[2] call(p), to_apply=nowhere\n}\n")
    with pytest.raises(UserError, match="'nowhere', which is not defined"):
        parse_module(callee)
    recursive = ("HloModule m\nf {\n  p = f32[] parameter(0)\n  ROOT c = f32[] call(p), to_apply=f\n}\n"
                 "ENTRY e {\n  p = f32[] parameter(0)\n  ROOT c = f32[] call(p), to_apply=f\n}\n")
    with pytest.raises(HloVerifyError, match="calls itself"):
        parse_module(recursive)


def test_verifier_on_a_module_built_in_code() -> None:
    from hloopt.hlo.verifier import verify_module

    mod = parse_module(SHORT)
    other = parse_module(LONG)
    mod.entry["b"].operands[0] = other.entry["r"]  # an operand from another module
    with pytest.raises(HloVerifyError, match="not defined in computation 'main'"):
        verify_module(mod)
    mod = parse_module(SHORT)
    mod.entry["a"].is_root = True
    with pytest.raises(HloVerifyError, match="more than one ROOT"):
        verify_module(mod)


def test_tuple_element_operands_are_get_tuple_elements() -> None:
    """XLA's dump files (jaxlib >= 0.12) write element i of a tuple-shaped instruction as ``%t#i``
    and leave out its get-tuple-element: the module reads as the one with the instruction."""
    short = ("HloModule m\nENTRY e {\n  %p = (f32[2]{0}, s32[]) parameter(0)\n"
             "  %n = f32[2]{0} negate(%p#0)\n  ROOT %r = (f32[2]{0}, s32[]) tuple(f32[2]{0} %n, %p#1)\n}\n")
    full = ("HloModule m\nENTRY e {\n  %p = (f32[2]{0}, s32[]) parameter(0)\n"
            "  %g0 = f32[2]{0} get-tuple-element(%p), index=0\n  %g1 = s32[] get-tuple-element(%p), index=1\n"
            "  %n = f32[2]{0} negate(%g0)\n  ROOT %r = (f32[2]{0}, s32[]) tuple(f32[2]{0} %n, %g1)\n}\n")
    a, b = parse_module(short).entry, parse_module(full).entry
    assert [(i.opcode, str(i.shape), i.attrs.get("index")) for i in a.instructions] == \
        [(i.opcode, str(i.shape), i.attrs.get("index")) for i in b.instructions]
    g0 = a.by_name["p.element0"]
    assert g0.operands == [a.by_name["p"]] and a.by_name["n"].operands == [g0]
    assert [i.index for i in a.instructions] == list(range(len(a.instructions)))
    # printed, it reads back the same
    again = parse_module(print_module(parse_module(short))).entry
    assert [(i.name, i.opcode) for i in again.instructions] == [(i.name, i.opcode) for i in a.instructions]
    with pytest.raises(HloParseError, match=r"operand 'p#2' is element 2 of 'p'"):
        parse_module(short.replace("%p#1)", "%p#2)"))
