"""The liveness graph: hand-written HLO in, buffers, intervals, bytes and edges out (hand-computed);
``hloopt graph`` writes GraphML / node-link JSON that networkx reads back as the same graph."""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import pytest
from click.testing import CliRunner

from hloopt.cli import cli
from hloopt.graph import liveness_graph
from hloopt.hlo.parser import parse_module

ROOT = Path(__file__).resolve().parents[1]

# A chain: each value is read only by the next one, so a and c are never live together.
#   step:   0  1  2  3  4
#   p       [============]   parameter: whole program
#   a          [==]          defined at 1, read by b at 2
#   b             [==]       read by c at 3
#   c                [==]    read by d at 4
#   d                   []   the output
CHAIN = """
HloModule chain
ENTRY e {
  p = f32[64] parameter(0)
  a = f32[64] negate(p)
  b = f32[8,64] broadcast(a), dimensions={1}
  c = f32[8,64] exponential(b)
  ROOT d = f32[1,64] slice(c), slice={[0:1], [0:64]}
}"""

# A host-memory parameter, a copy of it to the device, and a tuple of two outputs.
HOST = """
HloModule host
ENTRY e {
  h = f32[256]{0:S(5)} parameter(0)
  q = f32[256]{0} parameter(1)
  a = f32[256]{0} copy(h)
  b = f32[256]{0} add(a, q)
  ROOT t = (f32[256]{0}, f32[256]{0}) tuple(b, a)
}"""


def edges(g: nx.MultiDiGraph, kind: str) -> set[tuple[str, str]]:
    return {(u, v) for u, v, k in g.edges(keys=True) if k == kind}


def interfering(g: nx.MultiDiGraph) -> set[frozenset[str]]:
    return {frozenset((u, v)) for u, v in edges(g, "interference")}


def test_chain_buffers_intervals_and_bytes() -> None:
    # platform="cpu": a pre-optimization module analyzed as written (text order, every value a
    # buffer, exact sizes: f32[64] = 256 B, f32[8,64] = 2048 B)
    g = liveness_graph(parse_module(CHAIN), platform="cpu")
    assert isinstance(g, nx.MultiDiGraph)
    assert g.number_of_nodes() == 5
    got = {n: (d["bytes"], d["start"], d["end"]) for n, d in g.nodes(data=True)}
    assert got == {"p": (256, 0, 4), "a": (256, 1, 2), "b": (2048, 2, 3), "c": (2048, 3, 4), "d": (256, 4, 4)}
    assert {n: d["category"] for n, d in g.nodes(data=True)} == {
        "p": "parameters", "a": "temporaries", "b": "temporaries", "c": "temporaries", "d": "outputs"}
    b = g.nodes["b"]
    assert (b["instruction"], b["opcode"], b["shape"], b["index"]) == ("b", "broadcast", "f32[8,64]", "")
    assert (b["parameter"], b["output"], b["memory_space"]) == (-1, False, 0)
    assert g.nodes["p"]["parameter"] == 0 and g.nodes["d"]["output"]
    # an HLO module: no residual (no loss), names unknown, no metadata
    assert not any(d["residual"] or d["checkpoint_name"] or d["source"] for _, d in g.nodes(data=True))
    assert g.graph["num_steps"] == 5 and g.graph["kind"] == "unoptimized"
    # the peak is at step 3: p + b + c (b is read there, c written) = 256 + 2048 + 2048
    assert (g.graph["peak_bytes"], g.graph["peak_step"]) == (4352, 3)


