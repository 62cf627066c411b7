"""What hloopt writes is safe: any name survives ``hloopt emit`` intact and cannot break out of a
literal or comment; output files are written atomically and never replace a user's own file without
``--force``; a failure half-way leaves the old file (or none) and no temporary behind.

Ground truth: JAX's own ``save_and_offload_only_these_names`` policy for the emitted Python,
``yaml.safe_load`` for the MaxText fragment, the bytes of the files before and after.
"""

from __future__ import annotations

import ast
import copy
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import cli
from hloopt.devices import load_profile
from hloopt.emit import MAXTEXT_DEFAULTS, MAXTEXT_NAMES
from hloopt.fileio import MARKER
from hloopt.plan import Bounds, Budget, Decision, Plan, Predicted, Selector, SolverInfo

ROOT = Path(__file__).resolve().parents[1]
HLO = str(ROOT / "fixtures/hlo/zoo/mlp.tpu.hlo")

#: names that break naive code generation: quotes, newlines, unicode, triple quotes, comment and
#: YAML mapping markers, backslashes, a would-be statement
NASTY = (
    "it's \"quoted\"",
    "line one\nline two",
    "ünïcødé ✓ 名前",
    'has """ triple quotes',
    "hash # not a comment",
    "key: value",
    "back\\slash\\n",
    "x'])\nimport os; os.system('echo pwned')\n#",
    "- list item",
)


def nasty_plan(*, target: str = 'model "v2"\n# : """.py:make', names: tuple[str, ...] = NASTY) -> Plan:
    decisions = []
    for i, name in enumerate(names):
        action = ("offload", "device", "remat")[i % 3]
        decisions.append(Decision(key=f"name:{name}", name=name, selector=Selector.by_name(name), action=action,
                                  bytes=1024 * (i + 1), layers=2, shape="f32[2,64]", reason=f"why: {name}",
                                  source=f"{name}.py:{i}"))
    decisions.append(Decision(key="name:query_proj", name="query_proj", selector=Selector.by_name("query_proj"),
                              action="offload", bytes=4096, layers=2, shape="f32[2,64]"))
    return Plan(target=target, module='jit_step"\n#', device=load_profile("tpu-v5e").to_dict(),
                budget=Budget(spec="75%", bytes=12 * 2**30), mode="budget", decisions=tuple(decisions),
                predicted=Predicted(peak_bytes=1000, step_time_s=0.25, exposed_transfer_s=0.0,
                                    baseline_peak_bytes=2000, baseline_step_time_s=0.2),
                bounds=Bounds(least_peak_bytes=500, least_step_time_s=0.2),
                solver=SolverInfo(name="milp", status="optimal", gap=0.0))


def emit(*argv: str) -> str:
    r = CliRunner().invoke(cli, ["emit", *argv])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_emitted_python_policy_keeps_every_name(tmp_path: Path) -> None:
    import jax
    from jax._src.ad_checkpoint import name_p

    plan = nasty_plan()
    plan.save(tmp_path / "plan.json")
    r = CliRunner().invoke(cli, ["emit", str(tmp_path / "plan.json"), "-o", str(tmp_path / "policy.py")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "policy.py").read_text(encoding="utf-8")
    tree = ast.parse(text)  # valid Python whatever the names hold
    # The same code as for a plan with tame names, but for the string literals: no name added
    # code of its own or ended a comment early.
    tame = nasty_plan(target="model.py:make", names=tuple(f"n{i}" for i in range(len(NASTY))))
    tame_tree = ast.parse(emit(_saved(tmp_path / "tame.json", tame)))
    assert _shape(tree) == _shape(tame_tree)
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert set(plan.names("device")) | set(plan.names("offload")) <= literals  # intact, as literals
    ns: dict[str, object] = {}
    exec(compile(tree, "policy.py", "exec"), ns)
    # The emitted policy answers as JAX's own policy built from the same name sets.
    ref = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=plan.names("device"), names_which_can_be_offloaded=plan.names("offload"),
        offload_src="device", offload_dst="pinned_host")
    aval = jax.core.ShapedArray((2, 64), jax.numpy.float32)
    policy = ns["policy"]
    for name in (*NASTY, "query_proj", "never planned"):
        assert policy(name_p, aval, name=name) == ref(name_p, aval, name=name), name  # type: ignore[operator]
    # Every comment line is still a comment: the header keeps the marker and has no bare text.
    assert text.startswith(f"# {MARKER}")


def test_emitted_maxtext_yaml_has_exactly_the_maxtext_keys(tmp_path: Path) -> None:
    import yaml

    plan = nasty_plan()
    path = _saved(tmp_path / "plan.json", plan)
    strict = CliRunner().invoke(cli, ["emit", path, "--format", "maxtext"])
    assert strict.exit_code == 2 and strict.stdout == "" and len(strict.stderr.splitlines()) == 1
    text = emit(path, "--format", "maxtext", "--lenient")
    expected = {"remat_policy": "custom", **{n: MAXTEXT_DEFAULTS.get(n, "remat") for n in MAXTEXT_NAMES},
                "query_proj": "offload"}
    assert yaml.safe_load(text) == expected
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert [line.split(":")[0] for line in body] == list(expected)


