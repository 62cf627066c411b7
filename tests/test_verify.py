"""hloopt verify: the emitted policy offloads exactly the plan, or says what did not move and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.cli import cli
from hloopt.errors import UserError
from hloopt.hlo.parser import parse_module
from hloopt.plan import Budget, Decision, Selector
from hloopt.targets import resolve
from hloopt.verify import offload_annotations, verify
from tests.test_plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
LLAMA = "fixtures/zoo/llama.py:tiny"
# tiny llama: batch 2, seq 32, d_model 64 (4 heads x 16), 2 KV heads x 16 = 32, 2 layers, f32
BSD = 2 * 32 * 64 * 4  # one layer's query_proj/context, bytes
BSK = 2 * 32 * 32 * 4  # one layer's key_proj/value_proj, bytes
LAYERS = 2
VMEM_NOTE = "the peak is libtpu's on-chip VMEM heap, not HBM"


def offload(name: str, per_layer_bytes: int, *, layers: int = LAYERS) -> Decision:
    return Decision(key=f"name:{name}", name=name, selector=Selector.by_name(name), action="offload",
                    bytes=per_layer_bytes * layers, layers=layers, shape="")


def invoke(tmp_path: Path, plan: object, *extra: str, target: str = LLAMA) -> tuple[int, str]:
    path = tmp_path / "plan.json"
    plan.save(path)  # type: ignore[attr-defined]
    result = CliRunner().invoke(cli, ["verify", target, "--plan", str(path), *extra])
    return result.exit_code, result.output


# -- annotations and loop multiplicity on hand-written HLO ----------------------------------------

LOOP_HLO = """HloModule loop

