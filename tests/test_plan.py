"""The plan file: JSON round trip, deterministic text, and one-line errors for bad files (exit 2)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from hloopt.cli import cli, main
from hloopt.devices import load_profile
from hloopt.errors import UserError
from hloopt.plan import SCHEMA, Bounds, Budget, Decision, ParetoPoint, Plan, Predicted, Selector, SolverInfo


def named(name: str, action: str = "offload", *, nbytes: int = 32768, layers: int = 2) -> Decision:
    return Decision(key=f"name:{name}", name=name, selector=Selector.by_name(name), action=action,
                    bytes=nbytes, layers=layers, shape="f32[2,32,64]", reason="r", source="llama.py:137")


def make_plan(decisions: tuple[Decision, ...] = (), **kw: object) -> Plan:
    base = dict(
        target="fixtures/zoo/llama.py:tiny", module="jit_step", device=load_profile("tpu-v5e").to_dict(),
        budget=Budget(spec="75%", bytes=12 * 2**30), mode="budget", decisions=decisions,
        predicted=Predicted(peak_bytes=1000, step_time_s=0.25, exposed_transfer_s=0.001,
                            baseline_peak_bytes=2000, baseline_step_time_s=0.2),
        bounds=Bounds(least_peak_bytes=500, least_step_time_s=0.2),
        solver=SolverInfo(name="milp", status="optimal", gap=0.0, time_s=0.5))
    base.update(kw)
    return Plan(**base)  # type: ignore[arg-type]


PLAN = make_plan((
    named("query_proj"),
    named("context", "device"),
    Decision(key="prim:dot_general@model.py:42", name=None,
             selector=Selector.by_primitive("dot_general", source="model.py:42", shape="f32[2,32,32]"),
             action="remat", bytes=8192, layers=1, shape="f32[2,32,32]"),
), pareto=(ParetoPoint(peak_bytes=900, step_time_s=0.3, actions={"name:query_proj": "offload"}),))


def test_round_trip_and_fixed_point(tmp_path: Path) -> None:
    text = PLAN.to_json()
    assert Plan.loads(text) == PLAN
    path = tmp_path / "plan.json"
    PLAN.save(path)
    assert path.read_text() == text
    assert Plan.load(path).to_json() == text


def test_a_builtin_plan_round_trips_and_plans_without_one_keep_their_bytes() -> None:
    plan = make_plan((named("context", "device"), named("query_proj", "remat")), builtin="dots_saveable")
    text = plan.to_json()
    assert json.loads(text)["builtin"] == "dots_saveable"
    assert Plan.loads(text) == plan
    assert "builtin" not in json.loads(PLAN.to_json())


def test_a_flops_objective_round_trips_and_time_plans_keep_their_bytes() -> None:
    plan = make_plan((named("query_proj"),), objective="flops")
    text = plan.to_json()
    assert json.loads(text)["objective"] == "flops"
    assert Plan.loads(text) == plan
    assert "objective" not in json.loads(PLAN.to_json()) and Plan.loads(PLAN.to_json()).objective == "time"


def test_text_is_deterministic_sorted_and_rounded() -> None:
    plan = make_plan(predicted=Predicted(peak_bytes=1, step_time_s=0.1 + 0.2, exposed_transfer_s=1 / 3,
                                         baseline_peak_bytes=1, baseline_step_time_s=0.0))
    data = json.loads(plan.to_json())
    assert list(data) == sorted(data)
    assert data["schema"] == SCHEMA == "hloopt.plan/1"
    # 0.1 + 0.2 == 0.30000000000000004 in binary; 12 significant digits write 0.3
    assert data["predicted"]["step_time_s"] == 0.3
    assert data["predicted"]["exposed_transfer_s"] == 0.333333333333
    assert plan.to_json() == make_plan(predicted=plan.predicted).to_json()
    assert "time" not in plan.to_json().replace("time_s", "").replace("_time", "")


def test_views() -> None:
    assert PLAN.names("offload") == ["query_proj"]
    assert PLAN.names("device") == ["context"]
    assert [d.key for d in PLAN.of("remat")] == ["prim:dot_general@model.py:42"]
    assert not PLAN.by_name_only and make_plan((named("a"),)).by_name_only
    assert PLAN.device_profile().name == "tpu-v5e"


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1), st.text())
def test_any_name_and_target_survive_json(name: str, target: str) -> None:
    plan = make_plan((named(name),), target=target)
    text = plan.to_json()
    assert text.isascii()
    assert Plan.loads(text) == plan


def _bad(tmp_path: Path, content: str | bytes) -> str:
    path = tmp_path / "plan.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(UserError) as err:
        Plan.load(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: ")
    return msg[len(f"{path}: "):]


def _mutated(**changes: object) -> str:
    data = json.loads(PLAN.to_json())
    for dotted, value in changes.items():
        obj = data
        *path, last = dotted.split("__")
        for part in path:
            obj = obj[int(part)] if isinstance(obj, list) else obj[part]
        if value is KeyError:
            del obj[last]
        else:
            obj[last] = value
    return json.dumps(data)


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not JSON (line 1 column 2: Expecting property name enclosed in double quotes)"),
    (b"\xff\xfe", "not JSON (not UTF-8 text)"),
    ("[1, 2]", "not an hloopt plan (expected a JSON object, got a list)"),
    ('{"target": "x"}', 'not an hloopt plan (no "schema" field)'),
    ('{"schema": "other/1"}', "not an hloopt plan (schema 'other/1', expected hloopt.plan/1)"),
    ('{"schema": "hloopt.plan/9"}', "schema hloopt.plan/9 is newer than this hloopt (reads hloopt.plan/1); "
                                    "upgrade hloopt"),
    (_mutated(target=KeyError), "missing field 'target'"),
    (_mutated(decisions__0__bytes="32 KiB"), "decisions[0].bytes: expected an integer, got a string"),
    (_mutated(decisions__0__bytes=-1), "decisions[0].bytes: expected an integer >= 0, got -1"),
    (_mutated(decisions__1__layers=True), "decisions[1].layers: expected an integer, got a boolean"),
    (_mutated(decisions__0__action="keep"), "decisions[0].action: expected one of device, offload, remat, got 'keep'"),
    (_mutated(decisions__0__selector__kind="regex"),
     "decisions[0].selector.kind: expected one of name, primitive, got 'regex'"),
    (_mutated(decisions__2__selector=KeyError), "decisions[2]: missing field 'selector'"),
    (_mutated(decisions__0__values=[1]), "decisions[0].values[0]: expected a string, got an integer"),
    (_mutated(mode="fastest"), "mode: expected one of budget, max-slowdown, pareto, got 'fastest'"),
    (_mutated(predicted__step_time_s="1s"), "predicted.step_time_s: expected a number, got a string"),
    (_mutated(device=[]), "device: expected an object, got a list"),
    (_mutated(decisions={}), "expected a list, got an object"),
    (_mutated(pareto__0__actions={"k": "move"}), "pareto[0].actions.k: expected one of device, offload, remat, got 'move'"),
    (_mutated(decisions__1__key="name:query_proj"), "decisions[1].key: 'name:query_proj' repeats decisions[0]"),
    (_mutated(decisions__1__selector={"kind": "name", "name": "query_proj"}),
     "decisions[1]: checkpoint_name 'query_proj' is both offload (decisions[0]) and device"),
    (_mutated(builtin="checkpoint_dots"),
     "builtin: expected one of dots_saveable, dots_with_no_batch_dims_saveable, nothing_saveable, "
     "offload_dot_with_no_batch_dims, got 'checkpoint_dots'"),
    (_mutated(objective="speed"), "objective: expected one of time, flops, got 'speed'"),
    (_mutated(builtin="dots_saveable"),
     "builtin: dots_saveable offloads nothing, but decisions offload 'name:query_proj'"),
])
def test_bad_files_are_one_line_errors(tmp_path: Path, content: str | bytes, message: str) -> None:
    got = _bad(tmp_path, content)
    assert got == message or got.endswith(message), got


def test_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"nope.json: no such plan file$"):
        Plan.load(tmp_path / "nope.json")
    with pytest.raises(UserError, match=r"is a folder, not a plan file$"):
        Plan.load(tmp_path)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    data = json.loads(PLAN.to_json())
    data["notes"] = {"added": "in 1.x"}
    data["decisions"][0]["extra"] = 1
    assert Plan.from_dict(data) == PLAN


def test_plans_built_in_code_are_checked_too() -> None:
    with pytest.raises(UserError, match=r"repeats decisions\[0\]"):
        make_plan((named("a"), named("a")))
    with pytest.raises(UserError, match="is both offload"):
        make_plan((named("a"), dataclasses.replace(named("a", "device"), key="other")))


@pytest.mark.parametrize("content", ["{oops", '{"schema": "hloopt.plan/2"}'])
def test_cli_exits_2_with_one_line_for_bad_plans(tmp_path: Path, content: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    for argv in (["emit", str(path)], ["verify", "fixtures/zoo/llama.py:tiny", "--plan", str(path)]):
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 2, result.output
        assert str(path) in result.output
        # The real entry point prints one line, no traceback.
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"hloopt: error: {path}: "), err


def test_a_policy_that_offloads_more_values_than_the_plan_decides_is_told() -> None:
    """The step lowered with the plan's policy: two values annotated for host memory (f32[8],
    32 B each) where the plan offloads one name over one layer; with two layers planned, none."""
    from hloopt.pipeline import offloads_beyond_the_plan

    text = """HloModule m
ENTRY e {
  x = f32[8]{0} parameter(0)
  a = f32[8]{0} negate(x)
  b = f32[8]{0} exponential(x)
  ha = f32[8]{0} custom-call(a), custom_call_target="annotate_device_placement", custom_call_has_side_effect=true, frontend_attributes={_xla_buffer_placement="pinned_host"}
  hb = f32[8]{0} custom-call(b), custom_call_target="annotate_device_placement", custom_call_has_side_effect=true, frontend_attributes={_xla_buffer_placement="pinned_host"}
  ROOT r = (f32[8]{0}, f32[8]{0}) tuple(ha, hb)
}
"""
    note = offloads_beyond_the_plan(make_plan((named("q", layers=1),)), text)
    assert note is not None and note.startswith("the plan's policy offloads 2 value(s) (64 B) where the plan decides 1:")
    assert offloads_beyond_the_plan(make_plan((named("q", layers=2),)), text) is None
