"""Terminal output: rich tables for analyze / residuals / plan, sparklines, and a progress spinner.

Every builder returns a :class:`rich.table.Table` (or a plain string) and prints nothing, so
commands compose them and tests render them into a string. Numbers go through
:mod:`hloopt.units` (``12.3 GiB``, ``25.0 GB/s``, ``1.23 ms``).

Color and animation follow the terminal: :func:`make_console` leaves ``force_terminal`` unset, so
rich emits no ANSI codes when stdout is not a terminal, and honors ``NO_COLOR``; :func:`progress`
shows a spinner only on an interactive terminal and never under ``--quiet`` or ``--json``.
"""

from __future__ import annotations

import contextlib
import os
from typing import IO, Any, Iterator, Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hloopt.report import LiveBuffer, ReportData, ResidualRow
from hloopt.units import format_bytes, format_rate, format_seconds

__all__ = [
    "bar",
    "category_table",
    "device_table",
    "live_buffers_table",
    "make_console",
    "print_report",
    "progress",
    "residuals_table",
    "sparkline",
    "summary_table",
]

#: Eighth-blocks, from empty to full, for sparklines.
_BLOCKS = " ▁▂▃▄▅▆▇█"

_ACTION_STYLE = {"device": "", "offload": "cyan", "remat": "magenta"}


def make_console(*, file: IO[str] | None = None, quiet: bool = False, width: int | None = None,
                 stderr: bool = False) -> Console:
    """A console that colors only a real terminal, honors ``NO_COLOR``, and is silent if ``quiet``."""
    no_color = True if os.environ.get("NO_COLOR") else None
    con = Console(file=file, stderr=stderr, quiet=quiet, width=width, no_color=no_color,
                  highlight=False, force_terminal=None, soft_wrap=False)
    if width is None and not con.is_terminal and "COLUMNS" not in os.environ:
        con.width = 120  # piped output: rich's default of 80 columns would fold paths and op names
    return con


@contextlib.contextmanager
def progress(label: str, *, console: Console | None = None, quiet: bool = False) -> Iterator[None]:
    """Show a spinner with ``label`` while the block runs (> 1 s steps: lowering, compiling, solving).

    Prints nothing when ``quiet`` (``--quiet``/``--json``) or when the console is not an
    interactive terminal, so piped output and tests stay clean.
    """
    con = console if console is not None else Console(stderr=True)
    if quiet or con.quiet or not con.is_terminal or con.is_dumb_terminal:
        yield
        return
    with con.status(label, spinner="dots"):
        yield