body {
  p = (s32[], f32[8]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[8]{0} get-tuple-element(p), index=1
  host = f32[8]{0} custom-call(x), custom_call_target="annotate_device_placement", custom_call_has_side_effect=true, frontend_attributes={_xla_buffer_placement="pinned_host"}
  back = f32[8]{0} custom-call(host), custom_call_target="annotate_device_placement", custom_call_has_side_effect=true, frontend_attributes={_xla_buffer_placement="device"}
  one = s32[] constant(1)
  j = s32[] add(i, one)
  ROOT t = (s32[], f32[8]{0}) tuple(j, back)
}

cond {
  p = (s32[], f32[8]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(5)
  ROOT lt = pred[] compare(i, n), direction=LT
}

ENTRY e {
  a = f32[8]{0} parameter(0)
  y = f32[2,4]{1,0} parameter(1)
  top = f32[2,4]{1,0} custom-call(y), custom_call_target="annotate_device_placement", custom_call_has_side_effect=true, frontend_attributes={_xla_buffer_placement="pinned_host"}
  start = s32[] constant(2)
  init = (s32[], f32[8]{0}) tuple(start, a)
  w = (s32[], f32[8]{0}) while(init), condition=cond, body=body
  ROOT r = f32[8]{0} get-tuple-element(w), index=1
}
"""


def test_annotations_count_once_per_loop_iteration() -> None:
    found = {a.instruction: a for a in offload_annotations(parse_module(LOOP_HLO))}
    # Only pinned_host annotations count; the loop runs for i = 2, 3, 4: three times.
    assert set(found) == {"host", "top"}
    assert (found["host"].count, found["host"].bytes, found["host"].shape, found["host"].operand) == (3, 32, "f32[8]", "x")
    assert (found["top"].count, found["top"].bytes, found["top"].computation) == (1, 32, "e")


# -- verify on tiny llama (lowering only: no compile) -------------------------------------------------

@pytest.mark.slow
def test_planned_names_are_exactly_what_moves(tmp_path: Path) -> None:
    plan = make_plan((offload("query_proj", BSD), offload("key_proj", BSK)))
    code, out = invoke(tmp_path, plan)
    assert code == 0, out
    assert "OK: the policy offloads exactly the plan" in out
    code, out = invoke(tmp_path, plan, "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["problems"] == [] and data["unplanned"] == []
    got = {c["key"]: (c["status"], c["annotated_layers"], c["annotated_bytes"]) for c in data["checks"]}
    assert got == {"name:query_proj": ("ok", LAYERS, LAYERS * BSD), "name:key_proj": ("ok", LAYERS, LAYERS * BSK)}
    assert data["annotated_bytes"] == LAYERS * (BSD + BSK)
    # the memory model's second opinion (a tpu-v5e plan): a scan's offloads carry no warning; the only
    # note is that the tiny step peaks on libtpu's VMEM heap (tests/passes/test_preopt_accuracy.py checks
    # that note against libtpu's compiled module)
    assert data["modeled_peak_bytes"] > 0
    assert [w for w in data["warnings"] if not w.startswith(VMEM_NOTE)] == []
    assert "memory model (pre-optimization, TPU): peak" in invoke(tmp_path, plan)[1]


@pytest.mark.slow
def test_unrolled_layers_count_the_same() -> None:
    target = resolve(LLAMA, factory_kwargs={"scan_layers": False})
    result = verify(target, make_plan((offload("query_proj", BSD), offload("key_proj", BSK))))
    assert result.ok, result.problems
    # Unrolled: one annotation per layer, each once; under scan: one in the body, twice.
    assert sorted((a.shape, a.count) for a in result.annotations) == [("f32[2,32,32]", 1)] * 2 + [("f32[2,32,64]", 1)] * 2
    # ...but outside a loop libtpu copies each straight back: verify passes on it with a warning
    offload_warnings = [w for w in result.warnings if not w.startswith(VMEM_NOTE)]
    assert len(offload_warnings) == 1 and offload_warnings[0].startswith("4 value(s) offloaded outside a loop")


@pytest.mark.slow
def test_a_name_the_program_never_defines_is_reported(tmp_path: Path) -> None:
    kept = Decision(key="name:ctx", name="ctx", selector=Selector.by_name("ctx"), action="device",
                    bytes=BSD * LAYERS, layers=LAYERS)
    plan = make_plan((offload("query_proj", BSD), offload("q_proj", BSD), kept))
    code, out = invoke(tmp_path, plan)
    assert code == 1, out
    assert "name:ctx: plans device for checkpoint_name 'ctx', which the program does not define" in out
    assert "BAD checkpoint_name 'q_proj': 0/2 layer(s) offloaded" in out
    assert "no checkpoint_name 'q_proj' in the program (it defines: context, decoder_layer_input, key_proj," in out
    assert "ok  checkpoint_name 'query_proj': 2/2 layer(s) offloaded" in out
    assert "MISMATCH" in out


@pytest.mark.slow
def test_a_name_backward_never_reads_is_not_a_residual(tmp_path: Path) -> None:
    # mlpwo feeds the residual add only; the backward pass of the layer does not read it.
    code, out = invoke(tmp_path, make_plan((offload("mlpwo", BSD),)))
    assert code == 1
    assert "checkpoint_name 'mlpwo' is not a residual: the backward pass does not read it" in out


@pytest.mark.slow
def test_layer_count_and_shape_rule_mismatches(tmp_path: Path) -> None:
    code, out = invoke(tmp_path, make_plan((offload("query_proj", BSD, layers=3),)))
    assert code == 1 and "2 value(s) annotated, the plan counts 3 layer(s)" in out
    # A primitive rule sees shapes only: f32[2,32,32] dots are key_proj AND value_proj.
    rule = Decision(key="prim:dot_general@llama.py:136", name=None,
                    selector=Selector.by_primitive("dot_general", source="llama.py:136", shape="f32[2,32,32]"),
                    action="offload", bytes=LAYERS * BSK, layers=LAYERS)
    result = verify(LLAMA, make_plan((rule,)))
    assert not result.ok
    assert [(c.status, c.annotated_layers) for c in result.checks] == [("count-mismatch", 2 * LAYERS)]


def test_bad_targets_are_exit_2(tmp_path: Path) -> None:
    plan = make_plan((offload("query_proj", BSD),))
    code, out = invoke(tmp_path, plan, target=str(ROOT / "fixtures/hlo/zoo/llama.tpu.hlo"))
    assert code == 2 and "verify needs a JAX TARGET" in out
    code, out = invoke(tmp_path, plan, "--compile", "cpu")
    assert code == 2 and "expected a TPU" in out
    with pytest.raises(UserError, match="no such file"):
        verify("nope.py:make", plan)


# -- compiled through libtpu ------------------------------------------------------------------------

SNAPSHOT = json.loads((ROOT / "fixtures/hlo/zoo/llama.offload.tpu-v5e.json").read_text())


@pytest.mark.slow
@pytest.mark.tpu
def test_compiled_peak_is_xlas_and_checked_against_the_budget(tmp_path: Path) -> None:
    # The snapshot was compiled by libtpu with these names offloaded (fixtures/regen_snapshots.py).
    per_layer = {"query_proj": BSD, "key_proj": BSK, "value_proj": BSK, "context": BSD}
    decisions = tuple(offload(n, per_layer[n]) for n in SNAPSHOT["offloaded_names"])
    peak = SNAPSHOT["memory"]["peak_memory_in_bytes"]
    plan = make_plan(decisions, budget=Budget(spec="tight", bytes=peak - 1))
    code, out = invoke(tmp_path, plan, "--compile", "tpu-v5e", "--json")
    data = json.loads(out)
    assert data["memory"]["peak_memory_in_bytes"] == peak
    assert data["memory"]["host_temp_size_in_bytes"] == SNAPSHOT["memory"]["host_temp_size_in_bytes"] > 0
    assert all(c["status"] == "ok" for c in data["checks"])
    # Offloading is right, the budget is one byte short: exit 1.
    assert code == 1
    assert data["problems"] == [f"compiled peak {peak} bytes exceeds the budget tight ({peak - 1} bytes)"]
