"""Emitters: a plan turned into what a user runs or reads.

* :func:`policy` -- a real JAX checkpoint policy. A plan whose every decision selects by
  ``checkpoint_name`` becomes JAX's own ``save_and_offload_only_these_names`` (device names saved,
  offloaded names to ``pinned_host``, everything else recomputed); a plan with primitive rules
  becomes a :class:`PlanPolicy`, a hashable callable ``(prim, *avals, **params)`` answering
  ``Saveable``/``Offloadable``/``Recompute`` the way JAX's built-in policies do.
* :func:`python_snippet` -- the code the user pastes: it needs only jax, and builds the same policy
  (the rule helpers are copied from this module's source, so snippet and :func:`policy` cannot
  drift apart).
* :func:`maxtext_yaml` -- a MaxText config fragment ``remat_policy: custom`` with one key per
  MaxText tensor name (``device``/``offload``/``remat``), every key of MaxText's list present.
* :func:`annotate_hlo` -- the plan's module with an ``annotate_device_placement`` custom-call to
  ``pinned_host`` after each offloaded value (its users rewired to it), for inspection; it
  re-parses with :func:`hloopt.hlo.parser.parse_module`.

Invariant: names and other user text reach the output only through an escaping encoder
(``repr`` for Python literals, ``json.dumps`` inside comments, ``yaml.safe_dump`` for YAML values,
:func:`hloopt.ir.quote` for HLO strings), so any name, quotes, newlines and all, comes back intact
and can never break out of a literal or a comment. Primitive rules match the primitive's name and,
when the selector has one, the output shape: a policy never sees source locations, so two
same-shaped values of one primitive are not told apart (``hloopt verify`` reports such extras).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hloopt.errors import UserError
from hloopt.fileio import MARKER
from hloopt.plan import Decision, Plan

__all__ = [
    "MAXTEXT_NAMES", "PlanPolicy", "annotate_hlo", "load_plan", "maxtext_yaml", "policy", "python_snippet",
]

#: The tensor keys MaxText's ``remat_policy: custom`` reads (MaxText 0.2.5: ``MaxTextConfig`` turns
#: them into ``tensors_on_device`` / ``tensors_to_offload`` for JAX's
#: ``save_and_offload_only_these_names``), in ``configs/base.yml``'s order. Each is also the
#: ``checkpoint_name`` MaxText's layers give the tensor (the MoE ones nest inside the dense names:
#: ``moe_mlpwi_0`` names the value already named ``mlpwi_0``). base.yml's ``engram`` key is left out:
#: the custom policy does not read it.
MAXTEXT_NAMES: tuple[str, ...] = (
    "decoder_layer_input", "indexer_cutoff_threshold", "context", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo",
    "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "moe_x_sorted", "moe_routing_maps",
    "query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj", "out_proj",
    "query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "attention_out",
)
#: MaxText's default for keys a plan does not decide: the layer input is the remat start point.
MAXTEXT_DEFAULTS: Mapping[str, str] = {"decoder_layer_input": "device"}

OFFLOAD_SRC = "device"
OFFLOAD_DST = "pinned_host"

# numpy dtype name -> HLO element type (float8 variants are derived in _hlo_element_type).
_HLO_TYPES = {
    "bool": "pred", "int4": "s4", "int8": "s8", "int16": "s16", "int32": "s32", "int64": "s64",
    "uint4": "u4", "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "float16": "f16",
    "bfloat16": "bf16", "float32": "f32", "float64": "f64", "complex64": "c64", "complex128": "c128",
}


def load_plan(plan: Plan | str | os.PathLike[str]) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.load(plan)


# -- the policy ----------------------------------------------------------------------------------
# _hlo_element_type, _out_shape_text and _decide are copied verbatim into python_snippet's output:
# they may use only builtins, _HLO_TYPES and imports done inside their bodies.

def _hlo_element_type(dtype_name):
    if dtype_name.startswith("float8_"):
        return "f8" + dtype_name[len("float8_"):]
    return _HLO_TYPES.get(dtype_name, dtype_name)


def _out_shape_text(prim, avals, params):
    """HLO shape text (``f32[2,32,64]``) of the primitive's single output, or None."""
    if prim.multiple_results:
        return None
    try:
        out = prim.abstract_eval(*avals, **params)
    except Exception:
        return None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (set, frozenset)):
        out = out[0]  # (aval, effects)
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape is None or dtype is None:
        return None
    return _hlo_element_type(str(dtype)) + "[" + ",".join(str(d) for d in shape) + "]"


