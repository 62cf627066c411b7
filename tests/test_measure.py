"""hloopt.measure and ``hloopt measure``: steps run on the CPU backend, checked against outside clocks and XLA."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import cli
from hloopt.devices import load_profile
from hloopt.errors import UserError
from hloopt.measure import SCHEMA, StepTimes, _kendall_tau, materialize, measure, time_steps

ZOO = Path(__file__).resolve().parent.parent / "fixtures" / "zoo"
MLP = f"{ZOO / 'mlp.py'}:tiny"
LLAMA = f"{ZOO / 'llama.py'}:tiny"


def test_step_times_summary_is_numpy_quantiles() -> None:
    import numpy as np

    xs = (0.5, 0.1, 0.4, 0.2, 0.3, 0.9)
    st = StepTimes(xs)
    assert st.median_s == pytest.approx(float(np.median(xs)))
    assert (st.q1_s, st.q3_s) == pytest.approx((float(np.quantile(xs, 0.25)), float(np.quantile(xs, 0.75))))
    assert (st.min_s, st.max_s) == (0.1, 0.9)


def test_kendall_tau_hand_computed() -> None:
    assert _kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert _kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    # pairs (1,2) agree, (1,3) agree, (2,3) disagree: (2 - 1) / 3
    assert _kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def _sleepy_step():  # type: ignore[no-untyped-def]
    """A jitted step that sleeps 20 ms on the host (pure_callback), compiled and run once; the
    list its calls append to (emptied)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    calls: list[int] = []

    def sleepy(x: np.ndarray) -> np.ndarray:
        calls.append(1)
        time.sleep(0.02)
        return x

    f = jax.jit(lambda x: jax.pure_callback(sleepy, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1)
    x = jnp.ones((4,))
    jax.block_until_ready(f(x))
    calls.clear()
    return f, x, calls


def test_time_steps_counts_and_brackets_a_known_sleep() -> None:
    """A step that sleeps 20 ms on the host (pure_callback): every timed step takes at least that,
    there are exactly N of them, and together they fit in the wall time around the call."""
    f, x, calls = _sleepy_step()
    t0 = time.perf_counter()
    st = time_steps(f, (x,), {}, steps=5, warmup=2)
    wall = time.perf_counter() - t0
    assert len(st.times_s) == 5 and len(calls) == 7
    assert st.min_s >= 0.02
    assert sum(st.times_s) <= wall


def test_materialize_keeps_shape_dtype_sharding_and_is_seeded() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    tree = {"w": jax.ShapeDtypeStruct((4, 6), jnp.bfloat16),
            "i": jax.ShapeDtypeStruct((8,), jnp.int32),
            "s": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("d"))),
            "keep": jnp.arange(3)}
    a, b = materialize(tree, seed=3), materialize(tree, seed=3)
    assert a["w"].dtype == jnp.bfloat16 and a["w"].shape == (4, 6)
    assert np.array_equal(np.asarray(a["w"], np.float32), np.asarray(b["w"], np.float32))
    assert float(jnp.std(a["w"].astype(jnp.float32))) > 0.1  # random, not zeros
    assert not np.any(np.asarray(a["i"]))
    assert a["s"].sharding == tree["s"].sharding and len(a["s"].addressable_shards) == 2
    assert a["keep"] is tree["keep"]


@pytest.fixture(scope="module")
def mlp_measured():  # type: ignore[no-untyped-def]
    return measure(MLP, profile=load_profile("tpu-v5e"), steps=4, warmup=1)


