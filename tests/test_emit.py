"""Emitters: the JAX policy and its pasteable snippet, the MaxText yml, annotated HLO; names of any text."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.ad_checkpoint import Offloadable, Recompute, Saveable, checkpoint_name

import hloopt
from hloopt import emit
from hloopt.cli import cli
from hloopt.errors import UserError
from hloopt.hlo.parser import parse_module
from hloopt.ir import unquote
from hloopt.lowering import lower
from hloopt.plan import Decision, Plan, Selector
from hloopt.targets import resolve
from hloopt.verify import offload_annotations
from tests.test_plan import make_plan, named

ROOT = Path(__file__).resolve().parent.parent
LLAMA = "fixtures/zoo/llama.py:tiny"

#: the primitive checkpoint_name binds, found the public way
NAME_P = jax.make_jaxpr(lambda x: checkpoint_name(x, "n"))(1.0).eqns[0].primitive
DOT_P = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[0].primitive


def program(hlo_text: str) -> str:
    """The computations of a lowered module without debug info (which names the calling file)."""
    lines = [line for line in hlo_text.splitlines()
             if line not in ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
             and not re.match(r"^\d+ ", line)]
    return re.sub(r", metadata=\{[^{}]*\}", "", "\n".join(lines))


def run_snippet(text: str) -> object:
    ns: dict[str, object] = {}
    exec(compile(text, "<snippet>", "exec"), ns)
    return ns["policy"]


def answer(pol: object, name: str) -> object:
    return pol(NAME_P, jax.core.ShapedArray((2,), jnp.float32), name=name)  # type: ignore[operator]


def kind(x: object) -> str:
    if x is Saveable or x is True:
        return "device"
    if isinstance(x, Offloadable):
        assert (x.src, x.dst) == ("device", "pinned_host")
        return "offload"
    assert x is Recompute or x is False
    return "remat"


QK = make_plan((named("query_proj"), named("key_proj"), named("context", "device"), named("mlpwi_0", "remat")))


def test_name_only_plan_is_jaxs_own_policy_and_the_snippet_matches() -> None:
    pol = hloopt.policy(QK)
    assert pol.__qualname__.startswith("save_and_offload_only_these_names")
    snip = run_snippet(emit.python_snippet(QK))
    for name, want in [("query_proj", "offload"), ("key_proj", "offload"), ("context", "device"),
                       ("mlpwi_0", "remat"), ("out_proj", "remat"), ("", "remat")]:
        assert kind(answer(pol, name)) == want
        assert kind(answer(snip, name)) == want
    # Values that are not checkpoint names are recomputed.
    a = jax.core.ShapedArray((2, 3), jnp.float32)
    b = jax.core.ShapedArray((3, 4), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    params = dict(dimension_numbers=dims, precision=None, preferred_element_type=None, out_sharding=None)
    assert kind(pol(DOT_P, a, b, **params)) == kind(snip(DOT_P, a, b, **params)) == "remat"


@pytest.mark.parametrize("name", ["dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable"])
def test_a_builtin_plan_is_jaxs_own_policy_and_the_snippet_names_it(name: str) -> None:
    plan = make_plan((named("context", "device"), named("query_proj", "remat")), builtin=name)
    assert hloopt.policy(plan) is getattr(jax.checkpoint_policies, name)
    assert run_snippet(emit.python_snippet(plan)) is getattr(jax.checkpoint_policies, name)


def test_an_offloading_builtin_plan_is_jaxs_policy_called_with_its_memory_kinds(tmp_path: Path) -> None:
    """A plan that is ``offload_dot_with_no_batch_dims`` (its decisions: the built-in's replay,
    offloads among them) round-trips through its file, and its policy and snippet offload a dot
    without batch dimensions to pinned_host, as JAX's own does, and recompute a batched one."""
    plan = make_plan((named("mlpwi_0", "offload"), named("query_proj", "remat")),
                     builtin="offload_dot_with_no_batch_dims")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    ours, snip = hloopt.policy(str(path)), run_snippet(emit.python_snippet(plan))
    jaxs = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    a = jax.core.ShapedArray((2, 3), jnp.float32)
    b = jax.core.ShapedArray((3, 4), jnp.float32)
    plain = dict(dimension_numbers=(((1,), (0,)), ((), ())), precision=None, preferred_element_type=None,
                 out_sharding=None)
    a3, b3 = jax.core.ShapedArray((5, 2, 3), jnp.float32), jax.core.ShapedArray((5, 3, 4), jnp.float32)
    batched = dict(plain, dimension_numbers=(((2,), (1,)), ((0,), (0,))))
    for pol in (ours, snip):
        assert kind(pol(DOT_P, a, b, **plain)) == kind(jaxs(DOT_P, a, b, **plain)) == "offload"
        assert kind(pol(DOT_P, a3, b3, **batched)) == kind(jaxs(DOT_P, a3, b3, **batched)) == "remat"


