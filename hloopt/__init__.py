"""hloopt: what fills accelerator memory in a JAX training step, and what to offload to host."""

from __future__ import annotations

from typing import Any

__all__ = ["auto_offload", "liveness_graph", "lower", "policy"]


def __getattr__(name: str) -> Any:
    # ``hloopt.lower`` imports hloopt.lowering (and jax) only when first used, so that
    # ``import hloopt`` and the CLI's HLO-file commands never pay for jax.
    if name == "lower":
        from hloopt.lowering import lower

        return lower
    if name == "auto_offload":
        from hloopt.auto import auto_offload

        return auto_offload
    if name == "liveness_graph":
        from hloopt.graph import liveness_graph

        return liveness_graph
    if name == "policy":
        from hloopt.emit import policy

        return policy
    raise AttributeError(f"module 'hloopt' has no attribute {name!r}")
