"""Cached values in the IR (Shape sizes, parsed metadata) and hloopt.ir.gc_paused."""

from __future__ import annotations

import dataclasses
import gc
import weakref

from hloopt import ir
from hloopt.hlo.parser import parse_module
from hloopt.ir import Layout, Shape, gc_paused


def test_shape_sizes_computed_once_follow_the_fields():
    s = Shape("bf16", (3, 1000), (False, False), Layout((1, 0), ((8, 128),)))
    # (3, 1000) padded to (8, 1024) tiles: 8 * 1024 bf16 elements
    assert s.byte_size == 8 * 1024 * 2 and s.num_elements == 3000
    assert s.byte_size == 8 * 1024 * 2  # the cached value
    t = dataclasses.replace(s, dims=(16, 1000))
    assert t.byte_size == 16 * 1024 * 2 and t.num_elements == 16000
    # equal shapes compare and hash alike whether or not their sizes were asked for
    u = Shape("bf16", (3, 1000), (False, False), Layout((1, 0), ((8, 128),)))
    assert u == s and hash(u) == hash(s)


def test_metadata_shared_between_instructions_with_the_same_text():
    mod = parse_module("""HloModule m
ENTRY e {
  p = f32[4]{0} parameter(0), metadata={op_name="jit(f)/mul" source_file="f.py" source_line=7}
  a = f32[4]{0} multiply(p, p), metadata={op_name="jit(f)/mul" source_file="f.py" source_line=7}
  ROOT b = f32[4]{0} add(a, p), metadata={op_name="jit(f)/add" source_file="f.py" source_line=8}
}
""")
    p, a, b = mod.entry.instructions
    assert p.metadata is a.metadata and p.metadata.source_line == 7
    assert b.metadata.op_name == "jit(f)/add" and b.metadata.source_line == 8
    assert p.control_predecessors == ()


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_gc_paused_restores_the_collector_state():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_paused_still_frees_cycles_made_inside(monkeypatch):
    # Cycles moved to the oldest generation are freed by the full collection gc_paused runs once
    # the moved objects outnumber what the last full collection left (its 2M floor made small).
    monkeypatch.setattr(ir, "_GC_PROMOTE_MIN", 1000)
    gc.collect()
    heap = len(gc.get_objects())
    refs = []
    for _ in range(3):
        with gc_paused():
            nodes = [_Node() for _ in range(heap)]  # a node and its __dict__: 2 * heap objects
            refs.append(weakref.ref(nodes[0]))
            del nodes
        assert refs[-1]() is None
    monkeypatch.setattr(ir, "_GC_PROMOTE_MIN", 10**9)
    with gc_paused():
        kept = weakref.ref(_Node())
    assert kept() is not None  # below the threshold: left for later


def test_gc_paused_leaves_frozen_objects_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_paused():
            _Node()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