def test_policy_accepts_a_plan_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    QK.save(path)
    assert kind(answer(hloopt.policy(str(path)), "key_proj")) == "offload"


PRIM = make_plan((
    named("query_proj"),
    Decision(key="prim:dot_general@llama.py:137", name=None,
             selector=Selector.by_primitive("dot_general", source="llama.py:137", shape="f32[2,4]{1,0}"),
             action="offload", bytes=32, layers=1, shape="f32[2,4]"),
    Decision(key="prim:dot_general", name=None, selector=Selector.by_primitive("dot_general"),
             action="device", bytes=0, layers=1),
))


def test_primitive_rules_match_primitive_and_output_shape() -> None:
    pol = hloopt.policy(PRIM)
    assert isinstance(pol, emit.PlanPolicy)
    snip = run_snippet(emit.python_snippet(PRIM))
    dims = (((1,), (0,)), ((), ()))
    params = dict(dimension_numbers=dims, precision=None, preferred_element_type=None, out_sharding=None)
    f32 = jnp.float32
    # [2,3] @ [3,4] -> f32[2,4]: the shape rule; [2,3] @ [3,5] -> f32[2,5]: the catch-all rule.
    cases = [((2, 3), (3, 4), f32, "offload"), ((2, 3), (3, 5), f32, "device"),
             ((2, 3), (3, 4), jnp.bfloat16, "device")]
    for lhs, rhs, dt, want in cases:
        avals = (jax.core.ShapedArray(lhs, dt), jax.core.ShapedArray(rhs, dt))
        assert kind(pol(DOT_P, *avals, **params)) == want
        assert kind(snip(DOT_P, *avals, **params)) == want
    assert kind(answer(pol, "query_proj")) == kind(answer(snip, "query_proj")) == "offload"
    hash(pol)  # jax keys caches on the policy


def test_a_value_outside_checkpoints_does_not_shadow_a_rule_of_its_primitive_and_shape() -> None:
    # a plan of a step with a dot outside any jax.checkpoint (kept on device: no policy is asked
    # about it) and dots of the same output shape inside one, which the plan recomputes: the
    # policy recomputes f32[2,4] dots whichever decision the plan lists first, once per rule
    outside = Decision(key="prim:dot_general@loss.py:3", name=None, action="device", bytes=0, layers=1,
                       selector=Selector.by_primitive("dot_general", source="loss.py:3", shape="f32[2,4]"))
    inside = Decision(key="prim:dot_general:f32[2,4]@model.py:9", name=None, action="remat", bytes=32, layers=2,
                      selector=Selector.by_primitive("dot_general", source="model.py:9", shape="f32[2,4]"))
    dims = (((1,), (0,)), ((), ()))
    params = dict(dimension_numbers=dims, precision=None, preferred_element_type=None, out_sharding=None)
    avals = (jax.core.ShapedArray((2, 3), jnp.float32), jax.core.ShapedArray((3, 4), jnp.float32))
    another = dataclasses.replace(outside, key="prim:dot_general@loss.py:5",
                                  selector=dataclasses.replace(outside.selector, source="loss.py:5"))
    for order in ((outside, inside), (inside, outside), (outside, inside, another)):
        plan = make_plan(order)
        assert emit._primitive_rules(plan.decisions) == (("dot_general", "f32[2,4]", "remat"),)
        for pol in (hloopt.policy(plan), run_snippet(emit.python_snippet(plan))):
            assert kind(pol(DOT_P, *avals, **params)) == "remat"


