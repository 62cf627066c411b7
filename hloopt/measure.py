"""Step time and memory measured on the current JAX device, side by side with the simulator's prediction.

For the plan (``plan=``) and for each built-in policy (JAX's ``jax.checkpoint_policies`` and, where
the program uses MaxText's tensor names, MaxText's presets: :mod:`hloopt.anchors`) whose predicted
peak fits the budget, the step is built with that policy, compiled for the current device, run
``warmup`` times untimed and ``steps`` times timed (round-robin over the policies, so that other
load on the machine falls on all of them alike). A timed sample is one call waited for with
``block_until_ready`` (``back_to_back=1``: the step's latency, the host's dispatch included), or
the steady state of ``back_to_back`` calls queued as a training loop queues them, each dispatched
before the previous one is waited for (the step time the device sets wherever the host keeps up,
which is what the simulator predicts). We report

* the median and spread (min, max, first and third quartile) of the timed steps;
* the device's peak bytes in use (``device.memory_stats()["peak_bytes_in_use"]``) where the backend
  keeps them; the CPU backend returns ``None``, and the row says so;
* the process's peak resident host memory while the row compiled and ran its untimed steps
  (``VmHWM`` of ``/proc/self/status``, reset per row by writing ``5`` to
  ``/proc/self/clear_refs``): on the CPU backend this is where the step's buffers live;
* the compiled step's ``memory_analysis()`` temporaries, XLA's own figure for the policy;

next to what hloopt predicts for the step JAX lowers with that policy
(:func:`hloopt.pipeline.judge_lowered`: the memory model's peak of that module, and the one
simulator's time for its compute and every value it moves to host memory), and each row's rank by
time under both. The planner's own figure (the replay of the policy's rules on the all-saved step's
residuals, :mod:`hloopt.anchors`: the plan's prediction and ``hloopt plan``'s anchors table) is
reported beside it (``replayed``): a policy can keep values the all-saved step never keeps, and
then moves other bytes than its replay. ``peak_bytes_in_use`` counts from process start and
cannot be reset from JAX, so rows run in order of increasing predicted peak and a row whose
reading did not rise is marked as not its own.

Arguments that are ``jax.ShapeDtypeStruct`` are materialized (floats from a normal distribution with
a fixed seed, integers zero: valid indices into any table) with the same dtype and sharding.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hloopt.devices import DeviceProfile
from hloopt.errors import UserError

#: Version of :meth:`Measurement.to_dict`'s layout; bumped when a key changes meaning or goes.
SCHEMA = 1


@dataclass(frozen=True)
class StepTimes:
    """Wall-clock seconds of the timed steps, and their summary."""

    #: every timed step, in order
    times_s: tuple[float, ...]
    #: seconds the host took to dispatch each step queued back to back (the call returning, the
    #: device not waited for); empty when steps were timed one call at a time
    dispatch_s: tuple[float, ...] = ()

    @property
    def host_bound(self) -> bool:
        """Whether the host's dispatch sets the pace: dispatching a step takes 80% or more of the
        time per step, so the device waits on the host and a faster device step would not show."""
        return bool(self.dispatch_s) and _quantile(self.dispatch_s, 0.5) >= 0.8 * self.median_s

    @property
    def median_s(self) -> float:
        return _quantile(self.times_s, 0.5)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def max_s(self) -> float:
        return max(self.times_s)

    @property
    def q1_s(self) -> float:
        return _quantile(self.times_s, 0.25)

    @property
    def q3_s(self) -> float:
        return _quantile(self.times_s, 0.75)


@dataclass(frozen=True)
class PolicyRow:
    """One policy: predicted and measured."""

    #: ``plan`` or the anchor's name (``nothing_saveable``, ``minimal``...)
    name: str
    #: ``plan``, ``jax`` or ``maxtext``
    kind: str
    #: the policy as a user writes it
    code: str
    predicted_step_time_s: float
    predicted_peak_bytes: int
    #: the planner's figure: the replay of the policy on the all-saved step (the plan's own
    #: prediction for the plan row)
    replayed_step_time_s: float | None = None
    #: bytes the step lowered with the policy moves to host memory per step
    predicted_host_bytes: int = 0
    #: None when the row was not run (``skipped``) or failed (``error``)
    measured: StepTimes | None = None
    #: ``peak_bytes_in_use`` after the row ran; None where the backend has no memory stats
    device_peak_bytes: int | None = None
    #: False when the reading did not rise over the previous row's (it may be an earlier row's peak)
    device_peak_is_own: bool | None = None
    #: peak resident host memory of the process while this row compiled and ran
    host_peak_rss_bytes: int | None = None
    #: ``memory_analysis().temp_size_in_bytes`` of the compiled step
    compiled_temp_bytes: int | None = None
    #: why the row was not run (over the budget)
    skipped: str | None = None
    #: why the row failed (compiling or running the step with this policy)
    error: str | None = None
    predicted_rank: int | None = None
    measured_rank: int | None = None


@dataclass(frozen=True)
class Measurement:
    """What :func:`measure` found."""

    target: str
    #: ``jax.Device.device_kind`` and platform of the device the steps ran on
    device_kind: str
    platform: str
    #: the device profile the predictions use
    profile: str
    steps: int
    warmup: int
    budget_bytes: int | None
    rows: tuple[PolicyRow, ...]
    #: why device peaks are missing (None when the backend reports them)
    device_peak_note: str | None
    #: Kendall's tau between predicted and measured time ranks over the measured rows (None: < 2 rows)
    rank_agreement: float | None
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: calls queued per timed sample (:func:`time_steps`): 1 times each call waited for alone
    back_to_back: int = 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict, schema :data:`SCHEMA`."""
        rows = []
        for r in self.rows:
            m = r.measured
            rows.append({
                "name": r.name, "kind": r.kind, "code": r.code,
                "predicted": {"step_time_s": r.predicted_step_time_s, "peak_bytes": r.predicted_peak_bytes,
                              "host_bytes": r.predicted_host_bytes, "rank": r.predicted_rank,
                              "replayed_step_time_s": r.replayed_step_time_s},
                "measured": None if m is None else {
                    "step_time_s": {"median": m.median_s, "min": m.min_s, "max": m.max_s, "q1": m.q1_s,
                                    "q3": m.q3_s},
                    "dispatch_s": {"median": _quantile(m.dispatch_s, 0.5)} if m.dispatch_s else None,
                    "host_bound": m.host_bound,
                    "times_s": list(m.times_s),
                    "device_peak_bytes": r.device_peak_bytes,
                    "device_peak_is_own": r.device_peak_is_own,
                    "host_peak_rss_bytes": r.host_peak_rss_bytes,
                    "compiled_temp_bytes": r.compiled_temp_bytes,
                    "rank": r.measured_rank,
                },
                "skipped": r.skipped, "error": r.error,
            })
        return {
            "schema": SCHEMA, "target": self.target,
            "device": {"kind": self.device_kind, "platform": self.platform},
            "profile": self.profile, "steps": self.steps, "warmup": self.warmup,
            "back_to_back": self.back_to_back,
            "budget_bytes": self.budget_bytes, "device_peak_note": self.device_peak_note,
            "rank_agreement": self.rank_agreement, "notes": list(self.notes), "rows": rows,
        }


