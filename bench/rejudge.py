"""A device campaign's measurements against today's predictions, on this machine.

``bench/device_campaign.py`` commits what it measured on a lent accelerator and the profile it
calibrated there (``bench/results/*/…results.json``). This re-predicts every measured policy of
one target with that calibrated profile and the current model -- each policy's step lowered and
judged (``hloopt.pipeline.judge_lowered``: the memory model's peak, the simulator's time with
every value the step moves to host memory) and, beside it, the planner's replay of the policy on
the all-saved step (for the plan: the prediction its plan file carries, from the model of that
run) -- and prints both errors against the medians measured. No device is needed::

    python bench/rejudge.py bench/results/2026-12-07-tpu-v5e-b/1-llama-80pct.results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> int:
    from hloopt.anchors import ANCHORS, expressible, policy_object
    from hloopt.devices import load_profile
    from hloopt.emit import load_plan
    from hloopt.emit import policy as plan_policy
    from hloopt.pipeline import analyze_target, judge_lowered
    from hloopt.simulator import simulate
    from hloopt.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a device_campaign results.json")
    ap.add_argument("--target", help="the target's key in it (default: its only one)")
    args = ap.parse_args(argv)
    try:
        data = json.loads(args.results.read_text())
        targets = data["targets"]
    except (OSError, ValueError, KeyError) as err:
        print(f"rejudge: {args.results}: not a device_campaign results file ({err})", file=sys.stderr)
        return 2
    key = args.target or (next(iter(targets)) if len(targets) == 1 else None)
    if key not in targets:
        print(f"rejudge: {args.results}: pass --target, one of {', '.join(sorted(targets))}", file=sys.stderr)
        return 2
    t = targets[key]
    runs = t.get("measure_after") or {}
    if "rows" not in runs or "calibrated_profile" not in t:
        print(f"rejudge: {args.results}: {key} has no calibrated measurement", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        prof_path = Path(tmp) / "calibrated.toml"
        prof_path.write_text(t["calibrated_profile"])
        profile = load_profile(str(prof_path))
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps(t["plan_after"]))
        plan = load_plan(plan_path)
    spec, _, size = key.partition("@")
    tgt = resolve(spec, size=size or None)
    _, problem = analyze_target(tgt, profile)
    names = frozenset(c.name for c in problem.candidates if c.name)
    policies = {"plan": (plan_policy(plan), plan.predicted.step_time_s)}
    for a in ANCHORS:
        if expressible(a, problem) and a.place is None:
            policies[a.name] = (policy_object(a, names), simulate(problem, a.decisions(problem)).step_time_s)
    measured = {r["name"]: r["measured"]["step_time_s"]["median"] for r in runs["rows"] if r.get("measured")}
    print(f"{key} on {data.get('versions', {}).get('device_kind', '?')}, profile {profile.name}")
    print(f"{'policy':34} {'measured':>10} {'judged':>10} {'error':>8} {'replayed':>10} {'error':>8} {'to host':>9}")
    for name, (pol, replayed) in policies.items():
        if name not in measured:
            continue
        j = judge_lowered(tgt, pol, profile)
        m = measured[name]
        print(f"{name:34} {m * 1e3:8.3f}ms {j.step_time_s * 1e3:8.3f}ms {j.step_time_s / m - 1:+8.1%} "
              f"{replayed * 1e3:8.3f}ms {replayed / m - 1:+8.1%} {j.host_bytes / 2**20:7.0f}Mi")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