@pytest.mark.slow
def test_lowered_llama_offloads_what_jax_offloads_for_the_names() -> None:
    target = resolve(LLAMA)
    stock = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["context"], names_which_can_be_offloaded=["query_proj", "key_proj"],
        offload_src="device", offload_dst="pinned_host")
    want = lower(target, policy=stock).hlo_text
    ours = lower(target, policy=hloopt.policy(QK)).hlo_text
    pasted = lower(target, policy=run_snippet(emit.python_snippet(QK))).hlo_text
    assert program(ours) == program(want) == program(pasted)
    # JAX's own count: one device_put to host per offloaded name in the scanned layer body.
    host_puts = re.findall(r'_xla_buffer_placement="pinned_host"', want)
    assert len(host_puts) == 2
    shapes = sorted(a.shape for a in offload_annotations(ours))
    # query_proj: [batch, seq, n_heads*head_dim] = [2,32,64]; key_proj: [2,32,n_kv_heads*head_dim] = [2,32,32]
    assert shapes == ["f32[2,32,32]", "f32[2,32,64]"]


@pytest.mark.slow
def test_primitive_policy_and_its_snippet_lower_alike() -> None:
    target = resolve(LLAMA)
    plan = make_plan((Decision(key="prim:dot_general", name=None,
                               selector=Selector.by_primitive("dot_general", shape="f32[2,32,32]"),
                               action="offload", bytes=0, layers=2),))
    ours = lower(target, policy=hloopt.policy(plan)).hlo_text
    assert program(ours) == program(lower(target, policy=run_snippet(emit.python_snippet(plan))).hlo_text)
    # key_proj and value_proj are the layer's dot_generals with a [2,32,32] output (2 KV heads x 16).
    assert [a.shape for a in offload_annotations(ours)] == ["f32[2,32,32]", "f32[2,32,32]"]


NASTY = ['a"b', "a'b", 'x\\y', "line\nbreak", '"""', "'''", "é ü 中文 😀", "key: value", "# hash", "- dash",
         "? q", "{flow}", "[list]", "&anchor", "*alias", "!tag", "%pct", "@at", "`tick`", "yes", "null", "1e3",
         " lead", "trail ", "\t", "\x00", "\u2028", "\udc80"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(NASTY), st.text(min_size=1)), min_size=1, max_size=5, unique=True),
       st.text())
def test_any_names_survive_the_python_snippet(names: list[str], target: str) -> None:
    decisions = tuple(Decision(key=f"k{i}", name=n, selector=Selector.by_name(n),
                               action="offload" if i % 2 == 0 else "device", bytes=1, layers=1, shape="f32[1]")
                      for i, n in enumerate(names))
    plan = make_plan(decisions, target=target)
    text = emit.python_snippet(plan)
    compile(text, "<snippet>", "exec")
    pol = run_snippet(text)
    for i, n in enumerate(names):
        assert kind(answer(pol, n)) == ("offload" if i % 2 == 0 else "device")
    assert kind(answer(pol, "\x01not-planned")) == "remat"


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(NASTY), st.text(min_size=1)), min_size=1, max_size=5, unique=True),
       st.text(), st.sampled_from(["device", "offload", "remat"]))
def test_any_names_survive_the_primitive_snippet(names: list[str], source: str, action: str) -> None:
    decisions = tuple(Decision(key=f"k{i}", name=n, selector=Selector.by_name(n), action="offload",
                               bytes=1, layers=1) for i, n in enumerate(names))
    decisions += (Decision(key="p", name=None, selector=Selector.by_primitive("dot_general", source=source),
                           action=action, bytes=1, layers=1),)
    text = emit.python_snippet(make_plan(decisions))
    pol = run_snippet(text)
    for n in names:
        assert kind(answer(pol, n)) == "offload"
    a = jax.core.ShapedArray((2, 3), jnp.float32)
    b = jax.core.ShapedArray((3, 4), jnp.float32)
    params = dict(dimension_numbers=(((1,), (0,)), ((), ())), precision=None, preferred_element_type=None,
                  out_sharding=None)
    assert kind(pol(DOT_P, a, b, **params)) == action


# -- MaxText ---------------------------------------------------------------------------------------

