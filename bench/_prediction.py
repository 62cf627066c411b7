"""Shared by the benchmarks that hold the pre-optimization peak prediction to libtpu's compile
(``convnet_shapes.py``, ``small_shapes.py``): the machine-wide libtpu lock, and one step lowered,
predicted and compiled."""

from __future__ import annotations

import fcntl
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hloopt.lowering  # noqa: E402  (before jax: sets XLA_FLAGS / JAX_PLATFORMS)


@contextmanager
def libtpu_lock() -> Iterator[None]:
    """Hold ``/tmp/hloopt-tpu.flock``: one libtpu process at a time on the machine."""
    with open("/tmp/hloopt-tpu.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def predicted_and_compiled(step: Any, xs: tuple[Any, ...]) -> tuple[int, hloopt.lowering.Lowered]:
    """``hloopt analyze``'s TPU prediction of the step's peak, and the step compiled for v5e."""
    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module

    pre = hloopt.lowering.lower(step, *xs, platform="tpu")
    predicted = analyze(parse_module(pre.hlo_text), platform="tpu").peak_bytes
    return predicted, hloopt.lowering.lower(step, *xs, platform="tpu", compile="tpu-v5e")
