"""Shape inference for instructions written without a shape (``negate0 = negate(p1)``).

Only what hand-written test modules use: elementwise ops, compare, tuple/get-tuple-element,
copy-like ops, dot, reduce, and ops whose result is a called computation's root. Returns None
when the shape cannot be inferred without more information (the parser then asks for it).
"""

from __future__ import annotations

from hloopt.ir import Computation, Instruction, Shape

_SAME_AS_OPERAND = frozenset({
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clz", "copy", "cosine", "divide", "exponential",
    "exponential-minus-one", "floor", "imag", "is-finite", "log", "log-plus-one", "logistic",
    "maximum", "minimum", "multiply", "negate", "not", "or", "popcnt", "power", "real",
    "remainder", "round-nearest-afz", "round-nearest-even", "rsqrt", "shift-left",
    "shift-right-arithmetic", "shift-right-logical", "sign", "sine", "sqrt", "subtract", "tan",
    "tanh", "xor", "opt-barrier", "while", "clamp", "erf", "cosh", "sinh", "acos", "asin", "atan",
    "acosh", "asinh", "atanh", "reduce-precision", "copy-done", "optimization-barrier",
})


def infer_shape(inst: Instruction, comps: dict[str, Computation]) -> Shape | None:
    op = inst.opcode
    ops = inst.operands
    if op == "tuple":
        return Shape("tuple", tuple_shapes=tuple(o.shape for o in ops))
    if op == "get-tuple-element" and len(ops) == 1 and ops[0].shape.is_tuple:
        idx = inst.tuple_index
        if 0 <= idx < len(ops[0].shape.tuple_shapes):
            return ops[0].shape.tuple_shapes[idx]
        return None
    if op == "select" and len(ops) == 3:
        return ops[1].shape
    if op == "compare" and ops:
        s = ops[0].shape
        return Shape("pred", s.dims, s.dynamic, None)
    if op in _SAME_AS_OPERAND and ops:
        return max((o.shape for o in ops), key=lambda s: s.rank)
    if op in ("call", "fusion", "async-start"):
        callee = inst.called.get("calls") or inst.called.get("to_apply")
        if callee and callee[0].root is not None and callee[0].root.shape is not None:
            return callee[0].root.shape
        return None
    if op == "conditional":
        branches = inst.called.get("branch_computations")
        if branches and branches[0].root is not None:
            return branches[0].root.shape
        return None
    if op == "dot" and len(ops) == 2:
        lhs, rhs = ops[0].shape, ops[1].shape
        lb, lc = inst.attr_ints("lhs_batch_dims"), inst.attr_ints("lhs_contracting_dims")
        rb, rc = inst.attr_ints("rhs_batch_dims"), inst.attr_ints("rhs_contracting_dims")
        dims = [lhs.dims[d] for d in lb]
        dims += [d for i, d in enumerate(lhs.dims) if i not in lb and i not in lc]
        dims += [d for i, d in enumerate(rhs.dims) if i not in rb and i not in rc]
        return Shape(lhs.element_type, tuple(dims))
    if op == "reduce" and ops:
        n = len(ops) // 2
        red = set(inst.attr_ints("dimensions"))
        outs = [Shape(o.shape.element_type, tuple(d for i, d in enumerate(o.shape.dims) if i not in red))
                for o in ops[:n]]
        return outs[0] if n == 1 else Shape("tuple", tuple_shapes=tuple(outs))
    return None
