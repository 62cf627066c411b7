"""HLO text parser: long form (``%x = f32[2]{0} add(f32[2]{0} %a, ...)``) and short form.

The grammar follows XLA's ``hlo_parser.cc``::

    module      := ['HloModule' name (',' attr)*] (computation | debug_table)*
    computation := ['ENTRY'] name [signature] '{' instruction* '}' [',' attr]*
    signature   := '(' [name ':' shape (',' name ':' shape)*] ')' '->' shape
    instruction := ['ROOT'] name '=' shape opcode '(' operands ')' (',' attr)*
    attr        := name '=' value        (value: a balanced token run, kept raw)

Design for speed on multi-megabyte modules: the scanner works on absolute offsets into one
string with compiled regexes (no token objects); shapes are interned by their text; attribute
values are kept raw and interpreted on demand by the IR. Line/column are computed only for
errors and for each instruction's span (by counting newlines incrementally).

Errors are :class:`hloopt.errors.HloParseError`: ``FILE:LINE:COL: expected X, found Y`` plus a
caret snippet. Nothing here recurses on input nesting depth (shape parsing uses an explicit
bound), so hostile input cannot exhaust the stack.
"""

from __future__ import annotations

import re
from typing import Callable, NoReturn

from hloopt.errors import HloParseError
from hloopt.ir import (
    CALLED_COMPUTATION_ATTRS,
    ELEMENT_TYPES,
    AliasEntry,
    Computation,
    Instruction,
    Layout,
    Module,
    Shape,
    gc_paused,
    unquote,
)

MAX_SHAPE_DEPTH = 256
MAX_RANK = 64
MAX_DIM = 1 << 62

