"""The semantic checks XLA's HLO parser makes after the grammar: what makes a module "not HLO".

The parser (``parser.py``) accepts anything that fits the grammar and keeps attribute values raw.
XLA's own parser (``xla/hlo/parser/hlo_parser.cc``) rejects more: each opcode accepts a fixed set
of attributes, constants must fit their shape and element type, async chains must be consistent,
and a few attribute values have their own syntax. :func:`check_module` makes those checks on a
linked module so that hloopt rejects what XLA rejects, with ``FILE:LINE:COL`` of the offending
instruction (or attribute / literal token) and a caret snippet.

Algorithm: one pass over the instructions; each check is a small function keyed by opcode. The
attribute table is written from XLA's per-opcode attribute sets (not copied code): the opcode's own
attributes plus the ones every instruction may carry (:data:`COMMON_ATTRS`). ``X-start`` /
``X-update`` / ``X-done`` for an ``X`` that has no native async form is XLA's async sugar: the start
takes ``X``'s attributes plus the async ones, update/done only the async ones.

Invariants: a check never changes the module; it either returns or raises
:class:`~hloopt.errors.HloParseError` through the ``fail`` callback, which knows the source text.
An opcode hloopt does not know is *not* rejected: XLA's opcode set grows with every release
(``mulhi``, which JAX emits for Philox keys, is newer than this table) and libtpu's compiler is
built from a newer XLA than jaxlib's parser, so a name missing here says nothing about the module.
Its instruction keeps its shape, operands and raw attributes; :func:`check_module` returns it so
that the parser flags it (``Instruction.is_unknown``) and the analyses treat it as a value of its
shape. XLA rejects names outside *its* set, but no module in XLA's own rejected corpus
(``hlo-corpus-invalid``) is rejected for its opcode name: its one unknown name (``le`` in
``hlo_parser_test__177``) sits after a scalar layout ``{}`` that both parsers reject first.
``cholesky`` and ``triangular-solve`` take proto-message attributes and are not checked. ``device_ids`` on
collectives is accepted
(newer XLA prints mesh replica groups that way; our zoo snapshots hold it).
"""

from __future__ import annotations

import math
import re
from typing import Callable, NoReturn, Protocol

from hloopt.ir import Instruction, Module

#: Attributes every instruction may carry.
COMMON_ATTRS = frozenset({
    "metadata", "sharding", "backend_config", "frontend_attributes", "control-predecessors",
    "statistics", "origin", "parameter_replication",
})

_ACCURACY_UNARY = (
    "acos acosh asin asinh atanh exponential-minus-one log log-plus-one logistic sqrt cbrt rsqrt "
    "tanh erf sine sinh cosine cosh tan exponential").split()
_PLAIN = (
    "abs all-gather-done all-reduce-done round-nearest-afz round-nearest-even bitcast ceil clz "
    "collective-permute-done copy copy-done opt-barrier imag is-finite floor not negate popcnt "
    "real sign add divide multiply subtract atan2 complex maximum minimum power remainder and or "
    "xor shift-left shift-right-arithmetic shift-right-logical stochastic-convert clamp select "
    "convert bitcast-convert replica-id partition-id dynamic-reshape after-all add-dependency "
    "tuple dynamic-update-slice parameter constant").split()
_COLLECTIVE = {"replica_groups", "channel_id", "device_ids"}
_DOT = {"lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims",
        "operand_precision", "algorithm"}
_CHANNEL = {"channel_id", "is_host_transfer"}

