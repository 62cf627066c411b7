"""``hloopt report TARGET|plan.json|report.json -o report.html``: the HTML report and a terminal summary.

* TARGET (HLO file, XLA dump, ``file.py:factory``): the memory model (``hloopt analyze``).
* plan.json: the plan's target is lowered and analyzed again and the plan's decisions replayed
  by the simulator (baseline vs plan, transfers, decisions), on the plan's device unless a
  device option is given.
* report.json (``--json`` output of this command): re-rendered as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import click

from hloopt.cli.params import BudgetType, device_options, profile_from_options, user_errors
from hloopt.errors import UserError


def report_data(source: str, *, profile: Any, device_given: bool, budget: Any, platform: str | None,
                compile: str | None, size: str | None, progress: Callable[[str], Any]) -> Any:
    """ReportData for a TARGET, a plan file or a saved ReportData JSON (see the module docstring)."""
    from hloopt.report import ReportData

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
            from hloopt.plan import Plan
            from hloopt.report.adapt import outcome_from_plan, report_data_from_outcome

            plan = Plan.load(source)
            outcome = outcome_from_plan(plan, profile=profile if device_given else None, platform=platform,
                                        compile=compile, size=size, progress=progress)
            return report_data_from_outcome(outcome)
        raise UserError(f"{source}: a JSON file here must be a plan (hloopt.plan/1) or saved report data")
    from hloopt.analysis import analyze
    from hloopt.report.adapt import report_data_from_memory

    with progress(f"analyzing {source}"):
        mem = analyze(source, platform=platform, compile=compile, size=size, top=50)
        budget_bytes = budget.resolve(profile.hbm_bytes) if budget is not None else None
        return report_data_from_memory(mem, profile.to_dict(), budget_bytes=budget_bytes, target=source)


@click.command("report")
@click.argument("source", metavar="TARGET|PLAN.json")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default=None,
              help="Write the self-contained HTML report here.")
@click.option("--budget", "budget", type=BudgetType, default=None, metavar="SIZE|PCT",
              help="Budget line to draw for a TARGET, e.g. 12GiB or 75% of HBM (a plan draws its own).")
@click.option("--platform", type=click.Choice(["tpu", "cuda", "cpu"]), default=None,
              help="Platform a JAX TARGET is lowered for / pre-optimization HLO is predicted for.")
@click.option("--compile", "compile_", metavar="TARGET", default=None,
              help="Compile a JAX TARGET with XLA (cpu, tpu-v5e, ...) first; for a plan, as `plan --compile` did.")
@click.option("--size", default=None, help="Size passed to a JAX TARGET's factory (tiny, small, large).")
@click.option("--top", type=click.IntRange(0), default=20, show_default=True,
              help="Buffers live at the peak to list in the terminal.")
@click.option("--force", is_flag=True, help="Overwrite an output file hloopt did not write.")
@click.option("--json", "as_json", is_flag=True, help="Print the report data as JSON instead of tables.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors (and no progress display).")
@device_options
def report(source: str, output: str | None, budget: Any, platform: str | None, compile_: str | None,
           size: str | None, top: int, force: bool, as_json: bool, quiet: bool, device: str | None,
           device_file: str | None,
           hbm: int | None, d2h: float | None, h2d: float | None) -> None:
    """Report what fills device memory: tables here, and an HTML page with -o."""
    from hloopt.report.terminal import make_console, print_report, progress

    with user_errors():
        profile = profile_from_options(device=device, device_file=device_file, hbm=hbm, d2h=d2h, h2d=h2d,
                                       default="tpu-v5e")
        given = any(x is not None for x in (device, device_file, hbm, d2h, h2d))
        console = make_console(quiet=quiet or as_json)
        err = make_console(stderr=True)

        def prog(label: str) -> Any:
            return progress(label, console=err, quiet=quiet or as_json)

        data = report_data(source, profile=profile, device_given=given, budget=budget, platform=platform,
                           compile=compile_, size=size, progress=prog)
        if output:
            from hloopt.fileio import write_text_atomic
            from hloopt.report.html import render_html

            with prog(f"writing {output}"):
                try:
                    write_text_atomic(output, render_html(data), force=force)
                except OSError as e:
                    raise UserError(f"{output}: cannot write the report ({e.strerror})") from None
    if as_json:
        click.echo(data.to_json())
        return
    print_report(data, console, limit=top)
    if output:
        console.print(f"wrote {output}")
