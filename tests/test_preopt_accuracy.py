"""The pre-optimization TPU model (passes/fusion_model.py) against libtpu's own figures.

Truth: the zoo snapshots compiled by libtpu 0.0.42 for v5e (``<m>.tpu-v5e.hlo`` + ``.json``).
The prediction runs on ``<m>.tpu.hlo`` (what ``hloopt plan`` sees) and excludes generated code,
which is unknowable before compiling, so it is compared with ``peak - generated_code_size``.
Misses are strict xfails with the measured error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hloopt.analysis import analyze
from hloopt.hlo.parser import parse_file
from hloopt.ir import Shape
from hloopt.passes import AnalysisManager
from hloopt.passes.fusion_model import TpuFusion, parse_sharding, shard_dims, tpu_compact_bytes

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "hlo" / "zoo"
STEMS = [m + v for m in ("mlp", "convnet", "gpt2", "llama", "sharded") for v in ("", ".offload")]

#: measured error of predicted peak vs libtpu peak minus code (libtpu 0.0.42, jax 0.10.2), > 10%
PEAK_MISSES = {
    "convnet": +1.006, "convnet.offload": +0.589, "gpt2": +0.367, "gpt2.offload": +0.258,
    "sharded": +0.843, "sharded.offload": +2.215,
}


def _figures(stem: str) -> dict[str, int]:
    return json.loads((ZOO / f"{stem}.tpu-v5e.json").read_text())["memory"]


def test_compact_layout_hand_computed() -> None:
    # f32[64,10]: 64 minor (pads to 128), 10 second-minor (pads to 16): 16*128*4
    assert tpu_compact_bytes("f32", (64, 10)) == 16 * 128 * 4
    # f32[3,3,3,8]: 8 minor, 3 second-minor in a T(4,128) tile
    assert tpu_compact_bytes("f32", (3, 3, 3, 8)) == 3 * 3 * 4 * 128 * 4
    # f32[2,64]: T(2,128), then the 512-byte minimum
    assert tpu_compact_bytes("f32", (2, 64)) == 1024
    assert tpu_compact_bytes("f32", ()) == 512
    assert tpu_compact_bytes("bf16", (256, 256)) == 256 * 256 * 2
    assert tpu_compact_bytes("f32", (4, 16, 16, 3)) == 4 * 3 * 16 * 128 * 4


def test_parse_sharding() -> None:
    s = Shape("f32", (2, 64, 128))
    assert parse_sharding("{devices=[1,1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}", s) == (1, 1, 4)
    assert parse_sharding("{replicated}", s) is None
    assert parse_sharding("{maximal device=0}", s) is None
    assert shard_dims(s, (1, 1, 4)) == (2, 64, 32)


@pytest.mark.parametrize("stem", STEMS)
def test_per_device_argument_and_output_bytes_match_libtpu(stem: str) -> None:
    """Compact layouts and shard shapes of entry parameters and outputs give libtpu's totals."""
    mod = parse_file(ZOO / f"{stem}.tpu.hlo")
    plan = AnalysisManager(mod).get(TpuFusion())
    xla = _figures(stem)
    assert mod.entry is not None and mod.entry.root is not None
    assert sum(plan.value_bytes(p) for p in mod.entry.parameters) == xla["argument_size_in_bytes"]
    outputs = sum(plan.value_bytes(o) for o in mod.entry.root.operands)
    # libtpu counts the output tuple's index table too (one 512-byte allocation), and may add one
    # more small output allocation
    assert 0 <= xla["output_size_in_bytes"] - outputs - 512 <= 512


def test_compact_layout_matches_compiled_hbm_shapes() -> None:
    """Every HBM array in the compiled zoo has the compact size, but conv activations (feature-minor)."""
    total = miss = 0
    for path in sorted(ZOO.glob("*.tpu-v5e.hlo")):
        for inst in parse_file(path).instructions():
            if inst.parent is not None and inst.parent.is_fusion:
                continue  # inside a fusion: no allocation of its own
            for _, s in inst.shape.leaves():
                if not s.is_array or s.layout is None or s.layout.memory_space not in (0, 5):
                    continue
                total += 1
                actual = max(512, -(-s.byte_size // 512) * 512)
                if actual != tpu_compact_bytes(s.element_type, s.dims):
                    miss += 1
                    assert "convnet" in path.name and len(s.dims) == 4, (path.name, inst.name, s)
    assert total > 3000 and miss <= total // 100


def _xfail(stem: str):  # type: ignore[no-untyped-def]
    if stem in PEAK_MISSES:
        return pytest.param(stem, marks=pytest.mark.xfail(
            strict=True, reason=f"pre-optimization prediction: measured {PEAK_MISSES[stem]:+.1%}"))
    return stem


@pytest.mark.parametrize("stem", [_xfail(s) for s in STEMS])
def test_predicted_peak_within_10_percent_of_libtpu_without_code(stem: str) -> None:
    xla = _figures(stem)
    report = analyze(ZOO / f"{stem}.tpu.hlo", platform="tpu")
    assert report.profile.code_bytes == 0
    want = xla["peak_memory_in_bytes"] - xla["generated_code_size_in_bytes"]
    assert report.peak_bytes == pytest.approx(want, rel=0.10)


#: XLA's figures at size "small" (recorded from one libtpu compile each)
SMALL = {k: v for k, v in json.loads((Path(__file__).parent / "preopt_small_xla.json").read_text()).items()
         if not k.startswith("_")}
#: measured error at size "small", where > 10%
SMALL_MISSES = {"llama": +0.346}


@pytest.mark.slow
@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.xfail(
    strict=True, reason=f"small: measured {SMALL_MISSES[m]:+.1%}")) if m in SMALL_MISSES else m
    for m in sorted(SMALL)])
def test_small_models_predicted_peak_within_10_percent(model: str) -> None:
    """Lowered here (no compile); XLA's numbers come from the checked-in JSON."""
    from hloopt.lowering import lower
    from hloopt.targets import resolve

    xla = SMALL[model]
    lowered = lower(resolve(f"fixtures/zoo/{model}.py:small"), platform="tpu")
    report = analyze(parse_module_text(lowered.hlo_text), platform="tpu")
    assert report.profile.output_bytes == xla["output_size_in_bytes"]
    want = xla["peak_memory_in_bytes"] - xla["generated_code_size_in_bytes"]
    assert report.peak_bytes == pytest.approx(want, rel=0.10)


def parse_module_text(text: str):  # type: ignore[no-untyped-def]
    from hloopt.hlo.parser import parse_module

    return parse_module(text, filename="<lowered>")
