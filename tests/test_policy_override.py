"""hloopt decides the checkpoint policy of programs that do not take one (hloopt.policy_override,
hloopt.apply). Truth is the HLO JAX emits: an offload policy shows as ``annotate_device_placement``
custom-calls to ``pinned_host``; a program's own policy, restored, shows none.

Each framework's own checkpoint API is exercised as its users write it: ``jax.checkpoint``,
flax linen ``nn.remat``, flax ``nnx.remat``, equinox ``eqx.filter_checkpoint``.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from hloopt.apply import apply_plan, apply_policy, use_plan, use_policy
from hloopt.lowering import lower
from hloopt.policy_override import override_policies

D = 64
X = jax.ShapeDtypeStruct((8, D), jnp.float32)
W = jax.ShapeDtypeStruct((D, D), jnp.float32)


def _offload(*names: str):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host")


def _host_annotations(text: str) -> int:
    return sum(1 for line in text.splitlines()
               if "annotate_device_placement" in line and "pinned_host" in line)


def _layer(x, w):
    h = checkpoint_name(jnp.sin(x @ w), "h")
    return jnp.cos(h) @ w


def _plain_step():
    layer = jax.checkpoint(_layer, policy=jax.checkpoint_policies.nothing_saveable)

    def step(x, w):
        return jax.grad(lambda w: jnp.sum(layer(layer(x, w), w)))(w)

    return step


def _lowered(step, *args) -> str:
    return jax.jit(step).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def test_plain_checkpoint_takes_the_imposed_policy_and_gets_its_own_back() -> None:
    step = _plain_step()
    assert _host_annotations(_lowered(step, X, W)) == 0
    with override_policies(_offload("h")) as seen:
        inside = _lowered(step, X, W)
    # two layers, each offloads h: one annotation to host each (JAX's lowering of the policy)
    assert _host_annotations(inside) == 2
    assert seen.count == 2 and seen.own_policies == {"nothing_saveable": 2}
    # no stale trace either way: after the block the program's own policy applies again
    assert _host_annotations(_lowered(step, X, W)) == 0


def test_no_stale_trace_from_before_the_block() -> None:
    step = jax.jit(_plain_step())
    step.trace(X, W).lower(lowering_platforms=("tpu",))  # cached with the program's policy
    with override_policies(_offload("h")):
        assert _host_annotations(step.trace(X, W).lower(lowering_platforms=("tpu",)).as_text()) == 2
    assert _host_annotations(step.trace(X, W).lower(lowering_platforms=("tpu",)).as_text()) == 0


def test_restored_on_error() -> None:
    from jax._src import ad_checkpoint

    bind = ad_checkpoint.remat_p.bind
    with pytest.raises(RuntimeError, match="boom"):
        with override_policies(_offload("h")):
            raise RuntimeError("boom")
    assert ad_checkpoint.remat_p.bind is bind
    assert _host_annotations(_lowered(_plain_step(), X, W)) == 0


def test_nested_blocks_innermost_decides() -> None:
    step = _plain_step()
    with override_policies(jax.checkpoint_policies.nothing_saveable):
        with override_policies(_offload("h")):
            assert _host_annotations(_lowered(step, X, W)) == 2
        assert _host_annotations(_lowered(step, X, W)) == 0


def test_a_program_without_checkpoint_is_counted_as_such() -> None:
    def step(x, w):
        return jax.grad(lambda w: jnp.sum(_layer(x, w)))(w)

    with override_policies(_offload("h")) as seen:
        assert _host_annotations(_lowered(step, X, W)) == 0
    assert seen.count == 0


def test_lower_imposes_the_policy_on_a_plain_step_function() -> None:
    step = _plain_step()
    assert _host_annotations(lower(step, X, W, platform="tpu").hlo_text) == 0
    assert _host_annotations(lower(step, X, W, platform="tpu", policy=_offload("h")).hlo_text) == 2


def test_apply_policy_traces_the_step_with_it_and_computes_the_same_numbers() -> None:
    step = _plain_step()
    wrapped = apply_policy(_offload("h"), step)
    assert _host_annotations(_lowered(wrapped, X, W)) == 2
    x = jax.random.normal(jax.random.key(0), (8, D))
    w = jax.random.normal(jax.random.key(1), (D, D)) / 8
    # the CPU backend runs the offload policy (as a no-op placement); same gradient
    saved = apply_policy(jax.checkpoint_policies.everything_saveable, step)
    assert jnp.allclose(jax.jit(step)(x, w), jax.jit(saved)(x, w), rtol=1e-5, atol=1e-6)


def test_use_plan_and_apply_plan_read_a_plan_file(tmp_path) -> None:
    """The zoo llama threads policy= into its own jax.checkpoint; use_plan/apply_plan on the step
    built without it must give the same HLO annotations as the factory given the plan's policy."""
    from hloopt.emit import policy
    from hloopt.targets import resolve

    plan = _zoo_plan(tmp_path)
    own = resolve("fixtures/zoo/llama.py:tiny")
    rebuilt = own.rebuild(policy=policy(str(plan)))
    expected = _host_annotations(_lowered(rebuilt.step_fn, *rebuilt.args))
    assert expected > 0
    with use_plan(str(plan)) as seen:
        assert _host_annotations(_lowered(own.step_fn, *own.args)) == expected
    assert seen.count > 0
    assert _host_annotations(_lowered(apply_plan(str(plan), own.step_fn), *own.args)) == expected
    assert _host_annotations(_lowered(own.step_fn, *own.args)) == 0  # the program's own again
    with use_policy(None):  # JAX's default: save nothing, offload nothing
        assert _host_annotations(_lowered(own.step_fn, *own.args)) == 0


