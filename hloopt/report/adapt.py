"""Build a :class:`~hloopt.report.ReportData` from a planning outcome (the pipeline's result).

Categories of the baseline timeline: ``other`` (everything no decision changes: parameters,
optimizer state, gradients, temporaries, outputs) and ``residuals`` (forward->backward values the
plan may move), both taken from the simulator's replay of the Problem with everything on device,
so the report draws exactly what the simulator judged.
"""

from __future__ import annotations

from typing import Any

from hloopt.report import LiveBuffer, ReportData, ResidualRow, Transfer, mesh_of
from hloopt.units import format_bytes, format_rate, format_seconds


def _live_at_peak(an: Any, limit: int = 30) -> list[LiveBuffer]:
    ranges = an.ranges
    per_step = ranges.bytes_per_step(memory_space=0)
    if not per_step:
        return []
    t = max(range(len(per_step)), key=per_step.__getitem__)
    rows = []
    mod = an.module
    for r in sorted(ranges.live_at(t), key=lambda r: (-r.size_bytes, r.buffer.instruction.name)):
        b = r.buffer
        if b.memory_space != 0 or b.shape.is_tuple:
            continue
        inst = b.instruction
        src = mod.source_of(inst)
        cat = "parameter" if b.parameter >= 0 else ("output" if b.output_indices else "temporary")
        rows.append(LiveBuffer(name=inst.name, shape=b.shape.to_text(layout=False), bytes=r.size_bytes,
                               category=cat, op_name=inst.metadata.op_name,
                               source=f"{src[0]}:{src[1]}" if src else ""))
        if len(rows) >= limit:
            break
    return rows


def report_data_from_outcome(outcome: Any) -> ReportData:
    """ReportData for ``hloopt plan --html`` / ``hloopt report``."""
    problem = outcome.problem
    base = [s.base_bytes for s in problem.steps]
    baseline = list(outcome.baseline.timeline_bytes)
    residual = [max(0, b - a) for a, b in zip(base, baseline)]
    plan = outcome.plan
    res = outcome.result
    dev = plan.device
    module = outcome.analyzed.module
    shardings = [i.sharding for i in module.entry.instructions if i.sharding] if module.entry else []
    return ReportData(
        module_name=plan.module,
        device=dev,
        budget_bytes=plan.budget.bytes if plan.budget else None,
        step_labels=[s.label for s in problem.steps],
        baseline_by_category={"other": base, "residuals": residual},
        baseline_peak_step=int(outcome.baseline.peak_step),
        baseline_peak_bytes=int(outcome.baseline.peak_bytes),
        plan_timeline=list(res.timeline_bytes),
        plan_peak_step=int(res.peak_step),
        plan_peak_bytes=int(res.peak_bytes),
        transfers=tuple(Transfer(k, int(i), d, float(s), float(e)) for k, i, d, s, e in res.transfers),
        step_start_s=list(res.step_start_s),
        step_backward=[s.backward for s in problem.steps],
        live_at_peak=tuple(_live_at_peak(outcome.analyzed)),
        residuals=tuple(ResidualRow(d.key, d.name or "", d.shape, d.bytes, d.layers, d.action, d.reason, d.source)
                        for d in plan.decisions),
        assumptions={
            "analyzed HLO": outcome.analyzed.source,
            "device->host": format_rate(problem.d2h_bytes_per_s),
            "host->device": format_rate(problem.h2d_bytes_per_s),
            "both at once (d2h/h2d)": f"{format_rate(problem.duplex_d2h_bytes_per_s)} / "
                                      f"{format_rate(problem.duplex_h2d_bytes_per_s)}",
            "transfer latency": format_seconds(problem.transfer_latency_s),
            "DMA engines": str(problem.dma_engines),
            "least peak any policy reaches": format_bytes(plan.bounds.least_peak_bytes),
            "compute": "roofline per instruction (FLOPs / peak rate vs bytes / HBM rate)",
        },
        baseline_step_time_s=float(outcome.baseline.step_time_s),
        plan_step_time_s=float(res.step_time_s),
        num_partitions=module.num_partitions,
        mesh=mesh_of(shardings, module.num_partitions),
    ).validate()
