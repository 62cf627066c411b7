"""The XLA corpus: every module XLA's parser accepts we read and print back to a fixed point;
every module it rejects we reject with a one-line UserError at FILE:LINE:COL (never a crash).

Truth is XLA's own verdict: ``shared/hlo-corpus`` beside the checkout holds the 612 files jaxlib's
``hlo_module_from_text`` accepts, ``shared/hlo-corpus-invalid`` the 82 it rejects, each with XLA's
message in ``.why`` (where: :func:`fixtures.corpus.corpus_dir`). A missing corpus fails
:func:`test_corpus_present` instead of skipping the hundreds of tests below.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fixtures.corpus import corpus_dir
from hloopt.errors import HloParseError, UserError
from hloopt.hlo.parser import parse_module, parse_modules
from hloopt.hlo.printer import print_module

VALID = corpus_dir("hlo-corpus")
INVALID = corpus_dir("hlo-corpus-invalid")

VALID_FILES = sorted(VALID.rglob("*.hlo"))
INVALID_FILES = sorted(INVALID.rglob("*.hlo"))


def _id(p: Path) -> str:
    return p.name


def test_corpus_present() -> None:
    for d in (VALID, INVALID):
        assert d.is_dir(), (f"HLO corpus not found at {d}: put it in shared/ beside the checkout "
                            "or set HLOOPT_CORPUS / HLOOPT_CORPUS_INVALID")


def test_corpus_sizes() -> None:
    assert len(VALID_FILES) == 612
    assert len(INVALID_FILES) == 82


@pytest.mark.parametrize("path", VALID_FILES, ids=_id)
def test_valid_parses_and_round_trips(path: Path) -> None:
    text = path.read_text()
    mods = parse_modules(text, filename=str(path))
    assert mods
    for mod in mods:
        assert mod.entry is not None and mod.entry.root is not None
        for long_form in (False, True):
            printed = print_module(mod, long_form=long_form)
            again = parse_module(printed, filename=f"{path}.printed")
            assert print_module(again, long_form=long_form) == printed
            assert again.num_instructions == mod.num_instructions


@pytest.mark.parametrize("path", INVALID_FILES, ids=_id)
def test_invalid_rejected_cleanly(path: Path) -> None:
    text = path.read_text()
    with pytest.raises(UserError) as info:
        parse_module(text, filename=str(path))
    err = info.value
    msg = str(err)
    assert "\n" not in msg
    assert re.match(re.escape(str(path)) + r":\d+:\d+: \S", msg), msg
    assert getattr(err, "line", 0) >= 1
    assert err.detail is not None and err.detail.splitlines()[-1].strip() == "^"


def test_no_module_is_rejected_by_xla_for_its_opcode_name() -> None:
    """hloopt reads opcodes it does not know (hloopt.hlo.checks); that rejects none of these,
    because XLA rejects none of them for the name (its message would say ``Unknown opcode``).
    ``hlo_parser_test__177`` holds the one unknown name, ``le``, after a scalar layout ``{}``
    that XLA and hloopt both reject first, at the same place."""
    whys = {p: Path(f"{p}.why").read_text() for p in INVALID_FILES}
    assert len(whys) == 82
    assert not [p.name for p, why in whys.items() if "Unknown opcode" in why]
    wrong_opcode = INVALID / "xla-tests" / "hlo_parser_test__177.hlo"
    assert " le(" in wrong_opcode.read_text() and "was parsing 4:13: error: expects opcode" in whys[wrong_opcode]
    with pytest.raises(UserError, match=r"hlo_parser_test__177\.hlo:4:13: expects opcode"):
        parse_module(wrong_opcode.read_text(), filename=str(wrong_opcode))


MULTI_MODULE = sorted(p for p in INVALID_FILES if "\n// -----" in p.read_text())


def test_multi_module_files_read_module_by_module() -> None:
    assert len(MULTI_MODULE) == 6
    for path in MULTI_MODULE:
        text = path.read_text()
        n_headers = len(re.findall(r"^HloModule ", text, re.M))
        mods = parse_modules(text, filename=str(path))
        assert len(mods) == n_headers >= 2
        with pytest.raises(HloParseError, match="several modules"):
            parse_module(text, filename=str(path))


# Files where XLA points at the offending instruction itself (elsewhere it points at the token
# after it, often the next line, while we point at the instruction).
SAME_LINE_AS_XLA = [
    "buffer_assignment_test__008", "buffer_assignment_test__009", "buffer_assignment_test__010",
    "hlo_parser_test__180", "hlo_parser_test__184", "hlo_parser_test__185", "hlo_parser_test__186",
    "hlo_parser_test__187", "hlo_parser_test__188", "hlo_parser_test__190", "hlo_parser_test__191",
    "hlo_parser_test__196", "hlo_parser_test__198", "hlo_parser_test__199", "hlo_parser_test__200",
    "hlo_parser_test__206", "hlo_parser_test__207", "hlo_parser_test__214", "hlo_parser_test__216",
    "hlo_parser_test__230", "hlo_parser_test__239", "hlo_parser_test__240", "hlo_parser_test__242",
    "hlo_parser_test__254", "hlo_parser_test__258", "hlo_parser_test__259", "hlo_parser_test__260",
    "hlo_parser_test__276", "hlo_parser_test__280", "hlo_parser_test__281", "hlo_parser_test__282",
    "hlo_parser_test__298", "hlo_parser_test__300", "hlo_parser_test__301", "hlo_parser_test__303",
]


@pytest.mark.parametrize("stem", SAME_LINE_AS_XLA)
def test_error_line_agrees_with_xla(stem: str) -> None:
    path = INVALID / "xla-tests" / f"{stem}.hlo"
    why = Path(f"{path}.why").read_text()
    m = re.search(r"was parsing (\d+):(\d+)", why)
    assert m is not None
    with pytest.raises(UserError) as info:
        parse_module(path.read_text(), filename=str(path))
    assert info.value.line == int(m.group(1)), (str(info.value), why)


@pytest.mark.parametrize("stem,xla_phrase", [
    ("buffer_assignment_test__008", 'unexpected attribute "to_apply"'),
    ("hlo_parser_test__188", "out of range for literal's primitive type F16"),
    ("hlo_parser_test__207", "does not support payloads"),
    ("hlo_parser_test__214", "expects padding_low and padding_high separated by '_'"),
    ("hlo_parser_test__252", "Expected 2 operand layout constraints, 1 given"),
    ("hlo_parser_test__259", "The first operand must be a scalar of PRED or S32"),
    ("hlo_parser_test__281", "AsyncUpdate expects the op shape to be the same as the operand"),
    ("hlo_parser_test__290", "Expect async_execution_thread to be main, but got foo_thread"),
])
def test_error_names_xlas_reason(stem: str, xla_phrase: str) -> None:
    path = INVALID / "xla-tests" / f"{stem}.hlo"
    assert xla_phrase in Path(f"{path}.why").read_text()
    with pytest.raises(UserError) as info:
        parse_module(path.read_text(), filename=str(path))
    assert xla_phrase.replace('"', "'") in str(info.value)


def test_every_valid_module_analyzes_from_its_file() -> None:
    """``hloopt analyze FILE`` takes every module XLA's parser takes, header line or not (167 of
    the corpus files are bare computations, XLA's own test inputs), as written and predicted for
    TPU: a peak at least the arguments' bytes, and a JSON report."""
    import json

    from hloopt.analysis import analyze

    failed = []
    for path in VALID_FILES:
        for platform in (None, "tpu"):
            try:
                rep = analyze(path, platform=platform)
                assert rep.peak_bytes >= rep.profile.argument_bytes >= 0
                json.dumps(rep.to_json())
            except Exception as err:  # noqa: BLE001 - collected, reported below
                failed.append(f"{path.name} ({platform}): {type(err).__name__}: {err}")
    assert not failed, "\n".join(failed[:20])
