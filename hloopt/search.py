"""The search: which candidates to offload or rematerialize so the step fits at least step time.

``search(problem, budget_bytes=...)`` fits a budget (least modeled step time with peak <= budget);
``max_slowdown=x`` gives the least peak with step time <= (1 + x) * baseline (bisection on the
budget over the fit mode); ``pareto=True`` the non-dominated (peak, step time) points between
the all-device plan and the least-peak plan. Solvers: "milp" (exact model, HiGHS, time limit),
"heuristic" (greedy, fast), "auto" (heuristic, then the MILP seeded with it when the Problem
has at most ``_AUTO_MILP_MAX`` candidates). Every plan returned was replayed by
:func:`hloopt.simulator.simulate`; an infeasible answer raises, it is never a result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from hloopt.errors import InfeasibleBudget, UserError
from hloopt.problem import Decisions, Problem, SimResult
from hloopt.simulator import simulate
from hloopt.solvers._model import Model
from hloopt.solvers.bounds import check_budget, least_peak_bytes, least_time_s
from hloopt.solvers.heuristic import HeuristicFailed, least_peak_choice, solve_heuristic
from hloopt.solvers.milp import solve_milp
from hloopt.units import format_bytes

__all__ = ["Plan", "SearchResult", "search"]

_AUTO_MILP_MAX = 1000


@dataclass(frozen=True)
class Plan:
    """One replayed plan."""

    decisions: Decisions
    sim: SimResult
    #: Which solver produced it ("heuristic", "milp", "milp+repair", "incumbent", "all-device", "least-peak").
    solver: str
    #: HiGHS status and gap when the MILP ran on it.
    status: str = ""
    mip_gap: float = math.nan
    optimal: bool = False

    @property
    def peak_bytes(self) -> int:
        return self.sim.peak_bytes

    @property
    def step_time_s(self) -> float:
        return self.sim.step_time_s


@dataclass(frozen=True)
class SearchResult:
    #: The answer (for pareto: the fastest point; for max_slowdown: the least peak within it).
    plan: Plan
    baseline: SimResult
    least_peak_bytes: int
    #: Least step time any plan reaches: at a budget, compute time plus the LP relaxation's
    #: optimum (:func:`hloopt.solvers.bounds.least_time_s`); else compute time.
    least_time_s: float
    budget_bytes: int | None
    pareto: tuple[Plan, ...] = ()
    solve_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)


def _fit(problem: Problem, m: Model, budget: int, solver: str, time_limit_s: float) -> Plan:
    plan = _solve(problem, m, budget, solver, time_limit_s)
    return _best_of_anchors(problem, budget, plan)


def _best_of_anchors(problem: Problem, budget: int, plan: Plan | None) -> Plan:
    """The built-in JAX policies and MaxText presets are plans too: when one replays within the
    budget faster than the solver's answer (the MILP's time model is an approximation, the
    heuristic is not exact), it is the answer. So no anchor is ever better at its own peak."""
    from hloopt.anchors import ANCHORS

    best = plan
    for anchor in ANCHORS:
        d = anchor.decisions(problem)
        sim = simulate(problem, d)
        if sim.peak_bytes <= budget and (best is None or sim.objective_s < best.sim.objective_s
                                         or (sim.objective_s == best.sim.objective_s
                                             and sim.peak_bytes < best.peak_bytes)):
            best = Plan(d, sim, f"anchor:{anchor.name}", optimal=False)
    if best is None:
        raise InfeasibleBudget(
            f"no plan found that replays within budget {format_bytes(budget)} "
            f"(least peak with an ideal link: {format_bytes(least_peak_bytes(problem))})")
    return best


def _solve(problem: Problem, m: Model, budget: int, solver: str, time_limit_s: float) -> Plan | None:
    base = simulate(problem, Decisions.all_device())
    if base.peak_bytes <= budget:
        return Plan(Decisions.all_device(), base, "all-device", optimal=True)
    heur = None
    try:
        heur = solve_heuristic(problem, budget_bytes=budget, model=m)
    except HeuristicFailed:
        heur = None
    use_milp = solver == "milp" or (solver == "auto" and m.n_cands <= _AUTO_MILP_MAX)
    if use_milp:
        try:
            r = solve_milp(problem, budget_bytes=budget, time_limit_s=time_limit_s, model=m,
                           incumbent=None if heur is None else heur.choice)
            return Plan(r.decisions, r.sim, r.source if r.source in ("milp", "milp+repair") else "heuristic",
                        r.status, r.mip_gap, r.optimal)
        except RuntimeError:
            pass
    if heur is not None:
        return Plan(heur.decisions, heur.sim, "heuristic")
    return None


def search(
    problem: Problem,
    *,
    budget_bytes: int | None = None,
    max_slowdown: float | None = None,
    pareto: bool = False,
    solver: str = "auto",
    time_limit_s: float = 10.0,
    pareto_points: int = 8,
) -> SearchResult:
    """Find the plan (see the module docstring). Exactly one mode: budget, slowdown or pareto."""
    t0 = time.perf_counter()
    if solver not in ("auto", "milp", "heuristic"):
        raise UserError(f"unknown solver {solver!r}; expected auto, milp or heuristic")
    modes = (budget_bytes is not None) + (max_slowdown is not None) + bool(pareto)
    if modes != 1:
        raise UserError("give exactly one of a budget, a maximum slowdown, or pareto")
    m = Model.build(problem)
    base = simulate(problem, Decisions.all_device())
    floor = least_peak_bytes(problem)
    tmin = least_time_s(problem)

    if budget_bytes is not None:
        check_budget(problem, budget_bytes)
        plan = _fit(problem, m, budget_bytes, solver, time_limit_s)
        tmin = least_time_s(problem, budget_bytes=budget_bytes, model=m)
        return SearchResult(plan, base, floor, tmin, budget_bytes, solve_s=time.perf_counter() - t0)

    # The least-peak end: every candidate off device as far as it goes.
    lp_choice = least_peak_choice(m)
    lp_sim = simulate(problem, m.decisions_of(lp_choice))
    lo_end = Plan(m.decisions_of(lp_choice), lp_sim, "least-peak")

    if max_slowdown is not None:
        if not (max_slowdown >= 0 and math.isfinite(max_slowdown)):
            raise UserError(f"max slowdown {max_slowdown!r} must be a finite fraction >= 0")
        limit = (1 + max_slowdown) * base.step_time_s * (1 + 1e-12)
        best = Plan(Decisions.all_device(), base, "all-device", optimal=True)
        if lp_sim.step_time_s <= limit and lp_sim.peak_bytes < best.peak_bytes:
            best = lo_end
        lo, hi = max(floor, lp_sim.peak_bytes if lp_sim.step_time_s <= limit else floor), best.peak_bytes
        lo = floor
        for _ in range(20):
            if hi - lo <= max(1, hi // 1000):
                break
            mid = (lo + hi) // 2
            try:
                # The whole bisection stays within time_limit_s: probes after it use the heuristic.
                left = t0 + time_limit_s - time.perf_counter()
                plan = _fit(problem, m, mid, solver if left > 0.5 else "heuristic",
                            max(0.1, min(time_limit_s / 4, left)))
            except InfeasibleBudget:
                lo = mid + 1
                continue
            if plan.step_time_s <= limit:
                if plan.peak_bytes < best.peak_bytes:
                    best = plan
                hi = min(mid, plan.peak_bytes)
            else:
                lo = mid + 1
        return SearchResult(best, base, floor, tmin, None, solve_s=time.perf_counter() - t0)

    # Pareto: budgets spread between the least-peak end and the baseline.
    points = [Plan(Decisions.all_device(), base, "all-device", optimal=True), lo_end]
    top = base.peak_bytes
    bottom = min(lp_sim.peak_bytes, top)
    for k in range(1, pareto_points + 1):
        budget = int(bottom + (top - bottom) * k / (pareto_points + 1))
        try:
            points.append(_fit(problem, m, budget, solver, time_limit_s / pareto_points))
        except InfeasibleBudget:
            continue
    front = _non_dominated(points)
    fastest = min(front, key=lambda p: (p.step_time_s, p.peak_bytes))
    return SearchResult(fastest, base, floor, tmin, None, pareto=tuple(front),
                        solve_s=time.perf_counter() - t0)


def _non_dominated(points: list[Plan]) -> list[Plan]:
    pts = sorted(points, key=lambda p: (p.peak_bytes, p.step_time_s))
    front: list[Plan] = []
    for p in pts:
        if front and p.step_time_s >= front[-1].step_time_s - 1e-15:
            continue
        front.append(p)
    return front
