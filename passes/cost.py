"""Roofline cost of every instruction: FLOPs, transcendentals, bytes accessed, seconds.

Counting follows XLA's ``HloCostAnalysis`` (xla/service/hlo_cost_analysis.cc), re-derived from
the HLO text:

* elementwise ops: one FLOP per output element; ``exp log logistic power sqrt cbrt rsqrt tanh
  sin cos tan expm1 log1p atan2 erf`` count as *transcendentals* instead (``rng``: one each);
* ``dot``: ``2 * elements(output) * prod(lhs contracting dims)`` (batch dims are in the output);
* ``convolution``: ``2 * (in_features / feature_groups) * out_features * (batch / batch_groups)
  * prod_d(valid (output, kernel) position pairs along spatial dim d)``, so padding and dilation
  holes are not counted;
* ``reduce``: the reducer's cost times ``elements(input) - elements(output)``; ``reduce-window``
  ``(window - 1) * elements(output)``; ``map`` per element; ``sort`` ``n * ceil(log2 n)``;
  ``all-reduce`` one FLOP per output element;
* bytes accessed: operands read + output written, except: ``parameter constant
  get-tuple-element bitcast after-all add-dependency domain`` touch nothing; ``tuple`` writes its
  index table; ``slice``/``dynamic-slice``/``gather`` read what they output; ``dynamic-update-
  slice``/``scatter`` touch the update only;
* ``fusion``: FLOPs of its fused computation, but bytes only at its boundary: outputs written
  (a dynamic-update-slice root writes its update) plus, per fused parameter, what its readers
  read (a slice reads its output, a dynamic-update-slice's operand 0 is not read, others share
  one full read) plus constants of more than one element;
* ``while``: XLA counts ``body + condition`` once. We also count ``(body + condition) * trip
  count`` when the trip count is known, from ``backend_config={"known_trip_count":{"n":"L"}}`` or
  from the pattern ``i = constant K; while i <cmp> constant C; i += constant S`` (condition root a
  compare, possibly inside a fusion);
* ``conditional``: the per-property maximum over branches (as XLA), or their mean
  (``conditional="mean"``); ``call``/``async-start``: the callee's sum;
* collectives move bytes over the interconnect: ``all-gather`` its output, ``all-reduce`` twice
  its operand (ring reduce-scatter + all-gather), ``reduce-scatter``, ``all-to-all``,
  ``collective-permute`` their operands.

Time of an instruction (roofline)::

    seconds = max((flops + transcendentals) / flops_per_s(dtype), bytes / hbm_bytes_per_s,
                  collective_bytes / interconnect_bytes_per_s) / efficiency(op_class) + per_op_overhead_s

A move between device and host memory (:func:`~hloopt.passes.opcodes.is_host_transfer`: JAX's
``annotate_device_placement`` markers, a compiled module's copies to or from ``S(5)``) keeps its
bytes but takes no time here: it runs on the DMA engines beside the compute, at the host link's
rate, and the simulator times it as a transfer.

Fused kernels: a pre-optimization module has no fusions, and XLA fuses most of its element-wise
ops into the kernels that read them, where they touch no HBM of their own. Given a model of that
fusion (``fusion``, such as the TPU compiler model's ``TpuFusion()``), an instruction the model
fuses away costs its FLOPs and no bytes, and one that keeps its value reads, in place of each
fused-away operand, the materialized values that operand is computed from (each once per kernel,
no more than the operand's size). The bytes then approach those of the kernels the compiler
forms; without a model every instruction is a kernel of its own.

``efficiency`` is the profile's fitted share of the roofline that ops of the class reach
(``compute_efficiency``, from ``hloopt calibrate --profile``; 1.0 where not fitted, as in every
built-in profile).

with ``dtype`` the element type of a dot/convolution's lhs (inside a fusion: its first one),
else of the output. A ``while``/``call``/``conditional`` takes the time of its callees' instructions
(times the trip count). Free instructions (parameters, tuples, bitcasts...) take no time and no
overhead.

Invariants: ``totals_xla`` counts each loop body once (comparable to ``compiled.cost_analysis()``);
``totals`` equals ``totals_xla`` plus ``(L - 1) * (body + condition)`` for each loop of known trip
count ``L``; every count is >= 0.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from hloopt.devices import DeviceProfile, load_profile
from hloopt.errors import UserError
from hloopt.ir import Computation, Instruction, Module, Shape
from hloopt.passes import Analysis, AnalysisManager
from hloopt.passes.loops import trip_count
from hloopt.passes.opcodes import COLLECTIVES, ELEMENTWISE, TRANSCENDENTAL, is_host_transfer

__all__ = ["Cost", "InstructionCost", "CostResult", "CostAnalysis", "trip_count", "dot_flops", "convolution_flops",
           "op_class"]

#: Instructions that move no data and take no time.
FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "bitcast", "after-all", "add-dependency", "domain",
    "partition-id", "replica-id", "opt-barrier", "optimization-barrier",
})
_CONTROL = frozenset({"while", "call", "conditional", "async-start"})
_FMA_FLOPS = 2


@dataclass(frozen=True)
class Cost:
    """Counts of one execution of something (an instruction, a computation)."""

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0
    #: Bytes moved over the chip interconnect by collectives.
    collective_bytes: float = 0.0
    seconds: float = 0.0

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(self.flops + o.flops, self.transcendentals + o.transcendentals,
                    self.bytes_accessed + o.bytes_accessed, self.collective_bytes + o.collective_bytes,
                    self.seconds + o.seconds)

    def scaled(self, k: float) -> "Cost":
        return Cost(self.flops * k, self.transcendentals * k, self.bytes_accessed * k,
                    self.collective_bytes * k, self.seconds * k)

    def with_seconds(self, s: float) -> "Cost":
        return Cost(self.flops, self.transcendentals, self.bytes_accessed, self.collective_bytes, s)


ZERO = Cost()


@dataclass(frozen=True)
class InstructionCost:
    """One instruction's cost: ``full`` applies loop trip counts, ``xla`` counts loop bodies once."""

    full: Cost
    xla: Cost
    #: Trip count applied to a ``while`` (1 for everything else; None: unknown, counted once).
    trip_count: int | None = 1

    @property
    def flops(self) -> float:
        return self.full.flops

    @property
    def transcendentals(self) -> float:
        return self.full.transcendentals

    @property
    def bytes_accessed(self) -> float:
        return self.full.bytes_accessed

    @property
    def seconds(self) -> float:
        return self.full.seconds


