"""Liveness: HLO in, live intervals and bytes per step out (hand-computed)."""

from __future__ import annotations

from hloopt.hlo.parser import parse_module
from hloopt.passes import AnalysisManager
from hloopt.passes.liveness import Liveness
from hloopt.passes.loops import trip_count
from hloopt.passes.tpu import TpuFusion

CHAIN = """
HloModule m
ENTRY e {
  p = f32[256] parameter(0)
  a = f32[256] negate(p)
  b = f32[256] exponential(a)
  c = f32[256] add(a, b)
  ROOT d = f32[256] negate(c)
}"""


def live(text: str, **kw):  # type: ignore[no-untyped-def]
    m = parse_module(text)
    return m, AnalysisManager(m).get(Liveness(**kw))


def test_chain_intervals_and_bytes_per_step() -> None:
    m, lr = live(CHAIN)
    got = {r.buffer.instruction.name: (r.start, r.end) for r in lr.ranges()}
    # parameters live throughout; a value lives from its definition through its last reader.
    assert got == {"p": (0, 4), "a": (1, 3), "b": (2, 3), "c": (3, 4), "d": (4, 4)}
    assert lr.bytes_per_step() == [1024, 2048, 3072, 4096, 3072]


WHILE = """
HloModule m
body {
  s = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = f32[16] get-tuple-element(s), index=1
  big = f32[1024] broadcast(x), dimensions={}
  r = f32[16] slice(big), slice={[0:16]}
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  ROOT t = (s32[], f32[16]) tuple(i2, r)
}
cond {
  s = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}
ENTRY e {
  p = f32[16] parameter(0)
  z = s32[] constant(0)
  init = (s32[], f32[16]) tuple(z, p)
  w = (s32[], f32[16]) while(init), condition=cond, body=body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT out = f32[16] get-tuple-element(w), index=1
}"""


def test_while_body_peak_shows_at_its_call_site() -> None:
    m, lr = live(WHILE)
    per_step = lr.bytes_per_step()
    entry = lr.entry_timeline(per_step)
    w = m.entry["w"].index
    # the body's f32[1024] temporary (4096 B) is live inside the loop, i.e. at the while's step
    assert entry[w] >= 4096 + 64
    assert max(entry[:w]) < 4096
    # the loop state is a copy of the undonated parameter p (XLA's copy insertion): it lives from
    # the loop's first step (the condition's parameter, after p, z, init) through the end; p
    # lives throughout on its own
    state = lr.aliasing.buffer_at(m.entry["w"], (1,))
    param = lr.aliasing.buffer_at(m.entry["p"])
    assert state is not param
    assert lr.steps[3] is m.computations["cond"].parameters[0]
    assert (lr.start[state.id], lr.end[state.id]) == (3, lr.num_steps - 1)
    assert (lr.start[param.id], lr.end[param.id]) == (0, lr.num_steps - 1)


def test_the_loops_known_trip_count_is_read() -> None:
    m, _ = live(WHILE)
    assert trip_count(m.entry["w"]) == 3


REDUCE = """
HloModule m
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  c = f32[] constant(1)
  x1 = f32[4096] broadcast(c), dimensions={}
  x2 = f32[4096] broadcast(c), dimensions={}
  z = f32[] constant(0)
  r1 = f32[] reduce(x1, z), dimensions={0}, to_apply=add
  r2 = f32[] reduce(x2, z), dimensions={0}, to_apply=add
  ROOT o = f32[] add(r1, r2)
}"""


def test_list_schedule_lowers_the_peak_of_a_bad_text_order() -> None:
    _, text_order = live(REDUCE)
    _, listed = live(REDUCE, schedule="list")
    assert max(text_order.bytes_per_step()) >= 2 * 16384
    assert max(listed.bytes_per_step()) < 16384 + 64
    assert sorted(i.name for i in listed.steps) == sorted(i.name for i in text_order.steps)


def test_tpu_fusion_does_not_materialize_elementwise_chains() -> None:
    _, plain = live(CHAIN)
    _, fused = live(CHAIN, fusion=TpuFusion())
    # a and b are fused into c's fusion: only p, c and d hold buffers
    assert {r.buffer.instruction.name for r in fused.ranges()} == {"p", "c", "d"}
    assert max(fused.bytes_per_step()) == 3072 < max(plain.bytes_per_step())


_CONCAT = """
HloModule m
ENTRY e {
  p = f32[256]{0} parameter(0)
  a = f32[256]{0} negate(p)
  b = f32[256]{0} exponential(p)
  c = f32[512]{0} custom-call(a, b), custom_call_target="ConcatBitcast"
  ROOT r = f32[512]{0} negate(c)
}"""


def test_concat_bitcast_holds_no_storage_its_operands_live_through_its_readers() -> None:
    # libtpu's ConcatBitcast is a view of operands placed side by side: no bytes of its own
    m, lr = live(_CONCAT)
    got = {r.buffer.instruction.name: (r.start, r.end) for r in lr.ranges()}
    assert got == {"p": (0, 4), "a": (1, 4), "b": (2, 4), "r": (4, 4)}
    assert lr.bytes_per_step() == [1024, 2048, 3072, 3072, 5120]
    # read through bitcasts (libtpu's compiled BERT reads a ConcatBitcast of four prefetched weight
    # slices so): the bitcasts are views too, the operands live to the bitcasts' readers, and no
    # buffer of the concatenation's size is counted beside them
    m, lr = live(_CONCAT.replace("  ROOT r = f32[512]{0} negate(c)", "  v = f32[512,1]{0,1} bitcast(c)\n"
                                 "  w = f32[512,1]{0,1} bitcast(v)\n  ROOT r = f32[512,1]{0,1} negate(w)"))
    got = {r.buffer.instruction.name: (r.start, r.end) for r in lr.ranges()}
    assert got == {"p": (0, 6), "a": (1, 6), "b": (2, 6), "r": (6, 6)}
    assert max(lr.bytes_per_step()) == 5120


def test_list_schedule_runs_an_offload_as_soon_as_it_can() -> None:
    """A value placed in host memory (``S(5)``) defines no device bytes: the list scheduler runs
    the offload right after its producer (as XLA starts the copy to host), where an annotation
    left in device memory, 16 KiB more while ``a`` is still read later, waits until it must."""
    from hloopt.passes.schedule import list_schedule

    text = """
HloModule m
ENTRY e {
  p = f32[4096]{0} parameter(0)
  a = f32[4096]{0} exponential(p)
  b = f32[4096]{0} negate(p)
  c = f32[4096]{0} sine(b)
  d = f32[4096]{0} cosine(c)
  h = f32[4096]{0:S(5)} custom-call(a), custom_call_target="annotate_device_placement", frontend_attributes={_xla_buffer_placement="pinned_host"}
  e = f32[4096]{0} add(d, a)
  g = f32[4096]{0} custom-call(h), custom_call_target="annotate_device_placement", frontend_attributes={_xla_buffer_placement="device"}
  ROOT r = f32[4096]{0} add(g, e)
}"""
    order = [i.name for i in list_schedule(parse_module(text).entry)]
    assert order.index("h") == order.index("a") + 1
    # the same annotation left in device memory is an ordinary 16 KiB value: no reason to hurry
    order = [i.name for i in list_schedule(parse_module(text.replace("{0:S(5)}", "{0}")).entry)]
    assert order.index("h") > order.index("d")
