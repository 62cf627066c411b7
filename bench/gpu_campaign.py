"""Plans measured on a real GPU, before and after calibration, in one run (issue "Step time measured").

For each zoo target at a budget below its all-saved peak (keeping every residual does not fit):

1. ``hloopt plan`` with the built-in device profile (``--device h200`` by default);
2. ``hloopt measure --plan``: the plan and every built-in policy predicted within the budget, run
   on the device (median of ``--steps`` after warm-up), ``peak_bytes_in_use`` per policy;
3. a ``jax.profiler.trace`` of the step as written, fitted per op class against the profile
   (:func:`hloopt.calibrate.fit_trace`), the host<->device link timed
   (:func:`hloopt.calibrate.measure_link`): a calibrated profile that cites both;
4. ``hloopt plan`` again with the calibrated profile, and ``hloopt measure`` again.

Each plan and measurement runs in its own process (a device's peak memory reading is
process-long). Everything lands in ``--out`` (``$OUT`` on the lent machine): ``results.json``
(versions, device, driver, every measurement), ``log.txt``. Usage on the GPU machine::

    JAX_PLATFORMS=cuda python bench/gpu_campaign.py --targets llama:small,gpt2:small --budget 80%

``--dry-run`` runs the same on the CPU backend with tiny sizes (to check the script, not the device).
The raw results of a run are committed under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def sh(cmd: list[str], log: Any, env: dict[str, str], timeout: float) -> tuple[int, str]:
    t0 = time.perf_counter()
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as err:
        out, rc = f"timed out after {timeout:.0f} s: {err}", 124
    log.write(out[-6000:] + f"\n[rc={rc}, {time.perf_counter() - t0:.1f} s]\n")
    log.flush()
    return rc, out


def versions(env: dict[str, str]) -> dict[str, Any]:
    code = ("import json, jax, jaxlib; d = jax.devices()[0]; print(json.dumps({'jax': jax.__version__, "
            "'jaxlib': jaxlib.__version__, 'device_kind': d.device_kind, 'platform': d.platform, "
            "'memory_stats': bool(d.memory_stats())}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    info: dict[str, Any] = {"python": platform.python_version()}
    try:
        info.update(json.loads(p.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        info["jax_error"] = p.stderr[-2000:]
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    return info


CALIBRATE = r'''
import json, sys
from pathlib import Path
import hloopt.lowering  # noqa: F401  (before jax)
import jax
from hloopt.calibrate import compiled_module_for, fit_trace, measure_link, trace_calibrated_profile
from hloopt.devices import load_profile, write_profile
from hloopt.measure import materialize
from hloopt.profile_trace import read_trace
from hloopt.targets import resolve

target, base_name, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
tgt = resolve(target)
args = materialize(tuple(tgt.args))
f = jax.jit(tgt.step_fn)
jax.block_until_ready(f(*args))
with jax.profiler.trace(str(out / "trace")):
    for _ in range(5):
        jax.block_until_ready(f(*args))
trace = read_trace(out / "trace")
from collections import Counter
from hloopt.profile_trace import find_trace_file
import gzip as _gz
_ev = json.loads(_gz.open(find_trace_file(out / "trace"), "rt").read())["traceEvents"]
_names = {(e.get("pid"), e.get("tid")): e["args"].get("name") for e in _ev
          if e.get("ph") == "M" and e.get("name") == "thread_name"}
_lines = Counter(_names.get((e.get("pid"), e.get("tid")), "?") for e in _ev if e.get("ph") == "X")
_samples = {}
for e in _ev:
    if e.get("ph") == "X":
        _samples.setdefault(_names.get((e.get("pid"), e.get("tid")), "?"), []).append(e.get("name"))
lines = {k: {"events": v, "first": _samples[k][:4]} for k, v in _lines.most_common(12)}
base = load_profile(base_name)
cal = fit_trace(trace, compiled_module_for(tgt), base)
link = None
try:
    link = measure_link()
except Exception as err:  # the compute fit stands without it
    print(f"link: {type(err).__name__}: {err}")
profile = trace_calibrated_profile(base, cal, name=f"{base.name}-calibrated")
if link is not None:
    from hloopt.calibrate import calibrated_profile
    profile = calibrated_profile(profile, link)
write_profile(profile, out / "calibrated.toml")
print(json.dumps({
    "matched_events": cal.matched_events, "unmatched_ops": list(cal.unmatched_ops)[:20],
    "step_wall_s": list(cal.step_wall_s), "step_op_s": list(cal.step_op_s),
    "fits": [{"op_class": x.op_class, "events": x.events, "flops_per_s": x.achieved_flops_per_s,
              "efficiency": x.efficiency} for x in cal.fits],
    "trace_link": {"d2h_bytes_per_s": cal.d2h_bytes_per_s, "h2d_bytes_per_s": cal.h2d_bytes_per_s},
    "timed_link": None if link is None else {"d2h_bytes_per_s": link.d2h.bytes_per_s,
                                             "h2d_bytes_per_s": link.h2d.bytes_per_s},
    "sourced_link": {"d2h_bytes_per_s": base.d2h_bytes_per_s, "h2d_bytes_per_s": base.h2d_bytes_per_s},
    "trace_lines": lines, "xla_flags": __import__("os").environ.get("XLA_FLAGS", ""),
}))
'''


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="llama:small,gpt2:small", help="zoo model:size, comma-separated")
    ap.add_argument("--budget", default="80%")
    ap.add_argument("--device", default="h200", help="built-in profile to plan with before calibration")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_campaign"))
    ap.add_argument("--dry-run", action="store_true", help="CPU backend, tiny sizes")
    ap.add_argument("--skip-before", action="store_true", help="only calibrate, plan and measure again")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("JAX_PLATFORMS", "cpu" if a.dry_run else "cuda")
    py = [sys.executable, "-m", "hloopt"]
    results: dict[str, Any] = {"schema": "hloopt.gpu_campaign/1", "budget": a.budget, "device_profile": a.device,
                               "steps": a.steps, "versions": versions(env), "targets": {}}
    res_path = out / "results.json"
    with open(out / "log.txt", "w") as log:
        for spec in a.targets.split(","):
            model, size = spec.split(":")
            if a.dry_run:
                size = "tiny"
            target = f"fixtures/zoo/{model}.py:{size}"
            r: dict[str, Any] = {}
            results["targets"][target] = r
            work = out / f"{model}-{size}"
            work.mkdir(exist_ok=True)
            for phase, dev in (("before", ["--device", a.device]),
                               ("after", ["--device-file", str(work / "calibrated.toml")])):
                if phase == "before" and a.skip_before:
                    continue
                if phase == "after":
                    # XLA runs a GPU step's ops inside CUDA command buffers by default, and the
                    # profiler then times the buffers, not the ops: the trace is recorded without
                    cal_env = dict(env)
                    cal_env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
                    rc, text = sh([sys.executable, "-c", CALIBRATE, target, a.device, str(work)], log, cal_env, 300)
                    r["calibration"] = {"rc": rc}
                    if rc == 0:
                        r["calibration"].update(json.loads(text.strip().splitlines()[-1]))
                        r["calibrated_profile"] = (work / "calibrated.toml").read_text()
                    else:
                        break
                plan = work / f"plan-{phase}.json"
                rc, text = sh(py + ["plan", target, *dev, "--budget", a.budget, "--out", str(plan), "-q"],
                              log, env, 300)
                r[f"plan_{phase}"] = json.loads(plan.read_text()) if rc == 0 else {"rc": rc, "output": text[-3000:]}
                if rc != 0:
                    continue
                rc, text = sh(py + ["measure", target, "--plan", str(plan), *dev, "--steps", str(a.steps),
                                    "--warmup", "3", "--json", "-q"], log, env, 400)
                try:
                    r[f"measure_{phase}"] = json.loads(text[text.index("{"):text.rindex("}") + 1])
                except ValueError:
                    r[f"measure_{phase}"] = {"rc": rc, "output": text[-3000:]}
                res_path.write_text(json.dumps(results, indent=1) + "\n")
            res_path.write_text(json.dumps(results, indent=1) + "\n")
    res_path.write_text(json.dumps(results, indent=1) + "\n")
    print(summary(results))
    return 0


def summary(results: dict[str, Any]) -> str:
    """One line per policy and phase: predicted and measured step time and peak."""
    lines = [json.dumps(results["versions"])]
    for target, r in results["targets"].items():
        for phase in ("before", "after"):
            m = r.get(f"measure_{phase}")
            if not m or "rows" not in m:
                lines.append(f"{target} {phase}: {str(m)[:300]}")
                continue
            for row in m["rows"]:
                meas = row.get("measured") or {}
                pred = row.get("predicted") or {}
                median = (meas.get("step_time_s") or {}).get("median")
                lines.append(f"{target} {phase} {row['name']:<34} pred {pred.get('step_time_s')} s "
                             f"{pred.get('peak_bytes')} B | meas {median} s peak {meas.get('device_peak_bytes')} "
                             f"{row.get('skipped') or row.get('error') or ''}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