def test_maxtext_yaml_sets_every_maxtext_key() -> None:
    text = emit.maxtext_yaml(QK)
    data = yaml.safe_load(text)
    # every key of MaxText 0.2.5's custom policy, in base.yml's order (checked against MaxText
    # itself in test_thirdparty_maxtext.py)
    assert data == {
        "remat_policy": "custom", "decoder_layer_input": "device", "indexer_cutoff_threshold": "remat",
        "context": "device", "mlpwi": "remat", "mlpwi_0": "remat", "mlpwi_1": "remat", "mlpwo": "remat",
        "moe_mlpwi_0": "remat", "moe_mlpwi_1": "remat", "moe_mlpwo": "remat", "moe_x_sorted": "remat",
        "moe_routing_maps": "remat", "query_proj": "offload", "key_proj": "offload", "value_proj": "remat",
        "kv_proj": "remat", "qkv_proj": "remat", "out_proj": "remat", "query_wa_proj": "remat",
        "kv_wa_proj": "remat", "mla_q": "remat", "mla_kv": "remat", "attention_out": "remat",
    }
    assert list(data) == ["remat_policy", *emit.MAXTEXT_NAMES]
    assert text.startswith("# Generated by hloopt")


def test_maxtext_refuses_what_it_cannot_express() -> None:
    plan = make_plan((named("query_proj"), named("my_attn_out")))
    with pytest.raises(UserError, match=r"^1 decision\(s\) cannot be written as a MaxText remat_policy .*"
                                        r"offload checkpoint_name 'my_attn_out'; use --format python$"):
        emit.maxtext_yaml(plan)
    # A name MaxText does not know that the plan recomputes is what MaxText does anyway.
    assert yaml.safe_load(emit.maxtext_yaml(make_plan((named("my_attn_out", "remat"),))))["remat_policy"] == "custom"


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(NASTY), st.text(min_size=1)), min_size=1, max_size=5, unique=True),
       st.text(), st.text())
def test_any_text_round_trips_through_the_maxtext_yaml(names: list[str], target: str, spec: str) -> None:
    from hloopt.plan import Budget

    names = [n for n in names if n not in emit.MAXTEXT_NAMES]
    decisions = tuple(Decision(key=n, name=n, selector=Selector.by_name(n), action="offload", bytes=1, layers=1,
                               shape=n) for n in names) + (named("key_proj"),)
    plan = make_plan(decisions, target=target, budget=Budget(spec=spec, bytes=1))
    text = emit.maxtext_yaml(plan, strict=False)
    data = yaml.safe_load(text)
    assert set(data) == {"remat_policy", *emit.MAXTEXT_NAMES}
    assert data["key_proj"] == "offload" and data["query_proj"] == "remat"
    left_out = [json.loads(line.split("left out: offload ", 1)[1])
                for line in text.splitlines() if "NOT EXPRESSIBLE" in line]
    assert left_out == names


# -- annotated HLO ---------------------------------------------------------------------------------

LLAMA_HLO = ROOT / "fixtures/hlo/zoo/llama.tpu.hlo"


def test_annotated_hlo_reparses_with_exactly_the_planned_annotations() -> None:
    text = LLAMA_HLO.read_text()
    mod = parse_module(text)
    body = mod.computations["closed_call.14"]
    dots = [i.name for i in body.instructions if i.opcode == "dot"]
    odd = 'k"ey\n\\'
    plan = make_plan((
        Decision(key="name:query_proj", name="query_proj", selector=Selector.by_name("query_proj"),
                 action="offload", bytes=1, layers=2, values=(dots[0],)),
        Decision(key=odd, name=odd, selector=Selector.by_name(odd), action="offload", bytes=1, layers=2,
                 values=(dots[1], dots[2])),
        Decision(key="name:context", name="context", selector=Selector.by_name("context"), action="device",
                 bytes=1, layers=2, values=(dots[3],)),
    ))
    before = {d: [u.name for u in body.by_name[d].users] for d in dots[:3]}
    out = emit.annotate_hlo(text, plan)
    again = parse_module(out)
    found = offload_annotations(again)
    assert sorted(a.operand for a in found) == sorted(dots[:3])
    assert all(a.computation == "closed_call.14" for a in found)
    by_operand = {a.operand: again.computations["closed_call.14"].by_name[a.instruction] for a in found}
    for d, users in before.items():
        ann = by_operand[d]
        assert [u.name for u in ann.users] == users
        assert [u.name for u in again.computations["closed_call.14"].by_name[d].users] == [ann.name]
    assert {unquote(re.search(r'op_name=("(?:[^"\\]|\\.)*")', str(by_operand[d].attrs["metadata"])).group(1))
            for d in dots[1:3]} == {f"hloopt/offload/{odd}"}
    # Nothing else changed: the module had no annotations, and gains exactly three instructions.
    assert offload_annotations(mod) == []
    assert again.num_instructions == mod.num_instructions + 3
    assert emit.annotate_hlo(mod, plan) == out  # a Module works too, and is not modified
    assert offload_annotations(mod) == []