#: opcode -> attributes it accepts besides :data:`COMMON_ATTRS` (None: not checked).
OPCODE_ATTRS: dict[str, frozenset[str] | None] = {
    **{op: frozenset({"result_accuracy"}) for op in _ACCURACY_UNARY},
    **{op: frozenset() for op in _PLAIN},
    "iota": frozenset({"iota_dimension"}),
    "topk": frozenset({"k", "largest"}),
    "all-gather": frozenset(_COLLECTIVE | {"dimensions", "constrain_layout", "use_global_device_ids"}),
    "all-gather-start": frozenset(_COLLECTIVE | {"dimensions", "constrain_layout",
                                                 "use_global_device_ids"}),
    "all-reduce": frozenset(_COLLECTIVE | {"to_apply", "constrain_layout", "use_global_device_ids",
                                           "mode"}),
    "all-reduce-start": frozenset(_COLLECTIVE | {"to_apply", "constrain_layout",
                                                 "use_global_device_ids", "mode"}),
    "reduce-scatter": frozenset(_COLLECTIVE | {"to_apply", "constrain_layout",
                                               "use_global_device_ids", "mode", "dimensions"}),
    "all-to-all": frozenset(_COLLECTIVE | {"dimensions", "constrain_layout"}),
    "ragged-all-to-all": frozenset(_COLLECTIVE | {"dimensions"}),
    "collective-broadcast": frozenset(_COLLECTIVE),
    "collective-permute": frozenset({"source_target_pairs", "channel_id", "slice_sizes"}),
    "collective-permute-start": frozenset({"source_target_pairs", "channel_id", "slice_sizes"}),
    "async-start": frozenset({"async_execution_thread", "output_to_operand_aliasing", "calls"}),
    "async-update": frozenset({"async_execution_thread", "calls"}),
    "async-done": frozenset({"async_execution_thread", "calls"}),
    "copy-start": frozenset({"cross_program_prefetch_index"}),
    "reshape": frozenset({"inferred_dimension"}),
    "sort": frozenset({"dimensions", "is_stable", "to_apply"}),
    "while": frozenset({"condition", "body"}),
    "recv": frozenset(_CHANNEL), "recv-done": frozenset(_CHANNEL),
    "send": frozenset(_CHANNEL), "send-done": frozenset(_CHANNEL),
    "get-tuple-element": frozenset({"index"}),
    "call": frozenset({"to_apply", "is_composite"}),
    "reduce-window": frozenset({"window", "to_apply"}),
    "convolution": frozenset({"window", "dim_labels", "feature_group_count", "batch_group_count",
                              "conv_kind", "operand_precision"}),
    "fft": frozenset({"fft_type", "fft_length"}),
    "triangular-solve": None,
    "cholesky": None,
    "compare": frozenset({"direction", "type"}),
    "broadcast": frozenset({"dimensions"}),
    "concatenate": frozenset({"dimensions"}),
    "map": frozenset({"to_apply", "dimensions"}),
    "scan": frozenset({"to_apply", "dimensions", "num_carries", "is_reverse", "is_associative"}),
    "reduce": frozenset({"to_apply", "dimensions"}),
    "reverse": frozenset({"dimensions"}),
    "select-and-scatter": frozenset({"select", "scatter", "window"}),
    "slice": frozenset({"slice"}),
    "dynamic-slice": frozenset({"dynamic_slice_sizes"}),
    "transpose": frozenset({"dimensions"}),
    "batch-norm-training": frozenset({"epsilon", "feature_index"}),
    "batch-norm-inference": frozenset({"epsilon", "feature_index"}),
    "batch-norm-grad": frozenset({"epsilon", "feature_index"}),
    "pad": frozenset({"padding"}),
    "fusion": frozenset({"calls", "kind", "output_to_operand_aliasing"}),
    "infeed": frozenset({"infeed_config"}),
    "outfeed": frozenset({"outfeed_config", "outfeed_shape"}),
    "rng": frozenset({"distribution"}),
    "rng-get-and-update-state": frozenset({"delta"}),
    "rng-bit-generator": frozenset({"algorithm"}),
    "reduce-precision": frozenset({"exponent_bits", "mantissa_bits"}),
    "conditional": frozenset({"true_computation", "false_computation", "branch_computations"}),
    "custom-call": frozenset({
        "custom_call_target", "window", "dim_labels", "feature_group_count", "batch_group_count",
        "operand_layout_constraints", "custom_call_has_side_effect", "to_apply",
        "called_computations", "output_to_operand_aliasing", "padding_type", "literal",
        "operand_precision", "schedule", "api_version"}),
    "dot": frozenset(_DOT),
    "ragged-dot": frozenset((_DOT - {"algorithm"}) | {"lhs_ragged_dims", "rhs_group_dims"}),
    "scaled-dot": frozenset(_DOT),
    "gather": frozenset({"offset_dims", "collapsed_slice_dims", "start_index_map",
                         "index_vector_dim", "slice_sizes", "indices_are_sorted",
                         "operand_batching_dims", "start_indices_batching_dims"}),
    "scatter": frozenset({"update_window_dims", "inserted_window_dims",
                          "scatter_dims_to_operand_dims", "index_vector_dim", "to_apply",
                          "indices_are_sorted", "unique_indices", "input_batching_dims",
                          "scatter_indices_batching_dims"}),
    "domain": frozenset({"domain"}),
    "get-dimension-size": frozenset({"dimensions"}),
    "set-dimension-size": frozenset({"dimensions"}),
}