def test_chain_data_edges_and_interference() -> None:
    g = liveness_graph(parse_module(CHAIN), platform="cpu")
    assert edges(g, "data") == {("p", "a"), ("a", "b"), ("b", "c"), ("c", "d")}
    assert g.edges["a", "b", "data"]["step"] == 2
    # overlapping closed intervals: the parameter with everything, each value with its reader
    assert interfering(g) == {frozenset(x) for x in [("p", "a"), ("p", "b"), ("p", "c"), ("p", "d"),
                                                     ("a", "b"), ("b", "c"), ("c", "d")]}
    for far in [("a", "c"), ("a", "d"), ("b", "d")]:
        assert frozenset(far) not in interfering(g)
    # one edge per pair, from the buffer that starts first
    for u, v in edges(g, "interference"):
        assert g.nodes[u]["start"] <= g.nodes[v]["start"]
    assert all(d["kind"] == k for _, _, k, d in g.edges(keys=True, data=True))


def test_interference_can_be_left_out() -> None:
    g = liveness_graph(parse_module(CHAIN), platform="cpu", interference=False)
    assert edges(g, "interference") == set() and len(edges(g, "data")) == 4


def test_memory_spaces_do_not_interfere_and_tuples_forward() -> None:
    g = liveness_graph(parse_module(HOST), platform="cpu")
    got = {n: (d["bytes"], d["start"], d["end"], d["memory_space"]) for n, d in g.nodes(data=True)}
    # the root tuple's index table: 2 pointers of 8 bytes; outputs live to the end
    assert got == {"h": (1024, 0, 4, 5), "q": (1024, 0, 4, 0), "a": (1024, 2, 4, 0), "b": (1024, 3, 4, 0),
                   "t": (16, 4, 4, 0)}
    assert g.nodes["t"]["tuple_table"] and not g.nodes["a"]["tuple_table"]
    # the host parameter is live throughout but shares no memory with the device buffers
    assert not any("h" in pair for pair in interfering(g))
    assert frozenset(("q", "a")) in interfering(g) and frozenset(("q", "t")) in interfering(g)
    # the tuple forwards b and a: it reads no data
    assert edges(g, "data") == {("h", "a"), ("a", "b"), ("q", "b")}


# A loop whose state is a counter and an f32[16] rewritten each iteration through an f32[1024]
# temporary; the undonated parameter p and the constant z are copied into the state.
WHILE = """
HloModule loop
body {
  s = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = f32[16] get-tuple-element(s), index=1
  big = f32[1024] broadcast(x), dimensions={}
  r = f32[16] slice(big), slice={[0:16]}
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  ROOT t = (s32[], f32[16]) tuple(i2, r)
}
cond {
  s = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}
ENTRY e {
  p = f32[16] parameter(0)
  z = s32[] constant(0)
  init = (s32[], f32[16]) tuple(z, p)
  w = (s32[], f32[16]) while(init), condition=cond, body=body
  ROOT out = f32[16] get-tuple-element(w), index=1
}"""


def test_loop_state_copies_and_body_reads() -> None:
    g = liveness_graph(parse_module(WHILE), platform="cpu")
    # flat schedule: p z init | cond: s i n lt | body: s i x big r one i2 t | w out
    assert g.graph["num_steps"] == 17
    assert (g.nodes["big"]["bytes"], g.nodes["big"]["computation"]) == (4096, "body")
    assert (g.nodes["big"]["start"], g.nodes["big"]["end"]) == (10, 11)
    assert (g.nodes["w{1}"]["bytes"], g.nodes["w{1}"]["start"], g.nodes["w{1}"]["end"]) == (64, 3, 16)
    # p and z are copied into the state before the loop's first step; the body reads the state
    # (through the parameter's get-tuple-element) and writes its results into it in place
    assert edges(g, "data") == {("p", "w{1}"), ("z", "w{0}"), ("w{1}", "big"), ("big", "w{1}"),
                                ("one", "w{0}"), ("w{0}", "lt"), ("n", "lt")}
    assert g.edges["p", "w{1}", "data"]["step"] == 3
    # the body's temporary and the condition's result are never live together
    assert frozenset(("big", "lt")) not in interfering(g)
    assert frozenset(("big", "w{1}")) in interfering(g)