def test_annotating_a_root_makes_the_annotation_the_root() -> None:
    text = "HloModule m\n\nENTRY e {\n  p = f32[4]{0} parameter(0)\n  ROOT n = f32[4]{0} negate(p)\n}\n"
    plan = make_plan((Decision(key="k", name="k", selector=Selector.by_name("k"), action="offload", bytes=16,
                               layers=1, values=("n",)),))
    mod = parse_module(emit.annotate_hlo(text, plan))
    assert mod.entry.root.name == "n.offload"
    assert mod.entry.root.operands[0].name == "n"


def test_annotating_needs_known_values() -> None:
    text = LLAMA_HLO.read_text()
    with pytest.raises(UserError, match="does not say which HLO values it offloads"):
        emit.annotate_hlo(text, QK)
    plan = make_plan((Decision(key="k", name="k", selector=Selector.by_name("k"), action="offload", bytes=1,
                               layers=1, values=("no_such.1",)),))
    with pytest.raises(UserError, match="names HLO value 'no_such.1', which module"):
        emit.annotate_hlo(text, plan)


# -- CLI -------------------------------------------------------------------------------------------

def test_cli_emit_formats(tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    QK.save(plan_path)
    runner = CliRunner()
    r = runner.invoke(cli, ["emit", str(plan_path), "--format", "json"])
    assert r.exit_code == 0 and r.output == QK.to_json()
    r = runner.invoke(cli, ["emit", str(plan_path), "--format", "maxtext"])
    assert r.exit_code == 0 and yaml.safe_load(r.output)["query_proj"] == "offload"
    out = tmp_path / "policy.py"
    r = runner.invoke(cli, ["emit", str(plan_path), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert kind(answer(run_snippet(out.read_text()), "key_proj")) == "offload"
    r = runner.invoke(cli, ["emit", str(plan_path), "-o", str(out)])  # ours: replaced without --force
    assert r.exit_code == 0


def test_cli_emit_refuses_to_overwrite_a_user_file(tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    QK.save(plan_path)
    mine = tmp_path / "train.py"
    mine.write_text("print('mine')\n")
    r = CliRunner().invoke(cli, ["emit", str(plan_path), "-o", str(mine)])
    assert r.exit_code == 2
    assert f"{mine} exists: pass --force to overwrite" in r.output
    assert mine.read_text() == "print('mine')\n"
    r = CliRunner().invoke(cli, ["emit", str(plan_path), "-o", str(mine), "--force"])
    assert r.exit_code == 0 and "save_and_offload_only_these_names" in mine.read_text()


def test_cli_emit_maxtext_strict_and_hlo(tmp_path: Path) -> None:
    plan = make_plan((named("custom_name"),))
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    r = CliRunner().invoke(cli, ["emit", str(plan_path), "--format", "maxtext"])
    assert r.exit_code == 2 and "cannot be written as a MaxText remat_policy" in r.output
    r = CliRunner().invoke(cli, ["emit", str(plan_path), "--format", "maxtext", "--lenient"])
    assert r.exit_code == 0 and "NOT EXPRESSIBLE" in r.output
    body = parse_module(LLAMA_HLO.read_text()).computations["closed_call.14"]
    dot = next(i.name for i in body.instructions if i.opcode == "dot")
    make_plan((Decision(key="k", name="k", selector=Selector.by_name("k"), action="offload", bytes=1, layers=2,
                        values=(dot,)),)).save(plan_path)
    r = CliRunner().invoke(cli, ["emit", str(plan_path), "--format", "hlo", "--hlo", str(LLAMA_HLO)])
    assert r.exit_code == 0, r.output
    assert [a.operand for a in offload_annotations(r.output)] == [dot]
