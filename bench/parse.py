"""Parse speed: hloopt's ``parse_module`` against XLA's ``hlo_module_from_text``, same run, same text.

Usage: ``python bench/parse.py [--repeat N] [--chain N] [--skip-xla]``

Inputs: the 5 largest files of the shared corpus, the zoo snapshots (fixtures/hlo/zoo), and a
generated chain of ``--chain`` (default 200,000) ``add`` instructions with JAX-like metadata, in
long form (operand shapes and ``%``, as XLA prints) and short form (as JAX emits), each >= 20 MB.
Each parser's time is the best of ``--repeat`` runs (the generated modules: one run), in CPU
seconds of this process (``time.process_time``): the machine is shared, and wall time there
measures the neighbours as much as the parser. XLA's time
includes building its C++ module (and its verifier-free parse); ours includes linking, XLA's
semantic checks (hloopt.hlo.checks) and the structural verifier. ``ratio`` = ours / XLA.
Modules XLA cannot read (newer syntax in the TPU-compiled snapshots) show ``n/a``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fixtures.corpus import corpus_dir  # noqa: E402
from hloopt.hlo.parser import parse_module  # noqa: E402

CORPUS = corpus_dir("hlo-corpus")


def generate_chain(n: int, *, long_form: bool) -> str:
    """``n`` chained adds on f32[128,256] with op_name/source metadata, as JAX output looks."""
    shape = "f32[128,256]{1,0}"
    pct = "%" if long_form else ""
    lines = [
        "HloModule gen_chain, entry_computation_layout={(f32[128,256]{1,0})->f32[128,256]{1,0}}",
        "",
        f"ENTRY {pct}main.1 (Arg_0.1: f32[128,256]) -> f32[128,256] {{",
        f"  {pct}Arg_0.1 = {shape} parameter(0), metadata={{op_name=\"x\"}}",
    ]
    prev = "Arg_0.1"
    for i in range(n):
        name = f"add.{i}"
        if long_form:
            args = f"{shape} %{prev}, {shape} %Arg_0.1"
        else:
            args = f"{prev}, Arg_0.1"
        root = "ROOT " if i == n - 1 else ""
        lines.append(
            f"  {root}{pct}{name} = {shape} add({args}), metadata={{op_name=\"jit(step)/jvp(f)/add\" "
            f"source_file=\"/home/user/model.py\" source_line={i % 1000}}}")
        prev = name
    lines.append("}")
    lines.append("")
    return "\n".join(lines)


def _best(fn, text: str, repeat: int) -> tuple[float, object]:
    best = float("inf")
    out = None
    for _ in range(repeat):
        gc.collect()
        t0 = time.process_time()
        out = fn(text)
        best = min(best, time.process_time() - t0)
    return best, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chain", type=int, default=200_000)
    ap.add_argument("--skip-xla", action="store_true")
    args = ap.parse_args(argv)

    xla_parse = None
    if not args.skip_xla:
        from jax._src.lib import xla_client as xc

        xla_parse = xc.hlo.hlo_module_from_text

    inputs: list[tuple[str, str, int]] = []
    if CORPUS.is_dir():
        largest = sorted(CORPUS.rglob("*.hlo"), key=lambda p: p.stat().st_size, reverse=True)[:5]
        inputs += [(p.name, p.read_text(), args.repeat) for p in largest]
    for p in sorted((ROOT / "fixtures" / "hlo" / "zoo").glob("*.hlo")):
        inputs.append((p.name, p.read_text(), args.repeat))
    if args.chain:
        inputs.append((f"chain-{args.chain}-long", generate_chain(args.chain, long_form=True), 1))
        inputs.append((f"chain-{args.chain}-short", generate_chain(args.chain, long_form=False), 1))

    print(f"{'file':44s} {'MB':>7s} {'instrs':>8s} {'ours s':>8s} {'XLA s':>8s} {'ratio':>6s}")
    tot_ours = tot_xla = 0.0
    for name, text, repeat in inputs:
        ours_s, mod = _best(lambda t, name=name: parse_module(t, filename=name), text, repeat)
        n_inst = mod.num_instructions  # type: ignore[attr-defined]
        del mod
        xla_s = None
        if xla_parse is not None:
            try:
                xla_s, xmod = _best(xla_parse, text, repeat)
                del xmod
            except Exception:  # noqa: BLE001 - XLA cannot read it: report n/a
                xla_s = None
        mb = len(text.encode()) / 1e6
        xs = f"{xla_s:8.3f}" if xla_s is not None else f"{'n/a':>8s}"
        ratio = f"{ours_s / xla_s:6.2f}" if xla_s else f"{'':>6s}"
        if xla_s:
            tot_ours += ours_s
            tot_xla += xla_s
        print(f"{name[:44]:44s} {mb:7.2f} {n_inst:8d} {ours_s:8.3f} {xs} {ratio}", flush=True)
    if tot_xla:
        print(f"{'total (where XLA reads the file)':44s} {'':7s} {'':8s} {tot_ours:8.3f} "
              f"{tot_xla:8.3f} {tot_ours / tot_xla:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
