"""Shortcuts the TPU prediction takes for speed against the straightforward code they replace, on
the zoo's pre-optimization snapshots: reordering the module :func:`prepare_for_profile` owns in
place instead of copying it, and the one-allocation instruction copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from hloopt.hlo.parser import parse_module
from hloopt.ir import Instruction, Module
from hloopt.passes import AnalysisManager
from hloopt.passes.inline import _copy, inline_for_assignment, reordered
from hloopt.passes.schedule import Schedule
from hloopt.passes.tpu.layout import assign_tpu_layouts

ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "zoo"
SNAPSHOTS = sorted(p.name for p in ZOO.glob("*.tpu.hlo"))


def _layout_module(name: str) -> Module:
    m = parse_module((ZOO / name).read_text(), filename=name)
    inlined = inline_for_assignment(m)
    return assign_tpu_layouts(inlined, owned=inlined is not m)


def _describe(module: Module) -> list[object]:
    out: list[object] = [module.name, module.entry.name if module.entry else None]
    for comp in module.computations.values():
        out.append((comp.name, comp.root.name if comp.root else None, [p.name for p in comp.parameters],
                    list(comp.by_name), [(c.parent.name if c.parent else "", c.name) for c in comp.callers]))
        for i in comp.instructions:
            out.append((i.name, i.opcode, i.shape, i.index, i.is_root, i.parent is comp, dict(i.attrs),
                        [o.name for o in i.operands], [u.name for u in i.users],
                        [p.name for p in i.control_predecessors],
                        {r: [c.name for c in cs] for r, cs in i.called.items()}, i.literal, i.metadata))
    return out


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_reorder_in_place_is_the_copy(name: str) -> None:
    """The list-scheduled module written down in place equals the copy ``reordered`` makes."""
    copy_src = _layout_module(name)
    order = Schedule(kind="list").run(copy_src, AnalysisManager(copy_src))
    expected = _describe(reordered(copy_src, order.sequences))

    own = _layout_module(name)
    order = Schedule(kind="list").run(own, AnalysisManager(own))
    got = reordered(own, order.sequences, owned=True)
    assert got is own  # no call, every computation reachable: nothing to copy
    assert _describe(got) == expected


def test_reorder_in_place_falls_back_to_the_copy_with_calls() -> None:
    text = """
HloModule m

f {
  a = f32[4]{0} parameter(0)
  ROOT n = f32[4]{0} negate(a)
}

