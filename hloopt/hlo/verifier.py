"""Structural checks on a parsed module (XLA's HloVerifier, the part hloopt relies on).

Checks: every computation has exactly one root; operands are defined in the same computation
(the parser also checks while linking; this covers modules built in code); called computations
belong to the module; ``get-tuple-element`` indexes a tuple operand within range and has the element's shape;
``tuple`` has its operands' shapes; called computations exist and the call graph is acyclic;
instructions form no cycle (operands plus control predecessors); the entry signature agrees with
the parameters. Errors are :class:`HloVerifyError` whose message starts with ``FILE:LINE:COL``
of the instruction (or computation) and whose ``detail`` draws a caret under it when the source
text is given; ``line``/``col``/``filename`` are set on the error as on ``HloParseError``.
"""

from __future__ import annotations

from hloopt.errors import HloVerifyError
from hloopt.ir import Computation, Instruction, Module


def _where(mod: Module, inst: Instruction | None, comp: Computation | None = None) -> str:
    line, col = inst.span if inst is not None else (comp.span if comp is not None else (0, 0))
    return f"{mod.filename}:{line}:{col}" if line else mod.filename


def verify_module(mod: Module, *, text: str | None = None, linked: bool = False) -> None:
    """Raise :class:`HloVerifyError` on the first structural problem found.

    ``text``: the source the module was parsed from, for a caret snippet under the problem.
    ``linked``: the module comes straight from the parser, whose linking already guarantees one
    root per computation, operands from the same computation and callees in the module.
    """
    try:
        if not linked:
            _check_structure(mod)
        for comp in mod.computations.values():
            _verify_computation(mod, comp)
        _check_call_graph(mod)
    except HloVerifyError as err:
        _attach_position(err, mod, text)
        raise


def _attach_position(err: HloVerifyError, mod: Module, text: str | None) -> None:
    import re

    m = re.match(r".*?:(\d+):(\d+): ", err.message)
    line, col = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    err.filename = mod.filename
    err.line = line
    err.col = col
    if text is not None and line > 0 and err.detail is None:
        lines = text.split("\n", line)
        if len(lines) >= line:
            src = lines[line - 1]
            start = max(0, col - 80) if len(src) > 160 else 0
            err.detail = src[start:start + 160].expandtabs(1) + "\n" + " " * max(col - 1 - start, 0) + "^"


def _check_structure(mod: Module) -> None:
    """Roots, operand membership and callee membership (what linking guarantees for parsed text)."""
    for comp in mod.computations.values():
        if not comp.instructions:
            raise HloVerifyError(f"{_where(mod, None, comp)}: computation {comp.name!r} has no "
                                 "instructions")
        roots = [i for i in comp.instructions if i.is_root]
        if len(roots) > 1:
            raise HloVerifyError(f"{_where(mod, roots[1])}: computation {comp.name!r} has more than "
                                 f"one ROOT ({roots[0].name!r} and {roots[1].name!r})")
        if comp.root is None or comp.root.parent is not comp and comp.root.parent is not None:
            raise HloVerifyError(f"{_where(mod, None, comp)}: computation {comp.name!r} has no root")
        if roots and roots[0] is not comp.root:
            raise HloVerifyError(f"{_where(mod, roots[0])}: computation {comp.name!r} marks "
                                 f"{roots[0].name!r} as ROOT but its root is {comp.root.name!r}")
        members = {id(i) for i in comp.instructions}
        for inst in comp.instructions:
            for op in inst.operands:
                if id(op) not in members:
                    raise HloVerifyError(
                        f"{_where(mod, inst)}: instruction {inst.name!r} uses {op.name!r}, which "
                        f"is not defined in computation {comp.name!r}")
            for callee in inst.called_computations:
                if mod.computations.get(callee.name) is not callee:
                    raise HloVerifyError(
                        f"{_where(mod, inst)}: {inst.name!r} calls computation {callee.name!r}, "
                        "which is not in the module")


