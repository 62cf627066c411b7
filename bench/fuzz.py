"""Fuzz the HLO parser with mutated corpus files; print accepted / rejected / crashes / timeouts.

Usage: ``python bench/fuzz.py [N=10000] [--seed S] [--corpus DIR]``

Each input is a valid corpus module with one mutation (truncate, splice two files, flip bytes,
duplicate an instruction, drop or add an operand, an undefined operand, a cycle, an absurd
dimension, deep nesting, delete or swap lines). Times are CPU seconds of this process
(``time.process_time``), so a busy shared machine does not turn slow inputs into timeouts. The
parser must either reject it with a
:class:`UserError` or accept a module that verifies and prints back to a fixed point; anything else
(another exception, a round-trip mismatch) is a crash, and an input taking over the time bound is a
timeout. ``tests/test_fuzz.py`` uses the same mutators under hypothesis.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fixtures.corpus import corpus_dir  # noqa: E402
from hloopt.errors import UserError  # noqa: E402
from hloopt.hlo.parser import parse_module  # noqa: E402
from hloopt.hlo.printer import print_module  # noqa: E402

CORPUS = corpus_dir("hlo-corpus")
TIME_BOUND_S = 2.0

_NAME_REF = re.compile(r"(?<=[(, ])%?([A-Za-z_][\w.\-]*)(?=[,)])")
_INST_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", re.M)
_DIM = re.compile(r"(?<=[\[,])\d+(?=[\],])")


def load_corpus(root: Path = CORPUS, *, max_chars: int = 20_000) -> list[str]:
    """Valid corpus files small enough to fuzz quickly (single-module ones)."""
    out = []
    for p in sorted(root.rglob("*.hlo")):
        t = p.read_text()
        if len(t) <= max_chars and "\n// -----" not in t:
            out.append(t)
    return out


def _lines(t: str) -> list[str]:
    return t.split("\n")


def truncate(t: str, r: random.Random, corpus: list[str]) -> str:
    return t[: r.randrange(len(t) + 1)]


def splice(t: str, r: random.Random, corpus: list[str]) -> str:
    other = r.choice(corpus)
    return t[: r.randrange(len(t) + 1)] + other[r.randrange(len(other) + 1):]


def flip_bytes(t: str, r: random.Random, corpus: list[str]) -> str:
    chars = list(t)
    alphabet = "{}[](),=%:\"'/*<>?-_.0123456789abcxyzTSE \n\t\\\x00\u00e9"
    for _ in range(r.randint(1, 8)):
        if not chars:
            break
        chars[r.randrange(len(chars))] = r.choice(alphabet)
    return "".join(chars)


def duplicate_instruction(t: str, r: random.Random, corpus: list[str]) -> str:
    lines = _lines(t)
    idx = [i for i, ln in enumerate(lines) if _INST_LINE.match(ln)]
    if not idx:
        return t
    i = r.choice(idx)
    lines.insert(r.choice(idx), lines[i])
    return "\n".join(lines)


def wrong_operand_count(t: str, r: random.Random, corpus: list[str]) -> str:
    spots = [m for m in re.finditer(r"\b([a-z][a-z\-]*)\(([^()]*)\)", t)]
    if not spots:
        return t
    m = r.choice(spots)
    ops = [o for o in m.group(2).split(",") if o.strip()]
    if ops and r.random() < 0.5:
        ops.pop(r.randrange(len(ops)))
    else:
        ops.append(r.choice(ops) if ops else "x")
    return t[: m.start(2)] + ",".join(ops) + t[m.end(2):]


def undefined_operand(t: str, r: random.Random, corpus: list[str]) -> str:
    refs = list(_NAME_REF.finditer(t))
    if not refs:
        return t
    m = r.choice(refs)
    return t[: m.start(1)] + "undefined_" + m.group(1) + t[m.end(1):]


def cycle(t: str, r: random.Random, corpus: list[str]) -> str:
    """Point an operand at an instruction defined later in the text (often in the same body)."""
    names = [m.group(1) for m in _INST_LINE.finditer(t)]
    refs = list(_NAME_REF.finditer(t))
    if not names or not refs:
        return t
    m = r.choice(refs)
    later = names[-1] if r.random() < 0.5 else r.choice(names)
    return t[: m.start(1)] + later + t[m.end(1):]


def absurd_dim(t: str, r: random.Random, corpus: list[str]) -> str:
    dims = list(_DIM.finditer(t))
    if not dims:
        return t
    m = r.choice(dims)
    v = r.choice(["99999999999999", "0", "4611686018427387904", "99999999999999999999999", "-1",
                  "<=99999999999999", "?"])
    return t[: m.start()] + v + t[m.end():]


def deep_nesting(t: str, r: random.Random, corpus: list[str]) -> str:
    depth = r.choice([300, 5_000, 100_000])
    kind = r.randrange(4)
    dims = list(re.finditer(r"[a-z0-9]+\[[0-9,]*\](\{[^{}]*\})?", t))
    if kind == 0 and dims:  # a shape wrapped in tuple parens
        m = r.choice(dims)
        return t[: m.start()] + "(" * depth + m.group(0) + ")" * depth + t[m.end():]
    if kind == 1:  # braces in an attribute value, maybe unbalanced
        lines = _lines(t)
        idx = [i for i, ln in enumerate(lines) if _INST_LINE.match(ln)]
        if idx:
            i = r.choice(idx)
            close = "}" * (depth if r.random() < 0.5 else depth // 2)
            lines[i] += ", backend_config=" + "{" * depth + close
            return "\n".join(lines)
    if kind == 2:  # nested instructions as an operand
        refs = list(_NAME_REF.finditer(t))
        if refs:
            m = r.choice(refs)
            nested = "negate(" * depth + "f32[] parameter(0)" + ")" * depth
            return t[: m.start(1)] + nested + t[m.end(1):]
    # nested braces in a constant
    return re.sub(r"constant\(", "constant(" + "{" * depth, t, count=1)


def delete_line(t: str, r: random.Random, corpus: list[str]) -> str:
    lines = _lines(t)
    if lines:
        lines.pop(r.randrange(len(lines)))
    return "\n".join(lines)


def swap_lines(t: str, r: random.Random, corpus: list[str]) -> str:
    lines = _lines(t)
    if len(lines) >= 2:
        i, j = r.randrange(len(lines)), r.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


MUTATORS: dict[str, Callable[[str, random.Random, list[str]], str]] = {
    f.__name__: f for f in (truncate, splice, flip_bytes, duplicate_instruction, wrong_operand_count,
                            undefined_operand, cycle, absurd_dim, deep_nesting, delete_line, swap_lines)
}


@dataclass
class Outcome:
    kind: str  # "accepted" | "rejected" | "crash" | "timeout"
    seconds: float
    detail: str = ""


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Timeout()


def check_one(text: str, *, time_bound_s: float = TIME_BOUND_S, hard_limit_s: float = 10.0) -> Outcome:
    """Parse ``text``: a clean UserError, or a module that verifies and round-trips."""
    use_alarm = hasattr(signal, "setitimer")
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, hard_limit_s)
    t0 = time.process_time()
    try:
        try:
            mod = parse_module(text, filename="fuzz.hlo")
        except UserError as e:
            msg = str(e)
            kind = "rejected"
            if "\n" in msg or not msg.startswith("fuzz.hlo"):
                return Outcome("crash", time.process_time() - t0, "bad error text: " + msg[:200])
            return _timed(kind, t0, time_bound_s, msg[:200])
        printed = print_module(mod)
        again = print_module(parse_module(printed, filename="fuzz.printed.hlo"))
        if again != printed:
            return Outcome("crash", time.process_time() - t0, "round trip is not a fixed point")
        return _timed("accepted", t0, time_bound_s)
    except _Timeout:
        return Outcome("timeout", time.process_time() - t0, f"over {hard_limit_s} s")
    except Exception as e:  # noqa: BLE001 - a crash is what we count
        return Outcome("crash", time.process_time() - t0,
                       f"{type(e).__name__}: {str(e)[:200]}\n{traceback.format_exc()[-800:]}")
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _timed(kind: str, t0: float, bound: float, detail: str = "") -> Outcome:
    dt = time.process_time() - t0
    return Outcome("timeout" if dt > bound else kind, dt, detail)


def mutate(corpus: list[str], r: random.Random) -> tuple[str, str]:
    name = r.choice(sorted(MUTATORS))
    return name, MUTATORS[name](r.choice(corpus), r, corpus)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", nargs="?", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    args = ap.parse_args(argv)
    corpus = load_corpus(args.corpus)
    r = random.Random(args.seed)
    counts = {"accepted": 0, "rejected": 0, "crash": 0, "timeout": 0}
    by_mutator: dict[str, dict[str, int]] = {m: dict.fromkeys(counts, 0) for m in MUTATORS}
    slowest = (0.0, "")
    examples: list[str] = []
    t0 = time.perf_counter()
    for _ in range(args.n):
        name, text = mutate(corpus, r)
        out = check_one(text)
        counts[out.kind] += 1
        by_mutator[name][out.kind] += 1
        if out.seconds > slowest[0]:
            slowest = (out.seconds, name)
        if out.kind in ("crash", "timeout") and len(examples) < 5:
            examples.append(f"[{name}] {out.kind}: {out.detail}")
    wall = time.perf_counter() - t0
    print(f"{args.n} inputs from {len(corpus)} corpus files, seed {args.seed}, {wall:.1f} s")
    print("  ".join(f"{k}={v}" for k, v in counts.items()) +
          f"  max_time={slowest[0]:.3f}s ({slowest[1]})")
    print(f"{'mutator':24s} {'accepted':>9s} {'rejected':>9s} {'crash':>6s} {'timeout':>8s}")
    for m, c in by_mutator.items():
        print(f"{m:24s} {c['accepted']:9d} {c['rejected']:9d} {c['crash']:6d} {c['timeout']:8d}")
    for e in examples:
        print(e)
    return 1 if counts["crash"] or counts["timeout"] else 0


if __name__ == "__main__":
    sys.exit(main())
