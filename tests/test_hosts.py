"""Host profiles: built-in numbers and their sources, derived rates, loading errors, the time model."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import cli
from hloopt.errors import UserError
from hloopt.hosts import (
    ADAMW_ARITH_FLOPS_PER_PARAM,
    ADAMW_ARRAYS_MOVED,
    ADAMW_FLOPS_PER_PARAM,
    ADAMW_SQRT_PER_PARAM,
    DEFAULT_HOST,
    HostProfile,
    host_compute_s,
    list_host_profiles,
    load_host_profile,
    optimizer_update_host_s,
)

BUILTINS = ["epyc-genoa-9654", "xeon-emr-8592", "xeon-gnr-6980p", "xeon-spr-8480"]
INTEL = ["xeon-emr-8592", "xeon-gnr-6980p", "xeon-spr-8480"]
NUMERIC = ["sockets", "cores", "clock_hz", "avx512_fma_units", "memory_channels_per_socket", "memory_mt_per_s",
           "dram_bytes_per_s", "host_memory_bytes"]
PROFILE_DIR = Path(__file__).resolve().parents[1] / "hloopt" / "host_profiles"
GiB = 2**30


def test_list_and_default() -> None:
    assert list_host_profiles() == BUILTINS
    assert DEFAULT_HOST == "xeon-spr-8480"
    assert load_host_profile(DEFAULT_HOST).has_amx


@pytest.mark.parametrize("name", BUILTINS)
def test_every_number_has_a_source(name: str) -> None:
    p = load_host_profile(name)
    assert p.name == name
    keys = NUMERIC + [f"peak_flops_per_s.{k}" for k in p.peak_flops_per_s]
    assert [k for k in keys if not p.sources.get(k, "").strip()] == []
    # Every source cites something checkable, or says it is derived, measured or assumed.
    for k in keys:
        s = p.sources[k]
        assert "http" in s or s.startswith(("ASSUMPTION", "MEASURED", "DERIVED")), (k, s)
    # No stray sources for fields that do not exist (catches typos in the TOML).
    assert set(p.sources) <= set(keys)
    assert p.clock_kind in ("base", "all-core-turbo")
    assert p.description


@pytest.mark.parametrize("name", BUILTINS)
def test_rates_follow_from_the_profiles_own_fields(name: str) -> None:
    p = load_host_profile(name)
    # f32: cores x clock x 512-bit FMA units x 16 f32 lanes x 2 FLOP per FMA.
    assert p.peak_flops_per_s["avx512_f32"] == pytest.approx(p.cores * p.clock_hz * p.avx512_fma_units * 16 * 2,
                                                             rel=1e-12)
    # VDPBF16PS: twice the FLOPs of an f32 FMA per instruction.
    assert p.peak_flops_per_s["avx512_bf16"] == pytest.approx(2 * p.peak_flops_per_s["avx512_f32"], rel=1e-12)
    if p.has_amx:  # 1024 bf16 FLOP per cycle per core
        assert p.peak_flops_per_s["amx_bf16"] == pytest.approx(p.cores * p.clock_hz * 1024, rel=1e-12)
    # DRAM: channels x MT/s x 8 bytes per socket, times sockets.
    assert p.dram_bytes_per_s == pytest.approx(
        p.memory_channels_per_socket * p.memory_mt_per_s * 1e6 * 8 * p.sockets, rel=1e-12)


@pytest.mark.parametrize("name", INTEL)
def test_intel_f32_rate_is_cores_clock_32_2(name: str) -> None:
    p = load_host_profile(name)
    assert p.avx512_fma_units == 2 and p.has_amx
    assert p.flops_per_s("f32") == pytest.approx(p.cores * p.clock_hz * 32 * 2, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "cores", "clock", "f32", "amx", "dram", "mem"),
    [
        ("xeon-spr-8480", 112, 2.0e9, 14.336e12, 229.376e12, 614.4e9, 512 * GiB),
        ("xeon-emr-8592", 128, 1.9e9, 15.5648e12, 249.0368e12, 716.8e9, 1024 * GiB),
        ("xeon-gnr-6980p", 256, 2.0e9, 32.768e12, 524.288e12, 1228.8e9, 1536 * GiB),
        ("epyc-genoa-9654", 192, 2.4e9, 14.7456e12, 0.0, 921.6e9, 1536 * GiB),
    ],
)
def test_published_numbers(name: str, cores: int, clock: float, f32: float, amx: float, dram: float,
                           mem: int) -> None:
    p = load_host_profile(name)
    assert (p.cores, p.clock_hz, p.host_memory_bytes) == (cores, clock, mem)
    assert p.flops_per_s("f32") == pytest.approx(f32, rel=1e-12)
    assert p.peak_flops_per_s.get("amx_bf16", 0.0) == pytest.approx(amx, rel=1e-12)
    assert p.dram_bytes_per_s == pytest.approx(dram, rel=1e-12)


def test_genoa_has_no_amx_and_says_where_its_fma_count_comes_from() -> None:
    p = load_host_profile("genoa")
    assert not p.has_amx and p.avx512_fma_units == 1
    assert p.flops_per_s("bf16") == p.peak_flops_per_s["avx512_bf16"]
    assert p.sources["avx512_fma_units"].startswith("DERIVED")


@pytest.mark.parametrize(("alias", "name"), [("spr", "xeon-spr-8480"), ("8480+", "xeon-spr-8480"),
                                              ("Emerald_Rapids", "xeon-emr-8592"), ("GNR", "xeon-gnr-6980p"),
                                              ("genoa", "epyc-genoa-9654")])
def test_aliases(alias: str, name: str) -> None:
    assert load_host_profile(alias).name == name


def test_profiles_are_frozen() -> None:
    p = load_host_profile(DEFAULT_HOST)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.cores = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.peak_flops_per_s["avx512_f32"] = 1.0  # type: ignore[index]


def test_json_round_trip(tmp_path: Path) -> None:
    p = load_host_profile("xeon-gnr-6980p")
    f = tmp_path / "gnr.json"
    f.write_text(json.dumps(p.to_dict()))
    assert load_host_profile(f) == p


# -- malformed files ---------------------------------------------------------------------------


def _spr_data() -> dict:
    return tomllib.loads((PROFILE_DIR / "xeon-spr-8480.toml").read_text(encoding="utf-8"))


def _write_toml(path: Path, data: dict) -> Path:
    def val(v: object) -> str:
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"{k} = {val(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for table, entries in ((k, v) for k, v in data.items() if isinstance(v, dict)):
        lines += ["", f"[{table}]"] + [f"{json.dumps(k)} = {val(v)}" for k, v in entries.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_user_file_loads(tmp_path: Path) -> None:
    assert load_host_profile(_write_toml(tmp_path / "mine.toml", _spr_data())) == load_host_profile("spr")


@pytest.mark.parametrize(
    ("edit", "field", "fragment"),
    [
        (lambda d: d.pop("dram_bytes_per_s"), "dram_bytes_per_s", "missing field"),
        (lambda d: d.pop("cores"), "cores", "missing field"),
        (lambda d: d["peak_flops_per_s"].pop("avx512_f32"), "peak_flops_per_s.avx512_f32", "missing field"),
        (lambda d: d.update(dram_bytes_per_s="614.4 Gb/s"), "dram_bytes_per_s", "bits are not accepted"),
        (lambda d: d.update(dram_bytes_per_s="614.4 GB"), "dram_bytes_per_s", "needs '/s'"),
        (lambda d: d.update(host_memory_bytes="512 G"), "host_memory_bytes", "ambiguous unit"),
        (lambda d: d.update(cores=-1), "cores", "positive integer"),
        (lambda d: d.update(cores=113), "cores", "multiple"),
        (lambda d: d.update(clock_kind="turbo"), "clock_kind", "'base' or 'all-core-turbo'"),
        (lambda d: d["peak_flops_per_s"].update(amx_bf16=-1.0), "peak_flops_per_s.amx_bf16", "non-negative"),
        (lambda d: d["peak_flops_per_s"].update(avx512_f32=0.0), "peak_flops_per_s.avx512_f32", "positive"),
        (lambda d: d["peak_flops_per_s"].update(fp8=1.0), "peak_flops_per_s", "unknown key 'fp8'"),
        (lambda d: d.update(dram_gbps=600), "dram_gbps", "unknown field"),
    ],
)
def test_bad_fields_name_the_file_and_field(tmp_path: Path, edit, field: str, fragment: str) -> None:
    data = _spr_data()
    edit(data)
    path = _write_toml(tmp_path / "bad.toml", data)
    with pytest.raises(UserError) as err:
        load_host_profile(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(str(path) + ":")
    assert repr(field) in msg and fragment in msg, msg


def test_bad_names_and_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"unknown host 'sapphire'; known: epyc-genoa-9654, xeon-emr-8592"):
        load_host_profile("sapphire")
    with pytest.raises(UserError, match="no such host profile file"):
        load_host_profile(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(UserError, match=r"broken.toml: not valid TOML"):
        load_host_profile(broken)


# -- the time model ----------------------------------------------------------------------------


def test_roofline_hand_cases() -> None:
    spr = load_host_profile("spr")  # f32 14.336 TFLOP/s, AMX 229.376 TFLOP/s, DRAM 614.4 GB/s
    assert host_compute_s(spr, 14.336e12, 0) == pytest.approx(1.0)
    assert host_compute_s(spr, 0, 2 * 614.4e9) == pytest.approx(2.0)
    # Both limits: the slower wins. 1 s of f32 compute against 0.5 s of DRAM traffic, and back.
    assert host_compute_s(spr, 14.336e12, 307.2e9) == pytest.approx(1.0)
    assert host_compute_s(spr, 7.168e12, 614.4e9) == pytest.approx(1.0)
    assert host_compute_s(spr, 7.168e12, 307.2e9) == pytest.approx(0.5)
    # bf16 on a host with AMX runs at the AMX rate; element-wise work cannot use AMX.
    assert host_compute_s(spr, 229.376e12, 0, "bf16") == pytest.approx(1.0)
    assert host_compute_s(spr, 229.376e12, 0, "bfloat16") == pytest.approx(1.0)
    assert host_compute_s(spr, 14.336e12, 0, "bf16", elementwise=True) == pytest.approx(1.0)
    # No AMX: bf16 uses the AVX-512 bf16 dot-product rate.
    genoa = load_host_profile("genoa")  # avx512_bf16 29.4912 TFLOP/s, DRAM 921.6 GB/s
    assert host_compute_s(genoa, 29.4912e12, 921.6e9 / 2, "bf16") == pytest.approx(1.0)
    assert host_compute_s(spr, 0, 0) == 0.0
    with pytest.raises(UserError, match="no FLOP rate for element type 'f16'"):
        host_compute_s(spr, 1.0, 1.0, "f16")
    with pytest.raises(ValueError, match="flops"):
        host_compute_s(spr, -1.0, 0)


def test_adamw_update_time_hand_cases() -> None:
    spr = load_host_profile("spr")
    n = 10**9
    # f32 state: 7 arrays x 4 bytes = 28 GB through 614.4 GB/s; 16 GFLOP at 14.336 TFLOP/s is far less.
    assert optimizer_update_host_s(spr, n, 4) == pytest.approx(28e9 / 614.4e9)
    assert optimizer_update_host_s(spr, n, 2, "bf16") == pytest.approx(14e9 / 614.4e9)
    # A host slow enough to be compute-bound: 16 FLOP per parameter at the f32 rate, for bf16 too.
    slow = dataclasses.replace(spr, peak_flops_per_s={"amx_bf16": 1e15, "avx512_bf16": 2e9, "avx512_f32": 1e9})
    assert optimizer_update_host_s(slow, n, 4) == pytest.approx(16 * n / 1e9)
    assert optimizer_update_host_s(slow, n, 2, "bf16") == pytest.approx(16 * n / 1e9)
    assert (ADAMW_FLOPS_PER_PARAM, ADAMW_ARRAYS_MOVED) == (16, 7)
    with pytest.raises(ValueError, match="bytes_per_param_state"):
        optimizer_update_host_s(spr, n, 0)


@pytest.mark.slow
def test_adamw_flop_count_matches_xla_cost_analysis() -> None:
    """The per-parameter FLOP count against XLA's cost analysis of a real optax.adamw step (CPU).

    Tolerance 2%: XLA adds a few per-step scalar operations (the count increment, b1**t, b2**t), here
    about 0.4% of the total; a change in XLA's simplifications (e.g. no longer folding optax's
    ``+ eps_root`` with eps_root = 0) would show up as 1/15 = 6.7% and fail.
    """
    import jax
    import jax.numpy as jnp
    import optax

    params = {"w": jnp.ones((64, 32), jnp.float32), "b": jnp.zeros((32,), jnp.float32),
              "emb": {"table": jnp.ones((100, 16), jnp.float32)}}
    n = sum(x.size for x in jax.tree.leaves(params))
    tx = optax.adamw(1e-3)

    def step(p, g, s):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    compiled = jax.jit(step).lower(params, params, tx.init(params)).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax returned one dict per program
        cost = cost[0]
    assert cost["flops"] == pytest.approx(ADAMW_ARITH_FLOPS_PER_PARAM * n, rel=0.02)
    assert cost["transcendentals"] == pytest.approx(ADAMW_SQRT_PER_PARAM * n, rel=0.02)
    assert cost["flops"] + cost["transcendentals"] == pytest.approx(ADAMW_FLOPS_PER_PARAM * n, rel=0.02)
    # The model's traffic (7 f32 arrays, one fused pass) is a lower bound on what XLA reports.
    assert cost["bytes accessed"] >= ADAMW_ARRAYS_MOVED * 4 * n


# -- CLI ---------------------------------------------------------------------------------------


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_cli_lists_host_profiles() -> None:
    code, out = _run("devices", "--hosts")
    assert code == 0, out
    for col in ("cores", "AMX bf16 TFLOP/s", "f32 TFLOP/s", "DRAM GB/s"):
        assert col in out
    for name in BUILTINS:
        assert name in out
    row = next(line for line in out.splitlines() if "xeon-spr-8480" in line)
    assert "112" in row and "229" in row and "14.3" in row and "614" in row
    genoa = next(line for line in out.splitlines() if "epyc-genoa-9654" in line)
    assert "192" in genoa and " - " in genoa and "14.7" in genoa and "922" in genoa


def test_cli_hosts_json_and_one_profile() -> None:
    code, out = _run("devices", "--hosts", "--json")
    assert code == 0
    assert [d["name"] for d in json.loads(out)] == BUILTINS
    code, out = _run("devices", "--hosts", "spr")
    assert code == 0
    assert "xeon-spr-8480" in out and "DERIVED" in out and "peak_flops_per_s.amx_bf16" in out
    code, out = _run("devices", "--hosts", "--device", "tpu-v5e")
    assert code == 2 and "--hosts takes no device options" in out
    code, out = _run("devices", "--hosts", "nope")
    assert code == 2 and "unknown host 'nope'" in out


def test_host_profile_type_is_exported() -> None:
    assert isinstance(load_host_profile(DEFAULT_HOST), HostProfile)