@pytest.mark.slow
def test_builtin_policies_run_and_rank(mlp_measured) -> None:  # type: ignore[no-untyped-def]
    from hloopt.anchors import ANCHORS, expressible, policy_object
    from hloopt.pipeline import analyze_target, judge_lowered, run_anchors
    from hloopt.targets import resolve

    m = mlp_measured
    ran = [r for r in m.rows if r.measured is not None]
    # the program names only "mlpwi": MaxText's "full" applies, its name presets do not
    _, problem = analyze_target(resolve(MLP), load_profile("tpu-v5e"))
    expected = {a.name for a in ANCHORS if expressible(a, problem)}
    assert {r.name for r in m.rows} == expected
    assert {r.name for r in ran} == expected, [r.error for r in m.rows]
    for r in ran:
        assert len(r.measured.times_s) == 4
        assert all(math.isfinite(t) and t > 0 for t in r.measured.times_s)
        assert r.measured.min_s <= r.measured.median_s <= r.measured.max_s
    assert sorted(r.predicted_rank for r in ran) == list(range(1, len(ran) + 1))
    assert sorted(r.measured_rank for r in ran) == list(range(1, len(ran) + 1))
    fastest = min(ran, key=lambda r: r.measured.median_s)
    assert fastest.measured_rank == 1
    # the predictions are each policy's lowered step judged by the one memory model and simulator;
    # the replay beside them is `hloopt plan`'s anchors table
    anchors = {a.name: a for a in run_anchors(problem)}
    by_name = {a.name: a for a in ANCHORS}
    names = frozenset(c.name for c in problem.candidates if c.name)
    for r in m.rows:
        j = judge_lowered(resolve(MLP), policy_object(by_name[r.name], names), load_profile("tpu-v5e"))
        assert (r.predicted_step_time_s, r.predicted_peak_bytes, r.predicted_host_bytes) == (
            j.step_time_s, j.peak_bytes, j.host_bytes)
        assert r.replayed_step_time_s == anchors[r.name].step_time_s
    assert m.platform == "cpu" and m.device_peak_note and "None" in m.device_peak_note
    assert all(r.device_peak_bytes is None for r in ran)
    assert all(r.host_peak_rss_bytes and r.host_peak_rss_bytes > 0 for r in ran)


@pytest.mark.slow
@pytest.mark.full
def test_policy_reaches_the_step_saving_nothing_needs_fewer_temporaries() -> None:
    """Llama (scanned layers): XLA's own temporaries for the step with nothing saved are below those
    with everything saved, and each row's figure is what compiling that policy's step says."""
    import jax

    from hloopt.targets import resolve

    m = measure(LLAMA, profile=load_profile("tpu-v5e"), steps=2, warmup=0)
    rows = {r.name: r for r in m.rows if r.measured is not None}
    cp = jax.checkpoint_policies
    for name, pol in (("nothing_saveable", cp.nothing_saveable), ("everything_saveable", cp.everything_saveable),
                      ("dots_saveable", cp.dots_saveable)):
        t = resolve(LLAMA, factory_kwargs={"policy": pol})
        xla = jax.jit(t.step_fn).trace(*t.args).lower().compile().memory_analysis().temp_size_in_bytes
        assert rows[name].compiled_temp_bytes == xla
    assert rows["nothing_saveable"].compiled_temp_bytes < rows["dots_saveable"].compiled_temp_bytes \
        < rows["everything_saveable"].compiled_temp_bytes
    # MaxText's presets apply to llama (it uses MaxText's names)
    assert {"minimal", "full"} <= set(rows)


@pytest.mark.slow
def test_budget_leaves_out_policies_predicted_over_it() -> None:
    m = measure(MLP, profile=load_profile("tpu-v5e"), steps=1, warmup=0, budget="1KiB")
    assert m.rows and all(r.measured is None and r.skipped and "over the budget 1024 B" in r.skipped
                          for r in m.rows)
    assert m.rank_agreement is None


