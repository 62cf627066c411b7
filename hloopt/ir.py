"""The HLO intermediate representation: modules, computations, instructions, shapes, layouts.

This is the lowest layer of hloopt: it knows nothing of analyses, passes or the CLI.

* :class:`Shape` is immutable and interned by the parser (equal shape text -> the same object),
  so comparing and hashing shapes is cheap. ``Shape.byte_size`` is the exact size XLA allocates
  for an array: element bits (``E(n)`` when the layout says so, else the primitive's storage size),
  padded to the layout's tiles (``T(8,128)(2,1)``) when it has them.
* :class:`Instruction` keeps what analyses need as typed fields (opcode, shape, operands, called
  computations by role, metadata) and every other attribute as raw text in ``attrs``; values are
  interpreted on demand (``inst.attr_ints("dimensions")``), so parsing large modules stays fast.
* :class:`Module` carries the module header (``is_scheduled``, ``input_output_alias``, entry layout,
  frontend attributes) and the debug-info tables (FileNames, FunctionNames, FileLocations,
  StackFrames) that JAX emits with ``debug_info=True``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
from dataclasses import dataclass, field
from typing import Iterator, Sequence

# --------------------------------------------------------------------------------------------
# Element types
# --------------------------------------------------------------------------------------------

#: Storage bits of one element, as XLA's ShapeUtil::ByteSizeOfPrimitiveType stores it when the
#: layout does not say otherwise (sub-byte types take a whole byte unless the layout has E(n)).
STORAGE_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 8, "s2": 8, "s4": 8, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u1": 8, "u2": 8, "u4": 8, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128,
    "f4e2m1fn": 8, "f6e2m3fn": 8, "f6e3m2fn": 8,
    "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8,
    "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
    "token": 0, "opaque": 0,
}

#: Logical bits of one element (what a packed ``E(n)`` layout or a sub-byte packing would use).
LOGICAL_BITS: dict[str, int] = dict(STORAGE_BITS)
LOGICAL_BITS.update({"pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
                     "f4e2m1fn": 4, "f6e2m3fn": 6, "f6e3m2fn": 6})

ELEMENT_TYPES = frozenset(STORAGE_BITS)

#: Memory space of host memory in XLA layouts (``S(5)``).
HOST_MEMORY_SPACE = 5
#: an accelerator's on-chip memory space (TPU VMEM, ``S(1)``), where memory-space assignment places temporaries
ON_CHIP_MEMORY_SPACE = 1


# --------------------------------------------------------------------------------------------
# Layout and shape
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Layout:
    """An XLA layout: ``{1,0:T(8,128)(2,1)E(4)S(5)}``."""

    minor_to_major: tuple[int, ...]
    #: Tiles applied in sequence; a tile dimension of -1 is ``*`` (combine), -2 is ``?``.
    tiles: tuple[tuple[int, ...], ...] = ()
    #: ``E(n)``: bits per element in memory (0 = the primitive's storage size).
    element_size_bits: int = 0
    #: ``S(n)``: memory space; 0 = device default, 5 = host (pinned) memory on TPU/GPU.
    memory_space: int = 0
    #: Everything after ``:`` that hloopt does not interpret (``D(...)``, ``L(n)``, ``P(...)``...).
    extra: str = ""

    def __str__(self) -> str:
        return self.to_text()

    def to_text(self) -> str:
        body = ",".join(map(str, self.minor_to_major))
        tail = ""
        if self.tiles:
            tail += "T" + "".join(
                "(" + ",".join("*" if d == -1 else "?" if d == -2 else str(d) for d in t) + ")"
                for t in self.tiles
            )
        if self.element_size_bits:
            tail += f"E({self.element_size_bits})"
        if self.memory_space:
            tail += f"S({self.memory_space})"
        tail += self.extra
        return "{" + body + (":" + tail if tail else "") + "}"


@dataclass(frozen=True, slots=True)
class Shape:
    """An array or tuple shape. Exactly one of ``tuple_shapes`` (tuple) or ``dims`` applies."""

    element_type: str
    dims: tuple[int, ...] = ()
    #: For each dim, whether it is dynamic (``<=N``: N is the bound; ``?`` is unbounded, dim -1).
    dynamic: tuple[bool, ...] = ()
    layout: Layout | None = None
    #: For tuples: the element shapes (``element_type == "tuple"``).
    tuple_shapes: tuple["Shape", ...] = ()
    # Derived sizes, computed on first use: a shape is immutable and shared by every instruction
    # with the same shape text, and the analyses ask for its size hundreds of thousands of times.
    _num_elements: int = field(default=-1, init=False, repr=False, compare=False)
    _byte_size: int = field(default=-1, init=False, repr=False, compare=False)

    # -- kinds --------------------------------------------------------------------------------
    @property
    def is_tuple(self) -> bool:
        return self.element_type == "tuple"

    @property
    def is_array(self) -> bool:
        return self.element_type not in ("tuple", "token", "opaque")

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def num_elements(self) -> int:
        n = self._num_elements
        if n < 0:
            n = math.prod(max(d, 0) for d in self.dims)
            object.__setattr__(self, "_num_elements", n)
        return n

    @property
    def memory_space(self) -> int:
        return self.layout.memory_space if self.layout is not None else 0

    @property
    def on_host(self) -> bool:
        return self.memory_space == HOST_MEMORY_SPACE

    # -- sizes --------------------------------------------------------------------------------
    @property
    def byte_size(self) -> int:
        """Bytes of this buffer alone (for a tuple: its index table, one pointer per element)."""
        n = self._byte_size
        if n < 0:
            if self.element_type == "tuple":
                n = 8 * len(self.tuple_shapes)
            elif self.element_type in ("token", "opaque"):
                n = 0
            else:
                n = _array_bytes(self)
            object.__setattr__(self, "_byte_size", n)
        return n

    @property
    def total_byte_size(self) -> int:
        """Bytes of every array leaf (tuple index tables not counted)."""
        if self.element_type != "tuple":
            return self.byte_size  # its one leaf
        return sum(s.byte_size for _, s in self.leaves())

    def leaves(self, prefix: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], "Shape"]]:
        """(shape index, array shape) for every non-tuple leaf, in order."""
        if self.element_type != "tuple":
            yield prefix, self
            return
        stack: list[tuple[tuple[int, ...], Shape]] = [(prefix, self)]
        out = []
        while stack:
            idx, s = stack.pop()
            if s.element_type == "tuple":
                for i in range(len(s.tuple_shapes) - 1, -1, -1):
                    stack.append((idx + (i,), s.tuple_shapes[i]))
            else:
                out.append((idx, s))
        yield from out

    def subshapes(self) -> Iterator[tuple[tuple[int, ...], "Shape"]]:
        """(shape index, shape) for every node, tuples included, in pre-order."""
        stack: list[tuple[tuple[int, ...], Shape]] = [((), self)]
        while stack:
            idx, s = stack.pop()
            yield idx, s
            if s.element_type == "tuple":
                for i in range(len(s.tuple_shapes) - 1, -1, -1):
                    stack.append((idx + (i,), s.tuple_shapes[i]))

    def at(self, index: Sequence[int]) -> "Shape":
        """The subshape at a shape index."""
        s = self
        for i in index:
            if s.element_type != "tuple" or not 0 <= i < len(s.tuple_shapes):
                raise IndexError(f"shape index {tuple(index)} is not in {self}")
            s = s.tuple_shapes[i]
        return s

    def same_dims(self, other: "Shape") -> bool:
        """Equal ignoring layout (XLA's ShapeUtil::Compatible, roughly)."""
        if self.element_type != other.element_type:
            return False
        if self.element_type == "tuple":
            return len(self.tuple_shapes) == len(other.tuple_shapes) and all(
                a.same_dims(b) for a, b in zip(self.tuple_shapes, other.tuple_shapes)
            )
        return self.dims == other.dims

    def without_layout(self) -> "Shape":
        if self.element_type == "tuple":
            return Shape("tuple", tuple_shapes=tuple(s.without_layout() for s in self.tuple_shapes))
        return Shape(self.element_type, self.dims, self.dynamic, None)

    # -- text ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.to_text()

    def to_text(self, *, layout: bool = True) -> str:
        if self.element_type == "tuple":
            return "(" + ", ".join(s.to_text(layout=layout) for s in self.tuple_shapes) + ")"
        dims = ",".join(
            ("?" if d < 0 else f"<={d}") if dyn else str(d)
            for d, dyn in zip(self.dims, self.dynamic or (False,) * len(self.dims))
        )
        text = f"{self.element_type}[{dims}]"
        if layout and self.layout is not None:
            text += self.layout.to_text()
        return text


def _array_bytes(shape: Shape) -> int:
    lay = shape.layout
    bits = STORAGE_BITS[shape.element_type]
    if lay is not None and lay.element_size_bits:
        bits = lay.element_size_bits
    if lay is None or not lay.tiles:
        return (shape.num_elements * bits + 7) // 8
    # Tiled: logical dims in physical (major-to-minor) order, padded tile by tile.
    physical = [max(shape.dims[d], 0) for d in reversed(lay.minor_to_major)] if lay.minor_to_major \
        else [max(d, 0) for d in shape.dims]
    dims = physical
    for tile in lay.tiles:
        k = len(tile)
        if k > len(dims):
            dims = [1] * (k - len(dims)) + dims
        major, minor = dims[: len(dims) - k], dims[len(dims) - k:]
        tiled_major = []
        for d, t in zip(minor, tile):
            if t <= 0:  # '*' combines the dim into the tile; '?' keeps it whole.
                tiled_major.append(1)
            else:
                tiled_major.append(-(-d // t))
        tile_dims = [d if t <= 0 else t for d, t in zip(minor, tile)]
        dims = major + tiled_major + tile_dims
    return (math.prod(dims) * bits + 7) // 8


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Metadata:
    """``metadata={op_name="..." source_file="..." source_line=N stack_frame_id=N ...}``."""

    op_name: str = ""
    op_type: str = ""
    source_file: str = ""
    source_line: int = 0
    stack_frame_id: int = 0
    #: Any other key=value pairs, raw.
    extra: tuple[tuple[str, str], ...] = ()


EMPTY_METADATA = Metadata()
#: metadata text -> parsed, shared by every instruction with the same text (bounded)
_METADATA_CACHE: dict[str, Metadata] = {}
_METADATA_CACHE_SIZE = 50_000


#: folders an installed package's files lie under, as they appear in HLO written anywhere: a
#: virtualenv's or the system's ``site-packages``, Debian's ``dist-packages``, and the
#: ``<site-packages>`` placeholder of this repository's zoo snapshots
_PACKAGE_ROOTS = ("/site-packages/", "/dist-packages/", "<site-packages>/")


def package_path(file: str) -> str:
    """``file`` by its package path when it lies in an installed package
    (``<venv>/lib/python3.11/site-packages/transformers/x.py`` -> ``transformers/x.py``),
    unchanged otherwise. HLO a user brings (an XLA dump from any machine) names library files by
    the absolute path of the environment it was written in; reports name them the same way
    whichever environment that was, as lowering here does (:func:`hloopt.lowering.relative_paths`)."""
    for root in _PACKAGE_ROOTS:
        k = file.rfind(root)
        if k >= 0:
            return file[k + len(root):]
    return file


@dataclass(frozen=True, slots=True)
class StackFrame:
    """One frame of the StackFrames table: resolved file, function, line and parent frame id."""

    file: str
    function: str
    line: int
    column: int
    parent_id: int


# --------------------------------------------------------------------------------------------
# Instructions, computations, modules
# --------------------------------------------------------------------------------------------

#: Attribute names whose values name called computations, and the role each gives.
CALLED_COMPUTATION_ATTRS: dict[str, str] = {
    "calls": "calls",
    "to_apply": "to_apply",
    "condition": "condition",
    "body": "body",
    "branch_computations": "branch_computations",
    "true_computation": "branch_computations",
    "false_computation": "branch_computations",
    "called_computations": "calls",
    "async_wrapped_computation": "calls",
    "select": "select",
    "scatter": "scatter",
}


class Instruction:
    """One HLO instruction. Operands and called computations are resolved objects after parsing."""

    __slots__ = (
        "name", "opcode", "shape", "operands", "attrs", "called", "is_root", "parent",
        "index", "operand_shapes", "_metadata_text", "_metadata", "literal", "users",
        "control_predecessors", "span", "is_unknown",
    )

    def __init__(self, name: str, opcode: str, shape: Shape) -> None:
        self.name = name
        self.opcode = opcode
        self.shape = shape
        self.operands: list[Instruction] = []
        #: Raw attribute text by name (``dimensions`` -> ``"{1,0}"``), in text order.
        self.attrs: dict[str, str] = {}
        #: Called computations by role (``body``, ``condition``, ``to_apply``, ``calls``,
        #: ``branch_computations``), in text order.
        self.called: dict[str, list[Computation]] = {}
        self.is_root = False
        self.parent: Computation | None = None
        #: Position in the parent's instruction list (text order).
        self.index = -1
        #: Shapes written beside operands in long form, if any (checked by the verifier).
        self.operand_shapes: list[Shape | None] | None = None
        self._metadata_text: str | None = None
        self._metadata: Metadata | None = None
        #: Operand text of ``constant(...)`` / ``parameter(N)`` etc., raw.
        self.literal: str | None = None
        self.users: list[Instruction] = []
        #: ``control-predecessors={...}``; an empty tuple when there are none (nearly always:
        #: one list per instruction was a seventh of the objects the garbage collector scans)
        self.control_predecessors: Sequence[Instruction] = ()
        #: (line, col) of the instruction's name in the source text, 1-based.
        self.span: tuple[int, int] = (0, 0)
        #: The opcode is one hloopt does not know (XLA's set grows; see hloopt.hlo.checks): the
        #: analyses see a value of its shape computed from its operands, and nothing more.
        self.is_unknown = False

    def __repr__(self) -> str:
        return f"<Instruction {self.name} = {self.shape} {self.opcode}>"

    # -- typed views over raw attributes -------------------------------------------------------
    @property
    def metadata(self) -> Metadata:
        md = self._metadata
        if md is None:
            text = self._metadata_text
            if not text:
                md = EMPTY_METADATA
            else:
                # Metadata is immutable and a few hundred texts cover a 100k-instruction step
                # (every layer repeats its op names): parse each text once.
                md = _METADATA_CACHE.get(text)
                if md is None:
                    md = parse_metadata(text)
                    if len(_METADATA_CACHE) < _METADATA_CACHE_SIZE:
                        _METADATA_CACHE[text] = md
            self._metadata = md
        return md

    @property
    def custom_call_target(self) -> str:
        v = self.attrs.get("custom_call_target")
        return unquote(v) if v is not None else ""

    @property
    def frontend_attributes(self) -> dict[str, str]:
        v = self.attrs.get("frontend_attributes")
        return parse_string_map(v) if v else {}

    @property
    def backend_config(self) -> str:
        v = self.attrs.get("backend_config")
        if v is None:
            return ""
        return unquote(v) if v.startswith('"') else v

    @property
    def sharding(self) -> str | None:
        return self.attrs.get("sharding")

    @property
    def parameter_number(self) -> int:
        return int(self.literal) if self.opcode == "parameter" and self.literal is not None else -1

    @property
    def tuple_index(self) -> int:
        return int(self.attrs["index"]) if "index" in self.attrs else -1

    def callee(self, *roles: str) -> "Computation | None":
        """The first computation called in the first of ``roles`` it has (``"body"``...), or None."""
        for role in roles:
            comps = self.called.get(role)
            if comps:
                return comps[0]
        return None

    @property
    def called_computations(self) -> list["Computation"]:
        return [c for comps in self.called.values() for c in comps]

    def attr_ints(self, key: str) -> tuple[int, ...]:
        """An attribute like ``dimensions={1,0}`` as ints; () when absent."""
        v = self.attrs.get(key)
        if not v:
            return ()
        return tuple(int(x) for x in re.findall(r"-?\d+", v))

    def attr_str(self, key: str, default: str = "") -> str:
        v = self.attrs.get(key)
        return default if v is None else unquote(v)


class Computation:
    """A computation: parameters, instructions in text (or schedule) order, and one root."""

    __slots__ = ("name", "instructions", "root", "is_entry", "parameters", "by_name",
                 "module", "execution_thread", "callers", "signature", "span")

    def __init__(self, name: str) -> None:
        self.name = name
        self.instructions: list[Instruction] = []
        self.root: Instruction | None = None
        self.is_entry = False
        #: Parameter instructions ordered by parameter number.
        self.parameters: list[Instruction] = []
        self.by_name: dict[str, Instruction] = {}
        self.module: Module | None = None
        self.execution_thread = "main"
        #: Instructions (in any computation) that call this one.
        self.callers: list[Instruction] = []
        #: The header's ``(p: shape, ...) -> shape`` when present: (param (name, shape)s, result).
        self.signature: tuple[list[tuple[str, Shape]], Shape] | None = None
        self.span: tuple[int, int] = (0, 0)

    def __repr__(self) -> str:
        return f"<Computation {self.name}: {len(self.instructions)} instructions>"

    def __iter__(self) -> Iterator[Instruction]:
        return iter(self.instructions)

    def __len__(self) -> int:
        return len(self.instructions)

    def __getitem__(self, name: str) -> Instruction:
        return self.by_name[name]

    @property
    def is_fusion(self) -> bool:
        return any(c.opcode == "fusion" for c in self.callers)


@dataclass(frozen=True, slots=True)
class AliasEntry:
    """One ``input_output_alias`` entry: output ``{i}`` may reuse parameter ``p`` at ``{j}``."""

    output_index: tuple[int, ...]
    parameter_number: int
    parameter_index: tuple[int, ...]
    kind: str = "must-alias"


@dataclass
class Module:
    """An HLO module: computations in text order, the entry, the header and debug tables."""

    name: str
    computations: dict[str, Computation] = field(default_factory=dict)
    entry: Computation | None = None
    is_scheduled: bool = False
    input_output_alias: list[AliasEntry] = field(default_factory=list)
    #: ``entry_computation_layout={(params)->result}``: the parameter shapes and the result.
    entry_layout: tuple[list[Shape], Shape] | None = None
    frontend_attributes: dict[str, str] = field(default_factory=dict)
    #: Every header attribute, raw (``num_partitions``, ``replica_count``, ``buffer_donor``...).
    header_attrs: dict[str, str] = field(default_factory=dict)
    file_names: dict[int, str] = field(default_factory=dict)
    function_names: dict[int, str] = field(default_factory=dict)
    #: id -> (file_name_id, function_name_id, line, end_line, column, end_column)
    file_locations: dict[int, tuple[int, int, int, int, int, int]] = field(default_factory=dict)
    #: id -> (file_location_id, parent_frame_id)
    stack_frames: dict[int, tuple[int, int]] = field(default_factory=dict)
    filename: str = "<string>"

    def __repr__(self) -> str:
        return f"<Module {self.name}: {len(self.computations)} computations>"

    @property
    def num_instructions(self) -> int:
        return sum(len(c.instructions) for c in self.computations.values())

    @property
    def num_partitions(self) -> int:
        v = self.header_attrs.get("num_partitions")
        return int(v) if v and v.isdecimal() else 1

    def instructions(self) -> Iterator[Instruction]:
        for c in self.computations.values():
            yield from c.instructions

    @property
    def unknown_opcodes(self) -> dict[str, int]:
        """Opcodes hloopt does not know -> how many instructions use each, in text order."""
        out: dict[str, int] = {}
        for inst in self.instructions():
            if inst.is_unknown:
                out[inst.opcode] = out.get(inst.opcode, 0) + 1
        return out

    def computation(self, name: str) -> Computation:
        return self.computations[name]

    def stack_frame(self, frame_id: int) -> StackFrame | None:
        """Resolve a ``stack_frame_id`` through the debug tables (None when absent)."""
        fr = self.stack_frames.get(frame_id)
        if fr is None:
            return None
        loc = self.file_locations.get(fr[0])
        if loc is None:
            return None
        return StackFrame(
            file=self.file_names.get(loc[0], ""),
            function=self.function_names.get(loc[1], ""),
            line=loc[2],
            column=loc[4],
            parent_id=fr[1],
        )

    def source_of(self, inst: Instruction) -> tuple[str, int] | None:
        """Best source location of an instruction: metadata, else the innermost stack frame (an
        installed package's file by its package path, :func:`package_path`)."""
        md = inst.metadata
        if md.source_file:
            return package_path(md.source_file), md.source_line
        if md.stack_frame_id:
            fr = self.stack_frame(md.stack_frame_id)
            if fr is not None:
                return package_path(fr.file), fr.line
        return None

    def user_source_of(self, inst: Instruction, *, skip: Sequence[str] = ()) -> tuple[str, int] | None:
        """The innermost frame not inside a library path in ``skip`` (e.g. jax's own files)."""
        md = inst.metadata
        fid = md.stack_frame_id
        seen = 0
        while fid and seen < 1000:
            fr = self.stack_frame(fid)
            if fr is None:
                break
            file = package_path(fr.file)
            if not any(s in file for s in skip):
                return file, fr.line
            fid = fr.parent_id
            seen += 1
        return self.source_of(inst)


# --------------------------------------------------------------------------------------------
# Building many objects
# --------------------------------------------------------------------------------------------


#: objects gc_paused() moved to the oldest generation since the last full collection, and the
#: tracked objects that collection left (see gc_paused)
_gc_promoted = 0
_gc_heap_after_collect = 0
#: promote at least this many objects before collecting (a 100k-instruction plan makes ~1M)
_GC_PROMOTE_MIN = 2_000_000


def _after_full_collection(phase: str, info: dict[str, int]) -> None:
    global _gc_promoted, _gc_heap_after_collect
    if phase == "stop" and info.get("generation") == 2:
        _gc_promoted = 0
        _gc_heap_after_collect = len(gc.get_objects())


gc.callbacks.append(_after_full_collection)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while building many long-lived objects.

    Parsing a module or analyzing it allocates millions of objects and frees few. With the
    collector on, each time the survivors grow by a quarter it rescans the whole heap (IR
    included): half the time of planning a 100k-instruction module. At the end of the block the
    objects made inside go straight to the oldest generation (``gc.freeze()`` then
    ``gc.unfreeze()`` moves every tracked object there without scanning it), so the young
    collections do not scan each of them twice more either. The collector does not count objects
    moved that way towards its next full collection, so this does: once they outnumber what the
    last full collection left (and 2M), one ``gc.collect()`` frees the garbage cycles among them.
    Skipped when the process keeps objects frozen itself. Nested blocks are fine: the
    collector's previous state is restored.
    """
    global _gc_promoted
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            _gc_promoted += len(gc.get_objects(generation=0))  # made inside and still alive
            gc.freeze()
            gc.unfreeze()
            if _gc_promoted > max(_gc_heap_after_collect, _GC_PROMOTE_MIN):
                gc.collect()  # resets the count (_after_full_collection)
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------------------------
# Small value parsers shared by the parser and the typed views
# --------------------------------------------------------------------------------------------

_STR_RE = re.compile(r'"((?:[^"\\]|\\.)*)"')
_META_RE = re.compile(r'([\w\-.]+)=("(?:[^"\\]|\\.)*"|[^\s}]+)')


def unquote(text: str) -> str:
    """Decode an HLO string literal (``"a\\"b"``) to text; non-strings come back unchanged."""
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        body = text[1:-1]
        if "\\" not in body:
            return body
        return _unescape(body)
    return text


def _unescape(body: str) -> str:
    out = []
    i = 0
    n = len(body)
    simple = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}
    while i < n:
        c = body[i]
        if c == "\\" and i + 1 < n:
            d = body[i + 1]
            if d in simple:
                out.append(simple[d])
                i += 2
                continue
            if d == "x" and i + 3 < n + 1:
                try:
                    out.append(chr(int(body[i + 2:i + 4], 16)))
                    i += 4
                    continue
                except ValueError:
                    pass
            if d in "01234567":
                j = i + 1
                while j < n and j < i + 4 and body[j] in "01234567":
                    j += 1
                out.append(chr(int(body[i + 1:j], 8)))
                i = j
                continue
            out.append(d)
            i += 2
            continue
        out.append(c)
        i += 1
    s = "".join(out)
    # Octal/hex escapes encode UTF-8 bytes; recombine them when they form valid UTF-8.
    try:
        return s.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return s


def quote(text: str) -> str:
    """Encode text as an HLO string literal (the inverse of :func:`unquote`)."""
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 32:
            out.append("\\x%02x" % ord(ch))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def parse_metadata(text: str) -> Metadata:
    """``{op_name="x" source_file="f.py" source_line=3}`` -> :class:`Metadata`."""
    op_name = op_type = source_file = ""
    source_line = stack_frame_id = 0
    extra = []
    for k, v in _META_RE.findall(text):
        if k == "op_name":
            op_name = unquote(v)
        elif k == "op_type":
            op_type = unquote(v)
        elif k == "source_file":
            source_file = unquote(v)
        elif k == "source_line":
            source_line = int(v) if v.lstrip("-").isdecimal() else 0
        elif k == "stack_frame_id":
            stack_frame_id = int(v) if v.isdecimal() else 0
        else:
            extra.append((k, v))
    return Metadata(op_name, op_type, source_file, source_line, stack_frame_id, tuple(extra))


def parse_string_map(text: str) -> dict[str, str]:
    """``{a="x",b="y"}`` -> {"a": "x", "b": "y"} (frontend_attributes)."""
    out: dict[str, str] = {}
    for m in re.finditer(r'([\w\-.$]+|"(?:[^"\\]|\\.)*")\s*=\s*("(?:[^"\\]|\\.)*"|[^,}\s]+)', text):
        out[unquote(m.group(1))] = unquote(m.group(2))
    return out


__all__ = [
    "AliasEntry", "Computation", "ELEMENT_TYPES", "HOST_MEMORY_SPACE", "Instruction", "ON_CHIP_MEMORY_SPACE", "Layout",
    "LOGICAL_BITS", "Metadata", "Module", "STORAGE_BITS", "Shape", "StackFrame",
    "gc_paused", "package_path", "parse_metadata", "parse_string_map", "quote", "unquote",
]