def test_emitted_json_round_trips_every_name(tmp_path: Path) -> None:
    plan = nasty_plan()
    assert Plan.loads(emit(_saved(tmp_path / "plan.json", plan), "--format", "json")) == plan


def _shape(tree: ast.AST) -> str:
    """The AST with every string literal blanked."""
    class Blank(ast.NodeTransformer):
        def visit_Constant(self, node: ast.Constant) -> ast.Constant:
            return ast.Constant("") if isinstance(node.value, str) else node

    return ast.dump(Blank().visit(copy.deepcopy(tree)))


def _saved(path: Path, plan: Plan) -> str:
    plan.save(path, force=True)
    return str(path)


# -- overwriting ------------------------------------------------------------------------------

FOREIGN = "my own notes, not hloopt's\n"


def writers(tmp_path: Path) -> dict[str, list[str]]:
    """argv of every command that writes a file, each writing {out}."""
    plan = _saved(tmp_path / "in-plan.json", nasty_plan(target=HLO))
    plan_argv = ["plan", HLO, "--device", "tpu-v5e", "--max-slowdown", "3%", "-q"]
    return {
        "plan --out": [*plan_argv, "--out", "{out}"],
        "plan --html": [*plan_argv, "--html", "{out}"],
        "report -o": ["report", HLO, "-q", "-o", "{out}"],
        "emit -o": ["emit", plan, "-o", "{out}"],
        "emit --format json -o": ["emit", plan, "--format", "json", "-o", "{out}"],
    }


@pytest.mark.parametrize("writer", ["plan --out", "plan --html", "report -o", "emit -o", "emit --format json -o"])
def test_a_foreign_file_needs_force(tmp_path: Path, writer: str) -> None:
    out = tmp_path / "out.file"
    out.write_text(FOREIGN)
    argv = [a.format(out=out) for a in writers(tmp_path)[writer]]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2 and r.stderr == f"hloopt: error: {out} exists: pass --force to overwrite\n", r.output
    assert out.read_text() == FOREIGN
    r = CliRunner().invoke(cli, [*argv, "--force"])
    assert r.exit_code == 0, r.output
    written = out.read_text(encoding="utf-8")
    assert MARKER in written or '"schema": "hloopt.plan/1"' in written
    # Now it is ours: writing again needs no --force, and gives the same bytes.
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    assert out.read_text(encoding="utf-8") == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in-plan.json", "out.file"]  # no temporaries


def test_plan_refuses_before_writing_anything(tmp_path: Path) -> None:
    """--out is fine, --html is someone's file: neither is written (not plan.json alone)."""
    (tmp_path / "page.html").write_text(FOREIGN)
    r = CliRunner().invoke(cli, ["plan", HLO, "--device", "tpu-v5e", "--max-slowdown", "3%", "-q",
                                 "--out", str(tmp_path / "plan.json"), "--html", str(tmp_path / "page.html")])
    assert r.exit_code == 2 and "page.html exists: pass --force" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]


def test_an_error_before_writing_leaves_no_file(tmp_path: Path) -> None:
    path = _saved(tmp_path / "plan.json", nasty_plan())
    r = CliRunner().invoke(cli, ["emit", path, "--format", "maxtext", "-o", str(tmp_path / "x.yml")])
    assert r.exit_code == 2 and "cannot be written as a MaxText remat_policy" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


#: ``python -m hloopt`` in a process whose writes past 64 KiB fail with EFBIG (CPython ignores
#: SIGXFSZ, so the write raises instead of the signal killing the process)
_SMALL_FILES = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)); "
                "sys.argv[0] = 'hloopt'; runpy.run_module('hloopt', run_name='__main__')")


def test_a_write_failing_half_way_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    old = subprocess.run([sys.executable, "-m", "hloopt", "report", HLO, "-q", "-o", str(out)], cwd=ROOT,
                         capture_output=True, text=True)
    assert old.returncode == 0, old.stderr
    before = out.read_bytes()
    assert len(before) > 64 << 10  # the report is bigger than the limit below
    # Same report for another budget: different bytes, and the write fails past 64 KiB.
    r = subprocess.run([sys.executable, "-c", _SMALL_FILES, "report", HLO, "-q", "--budget", "1MiB", "-o", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [f"hloopt: error: {out}: cannot write: File too large"]
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    fresh = tmp_path / "new.html"
    r = subprocess.run([sys.executable, "-c", _SMALL_FILES, "report", HLO, "-q", "-o", str(fresh)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and not fresh.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
