"""The pre-optimization peak prediction vs libtpu's compile where the step outgrows VMEM.

At the zoo's ``small`` sizes libtpu's memory-space assignment can no longer hold the working set in
VMEM (112 MiB), so the peak depends on which temporaries it keeps there and which it leaves in
HBM: the part of the model (``passes/memory.py``) the tiny shapes of ``bench/convnet_shapes.py``
never reach. For each (model, policy, config overrides) the step is lowered for TPU, predicted
(``hloopt.analysis.analyze(..., platform="tpu")``) and compiled by libtpu for v5e; the table
prints both peaks and the error. One libtpu process at a time: takes ``/tmp/hloopt-tpu.flock``.

    python bench/small_shapes.py                 # 18 steps, ~5 min on a 2-core machine
    python bench/small_shapes.py --only convnet  # the 14 convnet steps
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Any

from _prediction import libtpu_lock, predicted_and_compiled

#: (zoo model, with the zoo's offload policy, overrides of its small Config)
STEPS: tuple[tuple[str, bool, dict[str, Any]], ...] = (
    ("convnet", False, {}), ("convnet", True, {}),
    ("convnet", False, {"batch": 48}), ("convnet", True, {"batch": 48}),
    ("convnet", False, {"batch": 64}), ("convnet", True, {"batch": 64}),
    ("convnet", False, {"image": 96, "batch": 16}), ("convnet", True, {"image": 96, "batch": 16}),
    ("convnet", False, {"channels": (32, 64, 128), "batch": 64}),
    ("convnet", True, {"channels": (32, 64, 128), "batch": 64}),
    ("convnet", False, {"channels": (128, 256), "batch": 32}), ("convnet", True, {"channels": (128, 256), "batch": 32}),
    ("convnet", True, {"blocks_per_stage": 1}), ("convnet", True, {"blocks_per_stage": 3, "batch": 24}),
    ("mlp", False, {"batch": 1024}), ("mlp", True, {"batch": 1024}),
    ("gpt2", False, {"batch": 4}), ("gpt2", True, {"batch": 4}),
)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", metavar="MODEL", help="only this zoo model's steps")
    args = ap.parse_args(argv)
    from fixtures.zoo import OFFLOAD_NAMES
    from fixtures.zoo._common import offload_policy

    steps = [s for s in STEPS if args.only in (None, s[0])]
    print(f"{'model':>8} {'policy':>7} {'overrides':>36} {'predicted B':>13} {'libtpu B':>13} {'error':>8}")
    errors: dict[bool, list[float]] = {True: [], False: []}
    with libtpu_lock():
        t0 = time.perf_counter()
        for model, offload, overrides in steps:
            policy = offload_policy(OFFLOAD_NAMES[model]) if offload else None
            step, xs = importlib.import_module(f"fixtures.zoo.{model}").make("small", policy=policy, **overrides)
            predicted, low = predicted_and_compiled(step, xs)
            assert low.memory is not None
            real = low.memory["peak_memory_in_bytes"]
            err = predicted / real - 1
            errors[offload].append(err)
            ov = ",".join(f"{k}={v}" for k, v in overrides.items()) or "-"
            print(f"{model:>8} {'offload' if offload else '-':>7} {ov.replace(' ', ''):>36} {predicted:>13,} "
                  f"{real:>13,} {err:>+8.1%}", flush=True)
    for offload, errs in errors.items():
        if errs:
            print(f"{'offload policy' if offload else 'no policy'}: error from {min(errs):+.1%} to {max(errs):+.1%} "
                  f"({len(errs)} steps)")
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
