"""Build a :class:`~hloopt.report.ReportData` from the analyses: the memory model or a plan.

Two sources, one output:

* :func:`report_data_from_memory` — a module on its own (``hloopt analyze --html``, ``hloopt
  report TARGET``): the memory model's timeline (:class:`~hloopt.passes.memory.PeakMemory`, the
  counting rules of the module's compiler) over the *flat* schedule (loop bodies and callees
  inline, once), split by the memory model's buffer categories.
* :func:`report_data_from_outcome` — a plan (``hloopt plan --html``, ``hloopt report
  plan.json``): the simulator's replay of the Problem with everything on device (baseline) and
  with the plan, over the Problem's steps (a scanned loop that carries residuals expanded into
  one step per layer).

Categories of the plan's baseline: ``residuals`` is exactly what the simulator counts for the
candidates at each step, and ``on-chip heap`` what a floor (``Step.floor_bytes``) adds above that
(none in the planner's own Problems, whose floor never exceeds the timeline). The rest
(``base_bytes``) is split like the memory model (:func:`hloopt.passes.memory.categorize`) splits
the buffers that hold no residual at the highest flat step of the step's entry instruction (for
a TPU prediction, over the profile the Problem's timeline is, with its VMEM settlement,
:func:`memory_category_timeline`); where the two totals differ (the
Problem counts stacked residuals per layer and per candidate), the difference is settled in
``temporaries`` first and ``parameters`` last, and noted in the assumptions when above 1% of the
peak. So the stack sums to the simulator's baseline at every step: the report draws what the
simulator judged.

Algorithm of a flat split: one difference array per category over the live ranges, O(buffers +
steps x categories). Folding flat steps onto entry steps keeps the split of the *highest* flat
step of each entry instruction, as :meth:`LiveRanges.entry_timeline` keeps its total.

Invariants (checked here, ``ValueError`` otherwise): every category split sums, step by step, to
the timeline it splits.

:func:`outcome_from_plan` replays a saved plan: it lowers and analyzes the plan's target again
with the plan's device, simulates the plan's decisions, and checks the candidates still match.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from hloopt.report import LiveBuffer, ReportData, ResidualRow, Transfer, mesh_of
from hloopt.units import format_bytes, format_rate, format_seconds

__all__ = [
    "STACK_ORDER",
    "flat_category_bytes",
    "memory_category_timeline",
    "outcome_from_plan",
    "report_data_from_memory",
    "report_data_from_outcome",
]

#: Stacking order of categories, bottom first: what lives the whole step at the bottom, what a
#: plan can move at the top (next to the plan's line).
STACK_ORDER: tuple[str, ...] = ("static", "parameters", "optimizer state", "inputs", "outputs", "gradients",
                                "temporaries", "activations", "residuals")

#: Where a difference between the memory model's split and the Problem's base is settled, in order:
#: short-lived values first, what lives the whole step last.
_RECONCILE: tuple[str, ...] = ("temporaries", "activations", "outputs", "gradients", "static", "inputs",
                               "optimizer state", "parameters")

Progress = Callable[[str], Any]


def _ordered(cats: Mapping[str, Any]) -> list[str]:
    known = [c for c in STACK_ORDER if c in cats]
    return known + sorted(c for c in cats if c not in STACK_ORDER)


# -- flat splits -------------------------------------------------------------------------------


def flat_category_bytes(lr: Any, category_of: Mapping[int, str], *, start: Sequence[int] | None = None,
                        end: Sequence[int] | None = None, memory_spaces: Collection[int] = (0,),
                        corrections: Sequence[tuple[int, int, int, int]] = ()) -> dict[str, np.ndarray]:
    """Bytes live at each flat step of ``lr`` (LiveRanges) in ``memory_spaces``, by category.

    ``start``/``end`` override the live ranges (a start of -1 drops the buffer), as
    :class:`PeakMemory` does for outputs and static allocations; ``corrections`` (buffer id,
    start, end, +/-bytes) are counted besides them (``MemoryProfile.counted_corrections``).
    """
    n = lr.num_steps
    start = lr.start if start is None else start
    end = lr.end if end is None else end
    diffs: dict[str, np.ndarray] = {}
    for b in lr.buffers:
        s = start[b.id]
        size = lr.size_bytes[b.id]
        if s < 0 or not size or b.memory_space not in memory_spaces:
            continue
        cat = category_of.get(b.id, "temporaries")
        d = diffs.get(cat)
        if d is None:
            d = diffs[cat] = np.zeros(n + 1, dtype=np.int64)
        d[s] += size
        d[end[b.id] + 1] -= size
    for bid, first, last, size in corrections:
        cat = category_of.get(bid, "temporaries")
        d = diffs.get(cat)
        if d is None:
            d = diffs[cat] = np.zeros(n + 1, dtype=np.int64)
        d[first] += size
        d[last + 1] -= size
    return {c: np.cumsum(d[:-1]) for c, d in diffs.items()}


def memory_category_timeline(prof: Any, settings: Mapping[str, Any], *,
                             category_of: Mapping[int, str] | None = None) -> dict[str, np.ndarray]:
    """The memory model's device timeline (``prof.timeline_bytes``) split by category, per flat step.

    Reapplies :class:`PeakMemory`'s counting switches from ``settings`` (outputs live the whole
    program; constants as static allocations; static and code bytes at every step, as
    ``static``). ``category_of`` overrides the model's categories. Raises ValueError when the
    split does not sum to the model's timeline.
    """
    lr = prof.ranges
    n = lr.num_steps
    cats = category_of if category_of is not None else prof.category_of
    if not cats:
        from hloopt.passes.memory import categorize

        cats = categorize(lr)
    fixed = int(prof.static_bytes) + int(prof.code_bytes)
    counted = getattr(prof, "counted_start", None)
    if counted:  # the model says which steps it counts each buffer in: every space but the host's
        from hloopt.ir import HOST_MEMORY_SPACE

        spaces = {b.memory_space for b in lr.buffers} - {HOST_MEMORY_SPACE}
        out = flat_category_bytes(lr, cats, start=counted, end=prof.counted_end, memory_spaces=spaces,
                                  corrections=getattr(prof, "counted_corrections", ()))
        if getattr(prof, "on_chip_timeline_bytes", None) is not None:
            _settle_msa(out, prof, fixed)
        return _checked(out, prof, fixed)
    start, end = list(lr.start), list(lr.end)
    if settings.get("static_allocations"):
        for b in lr.buffers:
            if start[b.id] >= 0 and b.on_device and all(i.opcode == "constant" for i, _ in b.values):
                start[b.id] = -1
    if settings.get("outputs_whole_program"):
        for b in lr.buffers:
            if start[b.id] >= 0 and b.output_indices:
                start[b.id], end[b.id] = 0, n - 1
    return _checked(flat_category_bytes(lr, cats, start=start, end=end), prof, fixed)


def _settle_msa(out: dict[str, np.ndarray], prof: Any, fixed: int) -> None:
    """Predicted memory-space assignment: the timeline is not a sum of buffers (VMEM holds some,
    the larger heap counts). Per step, as PeakMemory settles its peak: bytes above the buffers'
    sum are temporaries; bytes below come off temporaries, then activations, then gradients."""
    n = prof.ranges.num_steps
    total = sum(out.values(), np.zeros(n, dtype=np.int64)) + fixed
    delta = np.asarray(prof.timeline_bytes, dtype=np.int64) - total
    for c in ("temporaries", "activations", "gradients"):
        out.setdefault(c, np.zeros(n, dtype=np.int64))
    out["temporaries"] += np.maximum(delta, 0)
    owed = np.maximum(-delta, 0)
    # a caller's own bucket ("": the residuals a plan report draws apart) last
    for c in ("temporaries", "activations", "gradients", *(("",) if "" in out else ())):
        take = np.minimum(owed, out[c])
        out[c] -= take
        owed -= take


def _checked(out: dict[str, np.ndarray], prof: Any, fixed: int) -> dict[str, np.ndarray]:
    """Add the static/code bytes to every step and check the sum against the model's timeline."""
    n = prof.ranges.num_steps
    if fixed:
        out["static"] = out.get("static", np.zeros(n, dtype=np.int64)) + fixed
    total = sum(out.values(), np.zeros(n, dtype=np.int64))
    if not np.array_equal(total, np.asarray(prof.timeline_bytes, dtype=np.int64)):
        bad = int(np.flatnonzero(total != np.asarray(prof.timeline_bytes))[0])
        raise ValueError(f"category split sums to {int(total[bad])} B at step {bad}, "
                         f"the memory model says {prof.timeline_bytes[bad]} B")
    return {c: out[c] for c in _ordered(out)}


