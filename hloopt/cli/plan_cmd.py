"""``hloopt plan TARGET --device tpu-v5e --budget 75%``: the decision table, figures and the policy."""

from __future__ import annotations

import json
import sys

import click

from hloopt.cli.params import Percent, check_output, device_options, libtpu_option, profile_from_options, user_errors


@click.command()
@click.argument("target")
@libtpu_option
@device_options
@click.option("--budget", default=None,
              help="Device memory to fit: a size (12GiB) or a share of the all-on-device peak (75%).")
@click.option("--max-slowdown", type=Percent, default=None,
              help="Least peak with the step at most this much slower (3%).")
@click.option("--pareto", is_flag=True, help="The frontier of peak vs step time.")
@click.option("--solver", type=click.Choice(["auto", "milp", "heuristic"]), default="auto", show_default=True)
@click.option("--time-limit", "time_limit_s", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True,
              help="Seconds the MILP solver may take in all (a plan is always returned; raise it for a smaller gap).")
@click.option("--platform", type=click.Choice(["tpu", "cuda", "cpu"]), default=None,
              help="Platform to lower for (default: the device's).")
@click.option("--compile", "compile_target", default=None,
              help="Plan on the compiler's scheduled HLO (cpu, tpu-v5e, ...) instead of the lowered one.")
@click.option("--size", default=None, help="Size passed to a zoo factory (tiny, small, large).")
@click.option("--judge", type=click.Choice(["flops", "compiled", "measured"]), default="flops", show_default=True,
              help="Compare the searched plan with JAX's built-in policies by FLOPs as lowered; or compile each "
                   "with libtpu for the TPU profile (one compile each) and take the least roofline time of "
                   "what it compiled among those within the budget; or (measured, with --budget, on a machine "
                   "with the profile's device) also run the plan and each built-in policy and MaxText preset "
                   "predicted within the budget on that device and take the fastest JAX built-in (a faster MaxText "
                   "preset is named in a note).")
@click.option("--measure-steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Timed steps per policy with --judge measured.")
@click.option("--objective", type=click.Choice(["time", "flops"]), default="time", show_default=True,
              help="What the search minimises: the step time, every transfer to host memory timed at the link's "
                   "rates; or the fewest recomputed FLOPs that fit, no weight on waiting for the link (memory is "
                   "counted at the link's rates either way).")
@click.option("--out", "out_path", default=None, help="Write plan.json here.")
@click.option("--emit", "emit_format", type=click.Choice(["python", "maxtext", "json"]), default="python",
              show_default=True, help="What to print after the tables.")
@click.option("--html", "html_path", default=None, help="Also write an HTML report.")
@click.option("--force", is_flag=True, help="Overwrite files hloopt did not write.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON only.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@click.option("--state", "plan_state", is_flag=True,
              help="Also place the step's arguments it updates (parameters, optimizer state) in host memory, "
                   "or compute the optimizer update on the host, in the same search.")
@click.option("--host-budget", default=None, help="Host memory the plan may fill (e.g. 64GiB; with --state; "
              "default: the device profile's host memory per chip).")
@click.option("--host", "host_profile", default=None,
              help="Host CPU profile timing a host update (with --state; see hloopt devices --hosts).")
def plan(target: str, budget: str | None, max_slowdown: float | None, pareto: bool, solver: str,
         time_limit_s: float, platform: str | None, compile_target: str | None, size: str | None,
         out_path: str | None, emit_format: str, html_path: str | None, force: bool, as_json: bool,
         quiet: bool, plan_state: bool = False, host_budget: str | None = None, host_profile: str | None = None,
         judge: str = "flops", objective: str = "time", measure_steps: int = 10, **device_kw: object) -> int:
    """Plan what to offload (or recompute) so TARGET fits the budget at the least step time."""
    with user_errors():
        from hloopt import pipeline
        from hloopt.report.terminal import make_console, progress
        from hloopt.units import parse_budget

        if budget is not None:
            parse_budget(budget)  # a malformed budget is one line before any work
        pipeline.check_objective(objective, budgeted=budget is not None and not pareto)
        if host_budget is not None:
            from hloopt.units import parse_bytes

            parse_bytes(host_budget)
        if host_profile is not None:
            from hloopt.hosts import load_host_profile

            load_host_profile(host_profile)
        budget_spec = budget
        profile = profile_from_options(**device_kw)  # type: ignore[arg-type]
        check_output(out_path, force=force)  # refuse before minutes of work, and before writing either
        check_output(html_path, force=force)
        console = make_console(quiet=quiet or as_json)

        def prog(label: str):  # type: ignore[no-untyped-def]
            return progress(label, console=console, quiet=quiet or as_json)

        outcome = pipeline.plan(target, profile=profile, budget=budget_spec, max_slowdown=max_slowdown,
                                pareto=pareto, platform=platform, compile=compile_target, solver=solver,
                                time_limit_s=time_limit_s, size=size, progress=prog, state=plan_state,
                                host_budget=host_budget, host=host_profile, judge=judge,
                                objective=objective, measure_steps=measure_steps)
        text = outcome.plan.to_json()
        if out_path:
            from hloopt.fileio import write_text_atomic

            write_text_atomic(out_path, text, force=force)
        if html_path:
            from hloopt.fileio import write_text_atomic
            from hloopt.report.adapt import report_data_from_outcome
            from hloopt.report.html import render_html

            write_text_atomic(html_path, render_html(report_data_from_outcome(outcome)), force=force)
        if as_json:
            sys.stdout.write(text)
            return 0
        _print_outcome(outcome, console)
        if outcome.plan.measured is not None:
            _print_measured(outcome.plan, console)
        if outcome.plan.state:
            _print_state(outcome.plan, console, outcome.problem)
        if emit_format == "python":
            from hloopt.emit import python_snippet

            console.print("\n[bold]Policy[/bold] (paste into your jax.checkpoint):")
            click.echo(python_snippet(outcome.plan))
        elif emit_format == "maxtext":
            _print_maxtext(outcome, console)
        else:
            click.echo(text)
        if out_path:
            console.print(f"wrote {out_path}")
        if html_path:
            console.print(f"wrote {html_path}")
        return 0


