"""PeakMemory: timeline, peak, categories and host bytes on hand-computed modules."""

from __future__ import annotations

from hloopt.hlo.parser import parse_module
from hloopt.passes import AnalysisManager
from hloopt.passes.liveness import Liveness
from hloopt.passes.memory import PeakMemory

STEP = """
HloModule m
ENTRY e {
  w = f32[64,64]{1,0} parameter(0), metadata={op_name="params['w']"}
  m = f32[64,64]{1,0} parameter(1), metadata={op_name="opt_state.mu['w']"}
  x = f32[8,64]{1,0} parameter(2), metadata={op_name="batch['x']"}
  h = f32[8,64]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/dot_general"}
  t = f32[8,64]{1,0} tanh(h), metadata={op_name="jit(step)/jvp()/tanh"}
  off = f32[8,64]{1,0:S(5)} copy(h), metadata={op_name="jit(step)/jvp()/offload"}
  g = f32[64,64]{1,0} dot(x, t), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  w2 = f32[64,64]{1,0} subtract(w, g), metadata={op_name="jit(step)/sub"}
  ROOT r = (f32[64,64]{1,0}, f32[64,64]{1,0}, f32[8,64]{1,0:S(5)}) tuple(w2, m, off)
}"""


def profile(text: str, **kw):  # type: ignore[no-untyped-def]
    m = parse_module(text)
    return AnalysisManager(m).get(PeakMemory(**kw))


def test_peak_categories_and_host_apart() -> None:
    p = profile(STEP)
    # steps: w m x h t off g w2 r (0..8); at w2 (step 7) live are w, m, x (parameters), g (read
    # by w2) and w2: 4 * 16384 + 2048 = 67584; at g (step 6) t is live instead of w2: 53248
    assert p.peak_step == 7 and p.peak_bytes == 67584
    assert p.timeline_bytes[6] == 53248
    assert p.timeline_bytes[p.peak_step] == p.peak_bytes
    assert sum(p.categories.values()) == p.peak_bytes
    assert p.categories == {"parameters": 16384, "optimizer state": 16384, "inputs": 2048,
                            "gradients": 16384, "outputs": 16384}
    t = p.ranges.aliasing.buffer_at(p.ranges.module.entry["t"])
    assert p.category_of[t.id] == "activations"  # forward value read by the backward dot
    # the S(5) copy is host memory, never device bytes
    assert p.host_bytes == 2048
    assert p.argument_bytes == 16384 * 2 + 2048
    assert p.output_bytes == 16384 + 24  # w2 and the 3-pointer tuple table (m is a parameter)
    assert [b.name for b in p.top[:1]] and p.top[0].bytes == 16384


def test_tpu_counting_switches_add_up() -> None:
    plain = profile(STEP)
    tpu = profile(STEP, liveness=Liveness(alignment_bytes=512), outputs_whole_program=True, code_bytes=1000)
    # outputs from step 0 (w2 and the 512-B-aligned tuple table) plus code on every step
    assert tpu.timeline_bytes[0] == 16384 * 2 + 2048 + 16384 + 512 + 1000
    assert tpu.peak_bytes >= plain.peak_bytes + 1000


REUSE = """
HloModule m
ENTRY e {
  p = f32[256]{0} parameter(0)
  t = f32[256]{0} exponential(p)
  u = f32[256]{0} negate(t)
  o = f32[256]{0} add(u, p)
  ROOT r = (f32[256]{0}) tuple(o)
}"""


def test_temporaries_inside_an_output_allocation_cost_nothing() -> None:
    # steps p0 t1 u2 o3 r4: t [1,2] ends before o [3,4] starts; u [2,3] dies where o, which reads
    # it elementwise, is defined (XLA's operand sharing), so both fit in o's 1 KiB allocation
    whole = profile(REUSE, outputs_whole_program=True)
    assert whole.peak_bytes == 4 * 1024 + 8 and whole.peak_step == 2  # p, o (whole), t, u, table
    reuse = profile(REUSE, outputs_whole_program=True, reuse_output_allocations=True)
    e = reuse.ranges.module.entry
    buf = reuse.ranges.aliasing.buffer_at
    assert reuse.absorbed == {buf(e["t"]).id, buf(e["u"]).id}
    assert reuse.peak_bytes == 2 * 1024 + 8
    assert reuse.timeline_bytes[reuse.peak_step] == reuse.peak_bytes


def test_a_temporary_that_meets_the_output_or_outgrows_it_stays_on_the_heap() -> None:
    p = profile("""
HloModule m
ENTRY e {
  p = f32[256]{0} parameter(0)
  big = f32[512]{0} broadcast(p), dimensions={}
  s = f32[256]{0} slice(big), slice={[0:256]}
  w = f32[256]{0} exponential(p)
  o = f32[256]{0} add(s, p)
  ROOT r = (f32[256]{0}, f32[256]{0}) tuple(o, w)
}""", outputs_whole_program=True, reuse_output_allocations=True)
    e = p.ranges.module.entry
    buf = p.ranges.aliasing.buffer_at
    # steps p0 big1 s2 w3 o4 r5: big is larger than any output; s [2,4] dies at o [4,5], which
    # reads it elementwise and may overwrite it, so s fits in o's allocation
    assert buf(e["big"]).id not in p.absorbed
    assert buf(e["s"]).id in p.absorbed