def _fold_to_entry(lr: Any, flat: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[int]]:
    """Entry-step split: each entry instruction takes the split of its highest flat step.

    Returns (split per entry step, the flat step chosen for each entry step).
    """
    entry = lr.module.entry
    m = len(entry.instructions) if entry is not None else 0
    total = sum(flat.values(), np.zeros(lr.num_steps, dtype=np.int64))
    rep = [-1] * m
    for t, e in enumerate(lr.entry_step):
        if rep[e] < 0 or total[t] > total[rep[e]]:
            rep[e] = t
    idx = np.array([max(r, 0) for r in rep], dtype=np.int64)
    has = np.array([r >= 0 for r in rep], dtype=bool)
    return {c: np.where(has, v[idx], 0) if m else np.zeros(0, dtype=np.int64) for c, v in flat.items()}, rep


def _step_entries(problem: Any, entry: Any) -> list[int] | None:
    """Entry instruction index of each Problem step, from the labels ``name`` / ``name[k]``."""
    out: list[int] = []
    labels = [s.label for s in problem.steps]
    i = 0
    for e, inst in enumerate(entry.instructions):
        if i < len(labels) and labels[i] == inst.name:
            out.append(e)
            i += 1
            continue
        k = 0
        while i < len(labels) and labels[i] == f"{inst.name}[{k}]":
            out.append(e)
            i += 1
            k += 1
        if k == 0:
            return None
    return out if i == len(labels) else None


