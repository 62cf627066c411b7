"""Per-device analysis and planning of sharded programs.

A sharded step's lowered text is the *global* program: ``f32[32000,4096]`` for an embedding that
each of 8 devices holds a quarter of. What fills one device's HBM is the program XLA's SPMD
partitioner makes of it: per-device shapes, collectives inserted. hloopt gets that program from
XLA itself (:func:`hloopt.lowering.lower` with ``partitioned=True``): a compile whose dump options
write the module right after the ``spmd-partitioning`` pass. On this CPU-only machine that is a
CPU compile on 8 host devices (``--xla_force_host_platform_device_count=8``, set by
:mod:`hloopt.lowering`), or a deviceless libtpu compile (``compile="tpu-v5p"``), which writes the
partitioned module before buffer assignment and so even for a step too large for the chip.

The partitioned module is not fused or scheduled, like the pre-optimization text, so the pipeline
analyzes it as it analyzes lowered text (liveness with TPU fusion modeled, residuals, roofline
costs: collectives over the interconnect) and plans on it unchanged.

**Names.** ``checkpoint_name`` leaves no trace in HLO and :mod:`hloopt.naming` names the residuals
of the *global* module (tracing only, no compile). A per-device residual takes the name of a
global residual with the same dtype, layer count, producing primitive and source line whose shape
it can be a shard of (each per-device dim divides the global one, the ratios multiplying to at
most the number of partitions: sharding splits dims over mesh axes, never grows them), the one
needing the fewest shards first; left-over per-device residuals then match on dtype, layers and
shard shape alone. Each global residual names at most one per-device residual (schedule order).

A program on one device runs no SPMD partitioner: its per-device program is its lowered text, and
:func:`per_device` returns that (``partitioned=False``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union, cast

from hloopt.devices import DeviceProfile
from hloopt.errors import UserError
from hloopt.ir import Computation, Instruction, Module, Shape
from hloopt.passes.opcodes import is_identity_call, is_shard_map_boundary

if TYPE_CHECKING:
    from hloopt.naming import ResidualNames


@dataclasses.dataclass(frozen=True)
class PerDevice:
    """One step's per-device program, the global program it came from, and its residual names."""

    #: the per-device module (after SPMD partitioning; the global module when on one device)
    module: Module
    #: the global pre-optimization module (lowered for the compile target's backend)
    global_module: Module
    #: "partitioned:<compile target>" or "lowered:<platform>" (one device)
    source: str
    #: devices the program is partitioned over (1: not partitioned)
    num_partitions: int
    #: whether ``module`` is XLA's partitioned module (False: one device, the global module)
    partitioned: bool
    #: per-device instruction name -> checkpoint_name (see the module docstring)
    names: Mapping[str, str]
    #: the compile's error when libtpu ran out of HBM after partitioning (the module is still there)
    compile_error: str | None = None
    #: seconds spent lowering + compiling (XLA's part) and naming (tracing)
    lower_s: float = 0.0
    naming_s: float = 0.0


def per_device(target: Any, *, compile: str = "cpu", platform: str = "tpu", policy: Any = None,
               names: bool = True) -> PerDevice:
    """The per-device program of a JAX TARGET, lowered with ``policy`` (default: every residual
    saved, as :func:`hloopt.pipeline.plan` lowers), partitioned by a ``compile`` (``"cpu"`` or a
    TPU generation); ``names=False`` skips naming."""
    import jax

    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.targets import Target, resolve

    tgt = target if isinstance(target, Target) else resolve(target)
    if tgt.kind != "jax":
        raise UserError(f"{tgt.name}: per-device programs come from a JAX TARGET (file.py:factory), "
                        f"not a {tgt.kind} file: analyze an XLA dump's after-partitioning module instead")
    pol = policy if policy is not None else jax.checkpoint_policies.everything_saveable
    t0 = time.perf_counter()
    low = lower(tgt, platform=platform, policy=pol, compile=compile, partitioned=True)
    lower_s = time.perf_counter() - t0
    global_module = parse_module(low.hlo_text, filename=f"<{tgt.name} lowered>")
    if low.partitioned_text is None:
        module, source, parts = global_module, f"lowered:{platform}", 1
    else:
        module = parse_module(low.partitioned_text, filename=f"<{tgt.name} partitioned:{compile}>")
        source, parts = f"partitioned:{compile}", module.num_partitions
    t1 = time.perf_counter()
    mapping = name_per_device(tgt, module, global_module, platform=platform) if names else {}
    return PerDevice(module=module, global_module=global_module, source=source, num_partitions=parts,
                     partitioned=low.partitioned_text is not None, names=mapping,
                     compile_error=low.compile_error, lower_s=lower_s,
                     naming_s=time.perf_counter() - t1)


