"""Device profiles: built-in numbers, their sources, lookups, overrides and file round trips."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from hloopt.devices import DeviceProfile, list_profiles, load_profile, write_profile
from hloopt.errors import UserError

BUILTINS = ["a100-40gb", "a100-80gb", "gh200", "h100-sxm", "h200", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"]
NUMERIC = ["hbm_bytes", "hbm_bytes_per_s", "d2h_bytes_per_s", "h2d_bytes_per_s", "duplex_d2h_bytes_per_s",
           "duplex_h2d_bytes_per_s", "dma_engines", "transfer_latency_s", "host_memory_bytes",
           "interconnect_bytes_per_s"]
GiB = 2**30


def test_list_profiles() -> None:
    assert list_profiles() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_every_number_has_a_source(name: str) -> None:
    p = load_profile(name)
    keys = NUMERIC + [f"peak_flops_per_s.{k}" for k in p.peak_flops_per_s] + (
        ["on_chip_heap_bytes"] if p.on_chip_heap_bytes else [])
    missing = [k for k in keys if not p.sources.get(k, "").strip()]
    assert missing == []
    # Every source cites something checkable or says it is an assumption.
    for k in keys:
        s = p.sources[k]
        assert "http" in s or s.startswith(("ASSUMPTION", "MEASURED")) or "tpu_info.py" in s, (k, s)
    # No stray sources for fields that do not exist (catches typos in the TOML).
    assert set(p.sources) <= set(keys)


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_invariants(name: str) -> None:
    p = load_profile(name)
    assert p.name == name
    assert p.duplex_d2h_bytes_per_s <= p.d2h_bytes_per_s
    assert p.duplex_h2d_bytes_per_s <= p.h2d_bytes_per_s
    # The host link is always far slower than HBM: offload is only worth planning because of this.
    assert p.h2d_bytes_per_s < p.hbm_bytes_per_s / 5
    assert p.flops_per_s("bf16") >= p.flops_per_s("f32")


@pytest.mark.parametrize(
    ("name", "hbm", "hbm_bw", "bf16", "d2h", "h2d"),
    [
        ("tpu-v5e", 16 * GiB, 819e9, 197e12, 15e9, 15e9),
        ("tpu-v5p", 95 * GiB, 2765e9, 459e12, 15e9, 15e9),
        ("tpu-v6e", 32 * GiB, 1638e9, 918e12, 32e9, 32e9),
        ("tpu-v4", 32 * GiB, 1200e9, 275e12, 16e9, 16e9),
        ("a100-40gb", 40 * 10**9, 1555e9, 312e12, 25e9, 25e9),
        ("a100-80gb", 80 * 10**9, 2039e9, 312e12, 25e9, 25e9),
        ("h100-sxm", 80 * 10**9, 3.35e12, 989.4e12, 50e9, 50e9),
        ("h200", 141 * 10**9, 4.8e12, 989.4e12, 50e9, 50e9),
        ("gh200", 96 * 10**9, 4.0e12, 989.4e12, 300e9, 346e9),
    ],
)
def test_published_numbers(name: str, hbm: int, hbm_bw: float, bf16: float, d2h: float, h2d: float) -> None:
    p = load_profile(name)
    assert (p.hbm_bytes, p.hbm_bytes_per_s, p.flops_per_s("bf16"), p.d2h_bytes_per_s, p.h2d_bytes_per_s) == (
        hbm, hbm_bw, bf16, d2h, h2d)


def test_a100_duplex_is_the_measured_asymmetry() -> None:
    p = load_profile("a100-80gb")
    assert (p.duplex_d2h_bytes_per_s, p.duplex_h2d_bytes_per_s) == (24e9, 12e9)
    assert not p.is_assumption("duplex_h2d_bytes_per_s")
    assert load_profile("tpu-v5e").is_assumption("duplex_h2d_bytes_per_s")


@pytest.mark.parametrize(
    ("alias", "name"),
    [("v5e", "tpu-v5e"), ("tpu-v5e", "tpu-v5e"), ("TPU v5e", "tpu-v5e"), ("tpu_v5p", "tpu-v5p"),
     ("h100", "h100-sxm"), ("H100", "h100-sxm"), ("trillium", "tpu-v6e"), ("v4", "tpu-v4"), ("tpuv6e", "tpu-v6e")],
)
def test_aliases(alias: str, name: str) -> None:
    assert load_profile(alias).name == name


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(UserError) as info:
        load_profile("tpu-v9")
    msg = str(info.value)
    assert "'tpu-v9'" in msg
    for n in BUILTINS:
        assert n in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("dtype", "key"),
    [("bf16", "bf16"), ("f16", "f16"), ("f32", "f32"), ("s8", "s8"), ("u8", "s8"), ("f8e4m3fn", "f8"),
     ("f8e5m2", "f8"), ("s4", "s8"), ("f64", "f64"), ("s32", "f32"), ("pred", "f32")],
)
def test_flops_per_s_h100(dtype: str, key: str) -> None:
    p = load_profile("h100-sxm")
    assert p.flops_per_s(dtype) == p.peak_flops_per_s[key]


def test_flops_fallbacks_on_tpu() -> None:
    p = load_profile("tpu-v5e")  # no f16, f8 or f64 entries
    assert p.flops_per_s("f16") == 197e12
    assert p.flops_per_s("f8e4m3fn") == 197e12
    assert p.flops_per_s("f64") == p.flops_per_s("f32")
    assert p.flops_per_s("s8") == 393e12
    with pytest.raises(UserError, match="unknown element type 'fp42'"):
        p.flops_per_s("fp42")


def test_with_overrides() -> None:
    base = load_profile("a100-80gb")
    p = base.with_overrides(hbm_bytes=10 * GiB, d2h_bytes_per_s=20e9)
    assert p.hbm_bytes == 10 * GiB
    assert p.d2h_bytes_per_s == 20e9
    # The duplex D2H rate keeps the base profile's measured ratio (24/25).
    assert p.duplex_d2h_bytes_per_s == pytest.approx(20e9 * 24 / 25)
    assert p.h2d_bytes_per_s == base.h2d_bytes_per_s
    assert p.duplex_h2d_bytes_per_s == base.duplex_h2d_bytes_per_s
    assert p.sources["hbm_bytes"] == "user override"
    assert base.hbm_bytes == 80 * 10**9  # the original is unchanged
    assert base.with_overrides() is base
    q = base.with_overrides(h2d_bytes_per_s=30e9, duplex_h2d_bytes_per_s=30e9)
    assert (q.h2d_bytes_per_s, q.duplex_h2d_bytes_per_s) == (30e9, 30e9)
    with pytest.raises(UserError, match="duplex_h2d_bytes_per_s"):
        base.with_overrides(duplex_h2d_bytes_per_s=99e9)
    with pytest.raises(UserError, match="hbm_bytes"):
        base.with_overrides(hbm_bytes=0)


def test_profiles_are_immutable() -> None:
    p = load_profile("tpu-v5e")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.hbm_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.peak_flops_per_s["bf16"] = 1.0  # type: ignore[index]


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_write_load_round_trip(tmp_path: Path, name: str, suffix: str) -> None:
    p = load_profile(name).with_overrides(d2h_bytes_per_s=12.5e9, source='measured "here"\\ today')
    path = tmp_path / f"p{suffix}"
    write_profile(p, path)
    assert load_profile(str(path)) == p
    assert DeviceProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_written_toml_is_plain_numbers(tmp_path: Path) -> None:
    path = tmp_path / "v5e.toml"
    write_profile(load_profile("v5e"), path)
    data = tomllib.loads(path.read_text())
    assert data["hbm_bytes"] == 16 * GiB
    assert data["peak_flops_per_s"]["bf16"] == 197e12
    assert data["sources"]["peak_flops_per_s.bf16"].startswith("https://docs.cloud.google.com/tpu/docs/v5e")


def _write(tmp_path: Path, text: str, name: str = "bad.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_user_file_with_unit_strings(tmp_path: Path) -> None:
    text = Path(load_profile.__code__.co_filename).parent.joinpath("device_profiles", "tpu-v5e.toml").read_text()
    text = text.replace('name = "tpu-v5e"', 'name = "my-v5e"').replace('hbm_bytes = "16 GiB"', 'hbm_bytes = "15.75 GiB"')
    p = load_profile(_write(tmp_path, text, "mine.toml"))
    assert p.name == "my-v5e"
    assert p.hbm_bytes == int(15.75 * GiB)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (('hbm_bytes = "16 GiB"', 'hbm_bytes = "16 Gb"'), "field 'hbm_bytes'"),
        (('hbm_bytes = "16 GiB"', 'hbm_bytes = -5'), "field 'hbm_bytes': expected a positive integer"),
        (('kind = "tpu"', 'kind = "npu"'), "field 'kind'"),
        (("dma_engines = 1", "dma_engines = 1.5"), "field 'dma_engines'"),
        (("dma_engines = 1", "dma_enignes = 1"), "unknown field 'dma_enignes'"),
        (('d2h_bytes_per_s = 1.5e10', 'd2h_bytes_per_s = "fast"'), "field 'd2h_bytes_per_s'"),
        (("bf16 = 197e12", "bf16 = 0"), "field 'peak_flops_per_s.bf16'"),
        (("[sources]", "[sources\n"), "not valid TOML"),
    ],
)
def test_malformed_file_names_file_and_field(tmp_path: Path, edit: tuple[str, str], expected: str) -> None:
    src = Path(load_profile.__code__.co_filename).parent.joinpath("device_profiles", "tpu-v5e.toml").read_text()
    assert edit[0] in src
    path = _write(tmp_path, src.replace(edit[0], edit[1], 1))
    with pytest.raises(UserError) as info:
        load_profile(path)
    msg = str(info.value)
    assert msg.startswith(path + ":")
    assert expected in msg


def test_missing_file_and_missing_field(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such device profile file"):
        load_profile(str(tmp_path / "nope.toml"))
    path = _write(tmp_path, json.dumps({"name": "x", "kind": "gpu"}), "x.json")
    with pytest.raises(UserError, match="missing field 'hbm_bytes'"):
        load_profile(path)
