"""``hloopt measure TARGET``: run the step with the plan and the built-in policies; predicted vs measured."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from hloopt.measure import Measurement

from hloopt.cli.params import device_options, profile_from_options, user_errors


@click.command()
@click.argument("target")
@click.option("--plan", "plan_path", default=None, type=click.Path(dir_okay=False),
              help="plan.json from `hloopt plan`: measure its policy (and predict with its device).")
@click.option("--policies", type=click.Choice(["builtin", "none"]), default="builtin", show_default=True,
              help="Also measure JAX's built-in policies (and MaxText's presets where they apply).")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Timed steps per policy.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed steps first (the first call may include one-time work).")
@click.option("--back-to-back", type=click.IntRange(min=1), default=None,
              help="Calls queued per timed sample, each dispatched before the previous is waited for, as a "
                   "training loop runs them: a sample is the steady-state time per step. 1 times each call alone "
                   "(latency, the host's dispatch included). Default: 4 on an accelerator, 1 on the CPU backend "
                   "(which runs independent calls at once).")
@click.option("--budget", default=None,
              help="Leave out built-in policies predicted over this (a size or a share of the all-saved peak); "
                   "default: the plan's budget.")
@click.option("--size", default=None, help="Size passed to a zoo factory (tiny, small, large).")
@click.option("--compile", "compile_target", default=None,
              help="Predict on the compiler's scheduled HLO (cpu, tpu-v5e, ...) instead of the lowered one.")
@device_options
@click.option("--json", "as_json", is_flag=True, help="Print the measurement as JSON only.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
def measure(target: str, plan_path: str | None, policies: str, steps: int, warmup: int, back_to_back: int | None,
            budget: str | None, size: str | None, compile_target: str | None, as_json: bool, quiet: bool,
            **device_kw: object) -> int:
    """Time TARGET's step on the current JAX device with each policy; show predicted beside measured."""
    with user_errors():
        from hloopt.measure import measure as run_measure
        from hloopt.report.terminal import make_console, progress
        from hloopt.targets import resolve

        console = make_console(quiet=quiet or as_json)
        profile, why = _profile(plan_path, device_kw)
        tgt = resolve(target, size=size)
        m = run_measure(tgt, profile=profile, plan=plan_path, policies=policies, steps=steps, warmup=warmup,
                        back_to_back=back_to_back, budget=budget, compile=compile_target,
                        progress=lambda label: progress(label, console=console, quiet=quiet or as_json))
        if as_json:
            d = m.to_dict()
            if why:
                d["notes"].append(why)
            sys.stdout.write(json.dumps(d, indent=2) + "\n")
            return 0
        _print(m, console, why)
        return 0


def _profile(plan_path: str | None, device_kw: dict[str, object]) -> tuple[Any, str | None]:
    """The profile predictions use: --device/--device-file, else the plan's, else one guessed from
    the JAX device, else tpu-v5e with a note (the CPU has no built-in profile)."""
    from hloopt.devices import profile_from_dict

    if device_kw.get("device") or device_kw.get("device_file"):
        return profile_from_options(**device_kw), None  # type: ignore[arg-type]
    if plan_path:
        from hloopt.emit import load_plan

        p = load_plan(plan_path)
        return profile_from_dict(p.device, origin=f"{plan_path}: device"), None
    import jax

    import hloopt.lowering  # noqa: F401  (JAX_PLATFORMS before jax starts)
    from hloopt.cli.calibrate_cmd import _guess_base

    kind = str(jax.devices()[0].device_kind)
    try:
        name, why = _guess_base(kind), None
    except Exception:
        name = "tpu-v5e"
        why = (f"no built-in profile for {kind!r} ({jax.default_backend()}): predictions use tpu-v5e, so compare "
               "ranks, not absolute times (pass --device-file from `hloopt calibrate --profile` to predict this "
               "device)")
    return profile_from_options(**{**device_kw, "default": name}), why  # type: ignore[arg-type]


def _print(m: Measurement, console: Any, why: str | None) -> None:
    from rich.table import Table

    from hloopt.units import format_bytes, format_seconds

    mm = m
    t = Table(title=f"{mm.target} on {mm.device_kind} ({mm.platform}): predicted for {mm.profile} vs measured, "
                    f"median of {mm.steps} samples after {mm.warmup} warm-up"
                    + (f", each {mm.back_to_back} steps queued back to back" if mm.back_to_back > 1 else ""),
                    title_justify="left")
    for col in ("policy", "pred. time", "pred. peak", "to host", "pred. rank", "meas. time (median)", "min..max",
                "meas. rank", "device peak", "host peak RSS", "XLA temp"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in mm.rows:
        label = "[bold]hloopt plan[/bold]" if r.kind == "plan" else f"{r.kind}: {r.name}"
        pred = [format_seconds(r.predicted_step_time_s), format_bytes(r.predicted_peak_bytes),
                format_bytes(r.predicted_host_bytes) if r.predicted_host_bytes else "-", str(r.predicted_rank or "-")]
        if r.measured is None:
            t.add_row(label, *pred, r.skipped or f"failed: {r.error}", "", "", "", "", "")
            continue
        x = r.measured
        dpeak = "n/a" if r.device_peak_bytes is None else format_bytes(r.device_peak_bytes) + (
            "" if r.device_peak_is_own else " (earlier)")
        t.add_row(label, *pred, format_seconds(x.median_s), f"{format_seconds(x.min_s)}..{format_seconds(x.max_s)}",
                  str(r.measured_rank), dpeak,
                  "-" if r.host_peak_rss_bytes is None else format_bytes(r.host_peak_rss_bytes),
                  "-" if r.compiled_temp_bytes is None else format_bytes(r.compiled_temp_bytes))
    console.print(t)
    if mm.rank_agreement is not None:
        console.print(f"rank agreement (Kendall tau, predicted vs measured time): {mm.rank_agreement:+.2f}")
    if mm.device_peak_note:
        console.print(f"device peak n/a: {mm.device_peak_note}")
    for n in (*mm.notes, *([why] if why else [])):
        console.print(f"note: {n}")
