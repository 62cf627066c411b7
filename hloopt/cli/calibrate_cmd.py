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
@click.option("--profile", "trace_dir", default=None, metavar="DIR",
              help="Fit per-op-class efficiency (and link rates, where it has copies) from a "
                   "jax.profiler.trace(DIR) trace instead of timing copies. On GPUs record it with "
                   "XLA_FLAGS=--xla_gpu_enable_command_buffer= (XLA's CUDA graphs hide each op's time).")
@click.option("--target", "target", default=None, metavar="TARGET",
              help="With --profile: the step that was traced (file.py:factory, compiled again on this "
                   "backend), or its optimized HLO (a dump folder or after_optimizations file).")
@click.option("--size", default=None, help="With --profile: size passed to a zoo factory.")
@click.option("--for-compiled", "for_compiled", is_flag=True,
              help="With --profile: fit each kernel as the compiled module's instruction, for predictions "
                   "from the compiled module (--compile). Default: fit the step as lowered, which plan and "
                   "measure time (a JAX TARGET; an HLO target is always fitted as compiled).")
def calibrate(base: str | None, out: str | None, sizes: tuple[int, ...], repeats: int, trace_dir: str | None,
              target: str | None, size: str | None, for_compiled: bool) -> None:
    """Time D2H and H2D copies alone and together on the default JAX device; fit latency + bandwidth.

    With --profile DIR: read the profiler trace there instead, fit how close each op class
    (dot, convolution, reduction, elementwise...) comes to the base profile's roofline, and take
    the link's rates from the trace's host<->device copies where it has any.
    """
    from hloopt.calibrate import DEFAULT_SIZES_BYTES, calibrated_profile, measure_link
    from hloopt.devices import load_profile, write_profile

    if trace_dir is not None:
        with user_errors():
            _from_trace(trace_dir, target, size, base, out, for_compiled=for_compiled)
        return
    if target is not None or size is not None or for_compiled:
        with user_errors():
            from hloopt.errors import UserError

            raise UserError("--target, --size and --for-compiled go with --profile DIR")
    with user_errors():
        cal = measure_link(sizes_bytes=sizes or DEFAULT_SIZES_BYTES, repeats=repeats)
        profile = load_profile(base or _guess_base(cal.device_kind))
        profile = calibrated_profile(profile, cal, name=f"{profile.name}-calibrated")
        click.echo(f"{cal.device_kind}: D2H {format_rate(cal.d2h.bytes_per_s)} "
                   f"(+{format_seconds(cal.d2h.latency_s)}), H2D {format_rate(cal.h2d.bytes_per_s)} "
                   f"(+{format_seconds(cal.h2d.latency_s)}), duplex D2H/H2D "
                   + (f"{format_rate(cal.duplex_d2h_bytes_per_s)} / {format_rate(cal.duplex_h2d_bytes_per_s)}"
                      if cal.duplex_d2h_bytes_per_s is not None and cal.duplex_h2d_bytes_per_s is not None
                      else "not measured (the base profile's ratio kept)"))
        if out:
            write_profile(profile, Path(out))
            click.echo(f"wrote {out}")


def _from_trace(trace_dir: str, target: str | None, size: str | None, base: str | None, out: str | None, *,
                for_compiled: bool = False) -> None:
    from hloopt.calibrate import (
        compiled_module_for,
        fit_trace,
        fit_trace_lowered,
        lowered_module_for,
        trace_calibrated_profile,
    )
    from hloopt.devices import load_profile, write_profile
    from hloopt.errors import UserError
    from hloopt.profile_trace import read_trace
    from hloopt.targets import resolve
    from hloopt.units import format_rate, format_seconds

    if target is None:
        raise UserError("--profile DIR needs --target: the step that was traced (its compiled module names the ops)")
    if base is None:
        import jax

        import hloopt.lowering  # noqa: F401  (JAX_PLATFORMS before jax starts)

        base = _guess_base(str(jax.devices()[0].device_kind))
    trace = read_trace(trace_dir)
    tgt = resolve(target, size=size, stage="after")
    module = compiled_module_for(tgt)
    profile = load_profile(base)
    if for_compiled or tgt.kind != "jax":
        cal = fit_trace(trace, module, profile)
        unit = "each kernel as the compiled instruction it runs"
    else:
        cal = fit_trace_lowered(trace, module, lowered_module_for(tgt, profile), profile)
        unit = "the step as lowered (what plan times), kernel time attributed by op name"
    profile = trace_calibrated_profile(profile, cal, name=f"{profile.name}-calibrated")
    click.echo(f"{cal.trace}: {len(cal.step_wall_s)} runs of {cal.module}, {cal.matched_events} op events matched"
               + (f", {len(cal.unmatched_ops)} op names not in the module" if cal.unmatched_ops else ""))
    click.echo(f"  fitted: {unit}")
    for f in cal.fits:
        click.echo(f"  {f.op_class:<14} {f.events:>5} events  {format_seconds(f.measured_s):>9}  "
                   f"{f.achieved_flops_per_s:.3g} FLOP/s  {format_rate(f.achieved_bytes_per_s):>10}  "
                   f"efficiency {f.efficiency:.3g} of {profile.name.removesuffix('-calibrated')}'s roofline")
    if cal.d2h_bytes_per_s is None and cal.h2d_bytes_per_s is None:
        click.echo("  host link: no host<->device copies in the trace; the base profile's figures are kept")
    else:
        click.echo(f"  host link: D2H {format_rate(cal.d2h_bytes_per_s) if cal.d2h_bytes_per_s else '-'}, "
                   f"H2D {format_rate(cal.h2d_bytes_per_s) if cal.h2d_bytes_per_s else '-'}")
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
