"""The third-party steps (``fixtures/thirdparty/``): lowering time, checkpointing facts, hloopt's
pre-optimization peak prediction vs libtpu's compiled peak.

For each step (transformers, levanter/haliax: libraries hloopt did not write) the factory is
called and the step lowered for TPU (timed), its jaxpr read for ``jax.checkpoint`` / ``lax.scan`` /
``checkpoint_name`` equations, the peak predicted (``hloopt.analysis.analyze(..., platform="tpu")``)
and the step compiled by libtpu for v5e (``memory_analysis().peak_memory_in_bytes``). One libtpu
process at a time: takes ``/tmp/hloopt-tpu.flock``. Needs ``pip install -r
fixtures/thirdparty/requirements.txt``.

    python bench/thirdparty.py                       # every step, size small
    python bench/thirdparty.py --size tiny hf_bert   # one step, tiny
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from _prediction import libtpu_lock

import hloopt.lowering


def main(argv: list[str]) -> int:
    import jax

    from fixtures.thirdparty import STEPS, jaxpr_facts
    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("steps", nargs="*", default=list(STEPS))
    args = ap.parse_args(argv)
    print(f"{'step':>15} {'lower s':>8} {'remat':>5} {'scan':>4} {'predicted B':>14} {'libtpu B':>14} "
          f"{'error':>7} {'compile s':>9}  names", flush=True)
    for name in args.steps:
        t0 = time.perf_counter()
        step, xs = importlib.import_module(f"fixtures.thirdparty.{name}").make(args.size)
        pre = hloopt.lowering.lower(step, *xs, platform="tpu")
        t_lower = time.perf_counter() - t0
        facts = jaxpr_facts(jax.make_jaxpr(step)(*xs))
        predicted = analyze(parse_module(pre.hlo_text), platform="tpu").peak_bytes
        with libtpu_lock():
            t1 = time.perf_counter()
            low = hloopt.lowering.lower(step, *xs, platform="tpu", compile="tpu-v5e")
            t_compile = time.perf_counter() - t1
        assert low.memory is not None
        real = low.memory["peak_memory_in_bytes"]
        names = ", ".join(f"{k} x{v}" for k, v in sorted(facts["names"].items())) or "-"
        print(f"{name:>15} {t_lower:>8.1f} {facts['remat']:>5} {facts['scan']:>4} {predicted:>14,} {real:>14,} "
              f"{predicted / real - 1:>+7.1%} {t_compile:>9.1f}  {names}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
