"""hloopt.calibrate: the latency/bandwidth fit, the calibrated profile, and CPU-only refusal."""

from __future__ import annotations

import datetime as dt

import pytest
from click.testing import CliRunner

from hloopt.calibrate import Calibration, LinkFit, calibrated_profile, fit_latency_bandwidth
from hloopt.cli import cli, main
from hloopt.cli.calibrate_cmd import _guess_base
from hloopt.devices import load_profile


def test_fit_recovers_latency_and_bandwidth() -> None:
    sizes = [1 << 20, 8 << 20, 64 << 20, 256 << 20]
    times = [12e-6 + n / 24e9 for n in sizes]
    fit = fit_latency_bandwidth(sizes, times)
    assert fit.latency_s == pytest.approx(12e-6, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(24e9, rel=1e-9)


def test_fit_clamps_negative_latency() -> None:
    sizes = [1e6, 2e6]
    fit = fit_latency_bandwidth(sizes, [1e6 / 10e9 - 1e-6, 2e6 / 10e9])
    assert fit.latency_s == 0.0
    assert fit.bytes_per_s == pytest.approx(10e9, rel=0.05)
    with pytest.raises(ValueError):
        fit_latency_bandwidth([1e6, 1e6], [1e-4, 1e-4])


def test_calibrated_profile_keeps_base_and_records_source() -> None:
    cal = Calibration(device_kind="TPU v5 lite", platform="tpu", d2h=LinkFit(8e-6, 14e9), h2d=LinkFit(12e-6, 13e9),
                      duplex_d2h_bytes_per_s=13e9, duplex_h2d_bytes_per_s=20e9, pinned_host=True,
                      samples=(("d2h", 1 << 20, 1e-4), ("d2h", 1 << 30, 1e-1)))
    base = load_profile("v5e")
    p = calibrated_profile(base, cal, name="v5e-lab", when=dt.datetime(2025, 1, 2, 3, 4, tzinfo=dt.timezone.utc))
    assert p.name == "v5e-lab"
    assert (p.d2h_bytes_per_s, p.h2d_bytes_per_s) == (14e9, 13e9)
    assert p.duplex_d2h_bytes_per_s == 13e9
    assert p.duplex_h2d_bytes_per_s == 13e9  # clamped to the one-way rate
    assert p.transfer_latency_s == pytest.approx(10e-6)
    assert p.hbm_bytes == base.hbm_bytes and p.peak_flops_per_s == base.peak_flops_per_s
    src = p.sources["h2d_bytes_per_s"]
    assert "TPU v5 lite" in src and "2025-01-02 03:04 UTC" in src and "pinned_host" in src and "1.00 GiB" in src


def test_a_link_timed_one_direction_at_a_time_keeps_the_base_duplex_ratio() -> None:
    """Copies timed inside one program measure each direction alone: the calibrated profile's
    duplex rates are the measured one-way rates times the base profile's duplex ratio (v5e: D2H
    keeps 0.96, H2D falls to 0.5, an assumption its sources name), and say so."""
    cal = Calibration(device_kind="TPU v5 lite", platform="tpu", d2h=LinkFit(8e-6, 14e9), h2d=LinkFit(12e-6, 12e9),
                      duplex_d2h_bytes_per_s=None, duplex_h2d_bytes_per_s=None, pinned_host=True,
                      samples=(("d2h", 1 << 20, 1e-4), ("d2h", 1 << 30, 1e-1)))
    base = load_profile("v5e")
    p = calibrated_profile(base, cal)
    assert p.duplex_d2h_bytes_per_s == pytest.approx(14e9 * base.duplex_d2h_bytes_per_s / base.d2h_bytes_per_s)
    assert p.duplex_h2d_bytes_per_s == pytest.approx(12e9 * base.duplex_h2d_bytes_per_s / base.h2d_bytes_per_s)
    assert "scaled by the base profile's duplex ratio 0.50" in p.sources["duplex_h2d_bytes_per_s"]


@pytest.mark.parametrize(
    ("kind", "name"),
    [("TPU v5 lite", "tpu-v5e"), ("TPU v5", "tpu-v5p"), ("TPU v6 lite", "tpu-v6e"), ("TPU v4", "tpu-v4"),
     ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
     ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H200", "h200")],
)
def test_guess_base(kind: str, name: str) -> None:
    assert _guess_base(kind) == name


def test_cpu_only_machine_exits_2_with_one_line() -> None:
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("this machine has an accelerator")
    result = CliRunner().invoke(cli, ["calibrate"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "hloopt: error: no accelerator: JAX's default backend is cpu; calibrate needs a TPU or GPU"]


def test_cpu_only_main_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("this machine has an accelerator")
    assert main(["calibrate", "--sizes", "1MiB", "--sizes", "2MiB"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no accelerator" in err


@pytest.mark.slow
@pytest.mark.tpu
def test_the_link_is_timed_through_host_buffers_inside_one_program() -> None:
    """``measure_link`` times transfers as an offloading step makes them: the round trip JAX
    emits for a TPU moves the value to ``pinned_host`` and back inside one program, and libtpu,
    compiling it for a v5e here, keeps a host-memory (``S(5)``) buffer and the copies to and from
    it rather than folding the round trip away. (A ``device_put`` to a ``pinned_host`` array
    instead also times the runtime's allocation of that array: D2H 0.43 GB/s against 14.7 GB/s
    inside a program on a v5e, bench/results/2026-12-07-tpu-v5e/.)"""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from hloopt.calibrate import link_programs

    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    dev = topo.devices[0]
    _, h2d, round_trip = link_programs(dev)
    x = jax.ShapeDtypeStruct((1 << 20,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(dev))
    lowered = round_trip.trace(x).lower(lowering_platforms=("tpu",))
    placements = [line.split('_xla_buffer_placement = "')[1].split('"')[0]
                  for line in lowered.as_text().splitlines() if "annotate_device_placement" in line]
    assert placements == ["pinned_host", "device"]
    compiled = lowered.compile().as_text()
    assert "S(5)" in compiled and "copy-start" in compiled
    on_host = jax.ShapeDtypeStruct((1 << 20,), jnp.float32,
                                   sharding=jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    assert 'mhlo.memory_kind = "pinned_host"' in h2d.trace(on_host).lower(lowering_platforms=("tpu",)).as_text()