#: Attributes XLA requires (``attribute X is expected but not seen``).
REQUIRED_ATTRS: dict[str, tuple[str, ...]] = {
    "iota": ("iota_dimension",), "topk": ("k",), "all-gather": ("dimensions",),
    "all-gather-start": ("dimensions",), "all-reduce": ("to_apply",),
    "all-reduce-start": ("to_apply",), "reduce-scatter": ("to_apply", "dimensions"),
    "collective-permute": ("source_target_pairs",),
    "collective-permute-start": ("source_target_pairs",), "async-start": ("calls",),
    "sort": ("dimensions", "to_apply"), "while": ("condition", "body"),
    "get-tuple-element": ("index",), "call": ("to_apply",), "reduce-window": ("to_apply",),
    "convolution": ("dim_labels",), "fft": ("fft_type", "fft_length"),
    "compare": ("direction",), "concatenate": ("dimensions",), "map": ("to_apply",),
    "scan": ("to_apply", "dimensions", "num_carries"), "reduce": ("to_apply", "dimensions"),
    "reverse": ("dimensions",), "select-and-scatter": ("select", "scatter"), "slice": ("slice",),
    "dynamic-slice": ("dynamic_slice_sizes",), "transpose": ("dimensions",),
    "batch-norm-training": ("epsilon", "feature_index"),
    "batch-norm-inference": ("epsilon", "feature_index"),
    "batch-norm-grad": ("epsilon", "feature_index"), "pad": ("padding",),
    "fusion": ("calls", "kind"), "rng": ("distribution",), "rng-get-and-update-state": ("delta",),
    "rng-bit-generator": ("algorithm",), "reduce-precision": ("exponent_bits", "mantissa_bits"),
    "custom-call": ("custom_call_target",),
    "gather": ("offset_dims", "collapsed_slice_dims", "start_index_map", "index_vector_dim",
               "slice_sizes"),
    "scatter": ("update_window_dims", "inserted_window_dims", "scatter_dims_to_operand_dims",
                "index_vector_dim", "to_apply"),
    "domain": ("domain",), "get-dimension-size": ("dimensions",),
    "set-dimension-size": ("dimensions",),
}

_UNARY = _ACCURACY_UNARY + (
    "abs all-gather-done all-reduce-done round-nearest-afz round-nearest-even bitcast ceil clz "
    "collective-permute-done copy copy-done opt-barrier imag is-finite floor not negate popcnt "
    "real sign convert bitcast-convert copy-start reshape while recv recv-done send-done "
    "get-tuple-element fft cholesky broadcast reverse slice transpose infeed reduce-precision "
    "domain get-dimension-size topk").split()
_BINARY = ("add divide multiply subtract atan2 complex maximum minimum power remainder and or xor "
           "shift-left shift-right-arithmetic shift-right-logical stochastic-convert "
           "add-dependency convolution triangular-solve compare pad outfeed send gather "
           "set-dimension-size").split()
#: Operand counts XLA's parser requires (``expects N operands``).
OPCODE_ARITY: dict[str, int] = {
    **{op: 1 for op in _UNARY}, **{op: 2 for op in _BINARY},
    "iota": 0, "replica-id": 0, "partition-id": 0, "rng-get-and-update-state": 0,
    "clamp": 3, "select": 3, "select-and-scatter": 3, "batch-norm-training": 3,
    "batch-norm-inference": 5, "batch-norm-grad": 5,
}

#: Opcodes with a native ``-start``/``-done`` form (not async sugar).
_NATIVE_ASYNC = frozenset({
    "all-gather-start", "all-gather-done", "all-reduce-start", "all-reduce-done",
    "collective-permute-start", "collective-permute-done", "copy-start", "copy-done",
    "send-done", "recv-done", "async-start", "async-update", "async-done",
})
KNOWN_OPCODES = frozenset(OPCODE_ATTRS)
_ASYNC_ATTRS_START = frozenset({"async_execution_thread", "output_to_operand_aliasing"})
_ASYNC_ATTRS_OTHER = frozenset({"async_execution_thread"})

API_VERSIONS = frozenset({"API_VERSION_UNSPECIFIED", "API_VERSION_ORIGINAL",
                          "API_VERSION_STATUS_RETURNING", "API_VERSION_STATUS_RETURNING_UNIFIED",
                          "API_VERSION_TYPED_FFI"})


class Fail(Protocol):
    def __call__(self, inst: Instruction | None, message: str, *, needle: str | None = None,
                 offset: int = 0) -> NoReturn: ...


def async_form(opcode: str) -> tuple[str, str] | None:
    """``("start"|"update"|"done", wrapped opcode or "")`` for an async op, else None.

    ``async-start`` gives ``("start", "")`` (the wrapped opcode is its computation's root);
    ``custom-call-start`` gives ``("start", "custom-call")``.
    """
    if opcode in ("async-start", "async-update", "async-done"):
        return opcode[6:], ""
    if opcode in _NATIVE_ASYNC or opcode in KNOWN_OPCODES:
        return None
    for suffix in ("-start", "-update", "-done"):
        if opcode.endswith(suffix):
            base = opcode[: -len(suffix)]
            if base in KNOWN_OPCODES and base not in _NATIVE_ASYNC:
                return suffix[1:], base
    return None


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def is_known_opcode(opcode: str) -> bool:
    """Whether hloopt knows ``opcode`` (its own table, or async sugar around a known one)."""
    return opcode in KNOWN_OPCODES or opcode in _NATIVE_ASYNC or async_form(opcode) is not None


def check_module(mod: Module, fail: Fail, *, header_fail: Callable[[str, str, int], NoReturn]
                 ) -> list[Instruction]:
    """Raise (through ``fail``) on the first XLA-parser rule the module breaks; return the
    instructions whose opcode hloopt does not know (their attributes are not checked)."""
    donor = mod.header_attrs.get("buffer_donor")
    if donor is not None:
        _check_buffer_donor(donor, header_fail)
    async_callers: dict[str, Instruction] = {}
    unknown: list[Instruction] = []
    for comp in mod.computations.values():
        for inst in comp.instructions:
            if not _check_instruction(inst, fail, async_callers):
                unknown.append(inst)
    return unknown