def name_per_device(target: Any, module: Module, global_module: Module, *,
                    platform: str = "tpu") -> ResidualNames:
    """``{per-device instruction name: checkpoint_name}`` (see the module docstring)."""
    from hloopt.naming import ResidualNames, input_names, name_residuals
    from hloopt.passes.residuals import find_residuals

    probe = name_residuals(target, baseline=find_residuals(global_module), platform=platform)
    glob = probe.residuals
    if module is global_module:
        mapping = {r.inst.name: r.name for r in glob if r.name}
    else:
        mapping = match_names([(r.name, r) for r in glob if r.name], list(find_residuals(module)),
                              num_partitions=max(module.num_partitions, 1))
    return ResidualNames(mapping, checkpoint_inputs=input_names(probe.sites))


def shard_ratio(local: tuple[int, ...], global_: tuple[int, ...], *, max_ratio: int) -> int | None:
    """How many shards of ``global_`` make ``local`` (the product of per-dim ratios), or None when
    ``local`` cannot be a shard of ``global_`` over at most ``max_ratio`` devices: same rank, each
    dim divides its global dim, and the ratios multiply to at most ``max_ratio``."""
    if len(local) != len(global_):
        return None
    ratio = 1
    for n, g in zip(local, global_):
        if n <= 0 or n > g or g % n:
            return None
        ratio *= g // n
    return ratio if ratio <= max_ratio else None


def match_names(named_global: list[tuple[str, Any]], local: list[Any], *,
                num_partitions: int) -> dict[str, str]:
    """One-to-one naming of per-device residuals from named global ones: same primitive and source
    line first, then any; among candidates the one needing the fewest shards (exact shape first)."""
    def ratio(loc: Any, glo: Any, strict: bool) -> int | None:
        if (loc.dtype, loc.layers) != (glo.dtype, glo.layers):
            return None
        if strict and (loc.primitive, loc.source_text) != (glo.primitive, glo.source_text):
            return None
        return shard_ratio(loc.per_layer_dims, glo.per_layer_dims, max_ratio=num_partitions)

    out: dict[str, str] = {}
    taken: set[int] = set()
    for strict in (True, False):
        for loc in local:
            if loc.inst.name in out:
                continue
            best: tuple[int, int] | None = None
            for k, (_name, glo) in enumerate(named_global):
                if k in taken:
                    continue
                r = ratio(loc, glo, strict)
                if r is not None and (best is None or r < best[0]):
                    best = (r, k)
            if best is not None:
                out[loc.inst.name] = named_global[best[1]][0]
                taken.add(best[1])
    return out


