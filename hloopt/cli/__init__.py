"""The ``hloopt`` command line: argument parsing and output only; all logic lives in the library.

Subcommands live one per module in this package and are imported lazily, so ``hloopt --help``
and commands that read HLO files never import jax.
"""

from __future__ import annotations

import importlib
import sys

import click

from hloopt.errors import UserError

#: command name -> "module:attribute" (relative to this package)
COMMANDS: dict[str, str] = {
    "analyze": "analyze_cmd:analyze",
    "inspect": "inspect_cmd:inspect",
    "devices": "devices_cmd:devices",
    "calibrate": "calibrate_cmd:calibrate",
    "verify": "verify_cmd:verify",
    "emit": "emit_cmd:emit",
    "report": "report_cmd:report",
    "diff": "diff_cmd:diff",
    "plan": "plan_cmd:plan",
    "residuals": "residuals_cmd:residuals",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return None
        mod, attr = spec.split(":")
        return getattr(importlib.import_module(f"hloopt.cli.{mod}"), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hloopt")
def cli() -> None:
    """What fills accelerator memory in a JAX training step, and what to offload to host."""


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI; user errors print one line (plus a snippet) and exit 2."""
    try:
        rv = cli.main(args=argv, prog_name="hloopt", standalone_mode=False)
    except UserError as err:
        click.echo(f"hloopt: error: {err}", err=True)
        if err.detail:
            click.echo(err.detail, err=True)
        return err.exit_code
    except click.exceptions.Abort:
        click.echo("hloopt: aborted", err=True)
        return 1
    except click.ClickException as err:
        err.show()
        return 2
    except BrokenPipeError:
        return 0
    return rv if isinstance(rv, int) else 0


def run() -> None:
    sys.exit(main())
