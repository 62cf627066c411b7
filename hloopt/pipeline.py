"""The planning pipeline: TARGET -> HLO -> analyses -> Problem -> search -> Plan.

``plan(target, profile=..., budget=...)`` is what ``hloopt plan`` and ``hloopt.auto_offload`` run:

1. **Lower.** A JAX target is lowered for the device's platform with every residual saved
   (``everything_saveable``), so each value a policy could keep, offload or recompute appears as
   a forward->backward residual; the program as written is lowered too, for the baseline figure.
   An HLO file is analyzed as it is.
2. **Analyze.** Buffers and live ranges (with XLA's fusion modeled for pre-optimization HLO),
   the forward->backward residuals (dataflow), their ``checkpoint_name`` (by re-lowering, see
   :mod:`hloopt.naming`), and a roofline time per instruction.
3. **Problem.** Steps are the entry computation's schedule; a ``while`` loop that writes or reads
   per-layer residuals is expanded into one step per iteration so that layer ``i``'s offload can
   overlap layer ``i+1``'s compute. Each residual group one policy rule selects is a
   :class:`~hloopt.problem.Candidate` with one instance per layer. ``base_bytes`` is the
   analyzed timeline minus the candidates' own bytes, so replaying "all on device" reproduces the
   analyzed peak. An instance has its buffer's bytes and reads as the timeline counts them
   (stored size: TPU tiles, bf16 storage, nothing when fused away; read where a materialized
   instruction reads it, through checkpoint tuples and fused readers), so a decision takes off
   exactly what the timeline holds.

   *One accountant.* On a TPU device a pre-optimization module's timeline is the one ``hloopt
   analyze --platform tpu`` predicts (:func:`hloopt.analysis.profile_module`), computed on the
   module it counts: calls inlined, TPU tiles, instructions written in its memory-aware list
   schedule's order, so the Problem's steps are that schedule and "all on device" replays to
   analyze's peak byte for byte. That timeline is libtpu's accounting, ``fixed + max(HBM heap,
   VMEM heap)`` with predicted memory-space assignment (passes/memory.py), which is not linear in
   the residuals; the Problem keeps it linear with a floor:

   * an instance counts its buffer's HBM bytes (0 for a buffer XLA's buffer assigner places
     inside an output's allocation: the timeline holds none of it, and the room it leaves there
     for other temporaries is not modeled);
   * ``Step.floor_bytes`` is the VMEM side with every residual off the device (the same
     profile with ``off_device``): no decision goes under it;
   * a residual memory-space assignment packs into VMEM still comes off the step's total whole
     when taken off the device, although the model's HBM side may not have held it: between
     "everything on device" (exact) and the floor the replay can be below the model. Where the
     timeline holds less than the residuals live at a step (VMEM holds some, and counts at
     most its capacity), ``base_bytes`` is negative.

   *Stacked residuals* (a scan's ``[L, ...]`` buffers) are one instance per layer: layer ``i`` is
   produced in forward iteration ``i`` and read in backward iteration ``L-1-i``. Offloaded or
   recomputed, that is what XLA does (the stack lives in host memory, one slice per iteration
   moves). Kept on device, XLA allocates the whole stack before the forward loop and frees it when
   the backward loop ends, while the per-layer view holds layer ``i`` only from its forward to its
   backward iteration: the base leaves the whole stack out, so inside the loops, with everything
   on device, the replay can be below the analyzed timeline (never above it). The peak of a
   training step is at the start of the backward pass, where every layer is live and both agree.
4. **Search** for the decisions (:mod:`hloopt.search`), judge them and every built-in policy with
   the one simulator (:mod:`hloopt.simulator`), and write a :class:`~hloopt.plan.Plan`. What the
   search minimises is the plan's objective (:func:`for_objective`): the step time, or the
   recomputed FLOPs with no weight on waiting for the link; the memory is counted the same way
   for both.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from hloopt.devices import DeviceProfile
from hloopt.errors import InfeasibleBudget, UserError
from hloopt.ir import Instruction, Module, gc_paused
from hloopt.passes.opcodes import VIEWS
from hloopt.passes.residuals import under_checkpoint
from hloopt.problem import Action, Candidate, Decisions, Instance, Problem, SimResult, Step

_BARRIERS = ("opt-barrier", "optimization-barrier")

#: op_name fragments that say a value was computed inside ``jax.checkpoint`` (where a policy
#: decides its fate); values outside any checkpoint are always saved by JAX.

Progress = Callable[[str], Any]


def _no_progress(label: str) -> Any:
    import contextlib

    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Analysis of one module
# --------------------------------------------------------------------------------------------


@dataclass
class Analyzed:
    """One analyzed module: what the Problem is built from."""

    module: Module
    #: "hlo", "lowered:<platform>" or "compiled:<target>"
    source: str
    #: device bytes live at each entry instruction (a call site counts its callee's peak)
    timeline_bytes: list[int]
    #: host bytes live at each entry instruction
    host_timeline_bytes: list[int]
    #: modeled seconds of each entry instruction (loops times their trip count)
    step_s: list[float]
    residuals: Any
    ranges: Any
    cost: Any
    #: checkpoint_names that name a checkpoint's own input (hloopt.naming.ResidualNames): no remat
    checkpoint_inputs: frozenset[str] = frozenset()
    #: per entry instruction, the bytes counted whatever the decisions: for a TPU prediction the
    #: on-chip (VMEM) side of libtpu's accounting with every residual off the device (predicted
    #: memory-space assignment, passes/memory.py), which no offload lowers; None when not modeled
    floor_timeline_bytes: list[int] | None = None
    #: instructions the timeline counts no buffer for (XLA fuses them into their readers,
    #: passes/tpu/fusion.py, and storage views): their readers read through them
    fused: frozenset[Instruction] = frozenset()
    #: the memory profile the timeline is (hloopt analyze's, for a TPU prediction); None when the
    #: timeline is Liveness's own sum (other platforms)
    memory: Any = None
    #: the floor with these instructions' buffers off the device as well (argument groups placed
    #: in host memory, :func:`add_state_candidates`); None where there is no floor
    floor_without: Callable[[frozenset[str]], list[int]] | None = None

    @property
    def peak_bytes(self) -> int:
        return max(max(self.timeline_bytes, default=0), max(self.floor_timeline_bytes or [0]))

    def counted(self, bid: int) -> tuple[int, int, int]:
        """(first step, last step, bytes) the timeline counts buffer ``bid`` over; first step -1
        when it counts it nowhere on the device's HBM side (fused away, inside an output's
        allocation, another memory space)."""
        lr = self.ranges
        if self.memory is not None:
            return self.memory.counted_start[bid], self.memory.counted_end[bid], lr.size_bytes[bid]
        return lr.start[bid], lr.end[bid], lr.size_bytes[bid]


@gc_paused()  # builds long-lived analyses of a possibly huge module (hloopt.ir.gc_paused)
def analyze_module(module: Module, profile: DeviceProfile, *, source: str = "hlo",
                   names: Mapping[str, str] | None = None) -> Analyzed:
    """Liveness, residuals and roofline costs of one module, folded onto its entry schedule.

    For a TPU device and a pre-optimization module the timeline is the profile ``hloopt analyze
    --platform tpu`` computes (:func:`hloopt.analysis.profile_module`: tiling, bf16 stacks, output
    allocation reuse, predicted memory-space assignment, the list schedule), on the module it
    counts (calls inlined, instructions in the list schedule's order: its text order is the
    schedule, ``Analyzed.module``). Costs are the roofline of the module as lowered (untiled
    shapes), by instruction name. Other platforms: Liveness over the module's text order."""
    from hloopt.passes import AnalysisManager
    from hloopt.passes.cost import CostAnalysis
    from hloopt.passes.inline import inline_for_assignment
    from hloopt.passes.liveness import Liveness, storage_views
    from hloopt.passes.residuals import find_residuals
    from hloopt.passes.tpu import TpuFusion

    pre_opt = not module.is_scheduled
    if pre_opt:
        given = module
        module = inline_for_assignment(module)  # as XLA does before it assigns buffers
        if profile.kind == "tpu":
            return _analyze_tpu_prediction(module, profile, source=source, names=names,
                                           owned=module is not given)
    am = AnalysisManager(module)
    liveness = Liveness(fusion=TpuFusion() if pre_opt else None)
    ranges = am.get(liveness)
    timeline = ranges.entry_timeline(ranges.bytes_per_step(memory_space=0))
    fused = storage_views(ranges.steps)
    if pre_opt:
        fused = fused | am.get(TpuFusion()).fused  # what Liveness(fusion=TpuFusion()) fused
    host = ranges.entry_timeline(ranges.bytes_per_step(memory_space=5))
    cost = CostAnalysis(profile=profile).run(module, am)
    entry = module.entry
    assert entry is not None
    step_s = [cost.seconds(inst) for inst in entry.instructions]
    residuals = find_residuals(module)
    if names:
        residuals = residuals.with_names(dict(names))
    inputs: frozenset[str] = getattr(names, "checkpoint_inputs", frozenset())
    return Analyzed(module, source, timeline, host, step_s, residuals, ranges, cost, inputs, None, fused)


def _analyze_tpu_prediction(module: Module, profile: DeviceProfile, *, source: str,
                            names: Mapping[str, str] | None, owned: bool) -> Analyzed:
    """:func:`analyze_module` for a TPU device and an inlined pre-optimization module."""
    from hloopt.analysis import peak_memory_pass, prepare_for_profile, settings_for
    from hloopt.passes import AnalysisManager
    from hloopt.passes.cost import CostAnalysis
    from hloopt.passes.liveness import storage_views
    from hloopt.passes.residuals import find_residuals
    from hloopt.passes.tpu import TpuFusion

    # roofline times of the program as lowered (tiling pads what the memory model stores, not
    # what the cost model reads), looked up by name on the module the profile counts
    cost = CostAnalysis(profile=profile).run(module, AnalysisManager(module))
    settings = settings_for(module, platform="tpu")
    # the module the profile counts (calls inlined, tiled, in schedule order); ``owned``: ``module``
    # is call inlining's copy, which nothing else holds, and is not copied again
    module, am = prepare_for_profile(module, settings, owned=owned)
    on_chip = profile.on_chip_heap_bytes or None  # analyze's VMEM when the profile does not say
    mem = am.get(peak_memory_pass(settings, on_chip_bytes=on_chip))
    ranges = mem.ranges
    timeline = mem.entry_timeline_bytes()
    host = ranges.entry_timeline(mem.host_timeline_bytes)
    fused = storage_views(ranges.steps) | am.get(TpuFusion(narrow_stacks=bool(settings.get("narrow_stacks")))).fused
    entry = module.entry
    assert entry is not None
    step_s = [cost.seconds(inst.name) for inst in entry.instructions]
    residuals = find_residuals(module)
    if names:
        residuals = residuals.with_names(dict(names))
    inputs: frozenset[str] = getattr(names, "checkpoint_inputs", frozenset())
    floor = None
    floor_without = None
    if mem.on_chip_timeline_bytes is not None:
        # libtpu reports the larger of its HBM and VMEM heaps, and an offload lowers only the
        # first: the VMEM side with every residual off the device is counted whatever the plan
        # a residual is named by the instruction the backward pass reads (for a scanned layer's,
        # the forward loop's output element); the buffer holding it is named by the values that
        # define it (the stack's initial value and the loop body's update): those are taken off
        off_residuals = frozenset(i.name for r in residuals for b in _buffers_of(ranges, r.inst)
                                  for i, _ in b.values)

        def floor_without(names: frozenset[str]) -> list[int]:
            off = am.get(peak_memory_pass(settings, on_chip_bytes=on_chip,
                                          off_device=off_residuals | names))
            # (capped by the timeline: without the residuals XLA's buffer assigner may leave other
            # temporaries outside the output allocations, whose VMEM side can then be higher)
            return [min(f, t) for f, t in zip(ranges.entry_timeline(off.on_chip_timeline_bytes or []), timeline)]

        floor = floor_without(frozenset())
    return Analyzed(module, source, timeline, host, step_s, residuals, ranges, cost, inputs, floor, fused, mem,
                    floor_without)


# --------------------------------------------------------------------------------------------
# The Problem
# --------------------------------------------------------------------------------------------


def _buffers_of(ranges: Any, inst: Instruction) -> list[Any]:
    """The buffer holding ``inst``'s array value ([] for a tuple or a value with none)."""
    try:
        return [ranges.aliasing.buffer_at(inst, ())]
    except (KeyError, IndexError):
        return []


@dataclass
class StepMap:
    """Where each entry instruction landed among the Problem's steps."""

    #: entry index -> first step index
    first: list[int]
    #: entry index -> number of steps (the trip count for an expanded loop, else 1)
    count: list[int]

    def at(self, entry_index: int, iteration: int = 0) -> int:
        return self.first[entry_index] + min(iteration, self.count[entry_index] - 1)

    def last(self, entry_index: int) -> int:
        return self.first[entry_index] + self.count[entry_index] - 1


#: ``checkpoint_name``'s identity marker and the views a value passes through unchanged
_MARKERS = VIEWS | {"reduce-precision", "copy"}


def _through_markers(inst: Instruction) -> Instruction:
    """The op that computes a value, looking through ``checkpoint_name``'s identity marker."""
    seen = 0
    while inst.opcode in _MARKERS and inst.operands and seen < 8:
        inst = inst.operands[0]
        seen += 1
    return inst


def _recomputed_op(inst: Instruction) -> Instruction:
    """The op a rematerialization re-runs: through markers and views, and through the tuples that
    ``jax.checkpoint`` calls and scan bodies pass a value along in (``get-tuple-element`` of a
    ``tuple`` or of an optimization barrier over one). A scanned residual's producer is such a
    ``get-tuple-element`` (0 s); an unrolled one's is checkpoint_name's ``reduce-precision``."""
    for _ in range(64):
        inst = _through_markers(inst)
        element = _tuple_element(inst)
        if element is None:
            return inst
        inst = element
    return inst


def _tuple_element(inst: Instruction) -> Instruction | None:
    """For ``get-tuple-element`` of a ``tuple`` (or of an optimization barrier over one): the
    element's own instruction; None otherwise."""
    if inst.opcode != "get-tuple-element" or not inst.operands:
        return None
    src = inst.operands[0]
    if src.opcode in _BARRIERS and src.operands and src.operands[0].opcode == "tuple":
        src = src.operands[0]
    if src.opcode != "tuple" or not 0 <= inst.tuple_index < len(src.operands):
        return None
    return src.operands[inst.tuple_index]


