"""The anchors a plan is judged against: JAX's built-in checkpoint policies and MaxText's presets.

Each anchor is expressed as :class:`~hloopt.problem.Decisions` over a Problem's candidates, so the
one simulator judges it exactly as it judges a solver's plan. The Problem is built from the
program lowered with every residual saved (``everything_saveable``), so each anchor's policy is a
choice per candidate:

* a policy *saves* a residual (DEVICE), *offloads* it (OFFLOAD), or neither, in which case JAX
  recomputes it in the backward pass (REMAT);
* a candidate outside every ``jax.checkpoint`` is not governed by any policy: it stays on device
  (its ``allowed`` actions say so).

MaxText presets follow MaxText's ``get_remat_policy`` (0.2.5: layers/nnx_decoders.py): ``minimal`` saves the
projection tensors, ``minimal_offloaded`` offloads them, ``qkv_proj_offloaded`` offloads the q/k/v
projections, ``full`` saves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hloopt.problem import Action, Candidate, Decisions, Problem

#: The tensors MaxText's ``minimal`` / ``minimal_offloaded`` presets save / offload (MaxText 0.2.5,
#: layers/nnx_decoders.py ``minimal_policy`` and ``get_remat_policy``).
MAXTEXT_MINIMAL_NAMES = frozenset({
    "query_proj", "value_proj", "key_proj", "kv_proj", "qkv_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi",
    "mlpwo",
})
MAXTEXT_QKV_NAMES = frozenset({"query_proj", "value_proj", "key_proj", "kv_proj"})


@dataclass(frozen=True)
class Anchor:
    """A named policy and the action it takes on each candidate."""

    name: str
    #: ``jax`` (a ``jax.checkpoint_policies`` policy) or ``maxtext`` (a ``remat_policy`` preset).
    kind: str
    #: The policy as a user writes it.
    code: str
    decide: Callable[[Candidate], Action]
    #: what it does with the step's argument groups (``Candidate.state``); None: they stay on
    #: device (a checkpoint policy cannot move arguments)
    place: Callable[[Candidate], Action] | None = None

    def decisions(self, problem: Problem) -> Decisions:
        actions = {}
        for c in problem.candidates:
            if c.state is not None:
                a = self.place(c) if self.place is not None else Action.DEVICE
                if a in c.allowed and a != Action.DEVICE:
                    actions[c.key] = a
                continue
            a = self.decide(c)
            if a not in c.allowed:
                a = Action.DEVICE
            if a != Action.DEVICE:
                actions[c.key] = a
        return Decisions(actions)


def _is_dot(c: Candidate) -> bool:
    return c.primitive == "dot_general"


def _is_dot_or_conv(c: Candidate) -> bool:
    # jax's dots_saveable saves dot_general and conv_general_dilated outputs.
    return c.primitive in ("dot_general", "conv_general_dilated")


def _names(names: frozenset[str], action: Action) -> Callable[[Candidate], Action]:
    return lambda c: action if c.name in names else Action.REMAT


ANCHORS: tuple[Anchor, ...] = (
    Anchor("everything_saveable", "jax", "jax.checkpoint_policies.everything_saveable",
           lambda c: Action.DEVICE),
    Anchor("nothing_saveable", "jax", "jax.checkpoint_policies.nothing_saveable",
           lambda c: Action.REMAT),
    Anchor("dots_saveable", "jax", "jax.checkpoint_policies.dots_saveable",
           lambda c: Action.DEVICE if _is_dot_or_conv(c) else Action.REMAT),
    Anchor("dots_with_no_batch_dims_saveable", "jax",
           "jax.checkpoint_policies.dots_with_no_batch_dims_saveable",
           lambda c: Action.DEVICE if _is_dot(c) and not c.dot_has_batch_dims else Action.REMAT),
    Anchor("offload_dot_with_no_batch_dims", "jax",
           "jax.checkpoint_policies.offload_dot_with_no_batch_dims('device', 'pinned_host')",
           lambda c: Action.OFFLOAD if _is_dot(c) and not c.dot_has_batch_dims else Action.REMAT),
    Anchor("offload_all_names", "jax",
           "jax.checkpoint_policies.save_and_offload_only_these_names(names_which_can_be_saved=[], "
           "names_which_can_be_offloaded=<every name>, offload_src='device', offload_dst='pinned_host')",
           lambda c: Action.OFFLOAD if c.name else Action.REMAT),
    Anchor("minimal", "maxtext", "remat_policy: minimal",
           _names(MAXTEXT_MINIMAL_NAMES, Action.DEVICE)),
    Anchor("minimal_offloaded", "maxtext", "remat_policy: minimal_offloaded",
           _names(MAXTEXT_MINIMAL_NAMES, Action.OFFLOAD)),
    Anchor("qkv_proj_offloaded", "maxtext", "remat_policy: qkv_proj_offloaded",
           _names(MAXTEXT_QKV_NAMES, Action.OFFLOAD)),
    Anchor("full", "maxtext", "remat_policy: full", lambda c: Action.REMAT),
    # Where the step's arguments live (hloopt plan --state): MaxText's two booleans on its
    # default remat policy, and JAX's memory-kinds recipe (optimizer state in pinned_host,
    # its update under compute_on("device_host")) on the step as written.
    Anchor("full + optimizer_memory_host_offload", "maxtext",
           "remat_policy: full, optimizer_memory_host_offload: true", lambda c: Action.REMAT,
           lambda c: Action.OFFLOAD if _is_optimizer(c) else Action.DEVICE),
    Anchor("full + parameter_memory_host_offload", "maxtext",
           "remat_policy: full, parameter_memory_host_offload: true", lambda c: Action.REMAT,
           lambda c: Action.DEVICE if _is_optimizer(c) else Action.OFFLOAD),
    Anchor("full + both host offloads", "maxtext",
           "remat_policy: full, optimizer_memory_host_offload: true, parameter_memory_host_offload: true",
           lambda c: Action.REMAT, lambda c: Action.OFFLOAD),
    Anchor("optimizer on host (compute_on)", "jax",
           "opt_state with memory_kind='pinned_host'; the update under compute_on('device_host') "
           "(hloopt.state.on_host)", lambda c: Action.DEVICE,
           lambda c: Action.REMAT if _is_optimizer(c) else Action.DEVICE),
)


def _is_optimizer(c: Candidate) -> bool:
    """The candidate standing for the optimizer's state and update (hloopt.pipeline.OPTIMIZER_KEY)."""
    return c.key == "state:optimizer"


