"""``hloopt analyze``: CliRunner in, parsed JSON out, checked against XLA's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import cli

ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "zoo"


def run_json(*args: str) -> dict:  # type: ignore[type-arg]
    res = CliRunner().invoke(cli, ["analyze", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_json_of_a_tpu_compiled_snapshot_matches_xla() -> None:
    j = run_json(str(ZOO / "sharded.tpu-v5e.hlo"), "--top", "3")
    xla = json.loads((ZOO / "sharded.tpu-v5e.json").read_text())["memory"]
    assert j["source"] == "hlo" and j["module"] == "jit_step"
    assert j["xla"]["peak_memory_in_bytes"] == xla["peak_memory_in_bytes"]
    assert j["peak_bytes"] == pytest.approx(xla["peak_memory_in_bytes"], rel=0.02)
    assert j["argument_bytes"] == xla["argument_size_in_bytes"]
    assert j["host_bytes"] == xla["host_temp_size_in_bytes"] == 0
    assert sum(j["categories"].values()) == j["peak_bytes"]
    assert len(j["live_at_peak"]) == 3
    first = j["live_at_peak"][0]
    assert set(first) >= {"name", "shape", "bytes", "category", "op_name", "source"}
    assert first["bytes"] >= j["live_at_peak"][-1]["bytes"]
    assert set(j["peak_at"]) >= {"index", "instruction"}


def test_offload_snapshot_reports_host_bytes_like_xla() -> None:
    j = run_json(str(ZOO / "llama.offload.tpu-v5e.hlo"))
    xla = json.loads((ZOO / "llama.offload.tpu-v5e.json").read_text())["memory"]
    assert j["host_bytes"] == xla["host_temp_size_in_bytes"] > 0


def test_unoptimized_offload_module_counts_annotated_values_on_host() -> None:
    """Analyzed as written (no --platform), a pinned_host annotation's result is a host array:
    gpt2's 8 offloaded residuals (not scanned: all live until the backward) are f32[2,32,64],
    16 KiB each; the tpu prediction sizes the same host bytes as libtpu does."""
    from hloopt.hlo.parser import parse_file

    path = ZOO / "gpt2.offload.tpu.hlo"
    marked = [i for i in parse_file(path).instructions() if i.opcode == "custom-call"
              and i.frontend_attributes.get("_xla_buffer_placement") == "pinned_host"]
    assert len(marked) == 8 and all(i.shape.byte_size == 2 * 32 * 64 * 4 for i in marked)
    j = run_json(str(path))
    assert j["settings"]["kind"] == "unoptimized"
    assert j["host_bytes"] == 8 * 2 * 32 * 64 * 4
    plain = run_json(str(ZOO / "gpt2.tpu.hlo"))
    assert plain["host_bytes"] == 0
    tpu = run_json(str(path), "--platform", "tpu")
    assert tpu["host_bytes"] == json.loads((ZOO / "gpt2.offload.tpu-v5e.json").read_text())["memory"][
        "host_temp_size_in_bytes"]


def test_terminal_report_names_the_peak() -> None:
    res = CliRunner().invoke(cli, ["analyze", str(ZOO / "mlp.cpu-compiled.hlo"), "--top", "2"])
    assert res.exit_code == 0, res.output
    assert "peak" in res.output and "Largest buffers live at the peak" in res.output
    assert "optimizer state" in res.output


def test_bad_target_is_one_line_exit_2(tmp_path: Path) -> None:
    from hloopt.cli import main

    bad = tmp_path / "x.hlo"
    bad.write_text("HloModule broken\nENTRY e {\n  ROOT r = f32[2] nonsense(\n}\n")
    proc = subprocess.run([sys.executable, "-m", "hloopt", "analyze", str(tmp_path / "missing.hlo")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no such file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert main(["analyze", str(bad)]) == 2


def test_hlo_file_does_not_import_jax() -> None:
    code = ("import sys; from hloopt.cli import main; rc = main(['analyze', %r, '--json']); "
            "assert rc == 0; assert 'jax' not in sys.modules, 'jax imported'" % str(ZOO / "mlp.tpu-v5e.hlo"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_compiled_jax_target_carries_xla_figures() -> None:
    j = run_json("fixtures/zoo/mlp.py:tiny", "--compile", "cpu")
    assert j["source"] == "compiled:cpu"
    assert j["xla"]["argument_size_in_bytes"] == j["argument_bytes"]
    assert j["xla"]["output_size_in_bytes"] == pytest.approx(j["output_bytes"], abs=512)