@gc_paused()
def build_problem(an: Analyzed, profile: DeviceProfile, *,
                  prefetch_window_steps: int | None = None, moved: bool = False) -> tuple[Problem, StepMap]:
    """Turn an analyzed module into the simulator's and solvers' :class:`Problem`.

    ``moved``: the module already moves residuals to host memory (a step lowered with an
    offloading policy); each becomes a candidate that can only be OFFLOAD (:data:`MOVED_PREFIX`
    keys, :func:`as_lowered`), so that the simulator times its transfers against the module's
    compute. The analyzed timeline already counts what the module keeps of them on device, so
    they take nothing off the base: only such a Problem's times are the module's, not its peaks
    (:func:`judge_lowered` takes the peak from the analysis)."""
    from hloopt.passes.opcodes import FUSIBLE

    module = an.module
    entry = module.entry
    assert entry is not None
    residuals = [r for r in an.residuals if (moved or not r.offloaded) and r.bytes > 0]
    expand: dict[int, int] = {}
    for r in residuals:
        if r.stacked:
            expand[r.forward_loop.index] = r.layers
            if r.backward_loop is not None:
                expand[r.backward_loop.index] = r.layers

    steps: list[Step] = []
    first: list[int] = []
    count: list[int] = []
    backward_start = an.residuals.backward_start if len(an.residuals) else len(entry.instructions)
    for e, inst in enumerate(entry.instructions):
        n = expand.get(e, 1)
        first.append(len(steps))
        count.append(n)
        for k in range(n):
            label = inst.name if n == 1 else f"{inst.name}[{k}]"
            steps.append(Step(an.step_s[e] / n, an.timeline_bytes[e], label, e >= backward_start,
                              an.floor_timeline_bytes[e] if an.floor_timeline_bytes is not None else 0))
    smap = StepMap(first, count)

    groups = candidate_groups(residuals)
    for r in residuals:
        if r.offloaded:
            groups.setdefault(MOVED_PREFIX + relative_key(r.key), []).append(r)
    recompute_s, recompute_flops = _recompute_costs(an, [r for r in residuals if not r.offloaded])

    import numpy as np

    contrib = np.zeros(len(steps) + 1, dtype=np.int64)
    counted: set[int] = set()  # buffer ids an instance already stands for
    notes: dict[str, str] = {"module": module.name, "source": an.source}
    candidates: list[Candidate] = []
    for key in sorted(groups, key=lambda k: (-sum(r.bytes for r in groups[k]), k)):
        rs = groups[key]
        instances: list[Instance] = []
        remat_s = keep_s = remat_flops = 0.0
        for r in rs:
            if r.stacked:
                per = _stack_layer_bytes(an, r)
                fl = r.forward_loop.index
                bl = r.backward_loop.index if r.backward_loop is not None else None
                stack_start = _stack_start(an, r, smap, default=smap.at(fl))
                for _layer, fi, bi in r.iteration_map():
                    produced = smap.at(fl, fi)
                    if bl is not None:
                        fbu = smap.at(bl, bi)
                        last_use = fbu
                        stack_end = smap.last(bl)
                    else:
                        fbu = smap.at(r.first_backward_use)
                        last_use = smap.last(r.last_use)
                        stack_end = last_use
                    ins = Instance(per, produced, produced, max(fbu, produced), max(last_use, fbu, produced))
                    instances.append(ins)
                    if r.offloaded:
                        continue
                    # The base leaves out the whole stack while XLA holds it (see the docstring).
                    contrib[min(stack_start, ins.produced)] += ins.bytes
                    contrib[max(stack_end, ins.last_use) + 1] -= ins.bytes
            else:
                nbytes, (pos, fwd_last, bwd_first, last) = _as_counted(an, r, counted)
                produced = smap.at(pos)
                lfu = smap.last(fwd_last) if fwd_last > pos else produced
                fbu = smap.at(bwd_first)
                last_use = max(smap.last(last), fbu)
                ins = Instance(nbytes, produced, max(lfu, produced), max(fbu, produced), max(last_use, produced))
                instances.append(ins)
                if not r.offloaded:
                    contrib[ins.produced] += ins.bytes
                    contrib[ins.last_use + 1] -= ins.bytes
            if r.offloaded:
                continue
            keep = _stack_keep_s(an, r)
            remat_s += recompute_s[id(r)] * max(r.layers, 1) - keep
            remat_flops += recompute_flops[id(r)] * max(r.layers, 1)
            keep_s += keep
        r0 = rs[0]
        if key.startswith(MOVED_PREFIX):
            candidates.append(Candidate(
                key=key, name=r0.name, selector=f"moved to host memory as lowered ({r0.source_text or '?'})",
                instances=tuple(instances), allowed=frozenset({Action.OFFLOAD}), source=_op_source(an, r0),
                shape=_instance_shape(r0), in_loop=all(r.stacked and r.backward_loop is not None for r in rs),
                primitive=_selector_primitive(r0)))
            continue
        prod = _through_markers(r0.producer)
        movable = any(under_checkpoint(r) for r in rs) and (
            bool(r0.name) or policy_selectable(_selector_primitive(r0)))
        allowed = frozenset({Action.DEVICE, Action.OFFLOAD, Action.REMAT}) if movable else frozenset({Action.DEVICE})
        if movable and (all(_is_input(_recomputed_op(r.producer)) for r in rs)
                        or r0.name in an.checkpoint_inputs):
            # Read straight from the loop state or an argument (a scan's carry), or the name of
            # a checkpoint's own input: not saving it makes JAX save that input, the same bytes,
            # so there is no recomputation to choose.
            allowed = allowed - {Action.REMAT}
        if profile.kind == "tpu" and not all(r.stacked for r in rs):
            # libtpu copies a value offloaded outside a loop back as soon as it is on the host
            # (passes/memory.py, prefetch_at_offload): the plan's saving may not materialize
            notes[f"eager:{key}"] = ("outside a loop: libtpu copies it back right away, check with "
                                     "hloopt verify --compile tpu-...")
        name = r0.name
        selector = f"checkpoint_name {name!r}" if name else f"{r0.primitive} at {r0.source_text or '?'}"
        candidates.append(Candidate(
            key=key, name=name, selector=selector, instances=tuple(instances), allowed=allowed,
            remat_s=remat_s, keep_s=keep_s, remat_flops=remat_flops, source=_op_source(an, r0),
            shape=_instance_shape(r0),
            remat_fused=Action.REMAT in allowed and all(
                r.layers <= 1 and _recomputed_op(r.producer).opcode in FUSIBLE for r in rs),
            in_loop=all(r.stacked and r.backward_loop is not None for r in rs),
            primitive=_selector_primitive(r0),
            dot_has_batch_dims=prod.opcode == "dot" and bool(prod.attr_ints("lhs_batch_dims")),
        ))
    live = np.cumsum(contrib[:-1])
    # No clamp at 0: where memory-space assignment holds residuals in VMEM, libtpu's accounting
    # (the larger heap) can count less than their sum, and the base goes negative so that "all on
    # device" still replays to the timeline (the floor keeps a replay above the VMEM side).
    steps = [dataclasses.replace(s, base_bytes=s.base_bytes - int(live[t])) for t, s in enumerate(steps)]
    problem = Problem(
        steps=tuple(steps), candidates=tuple(candidates),
        d2h_bytes_per_s=profile.d2h_bytes_per_s, h2d_bytes_per_s=profile.h2d_bytes_per_s,
        duplex_d2h_bytes_per_s=profile.duplex_d2h_bytes_per_s,
        duplex_h2d_bytes_per_s=profile.duplex_h2d_bytes_per_s,
        transfer_latency_s=profile.transfer_latency_s, dma_engines=profile.dma_engines,
        prefetch_window_steps=prefetch_window_steps, device=profile.name, notes=notes,
    )
    return problem, smap


#: Key prefix of a candidate the module already moves to host memory (``build_problem(moved=True)``).
MOVED_PREFIX = "moved:"


def as_lowered(problem: Problem) -> Decisions:
    """The decisions that replay a module as it was lowered: what it moves to host memory is
    OFFLOAD (``build_problem(moved=True)``), everything else as the module keeps it."""
    return Decisions({c.key: Action.OFFLOAD for c in problem.candidates if c.key.startswith(MOVED_PREFIX)})


@dataclass(frozen=True)
class LoweredJudgment:
    """A policy judged on the step JAX lowers with it (:func:`judge_lowered`)."""

    #: the memory model's peak of that module (``hloopt analyze``'s figure)
    peak_bytes: int
    #: the simulator's step time: the module's compute, its transfers to and from host memory
    step_time_s: float
    #: of which waiting on the host link
    exposed_transfer_s: float
    #: FLOPs with loop trip counts (CostAnalysis)
    flops: float
    #: bytes the module moves to host memory per step, by JAX's shapes (each ``pinned_host`` value
    #: times its layers; the transfers are timed on the bytes as stored, TPU tiles included)
    host_bytes: int


def judge_lowered(tgt: Any, policy: Any, profile: DeviceProfile, *, platform: str | None = None,
                  compile: str | None = None) -> LoweredJudgment:
    """Lower ``tgt`` with ``policy`` and judge that module: its peak by the memory model, its time
    by the simulator replaying it as lowered (its compute, every value it offloads moved over the
    link and back).

    A replay of a policy's rules on the all-saved step's residuals (:mod:`hloopt.anchors`) can only
    save, offload or recompute those residuals; a policy that saves a value the all-saved step
    never keeps (a projection's output before the rotary embedding that reads it) moves other
    bytes than the replay does. Lowering with the policy sees what JAX does with it. ``policy``
    None: the step as written (its own checkpoint policies; a MaxText step built with a preset).
    ``compile`` (``cpu``, ``tpu-v5e``...): judge the compiler's scheduled module instead."""
    from hloopt.ir import STORAGE_BITS
    from hloopt.simulator import simulate

    module, source = _lowered_module(tgt, platform or ("tpu" if profile.kind == "tpu" else "cuda"), policy, compile)
    an = analyze_module(module, profile, source=source)
    problem, _ = build_problem(an, profile, moved=True)
    r = simulate(problem, as_lowered(problem))
    return LoweredJudgment(peak_bytes=int(an.peak_bytes), step_time_s=r.step_time_s,
                           exposed_transfer_s=r.exposed_transfer_s, flops=float(an.cost.totals.flops),
                           host_bytes=sum((r.shape.num_elements * STORAGE_BITS[r.shape.element_type] + 7) // 8
                                          for r in an.residuals if r.offloaded))


def judge_other_anchors(tgt: Any, problem: Problem, plan_obj: Any, profile: DeviceProfile, *,
                        platform: str | None = None) -> list[tuple[str, LoweredJudgment]]:
    """The plan and each policy :func:`_fewer_flops_builtin` does not weigh (JAX's offloading
    policies, MaxText's presets where the step uses MaxText's names), judged as lowered.

    Moving a value to host memory costs no FLOPs but its bytes over the link, so FLOPs alone
    cannot rank these against the plan: each row carries the simulator's time for its module,
    transfers included, beside its FLOPs and the bytes it moves."""
    from hloopt.anchors import ANCHORS, expressible, policy_object
    from hloopt.emit import policy as plan_policy
    from hloopt.plan import BUILTIN_POLICIES

    names = frozenset(c.name for c in problem.candidates if c.name)
    # MaxText's "full" is nothing_saveable, shown among the presets of a step that uses MaxText's names
    maxtext = any(a.kind == "maxtext" and a.name != "full" and a.place is None and expressible(a, problem)
                  for a in ANCHORS)
    rows = [("hloopt plan", judge_lowered(tgt, plan_policy(plan_obj), profile, platform=platform))]
    for a in ANCHORS:
        if a.place is not None or a.name in BUILTIN_POLICIES or a.name == "everything_saveable" \
                or not expressible(a, problem) or (a.kind == "maxtext" and not maxtext):
            continue
        rows.append((a.code, judge_lowered(tgt, policy_object(a, names), profile, platform=platform)))
    return rows


def _beating(rows: Sequence[tuple[str, LoweredJudgment]], budget_bytes: int,
             among: frozenset[str] | None = None, *, objective: str = "time") -> tuple[str, LoweredJudgment] | None:
    """Of the judged rows after the plan's (the first), the one (of ``among``, when given) that
    fits the budget with fewer FLOPs than the plan and, for the ``"time"`` objective, a step no
    longer than the plan's: the shortest step first (``"flops"``: the fewest FLOPs first); None
    when none does."""
    ours = rows[0][1]
    by_flops = objective == "flops"
    better = [(code, r) for code, r in rows[1:] if (among is None or code in among) and r.peak_bytes <= budget_bytes
              and r.flops < ours.flops * (1 - 1e-3) and (by_flops or r.step_time_s <= ours.step_time_s)]
    rank = (lambda r: (r.flops, r.step_time_s)) if by_flops else (lambda r: (r.step_time_s, r.flops))
    return min(better, key=lambda cr: rank(cr[1])) if better else None


def judged_notes_of(plan_obj: Any, rows: Sequence[tuple[str, LoweredJudgment]],
                    budget_bytes: int) -> tuple[str, ...]:
    """What the lowered steps' judgment (:func:`judge_other_anchors`, the plan's row first) says
    against the plan: the plan's step moving other bytes to host memory than the plan counts (its
    rules select more values together than alone), and a policy that fits with fewer FLOPs and is
    predicted no slower (it keeps values the all-saved step never keeps, which no rule hloopt
    searches can select)."""
    from hloopt.units import format_bytes, format_seconds

    if not rows or rows[0][0] != "hloopt plan":
        return ()
    ours = rows[0][1]
    notes = []
    planned = sum(d.bytes for d in plan_obj.of("offload"))
    if ours.host_bytes > planned:
        notes.append(f"the step lowered with the plan moves {format_bytes(ours.host_bytes)} to host memory where the "
                     f"plan counts {format_bytes(planned)}: predicted {format_seconds(ours.step_time_s)} as lowered, "
                     f"{format_seconds(plan_obj.predicted.step_time_s)} as planned (hloopt verify names the values)")
    best = _beating(rows, budget_bytes, objective=plan_obj.objective)
    if best is not None:
        code, r = best
        notes.append(f"{code} fits the budget with {r.flops / 1e9:.4g} GFLOP (the plan: {ours.flops / 1e9:.4g}) and is "
                     f"predicted {format_seconds(r.step_time_s)} as lowered (the plan: "
                     f"{format_seconds(ours.step_time_s)}), moving {format_bytes(r.host_bytes)} to host memory: it "
                     "keeps values the step with everything saved never keeps, which hloopt's rules cannot select; "
                     "consider it")
    return tuple(notes)


def _builtin_plan(problem: Problem, name: str, build: Callable[[Problem, Decisions, SimResult], Any], *,
                  peak_bytes: int, step_time_s: float, exposed_transfer_s: float | None = None
                  ) -> tuple[Any, Any, Decisions, SimResult]:
    """``(anchor, plan, decisions, result)`` of the JAX built-in ``name`` taking the plan's place
    (``Plan.builtin``): its decisions are its replay on the all-saved ``problem`` (each reason
    naming the built-in), its predicted figures those of the step lowered with it (``peak_bytes``,
    ``step_time_s`` and, where judged, ``exposed_transfer_s``), the replay's peak beside them."""
    import dataclasses as dc

    from hloopt.anchors import ANCHORS
    from hloopt.simulator import simulate

    anchor = next(a for a in ANCHORS if a.name == name)
    acts = anchor.decisions(problem)
    res = simulate(problem, acts)
    alt = build(problem, acts, res)
    verb = {"offload": "offloads", "remat": "recomputes"}
    exposed = {} if exposed_transfer_s is None else {"exposed_transfer_s": exposed_transfer_s}
    alt = dc.replace(alt, builtin=name, decisions=tuple(
        dc.replace(d, reason=f"{anchor.code} {verb[d.action]} it") if d.action in verb else d
        for d in alt.decisions),
        predicted=dc.replace(alt.predicted, peak_bytes=peak_bytes, model_peak_bytes=peak_bytes,
                             replay_peak_bytes=res.peak_bytes, step_time_s=step_time_s, **exposed))
    return anchor, alt, acts, res


