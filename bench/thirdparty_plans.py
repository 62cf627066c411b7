"""Plans on third-party steps, proven by libtpu, side by side with every built-in policy.

For each step of ``fixtures/thirdparty/`` (and the zoo, with ``--zoo``) and each budget: ``hloopt
plan`` (the library's code as written; hloopt imposes the policies), the plan applied with
``hloopt.use_plan`` and compiled by libtpu for v5e, and every JAX built-in policy and MaxText
preset compiled the same way. Printed: the plan's predicted and compiled peak, whether it is
within the budget, whether the offloaded set is the planned one (``hloopt.verify``), its FLOPs
(``cost_analysis()``), and the cheapest built-in policy that fits the budget on libtpu.

    python bench/thirdparty_plans.py [--size tiny] [--steps levanter_llama,hf_bert] [--objective flops]

``--objective flops`` plans the fewest recomputed FLOPs that fit (``hloopt plan --objective``).

A budget is written as hloopt plan takes it (``95%``) or ``mid``: halfway between the least peak
any policy reaches and the all-saved peak (both from the plan's own bounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hloopt.lowering  # noqa: E402,F401  (before jax)

STEPS = ("levanter_llama", "levanter_gpt2", "hf_bert", "hf_whisper", "hf_gpt2", "hf_resnet")


@dataclasses.dataclass
class Row:
    step: str
    budget: str
    budget_bytes: int
    predicted_peak: int
    compiled_peak: int
    offloads_as_planned: bool
    problems: tuple[str, ...]
    plan_flops: float
    #: (policy, compiled peak, flops) of each built-in policy / preset
    anchors: list[tuple[str, int | None, float | None]]
    seconds: float

    @property
    def error(self) -> float:
        return (self.predicted_peak - self.compiled_peak) / self.compiled_peak

    @property
    def cheapest_fitting(self) -> tuple[str, float] | None:
        fits = [(f, n) for n, p, f in self.anchors if p is not None and f is not None and p <= self.budget_bytes]
        return (min(fits)[1], min(fits)[0]) if fits else None


def target_of(step: str, size: str) -> Any:
    from hloopt.targets import resolve

    path = f"fixtures/thirdparty/{step}.py:make" if not step.startswith("zoo:") else \
        f"fixtures/zoo/{step[4:]}.py:make"
    return resolve(path, size=size)


def evaluate(step: str, size: str, budget: str, *, anchors: bool = True, objective: str = "time") -> Row:
    """Plan ``step`` at ``budget``, apply and compile the plan and (with ``anchors``) each built-in
    policy with libtpu for v5e."""
    from hloopt import pipeline
    from hloopt.anchors import ANCHORS, policy_object
    from hloopt.devices import load_profile
    from hloopt.emit import policy
    from hloopt.lowering import lower
    from hloopt.verify import verify

    t0 = time.perf_counter()
    target = target_of(step, size)
    profile = load_profile("tpu-v5e")
    spec = budget
    if budget == "mid":
        probe = pipeline.plan(target, profile=profile, max_slowdown=0.0, solver="heuristic")
        b = probe.plan.bounds.least_peak_bytes
        spec = str(int(b + 0.5 * (probe.plan.predicted.baseline_peak_bytes - b)))
    outcome = pipeline.plan(target, profile=profile, budget=spec, objective=objective)
    plan = outcome.plan
    v = verify(target, plan, compile="tpu-v5e")
    mem = dict(v.memory or {})
    flops = _flops(lower(target, platform="tpu", policy=policy(plan), compile="tpu-v5e"))
    rows: list[tuple[str, int | None, float | None]] = []
    if anchors:
        names = frozenset(d.name for d in plan.decisions if d.name)
        for a in ANCHORS:
            try:
                low = lower(target, platform="tpu", policy=policy_object(a, names), compile="tpu-v5e")
                rows.append((f"{a.kind}: {a.name}", int((low.memory or {})["peak_memory_in_bytes"]), _flops(low)))
            except Exception as err:  # over HBM, or a preset that does not apply: no row figures
                rows.append((f"{a.kind}: {a.name} ({type(err).__name__})", None, None))
    return Row(step=step, budget=budget, budget_bytes=plan.budget.bytes, predicted_peak=plan.predicted.peak_bytes,
               compiled_peak=int(mem["peak_memory_in_bytes"]),
               offloads_as_planned=all(c.status == "ok" for c in v.checks) and not v.unplanned,
               problems=v.problems, plan_flops=flops, anchors=rows, seconds=time.perf_counter() - t0)


def _flops(low: Any) -> float:
    return float((low.cost or {}).get("flops", float("nan")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--budgets", default="95%,mid")
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--objective", choices=("time", "flops"), default="time")
    a = ap.parse_args()
    from hloopt.units import format_bytes

    print("| step | budget | predicted | libtpu | error | within | offloads as planned | plan GFLOP | "
          "cheapest built-in that fits (GFLOP) | s |")
    print("|---|---|---:|---:|---:|---|---|---:|---|---:|")
    for step in a.steps.split(","):
        for budget in a.budgets.split(","):
            try:
                importlib.import_module("transformers" if step.startswith("hf_") else "levanter") \
                    if not step.startswith("zoo:") else None
                r = evaluate(step, a.size, budget, anchors=not a.no_anchors, objective=a.objective)
            except Exception as err:
                print(f"| {step} | {budget} | {type(err).__name__}: {str(err).splitlines()[0][:120]} |")
                continue
            cheap = r.cheapest_fitting
            within = "yes" if r.compiled_peak <= r.budget_bytes else "NO"
            print(f"| {step} | {budget} = {format_bytes(r.budget_bytes)} | {format_bytes(r.predicted_peak)} | "
                  f"{format_bytes(r.compiled_peak)} | {r.error:+.1%} | {within} | "
                  f"{'yes' if r.offloads_as_planned else 'no'} | {r.plan_flops / 1e9:.3f} | "
                  f"{(cheap[0] + f' ({cheap[1] / 1e9:.3f})') if cheap else 'none fits'} | {r.seconds:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
