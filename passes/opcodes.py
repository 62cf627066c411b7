"""Groups of HLO opcodes, named once for every pass.

Each analysis needs its own notion of "an instruction that only forwards storage" or "a cheap
op": liveness must know that a ``get-tuple-element`` reads no buffer, the fusion model that an
``add`` fuses into its consumer, the cost model that ``tanh`` is transcendental. Those notions
differ by pass (a ``reshape`` is a view for the offload walk but allocates in a CPU module), so
passes build their sets from these groups, by name, and say what they add: a new opcode XLA
grows is then added to one group here, not to seven frozensets that must agree.

The groups follow XLA's own classification (``hlo_opcode.h`` and ``HloInstruction::IsElementwise``,
``instruction_fusion.cc``'s cheap ops), with both spellings where XLA's text format has two (``opt-barrier``
and ``optimization-barrier``; ``exp`` and ``exponential``).
"""

from __future__ import annotations

from hloopt.ir import Instruction

#: control flow: their called computations run in their place
CONTROL_FLOW = frozenset({"while", "conditional", "call"})

#: optimization barriers (``jax.checkpoint`` keeps its saved values apart with them)
BARRIERS = frozenset({"opt-barrier", "optimization-barrier"})

#: tuples and their elements: index tables, no data of their own
TUPLE_OPS = frozenset({"tuple", "get-tuple-element"})

#: views of an operand's bytes in another shape
VIEWS = frozenset({"bitcast", "reshape"})

#: asynchronous copies (host offload and prefetch, in compiled modules)
ASYNC_COPIES = frozenset({"copy-start", "copy-done"})

#: element-wise math that is not transcendental (HloInstruction::IsElementwise, less the
#: transcendental ones below)
ELEMENTWISE = frozenset({
    "abs", "add", "and", "ceil", "clamp", "compare", "complex", "convert", "count-leading-zeros",
    "divide", "floor", "imag", "is-finite", "maximum", "minimum", "multiply", "negate", "not", "or",
    "popcnt", "real", "reduce-precision", "remainder", "round-nearest-afz", "round-nearest-even",
    "select", "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "subtract",
    "xor", "stochastic-convert",
})

#: element-wise math XLA counts as transcendental (cost_analysis' "transcendentals")
TRANSCENDENTAL = frozenset({
    "exponential", "exp", "log", "logistic", "power", "sqrt", "cbrt", "rsqrt", "tanh", "sine", "cosine",
    "tan", "exponential-minus-one", "log-plus-one", "atan2", "erf",
})

#: collectives (synchronous and start of asynchronous)
COLLECTIVES = frozenset({
    "all-gather", "all-gather-start", "all-reduce", "all-reduce-start", "reduce-scatter", "all-to-all",
    "collective-permute", "collective-permute-start", "collective-broadcast", "ragged-all-to-all",
})

#: element-wise and data-movement ops XLA's instruction fusion puts into their consumers
#: (``instruction_fusion.cc``: cheap, each output element from at most a few input elements)
FUSIBLE = ELEMENTWISE - {"stochastic-convert", "count-leading-zeros"} | {
    "stochastic-convert", "count-leading-zeros",
    "cos", "sin", "exp", "log", "logistic", "power", "sqrt", "cbrt", "rsqrt", "tanh", "tan", "atan2", "erf",
    "exponential", "exponential-minus-one", "log-plus-one", "cosine", "sine", "expm1", "log1p",
    "broadcast", "iota", "constant", "reshape", "bitcast", "bitcast-convert", "transpose", "slice", "pad",
    "reverse",
}

#: custom-calls that are identities once the SPMD partitioner has run (sharding markers)
IDENTITY_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})


def is_identity_call(inst: Instruction) -> bool:
    """A sharding marker: a ``custom-call`` the SPMD partitioner replaces by its operand."""
    return inst.opcode == "custom-call" and inst.custom_call_target in IDENTITY_CALLS


#: custom-calls that say which memory a value lives in (JAX's offload and reload markers); XLA's
#: host offloader turns them into DMA copies, or into a stack written in host memory
PLACEMENT_CALLS = frozenset({"annotate_device_placement"})


def is_host_transfer(inst: Instruction) -> bool:
    """A move between device and host memory: a placement marker (pre-optimization), or an
    asynchronous copy to or from host memory (``S(5)``, compiled). Its time is the host link's,
    on DMA engines beside the compute, not an op of the compute stream."""
    if inst.opcode == "custom-call":
        return inst.custom_call_target in PLACEMENT_CALLS
    if inst.opcode in ASYNC_COPIES:
        return any(s.on_host for _, s in inst.shape.leaves() if s.is_array) or any(
            s.on_host for o in inst.operands for _, s in o.shape.leaves() if s.is_array)
    return False


#: the ends of a ``shard_map`` body in text lowered with Shardy (JAX's default partitioner): a
#: tuple of each operand's per-device shard (``GlobalToLocalShape``) and of each result's global
#: array (``LocalToGlobalShape``). Once partitioned both are the operands themselves: element k of
#: the result is operand k's storage, as a ``tuple``'s elements are.
SHARD_MAP_BOUNDARIES = frozenset({"xla.sdy.GlobalToLocalShape", "xla.sdy.LocalToGlobalShape"})


def is_shard_map_boundary(inst: Instruction) -> bool:
    """A Shardy ``shard_map`` boundary: a custom-call whose result element k is operand k."""
    return inst.opcode == "custom-call" and inst.custom_call_target in SHARD_MAP_BOUNDARIES


def is_elementwise_dot(inst: Instruction) -> bool:
    """A dot that contracts nothing (``einsum("...hqk,h->...hqk")``, BERT's head mask): XLA's
    algebraic simplifier rewrites it as a multiply of broadcasts, elementwise, with no matmul
    (libtpu's compiled BERT has a fused ``multiply`` and no buffer where JAX wrote the dot)."""
    return inst.opcode == "dot" and not inst.attr_ints("lhs_contracting_dims") \
        and not inst.attr_ints("rhs_contracting_dims")


__all__ = ["ASYNC_COPIES", "BARRIERS", "COLLECTIVES", "CONTROL_FLOW", "ELEMENTWISE", "FUSIBLE", "IDENTITY_CALLS",
           "PLACEMENT_CALLS", "SHARD_MAP_BOUNDARIES", "TRANSCENDENTAL", "TUPLE_OPS", "VIEWS", "is_elementwise_dot",
           "is_host_transfer", "is_identity_call", "is_shard_map_boundary"]