def _decide(prim, avals, params, saved_names, offloaded_names, primitive_rules):
    from jax.ad_checkpoint import Offloadable, Recompute, Saveable

    if prim.name == "name":  # a checkpoint_name(x, name) value
        if params["name"] in saved_names:
            return Saveable
        if params["name"] in offloaded_names:
            return Offloadable(src="device", dst="pinned_host")
        return Recompute
    shape_text = None
    for primitive, shape, action in primitive_rules:
        if prim.name != primitive:
            continue
        if shape is not None:
            if shape_text is None:
                shape_text = _out_shape_text(prim, avals, params) or ""
            if shape_text != shape:
                continue
        if action == "device":
            return Saveable
        if action == "offload":
            return Offloadable(src="device", dst="pinned_host")
        return Recompute
    return Recompute


@dataclasses.dataclass(frozen=True)
class PlanPolicy:
    """A JAX checkpoint policy with checkpoint-name and primitive rules (hashable, like JAX's own).

    Named values: saved, offloaded, else recomputed. Other values: the first rule whose primitive
    (and output shape, when given) matches decides; no match means recompute.
    """

    saved_names: frozenset[str]
    offloaded_names: frozenset[str]
    #: (primitive name, output shape text or None, action)
    primitive_rules: tuple[tuple[str, str | None, str], ...]

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        return _decide(prim, avals, params, self.saved_names, self.offloaded_names, self.primitive_rules)

    @staticmethod
    def from_plan(plan: Plan) -> PlanPolicy:
        return PlanPolicy(saved_names=frozenset(plan.names("device")),
                          offloaded_names=frozenset(plan.names("offload")),
                          primitive_rules=_primitive_rules(plan.decisions))


def _normal_shape(shape: str | None) -> str | None:
    # "f32[2,32,64]{2,1,0}" -> "f32[2,32,64]": layouts are not visible to a policy.
    return None if shape is None else re.sub(r"\{[^{}]*\}$", "", shape.replace(" ", ""))


#: which of two decisions on one (primitive, shape) the policy carries out (see _primitive_rules)
_RULE_PRECEDENCE = {"offload": 2, "remat": 1, "device": 0}


def _primitive_rules(decisions: Iterable[Decision]) -> tuple[tuple[str, str | None, str], ...]:
    """One ``(primitive, shape, action)`` rule per primitive and output shape, shape-specific rules
    before a primitive's catch-all.

    A policy sees a value's primitive and shapes, never its source line. The planner gives every
    value a policy can select one decision per (primitive, shape) (``candidate_groups``); a value
    outside any ``jax.checkpoint`` keeps a decision of its own, always "device" (no policy is asked
    about it), which may share a rule's primitive and shape. Such a "device" must not shadow the
    rule: where decisions on one (primitive, shape) differ, an offload or a recomputation wins."""
    rules: dict[tuple[str, str | None], str] = {}
    for d in decisions:
        if d.selector.kind == "primitive" and d.selector.primitive:
            rule = (d.selector.primitive, _normal_shape(d.selector.shape))
            if rule not in rules or _RULE_PRECEDENCE.get(d.action, 0) > _RULE_PRECEDENCE.get(rules[rule], 0):
                rules[rule] = d.action
    # Shape-specific rules before catch-alls of the same primitive, then plan order (stable sort).
    return tuple(sorted(((p, s, a) for (p, s), a in rules.items()), key=lambda r: (r[0], r[1] is None)))


