"""``hloopt inspect FILE [--json]``: what is in an HLO module (never imports jax)."""

from __future__ import annotations

import json
import sys

import click

from hloopt.errors import UserError


@click.command("inspect")
@click.argument("file", metavar="FILE")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def inspect(ctx: click.Context, file: str, as_json: bool) -> None:
    """Summarize the HLO text module in FILE: computations, opcodes, bytes, offload, sharding."""
    from hloopt.hlo.parser import parse_file
    from hloopt.hlo.summary import summarize

    try:
        summary = summarize(parse_file(file))
    except UserError as err:
        click.echo(f"hloopt: error: {err}", err=True)
        if err.detail:
            click.echo(err.detail, err=True)
        ctx.exit(2)
    except RecursionError:  # pragma: no cover - the parser does not recurse on input depth
        click.echo(f"hloopt: error: {file}: nested too deeply to read", err=True)
        ctx.exit(2)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
        return
    _table(summary)


def _table(s: "object") -> None:
    from rich.console import Console
    from rich.table import Table

    from hloopt.units import format_bytes

    d = s.to_dict()  # type: ignore[attr-defined]
    facts = Table(title=f"HloModule {d['module']}  ({d['filename']})", show_header=False)
    facts.add_column("fact")
    facts.add_column("value", justify="right")
    rows = [
        ("computations", f"{d['computations']} ({d['fused_computations']} fused)"),
        ("instructions", f"{d['instructions']}"),
        (f"entry instructions ({d['entry_computation']})", f"{d['entry_instructions']}"),
        ("entry parameters", f"{d['entry_parameters']}"),
        ("parameter bytes (device)", format_bytes(d["parameter_bytes"])),
        ("parameter bytes (host S(5))", format_bytes(d["host_parameter_bytes"])),
        ("output bytes", format_bytes(d["output_bytes"])),
        ("fusions", f"{d['fusions']}"),
        ("placement annotations", ", ".join(f"{k or '?'}: {v}" for k, v in
                                            d["placement_annotations"].items()) or "none"),
        ("instructions in host memory S(5)", f"{d['host_memory_instructions']}"),
        ("copy-start / copy-done", f"{d['copy_starts']} / {d['copy_dones']}"),
        ("sharded instructions", f"{d['sharded_instructions']}"),
        ("partitions x replicas", f"{d['num_partitions']} x {d['replica_count']}"),
        ("scheduled", "yes" if d["is_scheduled"] else "no"),
        ("unknown opcodes (not modeled)", ", ".join(f"{k}: {v}" for k, v in
                                                   d["unknown_opcodes"].items()) or "none"),
    ]
    for k, v in rows:
        facts.add_row(k, v)
    ops = Table(title="opcodes")
    ops.add_column("opcode")
    ops.add_column("count", justify="right")
    for op, n in d["opcodes"].items():
        ops.add_row(op, str(n))
    console = Console(width=100, file=sys.stdout)
    console.print(facts)
    console.print(ops)