def _check_instruction(inst: Instruction, fail: Fail, async_callers: dict[str, Instruction]) -> bool:
    """Check one instruction; False when its opcode is unknown (and nothing was checked)."""
    op = inst.opcode
    # Fast path for the opcodes whose only rules are an operand count and an attribute set.
    arity = _SIMPLE_ARITY.get(op)
    if arity is not None and len(inst.operands) == arity:
        attrs = inst.attrs
        if not attrs or (attrs.keys() <= _ALLOWED_ALL[op] and "result_accuracy" not in attrs):
            return True
    form = None
    allowed: frozenset[str] | None
    if op not in OPCODE_ATTRS:
        form = async_form(op)
        if form is None:
            return False
        kind, base = form
        if kind == "start":
            allowed = (OPCODE_ATTRS[base] or frozenset()) | _ASYNC_ATTRS_START
        else:
            allowed = _ASYNC_ATTRS_OTHER
    else:
        allowed = OPCODE_ATTRS[op]
        if op.startswith("async-"):
            form = (op[6:], "")
    attrs = inst.attrs
    arity = OPCODE_ARITY.get(op)
    if arity is not None and len(inst.operands) != arity:
        fail(inst, f"expects {arity} operand{'s' if arity != 1 else ''}, but has "
                   f"{len(inst.operands)} operands", needle=op + "(")
    elif op in ("reduce", "reduce-window") and len(inst.operands) % 2:
        fail(inst, f"expects an even number of operands, but has {len(inst.operands)} operands")
    elif op == "scatter" and len(inst.operands) % 2 == 0:
        fail(inst, f"expects an odd number of operands, but has {len(inst.operands)} operands")
    if allowed is not None and attrs:
        if op == "conditional" and inst.operands:
            s = inst.operands[0].shape
            if s.element_type == "pred" and s.rank == 0:
                allowed = frozenset({"true_computation", "false_computation"})
            else:
                allowed = frozenset({"branch_computations"})
        for key in attrs:
            if key not in allowed and key not in COMMON_ATTRS:
                names = ", ".join(sorted(allowed | COMMON_ATTRS))
                fail(inst, f"unexpected attribute {key!r}. Allowed attributes: {names}",
                     needle=key + "=")
    req_key = op if form is None or not form[1] else (form[1] if form[0] == "start" else "")
    req = REQUIRED_ATTRS.get(req_key)
    if req:
        for key in req:
            if key not in attrs:
                fail(inst, f"attribute {key!r} is expected but not seen")
    if op == "broadcast" and "dimensions" not in attrs and inst.operands \
            and inst.operands[0].shape.rank > 0:
        fail(inst, "attribute 'dimensions' is expected but not seen (the operand is not a scalar)")
    if form is not None:
        _check_async(inst, form, fail, async_callers)
    check = _CHECKS.get(op)
    if check is not None:
        check(inst, fail)
    if form is not None and form[0] == "start" and form[1]:
        check = _CHECKS.get(form[1])
        if check is not None and form[1] not in ("constant",):
            check(inst, fail)
    ra = attrs.get("result_accuracy")
    if ra is not None:
        _check_result_accuracy(inst, ra, fail)
    return True


# --------------------------------------------------------------------------------------------
# Async chains
# --------------------------------------------------------------------------------------------

def _wrapped_opcode(inst: Instruction) -> str:
    form = async_form(inst.opcode)
    if form is not None and form[1]:
        return form[1]
    calls = inst.called.get("calls")
    if calls and calls[0].root is not None:
        return calls[0].root.opcode
    return ""


def _async_start_of(inst: Instruction) -> Instruction:
    seen = 0
    while inst.opcode != "async-start" and (async_form(inst.opcode) or ("",))[0] != "start":
        if not inst.operands or seen > 10_000:
            break
        inst = inst.operands[0]
        seen += 1
    return inst