@dataclass(frozen=True)
class CostResult:
    """Per-instruction costs (every instruction of every visited computation) and module totals."""

    #: Instruction name -> the cost of one execution of it (instruction names are unique in a
    #: module): an instruction inside a loop body costs one iteration, the ``while`` all of them.
    per_instruction: Mapping[str, InstructionCost]
    #: Entry computation totals with loop trip counts applied.
    totals: Cost
    #: Entry computation totals counting each loop body once, like XLA's ``cost_analysis()``.
    totals_xla: Cost
    #: Profile the seconds were computed for.
    device: str = ""
    #: ``while`` instruction name -> trip count used (None: unknown, counted once).
    trip_counts: Mapping[str, int | None] = field(default_factory=dict)

    def of(self, inst: Instruction | str) -> InstructionCost:
        return self.per_instruction[inst if isinstance(inst, str) else inst.name]

    def seconds(self, inst: Instruction | str) -> float:
        return self.of(inst).seconds


# -- op classes ------------------------------------------------------------------------------

_REDUCTIONS = frozenset({"reduce", "reduce-window", "select-and-scatter", "sort"})
_DATA_MOVEMENT = frozenset({
    "copy", "copy-start", "copy-done", "transpose", "broadcast", "reshape", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "reverse", "iota", "tuple",
})


#: byte rules of :meth:`_Visitor._counts` that read only what they output or update, and the
#: operand positions they still count at full size (a dynamic-slice's start index)
_PARTIAL_READS: Mapping[str, tuple[int, ...]] = {
    "slice": (), "dynamic-slice": (1,), "gather": (), "tuple": (), "dynamic-update-slice": (), "scatter": (),
}


