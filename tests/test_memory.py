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
