"""``hloopt analyze TARGET``: the memory timeline of one step, its peak and what is live there."""

from __future__ import annotations

import json

import click

from hloopt.cli.params import libtpu_option, user_errors
from hloopt.units import format_bytes


@click.command("analyze")
@click.argument("target")
@libtpu_option
@click.option("--platform", type=click.Choice(["tpu", "cuda", "cpu"]), default=None,
              help="Platform a JAX TARGET is lowered for / pre-optimization HLO is predicted for.")
@click.option("--compile", "compile_", metavar="TARGET", default=None,
              help="Compile a JAX TARGET with XLA (cpu, tpu-v5e, ...) and analyze the compiled module.")
@click.option("--size", default=None, help="Size passed to a JAX TARGET's factory (tiny, small, large).")
@click.option("--schedule", type=click.Choice(["module", "list"]), default=None,
              help="Schedule: the module's order (default) or a memory-aware list schedule.")
@click.option("--top", type=click.IntRange(0), default=10, show_default=True,
              help="How many buffers live at the peak to list.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--html", "html_path", default=None, metavar="PATH",
              help="Also write the HTML report (timeline by category, live buffers) here.")
@click.option("--device", "device", metavar="NAME", default=None,
              help="Device profile the HTML report draws (HBM line, rates); default tpu-v5e.")
@click.option("--force", is_flag=True, help="Overwrite an --html file hloopt did not write.")
@click.option("-q", "--quiet", is_flag=True, help="No progress display; with --html, print nothing but errors.")
def analyze(target: str, platform: str | None, compile_: str | None, size: str | None,
            schedule: str | None, top: int, as_json: bool, html_path: str | None, device: str | None,
            force: bool, quiet: bool) -> None:
    """Peak device memory of TARGET (HLO file, XLA dump, or file.py:factory) and what fills it."""
    from hloopt.analysis import analyze as run
    from hloopt.report.terminal import make_console, progress

    with user_errors():
        with progress(f"analyzing {target}", console=make_console(stderr=True), quiet=quiet or as_json):
            report = run(target, platform=platform, compile=compile_, top=max(top, 50) if html_path else top,
                         schedule=schedule, size=size)
        if html_path:
            from hloopt.devices import load_profile
            from hloopt.fileio import write_text_atomic
            from hloopt.report.adapt import report_data_from_memory
            from hloopt.report.html import render_html

            data = report_data_from_memory(report, load_profile(device or "tpu-v5e").to_dict(), target=target)
            write_text_atomic(html_path, render_html(data), force=force)
            report.profile.top = report.profile.top[:top]
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        return
    if quiet and html_path:
        return
    _show(report)
    if html_path:
        click.echo(f"wrote {html_path}")


def _show(report) -> None:  # type: ignore[no-untyped-def]
    from rich.table import Table

    from hloopt.report.terminal import bar, make_console, sparkline

    console = make_console()
    j = report.to_json()
    p = report.profile
    summary = Table(title=f"{j['module']} ({j['source']}, {j['settings'].get('kind', '')})", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    mod = report.profile.ranges.module
    if mod.num_partitions > 1:
        from hloopt.report.adapt import _mesh

        mesh = "x".join(map(str, _mesh(mod))) or "?"
        summary.add_row("devices", f"{mod.num_partitions} (mesh {mesh}); figures are per device")
    summary.add_row("peak", format_bytes(j["peak_bytes"]))
    summary.add_row("at", f"step {j['peak_at']['index']} of {j['num_steps']}: {j['peak_at']['instruction']}")
    summary.add_row("arguments", format_bytes(j["argument_bytes"]))
    summary.add_row("outputs", format_bytes(j["output_bytes"]))
    summary.add_row("host", format_bytes(j["host_bytes"]))
    if j.get("xla"):
        x = j["xla"]
        xp = x.get("peak_memory_in_bytes")
        if xp:
            summary.add_row("XLA peak", f"{format_bytes(xp)} ({(j['peak_bytes'] - xp) / xp:+.1%})")
    console.print(summary)
    console.print("timeline " + sparkline(p.entry_timeline_bytes(), width=60))
    cats = Table(title="At the peak, by category")
    cats.add_column("category")
    cats.add_column("bytes", justify="right")
    cats.add_column("")
    for k, v in sorted(j["categories"].items(), key=lambda kv: -kv[1]):
        cats.add_row(k, format_bytes(v), bar(v, j["peak_bytes"], width=20))
    console.print(cats)
    if j["live_at_peak"]:
        t = Table(title="Largest buffers live at the peak")
        for col in ("buffer", "shape", "bytes", "category", "op_name", "source"):
            t.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
        for b in j["live_at_peak"]:
            t.add_row(b["name"], b["shape"], format_bytes(b["bytes"]), b["category"], b["op_name"], b["source"])
        console.print(t)
    for note in j.get("notes", ()):
        console.print(f"note: {note}")
