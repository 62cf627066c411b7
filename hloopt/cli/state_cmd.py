"""``hloopt state TARGET [--json]``: a JAX step's inputs in groups that can live on device or host."""

from __future__ import annotations

import json

import click

from hloopt.cli.params import user_errors
from hloopt.units import format_bytes


@click.command("state")
@click.argument("target")
@click.option("--size", default=None, help="Size passed to a JAX TARGET's factory (tiny, small, large).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of groups instead of a table.")
def state(target: str, size: str | None, as_json: bool) -> None:
    """Groups of TARGET's inputs (params, optimizer mu/nu, batch) with their bytes.

    Each group can stay in device memory or live in host memory (pinned_host); a placement file
    ``{"placement": {"opt_state[0].mu": "host", ...}}`` names groups as listed here and is applied
    with ``hloopt.apply_state_plan(placement, step, args)``.
    """
    with user_errors():
        from hloopt.errors import UserError
        from hloopt.state import state_groups
        from hloopt.targets import resolve

        t = resolve(target, size=size)
        if t.kind != "jax" or t.step_fn is None:
            raise UserError(f"{target}: state groups need a JAX TARGET (file.py:factory), not {t.kind}")
        groups = state_groups(t.step_fn, tuple(t.args))
    rows = [{"name": g.name, "argument": g.argnum, "leaves": len(g.leaves), "bytes": g.nbytes,
             "tpu_bytes": g.tpu_bytes, "updated": g.updated} for g in groups]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows) if rows else 4
    click.echo(f"{'group':<{width}}  {'leaves':>6}  {'bytes':>10}  {'TPU layout':>10}  updated")
    for r in rows:
        click.echo(f"{r['name']:<{width}}  {r['leaves']:>6}  {format_bytes(r['bytes']):>10}  "
                   f"{format_bytes(r['tpu_bytes']):>10}  {'yes' if r['updated'] else 'no'}")
