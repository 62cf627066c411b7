"""The model zoo: published sizes, MaxText names, offload annotations, snapshots, real training."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hloopt.lowering as lowering  # noqa: E402  (before jax: 8 host devices, cpu platform)

# isort: split
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fixtures.zoo import MAXTEXT_NAMES, MODELS, OFFLOAD_NAMES, _common  # noqa: E402

PINNED = '_xla_buffer_placement="pinned_host"'
TO_DEVICE = '_xla_buffer_placement="device"'


def zoo(model: str):
    return importlib.import_module(f"fixtures.zoo.{model}")


def offload_counts(hlo_text: str) -> tuple[int, int]:
    """(to pinned host, back to device) ``annotate_device_placement`` custom-calls."""
    lines = [ln for ln in hlo_text.splitlines() if 'custom_call_target="annotate_device_placement"' in ln]
    return sum(PINNED in ln for ln in lines), sum(TO_DEVICE in ln for ln in lines)


# -- sizes -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "kw", "n_params"), [
    ("llama", {"variant": "7b"}, 6_738_415_616),        # Llama-2-7B
    ("llama", {"variant": "70b"}, 68_976_648_192),      # Llama-2-70B
    ("gpt2", {}, 1_557_611_200),                        # GPT-2 XL (1.5B)
    ("sharded", {"variant": "7b"}, 6_738_415_616),
])
def test_large_follows_published_sizes(model: str, kw: dict, n_params: int) -> None:
    _, (params, opt_state, batch) = zoo(model).make("large", **kw)
    assert _common.param_count(params) == n_params
    # Built only from ShapeDtypeStruct: nothing allocated, not even the AdamW moments.
    leaves = jax.tree.leaves((params, opt_state, batch))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def test_gpt2_small_is_gpt2_124m_less_unused_positions() -> None:
    _, (params, _, _) = zoo("gpt2").make("small")
    # GPT-2 small has 124,439,808 parameters with 1024 positions; the demo keeps 256 of them.
    assert _common.param_count(params) == 124_439_808 - (1024 - 256) * 768


@pytest.mark.parametrize("model", MODELS)
def test_small_is_demo_sized_and_abstract(model: str) -> None:
    _, args = zoo(model).make("small")
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args))
    assert _common.param_count(args[0]) < 200_000_000


def test_large_llama_computes_in_bf16_with_fp32_master_weights() -> None:
    step, args = zoo("llama").make("large", n_layers=2)
    assert {x.dtype for x in jax.tree.leaves(args[0])} == {jnp.dtype(jnp.float32)}
    text = lowering.lower(step, *args, platform="tpu").hlo_text
    # The 4096-wide projections run in bf16: [batch=1, seq=4096, 4096] bf16 dots exist.
    assert "bf16[1,4096,4096]" in text


def test_large_is_never_concrete() -> None:
    with pytest.raises(ValueError, match="size='large' is only ever abstract"):
        zoo("gpt2").make("large", abstract=False)


def test_bad_size_and_variant_are_rejected() -> None:
    with pytest.raises(ValueError, match="size must be one of tiny, small, large"):
        zoo("llama").make("huge")
    with pytest.raises(ValueError, match="variant= applies to size='large' only"):
        zoo("llama").make("tiny", variant="70b")
    with pytest.raises(ValueError, match="large variant must be one of 7b, 70b"):
        zoo("llama").make("large", variant="13b")


# -- names -------------------------------------------------------------------------------------

def _checkpoint_names(model: str, **kw) -> set[str]:
    step, args = zoo(model).make("tiny", **kw)
    jaxpr = str(jax.make_jaxpr(step)(*args))
    return {name for name in (*MAXTEXT_NAMES, "mlpwi", "conv", "norm") if re.search(rf"\bname={name}\b", jaxpr)}


def test_llama_carries_every_maxtext_name_in_both_layouts() -> None:
    assert _checkpoint_names("llama") == set(MAXTEXT_NAMES)
    assert _checkpoint_names("llama", scan_layers=False) == set(MAXTEXT_NAMES)


def test_gpt2_mlp_convnet_names() -> None:
    assert _checkpoint_names("gpt2") == {"decoder_layer_input", "query_proj", "key_proj", "value_proj",
                                         "context", "out_proj", "mlpwi", "mlpwo"}
    assert _checkpoint_names("mlp") == {"mlpwi"}
    assert _checkpoint_names("convnet") == {"conv", "norm"}


# -- lowering for every platform ---------------------------------------------------------------

@pytest.mark.parametrize("platform", lowering.PLATFORMS)
@pytest.mark.parametrize("model", MODELS)
def test_every_model_lowers_for_every_platform(model: str, platform: str) -> None:
    step, args = zoo(model).tiny()
    result = lowering.lower(step, *args, platform=platform)
    entry = next(ln for ln in result.hlo_text.splitlines() if ln.startswith("HloModule"))
    assert entry.startswith("HloModule jit_step,")
    # One entry parameter per argument leaf; metadata points back at the model's source file.
    n_params = entry.split("->")[0].count("[")
    assert n_params == len(jax.tree.leaves(args))
    assert f"fixtures/zoo/{model}.py" in result.hlo_text
    assert result.platform == platform and result.compiled_text is None and result.memory is None


def test_sharded_lowers_on_an_abstract_2x4_mesh_without_devices() -> None:
    step, args = zoo("sharded").tiny()
    text = lowering.lower(step, *args, platform="tpu").hlo_text
    assert '#sdy.mesh<["data"=2, "model"=4]>' in text
    params = {ln.split(" = ")[0].strip(): ln for ln in text.splitlines() if " parameter(" in ln and "sdy.sharding" in ln}
    # The embedding is split over the vocabulary, the LM head over its columns, and AdamW's
    # moments like their weights; the batch over "data".
    assert r'[{\"model\"}, {}]' in params["params__embed__.1"]
    assert r'[{}, {\"model\"}]' in params["params__lm_head__.1"]
    assert r'[{}, {\"model\"}]' in params["opt_state_0__nu__lm_head__.1"]
    assert r'[{\"data\"}, {}]' in params["batch__tokens__.1"]


# -- offload annotations: exactly when a policy offloads a residual ----------------------------

#: offloadable names whose value the backward pass reads. mlpwo is not: it only feeds a residual
#: add, whose gradient needs no values, so offloading it emits nothing.
LLAMA_RESIDUAL_NAMES = set(MAXTEXT_NAMES) - {"mlpwo"}


@pytest.mark.parametrize(("scan_layers", "names"), [
    (True, ("query_proj",)),
    (True, ("query_proj", "mlpwo")),
    (True, ("mlpwo",)),
    (True, MAXTEXT_NAMES),
    (False, ("query_proj", "mlpwo")),
    (False, MAXTEXT_NAMES),
    (False, ()),
])
def test_llama_offload_annotations_count(scan_layers: bool, names: tuple[str, ...]) -> None:
    step, args = zoo("llama").tiny(policy=_common.offload_policy(names), scan_layers=scan_layers)
    to_host, to_device = offload_counts(lowering.lower(step, *args).hlo_text)
    # Under scan the layer body appears once; unrolled, once per layer (tiny has 2).
    per_body = len(set(names) & LLAMA_RESIDUAL_NAMES)
    expected = per_body * (1 if scan_layers else 2)
    assert (to_host, to_device) == (expected, expected)


@pytest.mark.parametrize("model", MODELS)
def test_offload_annotations_appear_only_with_an_offload_policy(model: str) -> None:
    mod = zoo(model)
    step, args = mod.tiny()
    assert offload_counts(lowering.lower(step, *args).hlo_text) == (0, 0)
    save = jax.checkpoint_policies.save_only_these_names(*OFFLOAD_NAMES[model])
    step, args = mod.tiny(policy=save)
    assert offload_counts(lowering.lower(step, *args).hlo_text) == (0, 0)
    step, args = mod.tiny(policy=_common.offload_policy(OFFLOAD_NAMES[model]))
    to_host, to_device = offload_counts(lowering.lower(step, *args).hlo_text)
    # tiny: mlp and gpt2 have 2 unrolled layers, convnet 2 blocks; llama/sharded scan one body.
    instances = {"mlp": 2, "convnet": 2, "gpt2": 2, "llama": 1, "sharded": 1}[model]
    assert to_host == to_device == instances * len(OFFLOAD_NAMES[model])


# -- snapshots ---------------------------------------------------------------------------------

def _snapshot_module():
    return importlib.import_module("fixtures.regen_snapshots")


def _same_jax_as_the_snapshots(regen) -> None:  # type: ignore[no-untyped-def]
    """The snapshots are one jax's exact text: under another jax there is nothing to compare."""
    recorded = regen.recorded_version("jax")
    if jax.__version__ != recorded:
        pytest.skip(f"the zoo snapshots hold jax {recorded}'s HLO; this is jax {jax.__version__} "
                    "(test_every_model_lowers_for_every_platform covers lowering on it)")