def plan_per_device(target: Any, *, profile: DeviceProfile, budget: str | None = None,
                    max_slowdown: float | None = None, pareto: bool = False, compile: str = "cpu",
                    platform: str = "tpu", solver: str = "auto", time_limit_s: float = 30.0,
                    pd: PerDevice | None = None,
                    timings: dict[str, float] | None = None) -> Any:
    """:func:`hloopt.pipeline.plan` on the per-device program; returns its ``PlanOutcome``.

    ``pd`` reuses a :func:`per_device` result; ``timings`` (a dict) receives seconds per stage.
    """
    from hloopt.pipeline import PlanOutcome, analyze_module, build_problem, make_plan, resolve_mode, run_anchors
    from hloopt.problem import Decisions
    from hloopt.search import search
    from hloopt.simulator import simulate
    from hloopt.targets import Target, resolve

    clock = timings if timings is not None else {}
    tgt = target if isinstance(target, Target) else resolve(target)
    if pd is None:
        pd = per_device(tgt, compile=compile, platform=platform)
    clock["lower_s"], clock["naming_s"] = pd.lower_s, pd.naming_s
    t0 = time.perf_counter()
    an = analyze_module(pd.module, profile, source=pd.source, names=pd.names)
    problem, _ = build_problem(an, profile)
    clock["analyze_s"] = time.perf_counter() - t0
    if not problem.candidates:
        raise UserError(f"{tgt.name}: found no forward->backward residuals in the per-device program")
    baseline = simulate(problem, Decisions.all_device())
    budget_bytes, mode = resolve_mode(budget, max_slowdown, pareto, baseline.peak_bytes)
    t1 = time.perf_counter()
    sr = search(problem, budget_bytes=budget_bytes, max_slowdown=max_slowdown, pareto=pareto,
                solver=solver, time_limit_s=time_limit_s)
    clock["search_s"] = time.perf_counter() - t1
    decisions = sr.plan.decisions
    result = simulate(problem, decisions)
    chosen = sr.plan
    gap = chosen.mip_gap if chosen.mip_gap == chosen.mip_gap else None
    solver_info = {"name": chosen.solver, "status": chosen.status or ("optimal" if chosen.optimal else "feasible"),
                   "gap": gap, "time_s": round(clock["search_s"], 3)}
    plan_obj = make_plan(f"{tgt.name} (per device, {pd.source})", an, problem, profile,
                         budget_spec=budget, budget_bytes=budget_bytes, mode=mode, decisions=decisions,
                         result=result, baseline=baseline, solver=solver_info,
                         pareto=list(sr.pareto) if pareto else None)
    return PlanOutcome(plan_obj, problem, an, baseline, result, decisions, run_anchors(problem))


# --------------------------------------------------------------------------------------------
# Sharding propagation: the per-device shape of a value in the global (unpartitioned) program
# --------------------------------------------------------------------------------------------
#
# An SPMD module's per-device shape of a value is its global shape divided by the tile counts of
# its sharding. Shardings are written on entry parameters and ``Sharding`` custom-calls; they are
# propagated forward (elementwise ops take the most-split operand, broadcast/transpose/reshape/
# reduce/dot map dimensions, a dynamic-update-slice takes its update's split, tuples carry them
# through; a Shardy ``shard_map`` body sees its operands' shards, and its results are split by
# their global over their per-device dims). Loop state is the most split of the init and the
# body's result, to a fixed point (a scan's gradient accumulator starts as replicated zeros and is
# added sharded gradients: it is sharded, and so are the zeros broadcast into it), the way XLA's
# sharding propagation resolves the common cases. Reshards the SPMD partitioner adds (all-gathers
# of a weight before a matmul) are not modeled. A module that is already partitioned
# (:func:`is_partitioned`: XLA's per-device module, shapes already shards) is not divided again.
# The TPU memory model (:mod:`hloopt.passes.tpu.fusion`) sizes every value of a pre-optimization
# module with these.

#: a sharding as tile counts: per array dimension, or nested per tuple element
Split = Union[tuple[int, ...], tuple["Split", ...], None]


_DEVICES = re.compile(r"devices=\[([\d,]+)\]")
_LAST_TILE_DIMS = re.compile(r"last_tile_dims=\{([^}]*)\}")


def parse_sharding(text: str | None, shape: Shape) -> Split:
    """Tile counts of an HLO ``sharding={...}`` attribute for ``shape`` (None: replicated/unknown)."""
    if not text:
        return None
    body = text.strip()
    if shape.is_tuple:
        inner = body[1:-1].strip() if body.startswith("{") and body.endswith("}") else body
        parts = _split_top(inner) if inner.startswith("{") else []
        if len(parts) != len(shape.tuple_shapes):
            return None
        return tuple(parse_sharding(p, s) for p, s in zip(parts, shape.tuple_shapes))
    m = _DEVICES.search(body)
    if m is None or not shape.is_array:
        return None
    tiles = [int(x) for x in m.group(1).split(",")]
    if "last_tile_dim_replicate" in body:
        tiles = tiles[:-1]
    lt = _LAST_TILE_DIMS.search(body)
    if lt is not None:
        tiles = tiles[: len(tiles) - len([x for x in lt.group(1).split(",") if x.strip()])]
    if len(tiles) != len(shape.dims):
        return None
    return tuple(tiles)


