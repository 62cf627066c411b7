"""Applying a plan to a program as it is written: no ``policy=`` parameter needed.

Two public entry points, both built on :func:`hloopt.policy_override.override_policies`::

    with hloopt.use_plan("plan.json"):                 # every checkpoint traced inside
        compiled = jax.jit(step).lower(*args).compile()

    step = hloopt.apply_plan("plan.json", step)        # a step that does so whenever it is traced
    state = jax.jit(step)(*args)

``plan`` is a path to a ``plan.json`` written by ``hloopt plan``, or a loaded
:class:`hloopt.plan.Plan`; :func:`use_policy` and :func:`apply_policy` take any JAX checkpoint
policy instead. Offloading moves values and rematerialization recomputes them: the step computes
the same numbers with any policy, only where its residuals live changes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from hloopt.policy_override import CheckpointsSeen, override_policies

__all__ = ["apply_plan", "apply_policy", "use_plan", "use_policy"]


def _plan_policy(plan: Any) -> Any:
    from hloopt.emit import load_plan, policy

    return policy(load_plan(plan))


def use_policy(policy: Callable[..., Any] | None) -> contextlib.AbstractContextManager[CheckpointsSeen]:
    """Every ``jax.checkpoint`` traced inside the ``with`` block takes ``policy``."""
    return override_policies(policy)


def use_plan(plan: Any) -> contextlib.AbstractContextManager[CheckpointsSeen]:
    """Every ``jax.checkpoint`` traced inside the ``with`` block takes the plan's policy.

    ``plan`` is a ``plan.json`` path or a :class:`hloopt.plan.Plan`. The block yields a
    :class:`~hloopt.policy_override.CheckpointsSeen`: after tracing, ``seen.count == 0`` means the
    program has no ``jax.checkpoint`` and the plan could not apply."""
    return override_policies(_plan_policy(plan))


def apply_policy(policy: Callable[..., Any] | None, step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` wrapped so that every checkpoint traced while it runs takes ``policy``."""

    @functools.wraps(step)
    def with_policy(*args: Any, **kwargs: Any) -> Any:
        with override_policies(policy):
            return step(*args, **kwargs)

    return with_policy


def apply_plan(plan: Any, step: Callable[..., Any], args: tuple[Any, ...] | None = None, *,
               donate_argnums: int | tuple[int, ...] = ()) -> Any:
    """``step`` wrapped so that it takes the plan's policy whenever it is traced (``jax.jit`` it,
    or call it where it is already jitted). The plan is read once, here.

    With ``args`` (the step's positional arguments, arrays or ``ShapeDtypeStruct``): returns
    ``(step2, args2)``, ``step2`` jitted with the plan's placement of the step's arguments
    (``hloopt plan --state``: ``pinned_host`` shardings on the groups it puts in host memory and
    on their updated outputs, :func:`hloopt.state.apply_state_plan`) and ``args2`` placed so.
    ``donate_argnums`` goes to ``jax.jit``."""
    from hloopt.emit import load_plan

    loaded = load_plan(plan)
    stepped = apply_policy(_plan_policy(loaded), step)
    if args is None:
        if loaded.host_groups:
            from hloopt.errors import UserError

            raise UserError(f"the plan puts argument groups in host memory ({', '.join(loaded.host_groups)}): "
                            "give the step's arguments, hloopt.apply_plan(plan, step, args)")
        return stepped
    from hloopt.state import apply_state_plan

    placement = {s.group: ("host" if s.placement in ("host", "host-compute") else "device") for s in loaded.state}
    return apply_state_plan(placement, stepped, tuple(args), donate_argnums=donate_argnums)