def _check_async(inst: Instruction, form: tuple[str, str], fail: Fail,
                 async_callers: dict[str, Instruction]) -> None:
    kind, wrapped = form
    if kind == "start":
        s = inst.shape
        if not s.is_tuple or len(s.tuple_shapes) < 2 or not s.tuple_shapes[0].is_tuple:
            fail(inst, "AsyncStart expects the op shape to be in the form of "
                       "((async-operands), async-outputs, state).")
        for comp in inst.called.get("calls", ()):
            other = async_callers.get(comp.name)
            if other is not None and other is not inst:
                fail(inst, f"Computation {comp.name} is called by more than one async op.")
            async_callers[comp.name] = inst
        return
    ops = inst.operands
    prev_form = async_form(ops[0].opcode) if len(ops) == 1 else None
    if len(ops) != 1 or prev_form is None or prev_form[0] == "done":
        fail(inst, "AsyncUpdate and AsyncDone expect a single async op as their operand.")
    prev = ops[0]
    if kind == "update" and not prev.shape.same_dims(inst.shape):
        fail(inst, "AsyncUpdate expects the op shape to be the same as the operand shape.")
    if wrapped:
        have = _wrapped_opcode(prev)
        if have and have != wrapped:
            fail(inst, f"Expect async wrapped opcode to be {have}, but got {wrapped}")
    start = _async_start_of(prev)
    thread = inst.attrs.get("async_execution_thread")
    if thread is not None:
        want = start.attrs.get("async_execution_thread", '"main"').strip('"')
        if thread.strip('"') != want:
            fail(inst, f"Expect async_execution_thread to be {want}, but got {thread.strip(chr(34))}")
    mine = inst.called.get("calls")
    theirs = start.called.get("calls")
    if mine and theirs and mine[0] is not theirs[0]:
        fail(inst, f"Expect async_wrapped_computation to be {theirs[0].name}, but got {mine[0].name}")


# --------------------------------------------------------------------------------------------
# Per-opcode checks
# --------------------------------------------------------------------------------------------

def _check_conditional(inst: Instruction, fail: Fail) -> None:
    if not inst.operands:
        fail(inst, "conditional expects a branch index operand")
    s = inst.operands[0].shape
    if not s.is_array or s.rank != 0:
        fail(inst, "The first operand must be a scalar")
    if s.element_type not in ("pred", "s32"):
        fail(inst, "The first operand must be a scalar of PRED or S32")
    if s.element_type == "pred":
        for key in ("true_computation", "false_computation"):
            if key not in inst.attrs:
                fail(inst, f"attribute {key!r} is expected but not seen")
    elif "branch_computations" not in inst.attrs:
        fail(inst, "attribute 'branch_computations' is expected but not seen")
    n = len(inst.called.get("branch_computations", ()))
    if n == 0 or len(inst.operands) != n + 1:
        fail(inst, f"conditional has {len(inst.operands)} operands but {n} branch computations "
                   "(expected one operand per branch plus the branch index)")


def _check_infeed(inst: Instruction, fail: Fail) -> None:
    if not inst.shape.is_tuple:
        fail(inst, "infeed must have a non-empty tuple shape")


def _check_custom_call(inst: Instruction, fail: Fail) -> None:
    attrs = inst.attrs
    api = attrs.get("api_version")
    if api is not None:
        if api not in API_VERSIONS:
            fail(inst, f"expects custom-call API version but sees: {api}, error: Unknown API "
                       "version", needle="api_version=")
        if api == "API_VERSION_UNSPECIFIED":
            fail(inst, f"Invalid API version: {api}", needle="api_version=")
    if "to_apply" in attrs and "called_computations" in attrs:
        fail(inst, "A single instruction can't have both to_apply and calls field")
    olc = attrs.get("operand_layout_constraints")
    if olc is not None:
        from hloopt.hlo.parser import parse_shape_list

        # (XLA gives shapes written without a layout the default one, so "has a layout" always
        # holds for parsed text; only the count and the dimensions are checked.)
        shapes = parse_shape_list(olc)
        if shapes is None:
            fail(inst, "expects a list of shapes in operand_layout_constraints",
                 needle="operand_layout_constraints=")
        if len(shapes) != len(inst.operands):
            fail(inst, f"Expected {len(inst.operands)} operand layout constraints, "
                       f"{len(shapes)} given", needle="operand_layout_constraints=")
        for i, (s, o) in enumerate(zip(shapes, inst.operands)):
            if not s.same_dims(o.shape):
                fail(inst, f"Operand layout constraint shape {s} for operand {i} is not "
                           f"compatible with operand shape {o.shape}",
                     needle="operand_layout_constraints=")


_DIM_LABELS = re.compile(r"([0-9bf]+)_([0-9io]+)->([0-9bf]+)")
_WINDOW_KEYS = frozenset({"size", "stride", "pad", "lhs_dilate", "rhs_dilate", "rhs_reversal"})


def _check_convolution(inst: Instruction, fail: Fail) -> None:
    dl = inst.attrs.get("dim_labels")
    if dl is not None:
        m = _DIM_LABELS.fullmatch(dl)
        if m is None:
            fail(inst, f"expects dim labels pattern like 'bf0_oi0->bf0', found {dl!r}",
                 needle="dim_labels=")
        lhs, rhs, out = m.groups()
        rank = len(lhs)
        if not (len(rhs) == rank and len(out) == rank and sorted(lhs) == sorted(out)
                and lhs.count("b") == 1 and lhs.count("f") == 1 and rhs.count("i") == 1
                and rhs.count("o") == 1
                and sorted(c for c in lhs if c.isdigit()) == [str(i) for i in range(rank - 2)]
                and sorted(c for c in rhs if c.isdigit()) == [str(i) for i in range(rank - 2)]):
            fail(inst, f"convolution dim_labels {dl!r} are inconsistent", needle="dim_labels=")
        if inst.operands and inst.operands[0].shape.rank != rank:
            fail(inst, f"convolution dim_labels {dl!r} have rank {rank} but the input has rank "
                       f"{inst.operands[0].shape.rank}", needle="dim_labels=")
    _check_window(inst, fail)


