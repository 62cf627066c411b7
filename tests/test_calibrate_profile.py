"""``hloopt calibrate --profile``: a trace recorded here on the CPU backend, parsed, fitted, written, loaded."""

from __future__ import annotations

import dataclasses
import datetime as dt
import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.calibrate import (
    Calibration,
    LinkFit,
    TraceCalibration,
    calibrated_profile,
    fit_trace,
    fit_trace_lowered,
    trace_calibrated_profile,
)
from hloopt.cli import cli
from hloopt.devices import load_profile
from hloopt.profile_trace import OpEvent, Step, Trace, Transfer, leaf_ops, read_trace

ZOO = Path(__file__).resolve().parent.parent / "fixtures" / "zoo"
MLP = f"{ZOO / 'mlp.py'}:tiny"
STEPS = 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MLP step run STEPS times under jax.profiler.trace on the CPU backend."""
    import jax

    from hloopt.measure import materialize
    from hloopt.targets import resolve

    t = resolve(MLP)
    args = materialize(tuple(t.args))
    f = jax.jit(t.step_fn)
    jax.block_until_ready(f(*args))  # compile outside the trace
    where = tmp_path_factory.mktemp("trace")
    with jax.profiler.trace(str(where)):
        for i in range(STEPS):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                jax.block_until_ready(f(*args))
    return where


@pytest.mark.slow
def test_trace_ops_add_up_within_each_step(recorded: Path) -> None:
    from hloopt.calibrate import compiled_module_for
    from hloopt.targets import resolve

    trace = read_trace(recorded)
    assert trace.path.name.endswith(".trace.json.gz")
    module = compiled_module_for(resolve(MLP))
    cal = fit_trace(trace, module, load_profile("h200"))
    # one module run per step we ran, each timed by the trace's own module event
    assert len(cal.step_wall_s) == STEPS
    for wall, ops in zip(cal.step_wall_s, cal.step_op_s):
        assert 0 < ops <= wall
    # every op event names an instruction of the compiled module, and each step ran them all
    assert cal.unmatched_ops == ()
    assert cal.matched_events % STEPS == 0 and cal.matched_events > 0


@pytest.mark.slow
def test_calibrated_profile_loads_and_dot_efficiency_is_physical(recorded: Path, tmp_path: Path) -> None:
    out = tmp_path / "cpu.toml"
    res = CliRunner().invoke(cli, ["calibrate", "--profile", str(recorded), "--target", MLP, "--base", "h200",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    base = load_profile("h200")
    assert p.name == "h200-calibrated"
    eff = p.compute_efficiency["dot"]
    # this CPU does not beat an H200's tensor cores, and no CPU reaches 10 TFLOP/s in f32
    assert 0 < eff < 1
    assert 0 < eff * base.flops_per_s("f32") < 1e13
    src = p.sources["compute_efficiency.dot"]
    assert src.startswith("MEASURED") and str(recorded) in src and f"{STEPS} steps" in src
    # no copies on the CPU backend: the link keeps the base's figures and sources, and says so
    assert (p.d2h_bytes_per_s, p.h2d_bytes_per_s) == (base.d2h_bytes_per_s, base.h2d_bytes_per_s)
    assert p.sources["d2h_bytes_per_s"] == base.sources["d2h_bytes_per_s"]
    assert "NOT MEASURED" in p.sources["host_link.calibration"]
    assert "no host<->device copies" in res.output


@pytest.mark.slow
def test_cost_model_with_the_fit_reproduces_the_measured_class_times(recorded: Path) -> None:
    """The cost model divides each op's roofline by its class's efficiency: summed over the trace's
    events, the calibrated profile predicts exactly the measured time per class."""
    from hloopt.calibrate import compiled_module_for
    from hloopt.passes.cost import CostAnalysis, op_class
    from hloopt.targets import resolve

    trace = read_trace(recorded)
    module = compiled_module_for(resolve(MLP))
    base = load_profile("h200")
    cal = fit_trace(trace, module, base)
    fitted = trace_calibrated_profile(base, cal)
    cost = CostAnalysis(profile=fitted).run(module)
    insts = {i.name: i for c in module.computations.values() for i in c.instructions}
    predicted: dict[str, float] = {}
    for o in leaf_ops(trace.ops):
        cls = op_class(insts[o.op])
        predicted[cls] = predicted.get(cls, 0.0) + cost.of(o.op).xla.seconds
    for f in cal.fits:
        assert predicted[f.op_class] == pytest.approx(f.measured_s, rel=1e-9)
    assert {f.op_class for f in cal.fits} >= {"dot", "elementwise"}


def _trace_file(tmp_path: Path, events: list[dict]) -> Path:  # type: ignore[type-arg]
    run = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    run.mkdir(parents=True)
    path = run / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_copies_in_a_trace_become_the_link_rates_and_keep_the_previous_source(tmp_path: Path) -> None:
    """Hand-written events in XLA's CUPTI format: 2 MB D2H in 100 us + 2 MB in 100 us -> 20 GB/s;
    1 MB H2D in 40 us -> 25 GB/s."""
    detail = "kind_src:{} kind_dst:{} size:{} dest:0 async:1"
    events = [
        {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 100, "name": "MemcpyD2H",
         "args": {"memcpy_details": detail.format("device", "pinned", 2_000_000)}},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 200, "dur": 100, "name": "MemcpyD2H",
         "args": {"memcpy_details": detail.format("device", "pinned", 2_000_000)}},
        {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 40, "name": "MemcpyH2D",
         "args": {"memcpy_details": detail.format("pinned", "device", 1_000_000)}},
    ]
    trace = read_trace(_trace_file(tmp_path, events).parent.parent.parent.parent)
    assert sorted((t.direction, t.bytes) for t in trace.transfers) == [("d2h", 2_000_000), ("d2h", 2_000_000),
                                                                       ("h2d", 1_000_000)]
    cal = TraceCalibration(trace=str(trace.path), module="jit_step", step_wall_s=(), step_op_s=(), fits=(),
                           matched_events=0, unmatched_ops=(), d2h_bytes_per_s=20e9, h2d_bytes_per_s=25e9,
                           transfers=3)
    base = load_profile("tpu-v5e")
    p = trace_calibrated_profile(base, cal, when=dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc))
    assert (p.d2h_bytes_per_s, p.h2d_bytes_per_s) == (20e9, 25e9)
    assert p.sources["d2h_bytes_per_s"].startswith("MEASURED") and "2026-01-02" in p.sources["d2h_bytes_per_s"]
    prev = p.sources["d2h_bytes_per_s.previous"]
    assert prev.startswith("15.0 GB/s in tpu-v5e: ") and base.sources["d2h_bytes_per_s"] in prev
    assert "host_link.calibration" not in p.sources


def test_fit_trace_rates_from_copies_hand_computed(tmp_path: Path) -> None:
    from hloopt.hlo.parser import parse_module

    text = """HloModule jit_f, is_scheduled=true