def _print_measured(plan: object, console: object) -> None:
    """The policies ``--judge measured`` ran on the device, fastest first, and the one taken."""
    from rich.table import Table

    from hloopt.units import format_seconds

    m = plan.measured  # type: ignore[attr-defined]
    t = Table(title=f"Measured on the {m.device_kind} ({m.steps} timed steps each; the plan is the row marked *)",
              title_justify="left")
    for col in ("policy", "median", "quartiles"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in sorted(m.rows, key=lambda r: r.median_s):
        t.add_row(("* " if r.name == m.chosen else "  ") + r.name, format_seconds(r.median_s),
                  f"{format_seconds(r.q1_s)} - {format_seconds(r.q3_s)}")
    console.print(t)  # type: ignore[attr-defined]


def _print_state(plan: object, console: object, problem: object) -> None:
    """Where the plan puts each argument group, the compute on each side, and how to apply it to
    the step as written."""
    from hloopt.units import format_bytes, format_seconds

    console.print("\n[bold]Arguments[/bold] (--state):")  # type: ignore[attr-defined]
    if plan.host_peak_bytes is not None and plan.host_budget_bytes is not None:  # type: ignore[attr-defined]
        click.echo(f"  host memory: {format_bytes(plan.host_peak_bytes)} at most, "  # type: ignore[attr-defined]
                   f"of {format_bytes(plan.host_budget_bytes)} allowed")  # type: ignore[attr-defined]
    device_s, host_s = problem.compute_seconds(  # type: ignore[attr-defined]
        (d.key for d in plan.of("remat")), host_update=plan.host_update)  # type: ignore[attr-defined]
    click.echo(f"  compute per step: device {format_seconds(device_s)}, host {format_seconds(host_s)}"
               + (" (the optimizer update)" if host_s else ""))
    for s in plan.state:  # type: ignore[attr-defined]
        click.echo(f"  {s.placement:<12} {s.group:<28} {format_bytes(s.bytes):>10}  {s.reason}")
    if plan.host_groups and not plan.host_update:  # type: ignore[attr-defined]
        click.echo("  apply:  step, args = hloopt.apply_plan('plan.json', step, args)   "
                   "# pinned_host shardings on those arguments and their updates")
    if plan.host_update:  # type: ignore[attr-defined]
        click.echo("  apply:  write the optimizer update as  params, opt_state = "
                   "hloopt.state.on_host(update)(grads, opt_state, params)")
        click.echo("          and call  step, args = hloopt.apply_plan('plan.json', step, args)  "
                   "so the optimizer state is a host argument and output")


def _print_maxtext(outcome: object, console: object) -> None:
    """The plan as MaxText keys. Where MaxText cannot express all of it (rules for values without
    a MaxText checkpoint_name, which MaxText recomputes), the keys printed are those of the best
    plan MaxText's keys alone express, with its own prediction; comments in the YAML say so and
    what the full plan (applied with ``hloopt.use_plan``) predicts: the YAML is read the same
    with ``-q``."""
    from hloopt import pipeline
    from hloopt.emit import MAXTEXT_NAMES, maxtext_unexpressible, maxtext_yaml
    from hloopt.units import format_bytes, format_seconds

    plan = outcome.plan  # type: ignore[attr-defined]
    console.print("\n[bold]MaxText config[/bold]:")  # type: ignore[attr-defined]
    # values that can be recomputed: what MaxText does with any it is not told about
    choosable = [c.key for c in outcome.problem.candidates if any(a.value == "remat" for a in c.allowed)]  # type: ignore[attr-defined]
    missing = maxtext_unexpressible(plan, choosable)
    if not missing:
        click.echo(maxtext_yaml(plan, strict=False))
        return
    pr = plan.predicted
    alt = pipeline.config_only_plan(outcome, MAXTEXT_NAMES)  # type: ignore[arg-type]
    head = (f"# MaxText's keys cannot express {len(missing)} of this plan's decisions (values without a MaxText\n"
            f"# checkpoint_name, which MaxText recomputes); the full plan, applied with hloopt.use_plan,\n"
            f"# predicts {format_bytes(pr.peak_bytes)}, {format_seconds(pr.step_time_s)}.")
    if alt is None:
        click.echo(head + "\n# No plan MaxText's keys alone can express fits the budget; its keys, not enough alone:")
        click.echo(maxtext_yaml(plan, strict=False))
        return
    ap = alt.predicted
    click.echo(head + f"\n# The best plan MaxText's keys alone express: {format_bytes(ap.peak_bytes)}, "
               f"{format_seconds(ap.step_time_s)}:")
    click.echo(maxtext_yaml(alt, strict=False))


def _print_outcome(outcome: object, console: object, *, limit: int = 12) -> None:
    from rich.table import Table

    from hloopt.emit import builtin_code
    from hloopt.units import format_bytes, format_seconds

    o = outcome  # type: ignore[assignment]
    p = o.plan  # type: ignore[attr-defined]
    t = Table(title=f"Plan for {p.target} ({p.module}) on {o.problem.device}", title_justify="left")  # type: ignore[attr-defined]
    for col, just in (("selected by", "left"), ("shape", "left"), ("layers", "right"), ("bytes", "right"),
                      ("action", "left"), ("why", "left")):
        t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    moved = [d for d in p.decisions if d.action != "device"]
    kept = [d for d in p.decisions if d.action == "device"]
    shown = moved + kept[: max(0, limit - len(moved))]
    for d in sorted(shown, key=lambda d: (-d.bytes, d.key)):
        style = {"offload": "cyan", "remat": "yellow"}.get(d.action, "")
        sel = (f"checkpoint_name {d.name!r}" if d.name else
               f"{d.selector.primitive}" + (f" @ {d.source}" if d.source else ""))
        t.add_row(sel, d.shape, str(d.layers), format_bytes(d.bytes),
                  f"[{style}]{d.action}[/{style}]" if style else d.action, d.reason)
    rest = [d for d in p.decisions if d not in shown]
    if rest:
        t.add_row(f"... {len(rest)} smaller residuals", "", "", format_bytes(sum(d.bytes for d in rest)),
                  "device", "")
    console.print(t)  # type: ignore[attr-defined]
    pr = p.predicted
    s = Table(title="Replayed by the search (one linear count of the all-saved step judges every row)",
              title_justify="left")
    for col in ("policy", "peak", "step time", "exposed transfer"):
        s.add_column(col, justify="left" if col == "policy" else "right")
    budget = p.budget.bytes if p.budget else None
    s.add_row("all residuals on device", format_bytes(pr.baseline_peak_bytes),
              format_seconds(pr.baseline_step_time_s), "-")
    # the rows are the replay's figures (one count for every policy); the plan's own predicted
    # peak, the memory model's of the step lowered with it, is printed below the table
    plan_peak = format_bytes(pr.replay_peak_bytes if pr.replay_peak_bytes is not None else pr.peak_bytes)
    s.add_row("[bold]hloopt plan[/bold]", plan_peak, format_seconds(pr.step_time_s),
              format_seconds(pr.exposed_transfer_s))
    judged = o.aim_bytes if o.aim_bytes is not None else budget  # type: ignore[attr-defined]
    for a in o.anchors:  # type: ignore[attr-defined]
        fits = "" if judged is None else (" (fits)" if a.peak_bytes <= judged else " (over)")
        s.add_row(f"{a.kind}: {a.name}", format_bytes(a.peak_bytes) + fits, format_seconds(a.step_time_s), "")
    console.print(s)  # type: ignore[attr-defined]
    if o.lowered_rows:  # type: ignore[attr-defined]
        compiled = o.judge == "compiled"  # type: ignore[attr-defined]
        m = Table(title="Compiled by libtpu with each policy (its peak; the compiled module's roofline)" if compiled
                  else "Lowered with each policy (the memory model's peak; FLOPs as lowered)", title_justify="left")
        for col in ("policy", "peak", "roofline" if compiled else "GFLOP"):
            m.add_column(col, justify="left" if col == "policy" else "right")
        chosen = builtin_code(p.builtin) if p.builtin else "hloopt's searched rules"
        for name, peak, value in o.lowered_rows:  # type: ignore[attr-defined]
            fits = "" if budget is None else (" (fits)" if peak <= budget else " (over)")
            m.add_row(f"[bold]{name}[/bold] (the plan)" if name == chosen else name, format_bytes(peak) + fits,
                      format_seconds(value) if compiled else f"{value / 1e9:.4g}")
        console.print(m)  # type: ignore[attr-defined]
    if o.judged_rows:  # type: ignore[attr-defined]
        j = Table(title="Offloading policies and MaxText presets, each lowered and judged (the memory model's peak; "
                        "FLOPs; bytes to host; predicted step time, transfers included)", title_justify="left")
        for col in ("policy", "peak", "GFLOP", "to host", "step time"):
            j.add_column(col, justify="left" if col == "policy" else "right")
        for name, r in o.judged_rows:  # type: ignore[attr-defined]
            fits = "" if budget is None else (" (fits)" if r.peak_bytes <= budget else " (over)")
            if p.builtin is not None and name == builtin_code(p.builtin):
                label = f"[bold]{name}[/bold] (the plan)"
            else:
                label = f"[bold]{name}[/bold]" if name == "hloopt plan" else name
            j.add_row(label, format_bytes(r.peak_bytes) + fits,
                      f"{r.flops / 1e9:.4g}", format_bytes(r.host_bytes) if r.host_bytes else "-",
                      format_seconds(r.step_time_s))
        console.print(j)  # type: ignore[attr-defined]
    b = p.bounds
    line = (f"budget {format_bytes(budget)}; " if budget is not None else "") + \
        f"least peak any policy reaches {format_bytes(b.least_peak_bytes)}; " \
        f"solver {p.solver.name} ({p.solver.status}" + \
        (f", gap {p.solver.gap:.2%}" if p.solver.gap is not None else "") + \
        (f", {p.solver.time_s:.2f} s)" if p.solver.time_s is not None else ")")
    console.print(line)  # type: ignore[attr-defined]
    if p.objective == "flops":
        timed = dict(o.judged_rows).get("hloopt plan")  # type: ignore[attr-defined]
        console.print("objective flops: the search took the fewest recomputed FLOPs that fit, weighing no wait on "  # type: ignore[attr-defined]
                      f"the link; the plan's step waits {format_seconds(pr.exposed_transfer_s)} on it as replayed"
                      + (f", {format_seconds(timed.step_time_s)} per step lowered and judged" if timed is not None
                         else ""), markup=False, highlight=False)
    if o.aim_bytes is not None:  # type: ignore[attr-defined]
        console.print(f"the replay counts more than the memory model with nothing saved here: policies are "  # type: ignore[attr-defined]
                      f"judged against {format_bytes(o.aim_bytes)} in its count, the budget moved by "  # type: ignore[attr-defined]
                      "that gap", markup=False, highlight=False)
    if pr.model_peak_bytes is not None:
        console.print(f"the step lowered with the plan: {format_bytes(pr.model_peak_bytes)} by the memory model "  # type: ignore[attr-defined]
                      "(hloopt analyze's TPU prediction; the plan's predicted peak)", markup=False, highlight=False)
    written = o.as_written_peak_bytes  # type: ignore[attr-defined]
    if written is not None:
        planned = pr.peak_bytes  # the model's figure where the step was lowered with the plan
        console.print(f"the step as written (its own checkpoint policies): {format_bytes(written)} by the memory "  # type: ignore[attr-defined]
                      "model", markup=False, highlight=False)
        # (judged compiled, the plan's figure is libtpu's own: not comparable with the model's)
        if planned > written and o.judge != "compiled":  # type: ignore[attr-defined]
            console.print(f"note: the plan ({format_bytes(planned)}) needs more memory than the step as written; "  # type: ignore[attr-defined]
                          f"--budget {format_bytes(written).replace(' ', '')} or lower plans one that needs no more",
                          markup=False, highlight=False)
    if o.choice_note:  # type: ignore[attr-defined]
        console.print(f"note: {o.choice_note}", markup=False, highlight=False)  # type: ignore[attr-defined]
    for n in o.judged_notes:  # type: ignore[attr-defined]
        console.print(f"note: {n}", markup=False, highlight=False)  # type: ignore[attr-defined]
    if o.settle_note:  # type: ignore[attr-defined]
        console.print(f"warning: {o.settle_note}", markup=False, highlight=False)  # type: ignore[attr-defined]
    if o.policy_note:  # type: ignore[attr-defined]
        console.print(f"warning: {o.policy_note}", markup=False, highlight=False)  # type: ignore[attr-defined]
    hint = o.unmovable_line()  # type: ignore[attr-defined]
    if hint:
        console.print(hint, markup=False, highlight=False)  # type: ignore[attr-defined]


__all__ = ["plan", "json"]