def _zoo_plan(tmp_path):
    """hloopt plan's plan.json for llama tiny, with its named decisions turned into offloads."""
    from hloopt import pipeline
    from hloopt.devices import load_profile
    from hloopt.targets import resolve

    outcome = pipeline.plan(resolve("fixtures/zoo/llama.py:tiny"), profile=load_profile("tpu-v5e"),
                            max_slowdown=0.03, solver="heuristic", time_limit_s=5.0)
    data = json.loads(outcome.plan.to_json())
    named = [d for d in data["decisions"] if d["selector"]["kind"] == "name"]
    assert named
    for d in named:
        d["action"] = "offload"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


# -- frameworks, as their users write remat -------------------------------------------------------


def test_flax_linen_remat_takes_the_policy() -> None:
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = checkpoint_name(jnp.sin(nn.Dense(D, use_bias=False)(x)), "h")
            return nn.Dense(D, use_bias=False)(jnp.cos(h))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.remat(Block)()(x)
            return x

    model = Model()
    params = jax.eval_shape(model.init, jax.random.key(0), X)

    def step(p, x):
        return jax.grad(lambda p: jnp.sum(model.apply(p, x)))(p)

    assert _host_annotations(_lowered(step, params, X)) == 0
    with override_policies(_offload("h")) as seen:
        assert _host_annotations(_lowered(step, params, X)) == 3
    assert seen.count >= 3
    assert _host_annotations(_lowered(step, params, X)) == 0


def test_flax_nnx_remat_takes_the_policy() -> None:
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(D, D, use_bias=False, rngs=rngs)
            self.b = nnx.Linear(D, D, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.cos(checkpoint_name(jnp.sin(self.a(x)), "h")))

    model = Block(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, x):
        def loss(state):
            m = nnx.merge(graphdef, state)
            return jnp.sum(nnx.remat(lambda m, x: m(x))(m, x))
        return jax.grad(loss)(state)

    state_sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    assert _host_annotations(_lowered(step, state_sds, X)) == 0
    with override_policies(_offload("h")):
        assert _host_annotations(_lowered(step, state_sds, X)) == 1


