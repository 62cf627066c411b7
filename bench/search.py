"""Solve time vs number of candidates for both solvers on transformer-shaped Problems.

Run: python bench/search.py [--sizes 10,100,1000] [--milp-max 1000] [--time-limit 30] [--link-load 2.0]
Problems: hloopt.solvers.synthetic.transformer_problem(L) with 9 residuals per layer, one
Candidate per (layer, name), 20 forward + 40 backward steps per layer; budget halfway between
the least peak and the all-device peak. Step time is the simulator's replay of each plan.
The MILP runs alone (no heuristic start); its time includes building the model; ``gap`` is
HiGHS's last gap relative to the modeled step time; ``src`` says whose plan it returned ("milp",
or "milp+repair" when the heuristic completed a MILP plan the replay rejected).
"""

from __future__ import annotations

import argparse
import time

from hloopt.problem import Decisions
from hloopt.simulator import lower_bound_peak, simulate
from hloopt.solvers.heuristic import HeuristicFailed, solve_heuristic
from hloopt.solvers.milp import solve_milp
from hloopt.solvers.synthetic import transformer_problem


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,100,1000,10000,100000")
    ap.add_argument("--milp-max", type=int, default=1000)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--link-load", type=float, default=1.0)
    args = ap.parse_args()
    print(f"{'cands':>7} {'steps':>7} {'heur_s':>8} {'heur+%':>7} {'milp_s':>8} {'milp+%':>7} status")
    for n in [int(x) for x in args.sizes.split(",")]:
        layers = max(1, round(n / 9))
        p = transformer_problem(layers, link_load=args.link_load, seed=layers)
        base = simulate(p, Decisions.all_device())
        floor = lower_bound_peak(p)
        budget = (floor + base.peak_bytes) // 2
        t = time.perf_counter()
        try:
            h = solve_heuristic(p, budget_bytes=budget)
            hpct = f"{100 * (h.sim.step_time_s / base.step_time_s - 1):>7.2f}"
        except HeuristicFailed:
            hpct = f"{'infeas':>7}"
        ht = time.perf_counter() - t
        row = f"{len(p.candidates):>7} {len(p.steps):>7} {ht:>8.3f} {hpct}"
        if len(p.candidates) <= args.milp_max:
            t = time.perf_counter()
            try:
                r = solve_milp(p, budget_bytes=budget, time_limit_s=args.time_limit)
                mt = time.perf_counter() - t
                slower_pct = 100 * (r.sim.step_time_s / base.step_time_s - 1)
                row += f" {mt:>8.2f} {slower_pct:>7.2f} {r.status} gap={r.mip_gap:.3g} src={r.source}"
            except RuntimeError as e:
                row += f" {time.perf_counter() - t:>8.2f} {'infeas':>7} {e}"
        else:
            row += f" {'-':>8} {'-':>7} (not run)"
        print(row, flush=True)


if __name__ == "__main__":
    main()