# -- running a step -----------------------------------------------------------------------------


def _step_with_policy(target: Any, policy: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``(step_fn, args, kwargs)`` of ``target`` with every ``jax.checkpoint`` taking ``policy``
    (:meth:`hloopt.targets.Target.with_policy`: code that never exposes its policy too)."""
    return target.with_policy(policy)


def materialize(tree: Any, *, seed: int = 0) -> Any:
    """``tree`` with every ``jax.ShapeDtypeStruct`` replaced by an array of its shape, dtype and
    sharding on the current devices: floats standard normal from ``seed``, everything else zero."""
    import jax
    import numpy as np

    from hloopt.lowering import _place

    placed = _place(tree, jax.devices(), jax.default_backend())
    rng = np.random.default_rng(seed)

    def leaf(x: Any, orig: Any) -> Any:
        if not isinstance(orig, jax.ShapeDtypeStruct):
            return orig
        dtype = np.dtype(x.dtype)
        if np.issubdtype(dtype, np.floating) or dtype.name in ("bfloat16",) or dtype.name.startswith("float8"):
            host = rng.standard_normal(x.shape, dtype=np.float32).astype(dtype)
        else:
            host = np.zeros(x.shape, dtype)
        return jax.device_put(host, x.sharding)

    return jax.tree.map(leaf, placed, tree, is_leaf=lambda v: isinstance(v, jax.ShapeDtypeStruct))


def time_steps(compiled: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *,
               steps: int, warmup: int, back_to_back: int = 1) -> StepTimes:
    """Run ``compiled`` ``warmup`` times, then take ``steps`` timed samples.

    With ``back_to_back`` 1 a sample is one call, timed until its outputs are ready: the step's
    latency, the host's dispatch included. A training loop does not wait so: it queues the next
    step while the device runs this one, so a step costs the device's time wherever the host
    keeps up. With ``back_to_back`` N >= 2 a sample queues N calls, each dispatched before the
    previous one is waited for (two in flight at most, as such a loop holds), and is the time from
    the first call's outputs being ready to the last's, over N - 1: the steady-state step time.
    That needs a device that runs calls in order (a TPU's or GPU's stream): the CPU backend runs
    independent calls at once, where a real loop's steps wait on each other's outputs, so there
    ``back_to_back`` 1 is the step time (:func:`default_back_to_back`)."""
    import jax

    if back_to_back < 1:
        raise UserError(f"--back-to-back must be >= 1, got {back_to_back}")
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args, **kwargs))
    times = []
    dispatch: list[float] = []
    for _ in range(steps):
        if back_to_back == 1:
            t0 = time.perf_counter()
            out = compiled(*args, **kwargs)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
            del out
            continue
        prev = compiled(*args, **kwargs)
        first = None
        for _ in range(back_to_back - 1):
            t0 = time.perf_counter()
            cur = compiled(*args, **kwargs)
            dispatch.append(time.perf_counter() - t0)
            jax.block_until_ready(prev)
            if first is None:
                first = time.perf_counter()
            prev = cur
        jax.block_until_ready(prev)
        assert first is not None
        times.append((time.perf_counter() - first) / (back_to_back - 1))
        del prev, cur
    return StepTimes(tuple(times), tuple(dispatch))


def default_back_to_back(platform: str) -> int:
    """Calls per timed sample where the user names none: 4 on an accelerator, 1 on the CPU backend
    (see :func:`time_steps`)."""
    return 1 if platform == "cpu" else 4


def device_peak_bytes(device: Any) -> tuple[int | None, str | None]:
    """``(peak_bytes_in_use, None)``, or ``(None, why)`` where the backend keeps no memory stats."""
    try:
        stats = device.memory_stats()
    except Exception as err:  # a backend without the call raises rather than returning None
        return None, f"{device.platform} backend: memory_stats() failed ({type(err).__name__})"
    if not stats:
        return None, (f"{device.platform} backend: device.memory_stats() returns None (the CPU client "
                      "keeps no allocator statistics); host RSS is where its buffers live")
    if "peak_bytes_in_use" not in stats:
        return None, f"{device.platform} backend: memory_stats() has no peak_bytes_in_use"
    return int(stats["peak_bytes_in_use"]), None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (``VmHWM``); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """``VmHWM`` of ``/proc/self/status`` in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- the comparison ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    name: str
    kind: str
    code: str
    policy: Any
    predicted_step_time_s: float
    predicted_peak_bytes: int
    replayed_step_time_s: float | None = None
    predicted_host_bytes: int = 0


def measure(target: Any, *, profile: DeviceProfile, plan: Any = None, policies: str = "builtin",
            steps: int = 10, warmup: int = 2, back_to_back: int | None = None, budget: str | None = None,
            seed: int = 0, compile: str | None = None,
            progress: Callable[[str], Any] | None = None, analyzed: tuple[Any, Any] | None = None) -> Measurement:
    """Predict, then run and time, the plan's policy and the built-in ones (see the module docstring).

    ``target`` is a TARGET string or a resolved jax :class:`~hloopt.targets.Target`; ``plan`` a
    :class:`~hloopt.plan.Plan` or a plan file; ``policies`` ``"builtin"`` or ``"none"`` (the plan
    only). ``budget`` (a size or a share of the all-saved predicted peak, default the plan's)
    leaves out anchors predicted over it. ``compile`` (``cpu``, ``tpu-v5e``...) predicts from the
    compiler's scheduled module, as ``hloopt plan --compile`` does. Each policy runs at least one
    untimed step (its memory is read after it), ``max(warmup, 1)`` in all. ``back_to_back``: calls
    queued per timed sample, see :func:`time_steps` (None: :func:`default_back_to_back` for the
    device). ``analyzed``: ``(analysis, problem)`` of ``target`` from
    :func:`hloopt.pipeline.analyze_target` for the same profile, where the caller has it (``hloopt
    plan --judge measured``), so that the step is not analyzed twice.
    """
    import contextlib

    import jax

    from hloopt.anchors import ANCHORS, expressible, policy_object
    from hloopt.pipeline import analyze_target, judge_lowered, resolve_budget
    from hloopt.problem import Decisions
    from hloopt.simulator import simulate
    from hloopt.targets import Target, resolve

    if steps < 1 or warmup < 0 or (back_to_back is not None and back_to_back < 1):
        raise UserError(f"--steps and --back-to-back must be >= 1 and --warmup >= 0, got {steps}, "
                        f"{back_to_back} and {warmup}")
    if policies not in ("builtin", "none"):
        raise UserError(f"--policies {policies!r}: expected 'builtin' or 'none'")
    prog = progress or (lambda label: contextlib.nullcontext())
    tgt = target if isinstance(target, Target) else resolve(target)
    if tgt.kind != "jax":
        raise UserError(f"{tgt.name}: measure runs a JAX step (file.py:factory); an HLO file cannot be run")
    plan_obj = None
    if plan is not None:
        from hloopt.emit import load_plan
        from hloopt.emit import policy as plan_policy

        plan_obj = load_plan(plan)
    if policies == "none" and plan_obj is None:
        raise UserError("nothing to measure: --policies none needs --plan")

    an, problem = analyzed if analyzed is not None else analyze_target(tgt, profile, compile=compile, progress=prog)
    baseline = simulate(problem, Decisions.all_device())
    if budget is not None:
        budget_bytes = resolve_budget(budget, baseline.peak_bytes)
    elif plan_obj is not None and plan_obj.budget is not None:
        budget_bytes = plan_obj.budget.bytes
    else:
        budget_bytes = None

    def judged(name: str, kind: str, code: str, pol: Any, replayed_s: float) -> _Candidate:
        with prog(f"lowering {tgt.name} with {name}"):
            j = judge_lowered(tgt, pol, profile, compile=compile)
        return _Candidate(name, kind, code, pol, j.step_time_s, j.peak_bytes, replayed_s, j.host_bytes)

    cands: list[_Candidate] = []
    if plan_obj is not None:
        cands.append(judged("plan", "plan", f"hloopt.emit.policy({plan_obj.target!r} plan)",
                            plan_policy(plan_obj), plan_obj.predicted.step_time_s))
    names = frozenset(c.name for c in problem.candidates if c.name)
    if policies == "builtin":
        for a in ANCHORS:
            if not expressible(a, problem):
                continue
            r = simulate(problem, a.decisions(problem))
            cands.append(judged(a.name, a.kind, a.code, policy_object(a, names), r.step_time_s))

    dev = jax.devices()[0]
    if back_to_back is None:
        back_to_back = default_back_to_back(str(dev.platform))
    args: Any = None
    kwargs: Any = None
    rows: list[PolicyRow] = []
    note: str | None = None
    last_peak = -1
    notes = []
    if not reset_peak_rss():
        notes.append("the kernel refused to reset the peak RSS: host peaks are since process start")
    # Increasing predicted peak, so that a process-long device peak reading is each row's own
    # whenever the predictions order the rows right (see the module docstring).
    ready: list[tuple[dict[str, Any], Any, dict[str, Any]]] = []  # (row fields, compiled, memory fields)
    for c in sorted(cands, key=lambda c: (c.predicted_peak_bytes, c.name)):
        base: dict[str, Any] = dict(name=c.name, kind=c.kind, code=c.code,
                                    predicted_step_time_s=c.predicted_step_time_s,
                                    predicted_peak_bytes=c.predicted_peak_bytes,
                                    replayed_step_time_s=c.replayed_step_time_s,
                                    predicted_host_bytes=c.predicted_host_bytes)
        if budget_bytes is not None and c.kind != "plan" and c.predicted_peak_bytes > budget_bytes:
            rows.append(PolicyRow(**base, skipped=f"predicted peak {c.predicted_peak_bytes} B is over the "
                                                  f"budget {budget_bytes} B"))
            continue
        with prog(f"compiling and warming up {tgt.name} with {c.name}"):
            try:
                step_fn, step_args, step_kwargs = _step_with_policy(tgt, c.policy)
                if args is None:
                    args, kwargs = materialize((step_args, step_kwargs), seed=seed)
                gc.collect()
                reset_peak_rss()
                compiled = jax.jit(step_fn).trace(*args, **kwargs).lower().compile()
                mem = compiled.memory_analysis()
                for _ in range(max(warmup, 1)):
                    jax.block_until_ready(compiled(*args, **kwargs))
            except UserError:
                raise
            except Exception as err:  # the step with this policy failed: a finding, not a crash
                rows.append(PolicyRow(**base, error=_one_line(err)))
                continue
        peak, note = device_peak_bytes(dev)
        own = None
        if peak is not None:
            own = peak > last_peak
            last_peak = max(last_peak, peak)
        ready.append((base, compiled, dict(
            device_peak_bytes=peak, device_peak_is_own=own, host_peak_rss_bytes=peak_rss_bytes(),
            compiled_temp_bytes=None if mem is None else int(mem.temp_size_in_bytes))))

    # Timed steps round-robin over the policies, so that load from elsewhere on the machine (and
    # clock changes) falls on every row alike rather than on whichever ran during it.
    times: list[list[float]] = [[] for _ in ready]
    dispatches: list[list[float]] = [[] for _ in ready]
    failed: dict[int, str] = {}
    with prog(f"timing {steps} steps of each of {len(ready)} policies, interleaved"):
        for _ in range(steps):
            for i, (_, compiled, _) in enumerate(ready):
                if i in failed:
                    continue
                try:
                    st = time_steps(compiled, args, kwargs, steps=1, warmup=0, back_to_back=back_to_back)
                    times[i].extend(st.times_s)
                    dispatches[i].extend(st.dispatch_s)
                except Exception as err:
                    failed[i] = _one_line(err)
    for i, (base, _, memory) in enumerate(ready):
        if i in failed:
            rows.append(PolicyRow(**base, error=failed[i]))
        else:
            rows.append(PolicyRow(**base, measured=StepTimes(tuple(times[i]), tuple(dispatches[i])), **memory))
    del ready

    rows = _ranked(rows)
    ran = [r for r in rows if r.measured is not None]
    bound = [r.name for r in ran if r.measured is not None and r.measured.host_bound]
    if bound:
        notes.append(f"host-bound ({', '.join(bound)}): dispatching a step takes 80% or more of the time per step, "
                     "so these times are the host's pace, not the device's, which is what hloopt predicts")
    tau = _kendall_tau([r.predicted_step_time_s for r in ran],
                       [r.measured.median_s for r in ran if r.measured is not None]) if len(ran) >= 2 else None
    return Measurement(target=tgt.name, device_kind=str(dev.device_kind), platform=str(dev.platform),
                       profile=profile.name, steps=steps, warmup=warmup, budget_bytes=budget_bytes,
                       rows=tuple(rows), device_peak_note=note, rank_agreement=tau, notes=tuple(notes),
                       back_to_back=back_to_back)


def _one_line(err: BaseException) -> str:
    first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _ranked(rows: list[PolicyRow]) -> list[PolicyRow]:
    """Rows in predicted-time order, with both ranks (1 = fastest) among the rows that ran."""
    ran = [r for r in rows if r.measured is not None]
    pred = {r.name: i + 1 for i, r in enumerate(sorted(ran, key=lambda r: (r.predicted_step_time_s, r.name)))}
    meas = {r.name: i + 1 for i, r in enumerate(sorted(ran, key=lambda r: (r.measured.median_s, r.name)))}  # type: ignore[union-attr]
    out = [dataclasses.replace(r, predicted_rank=pred.get(r.name), measured_rank=meas.get(r.name)) for r in rows]
    return sorted(out, key=lambda r: (r.predicted_step_time_s, r.name))


def _kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a of two equally long sequences (ties count as neither agreeing nor not)."""
    n = len(a)
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += _sign(a[i] - a[j]) * _sign(b[i] - b[j])
    return s / (n * (n - 1) / 2)


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default method)."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