def builtin_code(name: str) -> str:
    """The built-in policy ``name`` as a user writes it (an offloading one called with its memory kinds)."""
    from hloopt.plan import OFFLOADING_BUILTINS

    call = f"({OFFLOAD_SRC!r}, {OFFLOAD_DST!r})" if name in OFFLOADING_BUILTINS else ""
    return f"jax.checkpoint_policies.{name}{call}"


def remat3_limits(plan: Plan) -> str | None:
    """What ``jax_remat3`` cannot carry out of ``plan``, in one line, or None when it can.

    JAX's remat3 (jax 0.10-0.12, behind ``jax_remat3``) reads a policy only as data:
    ``save_only_these_names`` / ``save_any_names_but_these`` / ``everything_saveable``; any other
    policy recomputes every value, and nothing is offloaded (measured on the zoo: no
    ``annotate_device_placement`` at all). So a plan that offloads, or that saves a value by its
    primitive rather than its checkpoint_name, cannot be expressed there."""
    offloads = plan.of("offload")
    by_primitive = [d for d in plan.decisions if d.selector.kind == "primitive" and d.action == "device"]
    # a built-in other than nothing_saveable saves by primitive whatever its decisions list
    builtin = plan.builtin is not None and plan.builtin != "nothing_saveable"
    if not offloads and not by_primitive and not builtin:
        return None
    parts = []
    if offloads:
        parts.append(f"{len(offloads)} offload(s) (remat3 drops offloading)")
    if by_primitive:
        parts.append(f"{len(by_primitive)} value(s) saved by primitive rule (remat3 saves by checkpoint_name only)")
    elif builtin:
        parts.append(f"{builtin_code(plan.builtin)} (remat3 saves by checkpoint_name only"  # type: ignore[arg-type]
                     + (" and drops offloading)" if offloads else ")"))
    return ("jax_remat3 is on: this plan needs " + " and ".join(parts) + "; turn it off "
            "(jax.config.update('jax_remat3', False)) or use only its saved names "
            f"(save_only_these_names({', '.join(repr(n) for n in sorted(plan.names('device')))}))")


def policy(plan: Plan | str | os.PathLike[str]) -> Callable[..., Any]:
    """The JAX checkpoint policy that carries out ``plan`` (a :class:`Plan` or a plan file).

    With ``jax_remat3`` on, a plan it can express (names saved, the rest recomputed) becomes
    ``save_only_these_names``, the form remat3 reads; see :func:`remat3_limits` for the rest."""
    from hloopt.policy_override import remat3_enabled

    plan = load_plan(plan)
    if plan.builtin is not None:  # remat3 recomputes everything under one (remat3_limits)
        import jax

        from hloopt.plan import OFFLOADING_BUILTINS

        builtin = getattr(jax.checkpoint_policies, plan.builtin)
        return builtin(OFFLOAD_SRC, OFFLOAD_DST) if plan.builtin in OFFLOADING_BUILTINS else builtin
    if remat3_enabled() and remat3_limits(plan) is None:
        import jax

        return jax.checkpoint_policies.save_only_these_names(*plan.names("device"))
    if plan.by_name_only:
        import jax

        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=plan.names("device"), names_which_can_be_offloaded=plan.names("offload"),
            offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)
    return PlanPolicy.from_plan(plan)


# -- Python ---------------------------------------------------------------------------------------

def _comment(text: str) -> str:
    """Arbitrary text made safe inside a ``#`` comment: one line, ASCII, quoted."""
    return json.dumps(text, ensure_ascii=True)


def _size(n: int) -> str:
    from hloopt.units import format_bytes

    return format_bytes(n)