def _counts_operands(inst: Instruction, operand: Instruction) -> bool:
    """Whether the byte rule of ``inst`` counts ``operand`` at its full size."""
    whole = _PARTIAL_READS.get(inst.opcode)
    return whole is None or any(k < len(inst.operands) and inst.operands[k] is operand for k in whole)


def op_class(inst: Instruction) -> str:
    """The class (:data:`hloopt.devices.OP_CLASSES`) whose fitted efficiency times ``inst``.

    A fusion takes the class of the heaviest kind of work it holds: a dot, else a convolution,
    else a reduction, else elementwise work, else data movement (XLA CPU's ``__ynn_fusion`` of a
    dot is a dot).
    """
    op = inst.opcode
    if op == "fusion":
        kinds = {op_class(x) for x in inst.called["calls"][0].instructions
                 if x.opcode not in FREE and x.opcode != "parameter"}
        for k in ("dot", "convolution", "reduction", "collective", "elementwise", "data_movement"):
            if k in kinds:
                return k
        return "other"
    if op == "dot":
        return "dot"
    if op == "convolution":
        return "convolution"
    if op in _REDUCTIONS:
        return "reduction"
    if op in COLLECTIVES:
        return "collective"
    if op in ELEMENTWISE or op in TRANSCENDENTAL or op in ("rng", "rng-bit-generator", "map"):
        return "elementwise"
    if op in _DATA_MOVEMENT:
        return "data_movement"
    return "other"


# -- counting helpers ------------------------------------------------------------------------


def _elements(shape: Shape) -> int:
    if shape.is_tuple:
        return sum(s.num_elements for _, s in shape.leaves())
    return shape.num_elements if shape.is_array else 0


def _first_array(shape: Shape) -> Shape:
    return shape.tuple_shapes[0] if shape.is_tuple and shape.tuple_shapes else shape


def _size(shape: Shape) -> int:
    """XLA's shape size: array bytes (tiling included); a tuple's own index table."""
    return shape.byte_size


def dot_flops(inst: Instruction) -> int:
    """``2 * elements(output) * prod(lhs contracting dims)``."""
    lhs = inst.operands[0].shape
    width = math.prod(lhs.dims[d] for d in inst.attr_ints("lhs_contracting_dims"))
    return _FMA_FLOPS * _first_array(inst.shape).num_elements * width


_WINDOW_FIELD = re.compile(r"(\w+)=([^\s}]+)")


def _window(inst: Instruction, nspatial: int) -> list[dict[str, int]]:
    """Per spatial dim: size, stride, pad_lo, pad_hi, lhs_dilate (base), rhs_dilate (window)."""
    dims = [dict(size=1, stride=1, lo=0, hi=0, base=1, win=1) for _ in range(nspatial)]
    text = inst.attrs.get("window", "")
    for key, val in _WINDOW_FIELD.findall(text):
        parts = val.split("x")
        for d, p in enumerate(parts[:nspatial]):
            if key == "size":
                dims[d]["size"] = int(p)
            elif key == "stride":
                dims[d]["stride"] = int(p)
            elif key == "pad":
                lo, hi = p.split("_")
                dims[d]["lo"], dims[d]["hi"] = int(lo), int(hi)
            elif key == "lhs_dilate":
                dims[d]["base"] = int(p)
            elif key == "rhs_dilate":
                dims[d]["win"] = int(p)
    return dims


def _dim_labels(inst: Instruction) -> tuple[str, str, str]:
    text = inst.attrs.get("dim_labels", "")
    m = re.fullmatch(r"\s*([^_]+)_([^-]+)->(\S+)\s*", text)
    if not m:
        raise UserError(f"{inst.name}: convolution without dim_labels")
    return m[1], m[2], m[3]


def _valid_positions(in_n: int, k_n: int, out_n: int, w: dict[str, int]) -> int:
    """Number of (output, kernel) index pairs along one spatial dim that read a real input element."""
    count = 0
    for k in range(k_n):
        for o in range(out_n):
            u = o * w["stride"] - w["lo"] + k * w["win"]
            if u < 0 or u % w["base"]:
                continue
            if u // w["base"] < in_n:
                count += 1
    return count