ENTRY e {
  x = f32[4]{0} parameter(0)
  ROOT c = f32[4]{0} call(x), to_apply=f
}
"""
    m = parse_module(text)
    got = reordered(m, {}, owned=True)
    assert got is not m and [i.opcode for i in got.entry.instructions] == ["parameter", "negate"]


def test_copy_sets_every_field() -> None:
    m = parse_module((ZOO / SNAPSHOTS[0]).read_text())
    for inst in m.entry.instructions[:50]:
        new = _copy(inst, "x." + inst.name)
        ref = Instruction("x." + inst.name, inst.opcode, inst.shape)
        for slot in Instruction.__slots__:
            got = getattr(new, slot)  # set (no AttributeError)
            if slot in ("attrs", "_metadata_text", "_metadata", "literal", "span", "is_unknown"):
                assert got == getattr(inst, slot)
            else:
                assert got == getattr(ref, slot) or (slot == "control_predecessors" and not got)


def test_new_buffer_is_the_dataclass() -> None:
    import dataclasses

    from hloopt.ir import Shape
    from hloopt.passes.aliasing import _BUFFER_FIELDS, Buffer, _new_buffer

    assert _BUFFER_FIELDS == tuple(f.name for f in dataclasses.fields(Buffer))
    args = (3, 512, 5, None, (1,), Shape("f32", (4,)), (), 2, ((0,),))
    got, ref = _new_buffer(*args), Buffer(*args)  # type: ignore[arg-type]
    assert [getattr(got, f) for f in _BUFFER_FIELDS] == [getattr(ref, f) for f in _BUFFER_FIELDS]


def _reference_forward_tuple_reads(module: Module) -> Module:
    """The round-by-round removal ``_forward_tuple_reads`` replaced with one worklist."""
    from hloopt.passes.inline import _finish

    for comp in module.computations.values():
        changed = False
        for inst in comp.instructions:
            for k, o in enumerate(inst.operands):
                while (o.opcode == "get-tuple-element" and o.operands[0].opcode == "tuple"
                       and 0 <= o.tuple_index < len(o.operands[0].operands)):
                    o = o.operands[0].operands[o.tuple_index]
                if o is not inst.operands[k]:
                    inst.operands[k] = o
                    changed = True
        while changed:
            _finish(comp)
            dead = {i for i in comp.instructions
                    if not i.users and not i.is_root and i.opcode in ("tuple", "get-tuple-element")}
            changed = bool(dead)
            if changed:
                comp.instructions = [i for i in comp.instructions if i not in dead]
    return module


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_forward_tuple_reads_is_the_round_by_round_removal(name: str) -> None:
    from hloopt.passes.inline import _forward_tuple_reads, inline_calls

    m = parse_module((ZOO / name).read_text(), filename=name)
    assert _describe(_forward_tuple_reads(inline_calls(m))) == \
        _describe(_reference_forward_tuple_reads(inline_calls(m)))


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_list_schedule_operand_lists_are_the_distinct_operands(name: str) -> None:
    """The scheduler (written-out operand lists for 0, 1, 2 operands; a lazy heap whose entries
    are pushed again when a value comes down to its last reader) gives the schedule of its
    definition, every ready instruction's priority computed afresh at each step."""
    from hloopt.passes import schedule as sched

    m = _layout_module(name)
    got = {c.name: [i.name for i in sched.list_schedule(c)] for c in m.computations.values()}
    ref = {c.name: [i.name for i in _reference_list_schedule(c)] for c in m.computations.values()}
    assert got == ref


def _reference_list_schedule(comp):  # type: ignore[no-untyped-def]
    """The list schedule by its definition, with no heap: at every step, among the ready
    instructions, the one with the least (bytes it defines - bytes it frees, text position),
    every priority computed afresh (O(n x ready))."""
    from hloopt.passes.schedule import _FORWARDING

    insts = comp.instructions
    n = len(insts)
    pos = {inst: i for i, inst in enumerate(insts)}
    root = pos.get(comp.root, -1) if comp.root is not None else -1
    size = [0 if inst.opcode in _FORWARDING or inst.shape.on_host else inst.shape.total_byte_size for inst in insts]
    operands, remaining, deps, succs = [], [0] * n, [0] * n, [[] for _ in range(n)]  # type: ignore[var-annotated]
    for i, inst in enumerate(insts):
        ops = list(dict.fromkeys(k for o in inst.operands if (k := pos.get(o)) is not None))
        operands.append(ops)
        preds = dict.fromkeys(ops)
        if inst.control_predecessors:
            preds.update(dict.fromkeys(k for p in inst.control_predecessors if (k := pos.get(p)) is not None))
        deps[i] = len(preds)
        for p in preds:
            succs[p].append(i)
        for o in ops:
            remaining[o] += 1

    def priority(i):  # type: ignore[no-untyped-def]
        return size[i] - sum(size[o] for o in operands[i] if remaining[o] == 1 and o != root)

    ready = {i for i in range(n) if deps[i] == 0}
    out = []
    while ready:
        i = min(ready, key=lambda k: (priority(k), k))
        ready.discard(i)
        out.append(insts[i])
        for o in operands[i]:
            remaining[o] -= 1
        for j in succs[i]:
            deps[j] -= 1
            if deps[j] == 0:
                ready.add(j)
    return out
