"""The pre-optimization peak prediction vs libtpu's compile, over convnet shapes.

For each (widths, image, batch), lower the zoo convnet's training step for TPU, predict its peak
(``hloopt.analysis.analyze(..., platform="tpu")``) and compile it with libtpu for v5e; print both,
the error, and how many convolutions libtpu rewrote into the ``0b1f`` form it uses for a batch
smaller than the 8 sublanes. One libtpu process at a time: takes ``/tmp/hloopt-tpu.flock``.

    python bench/convnet_shapes.py            # 19 shapes, ~1-2 min on a 2-core machine
    python bench/convnet_shapes.py --offload  # the same with the zoo's offload policy
"""

from __future__ import annotations

import argparse
import sys
import time

from _prediction import libtpu_lock, predicted_and_compiled

#: (stage widths, image side, batch)
SHAPES: tuple[tuple[tuple[int, ...], int, int], ...] = (
    ((8, 16), 16, 1), ((8, 16), 16, 2), ((8, 16), 16, 4), ((8, 16), 8, 4), ((8, 16), 32, 4),
    ((16,), 16, 4), ((32, 64), 16, 4), ((64, 128), 16, 4), ((128, 256), 16, 4),
    ((8, 16), 16, 8), ((8, 16), 32, 8), ((16,), 16, 8), ((64, 128), 16, 8),
    ((8, 16), 16, 16), ((16, 32), 32, 16), ((64,), 32, 16),
    ((8, 16), 8, 32), ((32, 64), 16, 32), ((8,), 16, 64),
)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offload", action="store_true", help="with the zoo's offload policy (conv)")
    args = ap.parse_args(argv)
    from fixtures.zoo import OFFLOAD_NAMES, convnet
    from fixtures.zoo._common import offload_policy

    policy = offload_policy(OFFLOAD_NAMES["convnet"]) if args.offload else None
    print(f"{'widths':>10} {'image':>5} {'batch':>5} {'predicted B':>13} {'libtpu B':>13} {'error':>8} "
          f"{'0b1f convs':>10}")
    errors: dict[bool, list[float]] = {True: [], False: []}
    with libtpu_lock():
        t0 = time.perf_counter()
        for widths, image, batch in SHAPES:
            step, xs = convnet.make("tiny", channels=widths, image=image, batch=batch, policy=policy)
            predicted, low = predicted_and_compiled(step, xs)
            assert low.memory is not None and low.compiled_text is not None
            real = low.memory["peak_memory_in_bytes"]
            err = predicted / real - 1
            errors[batch >= 8].append(err)
            rewritten = low.compiled_text.count("dim_labels=0b1f_")
            print(f"{','.join(map(str, widths)):>10} {image:>5} {batch:>5} {predicted:>13,} {real:>13,} "
                  f"{err:>+8.1%} {rewritten:>10}", flush=True)
    for full, errs in errors.items():
        if errs:
            print(f"batch {'>= 8' if full else '< 8'}: error from {min(errs):+.1%} to {max(errs):+.1%} "
                  f"({len(errs)} shapes)")
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
