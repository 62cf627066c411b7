"""Verification: does the emitted policy offload exactly what the plan says, and does it fit?

Algorithm. The step is lowered again (pre-optimization HLO for TPU) with the plan's policy
(:func:`hloopt.emit.policy`); every ``annotate_device_placement`` custom-call to ``pinned_host``
is an offloaded value. A value inside a loop body counts once per iteration (``lax.scan`` puts
one annotation in the body for all layers): its multiplicity is the product of the trip counts of
the ``while`` loops around it, read from their ``i < N`` conditions. To know which planned
decision each annotation belongs to, the step is lowered once more per offloaded decision with a
policy that offloads that decision alone; annotations are matched to the whole-plan lowering by
shape. A decision whose values were not annotated is explained when possible:

* its ``checkpoint_name`` appears nowhere in the traced program (a typo, another model);
* the name exists but offloading it annotates nothing: the backward pass does not read it
  (it is not a residual), so the policy silently does nothing for it;
* the plan counted a different number of layers than got annotated.

Whole-plan annotations no decision accounts for are *unplanned*. A plan that is a JAX built-in
policy (``Plan.builtin``) emits that policy, which offloads what it offloads: its decisions are
the built-in's replay and are not checked one by one. For a plan made for a TPU, the
re-lowered step is also run through the memory model (:func:`hloopt.analysis.analyze`, the
pre-optimization TPU prediction), which sees what the plan's own timeline does not: the VMEM
heap, and libtpu copying values offloaded outside a loop straight back. That second opinion
needs no compiler: ``modeled_peak_bytes``, and the model's notes as ``warnings`` (not failed
checks). It is not compared with the budget: on the small zoo plans it is within 2.1% of
libtpu's compile for llama, gpt2 and mlp but 27% over for convnet (tests/test_plan_tpu.py).
With ``compile=`` the step is
also compiled deviceless through libtpu: XLA's ``peak_memory_in_bytes`` must be within the plan's
budget, and ``host_temp_size_in_bytes`` must be non-zero when the plan offloads anything (else XLA
kept the residuals on device). Only one libtpu compile may run at a time on a machine; callers
serialise (``flock /tmp/hloopt-tpu.flock``).

Invariant: ``Verification.ok`` is true only when every offloaded decision has exactly its
planned layers annotated, nothing else is annotated, every name the plan keeps or recomputes
exists in the program, and (when compiled) the compiled peak is
within the budget and XLA placed bytes on the host.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hloopt.errors import UserError
from hloopt.plan import Decision, Plan

__all__ = ["Annotation", "DecisionCheck", "Verification", "offload_annotations", "verify"]



@dataclass(frozen=True)
class Annotation:
    """One ``annotate_device_placement`` to pinned_host in a lowered module."""

    computation: str
    instruction: str
    #: the annotated value (the custom-call's operand)
    operand: str
    #: HLO shape text without layout
    shape: str
    #: bytes of one instance
    bytes: int
    #: how many times it runs per step (product of enclosing loop trip counts)
    count: int


@dataclass(frozen=True)
class DecisionCheck:
    """How one offloaded decision fared."""

    key: str
    #: how the policy selects it, for people
    selector: str
    planned_layers: int
    planned_bytes: int
    #: instances annotated with the decision alone offloaded
    annotated_layers: int
    annotated_bytes: int
    #: "ok", "not-moved" or "count-mismatch"
    status: str
    #: why it did not move / does not match (empty when ok)
    why: str = ""


@dataclass(frozen=True)
class Verification:
    target: str
    plan_target: str
    checks: tuple[DecisionCheck, ...]
    #: every pinned_host annotation under the whole plan
    annotations: tuple[Annotation, ...]
    #: annotated values no offloaded decision accounts for: (shape, instances)
    unplanned: tuple[tuple[str, int], ...]
    #: compile target, XLA's memory figures (bytes), when compiled
    compiled_for: str | None
    memory: Mapping[str, int] | None
    predicted_peak_bytes: int
    budget_bytes: int | None
    #: one line per failed check
    problems: tuple[str, ...]
    #: the memory model's peak of the re-lowered step (TPU plans; None otherwise)
    modeled_peak_bytes: int | None = None
    #: what to look at that is not a failed check (the memory model over the budget, its notes)
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def annotated_layers(self) -> int:
        return sum(a.count for a in self.annotations)

    @property
    def annotated_bytes(self) -> int:
        return sum(a.count * a.bytes for a in self.annotations)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "target": self.target, "plan_target": self.plan_target,
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "annotated_layers": self.annotated_layers, "annotated_bytes": self.annotated_bytes,
            "unplanned": [{"shape": s, "layers": n} for s, n in self.unplanned],
            "compiled_for": self.compiled_for, "memory": dict(self.memory) if self.memory is not None else None,
            "predicted_peak_bytes": self.predicted_peak_bytes, "budget_bytes": self.budget_bytes,
            "modeled_peak_bytes": self.modeled_peak_bytes, "warnings": list(self.warnings),
            "problems": list(self.problems),
        }


# -- annotations in HLO ----------------------------------------------------------------------------

def offload_annotations(module: Any) -> list[Annotation]:
    """Every pinned_host ``annotate_device_placement`` in ``module`` (Module or HLO text)."""
    from hloopt.hlo.parser import parse_module
    from hloopt.passes.residuals import is_host_annotation

    mod = parse_module(module) if isinstance(module, str) else module
    mult = _multiplicities(mod)
    out = []
    for comp in mod.computations.values():
        for inst in comp.instructions:
            if is_host_annotation(inst):
                operand = inst.operands[0].name if inst.operands else ""
                out.append(Annotation(computation=comp.name, instruction=inst.name, operand=operand,
                                      shape=_shape_text(inst.shape), bytes=inst.shape.byte_size,
                                      count=mult.get(comp.name, 1)))
    return out


def _shape_text(shape: Any) -> str:
    import re

    return re.sub(r"\{[^{}]*\}", "", str(shape))


def _multiplicities(mod: Any) -> dict[str, int]:
    """Computation name -> executions per step (loop bodies: times their trip counts)."""
    from hloopt.passes.loops import trip_count

    memo: dict[str, int] = {}

    def of(comp: Any, depth: int = 0) -> int:
        if comp.name in memo:
            return memo[comp.name]
        if comp.is_entry or not comp.callers or depth > 64:
            memo[comp.name] = 1
            return 1
        total = 0
        for caller in comp.callers:
            n = of(caller.parent, depth + 1) if caller.parent is not None else 1
            if caller.opcode == "while" and comp in (caller.called.get("body") or []):
                n *= trip_count(caller) or 1
            total += n
        memo[comp.name] = max(total, 1)
        return memo[comp.name]

    return {name: of(comp) for name, comp in mod.computations.items()}


# -- names in the traced program ---------------------------------------------------------------------

def checkpoint_names(target: Any) -> set[str]:
    """Every ``checkpoint_name`` the target's step defines."""
    from hloopt.naming import checkpoint_names as sites

    return {s.name for s in sites(target)}