# -- live buffers --------------------------------------------------------------------------------


def _live_buffers(lr: Any, cats: Mapping[int, str], step: int, *, limit: int,
                  actions: Mapping[int, tuple[str, str]] | None = None) -> list[LiveBuffer]:
    """Device buffers live at flat ``step``, largest first; residual buffers (``actions``: buffer id
    -> (the plan's action, candidate key)) are filed as ``residuals``."""
    from hloopt.pipeline import relative_source

    mod = lr.module
    rows = []
    for r in sorted(lr.live_at(step), key=lambda r: (-lr.size_bytes[r.buffer.id], r.buffer.id)):
        b = r.buffer
        if b.memory_space != 0 or b.shape.is_tuple:
            continue
        inst = b.instruction
        src = mod.source_of(inst)
        idx = "{" + ",".join(map(str, b.index)) + "}" if b.index else ""
        action, key = actions.get(b.id, ("", "")) if actions else ("", "")
        rows.append(LiveBuffer(name=inst.name + idx, shape=b.shape.to_text(layout=False), bytes=lr.size_bytes[b.id],
                               category="residuals" if action else cats.get(b.id, "temporaries"),
                               op_name=inst.metadata.op_name or (f"residual {key}" if key else ""),
                               source=relative_source(f"{src[0]}:{src[1]}") if src else "", action=action))
        if len(rows) >= limit:
            break
    return rows


def _backward_flags(module: Any, entry_of_step: Sequence[int]) -> list[bool]:
    """Whether each step is in the backward pass (from the residual analysis); [] when unknown."""
    from hloopt.passes.residuals import find_residuals

    try:
        res = find_residuals(module)
    except Exception:  # a module the residual analysis cannot read still gets its memory report
        return []
    if not len(res):
        return []
    return [e >= res.backward_start for e in entry_of_step]


def _logical(shape: str) -> str:
    """``f32[2,64]{1,0:T(8,128)}`` -> ``f32[2,64]`` (layouts make the tables unreadable)."""
    return shape.split("{", 1)[0] if shape.endswith("}") and "[" in shape else shape


def _mesh(module: Any) -> tuple[int, ...]:
    shardings = [i.sharding for i in module.instructions() if i.sharding]
    return mesh_of(shardings, module.num_partitions)


# -- a module on its own ---------------------------------------------------------------------------


