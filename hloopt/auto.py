"""``hloopt.auto_offload``: plan a step's offloads and hand back the step rebuilt with the policy.

A checkpoint policy is fixed when a step is traced (``jax.checkpoint(f, policy=...)`` reads it
while tracing). The returned step imposes the plan's policy on every checkpoint traced inside it
(:func:`hloopt.apply.apply_policy`), so the program needs no ``policy`` parameter. Three forms:

* a **factory**: ``factory(**factory_kwargs) -> (step_fn, args[, kwargs])`` (one declaring
  ``policy=`` is called again with the plan's policy instead) -- every zoo model's ``make`` is one::

      step, args, plan = hloopt.auto_offload(llama.make, device="tpu-v5e", budget="98%", size="small")
      new_state = jax.jit(step)(*args)

* a TARGET string (``"fixtures/zoo/llama.py:small"``) or a resolved
  :class:`hloopt.targets.Target` -- the same, through :func:`hloopt.targets.resolve`;
* a **step** and its arguments: ``step_fn(*args)`` (one declaring ``policy=`` gets
  ``functools.partial(step_fn, policy=<the plan's policy>)``).

Algorithm: :func:`hloopt.pipeline.plan` (lower with every residual saved, analyse, search), then
:func:`hloopt.emit.policy` of the plan, then the step built again with that policy. The result is
an :class:`Offloaded` ``(step_fn, args, plan)`` triple, ready for ``jax.jit``.

Invariant: the returned step lowers to exactly the plan's offloads (``hloopt.verify.verify``
checks the same thing from a plan file); offloading moves values, never changes them, so the step
computes the same numbers as the original one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from hloopt.apply import apply_policy
from hloopt.errors import UserError

__all__ = ["Offloaded", "auto_offload"]


class Offloaded(NamedTuple):
    """What :func:`auto_offload` returns; unpacks as ``step_fn, args, plan``."""

    #: the step built with the plan's policy (keyword arguments of the step, if any, bound)
    step_fn: Callable[..., Any]
    #: its positional arguments (arrays or ``jax.ShapeDtypeStruct``), as the factory gave them
    args: tuple[Any, ...]
    #: the :class:`hloopt.plan.Plan` (``plan.save("plan.json")``, ``hloopt.verify.verify(...)``)
    plan: Any

    @property
    def policy(self) -> Any:
        """The JAX checkpoint policy the step was built with."""
        from hloopt.emit import policy

        return policy(self.plan)


def auto_offload(target: Any, *args: Any, device: Any = "tpu-v5e", budget: str | int | None = None,
                 max_slowdown: float | None = None, solver: str = "auto", time_limit_s: float = 10.0,
                 compile: str | None = None, size: str | None = None, **factory_kwargs: Any) -> Offloaded:
    """Plan ``target``'s offloads for ``device`` within ``budget`` and rebuild it with the policy.

    ``target`` is a factory, a TARGET string or :class:`~hloopt.targets.Target`, or a step taking
    ``policy=`` followed by its ``args`` (see the module docstring). ``device`` is a profile name
    (``"tpu-v5e"``) or a :class:`~hloopt.devices.DeviceProfile`; ``budget`` a size (``"12GiB"``, or
    bytes as an int) or a share of the all-on-device peak (``"75%"``); ``max_slowdown`` a fraction
    (0.03). ``size`` and ``factory_kwargs`` go to a factory. ``compile`` plans on the compiled
    module (``"tpu-v5e"``). Impossible budgets and bad targets are a :class:`UserError`.
    """
    from hloopt import pipeline
    from hloopt.emit import policy as emit_policy

    tgt, build = _as_target(target, args, size=size, factory_kwargs=factory_kwargs)
    profile = _profile(device)
    if isinstance(budget, bool):
        raise UserError(f"auto_offload: budget={budget!r}: expected a size (\"12GiB\", or bytes as an int) "
                        "or a share of the peak (\"75%\")")
    spec = str(budget) if isinstance(budget, int) else budget
    outcome = pipeline.plan(tgt, profile=profile, budget=spec, max_slowdown=max_slowdown, solver=solver,
                            time_limit_s=time_limit_s, compile=compile)
    plan = outcome.plan
    step_fn, step_args = build(emit_policy(plan))
    return Offloaded(step_fn, step_args, plan)


def _profile(device: Any) -> Any:
    from hloopt.devices import DeviceProfile, load_profile

    if isinstance(device, DeviceProfile):
        return device
    if isinstance(device, str):
        return load_profile(device)
    raise UserError(f"auto_offload: device= must be a profile name (tpu-v5e) or a DeviceProfile, "
                    f"got {type(device).__name__}")


Build = Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]


def _bind_kwargs(step_fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Callable[..., Any]:
    return functools.partial(step_fn, **kwargs) if kwargs else step_fn


def _as_target(target: Any, args: tuple[Any, ...], *, size: str | None,
               factory_kwargs: Mapping[str, Any]) -> tuple[Any, Build]:
    """The :class:`Target` to plan on, and how to build the step with a policy."""
    from hloopt.targets import Target, _call_factory, resolve

    if isinstance(target, Target):
        if args or size is not None or factory_kwargs:
            raise UserError(f"auto_offload({target.name}): a Target carries its arguments; pass none")
        tgt = target
    elif isinstance(target, str):
        if args:
            raise UserError(f"auto_offload({target!r}): a TARGET builds its own arguments; pass none")
        tgt = resolve(target, size=size, factory_kwargs=dict(factory_kwargs) or None)
    elif callable(target) and args:
        if size is not None or factory_kwargs:
            raise UserError("auto_offload(step_fn, *args): size= and factory keywords apply to a factory")
        return _step_target(target, args)
    elif callable(target):
        kw = dict(factory_kwargs)
        if size is not None:
            kw["size"] = size
        tgt = _call_factory(_callable_name(target), target, kw)
    else:
        raise UserError(f"auto_offload: expected a factory, a TARGET string, a Target or a step function "
                        f"with its arguments, got {type(target).__name__}")
    if tgt.kind != "jax":
        raise UserError(f"{tgt.name}: auto_offload needs a JAX step (file.py:factory), not an HLO file")

    def build(policy: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        step_fn, args, kwargs = tgt.with_policy(policy)
        return _bind_kwargs(step_fn, kwargs), args

    return tgt, build


def _step_target(step_fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Build]:
    from hloopt.targets import _call_factory

    name = _callable_name(step_fn)
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(step_fn).parameters
    except (TypeError, ValueError):
        params = {}
    p = params.get("policy")
    takes_policy = p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)

    def factory() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return step_fn, args

    def build(policy: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if takes_policy:
            return functools.partial(step_fn, policy=policy), args
        return apply_policy(policy, step_fn), args

    return _call_factory(name, factory, {}), build


def _callable_name(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    return f"{mod}:{getattr(fn, '__qualname__', type(fn).__name__)}"
