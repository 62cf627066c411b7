"""Our plan against every anchor (JAX built-in policies, MaxText presets) on the zoo models.

Run: python bench/anchors.py [--models mlp,convnet,gpt2,llama,sharded] [--sizes tiny,small]
                             [--devices tpu-v5e,h100-sxm] [--cache DIR] [--markdown]

For each model, size and device profile the pipeline builds the Problem (lowered with
``everything_saveable``, residuals named by re-lowering, see :mod:`hloopt.pipeline`), replays
every expressible anchor (:func:`hloopt.pipeline.run_anchors`), and plans with
:func:`hloopt.search.search` at

* each anchor's own peak as the budget: our step time must be <= the anchor's;
* 75% of the way from the least peak to the all-device peak.

Each row shows the anchor's peak and step time, and our plan's at the same budget; ``dominated``
marks a row where the anchor has both a lower peak and a lower step time than our plan (it should
never appear). ``--cache DIR`` pickles the Problems (lowering and naming take most of the time).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from dataclasses import dataclass

from hloopt.problem import Decisions, Problem
from hloopt.units import format_bytes, format_seconds

MODELS = ("mlp", "convnet", "gpt2", "llama", "sharded")
#: Relative slack when comparing modeled step times (float rounding of long sums).
TIME_TOL = 1e-9


def build(model: str, size: str, device: str) -> Problem:
    """The Problem the pipeline builds for ``fixtures/zoo/<model>.py:make`` at ``size`` on ``device``."""
    from hloopt import pipeline
    from hloopt.devices import load_profile
    from hloopt.targets import resolve

    prof = load_profile(device)
    tgt = resolve(f"fixtures/zoo/{model}.py", size=size)
    module, source = pipeline.lower_for_plan(tgt, prof)
    names = pipeline._names_for(tgt, module, prof, platform=None)
    an = pipeline.analyze_module(module, prof, source=source, names=names)
    problem, _ = pipeline.build_problem(an, prof)
    return problem


def cached_problem(model: str, size: str, device: str, cache: str | None) -> Problem:
    if cache is None:
        return build(model, size, device)
    path = os.path.join(cache, f"{model}.{size}.{device}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    problem = build(model, size, device)
    os.makedirs(cache, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(problem, f)
    return problem


@dataclass(frozen=True)
class Row:
    policy: str
    budget_bytes: int
    #: the anchor's replay (None for the 75% row)
    anchor_peak_bytes: int | None
    anchor_time_s: float | None
    plan_peak_bytes: int
    plan_time_s: float
    solver: str
    #: the anchors that have both a lower peak and a lower step time than our plan
    dominated_by: tuple[str, ...] = ()

    @property
    def dominated(self) -> bool:
        return bool(self.dominated_by)

    @property
    def slower(self) -> bool:
        """Our plan is slower than the anchor at the anchor's own peak (the requirement fails)."""
        return self.anchor_time_s is not None and self.plan_time_s > self.anchor_time_s * (1 + TIME_TOL)


def compare(problem: Problem, *, time_limit_s: float = 30.0) -> tuple[list[Row], dict]:
    """Rows for every expressible anchor plus the 75% budget (see the module docstring)."""
    from hloopt.pipeline import run_anchors
    from hloopt.search import search
    from hloopt.simulator import lower_bound_peak, simulate

    base = simulate(problem, Decisions.all_device())
    floor = lower_bound_peak(problem)
    anchors = run_anchors(problem)

    def beaten_by(peak: int, time_s: float) -> tuple[str, ...]:
        return tuple(a.name for a in anchors
                     if a.peak_bytes < peak and a.step_time_s < time_s * (1 - TIME_TOL))

    rows: list[Row] = []
    for a in anchors:
        sr = search(problem, budget_bytes=max(a.peak_bytes, floor), time_limit_s=time_limit_s)
        rows.append(Row(a.name, a.peak_bytes, a.peak_bytes, a.step_time_s,
                        sr.plan.peak_bytes, sr.plan.step_time_s, sr.plan.solver,
                        beaten_by(sr.plan.peak_bytes, sr.plan.step_time_s)))
    budget = int(floor + 0.75 * (base.peak_bytes - floor))
    sr = search(problem, budget_bytes=budget, time_limit_s=time_limit_s)
    rows.append(Row("(75% floor->peak)", budget, None, None, sr.plan.peak_bytes, sr.plan.step_time_s,
                    sr.plan.solver, beaten_by(sr.plan.peak_bytes, sr.plan.step_time_s)))
    info = {"baseline_peak_bytes": base.peak_bytes, "baseline_time_s": base.step_time_s,
            "floor_bytes": floor, "candidates": len(problem.candidates)}
    return rows, info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--devices", default="tpu-v5e,h100-sxm")
    ap.add_argument("--cache", default=None, help="folder to pickle the Problems in")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()
    bad = 0
    if args.markdown:
        print("| model | size | device | policy | anchor peak | anchor step | our peak | our step | Δ step |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        for size in args.sizes.split(","):
            for device in args.devices.split(","):
                t0 = time.perf_counter()
                problem = cached_problem(model, size, device, args.cache)
                t1 = time.perf_counter()
                rows, info = compare(problem, time_limit_s=args.time_limit)
                t2 = time.perf_counter()
                if not args.markdown:
                    print(f"\n{model} {size} {device}: {info['candidates']} candidates, all-device "
                          f"{format_bytes(info['baseline_peak_bytes'])} {format_seconds(info['baseline_time_s'])}, "
                          f"least peak {format_bytes(info['floor_bytes'])} (build {t1 - t0:.1f} s, "
                          f"search {t2 - t1:.1f} s)", flush=True)
                for r in rows:
                    flag = (f"DOMINATED by {','.join(r.dominated_by)}" if r.dominated
                            else ("slower" if r.slower else ""))
                    bad += bool(flag)
                    ap_ = "-" if r.anchor_peak_bytes is None else format_bytes(r.anchor_peak_bytes)
                    at_ = "-" if r.anchor_time_s is None else format_seconds(r.anchor_time_s)
                    d = "" if r.anchor_time_s is None else f"{100 * (r.plan_time_s / r.anchor_time_s - 1):+.1f}%"
                    if args.markdown:
                        print(f"| {model} | {size} | {device} | {r.policy} | {ap_} | {at_} | "
                              f"{format_bytes(r.plan_peak_bytes)} | {format_seconds(r.plan_time_s)} | {d} {flag} |",
                              flush=True)
                    else:
                        print(f"  {r.policy:<34} {ap_:>10} {at_:>10}   ours {format_bytes(r.plan_peak_bytes):>10} "
                              f"{format_seconds(r.plan_time_s):>10} {d:>7} {r.solver:<10} {flag}", flush=True)
    print(f"\n{bad} row(s) where an anchor beats our plan", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