def _places(anchor: Anchor) -> bool:
    return anchor.place is not None


def expressible(anchor: Anchor, problem: Problem) -> bool:
    """MaxText presets apply only to programs that use MaxText's tensor names; anchors placing the
    step's arguments only to problems that have them as candidates; ``offload_all_names`` only to
    programs that name values (without a name it is ``nothing_saveable``)."""
    if anchor.name == "offload_all_names":
        return any(c.name for c in problem.candidates)
    if _places(anchor):
        return any(c.state is not None and anchor.place is not None and anchor.place(c) in c.allowed - {Action.DEVICE}
                   for c in problem.candidates)
    if anchor.kind != "maxtext" or anchor.name == "full":
        return True
    wanted = MAXTEXT_QKV_NAMES if anchor.name == "qkv_proj_offloaded" else MAXTEXT_MINIMAL_NAMES
    return any(c.name in wanted for c in problem.candidates)


def policy_object(anchor: Anchor, names: frozenset[str]) -> object:
    """The JAX policy object ``anchor.code`` describes, for running the step with it.

    ``names`` are the ``checkpoint_name`` names the program uses (``offload_all_names`` offloads
    every one of them). MaxText presets map as MaxText's ``get_remat_policy`` does; ``full`` is
    ``nothing_saveable``. jax is imported here only.
    """
    import jax

    cp = jax.checkpoint_policies
    offload = {"offload_src": "device", "offload_dst": "pinned_host"}
    table: dict[str, Callable[[], object]] = {
        "everything_saveable": lambda: cp.everything_saveable,
        "nothing_saveable": lambda: cp.nothing_saveable,
        "dots_saveable": lambda: cp.dots_saveable,
        "dots_with_no_batch_dims_saveable": lambda: cp.dots_with_no_batch_dims_saveable,
        "offload_dot_with_no_batch_dims": lambda: cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
        "offload_all_names": lambda: cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=sorted(names), **offload),
        "minimal": lambda: cp.save_only_these_names(*sorted(MAXTEXT_MINIMAL_NAMES)),
        "minimal_offloaded": lambda: cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=sorted(MAXTEXT_MINIMAL_NAMES), **offload),
        "qkv_proj_offloaded": lambda: cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=sorted(MAXTEXT_QKV_NAMES), **offload),
        "full": lambda: cp.nothing_saveable,
        # anchors placing arguments: their checkpoint policy (the placement is not a policy)
        "full + optimizer_memory_host_offload": lambda: cp.nothing_saveable,
        "full + parameter_memory_host_offload": lambda: cp.nothing_saveable,
        "full + both host offloads": lambda: cp.nothing_saveable,
        "optimizer on host (compute_on)": lambda: cp.everything_saveable,
    }
    return table[anchor.name]()
