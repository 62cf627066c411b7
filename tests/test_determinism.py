"""The same input gives byte-identical outputs: plan.json, the HTML and terminal reports, the JSON of
analyze, residuals, diff and inspect; whatever the hash seed (set and dict-from-set order), whether
run twice in one process or in fresh ones, and wherever the checkout lies (source paths are written
relative to the working directory).

Each run is a fresh ``python`` process that runs a list of commands through ``hloopt.cli.main`` and
returns every command's stdout and every file written, as bytes; runs are compared whole.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HLO = "fixtures/hlo/zoo/llama.tpu.hlo"
COMPILED = "fixtures/hlo/zoo/llama.tpu-v5e.hlo"
COMPILED_OFFLOAD = "fixtures/hlo/zoo/llama.offload.tpu-v5e.hlo"

_RUNNER = r"""
import contextlib, io, json, os, sys
from hloopt.cli import main
out_dir, commands = sys.argv[1], json.loads(sys.argv[2])
res = {}
for i, argv in enumerate(commands):
    argv = [a.replace("{out}", out_dir) for a in argv]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(argv)
    res[f"{i}: {' '.join(commands[i])}"] = {"rc": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
for name in sorted(os.listdir(out_dir)):
    with open(os.path.join(out_dir, name), encoding="utf-8", newline="") as f:
        res[f"file {name}"] = f.read()
print(json.dumps(res))
"""


def run(commands: list[list[str]], *, cwd: Path, out: Path, seed: str, repeat: int = 1) -> dict[str, object]:
    """Outputs of ``commands`` (run ``repeat`` times over in one process) in a fresh process, with
    the ``out`` folder's path (which some outputs name) written as OUT."""
    out.mkdir()
    env = {**os.environ, "PYTHONHASHSEED": seed, "COLUMNS": "120"}
    r = subprocess.run([sys.executable, "-c", _RUNNER, str(out), json.dumps(commands * repeat)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.replace(json.dumps(str(out))[1:-1], "OUT"))
    for key, value in res.items():
        if not key.startswith("file "):
            assert value["rc"] == 0, (key, value)  # type: ignore[index]
    return res


def assert_same(a: dict[str, object], b: dict[str, object], what: str) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"{what}: different output from {differ}"


HLO_COMMANDS = [
    ["plan", HLO, "--device", "tpu-v5e", "--pareto", "-q", "--out", "{out}/pareto.json", "--html", "{out}/pareto.html"],
    ["plan", HLO, "--device", "tpu-v5e", "--max-slowdown", "3%", "-q", "--out", "{out}/slow.json", "--force"],
    ["plan", HLO, "--device", "tpu-v5e", "--max-slowdown", "3%", "-q"],
    ["analyze", HLO, "--json"],
    ["analyze", COMPILED],
    ["residuals", HLO, "--json"],
    ["report", HLO, "--json"],
    ["report", HLO],
    ["report", HLO, "-q", "-o", "{out}/report.html", "--force"],
    ["report", "{out}/pareto.json", "--json"],
    ["diff", COMPILED, COMPILED_OFFLOAD, "--json"],
    ["diff", COMPILED, COMPILED_OFFLOAD],
    ["diff", "{out}/pareto.json", "{out}/slow.json", "--json"],
    ["inspect", HLO, "--json"],
]


def test_hlo_commands_are_byte_identical_across_runs_and_hash_seeds(tmp_path: Path) -> None:
    a = run(HLO_COMMANDS, cwd=ROOT, out=tmp_path / "a", seed="0")
    b = run(HLO_COMMANDS, cwd=ROOT, out=tmp_path / "b", seed="4242", repeat=2)
    # Twice in one process: the second round equals the first.
    n = len(HLO_COMMANDS)
    rounds = list(b.items())
    for (k1, v1), (_, v2) in zip(rounds[:n], rounds[n:2 * n]):
        assert v1 == v2, f"second run in one process differs: {k1}"
    first = dict(rounds[:n]) | {k: v for k, v in rounds[2 * n:]}
    assert_same(a, first, "PYTHONHASHSEED 0 vs 4242")
    plan = json.loads(a["file pareto.json"])  # type: ignore[arg-type]
    assert plan["mode"] == "pareto" and "time_s" not in plan["solver"]  # no wall-clock time
    assert not any("/work/" in str(v) or str(ROOT) in str(v) for v in a.values())


JAX_COMMANDS = [
    ["plan", "fixtures/zoo/llama.py:tiny", "--device", "tpu-v5e", "--max-slowdown", "3%", "-q",
     "--out", "{out}/a.json", "--html", "{out}/a.html"],
    # a budget the MILP solver works for (gpt2 tiny, TPU memory model: all on device 5.96 MiB, least
    # peak 5.48 MiB)
    ["plan", "fixtures/zoo/gpt2.py:tiny", "--device", "tpu-v5e", "--budget", "5.8MiB", "--solver", "milp", "-q",
     "--out", "{out}/milp.json"],
    ["analyze", "fixtures/zoo/llama.py:tiny", "--json"],
    ["residuals", "fixtures/zoo/llama.py:tiny", "--json"],
    ["report", "{out}/a.json", "--json"],
    ["report", "{out}/a.json", "-q", "-o", "{out}/report.html"],
    ["diff", "{out}/a.json", "{out}/milp.json", "--json"],
]


@pytest.mark.slow
@pytest.mark.full
def test_jax_target_is_byte_identical_in_another_checkout_and_hash_seed(tmp_path: Path) -> None:
    """llama tiny lowered by jax: in the repository with one hash seed, and in a copy of the
    fixtures elsewhere with another; the outputs hold no absolute path of either."""
    copy = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "fixtures/zoo", copy / "fixtures/zoo", ignore=shutil.ignore_patterns("__pycache__"))
    a = run(JAX_COMMANDS, cwd=ROOT, out=tmp_path / "a", seed="1")
    b = run(JAX_COMMANDS, cwd=copy, out=tmp_path / "b", seed="2")
    assert_same(a, b, "repository (seed 1) vs a copy elsewhere (seed 2)")
    text = json.dumps(a) + "".join(str(v) for k, v in a.items() if k.startswith("file "))
    assert str(ROOT) not in text and str(copy) not in text
    assert '"fixtures/zoo/llama.py:' in text  # sources are there, relative
    milp = json.loads(a["file milp.json"])  # type: ignore[arg-type]
    assert "time_s" not in milp["solver"]  # the search's wall-clock time is not written
    assert any(d["action"] != "device" for d in milp["decisions"])  # the search had work to do
