"""Per-policy device traces of one step, kept for offline work on the time model.

``bench/device_campaign.py`` traces a step once, as written, and measures every policy's wall
time. A cost model of each policy's kernels needs more: which kernels the compiler formed for
that policy and how long each ran. For each policy (JAX's built-ins, and the step as written)
this compiles the step on the current device, runs it (``--warmup`` calls), records a
``jax.profiler.trace`` of ``--steps`` steps queued as a training loop queues them, and writes,
under ``--out/<target>/``: ``<policy>.hlo.txt`` (the compiled module: its fusions and their
names, which the trace's events carry), ``<policy>.trace.json.gz`` (the trace, Chrome format,
which :func:`hloopt.profile_trace.read_trace` reads) and one line per policy in ``runs.jsonl``
(wall time per step, device peak bytes, the device's time per module run from the trace). Each
target's folder is packed into ``<target>.tar.gz`` (the lent machine returns a few files)::

    python bench/policy_traces.py --targets llama:small,convnet:small --out "$OUT"

Offline, ``python bench/fused_roofline.py`` compares the cost model with what these hold.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def builtin_policies() -> dict[str, Any]:
    import jax

    cp = jax.checkpoint_policies
    return {
        "as_written": None,
        "nothing_saveable": cp.nothing_saveable,
        "dots_saveable": cp.dots_saveable,
        "dots_with_no_batch_dims_saveable": cp.dots_with_no_batch_dims_saveable,
        "everything_saveable": cp.everything_saveable,
        "offload_dot_with_no_batch_dims": cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
    }


def one(target: Any, name: str, policy: Any, out: Path, steps: int, warmup: int) -> dict[str, Any]:
    import jax

    from hloopt.measure import device_peak_bytes, materialize
    from hloopt.profile_trace import find_trace_file, read_trace

    fn, args, kwargs = (target.step_fn, target.args, dict(target.kwargs)) if policy is None \
        else target.with_policy(policy)
    args, kwargs = materialize(args), materialize(kwargs)
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    compile_s = time.perf_counter() - t0
    (out / f"{name}.hlo.txt").write_text(compiled.as_text())
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args, **kwargs))
    walls = []
    for _ in range(steps):  # 4 queued per sample, as hloopt measure times a step
        prev = compiled(*args, **kwargs)
        jax.block_until_ready(prev)
        t0 = time.perf_counter()
        for _ in range(3):
            prev = compiled(*args, **kwargs)
        jax.block_until_ready(prev)
        walls.append((time.perf_counter() - t0) / 3)
    tdir = out / f"{name}-trace"
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(tdir), profiler_options=options):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                jax.block_until_ready(compiled(*args, **kwargs))
    src = find_trace_file(tdir)
    trace = read_trace(tdir)
    runs = [r.dur_us * 1e-6 for r in trace.runs if r.device_line] or [r.dur_us * 1e-6 for r in trace.runs]
    with open(src, "rb") as f:
        raw = f.read()
    if not src.name.endswith(".gz"):
        raw = gzip.compress(raw)
    (out / f"{name}.trace.json.gz").write_bytes(raw)
    shutil.rmtree(tdir, ignore_errors=True)
    peak, _ = device_peak_bytes(jax.devices()[0])
    mem = compiled.memory_analysis()
    return {"policy": name, "compile_s": compile_s, "wall_s_median": statistics.median(walls),
            "wall_s": walls, "device_run_s_median": statistics.median(runs) if runs else None,
            "device_runs": len(runs), "process_peak_bytes": peak,
            "peak_memory_in_bytes": getattr(mem, "peak_memory_in_bytes", None)}


def main(argv: list[str]) -> int:
    import jax

    from hloopt.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="llama:small",
                    help="zoo model:size or file.py:factory[@size], comma-separated")
    ap.add_argument("--policies", default=",".join(builtin_policies()))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("policy_traces"))
    a = ap.parse_args(argv)
    known = builtin_policies()
    names = a.policies.split(",")
    bad = [n for n in names if n not in known]
    if bad:
        print(f"policy_traces: unknown policy {bad[0]!r} (one of {', '.join(known)})", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    info = {"jax": jax.__version__, "device_kind": dev.device_kind, "platform": dev.platform}
    for spec in a.targets.split(","):
        model, _, size = spec.rpartition(":")
        if model.endswith(".py"):
            factory, _, fsize = size.partition("@")
            target = resolve(f"{ROOT / model}:{factory}", size=fsize or None)
            label = f"{Path(model).stem}-{fsize or factory}"
        else:
            target = resolve(f"{ROOT / 'fixtures' / 'zoo' / model}.py:{size}")
            label = f"{model}-{size}"
        out = a.out / label
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "runs.jsonl", "w") as log:
            log.write(json.dumps({"target": spec, **info}) + "\n")
            for n in names:
                try:
                    row = one(target, n, known[n], out, a.steps, a.warmup)
                except Exception as err:  # one policy's failure (it does not fit) is a result too
                    row = {"policy": n, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(json.dumps({k: v for k, v in row.items() if k != "wall_s"}), flush=True)
        with tarfile.open(a.out / f"{label}.tar.gz", "w:gz") as tar:
            tar.add(out, arcname=label)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
