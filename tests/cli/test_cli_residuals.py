"""``hloopt residuals``: the CLI shows what the library finds, HLO targets never import jax."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import cli

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "fixtures" / "hlo" / "zoo"
KEYS = {"name", "shape", "bytes", "layers", "selectable_by", "source", "key", "producer", "forward_interval",
        "first_backward_use", "offloaded", "peak_share"}


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["residuals", *args], catch_exceptions=False)
    return res.exit_code, res.output


def test_json_offloaded_bytes_equal_xla_host_temp() -> None:
    code, out = run(str(ZOO / "llama.offload.tpu-v5e.hlo"), "--json")
    assert code == 0
    rows = json.loads(out)
    assert all(KEYS <= set(r) for r in rows)
    host = sum(r["bytes"] for r in rows if r["offloaded"])
    xla = json.loads((ZOO / "llama.offload.tpu-v5e.json").read_text())["memory"]["host_temp_size_in_bytes"]
    assert host == xla
    # largest first; a stacked per-layer buffer reports its layers; host rows have no device-peak share
    assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)
    assert {r["layers"] for r in rows if r["offloaded"]} == {2}
    assert all(r["peak_share"] is None for r in rows if r["offloaded"])
    assert all(0 < r["peak_share"] < 1 for r in rows if not r["offloaded"])


def test_table_names_the_locations_and_the_peak_source() -> None:
    code, out = run(str(ZOO / "mlp.tpu.hlo"))
    assert code == 0
    assert "fixtures/zoo/mlp.py:56" in out  # the relu outputs saved as the next layers' inputs
    assert "memory model" in out


def test_hlo_target_does_not_import_jax() -> None:
    code = ("import sys; from click.testing import CliRunner; from hloopt.cli import cli; "
            f"r = CliRunner().invoke(cli, ['residuals', {str(ZOO / 'mlp.tpu.hlo')!r}, '--json']); "
            "assert r.exit_code == 0, r.output; print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_bad_target_is_one_line_exit_2(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["residuals", str(tmp_path / "missing.hlo")])
    assert res.exit_code == 2
    assert "no such file" in res.output


@pytest.mark.slow
def test_jax_target_names_the_layer_input_stack() -> None:
    code, out = run(str(ROOT / "fixtures/zoo/llama.py:tiny"), "--json")
    assert code == 0
    rows = json.loads(out)
    named = [r for r in rows if r["name"]]
    assert [(r["name"], r["layers"], r["shape"], r["selectable_by"]) for r in named] == [
        ("decoder_layer_input", 2, "f32[2,2,32,64]", "checkpoint_name 'decoder_layer_input'")]
    assert all(r["key"].startswith("prim:") and r["source"] for r in rows if not r["name"])


def test_the_advice_for_a_layers_argument_names_the_layers_first_use(tmp_path: Path) -> None:
    """A checkpointed layer's argument (here a scan's carry) is no value a checkpoint_name on its
    own line lets a policy select: the table's advice points inside the layer, where its first
    use is (``x @ w["a"]``, line 8 of the program), and the JSON rows say which residuals no
    policy moves (tests/test_naming.py checks that claim against the HLO JAX emits)."""
    import textwrap

    from tests.test_naming import ARGUMENTS

    path = tmp_path / "layers.py"
    path.write_text(textwrap.dedent(ARGUMENTS).replace("NAME_INPUT", "False"))
    code, out = run(f"{path}:make", "-q")
    assert code == 0
    advice = [line for line in out.splitlines() if line.startswith("largest unnamed")]
    assert len(advice) == 1 and "checkpointed function's argument" in advice[0]
    assert "layers.py:8" in advice[0]
    code, out = run(f"{path}:make", "--json")
    rows = json.loads(out)
    assert [r["layers"] for r in rows if r["saved_whatever_policy"]] == [4]