def test_equinox_filter_checkpoint_takes_the_policy() -> None:
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.a = eqx.nn.Linear(D, D, use_bias=False, key=k1)
            self.b = eqx.nn.Linear(D, D, use_bias=False, key=k2)

        def __call__(self, x):
            return self.b(jnp.cos(checkpoint_name(jnp.sin(self.a(x)), "h")))

    model = Block(jax.random.key(0))

    @eqx.filter_jit
    def step(model, x):
        @eqx.filter_checkpoint
        def fwd(m, x):
            return jax.vmap(m)(x)
        return eqx.filter_grad(lambda m: jnp.sum(fwd(m, x)))(model)

    x = jnp.ones((8, D))

    def text():
        return step.lower(model, x).as_text() if hasattr(step, "lower") else eqx.filter_jit(step).lower(model, x).as_text()

    assert _host_annotations(lower(step, model, x, platform="tpu").hlo_text) == 0
    assert _host_annotations(lower(step, model, x, platform="tpu", policy=_offload("h")).hlo_text) == 1
    assert _host_annotations(lower(step, model, x, platform="tpu").hlo_text) == 0


# -- what a framework's config or JAX's remat3 can express ------------------------------------------


def test_config_only_plan_recomputes_what_the_config_cannot_name() -> None:
    from hloopt import pipeline
    from hloopt.devices import load_profile
    from hloopt.emit import MAXTEXT_NAMES, maxtext_unexpressible
    from hloopt.targets import resolve

    # gpt2 tiny: all on device 5.96 MiB, least peak 5.48 MiB (the memory model's figures)
    outcome = pipeline.plan(resolve("fixtures/zoo/gpt2.py:tiny"), profile=load_profile("tpu-v5e"),
                            budget="5.8MiB", solver="milp", time_limit_s=10.0)
    allowed = {c.key: c.allowed for c in outcome.problem.candidates}
    choosable = [k for k, a in allowed.items() if any(x.value == "remat" for x in a)]
    alt = pipeline.config_only_plan(outcome, MAXTEXT_NAMES)
    assert alt is not None and not maxtext_unexpressible(alt, choosable)
    for d in alt.decisions:
        if d.name not in MAXTEXT_NAMES:
            assert d.action == ("remat" if any(a.value == "remat" for a in allowed[d.key]) else "device")
    assert alt.predicted.peak_bytes <= outcome.plan.budget.bytes
    # a narrower choice never beats the optimum of the wider one (within the MILP's gap, and the
    # 5% within which the planner times a policy as the step lowered with it: the config-only
    # plan is searched over the step lowered again with the names alone saved,
    # tests/test_time_model.py)
    gap = outcome.plan.solver.gap or 0.0
    assert alt.predicted.step_time_s >= outcome.plan.predicted.step_time_s * (1 - gap - 0.05)


def test_remat3_gets_a_policy_it_reads_or_is_told_what_it_cannot_do(tmp_path) -> None:
    from hloopt.emit import load_plan, policy, remat3_limits

    if not hasattr(jax.config, "jax_remat3"):
        pytest.skip(f"jax {jax.__version__} has no jax_remat3 flag")
    offloading = load_plan(str(_zoo_plan(tmp_path)))
    data = json.loads(offloading.to_json())
    for d in data["decisions"]:
        d["action"] = "device" if d["selector"]["kind"] == "name" else "remat"
    saving_path = tmp_path / "saving.json"
    saving_path.write_text(json.dumps(data))
    saving = load_plan(str(saving_path))
    step = _plain_step()
    previous = jax.config.jax_remat3
    jax.config.update("jax_remat3", True)
    try:
        pol = policy(saving)
        assert type(pol) is type(jax.checkpoint_policies.save_only_these_names("x"))
        assert remat3_limits(saving) is None
        limits = remat3_limits(offloading)
        assert limits is not None and f"{len(offloading.of('offload'))} offload(s)" in limits
        # JAX's remat3 drops offloading: the offloading plan's policy annotates nothing
        assert _host_annotations(_lowered(apply_policy(policy(offloading), step), X, W)) == 0
    finally:
        jax.config.update("jax_remat3", previous)