def _offloading_builtin(problem: Problem, plan_obj: Any, rows: Sequence[tuple[str, LoweredJudgment]],
                        budget_bytes: int, build: Callable[[Problem, Decisions, SimResult], Any]) -> Any:
    """(plan, decisions, result, note) of the JAX offloading built-in (:data:`hloopt.plan.
    OFFLOADING_BUILTINS`) to take instead of the plan, or None.

    One is taken where, both lowered and judged (:func:`judge_lowered`, the plan's row first), it
    fits the budget with fewer FLOPs than the plan and (for the plan's ``"time"`` objective) a step
    no longer than the plan's. Such a policy keeps values the all-saved step never keeps (a
    projection's output before the rotary embedding that reads it), which no rule hloopt searches
    can select. The plan's predicted
    figures are the judgment's; its decisions are the built-in's replay on the all-saved step."""
    from hloopt.emit import builtin_code
    from hloopt.plan import OFFLOADING_BUILTINS
    from hloopt.units import format_bytes, format_seconds

    if not rows or plan_obj.state:
        return None
    ours = rows[0][1]
    by_code = {builtin_code(n): n for n in OFFLOADING_BUILTINS}
    best = _beating(rows, budget_bytes, among=frozenset(by_code), objective=plan_obj.objective)
    if best is None:
        return None
    name, r = by_code[best[0]], best[1]
    anchor, alt, acts, res = _builtin_plan(problem, name, build, peak_bytes=r.peak_bytes,
                                           step_time_s=r.step_time_s, exposed_transfer_s=r.exposed_transfer_s)
    note = (f"the plan is {anchor.code}: lowered and judged, it fits the budget with {r.flops / 1e9:.4g} GFLOP and "
            f"{format_seconds(r.step_time_s)} per step, moving {format_bytes(r.host_bytes)} to host memory, where "
            f"the plan hloopt searched needs {ours.flops / 1e9:.4g} GFLOP and {format_seconds(ours.step_time_s)} "
            "(the built-in keeps values the step with everything saved never keeps, which hloopt's rules "
            "cannot select)")
    return alt, acts, res, note


def _group_of(op_name: str, groups: Sequence[Any]) -> Any:
    """The state group whose name prefixes an entry parameter's ``op_name`` (JAX writes each
    argument leaf's path there: ``opt_state[0].mu[3]``), None when no group does."""
    for g in groups:
        if op_name == g.name or (op_name.startswith(g.name) and op_name[len(g.name)] in "[."):
            return g
    return None


#: key of the candidate standing for the optimizer's state and update (:func:`add_state_candidates`)
OPTIMIZER_KEY = "state:optimizer"

#: why argument groups stay on device on TPU: libtpu's own figures (tests/test_state.py)
TPU_STATE_EVIDENCE = (
    "on TPU libtpu brings a host group to the device whole, and lands a host computation's outputs in "
    "device memory: neither lowers the peak (wide AdamW, libtpu 0.0.42 and 0.0.50: 520 MB as written, "
    "571 MB with mu and nu in host memory, 739 MB with the update on the host)")


def add_state_candidates(an: Analyzed, problem: Problem, smap: StepMap, groups: Sequence[Any], *,
                         outputs: Mapping[str, Sequence[int]] | None = None,
                         host_budget_bytes: int | None = None, host: Any = None,
                         elements: Mapping[str, tuple[int, int]] | None = None, host_share: int = 1,
                         device_kind: str = "gpu") -> Problem:
    """``problem`` with the step's argument groups that it updates (:func:`hloopt.state.state_groups`)
    as candidates (``Candidate.state``): the search decides them with the residuals, against the
    same budget, and the one simulator replays them.

    * A group the differentiated computation reads (parameters: read by an op JAX names
      ``jvp(...)``) is one candidate: DEVICE, or OFFLOAD (kept in host memory, ``pinned_host``,
      and brought to the device before its first read).
    * The groups only the rest of the step reads (the optimizer's moments and count) are ONE
      candidate, ``state:optimizer``: DEVICE; OFFLOAD (all in host memory,
      brought to the device for the update, MaxText's ``optimizer_memory_host_offload``); or
      REMAT, which for this candidate means *the update computed on the host*
      (``hloopt.state.on_host``, JAX's ``compute_on("device_host")``): the state never reaches the
      device (``remat_transient``), and the step gains the host's time for the update (an AdamW
      roofline on the ``host`` profile over the parameter groups' elements, ``elements``: per
      group its element count and element bytes; :func:`hloopt.hosts.optimizer_update_host_s`)
      times ``host_share`` (the accelerators one host serves update at once, each at that share of
      its cores and DRAM), plus the gradients' copy out and the
      new parameters' copy in over the link. The device's own update time is not taken off
      (the update's device temporaries stay in the base): both sides err towards the device.

    A group's bytes are its entry parameters' buffers as the timeline counts them (tiled, per
    device), and the buffers of its updated values among the module's outputs (``outputs``: the
    root tuple indices of each group's updated leaves) where the timeline holds them for the
    whole step (libtpu's accounting allocates outputs for the whole program; a donated
    argument's update is its parameter's buffer, counted once). Its instance spans the step; the
    base takes it off, and the floor (libtpu's VMEM side, which counts arguments and outputs too)
    leaves it out, the simulator adding it back while on the device. Candidates over
    ``host_budget_bytes`` cannot go to the host and are left out. Input data that is not updated
    (the batch) is not a candidate: it arrives every step anyway.

    On TPU (``device_kind == "tpu"``) the candidates stay on device, with the reason in the
    problem's notes: libtpu (0.0.42 and 0.0.50, compiled here deviceless) brings a host group to
    the device whole and early, and lands a host computation's outputs in device memory, so
    neither lowers the peak (wide AdamW, :data:`TPU_STATE_EVIDENCE`)."""
    module = an.module
    entry = module.entry
    assert entry is not None
    lr = an.ranges
    last = len(problem.steps) - 1
    found: dict[str, list[Instruction]] = {}
    for p_inst in entry.parameters:
        g = _group_of(p_inst.metadata.op_name, groups)
        if g is not None and g.updated:
            found.setdefault(g.name, []).append(p_inst)
    root = entry.root
    # (group, bytes, first read (entry index), buffers, read by the differentiated forward pass)
    measured: list[tuple[str, int, int, set[int], bool]] = []
    for g in groups:
        params = found.get(g.name)
        if not params:
            continue
        nbytes, reads, seen, differentiated = 0, [], set(), False
        for p_inst in params:
            try:
                b = lr.aliasing.buffer_at(p_inst, ())
            except (KeyError, IndexError):
                continue
            start, _, size = an.counted(b.id)
            if start < 0 or size == 0 or b.id in seen:
                continue
            seen.add(b.id)
            nbytes += size
            flat = _storage_reads(an, p_inst)
            reads += [lr.entry_step[t] for t in flat]
            # JAX names what value_and_grad / grad linearize "jvp(...)": a group read there is
            # differentiated (parameters); the optimizer's state is read only outside it
            differentiated = differentiated or any("jvp(" in lr.steps[t].metadata.op_name for t in flat)
        for k in (outputs or {}).get(g.name, ()):
            if root is None or not root.shape.is_tuple:
                break
            try:
                b = lr.aliasing.buffer_at(root, (k,))
            except (KeyError, IndexError):
                continue
            start, end, size = an.counted(b.id)
            whole = start == 0 and end == len(lr.steps) - 1
            if b.id in seen or not whole or size == 0 or b.parameter >= 0:
                continue
            seen.add(b.id)
            nbytes += size
        if nbytes and reads:
            measured.append((g.name, nbytes, min(reads), seen, differentiated))

    candidates = list(problem.candidates)
    total = 0
    off_buffers: set[int] = set()
    tpu = device_kind == "tpu"
    notes = dict(problem.notes)
    forward = [m for m in measured if m[4]]
    optimizer = [m for m in measured if not m[4]]
    for name, nbytes, first, seen, _ in forward:
        if host_budget_bytes is not None and nbytes > host_budget_bytes:
            continue
        candidates.append(Candidate(
            key=f"state:{name}", name=None, selector=f"argument group {name}",
            instances=(Instance(nbytes, 0, 0, smap.at(first), last),),
            allowed=frozenset({Action.DEVICE} if tpu else {Action.DEVICE, Action.OFFLOAD}), source=name,
            shape="argument group", state=name))
        if tpu:
            notes[f"kept:state:{name}"] = TPU_STATE_EVIDENCE
        total += nbytes
        off_buffers |= seen
    opt_bytes = sum(m[1] for m in optimizer)
    if optimizer and (host_budget_bytes is None or opt_bytes <= host_budget_bytes):
        allowed = {Action.DEVICE, Action.OFFLOAD}
        remat_s = host_s = 0.0
        sizes = [(elements or {}).get(m[0], (0, 4)) for m in forward]
        params_elements = sum(n for n, _ in sizes)
        param_bytes = max((b for _, b in sizes), default=4)
        if tpu:
            allowed = {Action.DEVICE}
            notes[f"kept:{OPTIMIZER_KEY}"] = TPU_STATE_EVIDENCE
        elif host is not None and params_elements > 0:
            from hloopt.hosts import optimizer_update_host_s

            moved = sum(n * b for n, b in sizes)  # gradients out, new parameters in
            host_s = optimizer_update_host_s(host, params_elements, param_bytes) * max(1, host_share)
            remat_s = (host_s + moved / max(problem.d2h_bytes_per_s, 1.0) + moved / max(problem.h2d_bytes_per_s, 1.0)
                       + 2 * problem.transfer_latency_s)
            allowed.add(Action.REMAT)
        names = ", ".join(m[0] for m in optimizer)
        candidates.append(Candidate(
            key=OPTIMIZER_KEY, name=None, selector=f"optimizer state ({names})",
            instances=(Instance(opt_bytes, 0, 0, smap.at(min(m[2] for m in optimizer)), last),),
            allowed=frozenset(allowed), remat_s=remat_s, host_compute_s=host_s, source=names, shape="optimizer state",
            remat_transient=Action.REMAT in allowed, state=names))
        total += opt_bytes
        for m in optimizer:
            off_buffers |= m[3]
    if len(candidates) == len(problem.candidates):
        return problem
    notes.update({f"state-bytes:{m[0]}": str(m[1]) for m in measured})
    steps = tuple(dataclasses.replace(s, base_bytes=s.base_bytes - total) for s in problem.steps)
    if an.floor_without is not None:
        # the floor leaves the groups out: the simulator counts them on its side while on device
        low = an.floor_without(frozenset(i.name for bid in off_buffers for i, _ in lr.buffers[bid].values))
        steps = tuple(dataclasses.replace(s, floor_bytes=low[e])
                      for e in range(len(smap.first)) for s in steps[smap.first[e]: smap.first[e] + smap.count[e]])
    return dataclasses.replace(problem, steps=steps, candidates=tuple(candidates), notes=notes)


def host_bytes_of(problem: Problem, decisions: Decisions) -> int:
    """Host memory a plan fills: every offloaded candidate's bytes at once (an upper bound for
    residuals, which are on the host only between their copy out and their last read; exact for
    argument groups, which live there for the whole step)."""
    return sum(c.bytes for c in problem.candidates if decisions.action(c.key) == Action.OFFLOAD)


def candidate_groups(residuals: Any) -> dict[str, list[Any]]:
    """Candidate key -> its residuals: one candidate per policy rule.

    A rule is a checkpoint_name, or (primitive, output shape) for an unnamed value under
    ``jax.checkpoint``: the emitted policy (:mod:`hloopt.emit`) cannot tell two values of one
    primitive and shape apart, so they share a decision. Values outside any checkpoint keep their
    own key (no policy moves them).
    """
    groups: dict[str, list[Any]] = {}
    rule_key: dict[tuple[str, str], str] = {}
    live = [r for r in residuals if not r.offloaded and r.bytes > 0]
    for r in sorted(live, key=lambda r: (-r.bytes, r.position)):
        key = relative_key(r.key)
        if not r.name and under_checkpoint(r):
            rule = (_selector_primitive(r), _instance_shape(r))
            key = rule_key.setdefault(rule, f"prim:{rule[0]}:{rule[1]}@{relative_source(r.source_text)}")
        groups.setdefault(key, []).append(r)
    return groups


def relative_source(text: str) -> str:
    """A source path as lowered HLO writes it (:func:`hloopt.lowering.relative_paths`): an
    installed package's file by its package path (``/venv/.../site-packages/maxtext/layers/x.py``
    -> ``maxtext/layers/x.py``), ``/abs/cwd/model.py:3`` -> ``model.py:3``: plans and reports do
    not depend on the checkout, and call sites (jaxpr frames) compare with HLO locations."""
    import os

    from hloopt.ir import package_path

    text = package_path(text)
    cwd = os.getcwd().rstrip(os.sep) + os.sep
    return text[len(cwd):] if text.startswith(cwd) else text


def relative_key(key: str) -> str:
    head, sep, loc = key.partition("@")
    return head + sep + relative_source(loc) if sep else key


#: Names a JAX checkpoint policy is never called with: HLO opcodes of control flow and
#: parameters, and call wrappers (``jit(silu)``), whose inner primitives the policy sees instead.
_NOT_PRIMITIVES = frozenset({"parameter", "while", "call", "conditional", "tuple", "get_tuple_element",
                             "custom_call", "fusion", "constant"})


def policy_selectable(primitive: str) -> bool:
    """Whether a checkpoint policy can select values by this primitive name (see hloopt.emit)."""
    import re

    return bool(re.fullmatch(r"[a-z_][a-z0-9_]*", primitive)) and primitive not in _NOT_PRIMITIVES


def _policy_value(inst: Instruction) -> Instruction:
    """The op whose JAX primitive a policy is asked about for ``inst``'s value: through the
    ``reduce-precision`` markers saved values pass, layout-only copies, and into ``jit`` calls
    (a policy sees the primitives inside a ``jit``, not the call)."""
    for _ in range(16):
        if inst.opcode == "reduce-precision" and inst.operands:
            inst = inst.operands[0]
        elif inst.opcode in ("copy", "bitcast") and inst.operands and _primitive(inst) == inst.opcode:
            inst = inst.operands[0]
        elif inst.opcode == "get-tuple-element" and inst.operands and inst.operands[0].opcode == "tuple" \
                and inst.tuple_index < len(inst.operands[0].operands):
            inst = inst.operands[0].operands[inst.tuple_index]  # a call's root, after inlining
        elif inst.opcode == "get-tuple-element" and inst.operands and inst.operands[0].opcode == "call":
            callee = inst.operands[0].callee("to_apply", "calls")
            root = callee.root if callee is not None else None
            if root is None or root.opcode != "tuple" or inst.tuple_index >= len(root.operands):
                break
            inst = root.operands[inst.tuple_index]
        else:
            break
    return inst


def _selector_primitive(r: Any) -> str:
    """The JAX primitive a policy sees for the residual's value."""
    prod = _policy_value(r.producer)
    return {"dot": "dot_general", "convolution": "conv_general_dilated"}.get(prod.opcode, _primitive(prod))


def _primitive(inst: Instruction) -> str:
    from hloopt.passes.residuals import primitive_of

    return primitive_of(inst)


def _op_source(an: Analyzed, r: Any) -> str:
    """``file:line`` of the op that computes the residual (inside a scan body: the layer's own
    line, not the scan's), relative to the working directory."""
    from hloopt.passes.residuals import LIBRARY_PATHS

    loc = an.module.user_source_of(_recomputed_op(r.producer), skip=LIBRARY_PATHS)
    return relative_source(f"{loc[0]}:{loc[1]}") if loc else relative_source(r.source_text)


def _name_marker(inst: Instruction) -> Instruction | None:
    """The ``reduce-precision`` identity a residual's value is (through tuples and views), if any."""
    for _ in range(64):
        if inst.opcode == "reduce-precision":
            return inst
        if inst.opcode in ("copy", "bitcast", "reshape") and inst.operands:
            inst = inst.operands[0]
            continue
        element = _tuple_element(inst)
        if element is None:
            return None
        inst = element
    return None