def _verify_computation(mod: Module, comp: Computation) -> None:
    for inst in comp.instructions:
        op = inst.opcode
        if op == "get-tuple-element":
            if len(inst.operands) != 1:
                raise HloVerifyError(f"{_where(mod, inst)}: get-tuple-element {inst.name!r} needs one "
                                     f"operand, has {len(inst.operands)}")
            src = inst.operands[0].shape
            idx = inst.tuple_index
            if not src.is_tuple or not 0 <= idx < len(src.tuple_shapes):
                raise HloVerifyError(f"{_where(mod, inst)}: get-tuple-element {inst.name!r} index {idx} "
                                     f"is out of range for operand shape {src.to_text(layout=False)}")
            if not src.tuple_shapes[idx].same_dims(inst.shape):
                raise HloVerifyError(
                    f"{_where(mod, inst)}: get-tuple-element {inst.name!r} has shape "
                    f"{inst.shape.to_text(layout=False)} but element {idx} of its operand is "
                    f"{src.tuple_shapes[idx].to_text(layout=False)}")
        elif op == "tuple":
            if not inst.shape.is_tuple or len(inst.shape.tuple_shapes) != len(inst.operands) or not all(
                    s.same_dims(o.shape) for s, o in zip(inst.shape.tuple_shapes, inst.operands)):
                raise HloVerifyError(
                    f"{_where(mod, inst)}: tuple {inst.name!r} has shape {inst.shape.to_text(layout=False)}"
                    f" but its operands are ({', '.join(o.shape.to_text(layout=False) for o in inst.operands)})")
    if comp.signature is not None:
        # XLA checks only the result against the root (parameters are not compared).
        _, result = comp.signature
        if comp.root is not None and not result.same_dims(comp.root.shape):
            raise HloVerifyError(
                f"{_where(mod, None, comp)}: computation {comp.name!r} returns "
                f"{result.to_text(layout=False)} but its root {comp.root.name!r} has shape "
                f"{comp.root.shape.to_text(layout=False)}")
    _check_acyclic(mod, comp)


def _check_acyclic(mod: Module, comp: Computation) -> None:
    # Fast path: when every operand and control predecessor comes earlier in the list, the text
    # order is a topological order and there is no cycle (nearly every real module).
    forward = False
    for k, inst in enumerate(comp.instructions):
        for p in inst.operands:
            # ``index`` is the position in the parent's list when the parent is this computation
            if p.parent is not comp or p.index >= k or comp.instructions[p.index] is not p:
                forward = True
                break
        if forward or inst.control_predecessors:
            forward = True
            break
    if not forward:
        return
    # Kahn's algorithm over operand + control edges; iterative so deep graphs cannot overflow.
    indeg = {id(i): 0 for i in comp.instructions}
    succ: dict[int, list[Instruction]] = {id(i): [] for i in comp.instructions}
    for inst in comp.instructions:
        for p in (*inst.operands, *inst.control_predecessors):
            indeg[id(inst)] += 1
            succ[id(p)].append(inst)
    ready = [i for i in comp.instructions if indeg[id(i)] == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for s in succ[id(i)]:
            indeg[id(s)] -= 1
            if indeg[id(s)] == 0:
                ready.append(s)
    if seen != len(comp.instructions):
        stuck = next(i for i in comp.instructions if indeg[id(i)] > 0)
        raise HloVerifyError(f"{_where(mod, stuck)}: instruction {stuck.name!r} in {comp.name!r} "
                             "depends on itself (a cycle through its operands)")


def _check_call_graph(mod: Module) -> None:
    color: dict[str, int] = {}
    for root in mod.computations.values():
        if color.get(root.name):
            continue
        stack = [(root, iter(_callees(root)))]
        color[root.name] = 1
        while stack:
            comp, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[comp.name] = 2
                stack.pop()
                continue
            c = color.get(nxt.name, 0)
            if c == 1:
                raise HloVerifyError(f"{_where(mod, None, nxt)}: computation {nxt.name!r} calls itself "
                                     f"(a cycle in the call graph through {comp.name!r})")
            if c == 0:
                color[nxt.name] = 1
                stack.append((nxt, iter(_callees(nxt))))


def _callees(comp: Computation) -> list[Computation]:
    return [c for i in comp.instructions if i.called for cs in i.called.values() for c in cs]
