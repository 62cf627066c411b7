"""``hloopt diff A B [--json]``: what changed in device memory between two HLO modules or two plans."""

from __future__ import annotations

import click

from hloopt.cli.params import user_errors


@click.command("diff")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--json", "as_json", is_flag=True, help="Print the diff as JSON (bytes, base units).")
@click.option("--top", type=click.IntRange(1), default=20, show_default=True,
              help="Largest live buffers of each side to compare.")
def diff(a: str, b: str, as_json: bool, top: int) -> None:
    """Compare A and B (HLO files, XLA dump folders or plan files): peak, bytes by category,
    buffers moved to host, largest live buffers added/removed/resized, residual decisions."""
    from hloopt.diff import diff_paths

    with user_errors():
        result = diff_paths(a, b, top=top)
    if as_json:
        click.echo(result.to_json(), nl=False)
        return
    from hloopt.report.terminal import diff_tables, make_console

    console = make_console()
    for i, table in enumerate(diff_tables(result)):
        if i:
            console.print()
        console.print(table)
