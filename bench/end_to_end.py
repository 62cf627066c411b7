"""End to end: hloopt's time per stage on full-size training steps, next to XLA's on the same module.

    python bench/end_to_end.py                         # every row, TPU compiles under the libtpu flock
    python bench/end_to_end.py --rows llama-70b sharded-70b --no-tpu
    python bench/end_to_end.py --markdown              # the README table

Each row is a zoo step lowered from ``ShapeDtypeStruct`` (nothing allocated) with every residual
saved (``everything_saveable``, what ``hloopt plan`` lowers). Sharded rows are planned **per
device**: the module XLA's SPMD partitioner makes of the step during a CPU compile on 8 host
devices (:mod:`hloopt.spmd`). Every row runs in two fresh processes:

1. *prepare* (imports jax): lower; name the residuals (:mod:`hloopt.naming`, tracing); XLA's parse
   of the same text (``hlo_module_from_text``); a deviceless libtpu compile of the same training
   step as written (its own checkpoint policy: what the user compiles today) on ``--device``
   (default v5p, 95 GiB of HBM per chip; sharded steps on v5p:2x2x2). A step that does not fit
   compiles up to buffer assignment and fails: its time is marked OOM and is a lower bound on a
   compile. The libtpu compile holds ``/tmp/hloopt-tpu.flock``; only the compile is timed, not
   the wait for the lock nor the tracing.
2. *plan* (no jax in the process): parse, analyze (liveness + memory, ``hloopt analyze``'s
   settings), residuals, cost, and then the whole of ``hloopt plan`` from the text again on a
   fresh parse (analyze_module, Problem, search, replay, plan, anchors), with the names from 1.
   ``peak RSS`` is this process's ``ru_maxrss``: the tool's own memory.

Times are CPU seconds of the process (``time.process_time``), so other work on a shared machine
does not inflate them; wall seconds are printed too. Ratios: ``parse/XLA`` is our parse over
XLA's on the same text; ``plan/TPU`` is our end-to-end plan over the TPU compile.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: row -> (TARGET, factory keywords, per_device)
ROWS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama-tiny": ("fixtures/zoo/llama.py:tiny", {}, False),
    "llama-small": ("fixtures/zoo/llama.py:small", {}, False),
    "gpt2-xl": ("fixtures/zoo/gpt2.py:large", {}, False),
    "llama-7b": ("fixtures/zoo/llama.py:large", {"variant": "7b"}, False),
    "llama-70b": ("fixtures/zoo/llama.py:large", {"variant": "70b"}, False),
    "llama-70b-unrolled": ("fixtures/zoo/llama.py:large", {"variant": "70b", "scan_layers": False}, False),
    # Llama-2-7B dims with 200 unrolled layers: a ~100k-instruction module
    "llama-7b-200L-unrolled": ("fixtures/zoo/llama.py:large",
                               {"variant": "7b", "scan_layers": False, "n_layers": 200}, False),
    "sharded-7b": ("fixtures/zoo/sharded.py:large", {"variant": "7b"}, True),
    "sharded-70b": ("fixtures/zoo/sharded.py:large", {"variant": "70b"}, True),
}
DEFAULT_DEVICE = "tpu-v5p"
LOCK = "/tmp/hloopt-tpu.flock"


class Clock:
    """CPU and wall seconds of one stage."""

    def __init__(self) -> None:
        self.cpu_s = self.wall_s = 0.0

    def __enter__(self) -> Clock:
        self._c, self._w = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = time.process_time() - self._c
        self.wall_s = time.perf_counter() - self._w


# ---------------------------------------------------------------------------------------------
# 1. prepare: lower, name, XLA's parse, TPU compile (jax)
# ---------------------------------------------------------------------------------------------


def prepare(row: str, out: Path, *, tpu: str | None) -> dict[str, Any]:
    import fcntl

    import jax
    from jax._src.lib import xla_client as xc

    from hloopt import lowering
    from hloopt.hlo.parser import parse_module
    from hloopt.naming import name_residuals
    from hloopt.passes.residuals import find_residuals
    from hloopt.spmd import name_per_device
    from hloopt.targets import resolve

    spec, kw, per_device = ROWS[row]
    as_written = resolve(spec, factory_kwargs=kw)
    tgt = as_written.rebuild(policy=jax.checkpoint_policies.everything_saveable)
    res: dict[str, Any] = {"row": row, "target": spec, "kwargs": kw, "per_device": per_device}
    with Clock() as c:
        low = lowering.lower(tgt, platform="tpu", compile="cpu" if per_device else None,
                             partitioned=per_device)
    res["lower_s"], res["lower_wall_s"] = c.cpu_s, c.wall_s
    text = low.partitioned_text if per_device else low.hlo_text
    assert text is not None, f"{row}: XLA wrote no partitioned module"
    res["source"] = "partitioned:cpu" if per_device else "lowered:tpu"
    with Clock() as c:
        module = parse_module(text)
        if per_device:
            names = name_per_device(tgt, module, parse_module(low.hlo_text))
        else:
            probe = name_residuals(tgt, baseline=find_residuals(module), platform="tpu")
            names = {r.inst.name: r.name for r in probe.residuals if r.name}
    res["naming_s"], res["naming_wall_s"] = c.cpu_s, c.wall_s
    del module
    with Clock() as c:
        xla_module = xc.hlo.hlo_module_from_text(text)
    res["xla_parse_s"] = c.cpu_s
    del xla_module
    (out / f"{row}.hlo").write_text(text)
    (out / f"{row}.names.json").write_text(json.dumps(names))
    if tpu:
        # libtpu is initialised by the topology query already: the lock covers all of it. A
        # process that uses libtpu without the flock makes the query fail: wait and retry.
        from hloopt.errors import UserError

        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for attempt in range(30):
                try:
                    topology, devices = lowering._tpu_devices(
                        tpu, lowering._mesh_size(as_written.args, dict(as_written.kwargs)))
                    break
                except UserError:
                    if attempt == 29:
                        raise
                    time.sleep(10)
            step = lowering._jit(as_written.step_fn, ())
            args, kwargs = lowering._place((as_written.args, dict(as_written.kwargs)), devices, tpu)
            lowered = step.trace(*args, **kwargs).lower()
            with Clock() as c:
                try:
                    compiled = lowered.compile()
                    res["tpu_peak_bytes"] = int(compiled.memory_analysis().peak_memory_in_bytes)
                    res["tpu_status"] = "ok"
                except jax.errors.JaxRuntimeError as err:
                    first = str(err).splitlines()[0]
                    res["tpu_status"] = "OOM" if "RESOURCE_EXHAUSTED" in first else first[:120]
        res["tpu_compile_s"], res["tpu_compile_wall_s"], res["tpu_topology"] = c.cpu_s, c.wall_s, topology
    return res


# ---------------------------------------------------------------------------------------------
# 2. plan: our stages and the whole pipeline, from the text (no jax)
# ---------------------------------------------------------------------------------------------


def plan_from_text(text: str, names: dict[str, str], profile: Any, *, source: str,
                   max_slowdown: float, clock: dict[str, float]) -> Any:
    """``hloopt plan`` from a module's text: what :func:`hloopt.pipeline.plan` runs after lowering."""
    from hloopt.hlo.parser import parse_module
    from hloopt.pipeline import analyze_module, build_problem, make_plan, run_anchors
    from hloopt.problem import Decisions
    from hloopt.search import search
    from hloopt.simulator import simulate

    module = parse_module(text)
    an = analyze_module(module, profile, source=source, names=names)
    problem, _ = build_problem(an, profile)
    baseline = simulate(problem, Decisions.all_device())
    with Clock() as c:
        sr = search(problem, max_slowdown=max_slowdown)
    clock["search_s"], clock["search_wall_s"] = c.cpu_s, c.wall_s
    result = simulate(problem, sr.plan.decisions)
    plan = make_plan("bench", an, problem, profile, budget_spec=None, budget_bytes=None, mode="max-slowdown",
                     decisions=sr.plan.decisions, result=result, baseline=baseline,
                     solver={"name": sr.plan.solver, "status": sr.plan.status or ""})
    run_anchors(problem)
    clock["candidates"] = len(problem.candidates)
    clock["steps"] = len(problem.steps)
    clock["baseline_peak_bytes"] = baseline.peak_bytes
    clock["planned_peak_bytes"] = result.peak_bytes
    clock["offloaded"] = sum(1 for d in plan.decisions if d.action == "offload")
    clock["remat"] = sum(1 for d in plan.decisions if d.action == "remat")
    return plan