_FORWARDING = frozenset({"tuple", "get-tuple-element", "bitcast", "domain", *_BARRIERS})


def _as_counted(an: Analyzed, r: Any, counted: set[int]) -> tuple[int, tuple[int, int, int, int]]:
    """A residual's bytes and (produced, last forward read, first backward read, last read), entry
    indices, as the analyzed timeline counts its buffer, so that taking an instance off the device
    takes off what the timeline holds.

    The timeline (``Liveness`` on the materialized module) sizes a buffer as stored (TPU tiles,
    f32 kept bf16, 0 when fused away, passes/tpu/) and keeps it until its last
    materialized reader; the residual analysis sees the HLO's value and its direct users, such as
    the tuple ``jax.checkpoint`` hands its residuals through, or an elementwise op XLA fuses into
    a later reader. Reads here are where the value is read in storage: through tuples, barriers
    and their elements, views and fused readers, to the first instruction that materializes. A
    buffer two residuals share counts once. Without a buffer (not an array): the HLO's figures."""
    raw = (r.position, r.forward_last_use, r.first_backward_use, r.last_use)
    lr = an.ranges
    try:
        b = lr.aliasing.buffer_at(r.inst, ())
    except (KeyError, IndexError):
        return r.bytes, raw
    start, end, size = an.counted(b.id)
    if b.id in counted or start < 0 or size == 0:
        # fused away, or inside an output's allocation: the timeline holds nothing in HBM a
        # decision could take off
        return 0, raw
    counted.add(b.id)
    reads = sorted({lr.entry_step[t] for t in _storage_reads(an, r.inst)})
    fwd = [e for e in reads if e < r.first_backward_use]
    bwd = [e for e in reads if e >= r.first_backward_use]
    last = max(r.last_use, lr.entry_step[end])
    return size, (min(r.position, lr.entry_step[start]), max(fwd, default=r.forward_last_use),
                  min(bwd, default=r.first_backward_use), last)


def _stack_layer_bytes(an: Analyzed, r: Any) -> int:
    """One layer's bytes of a stacked residual as the timeline counts its ``[L, ...]`` buffer
    (stored size: tiles, bf16 stacks; nothing when the buffer lies inside an output's
    allocation, which XLA's buffer assigner does with stacks that fit, passes/memory.py)."""
    try:
        b = an.ranges.aliasing.buffer_at(r.inst, ())
    except (KeyError, IndexError):
        return r.per_layer_bytes
    start, _, size = an.counted(b.id)
    return size // r.layers if start >= 0 else 0


def _storage_reads(an: Analyzed, inst: Instruction) -> list[int]:
    """Flat steps of the materialized instructions that read ``inst``'s value (see _as_counted)."""
    time = an.ranges.time
    out: list[int] = []
    seen: set[tuple[int, int]] = set()
    todo: list[tuple[Instruction, int]] = [(inst, -1)]  # (holder, tuple index of the value or -1)
    while todo:
        v, k = todo.pop()
        for u in v.users:
            if (id(u), k) in seen or u not in time:
                continue
            seen.add((id(u), k))
            if k >= 0:  # v is a tuple holding the value at index k
                if u.opcode == "get-tuple-element":
                    if u.tuple_index == k:
                        todo.append((u, -1))
                elif u.opcode in _BARRIERS:
                    todo.append((u, k))
                else:  # a loop, call or output reads the whole tuple
                    out.append(time[u])
            elif u.opcode == "tuple":
                for j, o in enumerate(u.operands):
                    if o is v:
                        todo.append((u, j))
            elif u.opcode in _FORWARDING or u in an.fused:
                todo.append((u, -1))
            else:
                out.append(time[u])
    return out


def _is_input(inst: Instruction) -> bool:
    while inst.opcode == "get-tuple-element" and inst.operands:
        inst = inst.operands[0]
    return inst.opcode == "parameter"


#: where a recomputation starts from: values the backward pass has without computing them
_RECOMPUTE_SOURCES = frozenset({"parameter", "constant", "iota", "while", "call", "conditional",
                                "custom-call", "rng-get-and-update-state"})


def _recompute_costs(an: Analyzed, residuals: Sequence[Any]) -> tuple[dict[int, float], dict[int, float]]:
    """Modeled seconds and FLOPs (one execution: a scanned residual's per layer) of what
    recomputing each residual re-runs, by ``id`` of the residual.

    JAX's rematerialization re-runs the forward ops between a value and what the backward pass
    has: the checkpoint's inputs and the values the policy saves. Its producer alone is not that:
    a dropout mask is a ``select`` over the output of the threefry hash of its key, dozens of
    integer ops; an attention probability needs its scores. So a residual's recomputation is
    what of its cone the forward pass needs anyway: its producer and the producer's operands,
    transitively, up to the producers of residuals (which the plan saves, or recomputes at their
    own cost), loop state and parameters, constants, the ops that open loops and calls, and
    static values (weights and what is cheap to derive from them, passes/residuals.py: a scan's
    slice of its stacked weights, a weight's cast, which the backward pass computes whatever is
    saved). An op in the cones of several residuals is shared among them in equal parts, so that
    recomputing all of them costs each op once (full rematerialization: the forward again), and
    recomputing one costs its own chain and a share of the rest."""
    from hloopt.passes.residuals import _static_values, ancestors_of, static_values_of

    producers = {_recomputed_op(r.producer) for r in an.residuals}
    entry = an.module.entry
    assert entry is not None
    entry_static = _static_values(entry.instructions)
    static_by_loop: dict[int, set[Instruction]] = {}
    entry_needed = ancestors_of([an.residuals.loss])
    needed_by_loop: dict[int, set[Instruction]] = {}
    stacks: dict[int, set[int]] = {}  # forward loop -> its tuple elements that are residual stacks
    for r in an.residuals:
        if r.stacked and r.forward_loop is not None and r.inst.opcode == "get-tuple-element":
            stacks.setdefault(id(r.forward_loop), set()).add(r.inst.tuple_index)
    cones: dict[int, list[Instruction]] = {}
    shared: dict[Instruction, int] = {}
    for r in residuals:
        start = _recomputed_op(r.producer)
        if r.stacked and r.forward_loop is not None:
            loop = r.forward_loop
            static = static_by_loop.get(id(loop))
            if static is None:
                static = static_by_loop[id(loop)] = static_values_of(loop, entry_static)
            needed = needed_by_loop.get(id(loop))
            if needed is None:
                root = loop.called["body"][0].root
                outs = [o for k, o in enumerate(root.operands) if k not in stacks.get(id(loop), set())] \
                    if root.opcode == "tuple" else [root]
                needed = needed_by_loop[id(loop)] = ancestors_of(outs)
        else:
            static, needed = entry_static, entry_needed
        seen = {start}
        todo = [start]
        cone: list[Instruction] = []
        while todo:
            inst = todo.pop()
            cone.append(inst)
            for o in inst.operands:
                if o in seen or o in static or o.opcode in _RECOMPUTE_SOURCES or _through_markers(o) in producers:
                    continue
                if o.opcode == "get-tuple-element" and _through_markers(o.operands[0]).opcode in (
                        "parameter", "while", "call", "conditional"):
                    continue  # loop state, a call's result: there in the backward pass
                seen.add(o)
                todo.append(o)
        # what only residuals read is computed once either way: forward when saved, backward
        # when recomputed (a derivative JAX's linearization computes ahead, cos x of sin x)
        cone = [i for i in cone if i in needed]
        cones[id(r)] = cone
        for inst in cone:
            shared[inst] = shared.get(inst, 0) + 1
    seconds = {id(r): sum(_seconds(an, inst) / shared[inst] for inst in cones[id(r)]) for r in residuals}
    flops = {id(r): sum(_flops(an, inst) / shared[inst] for inst in cones[id(r)]) for r in residuals}
    return seconds, flops


def _seconds(an: Analyzed, inst: Instruction) -> float:
    """The cost model's seconds for one execution of ``inst`` (0 for what it does not time)."""
    return an.cost.seconds(inst) if inst.name in an.cost.per_instruction else 0.0


def _flops(an: Analyzed, inst: Instruction) -> float:
    """The cost model's FLOPs for one execution of ``inst`` (0 for what it does not count)."""
    return an.cost.of(inst).flops if inst.name in an.cost.per_instruction else 0.0


def _stack_keep_s(an: Analyzed, r: Any) -> float:
    """Modeled seconds the step as lowered spends keeping a scanned residual for the backward
    pass, which a plan that recomputes it does not spend: the forward loop's
    ``dynamic-update-slice`` writing each layer's value into the ``[L, ...]`` stack and the
    backward loop's ``dynamic-slice`` reading it back, once per iteration each. The module is
    lowered with every residual saved, so its step time holds these for every residual; JAX's
    scan lowered with the residual recomputed has neither. (The stack's zero initial value is
    left in: one broadcast feeds every stack of a shape, and stays while any of them does.)
    Zero for a residual kept outside a loop: it is held, not copied."""
    from hloopt.passes.loops import trip_count

    if not r.stacked or r.inst.opcode != "get-tuple-element" or r.forward_loop is None:
        return 0.0
    total = 0.0
    root = r.forward_loop.called["body"][0].root
    k = r.inst.tuple_index
    if root.opcode == "tuple" and k < len(root.operands) and root.operands[k].opcode == "dynamic-update-slice":
        dus = root.operands[k]
        # with the views and checkpoint_name marker between the value and the stack write, there
        # only to save it
        fwd = _seconds(an, dus)
        v = dus.operands[1] if len(dus.operands) > 1 else None
        while v is not None and v.opcode in _MARKERS and len(v.users) == 1 and v.operands:
            fwd += _seconds(an, v)
            v = v.operands[0]
        total += fwd * (trip_count(r.forward_loop) or r.layers)
    bl = r.backward_loop
    if bl is not None and bl.operands and bl.operands[0].opcode == "tuple":
        trips = trip_count(bl) or r.layers
        for u in _stack_reads(bl, r.inst):
            # with the views that take the stack's slice back to the value's shape
            bwd = _seconds(an, u)
            while len(u.users) == 1 and u.users[0].opcode in _MARKERS:
                u = u.users[0]
                bwd += _seconds(an, u)
            total += trips * bwd
    return total


def _stack_reads(loop: Instruction, stack: Instruction) -> list[Instruction]:
    """The ``dynamic-slice`` instructions of ``loop``'s body that read ``stack``, an element of the
    tuple the loop starts from."""
    elements = {j for j, o in enumerate(loop.operands[0].operands) if o is stack}
    body = loop.called["body"][0]
    return [u for param in body.parameters for g in param.users
            if g.opcode == "get-tuple-element" and g.tuple_index in elements
            for u in g.users if u.opcode == "dynamic-slice" and u.operands[0] is g]


def _stack_start(an: Analyzed, r: Any, smap: StepMap, *, default: int) -> int:
    """First step at which a stacked residual's ``[L, ...]`` buffer is allocated (its zero
    initial value before the forward loop, which the loop updates in place)."""
    try:
        b = an.ranges.aliasing.buffer_at(r.inst, ())
    except (KeyError, IndexError):
        return default
    t = an.counted(b.id)[0]
    if t < 0:
        return default
    return min(default, smap.first[an.ranges.entry_step[t]])


def _instance_shape(r: Any) -> str:
    s = r.shape
    if r.layers > 1 and r.layer_axis is not None:
        dims = r.per_layer_dims
        return f"{s.element_type}[{','.join(map(str, dims))}]"
    return s.to_text(layout=False)


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


@dataclass
class AnchorResult:
    name: str
    kind: str
    code: str
    peak_bytes: int
    step_time_s: float
    decisions: Decisions


@dataclass
class PlanOutcome:
    """Everything ``hloopt plan`` shows: the plan, the problem, replays and the anchors."""

    plan: Any
    problem: Problem
    analyzed: Analyzed
    baseline: SimResult
    result: SimResult
    decisions: Decisions
    anchors: list[AnchorResult] = field(default_factory=list)
    #: the program as written (no policy change), analyzed: its peak, when a JAX target
    as_written_peak_bytes: int | None = None

    #: top-level packages the target's factory uses (frameworks.imported_by), to name its switch
    imports: frozenset[str] = frozenset()
    #: set when the memory model puts the planned step over the budget (_settle_on_the_model)
    settle_note: str | None = None
    #: the plan's policy offloads more values than the plan decides (a rule selecting beyond its
    #: residuals), counted on the step lowered with it; None when the counts agree
    policy_note: str | None = None
    #: set when a built-in policy replaced the searched plan (_fewer_flops_builtin)
    choice_note: str | None = None
    #: (policy, the memory model's peak of the step lowered with it, its FLOPs as lowered), for
    #: the searched rules and each built-in :func:`_fewer_flops_builtin` compared them with
    lowered_rows: list[tuple[str, int, float]] = field(default_factory=list)
    #: the plan's policy and every other policy hloopt knows that moves values to host memory or
    #: is a MaxText preset, each judged on the step lowered with it (:func:`judge_lowered`): with
    #: ``judge="flops"``; the plan's row first
    judged_rows: list[tuple[str, LoweredJudgment]] = field(default_factory=list)
    #: what the judgment of the lowered steps says against the plan (:func:`judged_notes`)
    judged_notes: tuple[str, ...] = ()
    #: what ``lowered_rows`` hold: ``"flops"`` (the memory model's peak, FLOPs as lowered) or
    #: ``"compiled"`` (libtpu's peak, the compiled module's roofline seconds)
    judge: str = "flops"
    #: the budget the replay searched under, where it differs from the user's: the replay put
    #: the budget below its least peak and the memory model did not (_model_shifted_budget); the
    #: policies in the table are judged against it, as the plan was
    aim_bytes: int | None = None
    #: the search's settings, for searching again under other constraints (config_only_plan)
    max_slowdown: float | None = None
    solver: str = "auto"
    time_limit_s: float = 10.0
    #: the resolved TARGET and the platform it was lowered for (config_only_plan lowers it again)
    target: Any = None
    platform: str | None = None

    def unmovable_line(self) -> str | None:
        return unmovable_residuals_line(self.analyzed.residuals, imports=self.imports)


def unmovable_residuals_line(rs: Any, *, imports: Iterable[str] = ()) -> str | None:
    """For a program that saves no residual inside a ``jax.checkpoint``: one line with the
    residual bytes no policy can move and the switch of its framework that puts its layers under
    one. None when some residual is under a checkpoint (the program has checkpointing; what it
    saves outside, such as each checkpoint's own inputs, is the plan's business)."""
    from hloopt.frameworks import framework_of, unmovable_line

    if any(under_checkpoint(r) for r in rs):
        return None
    files = _stack_files(rs)
    return unmovable_line(rs.total_bytes, framework_of(files, modules=imports), files)


def _stack_files(rs: Any, *, frames: int = 64) -> list[str]:
    """The files of every frame in the residual producers' call stacks (HLO stack-frame table)."""
    files: list[str] = []
    for r in rs:
        fid = r.producer.metadata.stack_frame_id
        for _ in range(frames):
            fr = rs.module.stack_frame(fid) if fid else None
            if fr is None:
                break
            files.append(fr.file)
            fid = fr.parent_id
    return files


def lower_for_plan(target: Any, profile: DeviceProfile, *, platform: str | None = None,
                   compile: str | None = None, progress: Progress = _no_progress,
                   base_policy: Any = None) -> tuple[Module, str]:
    """Lower a JAX target with every residual saved (or under ``base_policy``); parse it.
    Returns (module, source)."""
    import jax

    plat = platform or ("tpu" if profile.kind == "tpu" else "cuda")
    with progress(f"lowering {target.name} for {compile or plat}"):
        return _lowered_module(target, plat, base_policy or jax.checkpoint_policies.everything_saveable, compile)


