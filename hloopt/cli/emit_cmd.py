"""``hloopt emit PLAN --format python|maxtext|json|hlo [-o FILE]``: a plan as code, config or HLO."""

from __future__ import annotations

import click

from hloopt.cli.params import user_errors

FORMATS = ("python", "maxtext", "json", "hlo")


@click.command("emit")
@click.argument("plan_file", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="python", show_default=True,
              help="python: a jax checkpoint policy; maxtext: a custom remat_policy yml fragment; "
                   "json: the plan, normalized; hlo: the plan's module with its offloads annotated.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write to FILE (atomically) instead of standard output.")
@click.option("--force", is_flag=True, help="Overwrite an existing FILE that hloopt did not write.")
@click.option("--hlo", "hlo_file", type=click.Path(dir_okay=False), default=None,
              help="--format hlo: the module to annotate (default: the plan's target, lowered again).")
@click.option("--lenient", is_flag=True,
              help="--format maxtext: list decisions MaxText cannot express in a comment instead of failing.")
def emit(plan_file: str, fmt: str, output: str | None, force: bool, hlo_file: str | None, lenient: bool) -> None:
    """Write PLAN (from `hloopt plan`) as a JAX policy, a MaxText config, JSON or annotated HLO."""
    with user_errors():
        from hloopt import emit as emitters
        from hloopt.fileio import write_text_atomic
        from hloopt.plan import Plan

        plan = Plan.load(plan_file)
        if hlo_file is not None and fmt != "hlo":
            raise click.UsageError("--hlo applies to --format hlo only")
        if fmt == "python":
            text = emitters.python_snippet(plan)
        elif fmt == "maxtext":
            text = emitters.maxtext_yaml(plan, strict=not lenient)
        elif fmt == "json":
            text = plan.to_json()
        else:
            text = emitters.annotate_hlo(_module_text(plan, hlo_file), plan)
        if output is None:
            click.echo(text, nl=False)
        else:
            write_text_atomic(output, text, force=force)
            click.echo(f"wrote {output}", err=True)


def _module_text(plan: object, hlo_file: str | None) -> object:
    from hloopt.targets import resolve

    if hlo_file is not None:
        target = resolve(hlo_file)
    else:
        target = resolve(plan.target)  # type: ignore[attr-defined]
    if target.kind != "jax":
        from hloopt.hlo.parser import parse_module

        assert target.text is not None
        # Parsed here so that a parse error names the file (annotate_hlo would say <module name>).
        return parse_module(target.text, filename=str(target.path or target.name))
    from hloopt.passes.inline import inline_for_assignment
    from hloopt.pipeline import lower_for_plan

    # The plan's values name instructions of the module it was made on: the step lowered with
    # every residual saved, calls inlined (hloopt.pipeline.lower_for_plan, analyze_module).
    module, _ = lower_for_plan(target, plan.device_profile())  # type: ignore[attr-defined]
    return module if module.is_scheduled else inline_for_assignment(module)
