"""Solvers against hand-computed optima and each other; every plan replayed by the simulator."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hloopt.problem import Action, Candidate, Decisions, Instance, Problem, Step
from hloopt.simulator import lower_bound_peak, simulate
from hloopt.solvers._model import OFF, REM, Model
from hloopt.solvers.heuristic import HeuristicFailed, solve_heuristic
from hloopt.solvers.milp import solve_milp
from hloopt.solvers.synthetic import transformer_problem
from tests.tiers import ci_sample

MB = 1 << 20


def two_candidates() -> Problem:
    """10 steps of 1 ms; A (100 MB) offloads and hides; B (100 MB) only rematerializes (2 ms).

    Both live over steps 1..8. Base is 1 GB at steps 3..6, 100 MB less at 2 and 7, 200 MB less
    elsewhere. A's copies take 1 ms each, so A is off device exactly at steps 3..6 (its copy out
    ends with step 2, its copy back starts with step 7); B's remat frees it at steps 2..7.
    Budget 1 GB + 150 MB: steps 3..6 need one of them off: {A: offload}, 10 ms, by hand.
    Budget 1 GB + 50 MB: steps 2 and 7 need B too: {A: offload, B: remat}, 12 ms.
    """
    base = [(1 << 30) - d * MB for d in (200, 200, 100, 0, 0, 0, 0, 100, 200, 200)]
    steps = tuple(Step(1e-3, b) for b in base)
    inst = Instance(bytes=100 * MB, produced=1, last_forward_use=1, first_backward_use=8, last_use=8)
    a = Candidate("a", "a", "a", (inst,), frozenset({Action.DEVICE, Action.OFFLOAD}))
    b = Candidate("b", "b", "b", (inst,), frozenset({Action.DEVICE, Action.REMAT}), remat_s=2e-3)
    bw = 100 * MB / 1e-3  # 1 ms per copy: fits in the 6 ms gap
    return Problem(steps, (b, a), bw, bw, bw, bw, 0.0)


def test_model_matches_simulator_for_single_decisions():
    p = transformer_problem(3, link_load=0.7, seed=3)
    m = Model.build(p)
    for ci, c in enumerate(p.candidates):
        for col, act in ((OFF, Action.OFFLOAD), (REM, Action.REMAT)):
            if act not in c.allowed:
                continue
            ch = np.zeros(len(p.candidates), dtype=np.int64)
            ch[ci] = col
            sim = simulate(p, Decisions({c.key: act}))
            assert list(sim.timeline_bytes) == m.timeline(ch).tolist()
            assert sim.step_time_s == pytest.approx(m.step_time(ch), abs=1e-12)


@pytest.mark.parametrize("solve", ["heuristic", "milp"])
def test_hand_built_optimum(solve):
    p = two_candidates()
    budget = (1 << 30) + 150 * MB
    if solve == "heuristic":
        r = solve_heuristic(p, budget_bytes=budget)
    else:
        r = solve_milp(p, budget_bytes=budget)
        assert r.optimal and r.mip_gap == pytest.approx(0.0, abs=1e-9)
    assert dict(r.decisions.actions) == {"a": Action.OFFLOAD}
    assert r.sim.step_time_s == pytest.approx(10e-3)
    assert r.sim.peak_bytes == (1 << 30) + 100 * MB
    assert list(r.sim.timeline_bytes)[3:7] == [(1 << 30) + 100 * MB] * 4


def test_hand_built_needs_both():
    """A budget of 1 GB + 50 MB needs both off: the 2 ms remat is forced."""
    p = two_candidates()
    r = solve_milp(p, budget_bytes=(1 << 30) + 50 * MB)
    assert dict(r.decisions.actions) == {"a": Action.OFFLOAD, "b": Action.REMAT}
    assert r.sim.step_time_s == pytest.approx(12e-3)


def check_milp_vs_heuristic(layers, load, frac):
    p = transformer_problem(layers, link_load=load, seed=layers)
    base = simulate(p, Decisions.all_device())
    floor = lower_bound_peak(p)
    budget = int(floor + (base.peak_bytes - floor) * frac)
    try:
        h = solve_heuristic(p, budget_bytes=budget)
    except HeuristicFailed:
        # "Always a plan when one exists": the MILP must not find one either.
        with pytest.raises(RuntimeError):
            solve_milp(p, budget_bytes=budget, time_limit_s=10)
        return
    assert h.sim.peak_bytes <= budget
    assert simulate(p, h.decisions).peak_bytes == h.sim.peak_bytes
    r = solve_milp(p, budget_bytes=budget, time_limit_s=10, incumbent=h.choice)
    assert r.sim.peak_bytes <= budget
    assert r.sim.step_time_s <= h.sim.step_time_s + 1e-12
    if r.optimal:
        assert h.sim.step_time_s <= 1.02 * r.sim.step_time_s


@pytest.mark.parametrize("layers", [2, 3, 5, 8])
@pytest.mark.parametrize("load", [2.0, 1.2])
@pytest.mark.parametrize("frac", [0.7, 0.3])
def test_chainscheck_milp_vs_heuristic(layers, load, frac):
    check_milp_vs_heuristic(layers, load, frac)


@pytest.mark.slow
@pytest.mark.parametrize(("layers", "load", "frac"), ci_sample(
    [(n, load, frac) for frac in (0.5, 0.2) for load in (2.0, 1.5, 1.0, 0.5) for n in (16, 32, 64)],
    [(32, 1.0, 0.2), (64, 2.0, 0.5), (16, 0.5, 0.5)]))
def test_long_chainscheck_milp_vs_heuristic(layers, load, frac):
    check_milp_vs_heuristic(layers, load, frac)


def queue_free_problem(seed: int, frac: float, fused: bool = False, transient: bool = False) -> tuple[Problem, int]:
    """8 instances in 6 candidates (two hold 2 instances, like a scanned layer), where the MILP's
    model is exact: steps of 1 ms, every copy under 1 ms, one copy out every other forward step
    and one reload every other backward step (no queueing, no duplex), no latency, each buffer
    read once in the forward. Actions allowed at random; budget ``frac`` of the way from the
    least peak to the all-device peak. ``fused``: every other candidate's recomputation is fused
    into its readers (never stored again); ``transient``: every third candidate's values are
    temporaries of the steps computing them (never counted under REMAT)."""
    rng = np.random.default_rng(seed)
    n_inst, owners = 8, [0, 0, 1, 1, 2, 3, 4, 5]
    prod = 1 + 2 * np.arange(n_inst)
    bwd0 = int(prod[-1]) + 2
    fbu = bwd0 + 1 + 2 * rng.permutation(n_inst)
    T = int(fbu.max()) + 3
    size = rng.integers(50, 200, size=n_inst) * MB
    rate = float(size.max()) / 0.9e-3
    steps = tuple(Step(1e-3, int(b)) for b in rng.integers(400, 600, size=T) * MB)
    insts = [Instance(int(size[i]), int(prod[i]), int(prod[i]), int(fbu[i]), int(fbu[i]) + int(rng.integers(0, 2)))
             for i in range(n_inst)]
    kinds = ({Action.OFFLOAD}, {Action.REMAT}, {Action.OFFLOAD, Action.REMAT})
    cands = tuple(
        Candidate(f"c{c}", f"c{c}", f"c{c}", tuple(x for x, o in zip(insts, owners) if o == c),
                  frozenset(kinds[int(rng.integers(0, 3))] | {Action.DEVICE}),
                  remat_s=float(rng.uniform(0.2e-3, 3e-3)), remat_fused=fused and c % 2 == 0,
                  remat_transient=transient and c % 3 == 1)
        for c in range(6))
    p = Problem(steps, cands, rate, rate, rate, rate, 0.0)
    peak = simulate(p, Decisions.all_device()).peak_bytes
    floor = lower_bound_peak(p)
    return p, int(floor + (peak - floor) * frac)


def brute_force(p: Problem, budget: int) -> float:
    """Least replayed step time over every combination of allowed actions within ``budget``."""
    best = float("inf")
    for combo in itertools.product(*[sorted(c.allowed, key=lambda a: a.value) for c in p.candidates]):
        sim = simulate(p, Decisions({c.key: a for c, a in zip(p.candidates, combo) if a != Action.DEVICE}))
        if sim.peak_bytes <= budget:
            best = min(best, sim.step_time_s)
    return best


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("frac", [0.15, 0.5])
def test_milp_equals_brute_force(seed, frac):
    p, budget = queue_free_problem(seed, frac)
    want = brute_force(p, budget)
    r = solve_milp(p, budget_bytes=budget, mip_rel_gap=1e-9)
    assert r.optimal and r.source == "milp"
    assert r.sim.peak_bytes <= budget
    assert r.sim.step_time_s == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["fused", "transient"])
def test_milp_equals_brute_force_with_fused_or_transient_remat(seed, kind):
    """Candidates recomputed inside their readers are off device from their last forward use to
    their last use; temporaries of their iterations are never counted under REMAT: the MILP's
    model counts them as the simulator does."""
    p, budget = queue_free_problem(seed, 0.15, fused=kind == "fused", transient=kind == "transient")
    want = brute_force(p, budget)
    r = solve_milp(p, budget_bytes=budget, mip_rel_gap=1e-9)
    assert r.optimal and r.sim.peak_bytes <= budget
    assert r.sim.step_time_s == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["fused", "transient"])
def test_model_matches_simulator_for_fused_and_transient_remat(kind):
    p, _ = queue_free_problem(3, 0.5, fused=kind == "fused", transient=kind == "transient")
    m = Model.build(p)
    for ci, c in enumerate(p.candidates):
        if Action.REMAT not in c.allowed:
            continue
        ch = np.zeros(len(p.candidates), dtype=np.int64)
        ch[ci] = REM
        sim = simulate(p, Decisions({c.key: Action.REMAT}))
        assert list(sim.timeline_bytes) == m.timeline(ch).tolist(), c.key
        if kind == "transient" and c.remat_transient:
            # never counted: the all-device timeline less the candidate's bytes wherever it lived
            dev = simulate(p, Decisions.all_device()).timeline_bytes
            for x in c.instances:
                assert sim.timeline_bytes[x.produced] <= dev[x.produced] - x.bytes