def _lowered_module(target: Any, platform: str, policy: Any, compile: str | None) -> tuple[Module, str]:
    """``target`` lowered for ``platform`` with every checkpoint taking ``policy`` (None: its own),
    parsed; with ``compile``, the compiler's module. Returns (module, source)."""
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower

    low = lower(target, platform=platform, policy=policy, compile=compile)
    text = low.compiled_text if compile else low.hlo_text
    assert text is not None, "lower(compile=...) returns the compiled text"
    source = f"compiled:{compile}" if compile else f"lowered:{platform}"
    return parse_module(text, filename=f"<{target.name} {source}>"), source


def resolve_budget(spec: str | None, baseline_peak_bytes: int) -> int | None:
    """``"75%"`` of the all-on-device peak, or an absolute size; None when not given."""
    if spec is None:
        return None
    from hloopt.units import parse_budget

    b = parse_budget(spec)
    if b.fraction is not None:
        return int(b.fraction * baseline_peak_bytes)
    assert b.bytes is not None, "a budget is a fraction or a size"
    return int(b.bytes)


def resolve_mode(budget: str | None, max_slowdown: float | None, pareto: bool,
                 baseline_peak_bytes: int) -> tuple[int | None, str]:
    """The budget in bytes (or None) and the search mode: "pareto", "budget" or "max-slowdown"."""
    budget_bytes = resolve_budget(budget, baseline_peak_bytes)
    if budget_bytes is None and max_slowdown is None and not pareto:
        raise UserError("say what to optimize: --budget SIZE|PCT, --max-slowdown PCT, or --pareto")
    return budget_bytes, "pareto" if pareto else ("budget" if budget_bytes is not None else "max-slowdown")


def run_anchors(problem: Problem) -> list[AnchorResult]:
    from hloopt.anchors import ANCHORS, expressible
    from hloopt.simulator import simulate

    out = []
    for a in ANCHORS:
        if not expressible(a, problem):
            continue
        d = a.decisions(problem)
        r = simulate(problem, d)
        out.append(AnchorResult(a.name, a.kind, a.code, r.peak_bytes, r.step_time_s, d))
    return out


def _reason(c: Candidate, action: Action, problem: Problem) -> str:
    from hloopt.units import format_seconds

    flops_objective = problem.notes.get("objective") == "flops"
    if action == Action.OFFLOAD:
        per = c.instances[0]
        move_s = problem.transfer_latency_s + per.bytes / max(problem.d2h_bytes_per_s, 1.0)
        why = f"frees {c.bytes} B between forward and backward; each move {format_seconds(move_s)}" + (
            " (objective flops: no FLOPs)" if flops_objective else "")
        if f"eager:{c.key}" in problem.notes:
            why += f" ({problem.notes[f'eager:{c.key}']})"
        return why
    if action == Action.REMAT:
        if flops_objective and c.state is None:
            return f"recomputing it re-runs {c.remat_flops / 1e9:.4g} GFLOP (objective flops)"
        if c.remat_s < 0:
            return f"recomputing it is {format_seconds(-c.remat_s)} faster than keeping its stack"
        return f"recompute costs {format_seconds(c.remat_s)}, cheaper than moving it"
    if Action.OFFLOAD not in c.allowed:
        if f"kept:{c.key}" in problem.notes:
            return problem.notes[f"kept:{c.key}"]
        if c.name is None and c.primitive and not policy_selectable(c.primitive):
            return f"a policy cannot select {c.primitive} values by primitive"
        return "outside jax.checkpoint: no policy can move it"
    return "fits the budget on device"


def make_plan(target_spec: str, an: Analyzed, problem: Problem, profile: DeviceProfile, *,
              budget_spec: str | None, budget_bytes: int | None, mode: str, decisions: Decisions,
              result: SimResult, baseline: SimResult, solver: Mapping[str, Any],
              pareto: Sequence[Any] | None = None, host_budget_bytes: int | None = None,
              model_least_peak_bytes: int | None = None) -> Any:
    """The Plan record of ``decisions``. ``model_least_peak_bytes``: the memory model's peak of the
    step with nothing saved, where it was computed; the least peak the plan reports is the lower
    of it and the replay's."""
    from hloopt.plan import Bounds, Budget, Decision, ParetoPoint, Plan, Predicted, Selector, SolverInfo, StateDecision
    from hloopt.simulator import lower_bound_peak, lower_bound_time

    groups = candidate_groups(an.residuals)
    decs = []
    state = []
    for c in problem.candidates:
        a = decisions.action(c.key)
        if c.state is not None:
            where = {Action.OFFLOAD: "host", Action.REMAT: "host-compute"}.get(a, "device")
            for g in c.state.split(", "):
                size = int(problem.notes.get(f"state-bytes:{g}", c.bytes))
                state.append(StateDecision(group=g, placement=where, bytes=size, reason=_state_reason(c, a, problem),
                                           role="optimizer" if c.key == OPTIMIZER_KEY else "parameters"))
            continue
        if c.name:
            sel = Selector.by_name(c.name)
        else:
            sel = Selector.by_primitive(c.primitive or "unknown", source=c.source or None,
                                        shape=c.shape or None)
        decs.append(Decision(
            key=c.key, name=c.name, selector=sel, action=a.value, bytes=c.bytes,
            layers=len(c.instances), shape=c.shape, reason=_reason(c, a, problem), source=c.source,
            values=tuple(sorted({r.inst.name for r in groups.get(c.key, ())})),
        ))
    return Plan(
        target=target_spec, module=an.module.name, device=profile.to_dict(),
        budget=None if budget_bytes is None else Budget(spec=budget_spec or str(budget_bytes), bytes=budget_bytes),
        mode=mode, decisions=tuple(decs),
        predicted=Predicted(peak_bytes=result.peak_bytes, step_time_s=result.step_time_s,
                            exposed_transfer_s=result.exposed_transfer_s,
                            baseline_peak_bytes=baseline.peak_bytes,
                            baseline_step_time_s=baseline.step_time_s),
        bounds=Bounds(least_peak_bytes=min(lower_bound_peak(problem), model_least_peak_bytes)
                      if model_least_peak_bytes is not None else lower_bound_peak(problem),
                      least_step_time_s=lower_bound_time(problem)),
        solver=SolverInfo(name=str(solver.get("name", "")), status=str(solver.get("status", "")),
                          gap=solver.get("gap"), time_s=float(solver.get("time_s", 0.0))),
        pareto=None if pareto is None else tuple(
            ParetoPoint(peak_bytes=p.peak_bytes, step_time_s=p.step_time_s,
                        actions={k: v.value for k, v in sorted(p.decisions.actions.items())})
            for p in pareto),
        state=tuple(state), host_budget_bytes=host_budget_bytes if state else None,
        host_peak_bytes=max(result.host_timeline_bytes, default=0) if state else None,
        objective=problem.notes.get("objective", "time"),
    )


def check_objective(objective: str, *, budgeted: bool = True) -> None:
    """One line (a :class:`UserError`) for an objective ``plan`` cannot take: not one of
    :data:`hloopt.plan.OBJECTIVES`, or ``"flops"`` without a budget (``budgeted``) to fit."""
    from hloopt.plan import OBJECTIVES

    if objective not in OBJECTIVES:
        raise UserError(f"unknown objective {objective!r}: expected one of {', '.join(map(repr, OBJECTIVES))}")
    if objective == "flops" and not budgeted:
        raise UserError("--objective flops needs a --budget: it plans the fewest FLOPs that fit it")


def for_objective(problem: Problem, objective: str, profile: DeviceProfile | None = None) -> Problem:
    """``problem`` as the search should see it for ``objective`` (:data:`hloopt.plan.OBJECTIVES`).

    ``"time"``: as built, the step time with every wait on the link. ``"flops"``: the fewest
    recomputed FLOPs that fit. The search then weighs no wait on the link
    (``Problem.stall_weight`` 0) and counts each recomputation by its FLOPs
    (``Candidate.remat_flops`` at the profile's bf16 peak: seconds at the chip's peak, so the
    objective stays in the simulator's units) rather than by the roofline, which charges
    element-wise ops memory traffic XLA's fusion removes and credits recomputation with the stack
    writes and reads keeping a scanned value costs. The link keeps its rates: a copy still holds
    its device bytes until it is done, and a reload is on device early enough, so the memory a
    plan needs is counted as for ``"time"`` (with an instant link the count fell 20% short of
    libtpu on a plan moving 856 MiB). The argument groups (``--state``) keep their costs. The
    objective is noted in ``problem.notes`` and the plan records it."""
    check_objective(objective)
    if objective == "time":
        return problem
    rate = profile.flops_per_s("bf16") if profile is not None else 1e12
    candidates = tuple(c if c.state is not None else
                       dataclasses.replace(c, remat_s=c.remat_flops / rate, keep_s=0.0, host_compute_s=0.0)
                       for c in problem.candidates)
    return dataclasses.replace(problem, candidates=candidates, stall_weight=0.0,
                               notes={**problem.notes, "objective": objective})


def _state_reason(c: Candidate, action: Action, problem: Problem) -> str:
    from hloopt.units import format_seconds

    per = c.instances[0]
    move_s = 2 * problem.transfer_latency_s + per.bytes / max(problem.d2h_bytes_per_s, 1.0) \
        + per.bytes / max(problem.h2d_bytes_per_s, 1.0)
    if action == Action.OFFLOAD:
        return (f"in host memory until step {per.first_backward_use} reads it: frees {c.bytes} B before; "
                f"in and out {format_seconds(move_s)}")
    if action == Action.REMAT:
        return (f"optimizer update computed on the host: {c.bytes} B of state never on the device; "
                f"adds {format_seconds(c.remat_s)} (host update, gradients out, parameters in)")
    if f"kept:{c.key}" in problem.notes:
        return problem.notes[f"kept:{c.key}"]
    return f"kept on device (moving it in and out would take {format_seconds(move_s)})"


def analyze_target(tgt: Any, profile: DeviceProfile, *, platform: str | None = None,
                   compile: str | None = None, progress: Progress = _no_progress,
                   base_policy: Any = None, state: bool = False,
                   host_budget_bytes: int | None = None, host: str | None = None) -> tuple[Analyzed, Problem]:
    """The analyses and the Problem ``plan`` searches, for a resolved TARGET.

    A JAX target is lowered with every residual saved (``base_policy``: with what that policy
    saves, the rest recomputed), its residuals named by re-lowering with one-name policies and
    its primitive rules probed; an HLO target is parsed as it is. ``state``: the step's argument
    groups that it updates are candidates too (:func:`add_state_candidates`; a JAX target).
    """
    names: dict[str, str] = {}
    if tgt.kind == "jax":
        from hloopt.passes.inline import inline_for_assignment

        module, source = lower_for_plan(tgt, profile, platform=platform, compile=compile, progress=progress,
                                        base_policy=base_policy)
        module = inline_for_assignment(module)  # as analyze_module does
        with progress("naming residuals (re-lowering with one-name policies)"):
            names = _names_for(tgt, module, profile, platform=platform, base_policy=base_policy)
    else:
        from hloopt.hlo.parser import parse_module

        assert tgt.text is not None, "an HLO target is read when resolved"
        module = parse_module(tgt.text, filename=str(tgt.path))
        source = "hlo"
    with progress("analyzing memory, residuals and costs"):
        an = analyze_module(module, profile, source=source, names=names)
        problem, smap = build_problem(an, profile)
    if not problem.candidates:
        raise UserError(f"{tgt.name}: found no forward->backward residuals to offload "
                        "(is this a training step with a backward pass?)")
    if tgt.kind == "jax" and base_policy is None:
        with progress("checking what each primitive rule selects (re-lowering)"):
            problem = probe_rules(tgt, problem, names.values(), platform=platform or (
                "tpu" if profile.kind == "tpu" else "cuda"))
        if profile.kind == "tpu" and compile is None and (platform or "tpu") == "tpu":
            with progress("checking recomputation inside scanned layers against the memory model"):
                problem = loop_remat_on_the_model(tgt, problem)
    if state:
        if tgt.kind != "jax":
            raise UserError(f"{tgt.name}: placing the step's arguments needs a JAX TARGET (file.py:factory), "
                            f"not a {tgt.kind} file")
        from hloopt.hosts import load_host_profile

        groups, outputs, elements = state_layout(tgt)
        host_profile = load_host_profile(host) if host is not None else None
        # accelerators sharing one host: its memory over the device profile's host memory per chip
        # (tpu-v5e: 512 GiB host DRAM, 64 GiB per chip -> 8)
        share = max(1, round(host_profile.host_memory_bytes / profile.host_memory_bytes)) \
            if host_profile is not None and profile.host_memory_bytes else 1
        problem = add_state_candidates(an, problem, smap, groups, outputs=outputs,
                                       host_budget_bytes=host_budget_bytes, elements=elements,
                                       host=host_profile, host_share=share, device_kind=profile.kind)
    return an, problem


