"""``hloopt inspect``: a hand-written module in -> exact facts out (CliRunner and a subprocess);
bad input -> one ``hloopt: error: FILE:LINE:COL`` line plus a caret, exit 2, no traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import cli

ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "zoo"

MODULE = """HloModule offload_demo, is_scheduled=true, num_partitions=2, entry_computation_layout={(f32[8,128]{1,0:T(8,128)}, f32[3,5]{1,0:T(8,128)S(5)})->f32[8,128]{1,0:T(8,128)}}

%fused (p0: f32[8,128]) -> f32[8,128] {
  %p0 = f32[8,128]{1,0:T(8,128)} parameter(0)
  ROOT %n = f32[8,128]{1,0:T(8,128)} negate(%p0)
}

ENTRY %main (a: f32[8,128], h: f32[3,5]) -> f32[8,128] {
  %a = f32[8,128]{1,0:T(8,128)} parameter(0), sharding={devices=[2,1]0,1}
  %h = f32[3,5]{1,0:T(8,128)S(5)} parameter(1), sharding={replicated}
  %f = f32[8,128]{1,0:T(8,128)} fusion(%a), kind=kLoop, calls=%fused
  %to_host = f32[8,128]{1,0:T(8,128)} custom-call(%f), custom_call_target="annotate_device_placement", frontend_attributes={_xla_buffer_placement="pinned_host"}
  %cs = (f32[3,5]{1,0:T(8,128)S(5)}, f32[3,5]{1,0:T(8,128)}, u32[]) copy-start(%h)
  %cd = f32[3,5]{1,0:T(8,128)} copy-done(%cs)
  ROOT %out = f32[8,128]{1,0:T(8,128)} add(%f, %to_host)
}
"""


@pytest.fixture()
def module_file(tmp_path: Path) -> Path:
    p = tmp_path / "demo.hlo"
    p.write_text(MODULE)
    return p


def test_json_facts(module_file: Path) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(module_file), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["module"] == "offload_demo"
    assert d["computations"] == 2 and d["fused_computations"] == 1
    assert d["instructions"] == 9 and d["entry_instructions"] == 7
    assert d["opcodes"] == {"parameter": 3, "add": 1, "copy-done": 1, "copy-start": 1,
                            "custom-call": 1, "fusion": 1, "negate": 1}
    assert d["is_scheduled"] is True
    assert d["num_partitions"] == 2 and d["sharded_instructions"] == 2
    # hand-computed: a fills one 8x128 f32 tile; h (3x5 padded to 8x128) lives on the host
    assert d["parameter_bytes"] == 8 * 128 * 4
    assert d["host_parameter_bytes"] == 8 * 128 * 4
    assert d["output_bytes"] == 8 * 128 * 4
    assert d["fusions"] == 1
    assert d["placement_annotations"] == {"pinned_host": 1}
    assert d["host_memory_instructions"] == 2  # %h and the copy-start tuple holding an S(5) leaf
    assert d["copy_starts"] == 1 and d["copy_dones"] == 1


def test_table_names_the_module_and_opcodes(module_file: Path) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(module_file)])
    assert r.exit_code == 0, r.output
    assert "HloModule offload_demo" in r.output
    assert re.search(r"copy-start\s*│\s*1", r.output)
    assert re.search(r"scheduled\s*│\s*yes", r.output)


def test_zoo_offload_annotations_match_the_text() -> None:
    path = ZOO / "mlp.offload.tpu.hlo"
    text = path.read_text()
    r = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    d = json.loads(r.output)
    for placement in ("pinned_host", "device"):
        assert d["placement_annotations"].get(placement, 0) == text.count(
            f'_xla_buffer_placement="{placement}"')
    assert d["instructions"] == len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", text, re.M))


def test_errors_one_line_with_caret_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule m\nENTRY e {\n  ROOT p = f32[2] parameter(0), foo=1\n}\n")
    r = CliRunner().invoke(cli, ["inspect", str(bad)])
    assert r.exit_code == 2
    lines = r.stderr.splitlines() if hasattr(r, "stderr") else r.output.splitlines()
    assert lines[0].startswith(f"hloopt: error: {bad}:3:")
    assert "unexpected attribute 'foo'" in lines[0]
    assert lines[1] == "  ROOT p = f32[2] parameter(0), foo=1"
    assert lines[2].strip() == "^" and lines[1][len(lines[2]) - 1] == "f"
    assert "Traceback" not in r.output

    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "missing.hlo")])
    assert r.exit_code == 2
    assert r.output.strip() == f"hloopt: error: {tmp_path / 'missing.hlo'}: no such file"


def test_subprocess_does_not_import_jax(module_file: Path, tmp_path: Path) -> None:
    code = ("import sys\nfrom hloopt.cli import main\nrc = main(['inspect', sys.argv[1], '--json'])\n"
            "assert 'jax' not in sys.modules, 'jax imported'\nprint('RC', rc)\n")
    r = subprocess.run([sys.executable, "-c", code, str(module_file)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("RC 0")


def test_subprocess_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule m\nENTRY e {\n  ROOT p = f32[2 parameter(0)\n}\n")
    r = subprocess.run([sys.executable, "-m", "hloopt", "inspect", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stdout == ""
    err = r.stderr.splitlines()
    assert err[0].startswith(f"hloopt: error: {bad}:3:") and len(err) == 3
    assert err[2].strip() == "^" and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "hloopt", "inspect", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("hloopt: error: ") and "Traceback" not in r.stderr
