"""The checks `hloopt measure` and `hloopt calibrate --profile` still owe a real accelerator, in one run.

Run on a GPU or TPU machine (hloopt defaults JAX to the CPU; name the platform):

    JAX_PLATFORMS=cuda python bench/accelerator_check.py --model gpt2 --size small --out "$OUT"

1. records a ``jax.profiler.trace`` of the step (``--steps`` runs) on the default device;
2. reads it (:mod:`hloopt.profile_trace`): module runs, op events matched to the compiled module,
   op seconds inside each run against the run's wall time, copies found;
3. fits per-op-class efficiency against the guessed built-in profile and writes ``calibrated.toml``;
4. times host<->device copies (:func:`hloopt.calibrate.measure_link`) as a second figure for the link;
5. runs ``hloopt measure`` with the calibrated profile: predicted vs measured time, the device's
   ``peak_bytes_in_use`` per policy, ranks; writes ``measure.json``.

What to look at: op events matched (all, or the GPU's trace names ops differently), op seconds
<= run wall time, the dot efficiency (0..1 of the tensor-core roofline), device peaks ordered like
the predicted ones, and the rank agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def record_and_fit(target: str, out: Path, *, base: str | None = None, steps: int = 5,
                   size: str | None = None) -> dict[str, Any]:
    """Steps 1-4 above for ``target`` on the default device: the trace under ``out/trace``, the
    calibrated profile (fitted efficiencies; the timed link where timing worked) in
    ``out/calibrated.toml``. Returns what was found, JSON-able."""
    import hloopt.lowering  # noqa: F401,I001  (before jax: sets XLA_FLAGS / JAX_PLATFORMS)
    import jax

    from hloopt.calibrate import (
        calibrated_profile,
        compiled_module_for,
        fit_trace_lowered,
        lowered_module_for,
        measure_link,
        trace_calibrated_profile,
    )
    from hloopt.cli.calibrate_cmd import _guess_base
    from hloopt.devices import load_profile, write_profile
    from hloopt.measure import materialize
    from hloopt.profile_trace import read_trace
    from hloopt.targets import resolve

    dev = jax.devices()[0]
    tgt = resolve(target, size=size)
    args = materialize(tuple(tgt.args))
    f = jax.jit(tgt.step_fn)
    jax.block_until_ready(f(*args))
    # each step marked (its wall time in the trace) and no Python tracer (it slows the host)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(out / "trace"), profiler_options=options):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                jax.block_until_ready(f(*args))
    trace = read_trace(out / "trace")
    profile_base = load_profile(base or _guess_base(str(dev.device_kind)))
    cal = fit_trace_lowered(trace, compiled_module_for(tgt), lowered_module_for(tgt, profile_base), profile_base)
    profile = trace_calibrated_profile(profile_base, cal, name=f"{profile_base.name}-calibrated")
    link = link_error = None
    try:
        link = measure_link()
        profile = calibrated_profile(profile, link)
    except Exception as err:  # report and go on: the compute fit does not need it
        link_error = f"{type(err).__name__}: {err}"
    write_profile(profile, out / "calibrated.toml")
    return {
        "device": f"{dev.device_kind} ({dev.platform})", "memory_stats": dev.memory_stats() is not None,
        "op_events": len(trace.ops), "module_runs": len(trace.runs), "copies": len(trace.transfers),
        "matched_events": cal.matched_events, "unmatched_ops": list(cal.unmatched_ops)[:20],
        "step_wall_s": list(cal.step_wall_s), "step_op_s": list(cal.step_op_s),
        "fits": [{"op_class": x.op_class, "events": x.events, "flops_per_s": x.achieved_flops_per_s,
                  "efficiency": x.efficiency} for x in cal.fits],
        "trace_link": {"d2h_bytes_per_s": cal.d2h_bytes_per_s, "h2d_bytes_per_s": cal.h2d_bytes_per_s},
        "timed_link": None if link is None else {"d2h_bytes_per_s": link.d2h.bytes_per_s,
                                                 "h2d_bytes_per_s": link.h2d.bytes_per_s},
        "link_error": link_error,
        "sourced_link": {"d2h_bytes_per_s": profile_base.d2h_bytes_per_s,
                         "h2d_bytes_per_s": profile_base.h2d_bytes_per_s},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--base", default=None, help="built-in profile to fit against (default: guessed from the device)")
    ap.add_argument("--out", default=os.environ.get("OUT", "accelerator_check"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from hloopt.devices import load_profile
    from hloopt.measure import measure

    target = f"{ROOT / 'fixtures' / 'zoo' / a.model}.py:{a.size}"
    r = record_and_fit(target, out, base=a.base, steps=a.steps)
    print(f"device: {r['device']}; memory_stats: {r['memory_stats']}")
    print(f"trace: {r['op_events']} op events, {r['module_runs']} module runs, {r['copies']} copies")
    print(f"matched {r['matched_events']} op events; not in the module: {r['unmatched_ops'][:10]}")
    for wall, ops in zip(r["step_wall_s"], r["step_op_s"]):
        print(f"  run wall {wall * 1e3:.3f} ms, ops inside {ops * 1e3:.3f} ms ({ops / wall:.0%})")
    for fit in r["fits"]:
        print(f"  {fit['op_class']:<14} {fit['events']:>5} events  {fit['flops_per_s']:.3g} FLOP/s  "
              f"efficiency {fit['efficiency']:.3g}")
    print(f"link (copies timed): {r['timed_link'] or r['link_error']}; trace: {r['trace_link']}")
    profile = load_profile(str(out / "calibrated.toml"))
    m = measure(target, profile=profile, steps=10, warmup=3)
    (out / "measure.json").write_text(json.dumps(m.to_dict(), indent=2) + "\n")
    for row in m.rows:
        meas = row.measured
        print(f"  {row.name:<34} pred {row.predicted_step_time_s * 1e3:8.3f} ms {row.predicted_peak_bytes:>12} B | "
              + (f"meas {meas.median_s * 1e3:8.3f} ms peak {row.device_peak_bytes} own={row.device_peak_is_own} "
                 f"temp {row.compiled_temp_bytes}" if meas else (row.skipped or row.error or "")))
    print(f"rank agreement: {m.rank_agreement}; device peak note: {m.device_peak_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
