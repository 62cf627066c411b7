"""search(): modes, floors and the pareto front, every plan judged by the simulator."""

from __future__ import annotations

import pytest

from hloopt.errors import InfeasibleBudget, UserError
from hloopt.search import search
from hloopt.simulator import lower_bound_peak, simulate
from hloopt.solvers.synthetic import transformer_problem


@pytest.fixture(scope="module")
def problem():
    return transformer_problem(6, link_load=1.2, seed=1)


def test_budget_below_floor_names_the_floor(problem):
    floor = lower_bound_peak(problem)
    with pytest.raises(InfeasibleBudget) as e:
        search(problem, budget_bytes=floor - 1)
    msg = str(e.value)
    assert "below the least peak any policy reaches" in msg and "needs at least" in msg
    assert "\n" not in msg


def test_fit_budget_replays_within(problem):
    floor = lower_bound_peak(problem)
    base = simulate(problem, __import__("hloopt.problem").problem.Decisions.all_device())
    budget = (floor + base.peak_bytes) // 2
    r = search(problem, budget_bytes=budget, solver="milp", time_limit_s=20)
    again = simulate(problem, r.plan.decisions)
    assert again.peak_bytes == r.plan.peak_bytes <= budget
    assert again.step_time_s == pytest.approx(r.plan.step_time_s)
    assert r.plan.step_time_s >= r.least_time_s - 1e-12


def test_max_slowdown_zero_keeps_time(problem):
    r = search(problem, max_slowdown=0.0, solver="heuristic")
    assert r.plan.step_time_s <= r.baseline.step_time_s * (1 + 1e-9)
    assert r.plan.peak_bytes < r.baseline.peak_bytes  # free offloads exist in this problem


def test_pareto_front_is_non_dominated_and_has_both_ends(problem):
    r = search(problem, pareto=True, solver="heuristic")
    pts = [(p.peak_bytes, p.step_time_s) for p in r.pareto]
    for i, a in enumerate(pts):
        for j, b in enumerate(pts):
            if i != j:
                assert not (b[0] <= a[0] and b[1] <= a[1]), (a, b)
    for p in r.pareto:
        assert simulate(problem, p.decisions).peak_bytes == p.peak_bytes
    # Fastest end: baseline step time; least-peak end: the least-peak plan's peak.
    assert min(t for _, t in pts) == pytest.approx(r.baseline.step_time_s)
    lp = [p for p in r.pareto if p.solver == "least-peak"]
    assert min(b for b, _ in pts) <= (lp[0].peak_bytes if lp else min(b for b, _ in pts))


def test_modes_are_exclusive(problem):
    with pytest.raises(UserError):
        search(problem)
    with pytest.raises(UserError):
        search(problem, budget_bytes=1, pareto=True)
    with pytest.raises(UserError):
        search(problem, pareto=True, solver="cplex")
