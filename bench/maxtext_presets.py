"""MaxText's ``remat_policy`` presets on its own Llama2 step, each compiled by libtpu for v5e:
peak, FLOPs (``cost_analysis``) and bytes moved to host memory, at any model width.

The slow test (``tests/test_thirdparty_maxtext.py``) compiles the presets at size ``mini``
(d=512) beside hloopt's plan; this shows how the presets' trade (recomputation against bytes to
host) moves with the width, where the link's time per step grows with d and the compute with d^2.
Python >= 3.12 with ``fixtures/thirdparty/requirements-py312.txt`` (MaxText). Overrides are
MaxText config keys:

    python bench/maxtext_presets.py --size mini base_emb_dim=4096 base_mlp_dim=11008 \\
        base_num_query_heads=32 base_num_kv_heads=32 head_dim=128 base_num_decoder_layers=2 \\
        per_device_batch_size=16
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _prediction import libtpu_lock

import hloopt.lowering

PRESETS = ("full", "minimal", "save_dot_except_mlp", "save_dot_except_mlpwi", "save_qkv_proj",
           "save_out_proj", "qkv_proj_offloaded", "minimal_offloaded")


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str]) -> int:
    from fixtures.thirdparty import maxtext_llama2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="mini", choices=sorted(maxtext_llama2.SIZES))
    ap.add_argument("overrides", nargs="*", help="MaxText config keys, KEY=VALUE")
    args = ap.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print(f"maxtext_presets: {bad[0]!r}: overrides are KEY=VALUE", file=sys.stderr)
        return 2
    overrides = {k: _value(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    print(f"{'preset':>22} {'peak MiB':>10} {'GFLOP':>10} {'to host MiB':>12} {'compile s':>9}", flush=True)
    with libtpu_lock():
        for preset in PRESETS:
            step, xs = maxtext_llama2.make(args.size, **overrides, remat_policy=preset)
            started = time.perf_counter()
            low = hloopt.lowering.lower(step, *xs, platform="tpu", compile="tpu-v5e")
            assert low.memory is not None and low.cost is not None
            print(f"{preset:>22} {low.memory['peak_memory_in_bytes'] / 2**20:>10.1f} "
                  f"{low.cost['flops'] / 1e9:>10.1f} {low.memory['host_temp_size_in_bytes'] / 2**20:>12.1f} "
                  f"{time.perf_counter() - started:>9.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