def report_data_from_memory(report: Any, device: Mapping[str, Any], *, budget_bytes: int | None = None,
                            top: int = 50, target: str = "") -> ReportData:
    """ReportData for a :class:`~hloopt.analysis.MemoryReport` (``analyze --html``, ``report TARGET``)."""
    prof = report.profile
    lr = prof.ranges
    module = lr.module
    note = ""
    try:
        flat = memory_category_timeline(prof, report.settings)
    except ValueError as err:  # the model counts in a way the split does not know: draw the total only
        flat = {"device": np.asarray(prof.timeline_bytes, dtype=np.int64)}
        note = f"not split by category ({err})"
    entry = module.entry
    labels = [inst.name if inst.parent is entry or inst.parent is None else f"{inst.parent.name}/{inst.name}"
              for inst in lr.steps]
    from hloopt.pipeline import relative_source

    xla = report.xla or {}
    s = report.settings
    assumptions = {
        "memory model": f"{report.source}, counted as {s.get('kind', '?')}: schedule {s.get('schedule')}, "
                        f"buffers {s.get('materialize')}"
                        + (f", {s.get('alignment_bytes')} B aligned" if s.get("alignment_bytes") else ""),
        "steps": "the flat schedule: each loop body and callee once, at its call site",
    }
    if note:
        assumptions["categories"] = note
    if xla.get("peak_memory_in_bytes"):
        xp = int(xla["peak_memory_in_bytes"])
        assumptions["XLA's own peak"] = f"{format_bytes(xp)} (model {(prof.peak_bytes - xp) / xp:+.1%})"
    if prof.code_bytes:
        assumptions["generated code"] = format_bytes(prof.code_bytes) + " resident (XLA's figure), counted as static"
    if prof.host_bytes:
        assumptions["host memory (S(5))"] = f"{format_bytes(prof.host_bytes)} at most, not counted as device"
    for k, text in enumerate(getattr(report, "notes", ()), 1):
        assumptions[f"note {k}"] = text
    return ReportData(
        module_name=module.name, device=dict(device), budget_bytes=budget_bytes, step_labels=labels,
        baseline_by_category={c: v.tolist() for c, v in flat.items()},
        baseline_peak_step=int(prof.peak_step), baseline_peak_bytes=int(prof.peak_bytes),
        step_backward=_backward_flags(module, lr.entry_step),
        live_at_peak=tuple(LiveBuffer(name=b.name, shape=_logical(b.shape), bytes=b.bytes, category=b.category,
                                      op_name=b.op_name, source=relative_source(b.source) if b.source else "")
                           for b in prof.top[:top]),
        assumptions=assumptions, num_partitions=module.num_partitions, mesh=_mesh(module), target=target,
    ).validate()


# -- a plan --------------------------------------------------------------------------------------


