"""Measure the host<->device link of the current JAX device and fit ``latency + bytes / bandwidth``.

For each size we time copies device->host (D2H) and host->device (H2D) alone, then both at once
from two threads (duplex). Per direction we fit ``t(n) = latency_s + n / bytes_per_s`` by least
squares over the sizes; duplex rates are the bytes each thread moved over its own wall time at the
largest size. Copies go to pinned host memory (``memory_kind="pinned_host"``) when the backend
offers it, which is where XLA's host offload puts activations; otherwise through numpy.

jax is imported lazily, inside :func:`measure_link`, so importing this module stays cheap.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hloopt.devices import DeviceProfile
from hloopt.errors import UserError
from hloopt.units import format_bytes

DEFAULT_SIZES_BYTES: tuple[int, ...] = (1 << 20, 8 << 20, 64 << 20, 256 << 20)


class NoAcceleratorError(UserError):
    """JAX's default backend is the CPU: there is no host<->device link to measure."""


@dataclass(frozen=True)
class LinkFit:
    """``t(n) = latency_s + n / bytes_per_s`` for one direction."""

    #: Fixed cost per transfer, seconds (clamped at 0).
    latency_s: float
    #: Asymptotic transfer rate, bytes/s.
    bytes_per_s: float


@dataclass(frozen=True)
class Calibration:
    """What :func:`measure_link` found on one device."""

    #: ``jax.Device.device_kind`` of the measured device, e.g. ``"TPU v5 lite"``.
    device_kind: str
    #: Platform: ``"tpu"`` or ``"gpu"``.
    platform: str
    d2h: LinkFit
    h2d: LinkFit
    #: Rates with both directions busy at once, bytes/s.
    duplex_d2h_bytes_per_s: float
    duplex_h2d_bytes_per_s: float
    #: Whether copies used pinned host memory.
    pinned_host: bool
    #: (direction, bytes, median seconds) for every measurement, for reports.
    samples: tuple[tuple[str, int, float], ...]


def fit_latency_bandwidth(sizes_bytes: Sequence[int], seconds: Sequence[float]) -> LinkFit:
    """Least-squares fit of ``t = latency + n / bandwidth`` over (size, time) points.

    Needs at least two distinct sizes. A negative intercept (noise) is clamped to zero latency and
    the bandwidth refit through the origin.
    """
    n = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if n.shape != t.shape or len(set(n.tolist())) < 2:
        raise ValueError("need times for at least two distinct sizes")
    slope, intercept = np.polyfit(n, t, 1)
    if intercept < 0:
        slope, intercept = float(np.dot(n, t) / np.dot(n, n)), 0.0
    if slope <= 0:
        raise UserError("calibration failed: transfer time did not grow with size; try larger --sizes")
    return LinkFit(latency_s=float(intercept), bytes_per_s=float(1.0 / slope))


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_link(*, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 5) -> Calibration:
    """Time host<->device copies on JAX's default device; raises NoAcceleratorError on CPU."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "cpu":
        raise NoAcceleratorError("no accelerator: JAX's default backend is cpu; calibrate needs a TPU or GPU")
    dev = jax.devices()[0]
    if len(set(int(s) for s in sizes_bytes)) < 2:
        raise UserError("calibrate needs at least two distinct --sizes")
    kinds = {m.kind for m in dev.addressable_memories()} if hasattr(dev, "addressable_memories") else set()
    pinned = "pinned_host" in kinds
    dev_sharding = jax.sharding.SingleDeviceSharding(dev)
    host_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host") if pinned else None

    def to_host(x: Any) -> Any:
        if host_sharding is not None:
            return jax.device_put(x, host_sharding).block_until_ready()
        return np.asarray(x)

    def to_device(h: Any) -> Any:
        return jax.device_put(h, dev_sharding).block_until_ready()

    samples: list[tuple[str, int, float]] = []
    for n in sorted(int(s) for s in sizes_bytes):
        count = max(n // 4, 1)
        on_device = [jnp.full((count,), i, dtype=jnp.float32, device=dev).block_until_ready()
                     for i in range(repeats + 1)]
        host = to_host(on_device[0])
        to_device(host)  # warm-up both paths
        it = iter(on_device[1:])
        # A fresh device array per repeat: numpy caches the host copy of an array it has seen.
        # (each lambda is called within its iteration: B023's late binding cannot bite)
        samples.append(("d2h", count * 4, _median_time(lambda: to_host(next(it)), repeats)))  # noqa: B023
        samples.append(("h2d", count * 4, _median_time(lambda: to_device(host), repeats)))  # noqa: B023
        del on_device

    d2h = fit_latency_bandwidth([s[1] for s in samples if s[0] == "d2h"], [s[2] for s in samples if s[0] == "d2h"])
    h2d = fit_latency_bandwidth([s[1] for s in samples if s[0] == "h2d"], [s[2] for s in samples if s[0] == "h2d"])

    # Duplex: both directions at once from two threads, at the largest size.
    n = max(int(s) for s in sizes_bytes)
    count = max(n // 4, 1)
    src_dev = [jnp.full((count,), i, dtype=jnp.float32, device=dev).block_until_ready() for i in range(repeats)]
    src_host = to_host(jnp.zeros((count,), jnp.float32, device=dev))
    barrier = threading.Barrier(2)
    elapsed: dict[str, float] = {}

    def worker(direction: str) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        for i in range(repeats):
            if direction == "d2h":
                to_host(src_dev[i])
            else:
                to_device(src_host)
        elapsed[direction] = time.perf_counter() - t0

    threads = [threading.Thread(target=worker, args=(d,)) for d in ("d2h", "h2d")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    moved = count * 4 * repeats
    return Calibration(
        device_kind=str(dev.device_kind),
        platform=str(dev.platform),
        d2h=d2h,
        h2d=h2d,
        duplex_d2h_bytes_per_s=min(moved / elapsed["d2h"], d2h.bytes_per_s),
        duplex_h2d_bytes_per_s=min(moved / elapsed["h2d"], h2d.bytes_per_s),
        pinned_host=pinned,
        samples=tuple(samples),
    )


def calibrated_profile(base: DeviceProfile, cal: Calibration, *, name: str | None = None,
                       when: _dt.datetime | None = None) -> DeviceProfile:
    """``base`` with the measured host-link numbers; sources say where and when they were measured."""
    stamp = (when or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
    sizes = sorted({s[1] for s in cal.samples})
    note = (f"measured by hloopt calibrate on {cal.device_kind} ({cal.platform}) at {stamp}, "
            f"{'pinned_host' if cal.pinned_host else 'numpy'} host buffers, sizes "
            f"{', '.join(format_bytes(s) for s in sizes)}")
    latency = (cal.d2h.latency_s + cal.h2d.latency_s) / 2
    p = base.with_overrides(
        d2h_bytes_per_s=cal.d2h.bytes_per_s,
        h2d_bytes_per_s=cal.h2d.bytes_per_s,
        duplex_d2h_bytes_per_s=min(cal.duplex_d2h_bytes_per_s, cal.d2h.bytes_per_s),
        duplex_h2d_bytes_per_s=min(cal.duplex_h2d_bytes_per_s, cal.h2d.bytes_per_s),
        transfer_latency_s=latency,
        source=note,
    )
    if name is not None:
        import dataclasses

        p = dataclasses.replace(p, name=name)
    return p
