"""`hloopt devices` and the shared unit/device options, through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from hloopt.cli import cli
from hloopt.cli.params import BudgetType, Percent, Rate, Size, device_options, profile_from_options, user_errors
from hloopt.units import Budget


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_devices_json_lists_every_profile() -> None:
    code, out = run("devices", "--json")
    assert code == 0
    data = json.loads(out)
    assert [d["name"] for d in data] == ["a100-40gb", "a100-80gb", "gh200", "h100-sxm", "h200",
                                         "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"]
    v5e = data[-3]
    assert v5e["hbm_bytes"] == 16 * 2**30
    assert v5e["peak_flops_per_s"]["bf16"] == 197e12


def test_devices_table_has_the_columns() -> None:
    code, out = run("devices")
    assert code == 0
    for col in ("HBM GiB", "bf16 TFLOP/s", "D2H GB/s", "duplex", "DMA", "host mem"):
        assert col in out
    row = next(line for line in out.splitlines() if "tpu-v5e" in line)
    assert "16.0" in row and "819" in row and "197" in row and "64.0 GiB" in row


def test_devices_one_with_sources() -> None:
    code, out = run("devices", "v5e")
    assert code == 0
    assert "docs.cloud.google.com/tpu/docs/v5e" in out
    assert "ASSUMPTION" in out


def test_devices_one_json_with_overrides() -> None:
    code, out = run("devices", "h100", "--json", "--hbm", "40GiB", "--d2h", "20GB/s", "--h2d", "30 GB/s")
    assert code == 0
    d = json.loads(out)
    assert d["name"] == "h100-sxm"
    assert d["hbm_bytes"] == 40 * 2**30
    assert (d["d2h_bytes_per_s"], d["h2d_bytes_per_s"]) == (20e9, 30e9)
    assert d["duplex_h2d_bytes_per_s"] == pytest.approx(15e9)  # base ratio 25/50 kept
    assert d["sources"]["hbm_bytes"] == "command-line override"


def test_devices_reads_a_profile_file(tmp_path: Path) -> None:
    code, out = run("devices", "tpu-v6e", "--json")
    data = json.loads(out)
    data["name"] = "lab-v6e"
    path = tmp_path / "lab.json"
    path.write_text(json.dumps(data))
    code, out = run("devices", str(path), "--json")
    assert code == 0
    assert json.loads(out)["name"] == "lab-v6e"
    code, out = run("devices", "--device-file", str(path), "--json")
    assert json.loads(out)["name"] == "lab-v6e"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["devices", "tpu-v9"], "unknown device 'tpu-v9'; known: a100-40gb"),
        (["devices", "v5e", "--hbm", "12 GB?"], "'12 GB?': not a size"),
        (["devices", "v5e", "--d2h", "25Gb/s"], "bits are not accepted"),
        (["devices", "--hbm", "12GiB"], "need a device NAME"),
    ],
)
def test_bad_input_exit_2_one_line(args: list[str], needle: str) -> None:
    code, out = run(*args)
    assert code == 2
    error_lines = [line for line in out.splitlines() if line.startswith("hloopt: error:")]
    assert len(error_lines) == 1
    assert needle in error_lines[0]


def test_malformed_profile_file_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('name = "x"\nkind = "gpu"\n')
    code, out = run("devices", str(path))
    assert code == 2
    assert out.strip() == f"hloopt: error: {path}: missing field 'hbm_bytes'"


def test_param_types_convert_and_fail() -> None:
    assert Size.convert("16GiB", None, None) == 16 * 2**30
    assert Rate.convert("25GB/s", None, None) == 25e9
    assert BudgetType.convert("75%", None, None) == Budget(fraction=0.75)
    assert Percent.convert("3%", None, None) == pytest.approx(0.03)
    assert Size.convert(123, None, None) == 123  # already converted (defaults)
    with pytest.raises(click.BadParameter, match="not a size"):
        Size.convert("12 GB?", None, None)
    with pytest.raises(click.BadParameter, match="not a budget"):
        BudgetType.convert("lots", None, None)


def test_device_options_decorator_is_reusable() -> None:
    @click.command()
    @device_options
    def show(**kw: object) -> None:
        with user_errors():
            p = profile_from_options(**kw, default="tpu-v5e")  # type: ignore[arg-type]
        click.echo(f"{p.name} {p.hbm_bytes} {p.d2h_bytes_per_s:g}")

    r = CliRunner().invoke(show, [])
    assert (r.exit_code, r.output) == (0, f"tpu-v5e {16 * 2**30} 1.5e+10\n")
    r = CliRunner().invoke(show, ["--device", "h200", "--hbm", "100GB", "--d2h", "40GB/s"])
    assert (r.exit_code, r.output) == (0, "h200 100000000000 4e+10\n")
    r = CliRunner().invoke(show, ["--device", "h200", "--device-file", "x.toml"])
    assert r.exit_code == 2
    assert "either --device or --device-file" in r.output