def _decision_lines(plan: Plan, prefix: str) -> list[str]:
    lines = []
    for d in plan.decisions:
        what = (f"checkpoint_name {_comment(d.selector.name or '')}" if d.selector.kind == "name"
                else f"{_comment(d.selector.primitive or '')} at {_comment(d.selector.source or '?')}")
        lines.append(f"{prefix}  {d.action:<7} {what}: {d.layers} x {_comment(d.shape)}, {_size(d.bytes)}")
    return lines


def _header(plan: Plan, prefix: str, what: str) -> list[str]:
    lines = [f"{prefix} {MARKER} ({plan.schema}): {what}",
             f"{prefix} target {_comment(plan.target)}, module {_comment(plan.module)}, "
             f"device {_comment(str(plan.device.get('name', '?')))}"]
    pred = plan.predicted
    lines.append(f"{prefix} predicted peak {_size(pred.peak_bytes)} (all on device: "
                 f"{_size(pred.baseline_peak_bytes)}), step {pred.step_time_s:.6g} s "
                 f"(all on device: {pred.baseline_step_time_s:.6g} s)")
    if plan.budget is not None:
        lines.append(f"{prefix} budget {_comment(plan.budget.spec)} = {_size(plan.budget.bytes)}")
    if plan.decisions:
        lines.append(f"{prefix} decisions:")
        lines.extend(_decision_lines(plan, prefix))
    return lines


def _py_list(names: Iterable[str]) -> str:
    items = sorted(set(names))
    if not items:
        return "[]"
    return "[\n" + "".join(f"        {n!r},\n" for n in items) + "    ]"


def python_snippet(plan: Plan | str | os.PathLike[str]) -> str:
    """Python source defining ``policy``, the plan's checkpoint policy, using only jax.

    Use it as ``jax.checkpoint(layer, policy=policy)`` (or MaxText/Flax ``remat(..., policy=policy)``).
    """
    plan = load_plan(plan)
    lines = _header(plan, "#", "checkpoint policy")
    if plan.host_groups:
        lines += [
            "# use, without editing the model (plan.json is what hloopt plan --out wrote); the plan puts",
            "# argument groups in host memory, so apply_plan takes the step's arguments and places them:",
            "#   step, args = hloopt.apply_plan(\"plan.json\", step, args)",
            "# or paste the policy below into your own jax.checkpoint(layer_fn, policy=policy)",
        ]
    else:
        lines += [
            "# use, without editing the model (plan.json is what hloopt plan --out wrote):",
            "#   with hloopt.use_plan(\"plan.json\"): compiled = jax.jit(step).lower(*args).compile()",
            "#   step = hloopt.apply_plan(\"plan.json\", step)   # takes the plan whenever it is traced",
            "# or paste the policy below into your own jax.checkpoint(layer_fn, policy=policy)",
        ]
    from hloopt.policy_override import remat3_enabled

    limits = remat3_limits(plan) if remat3_enabled() else None
    if limits:
        lines.append(f"# WARNING: {limits}")
    lines.append("")
    if plan.builtin is not None:
        lines += [
            "import jax",
            "",
            "# JAX's own policy: it fits the budget and beats the rules hloopt searched (see the plan's note);",
            "# the decisions above are what it does to each residual",
            f"policy = {builtin_code(plan.builtin)}",
            "",
        ]
        return "\n".join(lines)
    if plan.by_name_only:
        lines += [
            "import jax",
            "",
            "policy = jax.checkpoint_policies.save_and_offload_only_these_names(",
            f"    names_which_can_be_saved={_py_list(plan.names('device'))},",
            f"    names_which_can_be_offloaded={_py_list(plan.names('offload'))},",
            f"    offload_src={OFFLOAD_SRC!r},",
            f"    offload_dst={OFFLOAD_DST!r},",
            ")",
            "",
        ]
        return "\n".join(lines)
    rules = _primitive_rules(plan.decisions)
    rule_text = "(\n" + "".join(f"    ({p!r}, {s!r}, {a!r}),\n" for p, s, a in rules) + ")"
    lines += [
        f"SAVED_NAMES = frozenset({_py_list(plan.names('device'))})",
        f"OFFLOADED_NAMES = frozenset({_py_list(plan.names('offload'))})",
        "# (primitive, output shape or None for any, action): the first match decides",
        f"PRIMITIVE_RULES = {rule_text}",
        f"_HLO_TYPES = {_HLO_TYPES!r}",
        "",
    ]
    for fn in (_hlo_element_type, _out_shape_text, _decide):
        lines += [inspect.getsource(fn).rstrip("\n"), "", ""]
    lines += [
        "def policy(prim, *avals, **params):",
        "    return _decide(prim, avals, params, SAVED_NAMES, OFFLOADED_NAMES, PRIMITIVE_RULES)",
        "",
    ]
    return "\n".join(lines)


