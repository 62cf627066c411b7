"""Time parse + liveness + peak on generated modules from 1k to 1M instructions.

    python bench/analyze.py                 # 1k, 10k, 100k, 1M
    python bench/analyze.py --sizes 1000 100000 --zoo

Modules are chains where instruction i reads i-1 and i-k (k cycles through 1..64), so live ranges
overlap at many lengths; every 1000th value is a module output. ``--zoo`` adds the pre-optimization
HLO of ``fixtures/zoo/llama.py:large`` lowered for TPU (needs jax; lowering is not timed).
The ``us/inst`` columns make growth visible: O(n log n) keeps them nearly flat. Times are CPU
seconds of this process (``time.process_time``), so other work on a shared machine does not
inflate them; ``wall s`` is the wall time of the three stages together.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hloopt.hlo.parser import parse_module  # noqa: E402
from hloopt.passes import AnalysisManager  # noqa: E402
from hloopt.passes.liveness import Liveness  # noqa: E402
from hloopt.passes.memory import PeakMemory  # noqa: E402


def chain(n: int) -> str:
    lines = ["HloModule chain, is_scheduled=true", "", "ENTRY main {",
             "  v0 = f32[128,256]{1,0} parameter(0)"]
    outs = []
    for i in range(1, n - 1):
        k = 1 + (i * 7) % 64
        a, b = f"v{i - 1}", f"v{max(i - k, 0)}"
        op = ("add", "multiply", "subtract", "maximum")[i % 4]
        lines.append(f"  v{i} = f32[128,256]{{1,0}} {op}({a}, {b}), metadata={{op_name=\"jit(step)/jvp()/{op}\"}}")
        if i % 1000 == 0:
            outs.append(f"v{i}")
    outs.append(f"v{n - 2}")
    shapes = ", ".join(["f32[128,256]{1,0}"] * len(outs))
    lines.append(f"  ROOT out = ({shapes}) tuple({', '.join(outs)})")
    lines.append("}")
    return "\n".join(lines) + "\n"


def measure(name: str, text: str) -> tuple[str, int, float, float, float, float, int]:
    w0 = time.perf_counter()
    t0 = time.process_time()
    module = parse_module(text)
    t1 = time.process_time()
    am = AnalysisManager(module)
    live = Liveness()
    am.get(live)
    t2 = time.process_time()
    prof = am.get(PeakMemory(liveness=live))
    t3 = time.process_time()
    return name, module.num_instructions, t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - w0, prof.peak_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--zoo", action="store_true", help="also llama large lowered for TPU")
    ap.add_argument("--no-gc", action="store_true",
                    help="disable Python's cyclic GC while measuring (parse and liveness pause it "
                         "themselves, hloopt.ir.gc_paused; this also covers PeakMemory)")
    opts = ap.parse_args(argv)
    if opts.no_gc:
        import gc

        gc.disable()
    rows = [measure(f"chain-{n}", chain(n)) for n in opts.sizes]
    if opts.zoo:
        from hloopt.lowering import lower
        from hloopt.targets import resolve

        text = lower(resolve("fixtures/zoo/llama.py:large"), platform="tpu").hlo_text
        rows.append(measure("llama-large (tpu pre-opt)", text))
    print(f"{'module':28s} {'insts':>9s} {'parse s':>8s} {'live s':>8s} {'peak s':>8s} {'total s':>8s} "
          f"{'wall s':>8s} {'parse us/inst':>13s} {'live us/inst':>12s} {'peak us/inst':>12s}  peak")
    for name, n, tp, tl, tk, wall, peak in rows:
        print(f"{name:28s} {n:9d} {tp:8.2f} {tl:8.2f} {tk:8.2f} {tp + tl + tk:8.2f} {wall:8.2f} "
              f"{1e6 * tp / n:13.2f} {1e6 * tl / n:12.2f} {1e6 * tk / n:12.2f}  {peak}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