def _split_base(base: np.ndarray, entry_split: Mapping[str, np.ndarray], entry_of_step: Sequence[int]
                ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Split ``base`` (per Problem step) like the memory model splits each step's entry instruction.

    ``entry_split`` leaves the residual buffers out. Where its total differs from ``base`` (the
    Problem models stacked residuals per layer), the difference is taken out of (or added to)
    the categories in :data:`_RECONCILE` order. Returns (split, the difference per step).
    """
    idx = np.asarray(entry_of_step, dtype=np.int64)
    out = {c: v[idx].astype(np.int64) for c, v in entry_split.items()}
    total = sum(out.values(), np.zeros(len(base), dtype=np.int64))
    diff = total - base
    excess = diff.copy()
    order = [c for c in _RECONCILE if c in out] + [c for c in out if c not in _RECONCILE]
    for c in order:
        take = np.minimum(np.maximum(excess, 0), out[c])
        out[c] -= take
        excess -= take
    if (excess < 0).any():
        out["temporaries"] = out.get("temporaries", np.zeros(len(base), dtype=np.int64)) - np.minimum(excess, 0)
    return out, diff


def report_data_from_outcome(outcome: Any, *, top: int = 50) -> ReportData:
    """ReportData for ``hloopt plan --html`` / ``hloopt report plan.json`` (see the module docstring)."""
    from hloopt.passes.memory import categorize

    problem = outcome.problem
    an = outcome.analyzed
    module = an.module
    lr = an.ranges
    base = np.array([s.base_bytes for s in problem.steps], dtype=np.int64)
    baseline = np.asarray(outcome.baseline.timeline_bytes, dtype=np.int64)
    # every instance on device from its production to its last use (the all-device replay)
    delta = np.zeros(len(base) + 1, dtype=np.int64)
    for c in problem.candidates:
        for ins in c.instances:
            delta[ins.produced] += ins.bytes
            delta[ins.last_use + 1] -= ins.bytes
    residual = np.cumsum(delta[:-1])
    # where libtpu's on-chip heap is the larger one (Step.floor_bytes), the rest of the line
    on_chip = baseline - base - residual
    plan = outcome.plan
    res = outcome.result
    cats = categorize(lr)
    # the plan names the residual values (entry instructions) behind each decision
    decided = {v: (d.action, d.key) for d in plan.decisions for v in d.values}
    actions: dict[int, tuple[str, str]] = {}  # buffer id -> (action, candidate key)
    for r in an.residuals:
        if r.inst.name not in decided:
            continue
        try:
            b = lr.aliasing.buffer_at(r.inst, ())
        except (KeyError, IndexError):
            continue
        if b.id not in actions or actions[b.id][0] == "device":  # a moved value names a shared buffer
            actions[b.id] = decided[r.inst.name]
    # residual buffers are drawn from the simulator; the memory model splits the rest (the
    # profile the timeline is, when there is one: its counted ranges and VMEM settlement)
    rest = {k: ("" if k in actions else v) for k, v in cats.items()}
    mem = getattr(an, "memory", None)
    if mem is not None:
        flat = memory_category_timeline(mem, {}, category_of=rest)
    else:
        flat = flat_category_bytes(lr, rest)
    entry_split, rep = _fold_to_entry(lr, flat)
    entry_split.pop("", None)
    entry_of_step = _step_entries(problem, module.entry)
    by_cat: dict[str, Any]
    mismatch = 0
    if entry_of_step is not None:
        by_cat, diff = _split_base(base, entry_split, entry_of_step)
        mismatch = int(np.abs(diff).max()) if len(diff) else 0
    else:  # labels do not map back to the entry: one category for everything not a candidate
        by_cat = {"other": base}
    by_cat["residuals"] = residual
    by_cat["on-chip heap"] = on_chip
    by_cat = {c: [int(x) for x in by_cat[c]] for c in _ordered(by_cat) if by_cat[c].any()}
    peak = int(outcome.baseline.peak_step)
    live: list[LiveBuffer] = []
    if entry_of_step is not None and 0 <= peak < len(entry_of_step) and rep[entry_of_step[peak]] >= 0:
        live = _live_buffers(lr, cats, rep[entry_of_step[peak]], limit=top, actions=actions)
    budget = plan.budget.bytes if plan.budget else None
    # argument groups have no Decision: their placement (the update on the host) is plan.state
    device_s, host_s = problem.compute_seconds((d.key for d in plan.of("remat")), host_update=plan.host_update)
    return ReportData(
        module_name=plan.module,
        device=dict(plan.device),
        budget_bytes=budget,
        step_labels=[s.label for s in problem.steps],
        baseline_by_category=by_cat,
        baseline_peak_step=peak,
        baseline_peak_bytes=int(outcome.baseline.peak_bytes),
        plan_timeline=[int(x) for x in res.timeline_bytes],
        plan_peak_step=int(res.peak_step),
        plan_peak_bytes=int(res.peak_bytes),
        transfers=tuple(Transfer(k, int(i), d, float(s), float(e)) for k, i, d, s, e in res.transfers),
        step_start_s=[float(x) for x in res.step_start_s],
        step_backward=[bool(s.backward) for s in problem.steps],
        live_at_peak=tuple(live),
        host_timeline=[int(x) for x in res.host_timeline_bytes] if plan.state and len(res.host_timeline_bytes)
        == len(problem.steps) else None,
        host_budget_bytes=plan.host_budget_bytes if plan.state else None,
        device_compute_s=float(device_s),
        host_compute_s=float(host_s) if plan.state else None,
        residuals=tuple(ResidualRow(d.key, d.name or "", d.shape, d.bytes, d.layers, d.action, d.reason, d.source)
                        for d in plan.decisions)
        # where the step's argument groups live (plan --state): one row each, their placement as the action
        + tuple(ResidualRow(f"state:{s.group}", s.group, "argument group", s.bytes, 1, s.placement, s.reason, "")
                for s in plan.state),
        assumptions={
            "target": f"{plan.target} ({an.source})",
            "plan": f"{plan.mode}" + (f", budget {plan.budget.spec}" if plan.budget else "")
                    + f"; solver {plan.solver.name} ({plan.solver.status})"
                    + ("; objective flops: the fewest recomputed FLOPs, no weight on waiting for the link"
                       if plan.objective == "flops" else ""),
            "memory timeline": ("hloopt analyze's TPU prediction" if getattr(an, "memory", None) is not None
                                else "liveness of the analyzed HLO")
                               + " per entry instruction; scanned layers that carry residuals expanded to one "
                                 "step per layer",
            "device->host": format_rate(problem.d2h_bytes_per_s),
            "host->device": format_rate(problem.h2d_bytes_per_s),
            "both at once (d2h/h2d)": f"{format_rate(problem.duplex_d2h_bytes_per_s)} / "
                                      f"{format_rate(problem.duplex_h2d_bytes_per_s)}",
            "transfer latency": format_seconds(problem.transfer_latency_s),
            "DMA engines": str(problem.dma_engines),
            "least peak any policy reaches": format_bytes(plan.bounds.least_peak_bytes),
            "compute": "roofline per instruction (FLOPs / peak rate vs bytes / HBM rate)",
            **({"host memory the plan may fill": format_bytes(plan.host_budget_bytes),
                "host memory the plan fills (most at once)": format_bytes(plan.host_peak_bytes or 0),
                "argument groups in host memory": ", ".join(plan.host_groups) or "none",
                "optimizer update": "on the host (its time, gradients out and parameters in are in the plan's "
                                    "step time)" if plan.host_update else "on the device"}
               if plan.state and plan.host_budget_bytes is not None else {}),
            **({"categories": f"the memory model's split of what is not a residual differs from the Problem's "
                              f"by up to {format_bytes(mismatch)} a step; settled in temporaries first"}
               if mismatch > 0.01 * max(int(outcome.baseline.peak_bytes), 1) else {}),
        },
        baseline_step_time_s=float(outcome.baseline.step_time_s),
        plan_step_time_s=float(res.step_time_s),
        num_partitions=module.num_partitions,
        mesh=_mesh(module),
        target=plan.target,
    ).validate()


def outcome_from_plan(plan: Any, *, profile: Any = None, platform: str | None = None, compile: str | None = None,
                      size: str | None = None, progress: Progress | None = None) -> Any:
    """Re-run the pipeline's analysis for a saved plan's target and replay the plan's decisions.

    ``profile`` defaults to the plan's own device. Raises UserError when the target cannot be
    found or its residual candidates no longer match the plan's (the program changed).
    """
    import contextlib

    from hloopt import pipeline
    from hloopt.devices import DeviceProfile
    from hloopt.errors import UserError
    from hloopt.problem import Action, Decisions
    from hloopt.simulator import simulate
    from hloopt.targets import resolve

    prog = progress or (lambda label: contextlib.nullcontext())
    prof = profile if profile is not None else DeviceProfile.from_dict(plan.device, origin="the plan's device")
    tgt = resolve(plan.target, size=size)
    names: dict[str, str] = {}
    if tgt.kind == "jax":
        module, source = pipeline.lower_for_plan(tgt, prof, platform=platform, compile=compile, progress=prog)
        with prog("naming residuals (re-lowering with one-name policies)"):
            names = pipeline._names_for(tgt, module, prof, platform=platform)
    else:
        from hloopt.hlo.parser import parse_module

        assert tgt.text is not None, "an HLO target is read when resolved"
        module = parse_module(tgt.text, filename=str(tgt.path))
        source = "hlo"
    with prog("analyzing memory, residuals and costs"):
        an = pipeline.analyze_module(module, prof, source=source, names=names)
        problem, _ = pipeline.build_problem(an, prof)
    keys = {c.key for c in problem.candidates}
    missing = sorted(d.key for d in plan.decisions if d.action != "device" and d.key not in keys)
    if missing:
        raise UserError(f"{plan.target}: the plan's candidates {', '.join(missing[:3])} are not in the program "
                        "any more; plan it again")
    decisions = Decisions({d.key: Action(d.action) for d in plan.decisions if d.key in keys})
    with prog("replaying the plan"):
        baseline = simulate(problem, Decisions.all_device())
        result = simulate(problem, decisions)
    return pipeline.PlanOutcome(plan, problem, an, baseline, result, decisions, [], None)