_WS = re.compile(r"(?:[ \t\r\n]++|//[^\n]*+|/\*(?:[^*]|\*(?!/))*+\*/)*+")
_NAME = re.compile(r"%?([A-Za-z_$][\w.\-$]*)")
# An operand: an instruction's name, or ``name#i``, element i of a tuple-shaped instruction (XLA's
# dump files write tuple elements so, without get-tuple-element instructions; see link()).
_OPERAND_NAME = re.compile(r"%?([A-Za-z_$][\w.\-$]*(?:#\d+)?)")
_TUPLE_ELEMENT = re.compile(r"(.+)#(\d+)")
_INST_HEAD = re.compile(r"(ROOT[ \t]+)?%?([A-Za-z_$][\w.\-$]*)[ \t]*=[ \t]*")
_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]\[]*)\](\{[^{}]*\})?")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-_]*)[ \t]*\(")
_OPCODE_AHEAD = re.compile(r"([a-z][a-z0-9\-_]*)[ \t]*\(")
_ATTR_NAME = re.compile(r"([A-Za-z_][\w\-.]*)[ \t]*=[ \t]*")
_SIMPLE_VALUE = re.compile(r"[^,\s{}()\[\]\"]+")
_SPACE_GROUP = re.compile(r"[ \t]+[{\[]")
_FLAT_BRACES = re.compile(r'\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_BAL_TOKEN = re.compile(r'[^{}\[\]()"/]+|"(?:[^"\\]|\\.)*"|/\*(?:[^*]|\*(?!/))*\*/|.', re.S)
_SIMPLE_OPERAND = re.compile(r"[ \t\r\n]*(?:/\*[^*]*\*/[ \t\r\n]*)?%?([A-Za-z_$][\w.\-$]*(?:#\d+)?)[ \t\r\n]*(?:,|$)")
_LONG_OPERAND = re.compile(
    r"[ \t\r\n]*(?:/\*[^*]*\*/[ \t\r\n]*)?(?:([a-z][a-z0-9]*\[[^\]\[]*\](?:\{[^{}]*\})?)[ \t\r\n]+)?"
    r"%?([A-Za-z_$][\w.\-$]*(?:#\d+)?)"
    r"[ \t\r\n]*(?:,|$)"
)
_TABLE_ROW = re.compile(r"[ \t]*(\d+)[ \t]+(\"(?:[^\"\\]|\\.)*\"|\{[^{}\n]*\})[ \t]*\n?")
_KV = re.compile(r"([\w]+)=(-?\d+)")
_DIM = re.compile(r"\s*(<=)?\s*(\d+|\?)\s*")

_PARAM_NUMBER = re.compile(r"[0-9]{1,9}")
# Fast path: a whole one-line instruction with an array shape, operands without parens, quotes
# or comments, and attribute values that are simple tokens, strings or brace groups without
# nesting (what JAX and XLA print for nearly every instruction). Anything else falls back to the
# general recursive-descent path, which gives the same result.
_STR_FAST = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'
_ATTR_VALUE_FAST = (r'(?:[^,\s{}()\[\]"]+|' + _STR_FAST + r'|\{[^{}"\n]*(?:' + _STR_FAST
                    + r'[^{}"\n]*)*\})')
_FAST_INST = re.compile(
    r"(ROOT[ \t]+)?%?([A-Za-z_$][\w.\-$]*)[ \t]*=[ \t]*"
    r"([a-z][a-z0-9]*\[[^\]\[\n]*\](?:\{[^{}\n]*\})?)[ \t]+"
    r"([a-z][a-z0-9\-_]*)\(([^()\n\"/]*)\)"
    r"((?:[ \t]*,[ \t]*[A-Za-z_][\w\-.]*=" + _ATTR_VALUE_FAST + r")*)"
    r"[ \t]*(?=\n|$)")
_FAST_ATTR = re.compile(r"[ \t]*,[ \t]*([A-Za-z_][\w\-.]*)=(" + _ATTR_VALUE_FAST + r")")
_FAST_NAME = r"%?[A-Za-z_$][\w.\-$]*(?:#\d+)?"
_SHORT_OPS = re.compile(r"[ \t]*" + _FAST_NAME + r"[ \t]*(?:,[ \t]*" + _FAST_NAME + r"[ \t]*)*")
_LONG_OP = r"[a-z][a-z0-9]*\[[^\]\[]*\](?:\{[^{}]*\})?[ \t]+" + _FAST_NAME
_LONG_OPS = re.compile(r"[ \t]*" + _LONG_OP + r"[ \t]*(?:,[ \t]*" + _LONG_OP + r"[ \t]*)*")
_LONG_OP_ITEM = re.compile(r"([a-z][a-z0-9]*\[[^\]\[]*\](?:\{[^{}]*\})?)[ \t]+%?([A-Za-z_$][\w.\-$]*(?:#\d+)?)")
_WS_FAST = re.compile(r"[ \t\r\n]*")
_CALLED_KEYS = frozenset(CALLED_COMPUTATION_ATTRS)

_OPEN = {"{": "}", "[": "]", "(": ")"}

# Shapes are immutable, so one cache serves every parse in the process.
_SHAPE_CACHE: dict[str, Shape] = {}


def _line_col(text: str, pos: int) -> tuple[int, int, str]:
    line = text.count("\n", 0, pos) + 1
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    if end < 0:
        end = len(text)
    return line, pos - start + 1, text[start:end]


def _found(text: str, pos: int) -> str:
    if pos >= len(text):
        return "end of input"
    m = re.compile(r"[\w.\-%$]+|\S").match(text, pos)
    tok = m.group(0) if m else text[pos]
    if len(tok) > 40:
        tok = tok[:37] + "..."
    return repr(tok)


class _Parser:
    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.n = len(text)
        self.filename = filename
        # Incremental line counting for instruction spans.
        self._line_pos = 0
        self._line_no = 1
        #: Computations written inline in attributes (``to_apply={...}``).
        self._inline: list[Computation] = []
        #: Anonymous instructions nested in operand lists, waiting to join the computation.
        self._nested: list[Instruction] = []
        #: Bracket pairs found by a slow balanced() scan (open offset -> offset past the close),
        #: so nested groups are not rescanned (deeply nested input stays linear).
        self._match: dict[int, int] = {}
        self._anon = 0

    # -- errors -----------------------------------------------------------------------------
    def error(self, pos: int, message: str) -> HloParseError:
        line, col, src = _line_col(self.text, pos)
        return HloParseError(message, filename=self.filename, line=line, col=col, source_line=src)

    def expected(self, pos: int, what: str) -> HloParseError:
        return self.error(pos, f"expected {what}, found {_found(self.text, pos)}")

    def span(self, pos: int) -> tuple[int, int]:
        if pos < self._line_pos:
            line, col, _ = _line_col(self.text, pos)
            return line, col
        self._line_no += self.text.count("\n", self._line_pos, pos)
        start = self.text.rfind("\n", 0, pos) + 1
        self._line_pos = pos
        return self._line_no, pos - start + 1

    # -- scanning -----------------------------------------------------------------------------
    def ws(self, pos: int) -> int:
        pos = _WS.match(self.text, pos).end()  # type: ignore[union-attr]  # always matches
        if self.text.startswith("/*", pos):
            raise self.error(pos, "unterminated comment '/*'")
        return pos

    def balanced(self, pos: int) -> int:
        """``text[pos]`` opens a bracket; return the offset just past its match."""
        text = self.text
        m = _FLAT_BRACES.match(text, pos)
        if m is not None:
            return m.end()
        known = self._match.get(pos)
        if known is not None:
            return known
        match = self._match
        stack = []
        p = pos
        n = self.n
        while p < n:
            m = _BAL_TOKEN.match(text, p)
            tok = m.group(0)  # type: ignore[union-attr]  # always matches
            c = tok[0]
            if c in _OPEN and len(tok) == 1:
                stack.append((_OPEN[c], p))
            elif c in "}])" and len(tok) == 1:
                if not stack or stack[-1][0] != c:
                    raise self.error(p, f"unbalanced {c!r}" + (
                        f": expected {stack[-1][0]!r} to close {text[stack[-1][1]]!r}"
                        if stack else ""))
                match[stack.pop()[1]] = p + 1
                if not stack:
                    return p + 1
            elif c == '"' and (len(tok) == 1 or tok[-1] != '"'):
                raise self.error(p, "unterminated string")
            p = m.end()  # type: ignore[union-attr]  # always matches
        if stack:
            raise self.error(stack[-1][1], f"unclosed {text[stack[-1][1]]!r}")
        return p

    def value(self, pos: int) -> int:
        """Scan one attribute value (a run of simple chars and balanced groups)."""
        text = self.text
        start = pos
        while pos < self.n:
            c = text[pos]
            if c in "{[(":
                pos = self.balanced(pos)
            elif c == '"':
                m = _STRING.match(text, pos)
                if m is None:
                    raise self.error(pos, "unterminated string")
                pos = m.end()
            else:
                m = _SIMPLE_VALUE.match(text, pos)
                if m is None:
                    # ``replica_groups=@mesh[...] {'axis_0'}``: a group after a space continues
                    # the value (an attribute list never has '{' there otherwise).
                    m = _SPACE_GROUP.match(text, pos)
                    if m is None or pos == start:
                        break
                    pos = m.end() - 1
                    continue
                pos = m.end()
        if pos == start:
            raise self.expected(pos, "an attribute value")
        return pos

    # -- shapes -------------------------------------------------------------------------------
    def shape(self, pos: int) -> tuple[Shape, int]:
        text = self.text
        m = _ARRAY_SHAPE.match(text, pos)
        if m is not None and (m.end() >= self.n or text[m.end()] not in "{"):
            key = m.group(0)
            s = _SHAPE_CACHE.get(key)
            if s is None:
                s = self._shape_slow(pos, 0)[0]
                _SHAPE_CACHE[key] = s
            return s, m.end()
        return self._shape_slow(pos, 0)

    def _shape_slow(self, pos: int, depth: int) -> tuple[Shape, int]:
        text = self.text
        if depth > MAX_SHAPE_DEPTH:
            raise self.error(pos, f"shape nested deeper than {MAX_SHAPE_DEPTH} levels")
        if pos < self.n and text[pos] == "(":
            elems = []
            p = self.ws(pos + 1)
            if p < self.n and text[p] == ")":
                return Shape("tuple"), p + 1
            while True:
                s, p = self._shape_slow(p, depth + 1)
                elems.append(s)
                p = self.ws(p)
                if p < self.n and text[p] == ",":
                    p = self.ws(p + 1)
                    continue
                if p < self.n and text[p] == ")":
                    return Shape("tuple", tuple_shapes=tuple(elems)), p + 1
                raise self.expected(p, "',' or ')' in tuple shape")
        m = re.compile(r"[a-z][a-z0-9]*").match(text, pos)
        if m is None:
            raise self.expected(pos, "a shape")
        et = m.group(0)
        if et not in ELEMENT_TYPES:
            raise self.error(pos, f"expected primitive type, found {et!r}")
        p = m.end()
        if p >= self.n or text[p] != "[":
            raise self.expected(p, "'[' after element type")
        close = text.find("]", p)
        if close < 0:
            raise self.error(p, "unclosed '[' in shape")
        dims_text = text[p + 1:close]
        dims: list[int] = []
        dyn: list[bool] = []
        if dims_text.strip():
            for part in dims_text.split(","):
                dm = _DIM.fullmatch(part)
                if dm is None:
                    raise self.error(p + 1, f"expected dimension, found {part.strip()!r}")
                if dm.group(2) == "?":
                    dims.append(-1)
                    dyn.append(True)
                else:
                    v = int(dm.group(2))
                    if v > MAX_DIM:
                        raise self.error(p + 1, f"dimension {v} is too large")
                    dims.append(v)
                    dyn.append(bool(dm.group(1)))
        if len(dims) > MAX_RANK:
            raise self.error(p, f"rank {len(dims)} exceeds {MAX_RANK}")
        p = close + 1
        layout = None
        if p < self.n and text[p] == "{":
            layout, p = self.layout(p, len(dims))
        return Shape(et, tuple(dims), tuple(dyn) if any(dyn) else (), layout), p

    def layout(self, pos: int, rank: int) -> tuple[Layout, int]:
        text = self.text
        end = self.balanced(pos)
        body = text[pos + 1:end - 1]
        if not body.strip():
            # XLA reads a layout only when '{' is followed by a dimension or ':'.
            raise self.error(pos, "expects opcode: '{}' is not a layout (write {0,...} or omit it)")
        head, _, tail = body.partition(":")
        m2m: tuple[int, ...] = ()
        if head.strip():
            try:
                m2m = tuple(int(x) for x in head.split(","))
            except ValueError:
                raise self.error(pos + 1, f"expected minor-to-major dims, found {head.strip()!r}") from None
            if sorted(m2m) != list(range(rank)):
                raise self.error(pos + 1, f"layout {{{head}}} is not a permutation of {rank} dims")
        tiles: list[tuple[int, ...]] = []
        esize = 0
        mspace = 0
        extra = []
        i = 0
        tail = tail.strip()
        while i < len(tail):
            c = tail[i]
            if c == "T":
                i += 1
                while i < len(tail) and tail[i] == "(":
                    j = tail.find(")", i)
                    if j < 0:
                        raise self.error(pos, "unclosed tile in layout")
                    try:
                        tiles.append(tuple(
                            -1 if x.strip() == "*" else -2 if x.strip() == "?" else int(x)
                            for x in tail[i + 1:j].split(",")))
                    except ValueError:
                        raise self.error(pos, f"bad tile {tail[i:j + 1]!r} in layout") from None
                    i = j + 1
                continue
            m = re.compile(r"([A-Z#*]+)\(").match(tail, i)
            if m is None:
                raise self.error(pos + 1 + len(head) + 1, f"unexpected {tail[i:]!r} in layout")
            # Find the matching ')' (P(...) holds a nested shape).
            depth = 0
            j = m.end() - 1
            while j < len(tail):
                if tail[j] == "(":
                    depth += 1
                elif tail[j] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            arg = tail[m.end():j]
            key = m.group(1)
            if key in ("E", "S") and not re.fullmatch(r"[0-9]{1,9}", arg.strip()):
                raise self.error(pos, f"expected an integer in {key}(...) of the layout, found {arg!r}")
            if key == "E":
                esize = int(arg)
            elif key == "S":
                mspace = int(arg)
            else:
                if key == "D" and not all(x.strip() in ("D", "C", "S", "C+", "C~", "C+~", "S~")
                                          for x in arg.split(",")):
                    raise self.error(pos, "expected a DimLevelType abbreviation (D, C, or S)")
                if key == "P":
                    raise self.error(pos, "layout has a physical shape but is not sparse")
                extra.append(tail[i:j + 1])
            i = j + 1
        return Layout(m2m, tuple(tiles), esize, mspace, "".join(extra)), end

    # -- module -------------------------------------------------------------------------------
    def module(self, default_name: str) -> Module:
        text = self.text
        pos = self.ws(0)
        mod = Module(name=default_name, filename=self.filename)
        if text.startswith("HloModule", pos):
            pos = self.ws(pos + len("HloModule"))
            m = _NAME.match(text, pos)
            if m is None:
                raise self.expected(pos, "module name")
            mod.name = m.group(1)
            end = m.end()
            if end < self.n and text[end] == ":":
                end += 1
            pos, attrs = self.attributes(end)
            mod.header_attrs = attrs
            self._header(mod, attrs)
        pending_entry = None
        comps: list[Computation] = []
        while True:
            pos = self.ws(pos)
            if pos >= self.n:
                break
            if text.startswith("HloModule", pos):
                raise self.error(pos, "a second 'HloModule' in one module: "
                                      "the file holds several modules (split by '// -----')")
            table = re.compile(r"(FileNames|FunctionNames|FileLocations|StackFrames)\b").match(text, pos)
            if table is not None:
                pos = self.table(mod, table.group(1), table.end())
                continue
            comp_pos = pos
            comp, pos = self.computation(pos)
            for inline in self._inline:
                mod.computations[inline.name] = inline
                inline.module = mod
            self._inline = []
            if comp.name in mod.computations:
                raise self.error(comp_pos, f"computation {comp.name!r} is defined twice")
            if comp.is_entry:
                if pending_entry is not None:
                    raise self.error(comp_pos, "expects only one ENTRY")
                pending_entry = comp
            mod.computations[comp.name] = comp
            comp.module = mod
            comps.append(comp)
        if not comps:
            raise self.error(pos, "expected a computation, found end of input")
        if pending_entry is None:
            pending_entry = comps[-1]
            pending_entry.is_entry = True
        mod.entry = pending_entry
        self.link(mod)
        from hloopt.hlo.checks import check_module

        for inst in check_module(mod, self._fail, header_fail=self._header_fail):
            inst.is_unknown = True
        return mod

    def _fail(self, inst: Instruction | None, message: str, *, needle: str | None = None,
              offset: int = 0) -> NoReturn:
        """Raise at an instruction (or at ``needle`` inside its text, plus ``offset``)."""
        pos = self._pos_of(inst) if inst is not None else 0
        if needle is not None:
            # An instruction may span lines: search up to the next instruction (or the '}').
            comp = inst.parent if inst is not None else None
            if inst is not None and comp is not None and 0 <= inst.index + 1 < len(comp.instructions):
                limit = self._pos_of(comp.instructions[inst.index + 1])
            else:
                limit = self.text.find("\n}", pos)
            if limit <= pos:
                limit = self.n
            found = self.text.find(needle, pos, limit)
            if found >= 0:
                pos = found + (offset if offset else 0)
        raise self.error(pos, message)

    def _header_fail(self, key: str, message: str, offset: int) -> NoReturn:
        found = self.text.find(key + "=")
        pos = found + len(key) + 1 + offset if found >= 0 else 0
        raise self.error(pos, message)

    def _header(self, mod: Module, attrs: dict[str, str]) -> None:
        v = attrs.get("is_scheduled")
        mod.is_scheduled = v == "true"
        if "frontend_attributes" in attrs:
            from hloopt.ir import parse_string_map

            mod.frontend_attributes = parse_string_map(attrs["frontend_attributes"])
        if "entry_computation_layout" in attrs:
            mod.entry_layout = self._entry_layout(attrs["entry_computation_layout"])
        if "input_output_alias" in attrs:
            mod.input_output_alias = self._aliases(attrs["input_output_alias"])

    def _entry_layout(self, value: str) -> tuple[list[Shape], Shape]:
        sub = _Parser(value, self.filename)
        p = sub.ws(1)
        if not value.startswith("{") or p >= sub.n or value[p] != "(":
            raise self.error(0, "expected entry_computation_layout={(params)->result}")
        params = []
        p = sub.ws(p + 1)
        while p < sub.n and value[p] != ")":
            s, p = sub.shape(p)
            params.append(s)
            p = sub.ws(p)
            if p < sub.n and value[p] == ",":
                p = sub.ws(p + 1)
        p = sub.ws(p + 1)
        if not value.startswith("->", p):
            raise self.error(0, "expected '->' in entry_computation_layout")
        result, _ = sub.shape(sub.ws(p + 2))
        return params, result

    def _aliases(self, value: str) -> list[AliasEntry]:
        out = []
        body = value.strip()
        if not (body.startswith("{") and body.endswith("}")):
            raise self.error(0, "expected input_output_alias={ {out}: (param, {index}) }")
        entry = re.compile(
            r"\s*\{([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{([\d,\s]*)\}\s*(?:,\s*([\w\-]+)\s*)?\)\s*(,|$)")
        p = 1
        inner = body[:-1]
        while True:
            while p < len(inner) and inner[p] in " \t\n":
                p += 1
            if p >= len(inner):
                break
            m = entry.match(inner, p)
            if m is None:
                raise self.error(0, f"malformed input_output_alias entry near {inner[p:p + 30]!r}")
            out.append(AliasEntry(
                tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x),
                int(m.group(2)),
                tuple(int(x) for x in m.group(3).replace(" ", "").split(",") if x),
                m.group(4) or "may-alias",
            ))
            p = m.end()
        return out

    def table(self, mod: Module, kind: str, pos: int) -> int:
        text = self.text
        pos = self.ws(pos)
        while pos < self.n:
            m = _TABLE_ROW.match(text, pos)
            if m is None:
                break
            key = int(m.group(1))
            val = m.group(2)
            if kind == "FileNames":
                mod.file_names[key] = unquote(val)
            elif kind == "FunctionNames":
                mod.function_names[key] = unquote(val)
            else:
                kv = dict((k, int(v)) for k, v in _KV.findall(val))
                if kind == "FileLocations":
                    mod.file_locations[key] = (
                        kv.get("file_name_id", 0), kv.get("function_name_id", 0), kv.get("line", 0),
                        kv.get("end_line", 0), kv.get("column", 0), kv.get("end_column", 0))
                else:
                    mod.stack_frames[key] = (kv.get("file_location_id", 0), kv.get("parent_frame_id", 0))
            pos = self.ws(m.end())
        return pos

    def attributes(self, pos: int) -> tuple[int, dict[str, str]]:
        """Parse ``(, name=value)*``; returns the end offset and raw values."""
        text = self.text
        attrs: dict[str, str] = {}
        while True:
            p = self.ws(pos)
            if p >= self.n or text[p] != ",":
                return pos, attrs
            p = self.ws(p + 1)
            m = _ATTR_NAME.match(text, p)
            if m is None:
                raise self.expected(p, "attribute name")
            key = m.group(1)
            vstart = self.ws(m.end())
            if key == "literal" and vstart < self.n and text[vstart] != "(":
                # ``literal=s32[2]{0} {1, 2}``: a shape, then the literal text.
                _, q = self.shape(vstart)
                vend = self.value(self.ws(q))
            elif key in CALLED_COMPUTATION_ATTRS and text.startswith("{", vstart) and \
                    _INST_HEAD.match(text, self.ws(vstart + 1)) is not None:
                # ``to_apply={ x = f32[] parameter(0) ... }``: an inline computation.
                self._anon += 1
                cname = f"{key}.inline.{self._anon}"
                comp, vend = self.computation_body(Computation(cname), vstart)
                self._inline.append(comp)
                attrs[key] = cname
                pos = vend
                continue
            else:
                vend = self.value(vstart)
            if key in attrs:
                raise self.error(p, f"attribute {key!r} given twice")
            attrs[key] = text[vstart:vend]
            pos = vend

    def computation(self, pos: int) -> tuple[Computation, int]:
        text = self.text
        is_entry = False
        if text.startswith("ENTRY", pos) and not re.compile(r"[\w.\-]").match(text, pos + 5):
            is_entry = True
            pos = self.ws(pos + 5)
        m = _NAME.match(text, pos)
        if m is None:
            raise self.expected(pos, "computation name")
        comp = Computation(m.group(1))
        comp.is_entry = is_entry
        comp.span = self.span(pos)
        pos = self.ws(m.end())
        if pos < self.n and text[pos] == "(":
            pos, sig = self.signature(pos)
            comp.signature = sig
            pos = self.ws(pos)
        if pos >= self.n or text[pos] != "{":
            raise self.expected(pos, f"'{{' to open computation {comp.name!r}")
        comp, pos = self.computation_body(comp, pos)
        pos, attrs = self.attributes(pos)
        if "execution_thread" in attrs:
            comp.execution_thread = unquote(attrs["execution_thread"])
        return comp, pos

    def computation_body(self, comp: Computation, pos: int) -> tuple[Computation, int]:
        """Parse ``{ instruction* }`` starting at the '{'."""
        text = self.text
        n = self.n
        saved_nested = self._nested
        self._nested = []
        pos = self.ws(pos + 1)
        instructions = comp.instructions
        by_name = comp.by_name
        fast_match = _FAST_INST.match
        fast = self._fast_instruction
        while True:
            if pos >= n:
                raise self.error(pos, f"computation {comp.name!r} is not closed with '}}'")
            if text[pos] == "}":
                pos += 1
                break
            start = pos
            fm = fast_match(text, pos)
            got = fast(fm) if fm is not None else None
            if got is not None:
                inst, pos = got
            else:
                inst, pos = self.instruction(pos)
                pos = self.ws(pos)
                if self._nested:
                    for nested in self._nested:
                        nested.index = len(instructions)
                        nested.parent = comp
                        instructions.append(nested)
                        by_name[nested.name] = nested
                    self._nested = []
            name = inst.name
            if name in by_name:
                raise self.error(start, f"instruction {name!r} is defined twice in {comp.name!r}")
            inst.index = len(instructions)
            inst.parent = comp
            instructions.append(inst)
            by_name[name] = inst
            if inst.is_root:
                if comp.root is not None:
                    raise self.error(start, f"computation {comp.name!r} has more than one ROOT")
                comp.root = inst
        if not instructions:
            raise self.error(pos - 1, f"computation {comp.name!r} has no instructions")
        if comp.root is None:
            comp.root = instructions[-1]
            comp.root.is_root = True
        self._nested = saved_nested
        return comp, pos

    def signature(self, pos: int) -> tuple[int, tuple[list[tuple[str, Shape]], Shape]]:
        text = self.text
        params = []
        p = self.ws(pos + 1)
        while p < self.n and text[p] != ")":
            m = _NAME.match(text, p)
            if m is None:
                raise self.expected(p, "parameter name")
            p = self.ws(m.end())
            if p >= self.n or text[p] != ":":
                raise self.expected(p, "':' after parameter name")
            s, p = self.shape(self.ws(p + 1))
            params.append((m.group(1), s))
            p = self.ws(p)
            if p < self.n and text[p] == ",":
                p = self.ws(p + 1)
            elif p < self.n and text[p] != ")":
                raise self.expected(p, "',' or ')' in parameter list")
        p = self.ws(p + 1)
        if not text.startswith("->", p):
            raise self.expected(p, "'->' after computation parameters")
        result, p = self.shape(self.ws(p + 2))
        return p, (params, result)

    def instruction(self, pos: int) -> tuple[Instruction, int]:
        text = self.text
        m = _INST_HEAD.match(text, pos)
        if m is None:
            raise self.expected(pos, "an instruction 'name = shape opcode(...)' or '}'")
        name = m.group(2)
        span = self.span(m.start(2))
        return self._instruction_body(name, span, m.group(1) is not None, m.end(), 0)

    def _fast_instruction(self, m: re.Match[str]) -> tuple[Instruction, int] | None:
        """Build a one-line instruction matched by ``_FAST_INST``; None -> use the general path."""
        text = self.text
        root, name, shape_text, opcode, seg, attr_text = m.groups()
        shape = _SHAPE_CACHE.get(shape_text)
        if shape is None:
            shape, end = self.shape(m.start(3))
            if end != m.end(3):
                return None
        name_pos = m.start(2)
        inst = Instruction(name, opcode, shape)
        # Incremental line/column (see span()).
        if name_pos >= self._line_pos:
            self._line_no += text.count("\n", self._line_pos, name_pos)
            self._line_pos = name_pos
            inst.span = (self._line_no, name_pos - text.rfind("\n", 0, name_pos))
        else:
            inst.span = self.span(name_pos)
        if root is not None:
            inst.is_root = True
        if opcode == "parameter" or opcode == "constant":
            lit = seg.strip()
            if opcode == "parameter" and not _PARAM_NUMBER.fullmatch(lit):
                return None
            inst.literal = lit
            inst.operands = []
        elif not seg or seg.isspace():
            inst.operands = []
        elif "[" not in seg:
            if _SHORT_OPS.fullmatch(seg) is None:
                return None
            inst.operands = [x.strip() for x in seg.replace("%", "").split(",")]  # type: ignore[misc]
        else:
            if _LONG_OPS.fullmatch(seg) is None:
                return None
            cache = _SHAPE_CACHE
            names: list[str] = []
            shapes: list[Shape | None] = []
            for item in _LONG_OP_ITEM.finditer(text, m.start(5), m.end(5)):
                st, nm = item.groups()
                s = cache.get(st)
                if s is None:
                    s, _ = self.shape(item.start(1))  # errors point into the file
                    cache[st] = s
                shapes.append(s)
                names.append(nm)
            inst.operands = names  # type: ignore[assignment]
            inst.operand_shapes = shapes
        if attr_text:
            pairs = _FAST_ATTR.findall(attr_text)
            attrs = dict(pairs)
            if len(attrs) != len(pairs) or "literal" in attrs:
                return None  # a repeated attribute (error) or a literal=: the general path
            if attrs.keys() & _CALLED_KEYS:
                for k in attrs.keys() & _CALLED_KEYS:
                    if attrs[k][0] == "{" and "=" in attrs[k]:
                        return None  # an inline computation
            inst.attrs = attrs
            md = attrs.get("metadata")
            if md is not None:
                inst._metadata_text = md
        p = _WS_FAST.match(text, m.end()).end()  # type: ignore[union-attr]  # always matches
        if p < self.n:
            c = text[p]
            if c == ",":
                return None  # attributes continue on the next line
            if c == "/":
                p = self.ws(p)
        return inst, p

    def _instruction_body(self, name: str, span: tuple[int, int], is_root: bool, p: int,
                          depth: int) -> tuple[Instruction, int]:
        text = self.text
        shape: Shape | None
        if _OPCODE_AHEAD.match(text, p) is not None and not _ARRAY_SHAPE.match(text, p):
            shape = None  # written without a shape: inferred once operands are known
        else:
            shape, p = self.shape(p)
        om = _OPCODE.match(text, p)
        if om is None:
            p2 = self.ws(p)
            raise self.expected(p2, "opcode")
        opcode = om.group(1)
        inst = Instruction(name, opcode, shape)  # type: ignore[arg-type]
        inst.span = span
        inst.is_root = is_root
        open_pos = om.end() - 1
        close = text.find(")", open_pos)
        seg_end = close
        if close < 0 or "(" in text[open_pos + 1:close] or '"' in text[open_pos + 1:close] \
                or "/*" in text[open_pos + 1:close]:
            seg_end = self.balanced(open_pos) - 1
        body_start = open_pos + 1
        if opcode in ("parameter", "constant"):
            inst.literal = text[body_start:seg_end].strip()
            if opcode == "parameter" and not _PARAM_NUMBER.fullmatch(inst.literal):
                raise self.expected(body_start, "parameter number")
            inst.operands = []
            names: list[str] = []
        else:
            names = self.operands(inst, body_start, seg_end, depth)
        attrs: dict[str, str]
        if depth:
            pos, attrs = seg_end + 1, {}
        else:
            pos, attrs = self.attributes(seg_end + 1)
        inst.attrs = attrs
        md = attrs.get("metadata")
        if md is not None:
            inst._metadata_text = md
        inst.operands = names  # type: ignore[assignment]  # resolved by link()
        return inst, pos

    def operands(self, inst: Instruction, start: int, end: int, depth: int = 0) -> list[str]:
        text = self.text
        seg = text[start:end]
        if not seg.strip():
            return []
        names: list[str] = []
        # Fast path: short form (names only).
        if "[" not in seg and "(" not in seg:
            p = start
            while p < end:
                m = _SIMPLE_OPERAND.match(text, p, end)
                if m is None:
                    raise self.expected(self.ws(p), "operand name")
                names.append(m.group(1))
                p = m.end()
            return names
        shapes: list[Shape | None] = []
        p = start
        while p < end:
            m = _LONG_OPERAND.match(text, p, end)
            if m is not None:
                st = m.group(1)
                if st is not None:
                    s = _SHAPE_CACHE.get(st)
                    if s is None:
                        s, _ = self.shape(m.start(1))
                    shapes.append(s)
                else:
                    shapes.append(None)
                names.append(m.group(2))
                p = m.end()
                continue
            # Tuple-shaped operand, a nested instruction, or something unusual.
            q = self.ws(p)
            s = None
            if not (_OPCODE_AHEAD.match(text, q) and not _ARRAY_SHAPE.match(text, q)):
                s, q = self.shape(q)
                q = self.ws(q)
            if _OPCODE_AHEAD.match(text, q, end):
                # ``add(f32[] parameter(0), multiply(...))``: an anonymous nested instruction.
                if depth > MAX_SHAPE_DEPTH:
                    raise self.error(q, "instructions nested too deeply")
                om = _OPCODE_AHEAD.match(text, q, end)
                self._anon += 1
                nname = f"{om.group(1)}.nested.{self._anon}"  # type: ignore[union-attr]  # matched above
                start_q = q
                if s is not None:
                    # Re-parse with the shape in front so the nested instruction keeps it.
                    q = p
                nested, q = self._instruction_body(nname, self.span(self.ws(start_q)), False,
                                                   self.ws(q), depth + 1)
                self._nested.append(nested)
                shapes.append(None)
                names.append(nname)
                q = self.ws(q)
                if q < end and text[q] == ",":
                    q += 1
                elif q < end:
                    raise self.expected(q, "',' between operands")
                p = q
                continue
            nm = _OPERAND_NAME.match(text, q, end)
            if nm is None:
                raise self.error(q, "cannot parse as an instruction name: expected operand name, "
                                    f"found {_found(text, q)}")
            shapes.append(s)
            names.append(nm.group(1))
            q = self.ws(nm.end())
            if q < end and text[q] == ",":
                q += 1
            elif q < end:
                raise self.expected(q, "',' between operands")
            p = q
        inst.operand_shapes = shapes
        return names

    # -- resolution ----------------------------------------------------------------------------
    def _tuple_elements(self, comp: Computation) -> None:
        """Give each ``t#i`` operand of ``comp`` the instruction it stands for: a
        ``get-tuple-element(t), index=i`` named ``t.element<i>``, placed right after ``t`` (XLA's
        dump files leave these instructions out and write the element so; ``as_text()`` keeps
        them). The name is one HLO text can hold, so the module prints and re-parses."""
        by_name = comp.by_name
        wanted: dict[str, list[str]] = {}
        for inst in comp.instructions:
            names: list[str] = inst.operands  # type: ignore[assignment]  # names until link() resolves them
            for nm in names:
                if "#" in nm and nm not in by_name:
                    base, _ = _TUPLE_ELEMENT.fullmatch(nm).groups()  # type: ignore[union-attr]
                    if nm not in wanted.setdefault(base, []):
                        wanted[base].append(nm)
        if not wanted:
            return
        renamed: dict[str, str] = {}
        out: list[Instruction] = []
        for inst in comp.instructions:
            out.append(inst)
            for nm in wanted.get(inst.name, ()):
                index = int(_TUPLE_ELEMENT.fullmatch(nm).group(2))  # type: ignore[union-attr]
                if not inst.shape.is_tuple or index >= len(inst.shape.tuple_shapes):
                    raise self.error(self._pos_of(inst), f"operand {nm!r} is element {index} of "
                                     f"{inst.name!r}, whose shape {inst.shape.to_text(layout=False)} "
                                     "has no such element")
                name = f"{inst.name}.element{index}"
                while name in by_name:
                    name += "_"
                gte = Instruction(name, "get-tuple-element", inst.shape.tuple_shapes[index])
                gte.operands = [inst.name]  # type: ignore[list-item]
                gte.attrs = {"index": str(index)}
                gte.parent = comp
                gte.span = inst.span
                by_name[name] = gte
                renamed[nm] = name
                out.append(gte)
        for inst in out:
            names = inst.operands  # type: ignore[assignment]
            if any("#" in nm for nm in names):
                inst.operands = [renamed.get(nm, nm) for nm in names]  # type: ignore[misc]
        comp.instructions[:] = out
        for i, inst in enumerate(out):
            inst.index = i

    def link(self, mod: Module) -> None:
        comps = mod.computations
        for comp in comps.values():
            self._tuple_elements(comp)
            by_name = comp.by_name
            params: dict[int, Instruction] = {}
            for inst in comp.instructions:
                names: list[str] = inst.operands  # type: ignore[assignment]
                ops = []
                for nm in names:
                    op = by_name.get(nm)
                    if op is None:
                        raise self.error(self._pos_of(inst), f"instruction {inst.name!r} uses "
                                         f"{nm!r}, which is not defined in computation {comp.name!r}")
                    ops.append(op)
                    op.users.append(inst)
                inst.operands = ops
                if inst.operand_shapes is not None:
                    for i, (s, op) in enumerate(zip(inst.operand_shapes, ops)):
                        if s is not None and s is not op.shape and not s.same_dims(op.shape):
                            raise self.error(self._pos_of(inst), f"operand {i} of {inst.name!r} is "
                                             f"written as {s.to_text(layout=False)} but "
                                             f"{op.name!r} has shape {op.shape.to_text(layout=False)}")
                if inst.opcode == "parameter":
                    num = int(inst.literal or 0)
                    if num in params:
                        raise self.error(self._pos_of(inst), f"parameter number {num} is used twice "
                                                             f"in {comp.name!r}")
                    params[num] = inst
                attrs = inst.attrs
                if attrs:
                    for key, v in attrs.items():
                        role = CALLED_COMPUTATION_ATTRS.get(key)
                        if role is None:
                            continue
                        for cname in _computation_names(v):
                            callee = comps.get(cname)
                            if callee is None:
                                raise self.error(self._pos_of(inst), f"{inst.name!r} calls "
                                                 f"computation {cname!r}, which is not defined")
                            inst.called.setdefault(role, []).append(callee)
                            callee.callers.append(inst)
                    cp = attrs.get("control-predecessors")
                    if cp is not None:
                        preds = []
                        for nm in _computation_names(cp):
                            pred = by_name.get(nm)
                            if pred is None:
                                raise self.error(self._pos_of(inst), f"instruction {nm!r} is not "
                                                                     "defined (control-predecessors)")
                            preds.append(pred)
                        inst.control_predecessors = preds
                if inst.shape is None:
                    inst.shape = self._infer_shape(inst, comps)
            if params:
                if sorted(params) != list(range(len(params))):
                    raise self.error(self._pos_of(comp.instructions[0]),
                                     f"parameters of {comp.name!r} are not numbered 0..{len(params) - 1}")
                comp.parameters = [params[i] for i in range(len(params))]

    def _infer_shape(self, inst: Instruction, comps: dict[str, Computation]) -> Shape:
        """Shape of an instruction written without one (XLA infers these the same way)."""
        from hloopt.hlo.shape_inference import infer_shape

        for op in inst.operands:
            if op.shape is None:
                raise self.error(self._pos_of(inst), f"cannot infer the shape of {inst.name!r}: "
                                 f"operand {op.name!r} is defined later without a shape")
        s = infer_shape(inst, comps)
        if s is None:
            raise self.error(self._pos_of(inst), f"cannot infer the shape of {inst.name!r} "
                             f"({inst.opcode}): write its shape")
        return s

    def _pos_of(self, inst: Instruction) -> int:
        line, col = inst.span
        if line <= 0:
            return 0
        p = 0
        for _ in range(line - 1):
            p = self.text.find("\n", p) + 1
        return p + col - 1


def _computation_names(value: str) -> list[str]:
    v = value.strip()
    if v.startswith("{"):
        v = v[1:-1]
    return [x.strip().lstrip("%") for x in v.split(",") if x.strip()]


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------

def parse_module(text: str, *, filename: str = "<string>", name: str | None = None,
                 verify: bool = True) -> Module:
    """Parse one HLO module. Raises :class:`HloParseError` (or HloVerifyError) on bad input."""
    if "\0" in text:
        pos = text.index("\0")
        line, col, src = _line_col(text, pos)
        raise HloParseError("unexpected NUL byte (binary file?)", filename=filename, line=line,
                            col=col, source_line=src.replace("\0", " "))
    default = name or _stem(filename)
    # The parser allocates millions of long-lived objects and frees none: the cyclic GC would
    # rescan the growing heap over and over (8x the parse time on a 200k-instruction module).
    with gc_paused():
        mod = _Parser(text, filename).module(default)
        if verify:
            from hloopt.hlo.verifier import verify_module

            verify_module(mod, text=text, linked=True)
    return mod


def split_modules(text: str) -> list[tuple[int, str]]:
    """Split a file holding several modules (``// -----`` separators, as in XLA's lit tests).

    Returns (line offset, text) pairs; the offset keeps error line numbers true to the file.
    """
    parts = []
    line = 0
    cur: list[str] = []
    start = 0
    for ln in text.splitlines(keepends=True):
        if ln.strip() == "// -----":
            parts.append((start, "".join(cur)))
            cur = []
            start = line + 1
        else:
            cur.append(ln)
        line += 1
    parts.append((start, "".join(cur)))
    return [(s, t) for s, t in parts if _WS.match(t).end() != len(t)]  # type: ignore[union-attr]  # always matches


def parse_modules(text: str, *, filename: str = "<string>", verify: bool = True) -> list[Module]:
    """Parse every module of a file (one, or several separated by ``// -----`` lines)."""
    out = []
    for offset, part in split_modules(text):
        try:
            out.append(parse_module("\n" * offset + part, filename=filename, verify=verify))
        except HloParseError:
            raise
    return out


def parse_shape(text: str) -> Shape:
    """Parse a shape such as ``(f32[2,3]{1,0}, s32[])`` or ``bf16[8,128]{1,0:T(8,128)(2,1)}``."""
    p = _Parser(text, "<shape>")
    pos = p.ws(0)
    s, pos = p.shape(pos)
    pos = p.ws(pos)
    if pos != len(text):
        raise p.expected(pos, "end of shape")
    return s


def parse_shape_list(text: str) -> list[Shape] | None:
    """``{f32[2]{0}, s32[]}`` -> shapes, or None when the text is not a braced shape list."""
    try:
        p = _Parser(text, "<shapes>")
        pos = p.ws(0)
        if not text.startswith("{", pos):
            return None
        pos = p.ws(pos + 1)
        out: list[Shape] = []
        while pos < p.n and text[pos] != "}":
            s, pos = p.shape(pos)
            out.append(s)
            pos = p.ws(pos)
            if pos < p.n and text[pos] == ",":
                pos = p.ws(pos + 1)
        return out
    except HloParseError:
        return None


def parse_file(path: str, *, verify: bool = True) -> Module:
    """Read and parse an HLO text file; a missing/unreadable file is a UserError."""
    return parse_module(read_text(path), filename=path, verify=verify)


def read_text(path: str) -> str:
    from hloopt.errors import UserError

    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected an HLO text file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}): is this an HLO text file?") from None


def _stem(filename: str) -> str:
    import os

    base = os.path.basename(filename)
    return base.split(".")[0] or "module"


ParseFn = Callable[[str], Module]

__all__ = ["parse_file", "parse_module", "parse_modules", "parse_shape", "read_text", "split_modules"]