ON_CHIP = """
HloModule m
ENTRY e {
  p = f32[256]{0} parameter(0)
  a = f32[4,256]{1,0:S(1)} broadcast(p), dimensions={1}
  c = f32[256]{0} negate(p)
  s = f32[1,256]{1,0:S(1)} slice(a), slice={[0:1], [0:256]}
  t = f32[256]{0} reshape(s)
  o = f32[256]{0} add(c, t)
  ROOT r = (f32[256]{0}) tuple(o)
}"""


def test_libtpu_reports_the_on_chip_heap_when_it_peaks_higher() -> None:
    # steps p0 a1 c2 s3 t4 o5 r6. Device temporaries c [2,5] and t [4,5] peak at 2 KiB; on-chip
    # S(1) a [1,3] and s [3,4] peak at 5 KiB at step 3, which libtpu reports instead
    device = profile(ON_CHIP, outputs_whole_program=True)
    assert device.peak_bytes == 1024 + 1024 + 8 + 2048
    chip = profile(ON_CHIP, outputs_whole_program=True, on_chip_heap=True)
    assert chip.peak_bytes == 1024 + 1024 + 8 + 4096 + 1024 and chip.peak_step == 3
    assert sum(chip.categories.values()) == chip.peak_bytes
    # with the device heap the larger one, nothing changes
    small_chip = ON_CHIP.replace("f32[4,256]{1,0:S(1)} broadcast", "f32[1,256]{1,0:S(1)} broadcast")
    assert profile(small_chip, outputs_whole_program=True, on_chip_heap=True).peak_bytes == \
        profile(small_chip, outputs_whole_program=True).peak_bytes


SHARE = """
HloModule m, is_scheduled=true

fused_grad {
  a = f32[256,256]{1,0} parameter(0)
  g = f32[256,256]{1,0} parameter(1)
  w = f32[256,256]{1,0} parameter(2)
  d = f32[256,256]{1,0} dot(g, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  t = f32[256,256]{1,0} tanh(a)
  ROOT m = f32[256,256]{1,0} multiply(d, t)
}

fused_transposed {
  a = f32[256,256]{1,0} parameter(0)
  g = f32[256,256]{1,0} parameter(1)
  w = f32[256,256]{1,0} parameter(2)
  d = f32[256,256]{1,0} dot(g, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  t = f32[256,256]{0,1} transpose(a), dimensions={1,0}
  ROOT m = f32[256,256]{1,0} multiply(d, t)
}

ENTRY e {
  x = f32[256,256]{1,0} parameter(0)
  w = f32[256,256]{1,0} parameter(1)
  a = f32[256,256]{1,0} exponential(x)
  g = f32[256,256]{1,0} negate(x)
  o = f32[256,256]{1,0} fusion(a, g, w), kind=kOutput, calls=FUSED
  k = f32[256,256]{1,0} negate(o)
  ROOT r = (f32[256,256]{1,0}) tuple(k)
}"""


def test_a_fusion_reading_a_dying_operand_elementwise_takes_its_buffer() -> None:
    # steps x0 w1 a2 g3 o4 k5 r6; every array is 256 KiB. At o, a (read only through tanh and a
    # multiply) and g (read by the dot) die: XLA's heap simulator gives the temporary o a's
    # chunk, not g's (a dot reads it)
    kib = 256 * 1024
    plain = profile(SHARE.replace("FUSED", "fused_grad"))
    assert plain.peak_bytes == 5 * kib and plain.peak_step == 4  # x w a g o
    shared = profile(SHARE.replace("FUSED", "fused_grad"), share_dying_operands=True)
    assert shared.peak_bytes == 4 * kib and shared.timeline_bytes[4] == 4 * kib
    # a transpose is no element-wise read: no sharing
    other = profile(SHARE.replace("FUSED", "fused_transposed"), share_dying_operands=True)
    assert other.peak_bytes == 5 * kib
    # nor when the operand is read after the fusion
    later = SHARE.replace("FUSED", "fused_grad").replace("negate(o)", "add(o, a)")
    assert profile(later, share_dying_operands=True).timeline_bytes[4] == 5 * kib



