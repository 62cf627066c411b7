"""Bad input on the command line, for every command: one ``hloopt: error: ...`` line on stderr (plus
the caret snippet for malformed HLO), exit status 2, nothing on stdout, never a traceback.

Checked in process with click's ``CliRunner`` (exit code, both streams) for every command and kind
of bad input, and with real ``python -m hloopt`` processes for a representative subset (what users
see: no ``Traceback``). ``--help`` works for every command without importing jax, and so do the
commands that read HLO files. libtpu's own failures (another process holds its lockfile; a step
that does not fit HBM) surface as one line too (slow, libtpu).
"""

from __future__ import annotations

import fcntl
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import COMMANDS, cli

ROOT = Path(__file__).resolve().parents[2]
HLO = "fixtures/hlo/zoo/mlp.tpu.hlo"
HLO_OFFLOAD = "fixtures/hlo/zoo/mlp.offload.tpu.hlo"
MALFORMED = "HloModule m\n\nENTRY e {\n  p = f32[2] parameter(0)\n  ROOT r = f32[2] add(p, q)\n}\n"


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of bad inputs, by kind."""
    d = tmp_path_factory.mktemp("bad")
    files = {
        "malformed.hlo": MALFORMED,
        "empty.hlo": "",
        "notes.hlo": "hello world\n",
        "syntax.py": "import jax\ndef f(:\n",
        "raises.py": 'def f(**kw):\n    raise ValueError("no weights\\nfor you")\n',
        "wrong.py": "def f(**kw):\n    return 5\n",
        "notfn.py": "def f(**kw):\n    return (5, ())\n",
        "attr.py": "f = 3\n",
        "traceerr.py": "import jax.numpy as jnp\n\ndef f(**kw):\n    return (lambda x: x @ x, (jnp.ones((2, 3)),))\n",
        "invalid.json": "{oops\n",
        "future.json": '{"schema": "hloopt.plan/2"}\n',
        "list.json": "[]\n",
        "partial.json": '{"schema": "hloopt.plan/1"}\n',
        "empty.json": "",
    }
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "binary.hlo").write_bytes(bytes(range(256)) * 4)
    (d / "binary.json").write_bytes(b"\x9f\x00\xff" * 100)
    (d / "folder").mkdir()
    out = {Path(n).stem + ("_json" if n.endswith(".json") else ""): str(d / n) for n in files}
    out.update(binary=str(d / "binary.hlo"), binary_json=str(d / "binary.json"), folder=str(d / "folder"),
               missing=str(d / "missing.hlo"), missing_json=str(d / "missing.json"), dir=str(d))
    plan = subprocess.run([sys.executable, "-m", "hloopt", "plan", HLO, "--device", "tpu-v5e", "--max-slowdown", "3%",
                           "--json", "-q"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (d / "plan.json").write_text(plan)
    out["plan"] = str(d / "plan.json")
    return out


def one_error_line(argv: list[str]) -> str:
    """Run the CLI in process; assert exit 2, empty stdout, one ``hloopt: error:`` line; return it."""
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2, (argv, r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception  # not a crash
    assert r.stdout == "", (argv, r.stdout)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hloopt: error: "), (argv, r.stderr)
    return lines[0]


# -- TARGET arguments: every command that takes one, every kind of bad TARGET ------------------

#: argv templates of the commands that take a TARGET ({t} is the TARGET)
TARGET_COMMANDS = {
    "analyze": ["analyze", "{t}"],
    "residuals": ["residuals", "{t}"],
    "graph": ["graph", "{t}"],
    "plan": ["plan", "{t}", "--device", "tpu-v5e", "--max-slowdown", "3%", "-q"],
    "report": ["report", "{t}"],
    "diff A": ["diff", "{t}", HLO],
    "diff B": ["diff", HLO, "{t}"],
    "verify": ["verify", "{t}", "--plan", "{plan}"],
    "measure": ["measure", "{t}", "--device", "tpu-v5e", "-q"],
}
#: bad TARGET kind -> (TARGET template, what the line says)
BAD_TARGETS = {
    "missing file": ("{missing}", "{missing}: no such file"),
    "folder, not a dump": ("{folder}", "{folder}: no module_*.before_optimizations.txt files: not an XLA dump folder"),
    "binary file": ("{binary}", "{binary}: not a text file"),
    "empty file": ("{empty}", "{empty}: not HLO text"),
    "text, not HLO": ("{notes}", "{notes}: not HLO text"),
    "no such .py": ("{dir}/nope.py:f", "no such file '{dir}/nope.py'"),
    "no such attribute": ("{wrong}:nope", "has no attribute 'nope'"),
    "not callable": ("{attr}:f", "f is a int, not a factory function"),
    "no such module": ("no_such_pkg.model:make", "no module named 'no_such_pkg.model'"),
    "syntax error": ("{syntax}:f", "importing syntax.py failed: SyntaxError: invalid syntax (syntax.py, line 2)"),
    "factory raises": ("{raises}:f", "f() raised ValueError: no weights"),
    "returns the wrong thing": ("{wrong}:f", "f() must return (step_fn, args) or (step_fn, args, kwargs), got a int"),
    "step is not a function": ("{notfn}:f", "f() returned a int as step_fn, not a function"),
    "step fails to trace": ("{traceerr}:f", "tracing the step for tpu failed: TypeError: dot_general requires "
                                            "contracting dimensions to have the same shape"),
}
#: what a command says instead for a kind of TARGET it does not take
NOT_TAKEN = {
    ("diff A", "step fails to trace"): "diff reads HLO files, XLA dump folders and plan files",
    ("diff B", "step fails to trace"): "diff reads HLO files, XLA dump folders and plan files",
}


@pytest.mark.parametrize("kind", BAD_TARGETS)
@pytest.mark.parametrize("command", TARGET_COMMANDS)
def test_bad_target(bad: dict[str, str], command: str, kind: str) -> None:
    template, needle = BAD_TARGETS[kind]
    target = template.format(**bad)
    argv = [a.format(t=target, **bad) for a in TARGET_COMMANDS[command]]
    line = one_error_line(argv)
    assert NOT_TAKEN.get((command, kind), needle.format(**bad)) in line
    if kind == "factory raises":
        assert "for you" not in line  # the exception's second line is not printed


def test_verify_and_emit_name_a_hlo_target_they_cannot_use(bad: dict[str, str]) -> None:
    line = one_error_line(["verify", HLO, "--plan", bad["plan"]])
    assert line == f"hloopt: error: {HLO}: verify needs a JAX TARGET (file.py:factory), which it lowers again; this is hlo"


def test_inspect_bad_files(bad: dict[str, str]) -> None:
    assert one_error_line(["inspect", bad["missing"]]) == f"hloopt: error: {bad['missing']}: no such file"
    assert one_error_line(["inspect", bad["folder"]]).startswith(f"hloopt: error: {bad['folder']}: is a directory")
    assert one_error_line(["inspect", bad["binary"]]).startswith(f"hloopt: error: {bad['binary']}: not UTF-8 text")


@pytest.mark.parametrize("argv", [
    ["inspect", "{malformed}"], ["analyze", "{malformed}"], ["residuals", "{malformed}"],
    ["plan", "{malformed}", "--device", "tpu-v5e", "--max-slowdown", "3%"], ["report", "{malformed}"],
    ["diff", "{malformed}", HLO], ["emit", "{plan}", "--format", "hlo", "--hlo", "{malformed}"],
], ids=lambda a: a[0])
def test_malformed_hlo_gives_the_line_and_a_caret(bad: dict[str, str], argv: list[str]) -> None:
    r = CliRunner().invoke(cli, [a.format(**bad) for a in argv])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit) and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 3, r.stderr
    m = re.fullmatch(rf"hloopt: error: {re.escape(bad['malformed'])}:(\d+):(\d+): (.+)", lines[0])
    assert m, lines[0]
    line, col = int(m[1]), int(m[2])
    # 'q' on line 5 is used but never defined: the error is on that line, the snippet is that
    # line of the file, and the caret sits under the column the message names.
    assert line == 5 and "'q'" in m[3]
    assert lines[1] == MALFORMED.splitlines()[line - 1]
    assert lines[2] == " " * (col - 1) + "^"


# -- plan files: emit, verify --plan, report, diff ------------------------------------------

PLAN_COMMANDS = {
    "emit": ["emit", "{p}"],
    "verify": ["verify", "fixtures/zoo/llama.py:tiny", "--plan", "{p}"],
    "report": ["report", "{p}"],
    "diff": ["diff", "{p}", "{plan}"],
}
BAD_PLANS = {
    "invalid JSON": ("{invalid_json}", "line 1 column 2"),
    "future version": ("{future_json}", "schema hloopt.plan/2 is newer than this hloopt (reads hloopt.plan/1)"),
    "missing fields": ("{partial_json}", "missing field 'device'"),
    "a JSON list": ("{list_json}", ""),
    "binary": ("{binary_json}", ""),
    "empty": ("{empty_json}", ""),
}


@pytest.mark.parametrize("kind", BAD_PLANS)
@pytest.mark.parametrize("command", PLAN_COMMANDS)
def test_bad_plan_file(bad: dict[str, str], command: str, kind: str) -> None:
    template, needle = BAD_PLANS[kind]
    path = template.format(**bad)
    line = one_error_line([a.format(p=path, **bad) for a in PLAN_COMMANDS[command]])
    assert line.startswith(f"hloopt: error: {path}: ") and needle in line


@pytest.mark.parametrize("command", ["emit", "verify"])
def test_missing_and_folder_plan(bad: dict[str, str], command: str) -> None:
    argv = PLAN_COMMANDS[command]
    assert one_error_line([a.format(p=bad["missing_json"]) for a in argv]) == \
        f"hloopt: error: {bad['missing_json']}: no such plan file"
    assert f"'{bad['folder']}' is a directory" in one_error_line([a.format(p=bad["folder"]) for a in argv])


# -- budgets, devices, rates, conflicting flags, other commands -------------------------------

PLAN_HLO = ["plan", HLO, "--device", "tpu-v5e", "-q"]


@pytest.mark.parametrize("argv, needle", [
    (PLAN_HLO + ["--budget", "12 GB?"], "'12 GB?': not a budget"),
    (PLAN_HLO + ["--budget", "-5%"], "'-5%': not a budget"),
    (PLAN_HLO + ["--budget", "0%"], "'0%': a budget must be above 0%"),
    (PLAN_HLO + ["--budget", "0"], "'0': a budget must be above 0 bytes"),
    (PLAN_HLO + ["--max-slowdown", "-5%"], "'-5%': out of range"),
    (PLAN_HLO + ["--max-slowdown", "3"], "'3': not a percentage"),
    (["report", HLO, "--budget", "12 GB?"], "Invalid value for '--budget': '12 GB?': not a budget"),
    (["report", HLO, "--budget", "-5%"], "'-5%': not a budget"),
    (["report", HLO, "--budget", "0%"], "'0%': a budget must be above 0%"),
    (PLAN_HLO + ["--d2h", "25Gb/s"], "bits are not accepted"),
    (PLAN_HLO + ["--h2d", "fast"], "'fast': not a rate"),
    (PLAN_HLO + ["--hbm", "16G"], "'16G': unknown or ambiguous unit 'G'"),
    (["report", HLO, "--d2h", "-1GB/s"], "'-1GB/s': must be a finite, non-negative amount"),
    (["report", HLO, "--h2d", "25GB"], "'25GB': a rate needs '/s' after the unit"),
    (["devices", "tpu-v5e", "--d2h", "25Gb/s"], "bits are not accepted"),
    (["devices", "tpu-v5e", "--hbm", "lots"], "'lots': not a size"),
    (["plan", HLO, "--device", "tpu-v9", "--max-slowdown", "3%"], "unknown device 'tpu-v9'; known: a100-40gb"),
    (["report", HLO, "--device", "tpu-v9"], "unknown device 'tpu-v9'"),
    (["devices", "tpu-v9"], "unknown device 'tpu-v9'"),
    (["devices", ""], "NAME is empty"),
    (["report", HLO, "--device", ""], "--device is empty"),
    (["plan", HLO, "--max-slowdown", "3%"], "no device given: pass --device NAME"),
    # conflicting or missing flags
    (PLAN_HLO + ["--budget", "50%", "--max-slowdown", "3%"], "give exactly one of a budget, a maximum slowdown, or pareto"),
    (PLAN_HLO + ["--pareto", "--budget", "50%"], "give exactly one of a budget, a maximum slowdown, or pareto"),
    (PLAN_HLO, "say what to optimize: --budget SIZE|PCT, --max-slowdown PCT, or --pareto"),
    (PLAN_HLO + ["--max-slowdown", "3%", "--device-file", "x.toml"], "give either --device or --device-file, not both"),
    (PLAN_HLO + ["--max-slowdown", "3%", "--time-limit", "0"], "Invalid value for '--time-limit'"),
    (PLAN_HLO + ["--max-slowdown", "3%", "--size", "tiny"], "size= and factory keywords apply to a JAX TARGET"),
    (["devices", "tpu-v5e", "--device", "h100"], "give the device as NAME or with --device/--device-file, not both"),
    (["devices", "--hbm", "12GiB"], "--hbm/--d2h/--h2d need a device NAME"),
    (["analyze", HLO, "--compile", "cpu"], "--compile applies to a JAX TARGET; this is HLO already"),
    (["analyze", HLO, "--top", "-1"], "Invalid value for '--top'"),
    (["residuals", HLO, "--size", "tiny"], "size= and factory keywords apply to a JAX TARGET"),
    (["analyze", "fixtures/zoo/mlp.py:tiny", "--compile", "tpu-v9"], "unknown compile target 'tpu-v9'"),
    (["verify", "fixtures/zoo/llama.py:tiny"], "Missing option '--plan'"),
    (["diff", HLO], "Missing argument 'B'"),
    (["calibrate", "--repeats", "1"], "Invalid value for '--repeats'"),
    (["calibrate", "--sizes", "12 GB?"], "'12 GB?': not a size"),
    (["calibrate", "--profile", "fixtures"], "--profile DIR needs --target"),
    (["calibrate", "--target", "fixtures/zoo/mlp.py:tiny"], "--target, --size and --for-compiled go with --profile DIR"),
    (["measure", HLO, "--steps", "0"], "Invalid value for '--steps'"),
    (["measure", HLO, "--device", "tpu-v5e"], "an HLO file cannot be run"),
    (["measure", "fixtures/zoo/mlp.py:tiny", "--policies", "none", "--device", "tpu-v5e"],
     "nothing to measure: --policies none needs --plan"),
    (["state", HLO], "state groups need a JAX TARGET (file.py:factory), not hlo"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
    (["plan", "--nosuchoption"], "No such option '--nosuchoption'"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_bad_flags(argv: list[str], needle: str) -> None:
    assert needle in one_error_line(argv)


def test_budget_below_the_floor_says_the_floor() -> None:
    line = one_error_line(PLAN_HLO + ["--budget", "1KiB"])
    m = re.fullmatch(r"hloopt: error: budget 1\.00 KiB is below the least peak any policy reaches: "
                     r"needs at least ([\d.]+) (KiB|MiB)(; [\d.]+ KiB of the step's outputs .* does not donate .*)?", line)
    assert m, line
    floor = float(m[1]) * {"KiB": 2**10, "MiB": 2**20}[m[2]]
    # The parameters alone must stay on device: the floor is at least their bytes.
    from hloopt.hlo.parser import parse_file

    mod = parse_file(str(ROOT / HLO))
    params = sum(i.shape.byte_size for i in mod.entry.instructions if i.opcode == "parameter")
    assert floor >= params * 0.99


def test_emit_hlo_only_and_bad_formats(bad: dict[str, str]) -> None:
    assert "--hlo applies to --format hlo only" in one_error_line(
        ["emit", bad["plan"], "--format", "python", "--hlo", HLO])
    assert "'nope' is not one of" in one_error_line(["emit", bad["plan"], "--format", "nope"])
    assert f"{bad['dir']}/nowhere/p.py: no such folder" in one_error_line(
        ["emit", bad["plan"], "-o", f"{bad['dir']}/nowhere/p.py"])


def test_device_profile_files(bad: dict[str, str]) -> None:
    assert one_error_line(["devices", bad["binary"]]) == \
        f"hloopt: error: {bad['binary']}: not a text file (a TOML or JSON device profile expected)"
    assert one_error_line(["devices", bad["invalid_json"]]).startswith(
        f"hloopt: error: {bad['invalid_json']}: not valid JSON")
    assert one_error_line(["report", HLO, "--device-file", f"{bad['dir']}/no.toml"]) == \
        f"hloopt: error: {bad['dir']}/no.toml: no such device profile file"


def test_calibrate_without_an_accelerator() -> None:
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("this machine has an accelerator")
    assert one_error_line(["calibrate"]) == \
        "hloopt: error: no accelerator: JAX's default backend is cpu; calibrate needs a TPU or GPU"


def test_every_command_is_covered() -> None:
    """The tables above exercise every command the CLI registers."""
    import inspect as pyinspect

    src = pyinspect.getsource(sys.modules[__name__])
    for name in COMMANDS:
        assert re.search(rf'\["{name}"', src), f"no bad-input case for {name}"


# -- real processes ------------------------------------------------------------------------

def hloopt(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hloopt", *argv], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("argv, needle", [
    (["inspect", "{malformed}"], "{malformed}:5:"),
    (["analyze", "{missing}"], "{missing}: no such file"),
    (["residuals", "{traceerr}:f"], "tracing the step for tpu failed"),
    (["plan", HLO, "--device", "tpu-v5e", "--budget", "12 GB?"], "not a budget"),
    (["plan", HLO, "--device", "tpu-v5e", "--budget", "1KiB"], "needs at least"),
    (["emit", "{future_json}"], "is newer than this hloopt"),
    (["verify", "fixtures/zoo/llama.py:tiny", "--plan", "{invalid_json}"], "not JSON"),
    (["report", "{folder}"], "not an XLA dump folder"),
    (["diff", "{binary_json}", HLO], "not a text file"),
    (["devices", "tpu-v9"], "unknown device"),
    (["calibrate", "--repeats", "1"], "Invalid value for '--repeats'"),
    (["plan", HLO, "--device", "tpu-v5e", "--d2h", "25Gb/s"], "bits are not accepted"),
], ids=lambda x: x[0] if isinstance(x, list) else "")
def test_real_process_prints_one_line_and_exits_2(bad: dict[str, str], argv: list[str], needle: str) -> None:
    r = hloopt(*[a.format(**bad) for a in argv])
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("hloopt: error: ") and needle.format(**bad) in lines[0], r.stderr
    assert len(lines) == (3 if argv[0] == "inspect" else 1), r.stderr


_HELP_AND_HLO = """
import contextlib, io, json, sys
from hloopt.cli import COMMANDS, main
H, H2, PLAN = sys.argv[1:4]
res = {}
for argv in [["--help"]] + [[c, "--help"] for c in sorted(COMMANDS)] + [
        ["inspect", H], ["analyze", H, "--json"], ["residuals", H, "--json"], ["report", H, "--json"],
        ["graph", H, "--format", "json"],
        ["diff", H, H2, "--json"], ["plan", H, "--device", "tpu-v5e", "--max-slowdown", "3%", "--json", "-q"],
        ["emit", PLAN], ["devices"], ["analyze", H + ".missing"]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    res[" ".join(argv)] = [rc, out.getvalue(), err.getvalue(), "jax" in sys.modules]
print(json.dumps(res))
"""


def test_help_works_and_hlo_commands_import_no_jax(bad: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-c", _HELP_AND_HLO, HLO, HLO_OFFLOAD, bad["plan"]], cwd=ROOT,
                       capture_output=True, text=True, check=True, timeout=300)
    res = json.loads(r.stdout)
    rc, out, _, _ = res["--help"]
    assert rc == 0 and out.startswith("Usage: hloopt [OPTIONS] COMMAND")
    assert all(f"  {c} " in out for c in COMMANDS)
    for c in COMMANDS:
        rc, out, err, _ = res[f"{c} --help"]
        assert rc == 0 and out.startswith(f"Usage: hloopt {c} ") and err == "", (c, out, err)
    for argv, (rc, out, err, jax_loaded) in res.items():
        assert not jax_loaded, f"`hloopt {argv}` imported jax"
        if argv.endswith(".missing"):
            assert rc == 2 and err == f"hloopt: error: {HLO}.missing: no such file or folder " \
                "(a TARGET is file.py:factory, package.module:factory, an HLO text file or an XLA dump folder)\n"
        else:
            assert rc == 0 and out, argv


# -- libtpu: another process holds it; a step that does not fit ------------------------------

_HOLD_LIBTPU = """
import sys
import hloopt.lowering
from jax.experimental import topologies
topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
@pytest.mark.tpu
def test_libtpu_busy_and_out_of_memory_are_one_line(tmp_path: Path) -> None:
    # 5 Gi float32 = 20 GiB in, 20 GiB out: 40 GiB on a 16 GiB v5e chip.
    (tmp_path / "huge.py").write_text("import jax\nimport jax.numpy as jnp\n\n\ndef f(**kw):\n"
                                      "    x = jax.ShapeDtypeStruct((5 * 2**30,), jnp.float32)\n"
                                      "    return (lambda x: x * 2, (x,))\n")
    target = f"{tmp_path}/huge.py:f"
    with open("/tmp/hloopt-tpu.flock", "a") as lock:  # one libtpu user at a time on this machine
        fcntl.flock(lock, fcntl.LOCK_EX)
        holder = subprocess.Popen([sys.executable, "-c", _HOLD_LIBTPU], cwd=ROOT, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
            busy = hloopt("analyze", target, "--compile", "tpu-v5e")
        finally:
            holder.communicate("", timeout=60)
        oom = hloopt("analyze", target, "--compile", "tpu-v5e")
    for r in (busy, oom):
        assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert busy.stderr.splitlines() == [
        "hloopt: error: cannot compile for tpu-v5e: libtpu is in use by another process (one process at a "
        "time may use it); wait for it to finish and retry (ABORTED: Internal error when accessing libtpu "
        "multi-process lockfile.)"]
    # libtpu may log its own start-up lines first; ours is the one and last hloopt line.
    ours = [line for line in oom.stderr.splitlines() if line.startswith("hloopt")]
    assert ours == [oom.stderr.splitlines()[-1]]
    assert ours[0].startswith("hloopt: error: the step does not fit tpu-v5e's memory: XLA says RESOURCE_EXHAUSTED")
    assert "(40.00G)" in ours[0]  # XLA's figure for 2 x 20 GiB


@pytest.mark.slow
@pytest.mark.tpu
def test_a_step_whose_own_mesh_is_on_cpu_devices_cannot_be_compiled_for_tpu_and_says_so(tmp_path: Path) -> None:
    # a shard_map over a mesh of this machine's CPU devices: hloopt places the arguments on v5e
    # devices, which the mesh inside the step cannot follow
    (tmp_path / "smap.py").write_text(
        "import jax\nimport jax.numpy as jnp\nimport numpy as np\nfrom jax.sharding import Mesh, NamedSharding\n"
        "from jax.sharding import PartitionSpec as P\n\n\ndef f():\n"
        "    mesh = Mesh(np.array(jax.devices()[:2]), ('d',))\n"
        "    step = jax.jit(jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P('d'), out_specs=P('d')))\n"
        "    return step, (jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P('d'))),)\n")
    with open("/tmp/hloopt-tpu.flock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = hloopt("analyze", f"{tmp_path}/smap.py:f", "--compile", "tpu-v5e")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    ours = [line for line in r.stderr.splitlines() if line.startswith("hloopt")]
    assert len(ours) == 1 and ours[0] == r.stderr.splitlines()[-1]
    assert ours[0].startswith(f"hloopt: error: {tmp_path}/smap.py:f: the step holds a mesh of its own"), ours[0]


def test_a_budget_below_the_floor_of_a_step_that_donates_nothing_says_so(tmp_path: Path) -> None:
    """The plan's refusal names what the step itself can change: its new weights and momentum
    (256 KiB each) are written beside the arguments it does not donate."""
    (tmp_path / "sgd.py").write_text(
        "import jax\nimport jax.numpy as jnp\n\n\n"
        "def make():\n"
        "    def step(w, m, x):\n"
        "        def loss(w):\n"
        "            return jnp.mean(jax.checkpoint(lambda w: jnp.tanh(x @ w))(w) ** 2)\n"
        "        value, g = jax.value_and_grad(loss)(w)\n"
        "        m = 0.9 * m + g\n"
        "        return w - 0.1 * m, m, value\n"
        "    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)\n"
        "    return step, (w, w, jax.ShapeDtypeStruct((8, 256), jnp.float32))\n")
    line = one_error_line(["plan", f"{tmp_path}/sgd.py:make", "--device", "tpu-v5e", "--budget", "1KiB"])
    assert "is below the least peak any policy reaches" in line
    assert "; 512 KiB of the step's outputs have the shape and type of arguments it does not donate" in line
    assert "jax.jit(step, donate_argnums=...)" in line


def test_judging_by_libtpu_compiles_needs_a_tpu_profile() -> None:
    """``--judge compiled`` compiles with libtpu: for a GPU profile that is one line, before any work."""
    line = one_error_line(["plan", "fixtures/zoo/mlp.py:tiny", "--device", "h200", "--budget", "90%",
                           "--judge", "compiled"])
    assert "--judge compiled" in line and "'h200'" in line, line


def test_the_flops_objective_needs_a_budget() -> None:
    """``--objective flops`` plans the fewest FLOPs that fit a budget: without one it is one line,
    before the step is lowered."""
    line = one_error_line(["plan", "fixtures/zoo/mlp.py:tiny", "--device", "tpu-v5e", "--max-slowdown", "5%",
                           "--objective", "flops"])
    assert "--objective flops needs a --budget" in line, line


def test_judge_measured_refuses_a_device_other_than_the_profiles() -> None:
    """``--judge measured`` times policies on this machine's JAX device (here the CPU): planning for
    a TPU by a CPU's timings is one line naming both, before the step is lowered."""
    line = one_error_line(["plan", "fixtures/zoo/mlp.py:tiny", "--device", "tpu-v5e", "--budget", "80%",
                           "--judge", "measured"])
    assert "--judge measured" in line and "cpu" in line and "tpu-v5e" in line, line
