"""``hloopt residuals TARGET [--json]``: every forward->backward activation, named as JAX names it."""

from __future__ import annotations

import json

import click

from hloopt.cli.params import libtpu_option, user_errors
from hloopt.units import format_bytes


@click.command("residuals")
@click.argument("target")
@libtpu_option
@click.option("--size", default=None, help="Size passed to a JAX TARGET's factory (tiny, small, large).")
@click.option("--platform", type=click.Choice(["tpu", "cuda", "cpu"]), default="tpu", show_default=True,
              help="Platform a JAX TARGET is lowered for (pre-optimization HLO).")
@click.option("--no-names", is_flag=True, help="Skip naming (no re-lowering of a JAX TARGET).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of residuals instead of a table.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
def residuals(target: str, size: str | None, platform: str, no_names: bool, as_json: bool, quiet: bool) -> None:
    """Residuals of TARGET: values the forward pass leaves for the backward pass.

    TARGET is an HLO file or XLA dump (no jax import; names unknown) or a JAX program
    (file.py:factory), which is lowered and then re-lowered with offload policies to learn which
    checkpoint_name selects each residual.
    """
    with user_errors():
        from hloopt.naming import residuals_of
        from hloopt.passes.residuals import describe
        from hloopt.report.terminal import progress

        with progress(f"finding residuals of {target}" + ("" if no_names else " (re-lowering to name them)"),
                      quiet=quiet or as_json):
            result = residuals_of(target, size=size, platform=platform, names=not no_names)
        rows = describe(result.residuals, peak_bytes=result.peak_bytes)
    for r in rows:
        r["saved_whatever_policy"] = r["instruction"] in result.inputs
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    _table(result, rows)


def _table(result, rows) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console
    from rich.table import Table

    rs = result.residuals
    peak = result.peak_bytes
    title = (f"{len(rows)} residuals, {format_bytes(rs.total_bytes)}"
             + (f" ({rs.total_bytes / peak:.1%} of the {format_bytes(peak)} peak: {result.peak_source})"
                if peak else "")
             + (f"; checkpoint_names select {result.coverage:.1%} of the bytes" if result.coverage is not None else ""))
    table = Table(title=title)
    for col in ("name / location", "shape", "bytes", "layers", "producer", "forward live", "first bwd use",
                "host", "of peak"):
        table.add_column(col, justify="right" if col in ("bytes", "layers", "of peak") else "left")
    for r in rows:
        label = f"[bold]{r['name']}[/bold]" if r["name"] else (r["source"] or r["instruction"])
        share = f"{r['peak_share']:.1%}" if r["peak_share"] is not None else ""
        fi = r["forward_interval"]
        table.add_row(str(label), str(r["shape"]), format_bytes(int(r["bytes"])), str(r["layers"]), str(r["producer"]),
                      f"{fi[0]}..{fi[1]}", f"{r['first_backward_use']} {r['first_backward_user']}",
                      "yes" if r["offloaded"] else "", share)
    Console(width=200).print(table)
    for line in (result.unmovable_line(), result.input_slices_line()):
        if line:
            click.echo(line)
    line = largest_unnamed_line(result, rows)
    if line:
        click.echo(line)


def largest_unnamed_line(result, rows) -> str | None:  # type: ignore[no-untyped-def]
    """Where to put a ``checkpoint_name`` so that a policy can select the largest unnamed
    residual: on its own line for a value computed inside a checkpoint; inside the function that
    receives it for a checkpointed function's argument, which JAX saves whatever the policy
    (:func:`hloopt.naming.checkpoint_inputs`)."""
    unnamed = [r for r in rows if not r["name"] and r["source"] and r["under_checkpoint"]]
    if not unnamed or result.coverage is None:
        return None
    big = unnamed[0]
    what = f"largest unnamed: {format_bytes(int(big['bytes']))} {big['producer']} at {big['source']}"
    if big["instruction"] not in result.inputs:
        return f"{what}: wrap it in checkpoint_name(...) there to let a policy select it"
    first = result.inputs[big["instruction"]]
    return (f"{what} is a checkpointed function's argument, saved whatever the policy: name it inside that "
            f"function before its first use{f' ({first})' if first else ''}, x = checkpoint_name(x, \"layer_input\"), "
            "and a policy can offload it")