IN_PLACE = """
HloModule m, is_scheduled=true

body {
  c = (f32[4,256]{1,0:S(1)}, s32[]) parameter(0)
  st = f32[4,256]{1,0:S(1)} get-tuple-element(c), index=0
  i = s32[] get-tuple-element(c), index=1
  row = f32[1,256]{1,0:S(1)} broadcast(i), dimensions={}
  row2 = f32[1,256]{1,0:S(1)} convert(row)
  z = s32[] constant(0)
  d = f32[4,256]{1,0:S(1)} dynamic-update-slice(st, row2, i, z)
  one = s32[] constant(1)
  j = s32[] add(i, one)
  ROOT n = (f32[4,256]{1,0:S(1)}, s32[]) tuple(d, j)
}

cond {
  c = (f32[4,256]{1,0:S(1)}, s32[]) parameter(0)
  i = s32[] get-tuple-element(c), index=1
  four = s32[] constant(4)
  ROOT lt = pred[] compare(i, four), direction=LT
}

ENTRY e {
  p = f32[256]{0} parameter(0)
  a = f32[4,256]{1,0:S(1)} broadcast(p), dimensions={1}
  k = s32[] constant(0)
  t0 = (f32[4,256]{1,0:S(1)}, s32[]) tuple(a, k)
  w = (f32[4,256]{1,0:S(1)}, s32[]) while(t0), condition=cond, body=body
  st = f32[4,256]{1,0:S(1)} get-tuple-element(w), index=0
  s = f32[1,256]{1,0} slice(st), slice={[0:1], [0:256]}
  t = f32[256]{0} reshape(s)
  ROOT r = (f32[256]{0}) tuple(t)
}"""


def test_an_on_chip_value_written_in_place_counts_twice_where_it_is_written() -> None:
    # libtpu's VMEM figure replays memory-space assignment's trace, one allocation per value: the
    # loop's dynamic-update-slice d allocates the stack's next value before the one it overwrites
    # is freed. Steps (flattened): ... row 11, row2 12, z 13, d 14. Fixed: p 1 KiB, the output t
    # 1 KiB, the output tuple 8 B. At d: the stack 4 KiB twice and row2 (read by d) 1 KiB
    kib = 1024
    prof = profile(IN_PLACE, outputs_whole_program=True, on_chip_heap=True)
    assert prof.ranges.steps[14].name == "d"
    assert prof.peak_bytes == 2 * kib + 8 + 4 * kib + 4 * kib + kib and prof.peak_step == 14
    # counted once, the peak would be at row2: the stack, row and row2
    assert prof.timeline_bytes[12] == 2 * kib + 8 + 4 * kib + 2 * kib
    # the same loop on the device heap: XLA's heap simulator shares an in-place buffer
    hbm = profile(IN_PLACE.replace(":S(1)}", "}"), outputs_whole_program=True)
    assert hbm.timeline_bytes[14] == hbm.timeline_bytes[13]  # nothing more is live at d


CARRY_GAP = IN_PLACE.replace("""  row = f32[1,256]{1,0:S(1)} broadcast(i), dimensions={}
  row2 = f32[1,256]{1,0:S(1)} convert(row)
  z = s32[] constant(0)
  d = f32[4,256]{1,0:S(1)} dynamic-update-slice(st, row2, i, z)""", """  q = f32[4,256]{1,0:S(1)} negate(st)
  e = f32[4,256]{1,0:S(1)} exponential(q)
  d = f32[4,256]{1,0:S(1)} negate(e)""")


def test_an_on_chip_loop_carry_is_free_between_its_last_read_and_its_next_write() -> None:
    # body: q reads the carried stack (its last read), e reads q, d (the next carried value)
    # reads e. Per value, at e only q and e are live (4 KiB each); the carry's one buffer over
    # the whole loop would add its 4 KiB there. Fixed: p, the output t, the output tuple
    kib = 1024
    prof = profile(CARRY_GAP, outputs_whole_program=True, on_chip_heap=True)
    names = [i.name for i in prof.ranges.steps]
    e = names.index("e")
    assert prof.timeline_bytes[e] == 2 * kib + 8 + 4 * kib + 4 * kib
    assert prof.peak_bytes == 2 * kib + 8 + 8 * kib


def test_optimizer_state_is_told_by_its_pytree_path() -> None:
    """An argument is optimizer state when its JAX path first runs through an optimizer key
    (optax's ``mu``/``nu``, whatever the argument is called), not a model's (a layer named mu)."""
    text = """
HloModule m
ENTRY e {
  a = f32[64,64]{1,0} parameter(0), metadata={op_name="st[0].mu.layers.w1"}
  b = f32[64,64]{1,0} parameter(1), metadata={op_name="state.params['mu']['kernel']"}
  c = f32[64,64]{1,0} parameter(2), metadata={op_name="state.opt_state[0].nu['Dense_0']['kernel']"}
  d = f32[64,64]{1,0} parameter(3), metadata={op_name="model.layers.w1"}
  s = f32[64,64]{1,0} add(a, b)
  t = f32[64,64]{1,0} add(c, d)
  ROOT r = f32[64,64]{1,0} add(s, t)
}"""
    p = profile(text)
    cats = {b.instruction.name: p.category_of[b.id] for b in p.ranges.buffers if b.parameter >= 0}
    assert cats == {"a": "optimizer state", "b": "parameters", "c": "optimizer state", "d": "parameters"}
