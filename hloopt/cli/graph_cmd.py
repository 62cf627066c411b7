"""``hloopt graph TARGET --format graphml|json [-o FILE]``: the step's buffers as a networkx graph."""

from __future__ import annotations

import click

from hloopt.cli.params import check_output, libtpu_option, user_errors

FORMATS = ("graphml", "json")


@click.command("graph")
@click.argument("target")
@libtpu_option
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="graphml", show_default=True,
              help="graphml: GraphML (networkx's writer); json: networkx node-link JSON.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write to FILE (atomically) instead of standard output.")
@click.option("--force", is_flag=True, help="Overwrite an existing FILE that hloopt did not write.")
@click.option("--platform", type=click.Choice(["tpu", "cuda", "cpu"]), default="tpu", show_default=True,
              help="Platform a JAX TARGET is lowered for / pre-optimization HLO is predicted for.")
@click.option("--size", default=None, help="Size passed to a JAX TARGET's factory (tiny, small, large).")
@click.option("--schedule", type=click.Choice(["module", "list"]), default=None,
              help="Schedule: the default of the accounting (as analyze), or this one.")
@click.option("--no-interference", is_flag=True, help="Leave out the interference edges (they can be many).")
@click.option("--no-names", is_flag=True, help="Skip naming residuals (no re-lowering of a JAX TARGET).")
@click.option("-q", "--quiet", is_flag=True, help="No progress display.")
def graph(target: str, fmt: str, output: str | None, force: bool, platform: str, size: str | None,
          schedule: str | None, no_interference: bool, no_names: bool, quiet: bool) -> None:
    """The buffers of TARGET (HLO file, XLA dump, or file.py:factory) as a graph: live intervals,
    bytes, categories, data edges and interference edges (see hloopt.graph)."""
    with user_errors():
        from hloopt.graph import graphml_text, liveness_graph, node_link_json
        from hloopt.report.terminal import make_console, progress

        check_output(output, force=force)
        with progress(f"building the liveness graph of {target}", console=make_console(stderr=True),
                      quiet=quiet or output is None):
            g = liveness_graph(target, platform=platform, size=size, schedule=schedule,
                               interference=not no_interference, names=not no_names)
        text = graphml_text(g) if fmt == "graphml" else node_link_json(g)
        if output is None:
            click.echo(text, nl=False)
        else:
            from hloopt.fileio import write_text_atomic

            write_text_atomic(output, text, force=force)
            if not quiet:
                click.echo(f"wrote {output}: {g.number_of_nodes()} buffers, {g.number_of_edges()} edges", err=True)
