"""hloopt.lowering: pre-optimization text, CPU and deviceless TPU compiles, memory figures, dumps."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hloopt  # noqa: E402
import hloopt.lowering as lowering  # noqa: E402  (before jax: 8 host devices, cpu platform)

# isort: split
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fixtures.zoo import OFFLOAD_NAMES, _common, llama  # noqa: E402
from hloopt.errors import UserError  # noqa: E402
from hloopt.targets import resolve  # noqa: E402

LLAMA = "fixtures/zoo/llama.py:tiny"


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# -- API surface -------------------------------------------------------------------------------

def test_import_hloopt_does_not_import_jax_and_lower_is_reexported() -> None:
    code = ("import sys, hloopt; assert 'jax' not in sys.modules; "
            "import hloopt.lowering; assert 'jax' not in sys.modules; "
            "assert hloopt.lower is hloopt.lowering.lower; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "ok", out.stderr
    assert hloopt.lower is lowering.lower


def test_lowered_is_frozen_and_carries_platform() -> None:
    step, args = llama.tiny()
    result = lowering.lower(step, *args, platform="cuda")
    assert result.platform == "cuda"
    assert "metadata={op_name=" in result.hlo_text  # debug info kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.platform = "tpu"  # type: ignore[misc]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"platform": "rocm"}, "unknown platform 'rocm': expected one of tpu, cuda, cpu"),
    ({"compile": "tpu-v3"}, "unknown compile target 'tpu-v3': expected one of cpu, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e"),
    ({"dump_dir": "/tmp/x"}, "dump_dir= needs compile= (XLA writes dumps while compiling)"),
])
def test_bad_options_are_user_errors(kwargs: dict, message: str) -> None:
    step, args = llama.tiny()
    with pytest.raises(UserError) as err:
        lowering.lower(step, *args, **kwargs)
    assert str(err.value) == message


def test_tpu_compile_without_libtpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lowering, "has_libtpu", lambda: False)
    step, args = llama.tiny()
    with pytest.raises(UserError) as err:
        lowering.lower(step, *args, compile="tpu-v5e")
    assert str(err.value) == "TPU compile needs libtpu: pip install 'hloopt[tpu]'"


def test_policy_reaches_the_step_through_a_target() -> None:
    target = resolve(LLAMA, factory_kwargs={"scan_layers": False})
    plain = lowering.lower(target).hlo_text
    offloaded = lowering.lower(target, policy=_common.offload_policy(("query_proj",))).hlo_text
    assert 'custom_call_target="annotate_device_placement"' not in plain
    # One offload and one reload per unrolled layer (tiny has 2).
    assert offloaded.count('_xla_buffer_placement="pinned_host"') == 2
    # The factory keywords given at resolve time survive the rebuild.
    assert target.rebuild(policy=None).factory_kwargs == {"scan_layers": False, "policy": None}


def test_an_equinox_step_lowers_as_its_own_filter_jit_traces_it() -> None:
    """``lower(step, model, x)`` with an ``eqx.filter_jit`` step and a model holding functions
    (``eqx.nn.MLP``'s activations): the non-array leaves stay static, as ``filter_jit`` keeps them.
    Handed to a plain ``jax.jit`` instead, tracing stops at the first function leaf (what a user
    calling ``hloopt.lowering.lower`` got). Checked against the step run by Equinox itself: the
    lowered module returns the gradients it returns, in its order."""
    eqx = pytest.importorskip("equinox")
    from hloopt.hlo.parser import parse_module

    mlp = eqx.nn.MLP(8, 8, 16, 2, key=jax.random.PRNGKey(0))

    @eqx.filter_jit
    def step(model, x):  # type: ignore[no-untyped-def]
        return eqx.filter_grad(lambda m: m(x).sum())(model)

    x = jnp.ones(8)
    entry = parse_module(lowering.lower(step, mlp, x, platform="cpu").hlo_text).entry
    grads = [leaf.shape for leaf in jax.tree.leaves(step(mlp, x))]
    assert entry.root is not None
    assert [tuple(s.dims) for s in entry.root.shape.tuple_shapes] == grads


def test_hlo_target_cannot_be_lowered() -> None:
    target = resolve(str(ROOT / "fixtures/hlo/zoo/mlp.tpu.hlo"))
    with pytest.raises(UserError, match="a hlo target is HLO already; only jax targets lower"):
        lowering.lower(target)


# -- CPU compile -------------------------------------------------------------------------------

@pytest.mark.slow
def test_cpu_compile_memory_figures_match_the_arguments() -> None:
    step, args = llama.tiny()
    result = lowering.lower(step, *args, platform="cpu", compile="cpu")
    mem = result.memory
    assert mem is not None and result.cost is not None and result.compiled_text is not None
    assert result.compiled_text.startswith("HloModule jit_step, is_scheduled=true")
    # XLA CPU keeps arguments unpadded: exactly the bytes of params, AdamW state and batch.
    assert mem["argument_size_in_bytes"] == nbytes(args)
    assert mem["output_size_in_bytes"] >= nbytes(args[:2])
    assert mem["alias_size_in_bytes"] == 0 and mem["host_temp_size_in_bytes"] == 0
    assert mem["peak_memory_in_bytes"] >= mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
    assert result.cost["flops"] > 0 and result.cost["bytes accessed"] > 0


@pytest.mark.slow
def test_donated_params_and_opt_state_alias_their_outputs() -> None:
    step, args = llama.tiny()
    mem = lowering.lower(step, *args, platform="cpu", compile="cpu", donate_argnums=(0, 1)).memory
    assert mem is not None and mem["alias_size_in_bytes"] == nbytes(args[:2])


@pytest.mark.slow
def test_sharded_step_compiles_on_8_host_devices() -> None:
    target = resolve("fixtures/zoo/sharded.py:tiny")
    mem = lowering.lower(target, platform="cpu", compile="cpu").memory
    assert mem is not None
    # memory_analysis is per device: each holds its shard of every argument.
    shard_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves(target.args))
    assert mem["argument_size_in_bytes"] == shard_bytes < nbytes(target.args)


@pytest.mark.slow
def test_dump_dir_writes_xla_dump_files_that_resolve_as_a_target(tmp_path: Path) -> None:
    step, args = llama.tiny()
    result = lowering.lower(step, *args, platform="cpu", compile="cpu", dump_dir=tmp_path)
    assert result.dump_dir == tmp_path
    names = {p.name for p in tmp_path.iterdir()}
    for suffix in ("before_optimizations.txt", "cpu_after_optimizations.txt",
                   "cpu_after_optimizations-buffer-assignment.txt",
                   "cpu_after_optimizations-memory-usage-report.txt",
                   "cpu_after_optimizations-live-range.txt"):
        assert sum(n.endswith(".jit_step." + suffix) for n in names) == 1, suffix
    before = resolve(str(tmp_path))
    after = resolve(str(tmp_path), stage="after")
    assert before.kind == after.kind == "dump"
    assert before.path is not None and before.path.name.endswith(".jit_step.before_optimizations.txt")
    assert before.text is not None and before.text.startswith("HloModule jit_step")
    assert after.text is not None and "is_scheduled=true" in after.text.splitlines()[0]


# -- deviceless TPU compile (libtpu; one process at a time) ------------------------------------

@pytest.fixture(scope="module")
def v5e_llama() -> tuple[lowering.Lowered, lowering.Lowered]:
    """tiny llama on v5e without and with offloading OFFLOAD_NAMES["llama"]: two TPU compiles."""
    target = resolve(LLAMA)
    plain = lowering.lower(target, compile="tpu-v5e")
    offload = lowering.lower(target, compile="tpu-v5e", policy=_common.offload_policy(OFFLOAD_NAMES["llama"]))
    return plain, offload


def _padded_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of an f32 array in TPU's (8, 128) tiled layout: the two minor dims round up."""
    *major, rows, cols = shape
    return math.prod(major) * (-(-rows // 8) * 8) * (-(-cols // 128) * 128) * itemsize


@pytest.mark.slow
@pytest.mark.tpu
def test_v5e_offload_moves_exactly_the_named_residuals_to_host(v5e_llama) -> None:
    plain, offload = v5e_llama
    assert plain.topology == offload.topology == "v5e:2x2"
    assert plain.memory is not None and offload.memory is not None
    assert plain.memory["host_temp_size_in_bytes"] == 0
    cfg = llama.config("tiny")
    width = {"query_proj": cfg.n_heads * cfg.head_dim, "key_proj": cfg.n_kv_heads * cfg.head_dim,
             "value_proj": cfg.n_kv_heads * cfg.head_dim, "context": cfg.n_heads * cfg.head_dim}
    per_layer = sum(_padded_bytes((cfg.batch, cfg.seq, width[n]), 4) for n in OFFLOAD_NAMES["llama"])
    # Offload inside lax.scan is honored: every layer's residuals live in pinned host memory.
    assert offload.memory["host_temp_size_in_bytes"] == cfg.n_layers * per_layer
    # Host memory space S(5) appears in the compiled layouts only with offloading.
    assert "S(5)" not in (plain.compiled_text or "")
    assert "S(5)" in (offload.compiled_text or "")
    for mem in (plain.memory, offload.memory):
        assert mem["argument_size_in_bytes"] > 0 and mem["peak_memory_in_bytes"] > mem["argument_size_in_bytes"]


def _same_compiler_as(facts: dict, what: str) -> None:  # type: ignore[type-arg]
    from fixtures.regen_snapshots import other_versions

    reason = other_versions(facts, what)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.slow
@pytest.mark.tpu
def test_v5e_figures_match_the_snapshots(v5e_llama) -> None:
    plain, offload = v5e_llama
    for result, stem in ((plain, "llama.tpu-v5e"), (offload, "llama.offload.tpu-v5e")):
        facts = json.loads((ROOT / f"fixtures/hlo/zoo/{stem}.json").read_text())
        _same_compiler_as(facts, f"{stem}.json")
        assert dict(result.memory or {}) == facts["memory"], stem
        assert result.cost is not None and result.cost["flops"] == facts["cost"]["flops"], stem


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.parametrize(("model", "topology"), [
    ("mlp", "v5e:2x2"), ("convnet", "v5e:2x2"), ("gpt2", "v5e:2x2"), ("sharded", "v5e:2x4")])
def test_v5e_compile_per_model_family(model: str, topology: str) -> None:
    result = lowering.lower(resolve(f"fixtures/zoo/{model}.py:tiny"), compile="tpu-v5e")
    assert result.topology == topology
    facts = json.loads((ROOT / f"fixtures/hlo/zoo/{model}.tpu-v5e.json").read_text())
    _same_compiler_as(facts, f"{model}.tpu-v5e.json")
    assert dict(result.memory or {}) == facts["memory"]
    assert facts["memory"]["host_temp_size_in_bytes"] == 0 < facts["memory"]["argument_size_in_bytes"]


@pytest.mark.slow
def test_a_deviceless_tpu_compile_prints_no_libtpu_start_up_complaints(tmp_path: Path) -> None:
    """libtpu, started on a machine without a TPU, complains on stderr that it found no
    accelerator type or worker hostnames (and compiles regardless); hloopt holds those lines
    back and nothing else: the compile's figure is what JAX's own deviceless compile reports,
    and a line the program itself writes to stderr while the topology is built still shows."""
    code = textwrap.dedent("""
        import os, sys
        import hloopt.lowering as lowering
        from hloopt.lowering import _tpu_attached
        assert not _tpu_attached()
        import jax, jax.numpy as jnp
        with lowering._quiet_tpu_runtime_start():
            os.write(2, b"the program's own line\\n")
            from jax.experimental import topologies
            topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
        s = jax.sharding.SingleDeviceSharding(topo.devices[0])
        x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=s)
        m = jax.jit(lambda a: (a @ a).sum()).lower(x).compile().memory_analysis()
        print(m.argument_size_in_bytes)
    """)
    # The test process itself may already hold libtpu (an earlier test compiled for TPU), and
    # libtpu's machine-wide lockfile would refuse the child; libtpu's own switch lets both load it.
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(256 * 256 * 4)]
    assert "the program's own line" in proc.stderr
    for noise in ("could not determine TPU", "Failed to find host bounds", "unexpected worker hostname"):
        assert noise not in proc.stderr


def test_the_same_module_compiled_twice_is_compiled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second compile of a module already compiled in this process (the same function: the
    key holds its source locations, which the compiled text's metadata carries) is served from
    memory with the same compiled text and figures; another module, and a compile that writes
    dump files, are compiled (XLA writes the dump)."""
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)

    def f(a):  # type: ignore[no-untyped-def]
        return jnp.sin(a) @ a

    def g(a):  # type: ignore[no-untyped-def]
        return jnp.cos(a) @ a

    calls = []
    real = lowering._compiled_result

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(lowering, "_compiled_result", counting)
    first = lowering.lower(f, x, platform="cpu", compile="cpu")
    again = lowering.lower(f, x, platform="cpu", compile="cpu")
    other = lowering.lower(g, x, platform="cpu", compile="cpu")
    dumped = lowering.lower(f, x, platform="cpu", compile="cpu", dump_dir=tmp_path)
    assert len(calls) == 3
    assert again.compiled_text == first.compiled_text and dict(again.memory or {}) == dict(first.memory or {})
    assert "cosine" in (other.compiled_text or "") and "cosine" not in (first.compiled_text or "")
    assert dumped.compiled_text is not None and any(tmp_path.iterdir())
