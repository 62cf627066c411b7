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
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hloopt.devices import DeviceProfile
from hloopt.errors import UserError
from hloopt.ir import Module

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

