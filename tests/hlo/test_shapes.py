"""``Shape.byte_size``: hand-computed cases, and XLA's own figures (memory_analysis of compiled
programs: the TPU snapshots' argument sizes, and CPU compiles of identity-like programs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hloopt.hlo.parser import parse_file, parse_shape

ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "zoo"


@pytest.mark.parametrize("text,expected_bytes", [
    # untiled: elements x storage bytes
    ("f32[3,5]{1,0}", 3 * 5 * 4),
    ("f32[3,5]", 60),
    ("pred[9]", 9),
    ("c64[3]", 3 * 8),
    ("c128[2]", 2 * 16),
    ("f8e4m3fn[7]", 7),
    ("f64[]", 8),
    # XLA stores sub-byte types unpacked (one byte each) unless the layout says E(n)
    ("s4[10]", 10),
    ("s4[10]{0:E(4)}", 5),
    ("u4[7,3]{1,0:E(4)}", 11),          # 21 nibbles -> 84 bits -> 11 bytes
    ("s2[9]{0:E(2)}", 3),               # 18 bits -> 3 bytes
    # tiled: each tiled dim padded to the tile; 3x5 fills one 8x128 tile
    ("f32[3,5]{1,0:T(8,128)}", 8 * 128 * 4),
    ("f32[129,2]{1,0:T(8,128)}", 17 * 8 * 128 * 4),  # ceil(129/8)=17 row tiles
    ("f32[5,3]{0,1:T(8,128)}", 8 * 128 * 4),         # physical order is [3,5]
    ("f32[2,3,5]{2,1,0:T(8,128)}", 2 * 8 * 128 * 4),  # untiled major dim multiplies
    # second-level (2,1) tile packs bf16 pairs; 8 rows are already even, so no extra padding
    ("bf16[3,5]{1,0:T(8,128)(2,1)}", 8 * 128 * 2),
    ("bf16[9,5]{1,0:T(8,128)(2,1)}", 16 * 128 * 2),
    ("f32[1000]{0:T(256)}", 1024 * 4),
    ("s8[3,5]{1,0:T(8,128)(4,1)}", 8 * 128),
    # memory space does not change the size
    ("f32[2,3]{1,0:S(5)}", 24),
    ("f32[<=4,3]", 48),
    ("token[]", 0),
])
def test_byte_size_hand_computed(text: str, expected_bytes: int) -> None:
    assert parse_shape(text).byte_size == expected_bytes


def test_tuple_sizes() -> None:
    s = parse_shape("(f32[2], (s32[], bf16[4]{0}), ())")
    assert s.byte_size == 3 * 8              # the index table: one pointer per element
    assert s.total_byte_size == 8 + 4 + 8   # leaves only
    assert [idx for idx, _ in s.leaves()] == [(0,), (1, 0), (1, 1)]


@pytest.mark.parametrize("model", ["mlp", "convnet", "gpt2", "llama", "sharded"])
@pytest.mark.parametrize("variant", ["tpu-v5e", "offload.tpu-v5e", "cpu-compiled"])
def test_entry_parameter_bytes_match_xla_memory_analysis(model: str, variant: str) -> None:
    """XLA's argument_size_in_bytes is the sum of the entry parameters' buffer sizes: on TPU these
    are tiled (T(8,128), T(8,128)(2,1), T(256)...) so this checks tiling against libtpu itself."""
    hlo = ZOO / f"{model}.{variant}.hlo"
    mem = json.loads((ZOO / f"{model}.{variant}.json").read_text())["memory"]
    mod = parse_file(str(hlo))
    params = mod.entry.parameters
    device = sum(p.shape.total_byte_size for p in params if not p.shape.on_host)
    host = sum(p.shape.total_byte_size for p in params if p.shape.on_host)
    assert device == mem["argument_size_in_bytes"]
    assert host == mem.get("host_argument_size_in_bytes", 0)
    if variant == "cpu-compiled":
        # CPU: the output is the leaves plus the root tuple's pointer table
        root = mod.entry.root.shape
        assert root.total_byte_size + root.byte_size == mem["output_size_in_bytes"]


@pytest.mark.slow
def test_byte_size_matches_cpu_compiler_for_each_dtype() -> None:
    """Compile x -> x + x on CPU for each dtype; the compiled parameter's shape (with the layout XLA
    chose, E(4) for int4) must have the byte size XLA reports as the argument size."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from hloopt.hlo.parser import parse_module

    cases = [(jnp.int4, (10,)), (jnp.uint4, (7, 3)), (jnp.bfloat16, (3, 5)),
             (jnp.float8_e4m3fn, (7,)), (jnp.float8_e5m2, (2, 3)), (jnp.complex64, (3,)),
             (jnp.bool_, (9,)), (jnp.int8, (5, 7)), (jnp.int16, (3,))]
    for dtype, shape in cases:
        fn = (lambda x: ~x) if dtype == jnp.bool_ else (lambda x: x + x)
        compiled = jax.jit(fn).lower(jax.ShapeDtypeStruct(shape, dtype)).compile()
        mod = parse_module(compiled.as_text(), filename=f"{dtype}")
        param = mod.entry.parameters[0]
        assert param.shape.dims == shape
        assert param.shape.byte_size == compiled.memory_analysis().argument_size_in_bytes, (
            dtype, str(param.shape))
