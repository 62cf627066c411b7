"""hloopt: what fills accelerator memory in a JAX training step, and what to offload to host."""

from __future__ import annotations

from typing import Any

__all__ = ["apply_plan", "apply_policy", "apply_state_plan", "auto_offload", "liveness_graph", "lower",
           "override_policies", "policy", "use_plan", "use_policy"]

#: public name -> (module, attribute); imported on first use, so that ``import hloopt`` and the
#: CLI's HLO-file commands never pay for jax
_LAZY = {
    "lower": ("hloopt.lowering", "lower"),
    "auto_offload": ("hloopt.auto", "auto_offload"),
    "policy": ("hloopt.emit", "policy"),
    "use_plan": ("hloopt.apply", "use_plan"),
    "apply_plan": ("hloopt.apply", "apply_plan"),
    "use_policy": ("hloopt.apply", "use_policy"),
    "apply_policy": ("hloopt.apply", "apply_policy"),
    "override_policies": ("hloopt.policy_override", "override_policies"),
    "liveness_graph": ("hloopt.graph", "liveness_graph"),
    "apply_state_plan": ("hloopt.state", "apply_state_plan"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hloopt' has no attribute {name!r}")
