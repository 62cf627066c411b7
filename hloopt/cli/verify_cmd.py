"""``hloopt verify TARGET --plan PLAN [--compile tpu-v5e] [--json]``: does the policy do what the plan says?

Exit status: 0 when the offloaded set matches the plan (and, compiled, the peak fits the budget),
1 for a mismatch (with a report of what did not move and why), 2 for bad input.
"""

from __future__ import annotations

import json

import click

from hloopt.cli.params import libtpu_option, user_errors


@click.command("verify")
@click.argument("target")
@libtpu_option
@click.option("--plan", "plan_file", required=True, type=click.Path(dir_okay=False),
              help="The plan file (from `hloopt plan`).")
@click.option("--compile", "compile_for", default=None, metavar="TPU",
              help="Also compile deviceless through libtpu (tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e) and check "
                   "XLA's peak against the plan's budget.")
@click.option("--size", default=None, help="Size passed to the target's factory (tiny, small, large): "
              "the one the plan was made with.")
@click.option("--json", "as_json", is_flag=True, help="Print the verification as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
def verify(target: str, plan_file: str, compile_for: str | None, size: str | None, as_json: bool,
           quiet: bool) -> None:
    """Re-lower TARGET with PLAN's policy and check XLA offloads exactly the planned residuals."""
    with user_errors():
        from hloopt.plan import Plan
        from hloopt.report.terminal import progress
        from hloopt.targets import resolve
        from hloopt.verify import verify as run_verify

        plan = Plan.load(plan_file)
        label = "re-lowering with the plan's policy" + (f" and compiling for {compile_for}" if compile_for else "")
        with progress(label, quiet=quiet or as_json):
            result = run_verify(resolve(target, size=size) if size is not None else target, plan,
                                compile=compile_for)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        _show(result)
    if not result.ok:
        click.get_current_context().exit(1)


def _show(r: object) -> None:
    from hloopt.units import format_bytes
    from hloopt.verify import Verification

    assert isinstance(r, Verification)
    click.echo(f"verify {r.target} against plan for {r.plan_target}")
    if not r.checks:
        click.echo("  the plan is a JAX built-in policy: what it offloads is the plan's"
                   if r.annotations and not r.unplanned else "  the plan offloads nothing")
    for c in r.checks:
        mark = "ok " if c.status == "ok" else "BAD"
        click.echo(f"  {mark} {c.selector}: {c.annotated_layers}/{c.planned_layers} layer(s) offloaded, "
                   f"{format_bytes(c.annotated_bytes)} (plan {format_bytes(c.planned_bytes)})"
                   + (f" -- {c.why}" if c.why else ""))
    for shape, n in r.unplanned:
        click.echo(f"  BAD unplanned offload: {n} x {shape}")
    click.echo(f"  offloaded in all: {r.annotated_layers} value(s), {format_bytes(r.annotated_bytes)} "
               "(pre-optimization shapes)")
    if r.memory is not None:
        peak = r.memory.get("peak_memory_in_bytes")
        host = r.memory.get("host_temp_size_in_bytes")
        budget = f", budget {format_bytes(r.budget_bytes)}" if r.budget_bytes is not None else ""
        click.echo(f"  {r.compiled_for}: XLA peak {_b(peak)} (plan predicted {format_bytes(r.predicted_peak_bytes)}"
                   f"{budget}), host temp {_b(host)}")
    if r.modeled_peak_bytes is not None:
        click.echo(f"  memory model (pre-optimization, TPU): peak {format_bytes(r.modeled_peak_bytes)} "
                   f"(plan predicted {format_bytes(r.predicted_peak_bytes)})")
    for w in r.warnings:
        click.echo(f"  warning: {w}")
    click.echo("OK: the policy offloads exactly the plan" if r.ok else
               "MISMATCH:\n" + "\n".join(f"  {p}" for p in r.problems))


def _b(n: int | None) -> str:
    from hloopt.units import format_bytes

    return "?" if n is None else f"{format_bytes(n)} ({n} bytes)"