ENTRY %main (p: f32[64,64]) -> f32[64,64] {
  %p = f32[64,64]{1,0} parameter(0)
  ROOT %dot = f32[64,64]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    module = parse_module(text)
    trace = Trace(tmp_path, ops=(OpEvent("jit_f", "dot", 10.0, 5.0, 1, 1),),
                  runs=(), transfers=(Transfer("d2h", 1000, 1.0), Transfer("d2h", 3000, 1.0)))
    cal = fit_trace(trace, module, load_profile("h200"))
    assert cal.d2h_bytes_per_s == pytest.approx(4000 / 2e-6) and cal.h2d_bytes_per_s is None
    (f,) = cal.fits
    assert f.op_class == "dot" and f.flops == 2 * 64 * 64 * 64 and f.measured_s == pytest.approx(5e-6)
    h200 = load_profile("h200")
    # the roofline of this small dot on an H200 is its bytes (two reads, one write of 16 KiB), not its FLOPs
    assert f.bytes == 3 * 64 * 64 * 4
    roofline_s = max(f.flops / h200.flops_per_s("f32"), f.bytes / h200.hbm_bytes_per_s)
    assert roofline_s == f.bytes / h200.hbm_bytes_per_s
    assert f.efficiency == pytest.approx(roofline_s / 5e-6)


def test_a_trace_of_command_buffers_is_refused_with_the_flag_that_avoids_them(tmp_path: Path) -> None:
    """Measured on an H200 (jax 0.11.2): with XLA's default command buffers the trace's op events
    for llama small were ``command_buffer_1``, ``command_buffer_17``... and none matched an
    instruction; the fit must not go on with what is left."""
    from hloopt.errors import UserError
    from hloopt.hlo.parser import parse_module

    module = parse_module("""HloModule jit_f, is_scheduled=true

ENTRY %main (p: f32[64,64]) -> f32[64,64] {
  %p = f32[64,64]{1,0} parameter(0)
  ROOT %dot = f32[64,64]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
""")
    trace = Trace(tmp_path, ops=(OpEvent("jit_f", "dot", 10.0, 5.0, 1, 1),
                                 OpEvent("jit_f", "command_buffer_17", 20.0, 50.0, 1, 1)), runs=(), transfers=())
    with pytest.raises(UserError, match="command_buffer_17.*--xla_gpu_enable_command_buffer="):
        fit_trace(trace, module, load_profile("h200"))
    fit_trace(dataclasses.replace(trace, ops=trace.ops[:1]), module, load_profile("h200"))


def test_leaf_ops_drop_an_enclosing_loop_event() -> None:
    loop = OpEvent("m", "while", 0.0, 10.0, 1, 1)
    body = [OpEvent("m", "a", 1.0, 3.0, 1, 1), OpEvent("m", "b", 5.0, 4.0, 1, 1)]
    other_thread = OpEvent("m", "c", 2.0, 1.0, 1, 2)
    assert sorted(o.op for o in leaf_ops([loop, *body, other_thread])) == ["a", "b", "c"]


#: one step of the zoo Llama (small, its default policy) recorded on a TPU v5e (libtpu 0.0.42.1,
#: jax 0.10.2, bench/results/2026-12-07-tpu-v5e/): the device's own events, the host's step marker
TPU_TRACE = Path(__file__).resolve().parent.parent / "fixtures" / "traces" / "tpu-v5e-llama-small.trace.json.gz"
#: the same step compiled here, deviceless, by the same libtpu (fixtures/record_small_tpu.py)
TPU_COMPILED = Path(__file__).resolve().parent.parent / "fixtures" / "hlo" / "zoo" / "dumps" / "llama.small.tpu-v5e.hlo.gz"


def test_a_tpu_trace_names_instructions_of_the_module_libtpu_compiles_here() -> None:
    """The TPU writes its op events without ``hlo_op``/``hlo_module``: each is named by its
    instruction, and its module is the ``XLA Modules`` run that holds it. Every op event read
    names an instruction of the module libtpu compiles for the same step on this machine, and the
    leaf events fill the run's device time without exceeding it."""
    from hloopt.hlo.parser import parse_module
    from hloopt.profile_trace import ops_in_run

    trace = read_trace(TPU_TRACE)
    module = parse_module(gzip.open(TPU_COMPILED, "rt").read())
    names = {i.name for c in module.computations.values() for i in c.instructions}
    assert len(trace.runs) == 1 and trace.runs[0].module == module.name == "jit_step"
    assert len(trace.ops) > 1000 and {o.module for o in trace.ops} == {"jit_step"}
    assert [o.op for o in trace.ops if o.op not in names] == []
    run = trace.runs[0]
    busy = sum(o.dur_us for o in leaf_ops(ops_in_run(trace, run)))
    assert 0.95 * run.dur_us <= busy <= run.dur_us
    # the host's StepTraceAnnotation spans the device's run
    assert len(trace.steps) == 1 and trace.steps[0].dur_us >= run.dur_us


def test_link_calibration_keeps_the_previous_figure_and_source() -> None:
    cal = Calibration(device_kind="TPU v5 lite", platform="tpu", d2h=LinkFit(8e-6, 14e9), h2d=LinkFit(12e-6, 13e9),
                      duplex_d2h_bytes_per_s=13e9, duplex_h2d_bytes_per_s=20e9, pinned_host=True,
                      samples=(("d2h", 1 << 20, 1e-4), ("d2h", 1 << 30, 1e-1)))
    base = load_profile("v5e")
    p = calibrated_profile(base, cal)
    assert p.sources["h2d_bytes_per_s.previous"] == f"15.0 GB/s in tpu-v5e: {base.sources['h2d_bytes_per_s']}"
    assert p.sources["transfer_latency_s.previous"].startswith("1e-05 in tpu-v5e: ASSUMPTION")
    # and the file round-trips with those entries
    import tomllib

    from hloopt.devices import profile_from_dict, profile_to_toml

    assert profile_from_dict(tomllib.loads(profile_to_toml(p))) == p


def test_profile_dir_without_a_trace_is_one_line_exit_2(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["calibrate", "--profile", str(tmp_path), "--target", MLP, "--base", "h200"])
    assert res.exit_code == 2
    assert "no profiler trace found" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_efficiency_table_validates() -> None:
    from hloopt.devices import profile_from_dict
    from hloopt.errors import UserError

    d = load_profile("h200").to_dict()
    assert profile_from_dict({**d, "compute_efficiency": {"dot": 0.5}}).efficiency("dot") == 0.5
    assert profile_from_dict(d).efficiency("dot") == 1.0
    with pytest.raises(UserError, match="unknown op class 'matmul'"):
        profile_from_dict({**d, "compute_efficiency": {"matmul": 0.5}})
    with pytest.raises(UserError, match="compute_efficiency.dot"):
        profile_from_dict({**d, "compute_efficiency": {"dot": 0}})
    assert dataclasses.replace(load_profile("h200")).compute_efficiency == {}


@pytest.mark.slow
def test_a_profile_fitted_here_predicts_this_machines_step_time(recorded: Path) -> None:
    """The loop closed: fitted from a trace of the step on this CPU, the profile predicts the step
    (from the compiled module, as the trace's ops are) near what `hloopt measure` then times. The
    built-in profile misses by orders of magnitude (an H200 is not this CPU)."""
    from hloopt.calibrate import compiled_module_for
    from hloopt.measure import measure
    from hloopt.targets import resolve

    base = load_profile("h200")
    cal = fit_trace(read_trace(recorded), compiled_module_for(resolve(MLP)), base)
    fitted = trace_calibrated_profile(base, cal)
    m = measure(MLP, profile=fitted, compile="cpu", steps=15, warmup=3)
    row = next(r for r in m.rows if r.name == "everything_saveable")
    # the fastest step: a step of ~100 us on a shared 2-core machine is as often slowed by
    # other work as not, and the trace the profile was fitted from is of unhindered steps
    ratio = row.predicted_step_time_s / row.measured.min_s
    assert 1 / 3 < ratio < 3, (row.predicted_step_time_s, row.measured)
    plain = measure(MLP, profile=base, compile="cpu", steps=1, warmup=0, policies="builtin")
    row0 = next(r for r in plain.rows if r.name == "everything_saveable")
    assert row0.predicted_step_time_s < row.predicted_step_time_s / 10


# -- the step as lowered -----------------------------------------------------------------------

_LOWERED = """HloModule jit_f

ENTRY %main (x: f32[256,256], y: f32[256,256]) -> f32[256,256] {
  %x = f32[256,256]{1,0} parameter(0)
  %y = f32[256,256]{1,0} parameter(1)
  %d = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
  %a = f32[256,256]{1,0} add(%d, %x), metadata={op_name="jit(f)/add"}
  ROOT %m = f32[256,256]{1,0} multiply(%a, %y), metadata={op_name="jit(f)/mul"}
}
"""

_COMPILED = """HloModule jit_f, is_scheduled=true

%fused_computation (p0: f32[256,256], p1: f32[256,256], p2: f32[256,256]) -> f32[256,256] {
  %p0 = f32[256,256]{1,0} parameter(0)
  %p1 = f32[256,256]{1,0} parameter(1)
  %p2 = f32[256,256]{1,0} parameter(2)
  %add.1 = f32[256,256]{1,0} add(%p0, %p1), metadata={op_name="jit(f)/add"}
  ROOT %multiply.1 = f32[256,256]{1,0} multiply(%add.1, %p2), metadata={op_name="jit(f)/mul"}
}

ENTRY %main (x: f32[256,256], y: f32[256,256]) -> f32[256,256] {
  %x = f32[256,256]{1,0} parameter(0)
  %y = f32[256,256]{1,0} parameter(1)
  %dot.1 = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
  ROOT %fusion.1 = f32[256,256]{1,0} fusion(%dot.1, %x, %y), kind=kLoop, calls=%fused_computation
}
"""


def test_lowered_fit_attributes_kernel_time_by_op_name_hand_computed(tmp_path: Path) -> None:
    """Two steps of 50 us, each a 30 us dot kernel and a 10 us fusion of the add and the multiply
    (10 us between kernels). On an H200 every instruction here is bound by its bytes: three
    256x256 f32 arrays, 786,432 B, in 786432 / 4.8e12 s each. The fusion's time goes to the two
    element-wise instructions (by op name), the 10 us gap to the classes as their 40 us are
    split, so dot gets 37.5 us and elementwise 12.5 us: efficiencies r/37.5us and 2r/12.5us."""
    from hloopt.hlo.parser import parse_module
    from hloopt.passes.cost import CostAnalysis

    h200 = load_profile("h200")
    lowered, compiled = parse_module(_LOWERED), parse_module(_COMPILED)
    ops, steps = [], []
    for k in range(2):
        t0 = 100.0 * k
        ops += [OpEvent("jit_f", "dot.1", t0, 30.0, 1, 1), OpEvent("jit_f", "fusion.1", t0 + 40, 10.0, 1, 1)]
        steps.append(Step("train", str(k), t0, 50.0))
    trace = Trace(tmp_path, ops=tuple(ops), runs=(), transfers=(), steps=tuple(steps))
    cal = fit_trace_lowered(trace, compiled, lowered, h200)
    r = 3 * 256 * 256 * 4 / h200.hbm_bytes_per_s
    assert 2 * 256**3 / h200.flops_per_s("f32") < r  # the dot too is bound by its bytes
    fits = {f.op_class: f for f in cal.fits}
    assert set(fits) == {"dot", "elementwise"}
    assert fits["dot"].measured_s == pytest.approx(37.5e-6) and fits["dot"].roofline_s == pytest.approx(r)
    assert fits["elementwise"].measured_s == pytest.approx(12.5e-6)
    assert fits["elementwise"].roofline_s == pytest.approx(2 * r)
    assert fits["dot"].efficiency == pytest.approx(r / 37.5e-6)
    assert fits["elementwise"].efficiency == pytest.approx(2 * r / 12.5e-6)
    assert (fits["dot"].ops, fits["elementwise"].ops) == (1, 2)
    # the calibrated model times the step as lowered at the traced step's wall time
    fitted = trace_calibrated_profile(h200, cal)
    assert CostAnalysis(profile=fitted).run(lowered).totals.seconds == pytest.approx(50e-6)
    assert "of the step as lowered" in fitted.sources["compute_efficiency.dot"]


def test_on_an_accelerator_the_fit_reproduces_the_device_run_not_the_host_marker(tmp_path: Path) -> None:
    """The same two steps as above, now with a device line: each run of the module on the device
    (``XLA Modules``) takes 45 us, and the host's StepTraceAnnotation around the call it waited
    for 60 us (dispatch and the profiler's own work). A training loop queues its next step while
    this one runs, so the device's 45 us is the step time the fit reproduces; the 5 us between
    the kernels inside the run are split over the classes as their 40 us are (dot 30 * 45/40)."""
    from hloopt.hlo.parser import parse_module
    from hloopt.passes.cost import CostAnalysis
    from hloopt.profile_trace import ModuleRun

    h200 = load_profile("h200")
    lowered, compiled = parse_module(_LOWERED), parse_module(_COMPILED)
    ops, steps, runs = [], [], []
    for k in range(2):
        t0 = 100.0 * k
        ops += [OpEvent("jit_f", "dot.1", t0 + 5, 30.0, 1, 2), OpEvent("jit_f", "fusion.1", t0 + 40, 10.0, 1, 2)]
        runs.append(ModuleRun(t0 + 5, 45.0, 1, 3, device_line=True, module="jit_f"))
        steps.append(Step("train", str(k), t0, 60.0))
    trace = Trace(tmp_path, ops=tuple(ops), runs=tuple(runs), transfers=(), steps=tuple(steps))
    cal = fit_trace_lowered(trace, compiled, lowered, h200)
    fits = {f.op_class: f for f in cal.fits}
    assert fits["dot"].measured_s == pytest.approx(30e-6 * 45 / 40)
    assert fits["elementwise"].measured_s == pytest.approx(10e-6 * 45 / 40)
    fitted = trace_calibrated_profile(h200, cal)
    assert CostAnalysis(profile=fitted).run(lowered).totals.seconds == pytest.approx(45e-6)


def test_lowered_fit_counts_loop_bodies_by_their_trip_count(tmp_path: Path) -> None:
    """A loop of 4 iterations around an add: the lowered add runs 4 times a step, so its class's
    roofline per step is 4 adds', and the fit still reproduces the step's wall time."""
    from hloopt.hlo.parser import parse_module
    from hloopt.passes.cost import CostAnalysis

    text = """HloModule jit_g

%body (s: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %s = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[1024]{0} get-tuple-element(%s), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one), metadata={op_name="jit(g)/while/add_i"}
  %w = f32[1024]{0} add(%v, %v), metadata={op_name="jit(g)/while/add"}
  ROOT %t = (s32[], f32[1024]{0}) tuple(%j, %w)
}

%cond (s: (s32[], f32[1024])) -> pred[] {
  %s = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%zero, %x)
  %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[1024]{0} get-tuple-element(%loop), index=1
}
"""
    lowered = parse_module(text)
    compiled = parse_module(text.replace("HloModule jit_g", "HloModule jit_g, is_scheduled=true"))
    ops = [OpEvent("jit_g", "w", 10.0 * k, 2.0, 1, 1) for k in range(4)]
    trace = Trace(tmp_path, ops=tuple(ops), runs=(), transfers=(), steps=(Step("train", "0", 0.0, 40.0),))
    h200 = load_profile("h200")
    cal = fit_trace_lowered(trace, compiled, lowered, h200)
    fits = {f.op_class: f for f in cal.fits}
    one_add = 3 * 1024 * 4 / h200.hbm_bytes_per_s
    assert fits["elementwise"].roofline_s >= 4 * one_add
    fitted = trace_calibrated_profile(h200, cal)
    assert CostAnalysis(profile=fitted).run(lowered).totals.seconds == pytest.approx(40e-6)


@pytest.mark.slow
def test_a_profile_fitted_to_the_lowered_step_times_it_at_the_traced_wall_time(recorded: Path) -> None:
    """The MLP traced on this CPU, fitted to the step as lowered for an H200 profile (what ``plan``
    times): the calibrated model's time for that module is the trace's median marked step."""
    import statistics

    from hloopt.calibrate import compiled_module_for, lowered_module_for
    from hloopt.passes.cost import CostAnalysis
    from hloopt.targets import resolve

    trace = read_trace(recorded)
    assert [s.step_num for s in trace.steps] == [str(i) for i in range(STEPS)]
    base = load_profile("h200")
    t = resolve(MLP)
    lowered = lowered_module_for(t, base)
    cal = fit_trace_lowered(trace, compiled_module_for(t), lowered, base)
    assert {f.op_class for f in cal.fits} >= {"dot", "elementwise"}
    wall = statistics.median(s.dur_us * 1e-6 for s in trace.steps)
    fitted = trace_calibrated_profile(base, cal)
    assert CostAnalysis(profile=fitted).run(lowered).totals.seconds == pytest.approx(wall, rel=1e-6)