def _check_window(inst: Instruction, fail: Fail) -> None:
    w = inst.attrs.get("window")
    if w is None:
        return
    body = w.strip()
    if not (body.startswith("{") and body.endswith("}")):
        fail(inst, "expects '{' to start window", needle="window=")
    sizes = set()
    for item in body[1:-1].split():
        key, eq, val = item.partition("=")
        if not eq or key not in _WINDOW_KEYS:
            fail(inst, f"unexpected attribute {key!r} in window", needle="window=")
        parts = val.split("x")
        if key == "pad":
            for p in parts:
                if re.fullmatch(r"-?\d+_-?\d+", p) is None:
                    fail(inst, "expects padding_low and padding_high separated by '_'",
                         needle="window=")
        else:
            for p in parts:
                if re.fullmatch(r"-?\d+", p) is None:
                    fail(inst, f"expects integers separated by 'x' in window {key}, found {val!r}",
                         needle="window=")
        sizes.add(len(parts))
    if len(sizes) > 1:
        fail(inst, "window has a different number of dimensions per field", needle="window=")


_ACCURACY_MODES = frozenset({"default", "highest"})
_TOLERANCE_KEYS = frozenset({"atol", "rtol", "ulps"})


def _check_result_accuracy(inst: Instruction, value: str, fail: Fail) -> None:
    v = value.strip()
    if not (v.startswith("{") and v.endswith("}")):
        fail(inst, "expects '{' to start result_accuracy", needle="result_accuracy=")
    body = v[1:-1].strip()
    m = re.match(r"([A-Za-z_][\w\-]*)\s*=\s*", body)
    if m is None:
        fail(inst, "expects attribute name", needle="result_accuracy=")
    key, rest = m.group(1), body[m.end():]
    if key == "mode":
        if rest.strip().lower() not in _ACCURACY_MODES:
            fail(inst, f"expects ResultAccuracy type but sees: {rest.strip()}, error: Unknown "
                       "accuracy mode", needle="result_accuracy=")
    elif key == "tolerance":
        t = rest.strip()
        if not (t.startswith("{") and t.endswith("}")):
            fail(inst, "expects '{' to start tolerance", needle="result_accuracy=")
        for item in t[1:-1].split(","):
            k, eq, val = item.strip().partition("=")
            if k not in _TOLERANCE_KEYS or not eq:
                fail(inst, f"invalid attribute name: {k}", needle="result_accuracy=")
            try:
                float(val)
            except ValueError:
                fail(inst, f"expects a number for tolerance {k}, found {val!r}",
                     needle="result_accuracy=")
    else:
        fail(inst, f"invalid attribute name: {key}", needle="result_accuracy=")


def _check_buffer_donor(value: str, header_fail: Callable[[str, str, int], NoReturn]) -> None:
    body = value.strip()
    if not (body.startswith("{") and body.endswith("}")):
        header_fail("buffer_donor", "expects '{' to start buffer_donor", 0)
    entry = re.compile(r"\s*\(\s*(\S+?)\s*,\s*\{([^{}]*)\}\s*\)\s*(,|$)")
    p = 1
    inner = body[:-1]
    while True:
        while p < len(inner) and inner[p] in " \t\r\n":
            p += 1
        if p >= len(inner):
            return
        m = entry.match(inner, p)
        if m is None:
            header_fail("buffer_donor", "expects '(parameter, {index})' in buffer_donor", p)
        if not re.fullmatch(r"\d+", m.group(1)):
            header_fail("buffer_donor", "expects integer", m.start(1))
        off = m.start(2)
        for part in m.group(2).split(","):
            stripped = part.strip()
            if stripped and not re.fullmatch(r"[0-9]+", stripped):
                header_fail("buffer_donor", "expects integer", off + part.index(stripped))
            off += len(part) + 1
        p = m.end()


# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