def plan_stages(row: str, out: Path, *, device: str, max_slowdown: float) -> dict[str, Any]:
    from hloopt.analysis import profile_module
    from hloopt.devices import load_profile
    from hloopt.hlo.parser import parse_module
    from hloopt.passes import AnalysisManager
    from hloopt.passes.cost import CostAnalysis
    from hloopt.passes.residuals import find_residuals

    text = (out / f"{row}.hlo").read_text()
    names = json.loads((out / f"{row}.names.json").read_text())
    prep = json.loads((out / f"{row}.prepare.json").read_text())
    profile = load_profile(device)
    res: dict[str, Any] = {"mb": len(text.encode()) / 1e6}
    with Clock() as c:
        module = parse_module(text)
    res["parse_s"], res["instructions"] = c.cpu_s, module.num_instructions
    am = AnalysisManager(module)
    with Clock() as c:
        prof, _ = profile_module(module, platform="tpu", am=am)
    res["analyze_s"], res["analyzed_peak_bytes"] = c.cpu_s, prof.peak_bytes
    with Clock() as c:
        rs = find_residuals(module)
    res["residuals_s"], res["residuals"] = c.cpu_s, len(rs)
    with Clock() as c:
        CostAnalysis(profile=profile).run(module, am)
    res["cost_s"] = c.cpu_s
    del module, am, prof, rs
    gc.collect()  # not timed: a fresh `hloopt plan` process starts without these stages' garbage
    clock: dict[str, float] = {}
    with Clock() as c:
        plan_from_text(text, names, profile, source=prep["source"], max_slowdown=max_slowdown, clock=clock)
    res["plan_s"], res["plan_wall_s"] = c.cpu_s, c.wall_s
    res.update(clock)
    res["jax_imported"] = "jax" in sys.modules
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def _worker(stage: str, row: str, out: Path, opts: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", stage, "--out", str(out), "--device", opts.device,
           "--max-slowdown", str(opts.max_slowdown), "--rows", row]
    if opts.no_tpu:
        cmd.append("--no-tpu")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{row} {stage} failed:\n{proc.stderr[-3000:]}")
    res = json.loads((out / f"{row}.{stage}.json").read_text())
    res[f"{stage}_process_wall_s"] = time.perf_counter() - t0
    return res


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f}" if x < 10 else f"{x:.1f}")


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ["step", "instructions", "MB", "parse s", "XLA parse s", "parse/XLA", "analyze s", "residuals s",
            "cost s", "search s", "plan s", "TPU compile s", "plan/TPU", "plan wall s", "peak RSS GiB",
            "peak GiB (all saved -> planned)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tpu = r.get("tpu_compile_s")
        tpu_txt = "-" if tpu is None else _fmt_s(tpu) + (" (OOM)" if r.get("tpu_status") == "OOM" else "")
        ratio_tpu = "-" if not tpu else f"{r['plan_s'] / tpu:.2f}"
        name = r["row"] + (" (per device)" if r["per_device"] else "")
        lines.append("| " + " | ".join([
            name, f"{r['instructions']:,}", f"{r['mb']:.1f}", _fmt_s(r["parse_s"]), _fmt_s(r["xla_parse_s"]),
            f"{r['parse_s'] / r['xla_parse_s']:.2f}" if r["xla_parse_s"] else "-",
            _fmt_s(r["analyze_s"]), _fmt_s(r["residuals_s"]), _fmt_s(r["cost_s"]), _fmt_s(r["search_s"]),
            _fmt_s(r["plan_s"]), tpu_txt, ratio_tpu, _fmt_s(r["plan_wall_s"]), _gib(r["peak_rss_bytes"]),
            f"{_gib(r['baseline_peak_bytes'])} -> {_gib(r['planned_peak_bytes'])}",
        ]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--device", default=DEFAULT_DEVICE, help="profile to plan for and TPU to compile on")
    ap.add_argument("--max-slowdown", type=float, default=0.05)
    ap.add_argument("--no-tpu", action="store_true", help="skip the libtpu compiles")
    ap.add_argument("--out", default=None, help="folder for the lowered texts and JSON (default: a temp dir)")
    ap.add_argument("--markdown", action="store_true", help="print only the Markdown table")
    ap.add_argument("--reuse", action="store_true", help="take rows already measured in --out as they are")
    ap.add_argument("--json", default=None, help="also write all measurements here")
    ap.add_argument("--worker", choices=["prepare", "plan"], help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)

    if opts.worker:
        out = Path(opts.out)
        row = opts.rows[0]
        if opts.worker == "prepare":
            import hloopt.lowering  # noqa: F401  (XLA_FLAGS before jax starts)

            res = prepare(row, out, tpu=None if opts.no_tpu else opts.device)
        else:
            res = plan_stages(row, out, device=opts.device, max_slowdown=opts.max_slowdown)
        (out / f"{row}.{opts.worker}.json").write_text(json.dumps(res))
        return 0

    out = Path(opts.out) if opts.out else Path(tempfile.mkdtemp(prefix="hloopt-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in opts.rows:
        done = [out / f"{row}.{stage}.json" for stage in ("prepare", "plan")]
        if opts.reuse and all(f.exists() for f in done):
            res = {k: v for f in done for k, v in json.loads(f.read_text()).items()}
        else:
            res = _worker("prepare", row, out, opts)
            res.update(_worker("plan", row, out, opts))
        rows.append(res)
        if not opts.markdown:
            print(f"{row}: {res['instructions']:,} instructions, plan {res['plan_s']:.2f} s CPU "
                  f"({res['plan_wall_s']:.2f} s wall), peak RSS {_gib(res['peak_rss_bytes'])} GiB, "
                  f"lower {res['lower_wall_s']:.1f} s wall, naming {res['naming_wall_s']:.1f} s wall, "
                  f"TPU {res.get('tpu_status', '-')} {_fmt_s(res.get('tpu_compile_s'))} s", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
