"""The TPU compiler model behind its interface, and transforms that leave their input alone.

Generic liveness and the memory accountant must not import :mod:`hloopt.passes.tpu` (a fresh
interpreter is the truth: ``sys.modules`` after the import); the TPU rules reach liveness only as
the ``fusion`` model it is given. Transforms (layout assignment, host placement, tuple-read
forwarding, the TPU prediction's preparation) return new modules: the input prints the same
before and after, and the result carries the rewritten shapes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hloopt.analysis import analyze
from hloopt.hlo.parser import parse_module
from hloopt.hlo.printer import print_module
from hloopt.ir import HOST_MEMORY_SPACE
from hloopt.passes import AnalysisManager
from hloopt.passes.inline import forward_tuple_reads, inline_calls
from hloopt.passes.liveness import Liveness
from hloopt.passes.residuals import is_host_annotation
from hloopt.passes.tpu import TpuFusion, assign_tpu_layouts

ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "zoo"


def test_generic_analyses_do_not_import_the_tpu_model() -> None:
    code = ("import sys, hloopt.passes.liveness, hloopt.passes.memory, hloopt.passes.aliasing, "
            "hloopt.passes.schedule; print(sorted(m for m in sys.modules if m.startswith('hloopt.passes.tpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


CHAIN = """HloModule chain, entry_computation_layout={(f32[256,256]{1,0})->f32[256,256]{1,0}}

ENTRY main {
  p = f32[256,256]{1,0} parameter(0)
  a = f32[256,256]{1,0} add(p, p)
  b = f32[256,256]{1,0} multiply(a, a)
  c = f32[256,256]{1,0} dot(b, p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT d = f32[256,256]{1,0} tanh(c)
}"""


def test_liveness_takes_the_compiler_model_it_is_given() -> None:
    mod = parse_module(CHAIN)
    plain = AnalysisManager(mod).get(Liveness())
    fused = AnalysisManager(mod).get(Liveness(fusion=TpuFusion()))
    # without a model every instruction holds a buffer; with libtpu's, the add and multiply
    # fuse into the dot, which reads p in their place. 256 x 256 f32 is 262,144 B either way
    # (already (8,128)-aligned). Hand-counted buffers live per step (p, a, b, c, d):
    assert {r.buffer.instruction.name for r in plain.ranges()} == {"p", "a", "b", "c", "d"}
    assert {r.buffer.instruction.name for r in fused.ranges()} == {"p", "c", "d"}
    assert plain.bytes_per_step() == [n * 262144 for n in (1, 2, 3, 3, 3)]
    assert fused.bytes_per_step() == [n * 262144 for n in (1, 1, 1, 2, 3)]


@pytest.mark.parametrize("model", ["mlp.offload", "llama.offload"])
def test_tpu_layouts_are_a_new_module(model: str) -> None:
    mod = parse_module((ZOO / f"{model}.tpu.hlo").read_text())
    mod = inline_calls(mod)
    before = print_module(mod)
    tiled = assign_tpu_layouts(mod)
    assert print_module(mod) == before  # the input is not changed
    assert tiled is not mod
    arrays = [i for i in tiled.instructions() if i.shape.is_array]
    assert arrays and all(i.shape.layout is not None and i.shape.layout.tiles for i in arrays)
    hosted = [i for i in tiled.instructions() if is_host_annotation(i)]
    assert hosted and all(i.shape.layout.memory_space == HOST_MEMORY_SPACE for i in hosted)
    # the untiled input has neither
    assert not any(i.shape.layout is not None and i.shape.layout.tiles for i in mod.instructions())


@pytest.mark.parametrize("model", ["gpt2", "llama.offload", "sharded.offload"])
@pytest.mark.parametrize("platform", ["tpu", None])
def test_analyze_leaves_the_module_it_is_given_as_it_was(model: str, platform: str | None) -> None:
    mod = parse_module((ZOO / f"{model}.tpu.hlo").read_text())
    before = print_module(mod)
    first = analyze(mod, platform=platform)
    assert print_module(mod) == before
    # and analyzing it again gives the same figures (nothing was left rewritten on it)
    assert analyze(mod, platform=platform).peak_bytes == first.peak_bytes


GTE_OF_TUPLE = """HloModule fwd, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

ENTRY main {
  p = f32[8]{0} parameter(0)
  a = f32[8]{0} negate(p)
  t = (f32[8]{0}, f32[8]{0}) tuple(a, p)
  g = f32[8]{0} get-tuple-element(t), index=0
  ROOT r = f32[8]{0} exponential(g)
}"""


def test_forward_tuple_reads_returns_a_new_module() -> None:
    mod = parse_module(GTE_OF_TUPLE)
    before = print_module(mod)
    out = forward_tuple_reads(mod)
    assert print_module(mod) == before
    entry = out.entry
    assert entry is not None
    assert entry.root is not None and entry.root.operands[0].name == "a"
    assert {i.opcode for i in entry.instructions} == {"parameter", "negate", "exponential"}
