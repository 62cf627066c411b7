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

ROOT = Path(__file__).resolve().parent.parent


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

    import jax

    import hloopt.lowering  # noqa: F401  (before jax)
    from hloopt.calibrate import compiled_module_for, fit_trace, measure_link, trace_calibrated_profile
    from hloopt.cli.calibrate_cmd import _guess_base
    from hloopt.devices import load_profile, write_profile
    from hloopt.measure import materialize, measure
    from hloopt.profile_trace import read_trace
    from hloopt.targets import resolve

    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}); memory_stats: {dev.memory_stats() is not None}")
    target = f"{ROOT / 'fixtures' / 'zoo' / a.model}.py:{a.size}"
    tgt = resolve(target)
    args = materialize(tuple(tgt.args))
    f = jax.jit(tgt.step_fn)
    jax.block_until_ready(f(*args))
    with jax.profiler.trace(str(out / "trace")):
        for _ in range(a.steps):
            jax.block_until_ready(f(*args))
    trace = read_trace(out / "trace")
    print(f"trace: {trace.path.name}: {len(trace.ops)} op events, {len(trace.runs)} module runs, "
          f"{len(trace.transfers)} copies")
    base = load_profile(a.base or _guess_base(str(dev.device_kind)))
    cal = fit_trace(trace, compiled_module_for(tgt), base)
    print(f"matched {cal.matched_events} op events; not in the module: {list(cal.unmatched_ops)[:10]}")
    for wall, ops in zip(cal.step_wall_s, cal.step_op_s):
        print(f"  run wall {wall * 1e3:.3f} ms, ops inside {ops * 1e3:.3f} ms ({ops / wall:.0%})")
    for fit in cal.fits:
        print(f"  {fit.op_class:<14} {fit.events:>5} events  {fit.achieved_flops_per_s:.3g} FLOP/s  "
              f"efficiency {fit.efficiency:.3g}")
    profile = trace_calibrated_profile(base, cal, name=f"{base.name}-calibrated")
    try:
        link = measure_link()
        print(f"link (copies timed): D2H {link.d2h.bytes_per_s:.3g} B/s, H2D {link.h2d.bytes_per_s:.3g} B/s; "
              f"trace: D2H {cal.d2h_bytes_per_s}, H2D {cal.h2d_bytes_per_s}")
    except Exception as err:  # report and go on: the other checks do not need it
        print(f"link: {type(err).__name__}: {err}")
    write_profile(profile, out / "calibrated.toml")
    m = measure(target, profile=profile, steps=10, warmup=3)
    (out / "measure.json").write_text(json.dumps(m.to_dict(), indent=2) + "\n")
    for r in m.rows:
        meas = r.measured
        print(f"  {r.name:<34} pred {r.predicted_step_time_s * 1e3:8.3f} ms {r.predicted_peak_bytes:>12} B | "
              + (f"meas {meas.median_s * 1e3:8.3f} ms peak {r.device_peak_bytes} own={r.device_peak_is_own} "
                 f"temp {r.compiled_temp_bytes}" if meas else (r.skipped or r.error or "")))
    print(f"rank agreement: {m.rank_agreement}; device peak note: {m.device_peak_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