def _split_top(text: str) -> list[str]:
    """``{a}, {b, {c}}`` -> ``["{a}", "{b, {c}}"]``."""
    out, depth, start = [], 0, 0
    for k, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = k
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                out.append(text[start: k + 1])
    return out


def _factor(s: Split) -> int:
    if s is None:
        return 1
    if s and isinstance(s[0], tuple | type(None)):
        return 1
    return math.prod(s)  # type: ignore[arg-type]


def _array_split(s: Split, rank: int) -> tuple[int, ...]:
    if s is None or len(s) != rank or (s and not isinstance(s[0], int)):
        return (1,) * rank
    return s  # type: ignore[return-value]


def _reshape_split(src: tuple[int, ...], src_dims: tuple[int, ...], dst_dims: tuple[int, ...]) -> tuple[int, ...]:
    """Carry a split through a reshape: dims grouped into equal-product runs; a group's split goes
    to its major-most dim on the other side when it divides that dim."""
    out = [1] * len(dst_dims)
    i = j = 0
    while i < len(src_dims) and j < len(dst_dims):
        gi, gj = [i], [j]
        pi, pj = src_dims[i], dst_dims[j]
        while pi != pj:
            if pi < pj and i + len(gi) < len(src_dims):
                pi *= src_dims[i + len(gi)]
                gi.append(i + len(gi))
            elif j + len(gj) < len(dst_dims):
                pj *= dst_dims[j + len(gj)]
                gj.append(j + len(gj))
            else:
                break
        f = math.prod(src[k] for k in gi)
        if f > 1:
            for k in gj:
                if dst_dims[k] % f == 0 and dst_dims[k] >= f:
                    out[k] = f
                    break
        i += len(gi)
        j += len(gj)
    return tuple(out)


#: what only an SPMD-partitioned (per-device) module holds: the partitioner's collectives and
#: partition ids (a global module's are inside ``shard_map`` bodies, between the Sharding markers)
_PARTITIONED_OPS = frozenset({"partition-id", "all-reduce", "all-reduce-start", "all-gather", "all-gather-start",
                              "reduce-scatter", "all-to-all", "collective-permute", "collective-permute-start"})


def is_partitioned(module: Module) -> bool:
    """Whether ``module`` is already per-device (XLA's module after ``spmd-partitioning``): its
    shapes are shards and its ``sharding=`` attributes describe them, not divide them. Told by
    collectives or a partition id without the ``Sharding`` markers or Shardy ``shard_map``
    boundaries of the global text (a shard_map body holds collectives of its own)."""
    seen_partitioned = False
    for inst in module.instructions():
        if is_identity_call(inst) or is_shard_map_boundary(inst):
            return False
        if inst.opcode in _PARTITIONED_OPS:
            seen_partitioned = True
    return seen_partitioned


def _any_split(module: Module) -> bool:
    """Whether some ``sharding=`` attribute of ``module`` tiles a value over devices. Without one
    every value is whole on every device and propagation has nothing to spread (a single-device
    step: most of what users bring)."""
    for inst in module.instructions():
        text = inst.sharding
        if text and "devices=" in text and _tiles(parse_sharding(text, inst.shape)):
            return True
    return False


def _tiles(s: Split) -> bool:
    """Whether ``s`` (a leaf's tile counts, or a tuple's per element) splits some value."""
    if s is None:
        return False
    if s and isinstance(s[0], tuple | type(None)):
        return any(_tiles(e) for e in s)  # type: ignore[arg-type]
    return math.prod(s) > 1  # type: ignore[arg-type]