# -- MaxText ---------------------------------------------------------------------------------------

def maxtext_unexpressible(plan: Plan, choosable: Iterable[str] | None = None) -> list[Decision]:
    """Decisions a MaxText ``remat_policy: custom`` cannot express: keeping or offloading a value
    that has no MaxText checkpoint_name (MaxText recomputes whatever it is not told about).
    ``choosable``: the keys of values a policy can recompute (one it cannot recompute is kept by
    any policy, MaxText's too)."""
    keys = None if choosable is None else set(choosable)
    return [d for d in plan.decisions
            if not (d.selector.kind == "name" and d.selector.name in MAXTEXT_NAMES) and d.action != "remat"
            and (keys is None or d.key in keys)]


def maxtext_yaml(plan: Plan | str | os.PathLike[str], *, strict: bool = True) -> str:
    """A MaxText config fragment: ``remat_policy: custom`` and every MaxText tensor key.

    Keys the plan does not decide get MaxText's defaults (``decoder_layer_input: device``, the rest
    ``remat``), so the fragment fully defines the policy. Decisions MaxText cannot express (a name
    outside :data:`MAXTEXT_NAMES`, or a primitive rule) that keep or offload a value are a
    UserError with ``strict``; otherwise they are listed in a comment and left out.
    """
    import yaml

    plan = load_plan(plan)
    values: dict[str, Any] = {"remat_policy": "custom"}
    for n in MAXTEXT_NAMES:
        values[n] = MAXTEXT_DEFAULTS.get(n, "remat")
    for d in plan.decisions:
        if d.selector.kind == "name" and d.selector.name in MAXTEXT_NAMES:
            values[d.selector.name] = d.action
    left_out = maxtext_unexpressible(plan)
    if left_out and strict:
        what = ", ".join(_describe(d) for d in left_out[:5]) + (", ..." if len(left_out) > 5 else "")
        raise UserError(f"{len(left_out)} decision(s) cannot be written as a MaxText remat_policy "
                        f"(its custom keys are {', '.join(MAXTEXT_NAMES)}): {what}; "
                        "use --format python")
    lines = _header(plan, "#", "MaxText remat policy (merge into your config yml)")
    for d in left_out:
        lines.append(f"# NOT EXPRESSIBLE in MaxText, left out: {d.action} {_comment(d.key)}")
    # where the arguments live (plan --state): MaxText's two booleans place a whole role in host
    # memory; it has no switch for computing the optimizer update on the host
    for role, key in (("optimizer", "optimizer_memory_host_offload"), ("parameters", "parameter_memory_host_offload")):
        groups = [s for s in plan.state if s.role == role]
        if not groups:
            continue
        values[key] = all(s.placement in ("host", "host-compute") for s in groups)
        hosted = [s.group for s in groups if s.placement != "device"]
        if hosted and not values[key]:
            lines.append(f"# NOT EXPRESSIBLE in MaxText: {key} places every {role} group; the plan places "
                         f"only {_comment(', '.join(hosted))}")
        if any(s.placement == "host-compute" for s in groups):
            lines.append("# NOT EXPRESSIBLE in MaxText: the optimizer update computed on the host "
                         "(hloopt.state.on_host); optimizer_memory_host_offload keeps the state there only")
    body = yaml.safe_dump(values, sort_keys=False, default_flow_style=False, allow_unicode=False, width=1 << 30)
    return "\n".join(lines) + "\n" + body


