"""Loops: how many times a ``while`` runs. One rule for every pass (cost, residuals, verify).

``known_trip_count`` when XLA recorded it in the loop's backend_config (compiled modules);
otherwise the pattern JAX lowers ``lax.scan``/``fori_loop`` to: a counter in the loop state that
starts at a constant, moves by a constant each iteration, and is compared with a constant in the
condition (possibly inside a fusion). Anything else is unknown (None): callers decide what an
unknown count means for them.
"""

from __future__ import annotations

import re

from hloopt.ir import Instruction

_KNOWN_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(-?\d+)"?')


def _int_constant(inst: Instruction) -> int | None:
    while inst.opcode in ("copy", "bitcast", "reshape", "convert") and inst.operands:
        inst = inst.operands[0]
    if inst.opcode != "constant" or inst.shape.dims or inst.literal is None:
        return None
    try:
        return int(inst.literal.strip())
    except ValueError:
        return None


def _tuple_index_of(inst: Instruction, param: Instruction) -> int | None:
    """k when ``inst`` is ``get-tuple-element(param), index=k`` (through copies)."""
    while inst.opcode in ("copy", "bitcast") and inst.operands:
        inst = inst.operands[0]
    if inst.opcode == "get-tuple-element" and inst.operands and inst.operands[0] is param:
        return inst.tuple_index
    return None


def _resolve(inst: Instruction, fused_args: dict[Instruction, Instruction]) -> Instruction:
    return fused_args.get(inst, inst)


def trip_count(loop: Instruction) -> int | None:
    """Iterations of a ``while``: from ``known_trip_count``, else from ``i <cmp> C`` with ``i = K; i += S``."""
    m = _KNOWN_TRIP.search(loop.backend_config)
    if m:
        return max(0, int(m[1]))
    cond, body = loop.called.get("condition", [None])[0], loop.called.get("body", [None])[0]
    if cond is None or body is None or cond.root is None or not cond.parameters:
        return None
    cparam = cond.parameters[0]
    root = cond.root
    args: dict[Instruction, Instruction] = {}
    if root.opcode == "fusion":
        fc = root.called["calls"][0]
        args = {p: root.operands[p.parameter_number] for p in fc.parameters}
        if fc.root is None:
            return None
        root = fc.root
    if root.opcode != "compare":
        return None
    direction = root.attrs.get("direction", "")
    a, b = (_resolve(o, args) for o in root.operands)
    k, c = _tuple_index_of(a, cparam), _int_constant(b)
    if k is None or c is None:
        k, c = _tuple_index_of(b, cparam), _int_constant(a)
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    if k is None or c is None:
        return None
    init = loop.operands[0]
    if init.opcode != "tuple" or k >= len(init.operands):
        return None
    start = _int_constant(init.operands[k])
    broot = body.root
    if start is None or broot is None or broot.opcode != "tuple" or not body.parameters:
        return None
    upd = broot.operands[k]
    if upd.opcode not in ("add", "subtract"):
        return None
    step = None
    if _tuple_index_of(upd.operands[0], body.parameters[0]) == k:
        step = _int_constant(upd.operands[1])
    elif upd.opcode == "add" and _tuple_index_of(upd.operands[1], body.parameters[0]) == k:
        step = _int_constant(upd.operands[0])
    if step is None:
        return None
    if upd.opcode == "subtract":
        step = -step
    if direction in ("LT", "LE") and step > 0:
        end = c if direction == "LT" else c + 1
        return max(0, -(-(end - start) // step))
    if direction in ("GT", "GE") and step < 0:
        end = c if direction == "GT" else c - 1
        return max(0, -(-(start - end) // -step))
    if direction == "NE" and step != 0 and (c - start) % step == 0 and (c - start) // step >= 0:
        return (c - start) // step
    return None


__all__ = ["trip_count"]