@pytest.mark.parametrize("model", MODELS)
def test_preopt_snapshots_match_current_jax(model: str) -> None:
    regen = _snapshot_module()
    _same_jax_as_the_snapshots(regen)
    for snap in regen.snapshots([model], tpu=False):
        if snap.compile is None:
            for path, text in regen.produce(snap).items():
                assert regen.comparable(path.read_text()) == regen.comparable(text), \
                    f"{path.name} is stale: run python fixtures/regen_snapshots.py"


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_cpu_compiled_snapshots_match_current_jax(model: str) -> None:
    regen = _snapshot_module()
    _same_jax_as_the_snapshots(regen)
    for snap in regen.snapshots([model], tpu=False):
        if snap.compile == "cpu":
            for path, text in regen.produce(snap).items():
                assert regen.comparable(path.read_text()) == regen.comparable(text), \
                    f"{path.name} is stale: run python fixtures/regen_snapshots.py"


def test_snapshot_json_figures_are_consistent() -> None:
    for path in sorted((ROOT / "fixtures/hlo/zoo").glob("*.json")):
        facts = json.loads(path.read_text())
        mem = facts["memory"]
        assert mem["argument_size_in_bytes"] > 0 and mem["output_size_in_bytes"] > 0, path.name
        assert facts["cost"]["flops"] > 0, path.name
        # Only a TPU compile with an offload policy puts temporaries in host memory.
        offloading = bool(facts["offloaded_names"]) and facts["compile"] != "cpu"
        assert (mem["host_temp_size_in_bytes"] > 0) == offloading, path.name


# -- the steps really train --------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "convnet", "gpt2", "llama"])
def test_tiny_step_lowers_the_loss(model: str) -> None:
    step, (params, opt_state, batch) = zoo(model).tiny(abstract=False)
    step = jax.jit(step)
    params, opt_state, first = step(params, opt_state, batch)
    for _ in range(4):
        params, opt_state, loss = step(params, opt_state, batch)
    assert float(loss) < float(first)


@pytest.mark.slow
def test_llama_scan_and_unrolled_compute_the_same_loss() -> None:
    losses = []
    for scan_layers in (True, False):
        step, args = zoo("llama").tiny(scan_layers=scan_layers, policy=_common.offload_policy(("context",)),
                                       abstract=False)
        losses.append(float(jax.jit(step)(*args)[2]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
