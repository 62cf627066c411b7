"""``hloopt state TARGET [--json]``: a JAX step's inputs in groups that can live on device or host."""

from __future__ import annotations

import json
from typing import Any

import click

from hloopt.cli.params import libtpu_option, user_errors
from hloopt.units import format_bytes


@click.command("state")
@click.argument("target")
@libtpu_option
@click.option("--size", default=None, help="Size passed to a JAX TARGET's factory (tiny, small, large).")
@click.option("--device", default=None,
              help="Device profile (name or file) for the transfer time of each group on the host.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of groups instead of a table.")
def state(target: str, size: str | None, device: str | None, as_json: bool) -> None:
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
        profile = None
        if device is not None:
            from hloopt.devices import load_profile

            profile = load_profile(device)
    from hloopt.state import transfer_s

    rows: list[dict[str, Any]] = [{"name": g.name, "argument": g.argnum, "leaves": len(g.leaves), "bytes": g.nbytes,
             "tpu_bytes": g.tpu_bytes, "updated": g.updated,
             "host_transfer_s": transfer_s(g, profile) if profile is not None else None} for g in groups]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows) if rows else 4
    head = f"{'group':<{width}}  {'leaves':>6}  {'bytes':>10}  {'TPU layout':>10}  updated"
    click.echo(head + ("  on host: transfers" if profile is not None else ""))
    for r in rows:
        line = (f"{r['name']:<{width}}  {r['leaves']:>6}  {format_bytes(r['bytes']):>10}  "
                f"{format_bytes(r['tpu_bytes']):>10}  {'yes' if r['updated'] else 'no':<7}")
        if r["host_transfer_s"] is not None:
            line += f"  {r['host_transfer_s'] * 1e3:.3f} ms"
        click.echo(line.rstrip())
