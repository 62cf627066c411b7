"""Click parameter types for sizes, rates, budgets and percentages, and the shared device options.

The types wrap :mod:`hloopt.units`; a bad value becomes a click usage error (exit status 2) whose
message is the parser's one line. :func:`device_options` gives every command the same
``--device/--device-file/--hbm/--d2h/--h2d`` flags, and :func:`profile_from_options` turns them
into a :class:`~hloopt.devices.DeviceProfile`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from hloopt.devices import DeviceProfile, load_profile
from hloopt.errors import UserError
from hloopt.units import Budget, parse_budget, parse_bytes, parse_percent, parse_rate

F = TypeVar("F", bound=Callable[..., Any])


class _UnitType(click.ParamType):
    parse: Callable[[str], Any]
    passthrough: tuple[type, ...] = ()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if self.passthrough and isinstance(value, self.passthrough) and not isinstance(value, bool):
            return value
        try:
            return type(self).parse(str(value))
        except UserError as err:
            self.fail(str(err), param, ctx)


class SizeType(_UnitType):
    """A size such as ``16GiB`` or ``512 MiB``; converts to whole bytes (int)."""

    name = "size"
    parse = staticmethod(parse_bytes)
    passthrough = (int,)


class RateType(_UnitType):
    """A rate such as ``25GB/s``; converts to bytes per second (float)."""

    name = "rate"
    parse = staticmethod(parse_rate)
    passthrough = (float,)


class BudgetParamType(_UnitType):
    """A budget: a size (``12GiB``) or a share of HBM (``75%``); converts to :class:`Budget`."""

    name = "budget"
    parse = staticmethod(parse_budget)
    passthrough = (Budget,)


class PercentType(_UnitType):
    """A percentage such as ``3%``; converts to the fraction 0.03."""

    name = "percent"
    parse = staticmethod(parse_percent)


Size = SizeType()
Rate = RateType()
BudgetType = BudgetParamType()
Percent = PercentType()


class CliUserError(click.ClickException):
    """A :class:`UserError` surfaced through click: ``hloopt: error: ...`` (one line, plus the
    error's ``detail`` such as a caret snippet), exit status 2."""

    exit_code = 2

    def __init__(self, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail

    def show(self, file: Any = None) -> None:
        from hloopt.cli import one_line

        click.echo(f"hloopt: error: {one_line(self.format_message())}", file=file, err=file is None)
        if self.detail:
            click.echo(self.detail, file=file, err=file is None)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn UserError into a click error (exit 2) so commands behave the same under CliRunner."""
    try:
        yield
    except UserError as err:
        raise CliUserError(str(err), detail=err.detail) from err


def check_output(path: str | None, *, force: bool) -> None:
    """Refuse, before any work, an output path that :func:`hloopt.fileio.write_text_atomic` would
    refuse after it: a folder, a missing folder, or a file hloopt did not write (without ``force``)."""
    import os
    from pathlib import Path

    from hloopt.fileio import is_ours

    if not path:
        return
    dest = Path(os.path.realpath(path))
    if dest.is_dir():
        raise UserError(f"{path}: is a folder; give a file name")
    if not dest.parent.is_dir():
        raise UserError(f"{path}: no such folder {os.fspath(dest.parent)!r}")
    if dest.exists() and not force and not is_ours(dest):
        raise UserError(f"{path} exists: pass --force to overwrite")


def _check_libtpu(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from hloopt.passes.tpu.versions import parse_version

    if value is not None and parse_version(value) is None:
        raise click.BadParameter(f"{value!r} is not a libtpu version (e.g. 0.0.42, 0.0.52)")
    return value


def libtpu_option(f: F) -> F:
    """Add ``--libtpu VERSION``: the libtpu release whose rules the TPU memory model follows for
    the whole command (:func:`hloopt.analysis.target_libtpu`; default: the installed one)."""
    import functools

    @functools.wraps(f)
    def wrapper(*args: Any, libtpu: str | None = None, **kwargs: Any) -> Any:
        from hloopt.analysis import libtpu_rules

        with libtpu_rules(libtpu):
            return f(*args, **kwargs)

    return click.option(  # type: ignore[return-value]
        "--libtpu", "libtpu", metavar="VERSION", default=None, callback=_check_libtpu,
        help="libtpu release the TPU memory model follows (releases differ: from 0.0.46 no "
             "temporary shares an output's buffer); default: the installed libtpu, else the one "
             "jax pins; also $HLOOPT_LIBTPU.")(wrapper)


def device_options(f: F) -> F:
    """Add ``--device``, ``--device-file``, ``--hbm``, ``--d2h`` and ``--h2d`` to a command."""
    options = [
        click.option("--device", "device", metavar="NAME", default=None,
                     help="Built-in device profile (see `hloopt devices`), e.g. tpu-v5e, h100."),
        click.option("--device-file", "device_file", metavar="PATH", default=None,
                     type=click.Path(dir_okay=False),
                     help="Device profile TOML/JSON file (e.g. from `hloopt calibrate`)."),
        click.option("--hbm", "hbm", type=Size, default=None, metavar="SIZE",
                     help="Override HBM capacity, e.g. 16GiB."),
        click.option("--d2h", "d2h", type=Rate, default=None, metavar="RATE",
                     help="Override device-to-host rate, e.g. 25GB/s."),
        click.option("--h2d", "h2d", type=Rate, default=None, metavar="RATE",
                     help="Override host-to-device rate, e.g. 25GB/s."),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def profile_from_options(
    *,
    device: str | None,
    device_file: str | None,
    hbm: int | None = None,
    d2h: float | None = None,
    h2d: float | None = None,
    default: str | None = None,
) -> DeviceProfile:
    """The profile named by ``--device`` or ``--device-file`` (or ``default``), with overrides applied.

    Raises UserError when both or (without ``default``) neither of the two are given.
    """
    for flag, value in (("--device", device), ("--device-file", device_file), ("NAME", default)):
        if value is not None and not str(value).strip():
            raise UserError(f"{flag} is empty: give a device name (see `hloopt devices`) or a profile file")
    if device and device_file:
        raise UserError("give either --device or --device-file, not both")
    source = device_file or device or default
    if source is None:
        raise UserError("no device given: pass --device NAME (see `hloopt devices`) or --device-file PATH")
    profile = load_profile(source)
    return profile.with_overrides(hbm_bytes=hbm, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d,
                                  source="command-line override")