def propagate_shardings(module: Module) -> dict[Instruction, Split]:
    """Tile counts of every instruction's value (module docstring); absent/None: replicated.
    Nothing for a module that is already partitioned (:func:`is_partitioned`)."""
    split: dict[Instruction, Split] = {}
    if is_partitioned(module) or not _any_split(module):
        return split
    #: the parameter splits each computation was last visited with (a loop body is visited again
    #: when its state's sharding grows)
    seen: dict[Computation, list[Split] | None] = {}

    def array(inst: Instruction, k: int = 0) -> tuple[int, ...]:
        o = inst.operands[k]
        return _array_split(split.get(o), len(o.shape.dims) if o.shape.is_array else 0)

    def visit(comp: Computation, params: list[Split] | None) -> None:
        if comp in seen and seen[comp] == params:
            return
        seen[comp] = params
        for inst in comp.instructions:
            s = _infer(inst, params)
            if s is not None:
                split[inst] = s

    def _infer(inst: Instruction, params: list[Split] | None) -> Split:
        explicit = parse_sharding(inst.sharding, inst.shape)
        op = inst.opcode
        if explicit is not None:
            return explicit
        if op == "parameter":
            if params is not None and 0 <= inst.parameter_number < len(params):
                return params[inst.parameter_number]
            return None
        if not inst.operands and not inst.called:
            return None
        if op == "get-tuple-element":
            s = split.get(inst.operands[0])
            k = inst.tuple_index
            return split_element(s, k)
        if op == "tuple":
            return tuple(split.get(o) for o in inst.operands)
        if is_shard_map_boundary(inst) and inst.shape.is_tuple:
            # Into a shard_map body each operand arrives as its shard (whole on the device); out
            # of it each result is split by global dim / the body's per-device dim.
            elems: list[Split] = []
            for o, el in zip(inst.operands, inst.shape.tuple_shapes):
                if not (o.shape.is_array and el.is_array and len(o.shape.dims) == len(el.dims)):
                    elems.append(None)
                elif inst.custom_call_target.endswith("GlobalToLocalShape"):
                    elems.append((1,) * len(el.dims))
                else:
                    elems.append(tuple(max(1, g // max(1, d)) for g, d in zip(el.dims, o.shape.dims)))
            return tuple(elems)
        if op == "while":
            # Loop state takes the most split of what enters and what the body hands back (a
            # gradient accumulator starts as replicated zeros and is added sharded gradients),
            # to a fixed point; zeros broadcast into the init take the state's sharding too.
            init = split.get(inst.operands[0]) if inst.operands else None
            state = init
            body = inst.callee("body")
            for _ in range(4):
                for c in inst.called.get("condition", []) + inst.called.get("body", []):
                    visit(c, [state])
                merged = _merge_split(state, split.get(body.root) if body is not None and body.root else None)
                if merged == state:
                    break
                state = merged
            if state != init and inst.operands and inst.operands[0].opcode == "tuple":
                for k, o in enumerate(inst.operands[0].operands):
                    leaf = split_element(state, k)
                    tiles = cast(tuple[int, ...], leaf)
                    if is_leaf_split(leaf) and o.opcode in ("broadcast", "constant") and o.sharding is None \
                            and math.prod(_array_split(split.get(o), len(tiles))) < math.prod(tiles):
                        split[o] = leaf
                split[inst.operands[0]] = state
            return state
        if op in ("call", "conditional"):
            result: Split = None
            callees = inst.called.get("to_apply", []) + inst.called.get("calls", [])
            for c in callees:  # a callee shared by call sites takes each site's shardings in turn
                visit(c, [split.get(o) for o in inst.operands])
                if c.root is not None:
                    result = split.get(c.root)
            return result
        if op == "opt-barrier" or op == "optimization-barrier":
            return split.get(inst.operands[0])
        if not inst.shape.is_array:
            return None
        rank = len(inst.shape.dims)
        if op == "broadcast":
            src = array(inst)
            out = [1] * rank
            for k, d in enumerate(inst.attr_ints("dimensions")):
                if k < len(src) and d < rank:
                    out[d] = src[k]
            return tuple(out)
        if op == "transpose":
            src = array(inst)
            perm = inst.attr_ints("dimensions")
            return tuple(src[p] for p in perm) if len(perm) == rank == len(src) else None
        if op in ("reshape", "bitcast") and inst.operands[0].shape.is_array:
            return _reshape_split(array(inst), inst.operands[0].shape.dims, inst.shape.dims)
        if op in ("reduce", "reduce-window") and op == "reduce":
            src = array(inst)
            red = set(inst.attr_ints("dimensions"))
            kept = tuple(f for k, f in enumerate(src) if k not in red)
            return kept if len(kept) == rank else None
        if op == "dot":
            lhs, rhs = array(inst, 0), array(inst, 1)
            lb, rb = inst.attr_ints("lhs_batch_dims"), inst.attr_ints("rhs_batch_dims")
            lc, rc = inst.attr_ints("lhs_contracting_dims"), inst.attr_ints("rhs_contracting_dims")
            out = [max(lhs[a], rhs[b]) for a, b in zip(lb, rb)]
            out += [f for k, f in enumerate(lhs) if k not in lb and k not in lc]
            out += [f for k, f in enumerate(rhs) if k not in rb and k not in rc]
            return tuple(out) if len(out) == rank else None
        if op == "gather":
            idx = array(inst, 1)
            ivd = inst.attr_ints("index_vector_dim")
            batch = [f for k, f in enumerate(idx) if not ivd or k != ivd[0]]
            offsets = set(inst.attr_ints("offset_dims"))
            out, it = [], iter(batch)
            for d in range(rank):
                out.append(1 if d in offsets else next(it, 1))
            return tuple(out)
        if op == "dynamic-update-slice" and len(inst.operands) > 1 and inst.operands[1].shape.is_array \
                and len(inst.operands[1].shape.dims) == rank:
            # the buffer takes the update's split where the update's dims allow it (a scan's
            # stacked gradients: replicated zeros updated by each layer's sharded gradient)
            base, upd = array(inst, 0), array(inst, 1)
            udims = inst.operands[1].shape.dims
            return tuple(max(b, u if udims[k] % u == 0 else 1) for k, (b, u) in enumerate(zip(base, upd)))
        # Elementwise and everything that keeps an operand's dims: the most split operand.
        best: tuple[int, ...] | None = None
        for o in inst.operands:
            if o.shape.is_array and o.shape.dims == inst.shape.dims:
                s = _array_split(split.get(o), rank)
                if best is None or math.prod(s) > math.prod(best):
                    best = s
        if best is not None and op in ("concatenate", "pad", "slice", "dynamic-slice"):
            best = tuple(f if f <= d else 1 for f, d in zip(best, inst.shape.dims))
        if best is None and op in ("slice", "dynamic-slice", "pad", "concatenate", "reverse") \
                and inst.operands[0].shape.is_array and len(inst.operands[0].shape.dims) == rank:
            best = tuple(1 if inst.shape.dims[k] % f else f for k, f in enumerate(array(inst)))
        return best

    if module.entry is not None:
        visit(module.entry, None)
    return split


def _merge_split(a: Split, b: Split) -> Split:
    """The more split of two shardings of one value, leaf by leaf (tuples element-wise)."""
    if a is None:
        return b
    if b is None:
        return a
    if is_leaf_split(a) or is_leaf_split(b) or not a or not b:
        if is_leaf_split(a) and is_leaf_split(b) and len(a) == len(b):
            return b if math.prod(b) > math.prod(a) else a  # type: ignore[arg-type]
        return a
    if len(a) != len(b):
        return a
    return tuple(_merge_split(cast(Split, x), cast(Split, y)) for x, y in zip(a, b))


def is_leaf_split(s: Split) -> bool:
    """An array's tile counts (not a tuple's splits, not unknown)."""
    return isinstance(s, tuple) and bool(s) and isinstance(s[0], int)


def split_element(s: Split, k: int) -> Split:
    """The split of tuple element ``k`` under a tuple's split ``s`` (None: unknown/replicated)."""
    if isinstance(s, tuple) and not is_leaf_split(s) and 0 <= k < len(s):
        return cast(Split, s[k])
    return None


def shard_dims(shape: Shape, s: Split) -> tuple[int, ...]:
    """Per-device dims of an array under tile counts ``s`` (ceil division)."""
    sp = _array_split(s, len(shape.dims))
    return tuple(-(-d // f) for d, f in zip(shape.dims, sp))