@pytest.mark.slow
def test_cli_json_schema_is_stable() -> None:
    res = CliRunner().invoke(cli, ["measure", MLP, "--steps", "3", "--warmup", "0", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["schema"] == SCHEMA == 1
    assert set(d) == {"schema", "target", "device", "profile", "steps", "warmup", "back_to_back", "budget_bytes",
                      "device_peak_note", "rank_agreement", "notes", "rows"}
    assert d["back_to_back"] == 1  # the CPU backend runs queued calls at once
    assert d["steps"] == 3 and d["device"]["platform"] == "cpu" and d["profile"] == "tpu-v5e"
    assert any("predictions use tpu-v5e" in n for n in d["notes"])
    for row in d["rows"]:
        assert set(row) == {"name", "kind", "code", "predicted", "measured", "skipped", "error"}
        assert set(row["predicted"]) == {"step_time_s", "peak_bytes", "host_bytes", "rank", "replayed_step_time_s"}
        assert set(row["measured"]) == {"step_time_s", "times_s", "device_peak_bytes", "device_peak_is_own",
                                        "host_peak_rss_bytes", "compiled_temp_bytes", "rank", "dispatch_s",
                                        "host_bound"}
        # one call at a time on the CPU backend: no dispatch timed, no host-bound verdict
        assert row["measured"]["dispatch_s"] is None and row["measured"]["host_bound"] is False
        assert set(row["measured"]["step_time_s"]) == {"median", "min", "max", "q1", "q3"}
        assert len(row["measured"]["times_s"]) == 3


def test_cli_rejects_an_hlo_target_in_one_line() -> None:
    res = CliRunner().invoke(cli, ["measure", str(ZOO.parent / "hlo" / "zoo" / "mlp.cpu-compiled.hlo"),
                                   "--device", "tpu-v5e"])
    assert res.exit_code == 2
    assert "cannot be run" in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.full
def test_plan_row_carries_the_plans_prediction_and_runs_its_policy(tmp_path: Path) -> None:
    """A plan from `hloopt plan` is measured with its own policy and device; its predicted numbers are
    the plan file's, and the anchors over the plan's budget are left out."""
    from hloopt import pipeline
    from hloopt.plan import Plan

    # gpt2 tiny: all on device 5.96 MiB, least peak 5.48 MiB (llama tiny's peak is its VMEM heap,
    # which no policy lowers, so no budget below 100% is feasible there)
    gpt2 = f"{ZOO / 'gpt2.py'}:tiny"
    out = pipeline.plan(gpt2, profile=load_profile("tpu-v5e"), budget="97%")
    path = tmp_path / "plan.json"
    path.write_text(out.plan.to_json())
    plan = Plan.load(path)
    res = CliRunner().invoke(cli, ["measure", gpt2, "--plan", str(path), "--steps", "2", "--warmup", "0", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["profile"] == "tpu-v5e" and d["budget_bytes"] == plan.budget.bytes
    rows = {r["name"]: r for r in d["rows"]}
    assert rows["plan"]["kind"] == "plan"
    # predicted: the plan's policy lowered and judged (the model's peak is the plan's own figure
    # for that module); replayed: the plan's prediction
    assert rows["plan"]["predicted"]["replayed_step_time_s"] == plan.predicted.step_time_s
    assert rows["plan"]["predicted"]["peak_bytes"] == plan.predicted.model_peak_bytes
    assert rows["plan"]["predicted"]["host_bytes"] == sum(d.bytes for d in plan.of("offload"))
    assert len(rows["plan"]["measured"]["times_s"]) == 2
    for name, r in rows.items():
        if name == "plan":
            continue
        over = r["predicted"]["peak_bytes"] > plan.budget.bytes
        assert (r["measured"] is None) == over
        if over:
            assert "over the budget" in r["skipped"]
    assert any(r["skipped"] for r in rows.values())  # everything_saveable is over 97% of its own peak


def test_back_to_back_samples_time_the_steady_state_step() -> None:
    """A step that holds the host in a callback for 20 ms, queued 4 at a time: the calls made are
    warm-up + steps x 4, and a sample is the time between the first and the last of its calls
    finishing over the 3 between them. The CPU backend runs independent calls at once (a device
    runs them in order), so two in flight finish a call per 10 ms at best; a queue that held more
    would go faster."""
    f, x, calls = _sleepy_step()
    t0 = time.perf_counter()
    st = time_steps(f, (x,), {}, steps=3, warmup=1, back_to_back=4)
    wall = time.perf_counter() - t0
    assert len(st.times_s) == 3 and len(calls) == 1 + 3 * 4
    assert len(st.dispatch_s) == 3 * 3 and all(d >= 0 for d in st.dispatch_s)
    assert st.min_s >= 0.01
    assert 3 * st.max_s * 3 <= wall


def test_back_to_back_below_one_is_a_user_error() -> None:
    with pytest.raises(UserError, match="back-to-back"):
        time_steps(lambda: None, (), {}, steps=1, warmup=0, back_to_back=0)


def test_a_step_the_host_dispatches_as_slowly_as_it_runs_is_host_bound() -> None:
    """Host-bound: the median dispatch is 80% or more of the median time per step."""
    assert StepTimes((1.0, 1.0, 1.2), (0.8, 0.9, 0.95)).host_bound
    assert not StepTimes((1.0, 1.0, 1.2), (0.1, 0.2, 0.95)).host_bound
    assert not StepTimes((1.0,)).host_bound  # timed one call at a time: nothing to say