def test_interference_is_every_overlapping_pair_in_one_memory_space() -> None:
    # the sweep against all pairs, on the zoo gpt2 step as libtpu would see it
    g = liveness_graph(str(ROOT / "fixtures/hlo/zoo/gpt2.tpu.hlo"))
    nodes = list(g.nodes(data=True))
    want = {frozenset((a, b)) for i, (a, da) in enumerate(nodes) for b, db in nodes[i + 1:]
            if da["memory_space"] == db["memory_space"] and da["start"] <= db["end"] and db["start"] <= da["end"]}
    assert interfering(g) == want
    assert len(edges(g, "interference")) == len(want)  # one edge per pair


def test_tpu_prediction_readers_of_fused_values_read_their_inputs() -> None:
    # platform="tpu": XLA fuses the negate and the broadcast into the exponential that reads them
    # (hloopt.passes.tpu); the fused values hold no buffer, and the exponential reads p.
    # TPU tiles: f32[64] pads to 128 elements (512 B), f32[8,64] to (8, 128) (4096 B).
    g = liveness_graph(parse_module(CHAIN), platform="tpu")
    assert set(g.nodes) == {"p", "c", "d"}
    assert (g.nodes["p"]["bytes"], g.nodes["c"]["bytes"]) == (512, 4096)
    assert edges(g, "data") == {("p", "c"), ("c", "d")}
    assert g.graph["kind"] == "tpu-predicted"
    # libtpu's accounting gives outputs their allocation for the whole program
    assert (g.nodes["d"]["counted_start"], g.nodes["d"]["counted_end"]) == (0, 4)
    assert (g.nodes["d"]["start"], g.nodes["d"]["end"]) == (4, 4)


def test_source_lines_are_relative_to_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "model" / "step.py"
    text = CHAIN.replace("negate(p)", f'negate(p), metadata={{op_name="jit(f)/neg" source_file="{src}" source_line=7}}')
    monkeypatch.chdir(tmp_path)
    g = liveness_graph(parse_module(text), platform="cpu")
    assert g.nodes["a"]["source"] == "model/step.py:7"
    assert g.nodes["a"]["op_name"] == "jit(f)/neg"


def test_residuals_of_a_training_step_are_marked() -> None:
    # the zoo mlp's pre-optimization HLO, analyzed as written: the forward values its backward
    # pass reads (softmax's exp, the relu's result, ...) are residuals; an HLO file has no names
    from hloopt.passes.residuals import find_residuals

    path = ROOT / "fixtures/hlo/zoo/mlp.tpu.hlo"
    g = liveness_graph(str(path), platform="cpu", interference=False)
    marked = {n for n, d in g.nodes(data=True) if d["residual"]}
    assert {"exp.1", "abs.1"} <= marked
    assert all(g.nodes[n]["checkpoint_name"] is None for n in marked)
    # no more marked buffers than residuals the residual analysis lists (two calls of one
    # callee share its root's buffer)
    rs = find_residuals(parse_module(path.read_text()))
    assert len(marked) <= len(rs)
    # JAX's metadata agrees: a forward (jvp) value marked is read by a backward (transpose) step
    forward = [n for n in marked if "jvp(" in g.nodes[n]["op_name"]]
    assert forward
    for n in forward:
        assert any("transpose(" in g.nodes[s]["op_name"] for s in g.successors(n)), n
    # a parameter is never a residual (the backward pass reads it, but it is not a forward value)
    assert not any(g.nodes[n]["parameter"] >= 0 for n in marked)


# -- the command ---------------------------------------------------------------------------------

def run(*argv: str) -> object:
    return CliRunner().invoke(cli, list(argv))


def same_graph(a: nx.MultiDiGraph, b: nx.MultiDiGraph) -> None:
    assert sorted(a.nodes) == sorted(b.nodes)
    assert sorted(a.edges(keys=True)) == sorted(b.edges(keys=True))


@pytest.fixture()
def hlo(tmp_path: Path) -> Path:
    path = tmp_path / "chain.hlo"
    path.write_text(CHAIN)
    return path


