"""The ``hloopt`` command line: argument parsing and output only; all logic lives in the library.

Subcommands live one per module in this package and are imported lazily, so ``hloopt --help``
and commands that read HLO files never import jax.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from hloopt.errors import UserError

#: command name -> "module:attribute" (relative to this package)
COMMANDS: dict[str, str] = {
    "analyze": "analyze_cmd:analyze",
    "inspect": "inspect_cmd:inspect",
    "devices": "devices_cmd:devices",
    "calibrate": "calibrate_cmd:calibrate",
    "measure": "measure_cmd:measure",
    "verify": "verify_cmd:verify",
    "emit": "emit_cmd:emit",
    "report": "report_cmd:report",
    "diff": "diff_cmd:diff",
    "plan": "plan_cmd:plan",
    "residuals": "residuals_cmd:residuals",
    "graph": "graph_cmd:graph",
    "state": "state_cmd:state",
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

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        """Like click's, but every error a user can cause prints as ``hloopt: error: ...`` (one
        line, plus a caret snippet for HLO) with exit status 2, also under ``CliRunner``."""
        prog_name = "hloopt"  # also under CliRunner, which would say "cli"
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (UserError, click.ClickException, click.exceptions.Abort) as err:
            sys.exit(report_error(err))
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hloopt")
def cli() -> None:
    """What fills accelerator memory in a JAX training step, and what to offload to host."""


def one_line(text: str) -> str:
    """``text`` with its lines joined: an error message is one line whatever an exception said."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def report_error(err: BaseException) -> int:
    """Print an error the user caused (UserError, a click usage error, an abort) as
    ``hloopt: error: ...`` on stderr; return the exit status (2, or 1 for an abort)."""
    if isinstance(err, click.exceptions.Abort):
        click.echo("hloopt: aborted", err=True)
        return 1
    detail = getattr(err, "detail", None)
    if isinstance(err, UserError):
        message, code = str(err), err.exit_code
    elif isinstance(err, click.ClickException):
        message, code = err.format_message(), err.exit_code
        ctx = getattr(err, "ctx", None)
        if isinstance(err, click.UsageError) and ctx is not None:
            message += f" (see '{ctx.command_path} --help')"
    else:  # pragma: no cover - callers pass only the types above
        raise err
    click.echo(f"hloopt: error: {one_line(message)}", err=True)
    if detail:
        click.echo(detail, err=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI; user errors print one line (plus a snippet) and exit 2."""
    try:
        rv = cli.main(args=argv, prog_name="hloopt", standalone_mode=False)
    except (UserError, click.ClickException, click.exceptions.Abort) as err:
        return report_error(err)
    except BrokenPipeError:
        return 0
    return rv if isinstance(rv, int) else 0


def run() -> None:
    sys.exit(main())