def _downsample_max(values: Sequence[float], width: int) -> list[float]:
    n = len(values)
    if n <= width:
        return [float(v) for v in values]
    return [float(max(values[i * n // width:(i + 1) * n // width])) for i in range(width)]


def sparkline(values: Sequence[float], *, width: int = 60, top: float | None = None) -> str:
    """``values`` as one line of eighth-blocks, the max of each of ``width`` buckets.

    The scale runs from 0 to ``top`` (default: the largest value); a value above ``top`` is a full
    block. A nonzero value never draws as blank.
    """
    pts = _downsample_max(values, width)
    hi = top if top is not None else max(pts, default=0.0)
    if hi <= 0:
        return " " * len(pts)
    out = []
    for v in pts:
        level = min(8, int(round(v / hi * 8)))
        if v > 0 and level == 0:
            level = 1
        out.append(_BLOCKS[max(level, 0)])
    return "".join(out)


def bar(value: float, total: float, *, width: int = 20) -> str:
    """A horizontal bar: ``value/total`` of ``width`` cells filled (eighth-block resolution)."""
    if total <= 0:
        return " " * width
    eighths = int(round(max(0.0, min(1.0, value / total)) * width * 8))
    full, part = divmod(eighths, 8)
    s = "█" * full + (_BLOCKS[part] if part else "")
    return s + " " * (width - len(s))


def _table(title: str | None = None) -> Table:
    return Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False,
                 show_edge=False)


def summary_table(data: ReportData) -> Table:
    """Module, device, mesh, peaks, budget and step times: the first thing `analyze`/`plan` print."""
    t = _table()
    t.show_header = False
    t.add_column("", style="bold", no_wrap=True)
    t.add_column("", no_wrap=True)
    hbm = data.device.get("hbm_bytes")
    if data.target:
        t.add_row("target", data.target)
    t.add_row("module", data.module_name)
    t.add_row("device", str(data.device.get("name", "?")) + (f" ({format_bytes(hbm)} HBM)" if hbm else ""))
    if data.num_partitions > 1:
        mesh = "x".join(map(str, data.mesh)) if data.mesh else "?"
        t.add_row("devices", f"{data.num_partitions} partitions, mesh {mesh}; figures are per device")
    t.add_row("peak (all on device)", f"{format_bytes(data.baseline_peak_bytes)} at step "
              f"{data.baseline_peak_step} ({_label(data, data.baseline_peak_step)})")
    if data.budget_bytes is not None:
        t.add_row("budget", format_bytes(data.budget_bytes))
    if data.plan_peak_bytes is not None:
        delta = data.plan_peak_bytes - data.baseline_peak_bytes
        t.add_row("peak with plan", f"{format_bytes(data.plan_peak_bytes)} ({_signed_bytes(delta)})")
    if data.baseline_step_time_s is not None:
        after = ""
        if data.plan_step_time_s is not None:
            after = f" -> {format_seconds(data.plan_step_time_s)} with plan"
            if data.baseline_step_time_s > 0:
                after += f" ({(data.plan_step_time_s / data.baseline_step_time_s - 1) * 100:+.1f}%)"
        t.add_row("step time", format_seconds(data.baseline_step_time_s) + after)
    if data.transfers:
        d2h = sum(1 for x in data.transfers if x.direction == "d2h")
        t.add_row("host transfers", f"{d2h} to host, {len(data.transfers) - d2h} back")
    return t


def category_table(data: ReportData, *, width: int = 20) -> Table:
    """Bytes by category at the baseline peak, with shares and a bar each."""
    t = _table("At the peak")
    t.add_column("category")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    t.add_column("", no_wrap=True)
    peak = data.baseline_peak_bytes
    for cat, values in data.baseline_by_category.items():
        v = int(values[data.baseline_peak_step]) if data.num_steps else 0
        if not v:
            continue
        t.add_row(cat, format_bytes(v), f"{100 * v / peak:.1f}%" if peak else "-", bar(v, peak, width=width))
    return t


def live_buffers_table(rows: Sequence[LiveBuffer], *, limit: int | None = 20, title: str = "Live at the peak") -> Table:
    """The largest buffers live at the peak: name, shape, bytes, category, source."""
    t = _table(title)
    t.add_column("buffer", overflow="fold")
    t.add_column("shape")
    t.add_column("bytes", justify="right")
    t.add_column("category")
    t.add_column("source", overflow="fold")
    shown = list(rows) if limit is None else list(rows)[:limit]
    for b in shown:
        cat = f"{b.category} ({b.action})" if b.action and b.action != "device" else b.category
        t.add_row(b.name, b.shape, format_bytes(b.bytes), cat, b.source or "-")
    if limit is not None and len(rows) > limit:
        rest = sum(b.bytes for b in list(rows)[limit:])
        t.add_row(f"... {len(rows) - limit} more", "", format_bytes(rest), "", "")
    return t


def residuals_table(rows: Sequence[ResidualRow], *, decisions: bool = True, title: str = "Residuals") -> Table:
    """Residual candidates; with ``decisions`` also the plan's action and reason for each."""
    t = _table(title)
    t.add_column("residual", overflow="fold")
    t.add_column("shape")
    t.add_column("layers", justify="right")
    t.add_column("bytes", justify="right")
    if decisions:
        t.add_column("action")
        t.add_column("reason", overflow="fold")
    t.add_column("source", overflow="fold")
    for r in rows:
        cells: list[Any] = [residual_label(r), r.shape, str(r.layers), format_bytes(r.bytes)]
        if decisions:
            cells += [Text(r.action, style=_ACTION_STYLE.get(r.action, "")), r.reason or "-"]
        cells.append(r.source or "-")
        t.add_row(*cells)
    return t


def residual_label(r: ResidualRow) -> str:
    """Its ``checkpoint_name``, else the key without the source (the source has its own column)."""
    return r.name or r.key.split("@", 1)[0]


def device_table(device: Mapping[str, Any]) -> Table:
    """A device profile (``DeviceProfile.to_dict()``) in human units; assumed values marked ``*``."""
    t = _table("Device")
    t.add_column("field")
    t.add_column("value")
    sources = device.get("sources") or {}
    for key, value in device.items():
        if key in ("sources", "description"):
            continue
        mark = " *" if "assum" in str(sources.get(key, "")).lower() else ""
        t.add_row(key, format_value(key, value) + mark)
    return t


def format_value(key: str, value: Any) -> str:
    """A profile or assumption value in the unit its name says (``_bytes``, ``_bytes_per_s``, ``_s``)."""
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {format_value(key, v)}" for k, v in value.items())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_bytes_per_s"):
        return format_rate(value)
    if key.endswith("flops_per_s"):
        return f"{value / 1e12:.3g} TFLOP/s"
    if key.endswith("_bytes"):
        return format_bytes(value)
    if key.endswith("_s"):
        return format_seconds(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def print_report(data: ReportData, console: Console, *, limit: int = 20) -> None:
    """Summary, timeline sparkline, categories, live buffers and residuals, in that order."""
    console.print(summary_table(data))
    if data.num_steps:
        top = max(data.baseline_peak_bytes, data.plan_peak_bytes or 0)
        console.print(f"baseline {sparkline(data.baseline_timeline, width=60, top=top)}")
        if data.plan_timeline is not None:
            console.print(f"plan     {sparkline(data.plan_timeline, width=60, top=top)}")
    console.print()
    console.print(category_table(data))
    if data.live_at_peak:
        console.print()
        console.print(live_buffers_table(data.live_at_peak, limit=limit))
    if data.residuals:
        console.print()
        console.print(residuals_table(data.residuals, decisions=data.plan_timeline is not None))


def _label(data: ReportData, step: int) -> str:
    return data.step_labels[step] if 0 <= step < data.num_steps else "?"


def _signed_bytes(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_bytes(abs(n))


def diff_tables(diff: Any, *, limit: int = 15) -> list[Table]:
    """Tables for a :class:`hloopt.diff.MemoryDiff`: peaks, categories, host moves, buffers, decisions."""
    a, b = diff.a, diff.b
    out: list[Table] = []
    t = _table()
    t.add_column("")
    t.add_column("A", justify="right")
    t.add_column("B", justify="right")
    t.add_column("change", justify="right")
    t.add_row("file", a.label, b.label, "")
    t.add_row("peak", format_bytes(a.peak_bytes), format_bytes(b.peak_bytes), _signed_bytes(diff.peak_delta_bytes))
    for cat, (va, vb) in diff.categories.items():
        t.add_row(f"  {cat} at peak", format_bytes(va), format_bytes(vb), _signed_bytes(vb - va))
    ha, hb = sum(x.bytes for x in a.host_buffers), sum(x.bytes for x in b.host_buffers)
    if ha or hb:
        t.add_row("host memory (S(5))", format_bytes(ha), format_bytes(hb), _signed_bytes(hb - ha))
    if a.step_time_s is not None or b.step_time_s is not None:
        t.add_row("step time", format_seconds(a.step_time_s) if a.step_time_s is not None else "-",
                  format_seconds(b.step_time_s) if b.step_time_s is not None else "-", "")
    if a.model or b.model:
        t.add_row("memory figures", a.model or "plan prediction", b.model or "plan prediction", "")
    for side, name in ((a, "A"), (b, "B")):
        if side.num_partitions > 1:
            t.add_row(f"devices ({name})", "", f"{side.num_partitions}, mesh "
                      + ("x".join(map(str, side.mesh)) or "?") + "; per device", "")
    out.append(t)
    if diff.moved_to_host:
        m = _table("Moved to host memory in B")
        for col, j in (("buffer in B", "left"), ("shape", "left"), ("bytes", "right"), ("on device in A", "left")):
            m.add_column(col, justify=j)  # type: ignore[arg-type]
        for c in diff.moved_to_host:
            m.add_row(c.b.name, c.b.shape, format_bytes(c.b.bytes), c.a.name if c.a else "-")
        out.append(m)
    if diff.buffer_changes:
        bt = _table("Largest live buffers at the peak that changed")
        for col, j in (("", "left"), ("buffer", "left"), ("shape", "left"), ("A", "right"), ("B", "right"),
                       ("op", "left")):
            bt.add_column(col, justify=j, overflow="fold")  # type: ignore[arg-type]
        for c in list(diff.buffer_changes)[:limit]:
            x = c.b or c.a
            bt.add_row(c.status, x.name, x.shape, format_bytes(c.a.bytes) if c.a else "-",
                       format_bytes(c.b.bytes) if c.b else "-", x.op_name or "-")
        if len(diff.buffer_changes) > limit:
            bt.add_row(f"... {len(diff.buffer_changes) - limit} more", "", "", "", "", "")
        out.append(bt)
    if diff.decision_changes:
        dt = _table("Residual decisions that changed")
        for col in ("residual", "A", "B", "bytes"):
            dt.add_column(col, justify="right" if col == "bytes" else "left")
        for d in diff.decision_changes:
            dt.add_row(d.key, d.a_action or "-", d.b_action or "-", format_bytes(d.bytes))
        out.append(dt)
    return out
