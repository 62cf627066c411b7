"""Plans measured on a real accelerator (GPU or TPU), before and after calibration, in one run.

For each zoo target at a budget below its all-saved peak (keeping every residual does not fit):

1. ``hloopt plan`` with the built-in device profile (``--device``: ``h200`` on CUDA, ``tpu-v5e`` on
   TPU by default), in a process kept off the accelerator (``JAX_PLATFORMS=cpu``: planning lowers
   and never runs, and a TPU is held by one process at a time), except with ``--judge measured``,
   whose plan runs its candidates on the device;
2. ``hloopt measure --plan``: the plan and every built-in policy predicted within the budget, run
   on the device (median of ``--steps`` after warm-up), ``peak_bytes_in_use`` per policy;
3. a ``jax.profiler.trace`` of the step as written (without XLA's command buffers), fitted per op
   class against the profile and the host<->device link timed (``record_and_fit`` of
   ``bench/accelerator_check.py``): a calibrated profile that cites both;
4. ``hloopt plan`` again with the calibrated profile, and ``hloopt measure`` again.

Each plan and measurement runs in its own process (a device's peak memory reading is
process-long), in ``--out`` as its working directory with the targets named by absolute path, so
the installed hloopt is the one that runs (``pip install .``; a source folder on ``sys.path`` has
no ``hloopt.passes``). Everything lands in ``--out`` (``$OUT`` on the lent machine):
``results.json`` (versions, device, driver or libtpu, every measurement), ``log.txt``. Usage::

    python bench/device_campaign.py --platform cuda --targets llama:small,gpt2:small --budget 80%
    python bench/device_campaign.py --platform tpu --targets llama:small --budget 80%
    python bench/device_campaign.py --platform tpu --targets fixtures/thirdparty/levanter_llama.py:make@small

(a third-party step needs its libraries on the device machine: fixtures/thirdparty/requirements.txt).

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


def sh(cmd: list[str], log: Any, env: dict[str, str], timeout: float, cwd: Path) -> tuple[int, str]:
    t0 = time.perf_counter()
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as err:
        out, rc = f"timed out after {timeout:.0f} s: {err}", 124
    log.write(out[-6000:] + f"\n[rc={rc}, {time.perf_counter() - t0:.1f} s]\n")
    log.flush()
    return rc, out


def versions(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    code = ("import json, jax, jaxlib, importlib.metadata as m; d = jax.devices()[0]\n"
            "try: libtpu = m.version('libtpu')\n"
            "except m.PackageNotFoundError: libtpu = None\n"
            "print(json.dumps({'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'libtpu': libtpu, "
            "'device_kind': d.device_kind, 'platform': d.platform, 'devices': jax.device_count(), "
            "'memory_stats': d.memory_stats()}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd)
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


#: steps 1-4 of bench/accelerator_check.py (trace, fit, link, calibrated profile), in a process of
#: its own; prints what it found as one JSON line
CALIBRATE = """
import json, sys
from pathlib import Path
sys.path.append(sys.argv[4])
from accelerator_check import record_and_fit
print(json.dumps(record_and_fit(sys.argv[1], Path(sys.argv[3]), base=sys.argv[2], size=sys.argv[5] or None)))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="llama:small,gpt2:small",
                    help="zoo model:size, or file.py:factory[@size] (relative to the checkout), comma-separated")
    ap.add_argument("--budget", default="80%")
    ap.add_argument("--platform", choices=["cuda", "tpu"], default="cuda", help="the accelerator's JAX platform")
    ap.add_argument("--device", default=None,
                    help="built-in profile to plan with before calibration (h200 on cuda, tpu-v5e on tpu)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "device_campaign"))
    ap.add_argument("--timeout", type=float, default=400, help="seconds allowed to each plan and measurement")
    ap.add_argument("--dry-run", action="store_true", help="CPU backend, tiny sizes")
    ap.add_argument("--skip-before", action="store_true", help="only calibrate, plan and measure again")
    ap.add_argument("--judge", choices=["flops", "compiled", "measured"], default="flops",
                    help="plan's --judge: fewest FLOPs as lowered, libtpu's compiled roofline (TPU profiles), or "
                         "the candidates run on the device (the plan then runs on it too)")
    a = ap.parse_args()
    device = a.device or {"cuda": "h200", "tpu": "tpu-v5e"}[a.platform]
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # the accelerator first (the default backend), the CPU beside it for what hloopt keeps there
    env["JAX_PLATFORMS"] = "cpu" if a.dry_run else f"{a.platform},cpu"
    off_device = dict(env, JAX_PLATFORMS="cpu")
    py = [sys.executable, "-m", "hloopt"]
    results: dict[str, Any] = {"schema": "hloopt.device_campaign/1", "budget": a.budget, "device_profile": device,
                               "judge": a.judge,
                               "steps": a.steps, "versions": versions(env, out), "targets": {}}
    res_path = out / "results.json"
    with open(out / "log.txt", "w") as log:
        for spec in a.targets.split(","):
            model, size = spec.rsplit(":", 1)
            size_opt: list[str] = []
            if model.endswith(".py"):
                # any TARGET file (a third-party step under fixtures/thirdparty/, the user's own):
                # relative to the checkout, file.py:factory or file.py:factory@size
                path = Path(model) if Path(model).is_absolute() else ROOT / model
                factory, _, factory_size = size.partition("@")
                size_opt = ["--size", factory_size] if factory_size else []
                target, model, size = f"{path}:{factory}", path.stem, factory_size or factory
            else:
                if a.dry_run:
                    size = "tiny"
                target = f"{ROOT / 'fixtures' / 'zoo' / model}.py:{size}"
            r: dict[str, Any] = {}
            results["targets"][target] = r
            work = out / f"{model}-{size}"
            work.mkdir(exist_ok=True)
            for phase, dev in (("before", ["--device", device]),
                               ("after", ["--device-file", str(work / "calibrated.toml")])):
                if phase == "before" and a.skip_before:
                    continue
                if phase == "after":
                    # XLA runs a GPU step's ops inside CUDA command buffers by default, and the
                    # profiler then times the buffers, not the ops: the trace is recorded without
                    cal_env = dict(env)
                    if a.platform == "cuda":
                        cal_env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
                    rc, text = sh([sys.executable, "-c", CALIBRATE, target, device, str(work),
                                   str(ROOT / "bench"), size_opt[-1] if size_opt else ""], log, cal_env, a.timeout, out)
                    r["calibration"] = {"rc": rc}
                    if rc == 0:
                        # the JSON line it prints; the TPU runtime may log after it
                        r["calibration"].update(json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1]))
                        r["calibrated_profile"] = (work / "calibrated.toml").read_text()
                    else:
                        break
                plan = work / f"plan-{phase}.json"
                # --judge measured runs the candidates on the device: that plan needs it
                rc, text = sh(py + ["plan", target, *size_opt, *dev, "--budget", a.budget, "--judge", a.judge,
                                    "--out", str(plan), "-q"],
                              log, env if a.judge == "measured" else off_device, a.timeout, out)
                r[f"plan_{phase}"] = json.loads(plan.read_text()) if rc == 0 else {"rc": rc, "output": text[-3000:]}
                if rc != 0:
                    continue
                rc, text = sh(py + ["measure", target, *size_opt, "--plan", str(plan), *dev, "--steps", str(a.steps),
                                    "--warmup", "3", "--json", "-q"], log, env, a.timeout, out)
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