#: Largest finite value and the spacing of values at the top, per floating type.
_FLOAT_RANGE: dict[str, tuple[float, float]] = {
    "f16": (65504.0, 32.0),
    "bf16": (3.3895313892515355e38, 2.0 ** 120),
    "f32": (3.4028234663852886e38, 2.0 ** 104),
    "f8e5m2": (57344.0, 8192.0), "f8e5m2fnuz": (57344.0, 8192.0),
    "f8e4m3": (240.0, 16.0), "f8e4m3fn": (448.0, 32.0), "f8e4m3fnuz": (240.0, 16.0),
    "f8e4m3b11fnuz": (30.0, 2.0), "f8e3m4": (15.5, 0.5), "f8e8m0fnu": (2.0 ** 127, 2.0 ** 127),
    "f4e2m1fn": (6.0, 2.0), "f6e2m3fn": (7.5, 0.5), "f6e3m2fn": (28.0, 4.0),
}
#: Mantissa bits that can hold a NaN payload; 0 = the type has no NaN payloads.
_NAN_PAYLOAD_BITS: dict[str, int] = {
    "f16": 10, "bf16": 7, "f32": 23, "f64": 52, "f8e5m2": 2, "f8e4m3": 3, "f8e3m4": 4,
    "f8e4m3fn": 0, "f8e4m3fnuz": 0, "f8e4m3b11fnuz": 0, "f8e5m2fnuz": 0, "f8e8m0fnu": 0,
    "f4e2m1fn": 0, "f6e2m3fn": 0, "f6e3m2fn": 0,
}
_INT_BITS = {"s1": 1, "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
             "u1": 1, "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64}
_LIT_TOKEN = re.compile(r"\s*(?:/\*.*?\*/\s*)*([{}(),]|[^{}(),\s/]+|/)", re.S)


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _check_constant(inst: Instruction, fail: Fail) -> None:
    text = inst.literal
    if text is None:
        return
    shape = inst.shape
    if shape is None or shape.is_tuple or not shape.is_array or shape.dynamic:
        return
    if "..." in text:
        return  # a huge constant printed elided: XLA reads it as unknown values.
    et = shape.element_type

    def bad(msg: str, at: int) -> NoReturn:
        fail(inst, msg, needle=inst.opcode + "(", offset=len(inst.opcode) + 1 + at)

    rank = shape.rank
    dims = shape.dims
    # Tokenize: braces, commas, parens (complex), and values.
    toks: list[tuple[str, int]] = []
    p = 0
    n = len(text)
    while p < n:
        m = _LIT_TOKEN.match(text, p)
        if m is None:
            break
        toks.append((m.group(1), m.start(1)))
        p = m.end()
    if rank == 0:
        _check_scalar(et, toks, 0, bad, allow_brace=True)
        return
    depth = 0
    counts = [0] * (rank + 1)
    i = 0
    values_at_depth = 0
    nt = len(toks)
    while i < nt:
        tok, at = toks[i]
        if tok == "{":
            if depth >= rank:
                bad(f"expects nested array in rank {rank}, but sees larger", at)
            if depth > 0:
                counts[depth] += 1
                if counts[depth] > dims[depth - 1]:
                    bad(f"expects {dims[depth - 1]} elements in the "
                        f"[{counts[depth - 1] - 1 if depth > 1 else 0}]th element, but sees more", at)
            depth += 1
            counts[depth] = 0
            i += 1
        elif tok == "}":
            if depth == 0:
                bad("unexpected '}' token", at)
            if counts[depth] != dims[depth - 1] and (depth < rank or values_at_depth or dims[depth - 1]):
                bad(f"expects {dims[depth - 1]} elements, but sees {counts[depth]}", at)
            depth -= 1
            values_at_depth = 0
            i += 1
            if depth == 0:
                if i < nt:
                    bad(f"unexpected {toks[i][0]!r} after the literal", toks[i][1])
                return
        elif tok == ",":
            i += 1
        else:
            if depth == 0:
                # XLA takes a bare value for an array (``f32[1] constant(1)``): check the value.
                j = _check_scalar(et, toks, i, bad, allow_brace=False)
                if j < nt:
                    bad(f"unexpected {toks[j][0]!r} after the literal", toks[j][1])
                return
            if depth < rank:
                bad(f"expects nested array in rank {rank}, but sees {depth}", at)
            counts[depth] += 1
            values_at_depth += 1
            if counts[depth] > dims[depth - 1]:
                bad(f"expects {dims[depth - 1]} elements in the [{counts[depth - 1] - 1}]th "
                    "element, but sees more", at)
            i = _check_scalar(et, toks, i, bad, allow_brace=False)
    if depth != 0 or not toks:
        bad("expects '}' to end the literal", n)


def _check_scalar(et: str, toks: list[tuple[str, int]], i: int, bad: Callable[[str, int], NoReturn],
                  *, allow_brace: bool) -> int:
    """Check one value starting at toks[i]; return the index after it."""
    if i >= len(toks):
        bad("expects a literal value", 0)
    tok, at = toks[i]
    if allow_brace and tok == "{":  # ``constant({1})`` for a scalar is not XLA syntax either
        bad("expects a scalar literal, found '{'", at)
    if et in ("c64", "c128"):
        if tok != "(" or i + 4 >= len(toks) + 0 and i + 4 > len(toks):
            bad(f"expects a complex literal '(real, imag)' for {et}, found {tok!r}", at)
        if i + 4 > len(toks) or toks[i + 2][0] != "," or toks[i + 4][0] != ")":
            bad(f"expects a complex literal '(real, imag)' for {et}", at)
        lim = 3.4028234663852886e38 if et == "c64" else math.inf
        for part, (t, a) in (("real", toks[i + 1]), ("imaginary", toks[i + 3])):
            v = _float_value(t, a, bad)
            if math.isfinite(v) and abs(v) >= lim + 2.0 ** 103 and et == "c64":
                bad(f"{part} part {_fmt(v)} is out of range for literal's primitive type C64, "
                    f"namely [{_fmt(-3.40282e38)}, {_fmt(3.40282e38)}].", a)
            if _overflows_double(t):
                bad("Constant is out of range for double (+/-1.79769e+308) and so is unparsable.", a)
        return i + 5
    if tok in ("{", "}", "(", ")", ","):
        bad(f"expects a literal value, found {tok!r}", at)
    if et == "pred":
        if tok not in ("true", "false", "0", "1"):
            bad(f"expects true or false for a pred literal, found {tok!r}", at)
        return i + 1
    if et in _INT_BITS:
        try:
            v = int(tok, 0)
        except ValueError:
            if tok in ("true", "false"):
                return i + 1
            bad(f"expects an integer literal for {et}, found {tok!r}", at)
        bits = _INT_BITS[et]
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if et[0] == "s" else (0, (1 << bits) - 1)
        # XLA reads integers as int64 first: u64 also takes negative int64 values (two's complement).
        if not lo <= v <= hi and not (et == "u64" and -(1 << 63) <= v < 0):
            bad(f"value {v} is out of range for literal's primitive type {et.upper()} namely "
                f"[{lo}, {hi}].", at)
        return i + 1
    # Floating point.
    low = tok.lower().lstrip("+-")
    if low.startswith("nan(") or (low == "nan" and i + 1 < len(toks) and toks[i + 1][0] == "("):
        payload_text = tok[tok.index("(") + 1:] if "(" in tok else ""
        j = i + 1
        if not payload_text:
            payload_text = toks[i + 2][0] if i + 2 < len(toks) else ""
            j = i + 4
        else:
            j = i + 2  # the ')' token
        try:
            payload = int(payload_text.rstrip(")"), 0)
        except ValueError:
            bad(f"expects a NaN payload, found {payload_text!r}", at)
        nbits = _NAN_PAYLOAD_BITS.get(et)
        if nbits is not None:
            if nbits == 0:
                bad(f"tries to set NaN payload {payload:#x} to a literal in shape {et}[1] at "
                    f"linear index 0, but {et} does not support payloads", at)
            if payload >= (1 << nbits):
                bad(f"tries to set NaN payload {payload:#x} to a literal in shape {et}[1] at "
                    f"linear index 0, but the NaN payload is out of range ({(1 << nbits) - 1:#x})", at)
        return j
    v = _float_value(tok, at, bad)
    if et == "f64":
        if _overflows_double(tok):
            bad("Constant is out of range for double (+/-1.79769e+308) and so is unparsable.", at)
        return i + 1
    rng = _FLOAT_RANGE.get(et)
    if rng is not None and math.isfinite(v):
        top, ulp = rng
        if abs(v) >= top + ulp / 2:
            bad(f"value {_fmt(v)} is out of range for literal's primitive type {et.upper()} "
                f"namely [{_fmt(-top)}, {_fmt(top)}].", at)
    return i + 1


def _float_value(tok: str, at: int, bad: Callable[[str, int], NoReturn]) -> float:
    low = tok.lower()
    if low in ("inf", "+inf", "-inf", "nan", "-nan", "+nan"):
        return float(low)
    try:
        return float(tok) if not low.startswith(("0x", "-0x")) else float(int(tok, 16))
    except ValueError:
        bad(f"expects a number, found {tok!r}", at)


def _overflows_double(tok: str) -> bool:
    low = tok.lower().lstrip("+-")
    if low in ("inf", "nan") or low.startswith("nan"):
        return False
    try:
        return math.isinf(float(tok))
    except ValueError:
        return False


_CHECKS: dict[str, Callable[[Instruction, Fail], None]] = {
    "conditional": _check_conditional,
    "infeed": _check_infeed,
    "custom-call": _check_custom_call,
    "convolution": _check_convolution,
    "reduce-window": _check_window,
    "select-and-scatter": _check_window,
    "constant": _check_constant,
}

#: Opcode -> its attributes plus the common ones (for the fast path).
_ALLOWED_ALL: dict[str, frozenset[str]] = {
    op: a | COMMON_ATTRS for op, a in OPCODE_ATTRS.items() if a is not None}
#: Opcodes checked by operand count and attribute set alone -> their operand count.
_SIMPLE_ARITY: dict[str, int] = {
    op: n for op, n in OPCODE_ARITY.items()
    if op not in REQUIRED_ATTRS and op not in _CHECKS and op in _ALLOWED_ALL
    and op not in ("broadcast", "conditional")}

__all__ = ["API_VERSIONS", "COMMON_ATTRS", "KNOWN_OPCODES", "is_known_opcode", "OPCODE_ARITY", "OPCODE_ATTRS",
           "REQUIRED_ATTRS",
           "async_form", "check_module"]