def convolution_flops(inst: Instruction) -> int:
    """Multiply-adds of a convolution counting only positions inside the (dilated) input, times 2."""
    lhs_l, rhs_l, out_l = _dim_labels(inst)
    lhs, rhs, out = inst.operands[0].shape, inst.operands[1].shape, _first_array(inst.shape)
    spatial = [c for c in lhs_l if c.isdigit()]
    spatial.sort(key=int)
    in_feat = lhs.dims[lhs_l.index("f")]
    out_feat = out.dims[out_l.index("f")]
    batch = lhs.dims[lhs_l.index("b")]
    fgc = int(inst.attrs.get("feature_group_count", 1))
    bgc = int(inst.attrs.get("batch_group_count", 1))
    wins = _window(inst, len(spatial))
    positions = 1
    for d, c in enumerate(spatial):
        in_n, k_n, out_n = lhs.dims[lhs_l.index(c)], rhs.dims[rhs_l.index(c)], out.dims[out_l.index(c)]
        positions *= _valid_positions(in_n, k_n, out_n, wins[d])
    return _FMA_FLOPS * (in_feat // fgc) * out_feat * (batch // bgc) * positions


def _callee(inst: Instruction, role: str) -> Computation:
    """A called computation by role; roles the parser does not resolve are looked up by name."""
    got = inst.called.get(role)
    if got:
        return got[0]
    module = inst.parent.module if inst.parent is not None else None
    name = inst.attrs.get(role, "").strip().lstrip("%")
    if module is None or not name:
        raise UserError(f"{inst.name}: no {role} computation")
    return module.computation(name)


# -- the analysis ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CostAnalysis(Analysis[CostResult]):
    """Roofline FLOPs/bytes/seconds per instruction (see module docstring)."""

    name: ClassVar[str] = "cost"
    #: Device whose rates turn counts into seconds (default: tpu-v5e).
    profile: DeviceProfile | None = field(default=None, compare=False, hash=False)
    #: Fixed seconds added to every instruction that does work.
    per_op_overhead_s: float = 0.0
    #: How a conditional combines its branches: "max" (XLA) or "mean".
    conditional: str = "max"
    #: The target compiler's model of fusion for a pre-optimization module (an analysis whose
    #: result has ``fused``: the instructions it fuses into their readers, such as
    #: ``hloopt.passes.tpu.TpuFusion()``); None: every instruction is its own kernel, as in a
    #: compiled module. See "Fused kernels" in the module docstring.
    fusion: Analysis[Any] | None = None
    _profile_key: str = field(init=False, default="", repr=False)

    def __post_init__(self) -> None:
        if self.conditional not in ("max", "mean"):
            raise UserError(f"conditional must be 'max' or 'mean', not {self.conditional!r}")
        if self.per_op_overhead_s < 0:
            raise UserError("per_op_overhead_s must be >= 0")
        prof = self.profile if self.profile is not None else load_profile("tpu-v5e")
        object.__setattr__(self, "profile", prof)
        object.__setattr__(self, "_profile_key", json.dumps(prof.to_dict(), sort_keys=True, default=str))

    def run(self, module: Module, am: AnalysisManager | None = None) -> CostResult:
        fused: frozenset[Instruction] = frozenset()
        if self.fusion is not None:
            fused = (am or AnalysisManager(module)).get(self.fusion).fused
        v = _Visitor(self, fused)
        entry = module.entry
        assert entry is not None, "a parsed module has an entry computation"
        full, xla = v.computation(entry)
        return CostResult(per_instruction=dict(v.records), totals=full, totals_xla=xla,
                          device=self.profile.name if self.profile else "", trip_counts=dict(v.trips))


class _Visitor:
    def __init__(self, opts: CostAnalysis, fused: frozenset[Instruction] = frozenset()) -> None:
        self.opts = opts
        self.fused = fused
        #: fused-away instruction -> the materialized values a kernel reading it reads, and bytes
        self._frontier: dict[Instruction, dict[Instruction, int]] = {}
        self.profile: DeviceProfile = opts.profile  # type: ignore[assignment]
        self.records: dict[str, InstructionCost] = {}
        self.trips: dict[str, int | None] = {}
        self._memo: dict[int, tuple[Cost, Cost]] = {}

    # -- time --------------------------------------------------------------------------------
    def _flops_rate(self, dtype: str) -> float:
        try:
            return self.profile.flops_per_s(dtype)
        except UserError:
            return self.profile.flops_per_s("f32")

    def _roofline(self, c: Cost, dtype: str, inst: Instruction | None = None) -> float:
        if c.flops == 0 and c.transcendentals == 0 and c.bytes_accessed == 0 and c.collective_bytes == 0:
            return 0.0
        t = max(
            (c.flops + c.transcendentals) / self._flops_rate(dtype) if c.flops or c.transcendentals else 0.0,
            c.bytes_accessed / self.profile.hbm_bytes_per_s,
            c.collective_bytes / self.profile.interconnect_bytes_per_s,
        )
        if inst is not None and self.profile.compute_efficiency:
            t /= self.profile.efficiency(op_class(inst))
        return t + self.opts.per_op_overhead_s

    # -- computations ------------------------------------------------------------------------
    def computation(self, comp: Computation) -> tuple[Cost, Cost]:
        hit = self._memo.get(id(comp))
        if hit is not None:
            return hit
        full, xla = ZERO, ZERO
        for inst in comp.instructions:
            rec = self.instruction(inst)
            self.records[inst.name] = rec
            full, xla = full + rec.full, xla + rec.xla
        self._memo[id(comp)] = (full, xla)
        return full, xla

    # -- instructions ------------------------------------------------------------------------
    def instruction(self, inst: Instruction) -> InstructionCost:
        op = inst.opcode
        if op in _CONTROL:
            return self._control(inst)
        c = self._counts(inst)
        return InstructionCost(full=c, xla=c)

    def _control(self, inst: Instruction) -> InstructionCost:
        op = inst.opcode
        if op == "while":
            bf, bx = self.computation(inst.called["body"][0])
            cf, cx = self.computation(inst.called["condition"][0])
            n = trip_count(inst)
            self.trips[inst.name] = n
            once_full = bf + cf
            full = once_full.scaled(n) if n is not None else once_full
            return InstructionCost(full=full, xla=bx + cx, trip_count=n)
        if op == "conditional":
            branches = [self.computation(b) for b in inst.called.get("branch_computations", [])]
            if not branches:
                return InstructionCost(ZERO, ZERO)
            return InstructionCost(self._combine([b[0] for b in branches]), self._combine([b[1] for b in branches]))
        # call, async-start: the callee's sum
        full, xla = ZERO, ZERO
        for callee in inst.called_computations:
            f, x = self.computation(callee)
            full, xla = full + f, xla + x
        return InstructionCost(full, xla)

    def _combine(self, costs: list[Cost]) -> Cost:
        if self.opts.conditional == "mean":
            out = ZERO
            for c in costs:
                out = out + c
            return out.scaled(1.0 / len(costs))
        return Cost(*(max(getattr(c, f) for c in costs) for f in
                      ("flops", "transcendentals", "bytes_accessed", "collective_bytes", "seconds")))

    def _sub_flops(self, comp: Computation) -> Cost:
        """FLOPs of one application of a reducer/mapper computation (bytes not copied, like XLA)."""
        f, _ = self.computation(comp)
        return Cost(f.flops, f.transcendentals)

    def _counts(self, inst: Instruction) -> Cost:
        op = inst.opcode
        if op in FREE:
            return ZERO
        out = inst.shape
        default_bytes = _size(out) + sum(_size(o.shape) for o in inst.operands)
        flops = trans = 0.0
        nbytes: float = default_bytes
        coll = 0.0
        dtype = _first_array(out).element_type
        if op in TRANSCENDENTAL:
            trans = _elements(out)
        elif op in ELEMENTWISE:
            flops = _elements(out)
        elif op == "dot":
            flops = dot_flops(inst)
            dtype = inst.operands[0].shape.element_type
        elif op == "convolution":
            flops = convolution_flops(inst)
            dtype = inst.operands[0].shape.element_type
        elif op in ("rng", "rng-bit-generator"):
            trans = _elements(out)
        elif op == "reduce":
            n = inst.operands[0].shape.num_elements - _first_array(out).num_elements
            sub = self._sub_flops(inst.called["to_apply"][0]).scaled(n)
            flops, trans = sub.flops, sub.transcendentals
        elif op == "reduce-window":
            wins = _window(inst, inst.operands[0].shape.rank)
            size = math.prod(w["size"] for w in wins)
            sub = self._sub_flops(inst.called["to_apply"][0]).scaled((size - 1) * _first_array(out).num_elements)
            flops, trans = sub.flops, sub.transcendentals
        elif op == "map":
            sub = self._sub_flops(inst.called["to_apply"][0]).scaled(_elements(out))
            flops, trans = sub.flops, sub.transcendentals
        elif op == "select-and-scatter":
            src = inst.operands[1].shape.num_elements
            wins = _window(inst, inst.operands[0].shape.rank)
            size = math.prod(w["size"] for w in wins)
            sel = self._sub_flops(_callee(inst, "select")).scaled(src * (size - 1))
            sca = self._sub_flops(_callee(inst, "scatter")).scaled(src)
            flops, trans = sel.flops + sca.flops, sel.transcendentals + sca.transcendentals
        elif op == "sort":
            n = inst.operands[0].shape.num_elements
            flops = n * math.ceil(math.log2(n)) if n > 1 else 0
        elif op == "fusion":
            return self._fusion(inst)
        elif op == "tuple":
            nbytes = _size(out)
        elif op == "slice":
            nbytes = 2 * _size(out)
        elif op == "dynamic-slice":
            nbytes = 2 * _size(out) + sum(_size(o.shape) for o in inst.operands[1:2])
        elif op == "dynamic-update-slice":
            upd = _size(inst.operands[1].shape)
            nbytes = 2 * upd + sum(_size(o.shape) for o in inst.operands[2:3])
        elif op == "gather":
            nbytes = 2 * _size(out) + _size(inst.operands[1].shape)
        elif op == "scatter":
            k = (len(inst.operands) - 1) // 2
            upd = sum(_size(o.shape) for o in inst.operands[k + 1:])
            nbytes = 3 * upd + _size(inst.operands[k].shape)
            sub = self._sub_flops(inst.called["to_apply"][0]).scaled(inst.operands[-1].shape.num_elements)
            flops, trans = sub.flops, sub.transcendentals
        elif op in COLLECTIVES:
            operand_bytes = sum(s.byte_size for o in inst.operands for _, s in o.shape.leaves())
            if op.startswith("all-reduce"):
                flops = sum(s.num_elements for _, s in out.leaves() if s.is_array)
                # XLA: every output array written (not the tuple index table) + operands read.
                nbytes = sum(s.byte_size for _, s in out.leaves() if s.is_array) + sum(
                    _size(o.shape) for o in inst.operands)
                coll = 2 * operand_bytes
            elif op.startswith("all-gather"):
                coll = sum(s.byte_size for _, s in out.leaves() if s.is_array)
            else:
                coll = operand_bytes
        elif op == "custom-call":
            # Unknown work (XLA reports -1); count its bytes so its time is not zero.
            pass
        if self.fused:
            nbytes = self._kernel_bytes(inst, nbytes)
        c = Cost(flops, trans, nbytes, coll)
        if is_host_transfer(inst):
            return c.with_seconds(0.0)  # the link's time, not the compute stream's (module docstring)
        return c.with_seconds(self._roofline(c, dtype, inst))

    # -- fused kernels of a pre-optimization module ----------------------------------------------
    def _kernel_bytes(self, inst: Instruction, nbytes: float) -> float:
        """HBM bytes of ``inst`` where :attr:`fused` names what the compiler fuses: none for a
        fused-away instruction (its kernel is its readers'); for one that keeps its value, what its
        own rule counts with each fused-away operand's size replaced by the materialized values
        that operand is computed from (each read once per kernel, no more than the operand's
        size: a fused broadcast reads its small input, a fused slice its window)."""
        if inst in self.fused:
            return 0.0
        fused_ops = [o for o in dict.fromkeys(inst.operands) if o in self.fused]
        if not fused_ops:
            return nbytes
        reads: dict[Instruction, int] = {}
        counted = 0
        for o in fused_ops:
            if _counts_operands(inst, o):
                counted += _size(o.shape) * sum(1 for x in inst.operands if x is o)
                for leaf, b in self._leaves(o).items():
                    reads[leaf] = max(reads.get(leaf, 0), b)
        direct = {o for o in inst.operands if o not in self.fused}  # the rule counts these already
        return max(0.0, nbytes - counted + sum(b for leaf, b in reads.items() if leaf not in direct))

    def _leaves(self, inst: Instruction) -> dict[Instruction, int]:
        """Materialized values the fused-away ``inst`` is computed from, with the bytes read."""
        hit = self._frontier.get(inst)
        if hit is not None:
            return hit
        out: dict[Instruction, int] = {}
        cap = _size(inst.shape)
        stack: list[tuple[Instruction, int]] = [(o, cap) for o in inst.operands]
        seen: set[Instruction] = set()
        while stack:
            o, limit = stack.pop()
            if o in self.fused:
                if o in seen:
                    continue
                seen.add(o)
                lim = min(limit, _size(o.shape))
                stack.extend((x, lim) for x in o.operands)
                continue
            out[o] = max(out.get(o, 0), min(limit, _size(o.shape)))
        self._frontier[inst] = out
        return out

    # -- fusion --------------------------------------------------------------------------------
    def _fusion(self, inst: Instruction) -> Cost:
        fc = inst.called["calls"][0]
        inner, _ = self.computation(fc)
        root = fc.root
        # Outputs written at the boundary (a dynamic-update-slice root writes only its update).
        out_bytes = 0
        if not inst.shape.is_tuple:
            if root is not None and root.opcode == "dynamic-update-slice":
                out_bytes = _size(root.operands[1].shape)
            else:
                out_bytes = _size(inst.shape)
        else:
            for i, s in enumerate(inst.shape.tuple_shapes):
                r = root.operands[i] if root is not None and root.opcode == "tuple" and i < len(root.operands) else None
                if r is not None and r.opcode == "dynamic-update-slice":
                    out_bytes += _size(r.operands[1].shape)
                else:
                    out_bytes += sum(x.byte_size for _, x in s.leaves())
        read = sum(self._param_read_bytes(p) for p in fc.parameters)
        consts = sum(_size(x.shape) for x in fc.instructions if x.opcode == "constant" and x.shape.num_elements > 1)
        dtype = _first_array(inst.shape).element_type
        for x in fc.instructions:
            if x.opcode in ("dot", "convolution"):
                dtype = x.operands[0].shape.element_type
                break
        c = Cost(inner.flops, inner.transcendentals, out_bytes + read + consts, inner.collective_bytes)
        return c.with_seconds(self._roofline(c, dtype, inst))

    def _param_read_bytes(self, p: Instruction) -> int:
        if p.shape.is_tuple:
            total = 0
            for u in p.users:
                if u.opcode == "get-tuple-element":
                    total += self._param_read_bytes(u)
            return total
        size, seen_trivial = 0, False
        for u in p.users:
            op = u.opcode
            if op == "fusion":
                fc = u.called["calls"][0]
                for idx, o in enumerate(u.operands):
                    if o is p:
                        size += self._param_read_bytes(fc.parameters[idx])
            elif op == "slice":
                size += _size(u.shape)
            elif op == "dynamic-slice":
                if u.operands[0] is p:
                    size += _size(u.shape)
                elif not seen_trivial:
                    seen_trivial, size = True, size + _size(p.shape)
            elif op == "dynamic-update-slice":
                if u.operands[0] is not p and not seen_trivial:
                    seen_trivial, size = True, size + _size(p.shape)
            elif op in ("broadcast", "reshape"):
                size += _size(p.shape)
            elif not seen_trivial:
                seen_trivial, size = True, size + _size(p.shape)
        return size
