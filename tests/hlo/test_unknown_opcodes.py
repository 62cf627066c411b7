"""Opcodes hloopt does not know are read, flagged and analyzed as values of their shape.

Truth: libtpu's own module of a training step with Philox dropout (``mulhi``, recorded by
fixtures/record_dropout.py) and its ``memory_analysis()``; hand-computed bytes for small modules;
XLA's parser (jaxlib's ``hlo_module_from_text``) for which names XLA itself reads.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from hloopt.analysis import analyze
from hloopt.cli import cli
from hloopt.hlo.parser import parse_module
from hloopt.hlo.printer import print_module
from hloopt.passes.cost import CostAnalysis

DROPOUT = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "dropout"

MULHI = """HloModule unknown_ops, entry_computation_layout={(u32[1024]{0}, u32[1024]{0})->u32[1024]{0}}

ENTRY main {
  a = u32[1024]{0} parameter(0)
  b = u32[1024]{0} parameter(1)
  hi = u32[1024]{0} mulhi(a, b)
  hi2 = u32[1024]{0} mulhi(hi, b)
  ROOT r = u32[1024]{0} add(hi2, hi)
}
"""


def _dropout_text() -> str:
    return gzip.decompress((DROPOUT / "mlp_dropout.tpu-v5e.hlo.gz").read_bytes()).decode()


def _dropout_memory() -> dict[str, int]:
    return json.loads((DROPOUT / "mlp_dropout.tpu-v5e.json").read_text())["memory"]  # type: ignore[no-any-return]


def test_xla_reads_mulhi_but_not_a_made_up_name() -> None:
    """The premise: XLA's parser knows ``mulhi`` (hloopt's table does not); ``le`` is no opcode."""
    from jax._src.lib import xla_client as xc

    xc.hlo.hlo_module_from_text(MULHI)
    with pytest.raises(Exception, match="Unknown opcode: le"):
        xc.hlo.hlo_module_from_text(MULHI.replace("mulhi(", "le("))


def test_libtpu_dropout_module_parses_with_mulhi_flagged() -> None:
    text = _dropout_text()
    mod = parse_module(text, filename="mlp_dropout.tpu-v5e.hlo")
    n_mulhi = len(re.findall(r" mulhi\(", text))
    assert n_mulhi > 0
    assert mod.unknown_opcodes == {"mulhi": n_mulhi}
    flagged = [i for i in mod.instructions() if i.is_unknown]
    assert len(flagged) == n_mulhi and all(i.opcode == "mulhi" for i in flagged)
    # each keeps its shape and both operands
    assert all(len(i.operands) == 2 and i.shape.element_type == "u32" for i in flagged)
    # and prints back to a fixed point
    printed = print_module(mod)
    again = parse_module(printed)
    assert print_module(again) == printed and again.unknown_opcodes == mod.unknown_opcodes


def test_libtpu_dropout_peak_within_half_a_percent() -> None:
    xla = _dropout_memory()
    report = analyze(parse_module(_dropout_text()), xla=xla)
    p = report.profile
    assert p.argument_bytes == xla["argument_size_in_bytes"]
    assert abs(p.output_bytes - xla["output_size_in_bytes"]) <= 512
    assert report.peak_bytes == pytest.approx(xla["peak_memory_in_bytes"], rel=0.005)


def test_unknown_values_are_live_like_any_other() -> None:
    """Hand-computed: at ``r`` a, b, hi, hi2 and r are live, 5 x 4 KiB."""
    report = analyze(parse_module(MULHI))
    assert report.profile.argument_bytes == 2 * 4096 and report.profile.output_bytes == 4096
    assert report.peak_bytes == 5 * 4096


def test_unknown_tuple_result_and_attributes() -> None:
    """A made-up tuple-shaped op with a made-up attribute: its leaves are buffers. Hand-computed
    peak at ``t``: a, b, hi (4 KiB each), t's two leaves (4 + 8 KiB) and its 2-pointer table."""
    text = MULHI.replace("hi2 = u32[1024]{0} mulhi(hi, b)",
                         "t = (u32[1024]{0}, u32[2048]{0}) frob(hi, b), foo={1,2}\n"
                         "  hi2 = u32[1024]{0} get-tuple-element(t), index=0")
    mod = parse_module(text)
    t = mod.entry["t"]  # type: ignore[index]
    assert t.is_unknown and t.attrs == {"foo": "{1,2}"} and [o.name for o in t.operands] == ["hi", "b"]
    assert mod.unknown_opcodes == {"mulhi": 1, "frob": 1}
    assert analyze(mod).peak_bytes == 3 * 4096 + 4096 + 8192 + 2 * 8


def test_unknown_cost_is_bytes_without_flops() -> None:
    """The generic default: operands read + result written, no flops (``add`` beside it: 1024)."""
    c = CostAnalysis().run(parse_module(MULHI))
    assert c.of("hi").flops == 0 and c.of("hi").transcendentals == 0
    assert c.of("hi").bytes_accessed == 3 * 4096
    assert c.of("r").flops == 1024
    assert c.of("hi").seconds > 0


def test_inspect_lists_unknown_opcodes(tmp_path: Path) -> None:
    path = tmp_path / "mlp_dropout.hlo"
    text = _dropout_text()
    path.write_text(text)
    n_mulhi = len(re.findall(r" mulhi\(", text))
    r = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["unknown_opcodes"] == {"mulhi": n_mulhi}
    r = CliRunner().invoke(cli, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    assert re.search(rf"unknown opcodes \(not modeled\)\s*│\s*mulhi: {n_mulhi}", r.output), r.output


def test_inspect_says_none_when_every_opcode_is_known(tmp_path: Path) -> None:
    path = tmp_path / "known.hlo"
    path.write_text(MULHI.replace("mulhi(", "multiply("))
    r = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["unknown_opcodes"] == {}


@pytest.mark.parametrize("bad,phrase", [
    # an opcode must be a name followed by its operand list
    ("hi = u32[1024]{0} mulhi a, b)", "expected opcode, found 'mulhi'"),
    ("hi = u32[1024]{0} 7mulhi(a, b)", "opcode"),
    # an unknown opcode's operands must still be defined
    ("hi = u32[1024]{0} mulhi(a, c)", "not defined"),
])
def test_malformed_unknown_instructions_are_still_rejected(bad: str, phrase: str) -> None:
    from hloopt.errors import UserError

    with pytest.raises(UserError) as info:
        parse_module(MULHI.replace("hi = u32[1024]{0} mulhi(a, b)", bad), filename="bad.hlo")
    assert str(info.value).startswith("bad.hlo:6:") and phrase in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.tpu
def test_dropout_recompiled_holds_mulhi_and_matches_memory_analysis() -> None:
    """libtpu here still emits ``mulhi`` for the step, and our peak of its fresh module agrees."""
    from fixtures.record_dropout import make
    from hloopt.lowering import lower

    step, args = make()
    lowered = lower(step, *args, platform="tpu", compile="tpu-v5e")
    assert lowered.memory is not None and lowered.compiled_text is not None
    mod = parse_module(lowered.compiled_text)
    assert mod.unknown_opcodes.get("mulhi", 0) > 0
    report = analyze(mod, xla=lowered.memory)
    assert report.peak_bytes == pytest.approx(lowered.memory["peak_memory_in_bytes"], rel=0.005)