def state_layout(tgt: Any) -> tuple[tuple[Any, ...], dict[str, list[int]], dict[str, tuple[int, int]]]:
    """The step's argument groups (:func:`hloopt.state.state_groups`); per group, the indices of
    its updated leaves among the step's flattened outputs (the lowered module's root tuple); and
    per group its element count and largest element size in bytes."""
    import functools

    import jax
    from jax.tree_util import SequenceKey, keystr

    from hloopt.state import state_groups

    step = functools.partial(tgt.step_fn, **dict(tgt.kwargs)) if tgt.kwargs else tgt.step_fn
    args = tuple(tgt.args)
    out = jax.eval_shape(step, *args)  # traced once, for the groups and their outputs
    groups = state_groups(step, args, out=out)
    by_leaf = {(g.argnum, leaf): g.name for g in groups if g.updated for leaf in g.leaves}
    outputs: dict[str, list[int]] = {}
    leaves = jax.tree_util.tree_flatten_with_path(out)[0]
    for k, (path, _) in enumerate(leaves):
        if path and isinstance(path[0], SequenceKey):
            name = by_leaf.get((path[0].idx, keystr(path[1:])))
            if name is not None:
                outputs.setdefault(name, []).append(k)
    import numpy as np

    elements: dict[str, tuple[int, int]] = {}
    for i, arg in enumerate(args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            name = by_leaf.get((i, keystr(path)))
            if name is None or not hasattr(leaf, "shape"):
                continue
            n, b = elements.get(name, (0, 0))
            elements[name] = (n + int(np.prod(leaf.shape, dtype=np.int64)), max(b, np.dtype(leaf.dtype).itemsize))
    return groups, outputs, elements


#: the memory model's peak of a target lowered with nothing saved, per live Target (plan and
#: config_only_plan both ask for the same step)
_nothing_saved: dict[int, tuple[weakref.ref[Any], int]] = {}


def loop_remat_on_the_model(tgt: Any, problem: Problem) -> Problem:
    """Where the memory model says so, a scanned layer's recomputed values are temporaries of the
    loop iterations that compute them, not buffers counted on top of those iterations.

    The replay counts a residual as a buffer: under REMAT live in the forward iteration that
    produces it and again through the backward iteration that recomputes it, on top of the step's
    base there, the all-saved loop body's working set (which writes the value into its stack
    in place, and whose backward ops work on what the recomputation gives back). Without the
    stack, XLA computes the layer's values as temporaries of the iteration, dying as their
    readers run: summed on top of the base, a Llama layer's attention scores put the least peak of
    MaxText's step at twice what libtpu compiles with nothing saved. The memory model decides
    (``hloopt analyze``'s TPU prediction of the step lowered with ``nothing_saveable``): if the
    replay of "recompute every value that can be", with the loop candidates' recomputed values
    counted as temporaries of their iterations (``remat_transient``), is not below the model's
    figure, the loop candidates are marked so; otherwise the replay's count stands. A note
    records the figures either way."""

    from hloopt.simulator import simulate
    from hloopt.units import format_bytes

    loop = {c.key for c in problem.candidates if c.in_loop and Action.REMAT in c.allowed}
    if not loop:
        return problem
    modeled = _nothing_saved_on_the_model(tgt)
    inside = dataclasses.replace(problem, candidates=tuple(
        dataclasses.replace(c, remat_transient=True) if c.key in loop else c for c in problem.candidates))
    every = Decisions({c.key: Action.REMAT for c in inside.candidates if Action.REMAT in c.allowed})
    replayed = simulate(inside, every).peak_bytes
    summed = simulate(problem, every).peak_bytes
    figures = (f"nothing saved: memory model {format_bytes(modeled)}; replay with scanned values "
               f"recomputed as temporaries of their iterations {format_bytes(replayed)}, as buffers "
               f"{format_bytes(summed)}")
    if replayed < modeled:
        return dataclasses.replace(problem, notes={**problem.notes, "loop-remat": f"as buffers ({figures})"})
    return dataclasses.replace(inside, notes={**inside.notes, "loop-remat": f"as temporaries ({figures})"})


def plan(target: str | Any, *, profile: DeviceProfile, budget: str | None = None,
         max_slowdown: float | None = None, pareto: bool = False, platform: str | None = None,
         compile: str | None = None, solver: str = "auto", time_limit_s: float = 10.0,
         size: str | None = None, progress: Progress = _no_progress, state: bool = False,
         host_budget: str | None = None, host: str | None = None, judge: str = "flops",
         objective: str = "time", measure_steps: int = 10) -> PlanOutcome:
    """Run the whole pipeline on a TARGET (see the module docstring).

    ``judge``: how the searched plan and JAX's built-in policies are compared once each is lowered
    (:func:`_fewer_flops_builtin`): ``"flops"`` (the memory model's peak, FLOPs as lowered) or
    ``"compiled"`` (each compiled by libtpu for the profile's TPU: its peak, and the roofline time
    of the module libtpu compiled), or ``"measured"``: compared as ``"flops"`` compares them, then
    the plan and every built-in policy and MaxText preset predicted within the budget run on this
    machine's JAX device (which must be the profile's kind), ``measure_steps`` timed steps each,
    and the fastest takes the plan's place (:func:`measured_choice`).

    ``objective``: what the search minimises (:func:`for_objective`): ``"time"``, the step time
    with every transfer timed; ``"flops"``, recomputation alone (no weight on waiting for the link,
    memory counted as for ``"time"``), where a policy judged as lowered replaces the plan when it
    fits with fewer FLOPs whatever its transfers.

    ``state``: the step's argument groups it updates (parameters, optimizer state) are placed
    with the residuals, in one search, under ``budget`` on the device and ``host_budget`` on the
    host (bytes or a size such as ``"64GiB"``; default the device profile's host memory per
    chip): a plan whose offloads fill more host memory than that is searched again without its
    largest offloaded candidate, until it fits. ``host``: the host CPU profile that times an
    optimizer update computed on the host (:mod:`hloopt.hosts`; default
    :data:`hloopt.hosts.DEFAULT_HOST`)."""
    from hloopt.analysis import step_notes
    from hloopt.search import search
    from hloopt.simulator import lower_bound_peak, simulate
    from hloopt.solvers.bounds import below_least_peak
    from hloopt.targets import Target, resolve

    if judge == "compiled":
        _compile_target_of(profile)  # a profile libtpu cannot compile for is one line before any work
    elif judge == "measured":
        measuring_device(profile)  # likewise a machine without the profile's device
        if budget is None or pareto or state:
            raise UserError("--judge measured times the policies that fit a budget: give --budget "
                            "(not --pareto or --state)")
        if measure_steps < 1:
            raise UserError(f"measure_steps must be >= 1, got {measure_steps}")
    elif judge != "flops":
        raise UserError(f"unknown judge {judge!r}: expected 'flops', 'compiled' or 'measured'")
    model_judge = "flops" if judge == "measured" else judge  # how the model compares before measuring
    tgt = target if isinstance(target, Target) else resolve(target, size=size)
    if judge == "measured" and tgt.kind != "jax":
        raise UserError(f"{tgt.name}: --judge measured runs a JAX step (file.py:factory); an HLO file cannot be run")
    as_written = None
    host_budget_bytes = None
    if state:
        from hloopt.units import parse_bytes

        host_budget_bytes = parse_bytes(host_budget) if host_budget is not None else profile.host_memory_bytes
    elif host_budget is not None:
        raise UserError("--host-budget applies to plans that place the step's arguments (--state)")
    if state and host is None:
        from hloopt.hosts import DEFAULT_HOST

        host = DEFAULT_HOST
    check_objective(objective, budgeted=budget is not None and not pareto)
    an, analyzed_problem = analyze_target(tgt, profile, platform=platform, compile=compile, progress=progress,
                                          state=state, host_budget_bytes=host_budget_bytes, host=host)
    problem = for_objective(analyzed_problem, objective, profile)
    baseline = simulate(problem, Decisions.all_device())
    budget_bytes, mode = resolve_mode(budget, max_slowdown, pareto, baseline.peak_bytes)
    # the memory model checks the planned step (_settle_on_the_model) where it describes the device
    on_the_model = (budget_bytes is not None and not pareto and tgt.kind == "jax" and profile.kind == "tpu"
                    and compile is None and an.memory is not None)
    aim = budget_bytes  # the budget the replay searches under (see _model_shifted_budget)
    t0 = time.perf_counter()
    for _ in range(len(problem.candidates) + 1):
        with progress(f"searching {len(problem.candidates)} candidates"):
            try:
                try:
                    sr = search(problem, budget_bytes=aim, max_slowdown=max_slowdown, pareto=pareto,
                                solver=solver, time_limit_s=time_limit_s)
                except InfeasibleBudget as err:
                    if not on_the_model or budget_bytes is None:
                        raise
                    shifted = _model_shifted_budget(tgt, problem, budget_bytes)
                    if shifted is None:
                        least = min(lower_bound_peak(problem), _nothing_saved_on_the_model(tgt))
                        raise InfeasibleBudget(below_least_peak(budget_bytes, least)) from err
                    aim = shifted
                    sr = search(problem, budget_bytes=aim, max_slowdown=max_slowdown, pareto=pareto,
                                solver=solver, time_limit_s=time_limit_s)
            except InfeasibleBudget as err:
                hints = [unmovable_residuals_line(an.residuals, imports=_imports(tgt)),
                         *(step_notes(an.memory) if an.memory is not None else [])]
                if not any(hints):
                    raise
                raise InfeasibleBudget("; ".join([str(err), *(h for h in hints if h)])) from err
        if host_budget_bytes is None or host_bytes_of(problem, sr.plan.decisions) <= host_budget_bytes:
            break
        # over the host budget: the largest offloaded candidate stays off the host, search again
        worst = max((c for c in problem.candidates if sr.plan.decisions.action(c.key) == Action.OFFLOAD),
                    key=lambda c: (c.bytes, c.key))
        problem = dataclasses.replace(problem, candidates=tuple(
            dataclasses.replace(c, allowed=c.allowed - {Action.OFFLOAD}) if c.key == worst.key else c
            for c in problem.candidates))
    chosen = sr.plan
    decisions = chosen.decisions
    result = simulate(problem, decisions)
    if aim is not None and result.peak_bytes > aim:
        raise UserError(f"internal: the chosen plan replays to {result.peak_bytes} B over the budget "
                        f"{aim} B")

    def build(problem: Problem, decisions: Decisions, result: SimResult) -> Any:
        gap = chosen.mip_gap if chosen.mip_gap == chosen.mip_gap else None  # NaN: no MILP ran
        status = chosen.status or ("optimal" if chosen.optimal else "feasible")
        solver_info = {"name": chosen.solver, "status": status, "gap": gap,
                       "time_s": round(time.perf_counter() - t0, 3)}
        return make_plan(tgt.name, an, problem, profile, budget_spec=budget, budget_bytes=budget_bytes,
                         mode=mode, decisions=decisions, result=result, baseline=baseline,
                         solver=solver_info, pareto=list(sr.pareto) if pareto else None,
                         host_budget_bytes=host_budget_bytes,
                         model_least_peak_bytes=_nothing_saved_on_the_model(tgt) if on_the_model else None)

    plan_obj = build(problem, decisions, result)
    searched = problem
    settle_note = policy_note = None
    # the check re-lowers the step with the plan's policy only, not its argument placements
    # (hloopt.apply_plan(plan, step, args) applies those); on TPU no group leaves the device
    hosted = any(c.state is not None and decisions.action(c.key) != Action.DEVICE for c in problem.candidates)
    if not hosted and on_the_model:
        with progress("checking the plan against the memory model (re-lowering with its policy)"):
            plan_obj, decisions, result, problem, settle_note, policy_note = _settle_on_the_model(
                tgt, problem, plan_obj, decisions, result, budget_bytes, build, platform=platform,
                solver=solver, time_limit_s=time_limit_s, aim=aim)
    choice_note = None
    lowered_rows: list[tuple[str, int, float]] = []
    judged_rows: list[tuple[str, LoweredJudgment]] = []
    judged_notes: tuple[str, ...] = ()
    if not hosted and on_the_model:
        with progress("comparing built-in policies on the memory model (re-lowering with each)"
                      if model_judge == "flops" else "compiling the plan and each built-in policy with libtpu"):
            plan_obj, decisions, result, choice_note, lowered_rows = _fewer_flops_builtin(
                tgt, problem, plan_obj, decisions, result, budget_bytes, build, profile, platform=platform,
                over=settle_note is not None, judge=model_judge)
        if choice_note is not None:
            settle_note = policy_note = None  # the plan is a built-in policy now
        if model_judge == "flops" and budget_bytes is not None:
            with progress("judging the offloading policies and MaxText presets (re-lowering with each)"):
                judged_rows = judge_other_anchors(tgt, searched, plan_obj, profile, platform=platform)
            adopted = _offloading_builtin(searched, plan_obj, judged_rows, budget_bytes, build)
            if adopted is None:
                judged_notes = judged_notes_of(plan_obj, judged_rows, budget_bytes)
            else:
                plan_obj, decisions, result, choice_note = adopted
                settle_note = policy_note = None
                judged_rows = [("hloopt's searched rules", judged_rows[0][1]), *judged_rows[1:]]
    if judge == "measured" and budget_bytes is not None:
        from hloopt.measure import measure

        measurement = measure(tgt, profile=profile, plan=plan_obj, policies="builtin", steps=measure_steps,
                              warmup=2, compile=compile, progress=progress, analyzed=(an, analyzed_problem))
        taken, acts, res, note, advice = measured_choice(searched, plan_obj, measurement, build)
        plan_obj = taken
        if note is not None:
            settle_note = policy_note = None
            judged_notes = ()
            decisions, result, choice_note = acts, res, note
        # what the measurement says of its own figures (host-bound rows time the host's dispatch)
        judged_notes = (*judged_notes, *([advice] if advice else []),
                        *(f"measured: {n}" for n in measurement.notes))
    if on_the_model:
        with progress("analyzing the step as written"):
            as_written = _as_written_on_the_model(tgt)
    anchors = run_anchors(searched)  # every policy judged on the whole choice, not the settled one
    return PlanOutcome(plan_obj, problem, an, baseline, result, decisions, anchors, as_written,
                       imports=frozenset(_imports(tgt)), max_slowdown=max_slowdown, solver=solver,
                       time_limit_s=time_limit_s, settle_note=settle_note, policy_note=policy_note,
                       choice_note=choice_note,
                       lowered_rows=lowered_rows, judged_rows=judged_rows, judged_notes=judged_notes, judge=judge,
                       aim_bytes=aim if aim != budget_bytes else None,
                       target=tgt if compile is None else None, platform=platform)


#: re-searches with a tighter budget when the memory model puts the planned step over the budget
SETTLE_ROUNDS = 3


def _model_shifted_budget(tgt: Any, problem: Problem, budget_bytes: int | None) -> int | None:
    """The budget for the replay to search under when it puts ``budget_bytes`` below the least
    peak it reaches but the memory model puts the step with nothing saved within it; None when
    the model agrees that no policy fits.

    The replay takes a decision off the analyzed timeline linearly; the model (libtpu's larger of
    two heaps over memory-space assignment, iterations' temporaries) does not, and on a small step
    its "nothing saved" can sit well under the replay's (a 4-layer scan: 16.0 MiB by the model,
    18.0 MiB replayed). The replay's figures are moved by that gap, its least peak lining up with
    the model's; the planned step is then checked on the model against the budget itself
    (:func:`_settle_on_the_model`), which lowers the aim again where the shift was too much."""
    from hloopt.simulator import lower_bound_peak

    if budget_bytes is None:
        return None
    modeled = _nothing_saved_on_the_model(tgt)
    if modeled > budget_bytes:
        return None
    floor = lower_bound_peak(problem)
    return max(floor, budget_bytes + (floor - modeled)) if floor > modeled else None


def _as_written_on_the_model(tgt: Any) -> int:
    """The memory model's peak of the step as its program is written (its own checkpoint
    policies, none imposed): what the user's step needs today, beside which a plan is judged."""
    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower

    text = lower(tgt, platform="tpu").hlo_text
    return int(analyze(parse_module(text, filename=f"{tgt.name} (as written)"), platform="tpu").peak_bytes)


def _nothing_saved_on_the_model(tgt: Any) -> int:
    """The memory model's peak (``hloopt analyze``'s TPU prediction) of the step lowered with
    ``nothing_saveable``: the least any policy gives by the model's count (cached per Target)."""
    import jax

    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower

    hit = _nothing_saved.get(id(tgt))
    if hit is not None and hit[0]() is tgt:
        return hit[1]
    text = lower(tgt, platform="tpu", policy=jax.checkpoint_policies.nothing_saveable).hlo_text
    modeled = int(analyze(parse_module(text, filename=f"{tgt.name} (nothing saved)"), platform="tpu").peak_bytes)
    _nothing_saved[id(tgt)] = (weakref.ref(tgt), modeled)
    return modeled


def _settle_on_the_model(tgt: Any, problem: Problem, plan_obj: Any, decisions: Decisions, result: SimResult,
                         budget_bytes: int | None, build: Callable[[Problem, Decisions, SimResult], Any], *,
                         platform: str | None, solver: str, time_limit_s: float,
                         aim: int | None = None
                         ) -> tuple[Any, Decisions, SimResult, Problem, str | None, str | None]:
    """A plan the memory model ``hloopt analyze`` runs puts within the budget, on the step lowered
    with the plan's policy.

    The Problem replays a decision by taking the residual's counted bytes off its live range; the
    memory model (libtpu's larger of the HBM and VMEM heaps over memory-space assignment,
    output-allocation reuse, the schedule, libtpu copying a value offloaded outside a loop straight
    back) does not move linearly with that, so the replay can be below the model on the planned
    step. The planned step is lowered and analyzed; while the model puts it over the budget: first
    offloads outside loops are taken out of the choices (libtpu copies them back at once, so they
    free nothing there), then the budget the search aims at is lowered by the overshoot, at most
    :data:`SETTLE_ROUNDS` searches in all. The plan keeps the replay's prediction (what its
    decisions take off the analyzed timeline) as ``replay_peak_bytes`` and the model's figure as its
    predicted peak; the next-to-last value is a note, with the model's figure, when no plan the
    model puts within the budget was found, the last one a note when the planned step offloads
    more values than the plan decides."""
    from hloopt.analysis import analyze
    from hloopt.emit import policy
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.search import search
    from hloopt.simulator import lower_bound_peak, simulate

    target = aim or budget_bytes or 0  # the budget the replay searched under
    best = None
    eager = [c for c in problem.candidates if f"eager:{c.key}" in problem.notes and Action.OFFLOAD in c.allowed]
    for round_ in range(SETTLE_ROUNDS + 1):
        planned = parse_module(lower(tgt, platform=platform or "tpu", policy=policy(plan_obj)).hlo_text,
                               filename=f"{tgt.name} (planned)")
        beyond = offloads_beyond_the_plan(plan_obj, planned)
        modeled = int(analyze(planned, platform="tpu").peak_bytes)
        # the first plan that fits (the fastest: searched under the loosest budget), else the lowest
        if best is None or modeled < best[0]:
            best = (modeled, plan_obj, decisions, result, problem, beyond)
        if budget_bytes is None or modeled <= budget_bytes or round_ == SETTLE_ROUNDS:
            break
        assert budget_bytes is not None
        if eager and any(decisions.action(c.key) == Action.OFFLOAD for c in eager):
            dropped = {c.key for c in eager}
            notes = dict(problem.notes)
            notes.update({f"kept:{k}": "outside a loop, where libtpu copies an offload straight back: "
                                       "such offloads did not fit once the step was lowered with them"
                           for k in dropped})
            problem = dataclasses.replace(problem, notes=notes, candidates=tuple(
                dataclasses.replace(c, allowed=c.allowed - {Action.OFFLOAD}) if c.key in dropped else c
                for c in problem.candidates))
            eager = []
        else:
            floor = lower_bound_peak(problem)
            if target <= floor:
                break  # the least peak the replay reaches was tried
            target = max(floor, target - (modeled - budget_bytes))
        try:
            decisions = search(problem, budget_bytes=target, solver=solver, time_limit_s=time_limit_s).plan.decisions
        except InfeasibleBudget:
            break
        result = simulate(problem, decisions)
        plan_obj = build(problem, decisions, result)
    assert best is not None
    if budget_bytes is not None and best[0] > budget_bytes:
        # the rounds did not reach the budget on the model: every value recomputed that can be
        # (what nothing_saveable does to the values the plan decides), which the model may put
        # within it where the replay's figures for the choices between are off
        decisions = Decisions({c.key: Action.REMAT for c in problem.candidates if Action.REMAT in c.allowed})
        if decisions.actions:
            result = simulate(problem, decisions)
            plan_obj = build(problem, decisions, result)
            planned = parse_module(lower(tgt, platform=platform or "tpu", policy=policy(plan_obj)).hlo_text,
                                   filename=f"{tgt.name} (planned)")
            beyond = offloads_beyond_the_plan(plan_obj, planned)
            modeled = int(analyze(planned, platform="tpu").peak_bytes)
            if modeled < best[0]:
                best = (modeled, plan_obj, decisions, result, problem, beyond)
    modeled, plan_obj, decisions, result, problem, beyond = best
    # One figure for the planned step: the memory model's (what ``hloopt analyze`` predicts for the
    # step lowered with the plan), which is the figure checked against the budget; the replay's
    # stays what the search compared choices by.
    plan_obj = dataclasses.replace(plan_obj, predicted=dataclasses.replace(
        plan_obj.predicted, peak_bytes=modeled, model_peak_bytes=modeled,
        replay_peak_bytes=plan_obj.predicted.peak_bytes))
    from hloopt.units import format_bytes

    over = None
    if budget_bytes is not None and modeled > budget_bytes:
        over = (f"the memory model puts the planned step at {format_bytes(modeled)}, over the budget "
                f"{format_bytes(budget_bytes)}: no plan it puts within the budget was found "
                f"(hloopt verify --compile tpu-... gives the compiler's figure)")
    return plan_obj, decisions, result, problem, over, beyond


def offloads_beyond_the_plan(plan_obj: Any, planned: Module | str) -> str | None:
    """A note when the step lowered with the plan's policy (``planned``, a module or its text)
    offloads more values than the plan decides to offload; None otherwise.

    A primitive rule (primitive and output shape) can select values the everything-saved step does
    not save: under the plan's policy more of the step is recomputed, and its values of that shape
    are saved -- and offloaded -- too. The memory model's figure for the planned step counts them;
    the plan's time does not (a flax scan step with ``jax.nn.dot_product_attention``: 32 reshapes
    offloaded for 24 planned)."""
    from hloopt.units import format_bytes
    from hloopt.verify import offload_annotations

    annotated = offload_annotations(planned)
    decided = sum(d.layers for d in plan_obj.of("offload"))
    moved = sum(a.count for a in annotated)
    if moved <= decided:
        return None
    moved_bytes = format_bytes(sum(a.count * a.bytes for a in annotated))
    return (f"the plan's policy offloads {moved} value(s) ({moved_bytes}) where the plan decides {decided}: "
            "a rule selects values beyond the residuals it was planned for, which move to host and back "
            "too (hloopt verify names the rule)")


def _compile_target_of(profile: DeviceProfile) -> str:
    """The deviceless compile target (:data:`hloopt.lowering.TPU_TOPOLOGIES`) of a TPU profile,
    built-in or calibrated from one (``tpu-v5e-calibrated``)."""
    from hloopt.lowering import TPU_TOPOLOGIES

    if profile.kind == "tpu":
        for name in sorted(TPU_TOPOLOGIES, key=len, reverse=True):
            if profile.name == name or profile.name.startswith(name + "-"):
                return name
    raise UserError(f"--judge compiled compiles with libtpu for a TPU profile ({', '.join(TPU_TOPOLOGIES)}, or one "
                    f"calibrated from them); the profile is {profile.name!r}")


def measuring_device(profile: DeviceProfile) -> Any:
    """This machine's JAX device, which ``--judge measured`` runs steps on; a one-line
    :class:`UserError` where it is not of the profile's kind (timings of a CPU would choose a
    TPU's plan by the CPU's costs)."""
    import jax

    dev = jax.devices()[0]
    want = {"tpu": ("tpu",), "gpu": ("gpu", "cuda", "rocm")}.get(profile.kind, (profile.kind,))
    if str(dev.platform).lower() not in want:
        raise UserError(f"--judge measured runs the step on this machine's JAX device, a {dev.platform} "
                        f"({dev.device_kind}), not a {profile.kind} like the profile {profile.name}: run hloopt "
                        "where that device is attached, or judge by --judge flops or compiled")
    return dev


def measured_choice(problem: Problem, plan_obj: Any, measurement: Any,
                    build: Callable[[Problem, Decisions, SimResult], Any]
                    ) -> tuple[Any, Any, Any, str | None, str | None]:
    """The plan as ``--judge measured`` leaves it, with what was measured (``Plan.measured``):
    ``(plan, decisions, result, note, advice)``; ``note`` None where the searched plan stays;
    ``advice`` a line where a MaxText preset ran fastest.

    ``measurement`` (:func:`hloopt.measure.measure`) ran the plan and every built-in policy and
    MaxText preset predicted within the budget on the device. The fastest row by median step time
    takes the plan's place when it is faster than the plan beyond the plan's own spread: its median
    below the plan's first quartile (a row within the plan's quartiles is noise, and the plan was
    chosen on more than time). Only a JAX built-in can take it (``Plan.builtin``: the policy emitted
    is the built-in, the step that ran): a MaxText preset's names, replayed as decisions on the
    all-saved step, lower to another step than the preset's (zoo Llama tiny: 3 offloaded values
    where ``minimal_offloaded`` offloads 6), so a preset that ran fastest is ``advice`` (set it in
    the config). Where the plan's own step failed to run, the fastest built-in that ran is taken.
    The predicted figures become those of the taken policy's step as lowered and judged (the
    measurement's prediction)."""
    import dataclasses as dc

    from hloopt.plan import BUILTIN_POLICIES, OFFLOADING_BUILTINS, Measured, MeasuredRow
    from hloopt.units import format_seconds

    ran = [r for r in measurement.rows if r.measured is not None]
    record = tuple(MeasuredRow(r.name, r.measured.median_s, r.measured.q1_s, r.measured.q3_s) for r in ran)

    def with_record(p: Any, chosen: str) -> Any:
        return dc.replace(p, measured=Measured(measurement.device_kind, measurement.platform, measurement.steps,
                                               chosen, record))

    def faster(r: Any) -> bool:  # than the plan, beyond its spread
        return ours is None or r.measured.median_s < ours.measured.q1_s

    def speed(r: Any) -> tuple[float, str]:
        return (r.measured.median_s, r.name)

    ours = next((r for r in ran if r.kind == "plan"), None)
    emitted = [r for r in ran if r.kind == "jax" and r.name in BUILTIN_POLICIES + OFFLOADING_BUILTINS]
    best = min(emitted, key=speed, default=None)
    fastest = min((r for r in ran if r.kind != "plan"), key=speed, default=None)
    advice = None
    if fastest is not None and fastest.kind == "maxtext" and faster(fastest) and \
            (best is None or speed(fastest) < speed(best)):
        advice = (f"MaxText's remat_policy: {fastest.name} ran {format_seconds(fastest.measured.median_s)} per "
                  f"step on the {measurement.device_kind}, the fastest that fits: set it in the config (a policy "
                  "hloopt emits from its names lowers to another step)")
    if best is None or not faster(best):
        if ours is None:
            raise UserError(f"--judge measured: no policy hloopt can emit ran on the {measurement.device_kind} "
                            f"({'; '.join(r.error or r.skipped or '' for r in measurement.rows)[:300]})")
        return with_record(plan_obj, "plan"), None, None, None, advice
    anchor, alt, acts, res = _builtin_plan(problem, best.name, build, peak_bytes=best.predicted_peak_bytes,
                                           step_time_s=best.predicted_step_time_s)
    than = (f"the searched plan's {format_seconds(ours.measured.median_s)} (quartiles "
            f"{format_seconds(ours.measured.q1_s)}-{format_seconds(ours.measured.q3_s)})" if ours is not None
            else "the searched plan, which did not run")
    note = (f"the plan is {anchor.code}: measured on the {measurement.device_kind} it ran "
            f"{format_seconds(best.measured.median_s)} per step (median of {measurement.steps}), faster than {than}")
    return with_record(alt, best.name), acts, res, note, advice


def _fewer_flops_builtin(tgt: Any, problem: Problem, plan_obj: Any, decisions: Decisions, result: SimResult,
                         budget_bytes: int | None, build: Callable[[Problem, Decisions, SimResult], Any],
                         profile: DeviceProfile, *, platform: str | None,
                         over: bool = False, judge: str = "flops") -> tuple[Any, Decisions, SimResult, str | None,
                                                                            list[tuple[str, int, float]]]:
    """The searched plan, or a JAX built-in policy that fits the budget on the memory model with
    fewer FLOPs and moves nothing to host memory (``Plan.builtin``).

    The search times a value's recomputation by the roofline of the step as lowered, one
    instruction at a time: an element-wise op is charged the HBM traffic of its operands and
    result, which XLA's fusion removes (it is computed inside the matmul or reduction that reads
    it). So it can prefer recomputing matmuls over recomputing fused element-wise chains
    (transformers' BERT at 90%: the searched plan 8.48 GFLOP, ``dots_saveable`` 7.90). And its
    candidates are the residuals of the step with everything saved: a matmul output read in the
    backward pass only through an element-wise op (a bias add) is no residual there, so no
    choice of rules saves it the way ``dots_saveable`` does. Each policy of
    :data:`hloopt.plan.BUILTIN_POLICIES` and the plan are lowered and counted alike (the memory
    model's peak; FLOPs with loop trip counts, :class:`~hloopt.passes.cost.CostAnalysis`); the
    built-in with the fewest FLOPs among those within the budget replaces the plan where it
    needs fewer than the plan (it moves nothing to host memory, so no transfer of the plan's
    makes up for them), or where the plan is over the budget on the model.

    With ``judge="compiled"`` each is compiled by libtpu for the profile's TPU instead (deviceless,
    one compile each): it fits where libtpu's ``peak_memory_in_bytes`` is within the budget, and
    the one with the least roofline time of the module libtpu compiled is taken (:class:`CostAnalysis`
    over that module, loop trip counts applied). Measured on a TPU v5e, FLOPs ordered a convnet's
    policies against their step times (``dots_saveable`` 112 GFLOP ran 3.81 ms, ``nothing_saveable``
    149 GFLOP 3.56 ms: saving the convolutions' outputs costs more HBM traffic than recomputing them
    costs compute), and the compiled module's roofline ordered them as measured (5.43 / 4.44 ms),
    as it did a Llama's three (bench/results/2026-12-07-tpu-v5e/, docs/measurements.md)."""
    import dataclasses as dc

    from hloopt.analysis import analyze
    from hloopt.anchors import ANCHORS
    from hloopt.emit import policy
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.passes import AnalysisManager
    from hloopt.passes.cost import CostAnalysis
    from hloopt.passes.inline import inline_for_assignment
    from hloopt.plan import BUILTIN_POLICIES
    from hloopt.simulator import simulate

    if budget_bytes is None or plan_obj.state:
        return plan_obj, decisions, result, None, []
    compile_for = _compile_target_of(profile) if judge == "compiled" else None  # plan() checked judge

    def lowered(p: Any, label: str) -> Module:
        return parse_module(lower(tgt, platform=platform or "tpu", policy=policy(p)).hlo_text,
                            filename=f"{tgt.name} ({label})")

    def flops(module: Module) -> float:
        inlined = inline_for_assignment(module)
        return float(CostAnalysis(profile=profile).run(inlined, AnalysisManager(inlined)).totals.flops)

    def compiled(p: Any, label: str) -> tuple[int, float]:
        """libtpu's peak for the step lowered with ``p``, and its compiled module's roofline seconds."""
        try:
            low = lower(tgt, platform="tpu", policy=policy(p), compile=compile_for)
        except UserError:
            # libtpu refused it (more than the chip's HBM, say): within no budget
            return 2 ** 62, math.inf
        assert low.compiled_text is not None and low.memory is not None
        module = inline_for_assignment(parse_module(low.compiled_text, filename=f"{tgt.name} ({label}, compiled)"))
        seconds = float(CostAnalysis(profile=profile).run(module, AnalysisManager(module)).totals.seconds)
        return int(low.memory["peak_memory_in_bytes"]), seconds

    if compile_for is not None:
        plan_peak, plan_flops = compiled(plan_obj, "planned")
        over = over or plan_peak > budget_bytes  # as libtpu compiles it
    else:
        # the plan's peak is the model's figure _settle_on_the_model computed; only its FLOPs are new
        planned = lowered(plan_obj, "planned")
        plan_peak = plan_obj.predicted.model_peak_bytes
        if plan_peak is None:
            plan_peak = int(analyze(planned, platform="tpu").peak_bytes)
        plan_flops = flops(planned)
    rows = [("hloopt's searched rules", plan_peak, plan_flops)]
    best = None
    verb = {"device": "saves", "remat": "recomputes"}
    for anchor in ANCHORS:
        if anchor.kind != "jax" or anchor.name not in BUILTIN_POLICIES:
            continue
        acts = anchor.decisions(problem)
        res = simulate(problem, acts)
        alt = build(problem, acts, res)
        alt = dc.replace(alt, builtin=anchor.name, decisions=tuple(
            d if Action.REMAT not in problem.candidate(d.key).allowed
            else dc.replace(d, reason=f"{anchor.code} {verb.get(d.action, d.action)} it")
            for d in alt.decisions))
        if compile_for is not None:
            peak, alt_flops = compiled(alt, anchor.name)
        else:
            module = lowered(alt, anchor.name)
            peak, alt_flops = int(analyze(module, platform="tpu").peak_bytes), flops(module)
        rows.append((anchor.code, peak, alt_flops))
        if peak <= budget_bytes and (over or alt_flops < plan_flops * (1 - 1e-3)) and \
                (best is None or alt_flops < best[1]):
            best = (anchor, alt_flops, peak, alt, acts, res)
    if best is None:
        return plan_obj, decisions, result, None, rows
    anchor, alt_flops, peak, alt, acts, res = best
    # judged compiled, the peak is libtpu's own, not the memory model's
    alt = dc.replace(alt, predicted=dc.replace(alt.predicted, peak_bytes=peak, replay_peak_bytes=res.peak_bytes,
                                               model_peak_bytes=peak if compile_for is None else None))
    if compile_for is not None:
        from hloopt.units import format_seconds

        note = (f"the plan is {anchor.code}: within the budget as libtpu compiles it for {compile_for}, and "
                f"{format_seconds(alt_flops)} by the compiled module's roofline, where the rules hloopt searched "
                f"take {format_seconds(plan_flops)}" + (" and are over the budget" if over else ""))
        return alt, acts, res, note, rows
    note = (f"the plan is {anchor.code}: within the budget by the memory model with {alt_flops / 1e9:.4g} GFLOP, "
            f"where the rules hloopt searched need {plan_flops / 1e9:.4g}"
            + (" and are over the budget" if over else "") + " (their roofline charges element-wise ops the "
            "memory traffic XLA's fusion removes)")
    return alt, acts, res, note, rows


def config_only_plan(outcome: PlanOutcome, names: Iterable[str]) -> Any | None:
    """The best plan a framework config that decides only ``names`` can express (MaxText's
    ``remat_policy: custom`` keys), searched under the outcome's budget or slowdown. None when no
    such plan fits the budget.

    Such a config recomputes every value it is not told about, and that changes what the
    backward pass reads: with everything else saved, a name's value may be no residual at all (a
    query projection read only through its rotary embedding), while with everything else
    recomputed it is what spares recomputing a matmul. So for a JAX target the step is lowered
    again with only the names the program calls saved (``save_only_these_names``, every other
    value recomputed), its residuals found and named as ``plan`` does, and the search decides each
    name (device, offload or recompute); a value no name selects keeps what that lowering gives
    it. For an HLO file (nothing to lower) the outcome's own problem is searched again with every
    value outside ``names`` recomputed (kept where it cannot be)."""
    p = outcome.plan
    budget_bytes = p.budget.bytes if p.budget is not None else None
    max_slowdown = outcome.max_slowdown if budget_bytes is None else None
    if budget_bytes is None and max_slowdown is None:
        return None  # a pareto plan has no single answer to compare
    allowed_names = frozenset(names)
    tgt = outcome.target
    if tgt is not None and getattr(tgt, "kind", None) == "jax":
        import jax

        from hloopt.naming import checkpoint_names

        called = sorted({site.name for site in checkpoint_names(tgt)} & allowed_names)
        if not called:
            return None
        profile = _profile_of(p)
        try:
            an, problem = analyze_target(tgt, profile, platform=outcome.platform,
                                         base_policy=jax.checkpoint_policies.save_only_these_names(*called))
        except UserError:
            return None
        problem = for_objective(problem, p.objective, profile)
        baseline = None
    else:
        an, problem, baseline = outcome.analyzed, outcome.problem, outcome.baseline
    return _search_config(outcome, an, problem, baseline, allowed_names, budget_bytes, max_slowdown)


def _search_config(outcome: PlanOutcome, an: Analyzed, problem: Problem, baseline: SimResult | None,
                   allowed_names: frozenset[str], budget_bytes: int | None,
                   max_slowdown: float | None) -> Any | None:
    """Search ``problem`` with every candidate outside ``allowed_names`` forced to what a config
    does with a value it is not told about: recompute (keep where it cannot). The solvers always
    allow keeping a value, so any such choice is forced back to recomputation afterwards, which
    only frees memory (the budget still holds) and costs the recomputation's time: the best such
    plan found, not a proven optimum."""
    from hloopt.search import search
    from hloopt.simulator import simulate

    candidates = []
    forced: dict[str, Action] = {}
    for c in problem.candidates:
        if c.name not in allowed_names:
            forced[c.key] = Action.REMAT if Action.REMAT in c.allowed else Action.DEVICE
            c = dataclasses.replace(c, allowed=frozenset({forced[c.key]}))
        candidates.append(c)
    restricted = dataclasses.replace(problem, candidates=tuple(candidates))
    if baseline is None:
        baseline = simulate(restricted, Decisions.all_device())
    # where the replay's count was moved to the memory model's (PlanOutcome.aim_bytes), so is this one
    aim = outcome.aim_bytes if outcome.aim_bytes is not None and budget_bytes is not None else budget_bytes
    try:
        sr = search(restricted, budget_bytes=aim, max_slowdown=max_slowdown,
                    solver=outcome.solver, time_limit_s=outcome.time_limit_s)
    except InfeasibleBudget:
        return None
    chosen = sr.plan
    actions = {k: a for k, a in chosen.decisions.actions.items() if k not in forced}
    actions.update({k: a for k, a in forced.items() if a != Action.DEVICE})
    decisions = Decisions(actions)
    result = simulate(restricted, decisions)
    if aim is not None and result.peak_bytes > aim:
        return None
    p = outcome.plan
    return make_plan(p.target, an, restricted, _profile_of(p),
                     budget_spec=p.budget.spec if p.budget else None, budget_bytes=budget_bytes, mode=p.mode,
                     decisions=decisions, result=result, baseline=baseline,
                     solver={"name": chosen.solver, "status": "feasible", "gap": None})


def _profile_of(plan: Any) -> DeviceProfile:
    from hloopt.devices import profile_from_dict

    return profile_from_dict(plan.device)


def _imports(tgt: Any) -> set[str]:
    """What the target's factory imports (for naming its framework); nothing for HLO files."""
    from hloopt.frameworks import imported_by

    return imported_by(tgt.factory) if getattr(tgt, "factory", None) is not None else set()


def probe_rules(tgt: Any, problem: Problem, names: Any, *, platform: str) -> Problem:
    """Offload no unnamed candidate whose policy rule would move other values too.

    A primitive rule (primitive, output shape) selects every value of that primitive and shape in
    the checkpointed layers, which may be more than the residuals the candidate groups (a value
    the backward pass reads twice, a primitive inside a ``jit``). The step is lowered once with
    every such rule offloading (names saved), and a rule's ``pinned_host`` annotations (times
    their loop trip counts, :func:`hloopt.verify.offload_annotations`) are counted by shape. Rules
    that share a shape are told apart by lowering again, each time with a batch of policy
    selectors (primitive, shape) no two of which share a shape, so that an annotation's shape
    names its selector: as many lowerings as one shape has selectors (an encoder-decoder's
    same-width projections), not one per rule. A rule that annotates a different number of values
    than it has instances is not offloaded (it may stay on device or recompute). Rules still
    interact (recomputing one value can make another a residual; every probe offloads the other
    rules of its batch): ``hloopt verify`` checks the chosen plan as a whole.
    """
    from collections import Counter

    from hloopt.emit import PlanPolicy
    from hloopt.lowering import lower
    from hloopt.verify import offload_annotations

    rules = [c for c in problem.candidates if c.name is None and Action.OFFLOAD in c.allowed and c.primitive]
    if not rules:
        return problem
    saved = frozenset(names)

    def annotated(cands: Sequence[Candidate]) -> Counter[str]:
        pol = PlanPolicy(saved_names=saved, offloaded_names=frozenset(),
                         primitive_rules=tuple((c.primitive, c.shape, "offload") for c in cands))
        found: Counter[str] = Counter()
        for a in offload_annotations(lower(tgt, platform=platform, policy=pol).hlo_text):
            found[a.shape] += a.count
        return found

    seen = annotated(rules)
    expected: Counter[str] = Counter()
    for c in rules:
        expected[c.shape] += len(c.instances)
    # Rules sharing a shape are told apart by lowering their selectors apart (sums can hide
    # swaps): batches of selectors with pairwise different shapes, one lowering each.
    # one candidate stands for each selector: the policy rule is (primitive, shape)
    shared = {(c.primitive, c.shape): c for c in rules if expected[c.shape] != len(c.instances)}
    batches: list[list[tuple[str, str]]] = []
    for sel in sorted(shared):
        batch = next((b for b in batches if all(s[1] != sel[1] for s in b)), None)
        if batch is None:
            batches.append([sel])
        else:
            batch.append(sel)
    alone: dict[tuple[str, str], int] = {}
    for batch in batches:
        found = annotated([shared[sel] for sel in batch])
        alone.update({sel: found[sel[1]] for sel in batch})
    bad: dict[str, int] = {}
    for c in rules:
        if (c.primitive, c.shape) in shared:
            n = alone[(c.primitive, c.shape)]
        elif seen[c.shape] == expected[c.shape]:
            continue
        else:
            n = seen[c.shape]
        if n != len(c.instances):
            bad[c.key] = n
    if not bad:
        return problem
    # Recomputing is still open to such a rule: the values it selects beyond the residuals are not
    # saved by it, and an unsaved value the backward pass needs is recomputed (verify checks the
    # whole plan); saving or offloading them would move bytes the plan does not count.
    cands = tuple(dataclasses.replace(c, allowed=c.allowed & frozenset({Action.DEVICE, Action.REMAT}))
                  if c.key in bad else c for c in problem.candidates)
    notes = dict(problem.notes)
    for c in rules:
        if c.key in bad:
            notes[f"kept:{c.key}"] = (f"a policy rule for {c.primitive} {c.shape} selects {bad[c.key]} value(s), "
                                      f"not these {len(c.instances)}: not offloaded")
    return dataclasses.replace(problem, candidates=cands, notes=notes)


def _names_for(tgt: Any, module: Module, profile: DeviceProfile, *, platform: str | None,
               base_policy: Any = None) -> Any:
    """``{instruction name: checkpoint_name}`` for the residuals of ``module`` (see hloopt.naming),
    as a :class:`hloopt.naming.ResidualNames` that also knows the checkpoints' input names."""
    import jax

    from hloopt.naming import ResidualNames, input_names, name_residuals
    from hloopt.passes.residuals import LIBRARY_PATHS, find_residuals

    plat = platform or ("tpu" if profile.kind == "tpu" else "cuda")
    # the module is lower_for_plan's: every residual saved (or base_policy's)
    everything = base_policy or jax.checkpoint_policies.everything_saveable
    probe = name_residuals(tgt, baseline=find_residuals(module), platform=plat, policy=everything)
    probed = {r.inst.name: r.name for r in probe.residuals if r.name}
    # The probe matches residuals of two different lowerings, falling back to shapes, which is
    # ambiguous when several names share a shape (q/context/out projections). JAX lowers
    # ``checkpoint_name(x, n)`` to an identity ``reduce-precision`` carrying the call's source
    # line: a residual that is such a marker's value, on a line where exactly one name is
    # called, has that name.
    by_line: dict[tuple[str, int], set[str]] = {}
    for site in probe.sites:
        by_line.setdefault((relative_source(site.file), site.line), set()).add(site.name)
    names: dict[str, str] = {}
    #: markers the line cannot name: without a user line, or on a line where several names are
    #: called (haliax names a scanned layer's carry and inputs at the line that calls the stack),
    #: or none where a one-name lowering moved the value
    undecided: set[str] = set()
    nameless: set[str] = set()  # markers on a line where no name is called
    by_marker: dict[str, list[Any]] = {}  # per name, the markers its line gives it
    for r in probe.residuals:
        marker = _name_marker(r.producer)
        if marker is None:
            # an op of its own at a user line that calls no name, which the probe named only by
            # its shape (an RMSNorm's product the size of the q projection on the next line):
            # named only if offloading that name alone moves it, as a nameless marker
            loc = module.user_source_of(r.producer, skip=LIBRARY_PATHS)
            if r.name and loc is not None and r.inst.name not in probe.diffed \
                    and not by_line.get((relative_source(loc[0]), loc[1])):
                nameless.add(r.inst.name)
            continue
        loc = module.user_source_of(marker, skip=LIBRARY_PATHS)
        if loc is None:
            undecided.add(r.inst.name)
            continue
        found = by_line.get((relative_source(loc[0]), loc[1]), set())
        if len(found) > 1:
            undecided.add(r.inst.name)
        elif not found:
            # JAX marks every value a policy saves, at the line of the op that made it: a name
            # called on another line than its argument's op (MaxText shards first, in a helper)
            # is checked below by lowering with that name alone offloaded
            nameless.add(r.inst.name)
        if len(found) != 1:
            continue
        name = next(iter(found))
        # ... and what selecting that name moves (the probe's values) has its size and type
        # (a reshape of the named value counts: the same bytes move).
        if any(v.name == name and v.dtype == r.dtype and math.prod(v.per_layer_dims) == math.prod(r.per_layer_dims)
               for v in probe.values):
            by_marker.setdefault(name, []).append(r)
    # A line can hold more values of the named one's size than the name moves: a library layer
    # called on that line (flax NNX's attention: its q, k, v and output have the size of the
    # named output, and every saved value is marked at the user's line). Where the name's values
    # are fewer, the ones of its exact dims stand, if few enough; else the line decides nothing.
    for name, rs in by_marker.items():
        values = [v for v in probe.values if v.name == name]
        need = sum(v.layers for v in values)
        if sum(r.layers for r in rs) > need:
            dims = {(v.dtype, v.per_layer_dims) for v in values}
            exact = [r for r in rs if (r.dtype, r.per_layer_dims) in dims]
            if not exact or sum(r.layers for r in exact) > need:
                undecided.update(r.inst.name for r in rs)
                continue
            rs = exact
        names.update((r.inst.name, name) for r in rs)
    # Residuals that are no marker's value (a scan's carried layer input), or a marker the line
    # cannot tell apart, keep the probe's name.
    taken = set(names.values())
    unmarked = {r.inst.name for r in probe.residuals if _name_marker(r.producer) is None} - nameless | undecided
    for inst_name, name in probed.items():
        if inst_name in unmarked and inst_name not in names and name not in taken:
            names[inst_name] = name
    # A nameless marker takes a name only if offloading that name alone moves it (the probe's
    # shape match can pick a look-alike: a roped query where the projection is no residual).
    used = set(names.values())
    guesses = {name for inst_name, name in probed.items()
               if inst_name in nameless and inst_name not in probe.diffed and name not in used}
    names.update({i: n for i, n in probed.items() if i in nameless and i in probe.diffed and n not in taken})
    if guesses:
        from hloopt.naming import moved_by_name

        for name in sorted(guesses):
            for inst_name in moved_by_name(tgt, name, probe.residuals, policy=everything, platform=plat,
                                           taken=frozenset(names)):
                if inst_name in nameless and inst_name not in names:
                    names[inst_name] = name
    return ResidualNames(names, checkpoint_inputs=input_names(probe.sites))


def iter_steps(problem: Problem) -> Iterator[tuple[int, Step]]:
    return enumerate(problem.steps)
