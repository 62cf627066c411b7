"""The search's objective (hloopt.pipeline.for_objective): the step time, transfers timed at the
link's rates, or the fewest recomputed FLOPs, transfers counted as hidden. Hand-built problems
whose answers are worked out by hand."""

from __future__ import annotations

import pytest

from hloopt.errors import UserError
from hloopt.pipeline import for_objective
from hloopt.problem import Action, Candidate, Decisions, Instance, Problem, Step
from hloopt.search import search
from hloopt.simulator import simulate

GB = 10**9


def _one_residual(remat_s: float, remat_flops: float = 4e9) -> Problem:
    """Eight steps and one 1 GB residual produced by step 0, read by step 1 and again by step 7.
    The other bytes are 1 GB at steps 3-5 and 0.5 GB elsewhere, so kept on device the residual
    takes the step to 2 GB there. The link moves 10 GB/s each way: a copy takes 100 ms. Step 2
    runs 150 ms (the copy out is done inside it); every other step 1 ms, and a reload may start
    at most one step before its read (``prefetch_window_steps``): it starts with step 6 and
    step 7 waits ~99 ms for it. Recomputing the residual costs ``remat_s`` and re-runs
    ``remat_flops``."""
    durations = [1e-3, 1e-3, 0.15, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]
    steps = tuple(Step(duration_s=d, base_bytes=GB if i in (3, 4, 5) else GB // 2, label=f"s{i}",
                       backward=i >= 4) for i, d in enumerate(durations))
    res = Candidate(key="name:h", name="h", selector="checkpoint_name 'h'",
                    instances=(Instance(bytes=GB, produced=0, last_forward_use=1, first_backward_use=7, last_use=7),),
                    allowed=frozenset({Action.DEVICE, Action.OFFLOAD, Action.REMAT}), remat_s=remat_s,
                    remat_flops=remat_flops)
    return Problem(steps=steps, candidates=(res,), d2h_bytes_per_s=10 * GB, h2d_bytes_per_s=10 * GB,
                   duplex_d2h_bytes_per_s=10 * GB, duplex_h2d_bytes_per_s=10 * GB, transfer_latency_s=0.0,
                   prefetch_window_steps=1)


def test_time_recomputes_what_the_link_cannot_hide_and_flops_moves_it() -> None:
    """At a 1.5 GB budget the residual cannot stay on device. Recomputing it costs 2 ms; moving
    it costs no FLOPs but step 7 waits ~99 ms for its reload. By time the search recomputes; by
    FLOPs it offloads, within the same budget counted with the link's rates, and the step it
    predicts includes the wait."""
    problem = _one_residual(remat_s=2e-3)
    budget = GB + GB // 2
    compute = sum(s.duration_s for s in problem.steps)
    assert simulate(problem, Decisions.all_device()).peak_bytes == 2 * GB
    by_time = search(problem, budget_bytes=budget).plan
    assert by_time.decisions.action("name:h") == Action.REMAT
    assert by_time.step_time_s == pytest.approx(compute + 2e-3)
    flops_problem = for_objective(problem, "flops")
    by_flops = search(flops_problem, budget_bytes=budget).plan
    assert by_flops.decisions.action("name:h") == Action.OFFLOAD
    assert by_flops.sim.objective_s == pytest.approx(compute)  # no FLOPs added, the wait not weighed
    timed = simulate(problem, by_flops.decisions)
    assert timed.peak_bytes <= budget and by_flops.peak_bytes == timed.peak_bytes
    assert timed.step_time_s == pytest.approx(by_flops.step_time_s) == pytest.approx(compute + 0.099, rel=1e-3)


def test_flops_counts_recomputation_by_its_flops_not_the_roofline() -> None:
    """The roofline can call a recomputation cheaper than keeping the value (``remat_s`` < 0: a
    scanned value's stack writes and reads cost more than re-running a matmul), which the time
    objective takes with no memory pressure at all. Counted by FLOPs, recomputing 4 GFLOP costs
    4 ms at a 1 TFLOP/s peak and keeping costs nothing: the flops objective keeps it."""
    problem = _one_residual(remat_s=-1e-4)
    by_time = search(problem, budget_bytes=4 * GB).plan
    assert by_time.decisions.action("name:h") == Action.REMAT
    flops = for_objective(problem, "flops")
    assert flops.candidates[0].remat_s == pytest.approx(4e9 / 1e12) and flops.candidates[0].keep_s == 0.0
    by_flops = search(flops, budget_bytes=4 * GB).plan
    assert by_flops.decisions.action("name:h") != Action.REMAT


def test_time_is_the_problem_as_built_and_flops_is_noted() -> None:
    problem = _one_residual(remat_s=2e-3)
    assert for_objective(problem, "time") is problem
    flops = for_objective(problem, "flops")
    assert flops.notes["objective"] == "flops" and flops.stall_weight == 0.0
    assert flops.d2h_bytes_per_s == problem.d2h_bytes_per_s  # memory counted at the link's rates
    assert simulate(flops, Decisions.all_device()).step_time_s == simulate(problem, Decisions.all_device()).step_time_s
    with pytest.raises(UserError, match="unknown objective 'speed'"):
        for_objective(problem, "speed")