def _describe(d: Decision) -> str:
    sel = d.selector
    if sel.kind == "name":
        return f"{d.action} checkpoint_name {sel.name!r}"
    return f"{d.action} {sel.primitive} at {sel.source or '?'}"


# -- annotated HLO ---------------------------------------------------------------------------------

def annotate_hlo(module: Any, plan: Plan | str | os.PathLike[str], *,
                 values: Mapping[str, Iterable[str]] | None = None) -> str:
    """HLO text of ``module`` (a :class:`hloopt.ir.Module` or HLO text, the plan's module) with a
    ``pinned_host`` ``annotate_device_placement`` custom-call after every offloaded value.

    The values of a decision are ``values[key]`` when given, else the decision's ``values`` (HLO
    instruction names). Each annotated value's users read the annotation instead.
    """
    from hloopt.hlo.parser import parse_module
    from hloopt.hlo.printer import print_module
    from hloopt.ir import Instruction, Module, quote

    plan = load_plan(plan)
    if isinstance(module, str):
        mod = parse_module(module, filename=f"<{plan.module}>")
    elif isinstance(module, Module):
        # Annotation rewires users in place: work on a private copy.
        mod = parse_module(print_module(module), filename=module.filename)
    else:
        raise TypeError(f"annotate_hlo: expected HLO text or a Module, got {type(module).__name__}")
    by_name: dict[str, Instruction] = {i.name: i for i in mod.instructions()}
    taken = set(by_name)
    annotated: list[tuple[Decision, Instruction, Instruction]] = []
    for d in plan.of("offload"):
        names = list(values[d.key]) if values is not None and d.key in values else list(d.values)
        if not names:
            raise UserError(f"plan decision {d.key!r} does not say which HLO values it offloads "
                            "(no 'values'); cannot annotate the module")
        for name in names:
            inst = by_name.get(name)
            if inst is None:
                raise UserError(f"plan decision {d.key!r} names HLO value {name!r}, which module "
                                f"{mod.name} does not define (is it the plan's module {plan.module!r}?)")
            new_name = f"{name}.offload"
            k = 1
            while new_name in taken:
                k += 1
                new_name = f"{name}.offload{k}"
            taken.add(new_name)
            ann = Instruction(new_name, "custom-call", inst.shape)
            ann.operands = [inst]
            ann.attrs = {
                "custom_call_target": '"annotate_device_placement"',
                "custom_call_has_side_effect": "true",
                "frontend_attributes": '{_xla_buffer_placement="pinned_host"}',
                "metadata": "{op_name=" + quote(f"hloopt/offload/{d.key}") + "}",
            }
            _insert_after(inst, ann)
            annotated.append((d, inst, ann))
    header = _header(plan, "//", "plan's offloads annotated (annotate_device_placement to pinned_host)")
    for d, inst, ann in annotated:
        header.append(f"//   {ann.name} <- {inst.name}: {_comment(d.key)}")
    return "\n".join(header) + "\n" + print_module(mod) + "\n"


def _insert_after(inst: Any, ann: Any) -> None:
    comp = inst.parent
    users = [u for u in inst.users if u is not ann]
    for u in users:
        u.operands = [ann if o is inst else o for o in u.operands]
    ann.users = users
    inst.users = [ann]
    ann.parent = comp
    pos = comp.instructions.index(inst) + 1
    comp.instructions.insert(pos, ann)
    for i, x in enumerate(comp.instructions):
        x.index = i
    comp.by_name[ann.name] = ann
    if inst.is_root:
        inst.is_root = False
        ann.is_root = True
        comp.root = ann
