"""``hloopt report TARGET|plan.json|report.json -o report.html``: the HTML report (and a terminal summary)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hloopt.cli.params import BudgetType, device_options, profile_from_options, user_errors
from hloopt.errors import UserError


def _report_data(source: str, *, profile_dict: dict, budget_bytes: int | None):
    """ReportData for a HLO file / dump folder, a saved ReportData JSON, or a plan file."""
    from hloopt.report import ReportData, ResidualRow

    path = Path(source)
    if path.suffix == ".json" and path.is_file():
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise UserError(f"{source}: not readable JSON ({err})") from None
        if isinstance(obj, dict) and "step_labels" in obj:
            try:
                return ReportData.from_dict(obj)
            except (TypeError, ValueError) as err:
                raise UserError(f"{source}: not a valid report data file ({err})") from None
        if isinstance(obj, dict) and str(obj.get("schema", "")).startswith("hloopt.plan/"):
            from dataclasses import replace

            from hloopt.plan import Plan

            plan = Plan.load(source)
            data = _report_data(plan.target, profile_dict=dict(plan.device),
                                budget_bytes=plan.budget.bytes if plan.budget else budget_bytes)
            rows = tuple(ResidualRow(key=d.key, name=d.name or d.key, shape=d.shape, bytes=d.bytes, layers=d.layers,
                                     action=d.action, reason=d.reason, source=d.source) for d in plan.decisions)
            return replace(data, residuals=rows, plan_step_time_s=plan.predicted.step_time_s,
                           baseline_step_time_s=plan.predicted.baseline_step_time_s)
        raise UserError(f"{source}: a JSON file here must be a plan (hloopt.plan/1) or saved report data")
    from hloopt.hlo.parser import parse_module
    from hloopt.report.approx import report_data_from_module
    from hloopt.targets import resolve

    target = resolve(source)
    if target.kind == "jax" or target.text is None:
        raise UserError(f"{source}: report reads HLO files, XLA dump folders, plan files and report data; "
                        "for a JAX TARGET run `hloopt plan` first and report its plan")
    module = parse_module(target.text, filename=str(target.path or source))
    if module.entry is None:
        raise UserError(f"{source}: the HLO module has no ENTRY computation")
    return report_data_from_module(module, profile_dict, budget_bytes=budget_bytes)


@click.command("report")
@click.argument("source", metavar="TARGET|PLAN.json")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default=None,
              help="Write the self-contained HTML report here.")
@click.option("--budget", "budget", type=BudgetType, default=None, metavar="SIZE|PCT",
              help="Budget line to draw, e.g. 12GiB or 75%.")
@click.option("--json", "as_json", is_flag=True, help="Print the report data as JSON instead of tables.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@device_options
def report(source: str, output: str | None, budget, as_json: bool, quiet: bool, device: str | None,
           device_file: str | None, hbm: int | None, d2h: float | None, h2d: float | None) -> None:
    """Report what fills device memory: tables here, and an HTML page with -o."""
    from hloopt.report.terminal import make_console, print_report, progress

    with user_errors():
        profile = profile_from_options(device=device, device_file=device_file, hbm=hbm, d2h=d2h, h2d=h2d,
                                       default="tpu-v5e")
        budget_bytes = budget.resolve(profile.hbm_bytes) if budget is not None else None
        console = make_console(quiet=quiet or as_json)
        with progress("analyzing", console=make_console(stderr=True), quiet=quiet or as_json):
            data = _report_data(source, profile_dict=profile.to_dict(), budget_bytes=budget_bytes)
        if output:
            from hloopt.report.html import render_html

            try:
                Path(output).write_text(render_html(data), encoding="utf-8")
            except OSError as err:
                raise UserError(f"{output}: cannot write the report ({err.strerror})") from None
    if as_json:
        click.echo(data.to_json())
        return
    print_report(data, console)
    if output:
        console.print(f"wrote {output}")