# -- verify --------------------------------------------------------------------------------------

def _describe(d: Decision) -> str:
    sel = d.selector
    if sel.kind == "name":
        return f"checkpoint_name {sel.name!r}"
    shape = f" {sel.shape}" if sel.shape else ""
    return f"{sel.primitive}{shape} at {sel.source or '?'}"


def _resolve(target: Any) -> Any:
    from hloopt.targets import Target, resolve

    t = resolve(target) if isinstance(target, str) else target
    if not isinstance(t, Target) or t.kind != "jax":
        name = getattr(t, "name", target)
        raise UserError(f"{name}: verify needs a JAX TARGET (file.py:factory), which it lowers again; "
                        f"this is {getattr(t, 'kind', type(t).__name__)}")
    return t


#: what JAX's remat3 cannot express (measured with jax 0.10.2 on the zoo: no annotation at all)
REMAT3_NO_OFFLOAD = ("jax_remat3 is on: JAX's remat3 implements only name-based saving "
                     "(save_only_these_names, save_any_names_but_these, everything_saveable) and drops "
                     "offloading, so this plan's offloads do not happen; turn jax_remat3 off "
                     "(jax.config.update('jax_remat3', False)) or plan with --no-offload")


def verify(target: Any, plan: Plan | str, *, compile: str | None = None) -> Verification:
    """Re-lower ``target`` (a TARGET string or :class:`hloopt.targets.Target`) with the plan's policy
    and check the offloaded set (see the module docstring); ``compile`` is a TPU generation."""
    from hloopt.emit import load_plan, policy
    from hloopt.lowering import TPU_TOPOLOGIES, lower
    from hloopt.policy_override import remat3_enabled

    plan = load_plan(plan)
    if compile is not None and compile not in TPU_TOPOLOGIES:
        raise UserError(f"verify --compile {compile}: expected a TPU ({', '.join(TPU_TOPOLOGIES)}); "
                        "XLA CPU ignores offloading")
    t = _resolve(target)
    whole_policy = policy(plan)
    whole_text = lower(t, platform="tpu", policy=whole_policy).hlo_text
    whole = offload_annotations(whole_text)
    defined = checkpoint_names(t)
    modeled, warnings = _second_opinion(whole_text, plan)

    # A plan that is a JAX built-in policy emits that policy, whatever its decisions (the built-in's
    # replay on the all-saved step) say: what it offloads is the plan's, checked as a whole below.
    per_decision = plan.of("offload") if plan.builtin is None else ()
    remaining: Counter[str] = Counter()
    for a in whole if plan.builtin is None else ():
        remaining[a.shape] += a.count
    checks: list[DecisionCheck] = []
    problems: list[str] = []
    for d in per_decision:
        alone = offload_annotations(
            lower(t, platform="tpu", policy=policy(dataclasses.replace(plan, decisions=(d,)))).hlo_text)
        layers = sum(a.count for a in alone)
        nbytes = sum(a.count * a.bytes for a in alone)
        missing_under_whole = 0
        for a in alone:
            took = min(remaining[a.shape], a.count)
            remaining[a.shape] -= took
            missing_under_whole += a.count - took
        why = ""
        if d.selector.kind == "name" and d.selector.name not in defined:
            status = "not-moved"
            known = ", ".join(sorted(defined)) or "none"
            why = f"no checkpoint_name {d.selector.name!r} in the program (it defines: {known})"
        elif layers == 0:
            status = "not-moved"
            why = (f"{_describe(d)} is not a residual: the backward pass does not read it, so the "
                   "policy has nothing to offload")
        elif missing_under_whole:
            status = "count-mismatch"
            why = (f"offloaded alone it annotates {layers} value(s), with the whole plan "
                   f"{layers - missing_under_whole}")
        elif d.layers and layers != d.layers:
            status = "count-mismatch"
            why = f"{layers} value(s) annotated, the plan counts {d.layers} layer(s)"
        else:
            status = "ok"
        checks.append(DecisionCheck(key=d.key, selector=_describe(d), planned_layers=d.layers,
                                    planned_bytes=d.bytes, annotated_layers=layers, annotated_bytes=nbytes,
                                    status=status, why=why))
        if status != "ok":
            problems.append(f"{d.key}: {why}")
    for d in plan.decisions:
        # Saving or recomputing a name the program does not define silently does nothing too.
        if d.action != "offload" and d.selector.kind == "name" and d.selector.name not in defined:
            problems.append(f"{d.key}: plans {d.action} for checkpoint_name {d.selector.name!r}, "
                            "which the program does not define")
    if plan.of("offload") and not whole and remat3_enabled():
        problems.append(REMAT3_NO_OFFLOAD)
    unplanned = tuple(sorted((s, n) for s, n in remaining.items() if n > 0))
    if unplanned:
        problems.append("unplanned offloads: " + ", ".join(f"{n} x {s}" for s, n in unplanned))

    memory = None
    if compile is not None:
        memory = dict(lower(t, platform="tpu", policy=whole_policy, compile=compile).memory or {})
        peak = memory.get("peak_memory_in_bytes")
        if plan.budget is not None and peak is not None and peak > plan.budget.bytes:
            problems.append(f"compiled peak {peak} bytes exceeds the budget {plan.budget.spec} "
                            f"({plan.budget.bytes} bytes)")
        moved = any(c.annotated_layers for c in checks) or (plan.builtin is not None and bool(whole))
        if plan.of("offload") and moved and not memory.get("host_temp_size_in_bytes"):
            problems.append(f"XLA kept the offloaded residuals on device ({compile}: host_temp_size_in_bytes = 0)")
    return Verification(
        target=t.name, plan_target=plan.target, checks=tuple(checks), annotations=tuple(whole),
        unplanned=unplanned, compiled_for=compile, memory=memory,
        predicted_peak_bytes=plan.predicted.peak_bytes,
        budget_bytes=plan.budget.bytes if plan.budget is not None else None, problems=tuple(problems),
        modeled_peak_bytes=modeled, warnings=warnings)


def _second_opinion(hlo_text: str, plan: Plan) -> tuple[int | None, tuple[str, ...]]:
    """The memory model's peak of the step lowered with the plan's policy, and its warnings
    (module docstring); (None, ()) for a plan made for a GPU."""
    if plan.device.get("kind") != "tpu":
        return None, ()
    from hloopt.analysis import analyze, prediction_notes
    from hloopt.hlo.parser import parse_module

    report = analyze(parse_module(hlo_text, filename="<verify>"), platform="tpu")
    # the prediction's blind spots; advice on the step itself (donation) is analyze's to give
    return report.peak_bytes, tuple(prediction_notes(report.profile, report.settings))
