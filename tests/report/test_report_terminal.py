"""Terminal output: exact text for a small report, units, sparklines, color and spinner rules."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from hloopt.report.terminal import bar, make_console, print_report, progress, residuals_table, sparkline
from tests.report.test_report_html import small


def render(fn, *, width: int = 100) -> str:
    f = io.StringIO()
    fn(make_console(file=f, width=width))
    return "\n".join(line.rstrip() for line in f.getvalue().splitlines())


def test_report_text_exact() -> None:
    # hand-checked: peak 1+2+1 MiB at step 2 (dot.3); shares 25/50/25 %; bars of 20 cells -> 5/10/5;
    # baseline 1,2,4,1 MiB on a 4 MiB scale -> eighths 2,4,8,2; plan 1,1,3,1 -> 2,2,6,2;
    # step time 4.1 / 4.0 ms = +2.5%; one transfer each way.
    expected = """\
module                 jit_step
device                 tpu-v5e (16.0 GiB HBM)
peak (all on device)   4.00 MiB at step 2 (dot.3)
budget                 3.00 MiB
peak with plan         3.00 MiB (-1.00 MiB)
step time              4.00 ms -> 4.10 ms with plan (+2.5%)
host transfers         1 to host, 1 back
baseline ▂▄█▂
plan     ▂▂▆▂

At the peak
category       bytes   share
───────────────────────────────────────────────────
parameter   1.00 MiB   25.0%   █████
residual    2.00 MiB   50.0%   ██████████
temporary   1.00 MiB   25.0%   █████

Live at the peak
buffer     shape              bytes   category    source
─────────────────────────────────────────────────────────────
dot.3      f32[512,512]    1.00 MiB   temporary   model.py:12
fusion.1   f32[1024,512]   2.00 MiB   residual    model.py:7
p0         f32[512,512]    1.00 MiB   parameter   -

Residuals
residual     shape           layers      bytes   action    reason                    source
────────────────────────────────────────────────────────────────────────────────────────────────
query_proj   bf16[2,64,64]        2   1.00 MiB   offload   frees 1 MiB at the peak   llama.py:40"""
    got = render(lambda c: print_report(small(), c))
    assert got == expected
    assert "\x1b[" not in got  # not a terminal: no ANSI codes


def test_sharded_summary_names_mesh() -> None:
    from dataclasses import replace

    data = replace(small(), num_partitions=8, mesh=(2, 4))
    assert "devices                8 partitions, mesh 2x4; figures are per device" in render(
        lambda c: print_report(data, c))


def test_sparkline_and_bar() -> None:
    assert sparkline([0, 1, 2, 4, 8], width=5) == " ▁▂▄█"
    assert sparkline([0, 0.01, 8]) == " ▁█"  # a nonzero value is never blank
    assert sparkline(list(range(100)), width=4) == "▂▄▆█"  # max of each quarter: 24, 49, 74, 99 of 99
    assert sparkline([5, 20], top=10) == "▄█"  # above the top: full block
    assert sparkline([]) == ""
    assert bar(1, 3, width=10) == "███▃      "  # 10/3 cells = 26.7 eighths -> 27 = 3 full + 3/8
    assert bar(5, 0, width=3) == "   "


def test_colors_only_on_a_terminal_and_never_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = small().residuals
    f = io.StringIO()
    Console(file=f, force_terminal=True, color_system="standard", width=120).print(residuals_table(rows))
    assert "\x1b[36m" in f.getvalue()  # cyan "offload" on a terminal
    monkeypatch.setenv("NO_COLOR", "1")
    f = io.StringIO()
    con = make_console(file=f, width=120)
    con._force_terminal = True  # as if stdout were a terminal
    con.print(residuals_table(rows))
    assert "\x1b[36m" not in f.getvalue() and "offload" in f.getvalue()


def test_progress_silent_when_quiet_or_piped() -> None:
    for console, quiet in ((Console(file=io.StringIO(), force_terminal=False), False),
                           (Console(file=io.StringIO(), force_terminal=True), True)):
        with progress("compiling for tpu-v5e", console=console, quiet=quiet):
            pass
        assert console.file.getvalue() == ""
    tty = Console(file=io.StringIO(), force_terminal=True, width=80)
    with progress("compiling for tpu-v5e", console=tty):
        pass
    assert "compiling for tpu-v5e" in tty.file.getvalue()
