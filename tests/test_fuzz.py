"""Property: any mutation of a valid corpus module is either rejected with a clean one-line
UserError at FILE:LINE:COL, or accepted as a module that verifies and prints back to a fixed point;
never another exception, never over the time bound. Mutators live in ``bench/fuzz.py`` (which runs
10,000 inputs); here hypothesis drives a modest number of them per CI run."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "hloopt_bench_fuzz", Path(__file__).resolve().parent.parent / "bench" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fuzz
_spec.loader.exec_module(fuzz)  # type: ignore[union-attr]

if not fuzz.CORPUS.is_dir():  # pragma: no cover - the corpus is shared data
    pytest.skip("HLO corpus not present", allow_module_level=True)

CORPUS = fuzz.load_corpus(max_chars=8_000)
TIME_BOUND_S = 2.0


def assert_clean(text: str) -> "fuzz.Outcome":
    out = fuzz.check_one(text, time_bound_s=TIME_BOUND_S)
    assert out.kind in ("accepted", "rejected"), f"{out.kind}: {out.detail}\n--- input ---\n{text[:2000]}"
    return out


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.integers(0, len(CORPUS) - 1), st.sampled_from(sorted(fuzz.MUTATORS)), st.integers(0, 2**32))
def test_mutated_corpus_is_rejected_cleanly_or_round_trips(index: int, mutator: str, seed: int) -> None:
    text = fuzz.MUTATORS[mutator](CORPUS[index], random.Random(seed), CORPUS)
    assert_clean(text)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(CORPUS) - 1), st.text(max_size=40), st.integers(0, 10**9))
def test_arbitrary_text_inserted_anywhere(index: int, junk: str, where: int) -> None:
    base = CORPUS[index]
    at = where % (len(base) + 1)
    assert_clean(base[:at] + junk + base[at:])


@pytest.mark.parametrize("mutator", sorted(fuzz.MUTATORS))
def test_each_mutator_changes_its_input_and_some_are_rejected(mutator: str) -> None:
    """The mutators really mutate (a fuzz test whose inputs all parse would test nothing)."""
    r = random.Random(7)
    outcomes = []
    for i in range(12):
        base = CORPUS[(i * 37) % len(CORPUS)]
        text = fuzz.MUTATORS[mutator](base, r, CORPUS)
        outcomes.append(assert_clean(text).kind)
    assert "rejected" in outcomes


@pytest.mark.parametrize("text,phrase", [
    ("HloModule m\nENTRY e {\n  ROOT p = f32[99999999999999] parameter(0)\n}\n", None),
    ("HloModule m\nENTRY e {\n  ROOT p = f32[99999999999999999999999] parameter(0)\n}\n", "too large"),
    ("HloModule m\nENTRY e {\n  p = f32[] parameter(0)\n  ROOT a = f32[] add(p, p, p)\n}\n",
     "expects 2 operands"),
    ("HloModule m\nENTRY e {\n  p = f32[] parameter(0)\n  ROOT a = f32[] add(p, q)\n}\n", "not defined"),
    ("HloModule m\nENTRY e {\n  a = f32[] negate(a)\n  ROOT r = f32[] negate(a)\n}\n", "cycle"),
])
def test_named_hazards(text: str, phrase: str | None) -> None:
    out = assert_clean(text)
    if phrase is None:
        assert out.kind == "accepted"
    else:
        assert out.kind == "rejected" and phrase in out.detail
