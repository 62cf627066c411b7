"""``hloopt calibrate``: measure this machine's host<->device link and write a device profile."""

from __future__ import annotations

from pathlib import Path

import click

from hloopt.cli.params import Size, user_errors
from hloopt.units import format_rate, format_seconds


@click.command("calibrate")
@click.option("--base", default=None, metavar="NAME",
              help="Built-in profile to start from (HBM, FLOP/s...); default: guessed from the device.")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="Write the calibrated profile here (.toml or .json).")
@click.option("--sizes", "sizes", type=Size, multiple=True, metavar="SIZE",
              help="Transfer sizes to time (repeatable), e.g. --sizes 8MiB --sizes 256MiB.")
@click.option("--repeats", type=click.IntRange(2, 100), default=5, show_default=True,
              help="Timed copies per size and direction.")
def calibrate(base: str | None, out: str | None, sizes: tuple[int, ...], repeats: int) -> None:
    """Time D2H and H2D copies alone and together on the default JAX device; fit latency + bandwidth."""
    from hloopt.calibrate import DEFAULT_SIZES_BYTES, calibrated_profile, measure_link
    from hloopt.devices import load_profile, write_profile

    with user_errors():
        cal = measure_link(sizes_bytes=sizes or DEFAULT_SIZES_BYTES, repeats=repeats)
        profile = load_profile(base or _guess_base(cal.device_kind))
        profile = calibrated_profile(profile, cal, name=f"{profile.name}-calibrated")
        click.echo(f"{cal.device_kind}: D2H {format_rate(cal.d2h.bytes_per_s)} "
                   f"(+{format_seconds(cal.d2h.latency_s)}), H2D {format_rate(cal.h2d.bytes_per_s)} "
                   f"(+{format_seconds(cal.h2d.latency_s)}), duplex D2H/H2D "
                   f"{format_rate(cal.duplex_d2h_bytes_per_s)} / {format_rate(cal.duplex_h2d_bytes_per_s)}")
        if out:
            write_profile(profile, Path(out))
            click.echo(f"wrote {out}")


def _guess_base(device_kind: str) -> str:
    """A built-in profile name from ``jax.Device.device_kind`` (``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``)."""
    k = device_kind.lower()
    table = [("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"), ("v5", "tpu-v5p"), ("v6", "tpu-v6e"),
             ("v4", "tpu-v4"), ("gh200", "gh200"), ("h200", "h200"), ("h100", "h100-sxm"),
             ("a100", "a100-80gb" if "80" in k else "a100-40gb")]
    for needle, name in table:
        if needle in k:
            return name
    from hloopt.errors import UserError

    raise UserError(f"no built-in profile matches device {device_kind!r}; pass --base NAME")