def test_cli_graphml_reads_back_as_the_same_graph(hlo: Path, tmp_path: Path) -> None:
    out = tmp_path / "g.graphml"
    r = run("graph", str(hlo), "--platform", "cpu", "--format", "graphml", "-o", str(out))
    assert r.exit_code == 0, r.output
    back = nx.read_graphml(out)
    g = liveness_graph(str(hlo), platform="cpu")
    same_graph(back, g)
    assert back.is_directed() and back.is_multigraph()
    # scalars survive; None is written as ""
    assert {n: (d["bytes"], d["start"], d["end"]) for n, d in back.nodes(data=True)} == \
        {n: (d["bytes"], d["start"], d["end"]) for n, d in g.nodes(data=True)}
    assert back.nodes["a"]["checkpoint_name"] == "" and back.nodes["d"]["output"] is True
    assert back.graph["peak_bytes"] == 4352
    # written again over its own file: hloopt recognizes it, same bytes (sorted, deterministic)
    first = out.read_bytes()
    assert run("graph", str(hlo), "--platform", "cpu", "-o", str(out)).exit_code == 0
    assert out.read_bytes() == first


def test_cli_json_reads_back_as_the_same_graph(hlo: Path) -> None:
    r = run("graph", str(hlo), "--platform", "cpu", "--format", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    back = nx.node_link_graph(data, edges="edges")
    g = liveness_graph(str(hlo), platform="cpu")
    same_graph(back, g)
    assert dict(back.nodes(data=True)) == dict(g.nodes(data=True))
    assert [n["id"] for n in data["nodes"]] == sorted(g.nodes)
    assert run("graph", str(hlo), "--platform", "cpu", "--format", "json").stdout == r.stdout


def test_cli_no_interference(hlo: Path) -> None:
    r = run("graph", str(hlo), "--platform", "cpu", "--format", "json", "--no-interference")
    assert {e["key"] for e in json.loads(r.stdout)["edges"]} == {"data"}


def test_cli_bad_format_is_one_line_exit_2(hlo: Path) -> None:
    r = run("graph", str(hlo), "--format", "dot")
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hloopt: error: ") and "'dot'" in lines[0]


def test_cli_refuses_a_file_it_did_not_write(hlo: Path, tmp_path: Path) -> None:
    mine = tmp_path / "notes.graphml"
    mine.write_text("my notes\n")
    r = run("graph", str(hlo), "-o", str(mine))
    assert r.exit_code == 2 and "exists: pass --force" in r.stderr
    assert mine.read_text() == "my notes\n"


def test_liveness_graph_is_exported_lazily() -> None:
    import hloopt

    assert hloopt.liveness_graph is liveness_graph


@pytest.mark.slow
@pytest.mark.tpu
def test_jax_target_residuals_carry_their_checkpoint_names() -> None:
    # gpt2 tiny (lowered for TPU): the residuals that checkpoint_name selects carry the name, and
    # JAX itself saves a value of that name with the node's dtype and dims when asked to
    import jax

    from hloopt.naming import jax_saved_residuals
    from hloopt.targets import resolve

    target = str(ROOT / "fixtures/zoo/gpt2.py:tiny")
    g = liveness_graph(target, interference=False)
    named = {n: d for n, d in g.nodes(data=True) if d["checkpoint_name"]}
    assert named and all(d["residual"] for d in named.values())
    names = sorted({d["checkpoint_name"] for d in named.values()})
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    saved = jax_saved_residuals(resolve(target, factory_kwargs={"policy": policy}))
    hlo_type = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    jax_shapes = {(desc.split("'")[1], f"{hlo_type[str(a.dtype)]}[{','.join(map(str, a.shape))}]")
                  for a, desc in saved if desc.startswith("named '")}
    for n, d in named.items():
        assert (d["checkpoint_name"], d["shape"].split("{")[0]) in jax_shapes, (n, d["shape"], jax_shapes)
