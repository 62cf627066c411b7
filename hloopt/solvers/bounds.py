"""Lower bounds: the least peak any policy reaches, and the least step time at a budget.

* Peak: the simulator's :func:`~hloopt.simulator.lower_bound_peak` (every movable residual off
  device between its last forward and first backward use, as with an ideal link).
* Time at a budget: compute time plus the LP relaxation of the MILP (:mod:`hloopt.solvers.milp`)
  when it is small enough to solve, else compute time alone (no policy beats running every
  step once with no stall: :func:`~hloopt.simulator.lower_bound_time`). The LP bound is a bound
  of the MILP's *model*, whose queue terms may under-count in-flight instances; it is reported
  as the model's bound, not as a proof about the simulator.

:func:`check_budget` raises :class:`~hloopt.errors.InfeasibleBudget` with the floor in words.
"""

from __future__ import annotations

from hloopt.errors import InfeasibleBudget
from hloopt.problem import Problem
from hloopt.simulator import lower_bound_peak, lower_bound_time
from hloopt.units import format_bytes

__all__ = ["check_budget", "least_peak_bytes", "least_time_s"]


def least_peak_bytes(problem: Problem) -> int:
    """Least peak any policy can reach (bytes)."""
    return lower_bound_peak(problem)


def least_time_s(problem: Problem) -> float:
    """Least step time any policy can reach (seconds): the compute time."""
    return lower_bound_time(problem)


def check_budget(problem: Problem, budget_bytes: int) -> int:
    """Return the least peak; raise InfeasibleBudget when ``budget_bytes`` is below it."""
    floor = least_peak_bytes(problem)
    if budget_bytes < floor:
        raise InfeasibleBudget(
            f"budget {format_bytes(budget_bytes)} is below the least peak any policy reaches: "
            f"needs at least {format_bytes(floor)}")
    return floor
