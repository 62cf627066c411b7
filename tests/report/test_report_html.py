"""The HTML report: self-contained, deterministic, downsampled, and drawn by a real browser."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from hloopt.analysis import analyze
from hloopt.devices import load_profile
from hloopt.hlo.parser import parse_file
from hloopt.report import LiveBuffer, ReportData, ResidualRow, Transfer, mesh_of
from hloopt.report.adapt import report_data_from_memory
from hloopt.report.html import MAX_POINTS, downsample, render_html

ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hlo" / "zoo"
MiB = 2**20
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


def small() -> ReportData:
    """Four steps; hand-made numbers: baseline peak 4 MiB at step 2, plan 3 MiB."""
    return ReportData(
        module_name="jit_step", device=load_profile("tpu-v5e").to_dict(), budget_bytes=3 * MiB,
        step_labels=["fusion.1", "fusion.2", "dot.3", "add.4"],
        baseline_by_category={"parameter": [MiB] * 4, "residual": [0, MiB, 2 * MiB, 0], "temporary": [0, 0, MiB, 0]},
        baseline_peak_step=2, baseline_peak_bytes=4 * MiB,
        plan_timeline=[MiB, MiB, 3 * MiB, MiB], plan_peak_step=2, plan_peak_bytes=3 * MiB,
        transfers=(Transfer("name:q", 0, "d2h", 0.001, 0.002), Transfer("name:q", 0, "h2d", 0.0025, 0.003)),
        step_start_s=(0.0, 0.001, 0.002, 0.003), step_backward=(False, False, True, True),
        live_at_peak=(LiveBuffer("dot.3", "f32[512,512]", MiB, "temporary", "jit(step)/dot", "model.py:12"),
                      LiveBuffer("fusion.1", "f32[1024,512]", 2 * MiB, "residual", "", "model.py:7"),
                      LiveBuffer("p0", "f32[512,512]", MiB, "parameter", "", "")),
        residuals=(ResidualRow("name:q", "query_proj", "bf16[2,64,64]", MiB, 2, "offload", "frees 1 MiB at the peak",
                               "llama.py:40"),),
        assumptions={"d2h rate": "15.0 GB/s (profile)"},
        baseline_step_time_s=0.004, plan_step_time_s=0.0041,
    ).validate()


def test_self_contained_and_deterministic() -> None:
    page = render_html(small())
    assert page == render_html(small())
    # offline: nothing is loaded from anywhere (no src/href to a URL, no @import, no url())
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page)
    assert "@import" not in page and "url(" not in page
    # the figures a reader needs are there, in human units
    for text in ("4.00 MiB", "3.00 MiB", "budget 3.00 MiB", "query_proj", "model.py:12", "frees 1 MiB at the peak",
                 "15.0 GB/s"):
        assert text in page, text


def test_budget_line_and_peak_marker_positions() -> None:
    page = render_html(small())
    # y is linear in bytes: ymax = 1.1 * 4 MiB over the plot height; the budget (3 MiB) and the peak (4 MiB)
    # must sit at the heights that formula gives (geometry: top 18, height 340-18-34=288).
    top, height, ymax = 18, 288, 1.1 * 4 * MiB
    y_budget = float(re.search(r'id="budget-line"[^>]* y1="([\d.]+)"', page).group(1))
    y_peak = float(re.search(r'id="base-peak"[^>]* cy="([\d.]+)"', page).group(1))
    assert y_budget == pytest.approx(top + height * (1 - 3 * MiB / ymax), abs=0.06)
    assert y_peak == pytest.approx(top + height * (1 - 4 * MiB / ymax), abs=0.06)


def test_sharded_module_states_per_device_and_mesh() -> None:
    mod = parse_file(ZOO / "sharded.tpu-v5e.hlo")
    data = report_data_from_memory(analyze(mod), load_profile("tpu-v5e").to_dict())
    assert data.num_partitions == 8 and tuple(data.mesh) == (2, 4)
    assert "SPMD program on 8 devices (mesh 2x4): every figure is per device." in render_html(data)


def test_mesh_of_forms() -> None:
    assert mesh_of(["{devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}", "{devices=[2,1,4]<=[8]}"], 8) == (2, 4)
    assert mesh_of(["{devices=[2,1,2]0,1,2,3}"], 4) == (2, 2)
    assert mesh_of(["{replicated}"], 4) == (4,)
    assert mesh_of([], 1) == ()


def test_downsampling_keeps_every_bucket_maximum() -> None:
    rng = np.random.default_rng(0)
    n = 100_000
    a = rng.integers(0, 1000, n)
    b = rng.integers(0, 1000, n)
    a[77_777] = 50_000  # one narrow spike must survive
    total = a + b
    data = ReportData(module_name="big", device={"name": "x"}, budget_bytes=None,
                      step_labels=[f"s{i}" for i in range(n)], baseline_by_category={"a": a.tolist(), "b": b.tolist()},
                      baseline_peak_step=int(np.argmax(total)), baseline_peak_bytes=int(total.max()),
                      plan_timeline=(total // 2).tolist(), plan_peak_step=int(np.argmax(total)),
                      plan_peak_bytes=int(total.max() // 2))
    ds = downsample(data)
    assert len(ds["rep"]) == MAX_POINTS
    edges = ds["edges"]
    assert edges[0] == 0 and edges[-1] == n
    for i in (0, 777, 1555, MAX_POINTS - 1):
        lo, hi = edges[i], edges[i + 1]
        assert ds["total"][i] == total[lo:hi].max()
        assert ds["mat"][:, i].sum() == total[lo:hi].max()  # the category split of that very step
        assert ds["plan"][i] == (total // 2)[lo:hi].max()
    assert ds["total"].max() == total.max() == 50_000 + b[77_777]
    t0 = time.process_time()  # CPU seconds: other processes on a shared machine do not count
    page = render_html(data)
    assert time.process_time() - t0 < 20
    assert len(page) < 1_500_000
    assert 'data-buckets="2000"' in page


# -- in a real browser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium/chromedriver not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,1000"):
        opts.add_argument(arg)
    profile = tempfile.mkdtemp(prefix="hloopt-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _load(driver, page: str, tmp_path: Path) -> None:
    f = tmp_path / "report.html"
    f.write_text(page, encoding="utf-8")
    driver.get(f.as_uri())
    driver.get_log("browser")  # drop anything from before the page


@pytest.mark.browser
def test_browser_draws_llama_timeline_with_tooltip_and_sorting(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    mod = parse_file(ZOO / "llama.tpu-v5e.hlo")
    mem = analyze(mod)
    data = report_data_from_memory(mem, load_profile("tpu-v5e").to_dict(), budget_bytes=int(mem.peak_bytes * 0.9))
    f = tmp_path / "report.html"
    f.write_text(render_html(data), encoding="utf-8")
    browser.get(f.as_uri())
    # every category area is drawn with a real size
    sizes = browser.execute_script(
        "return Array.from(document.querySelectorAll('#memory-chart path.area'))"
        ".map(p => { const b = p.getBBox(); return [p.dataset.cat, b.width, b.height]; });")
    assert {s[0] for s in sizes} == set(data.baseline_by_category)
    # each band spans the full width, and its height is its bytes on the chart's scale: from the lowest
    # bottom to the highest top of the category in the stack, over the downsampled buckets
    ds = downsample(data)
    ymax = max(data.baseline_peak_bytes, data.budget_bytes or 0) * 1.1
    cum = np.zeros(ds["mat"].shape[1], dtype=np.int64)
    want = {}
    for cat, row in zip(ds["cats"], ds["mat"]):
        lower, cum = cum, cum + row
        want[cat] = (cum.max() - lower.min()) / ymax
    plot_h = browser.execute_script(
        "return document.querySelector('#memory-chart rect.bwd').getBBox().height;")
    for cat, w, h in sizes:
        assert w > 500, (cat, w)
        assert h == pytest.approx(want[cat] * plot_h, abs=0.5), (cat, h, want[cat] * plot_h)
    assert max(h for _, _, h in sizes) > 0.2 * plot_h  # the largest band is a visible part of the plot
    assert browser.find_element(By.ID, "budget-line").size["width"] > 500
    # hover the peak step: the tooltip names its instruction and the total in bytes
    overlay = browser.find_element(By.ID, "memory-hover")
    rect = overlay.rect
    peak = mem.profile.peak_step
    frac = (peak + 0.5) / data.num_steps
    ActionChains(browser).move_to_element_with_offset(
        overlay, round(rect["width"] * frac - rect["width"] / 2), 0).perform()
    tip = browser.find_element(By.ID, "tooltip")
    assert tip.is_displayed()
    # a step is about 2 px wide here: the pointer lands on the peak step or its neighbour; the tooltip
    # names the step it shows, its instruction and its total in bytes
    shown = int(re.search(r"step (\d+)", tip.text).group(1))
    assert abs(shown - peak) <= 1, (shown, peak)
    assert data.step_labels[shown] in tip.text
    from hloopt.units import format_bytes
    assert f"total {format_bytes(mem.profile.timeline_bytes[shown])}" in tip.text
    # click "bytes" in the live-buffer table: largest first; again: smallest first
    th = browser.find_element(By.XPATH, "//table[@id='live-table']//th[text()='bytes']")
    th.click()
    col = "return Array.from(document.querySelectorAll('#live-table tbody tr')).map(r => +r.cells[2].dataset.v);"
    got = browser.execute_script(col)
    assert got == sorted((b.bytes for b in data.live_at_peak), reverse=True)
    th.click()
    assert browser.execute_script(col) == sorted(b.bytes for b in data.live_at_peak)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


@pytest.mark.browser
def test_browser_draws_plan_and_transfer_lanes(browser, tmp_path: Path) -> None:
    f = tmp_path / "small.html"
    f.write_text(render_html(small()), encoding="utf-8")
    browser.get(f.as_uri())
    plan = browser.execute_script("const b = document.getElementById('plan-line').getBBox(); return [b.width, b.height];")
    assert plan[0] > 500 and plan[1] > 10
    lanes = browser.execute_script(
        "return ['d2h','h2d','fwd-c','bwd-c'].map(c => Array.from(document.querySelectorAll('#transfer-chart rect.' + c))"
        ".map(r => r.getBBox().width));")
    d2h, h2d, fwd, bwd = lanes
    # D2H 1..2 ms and H2D 2.5..3 ms of a 4 ms step: widths in the ratio 2:1; compute split 2 steps / 2 steps
    assert len(d2h) == len(h2d) == 1 and d2h[0] == pytest.approx(2 * h2d[0], rel=0.01)
    assert len(fwd) == len(bwd) == 1 and fwd[0] == pytest.approx(bwd[0], rel=0.01)
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_cli_report_writes_page_and_json(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hloopt.cli import cli

    out = tmp_path / "r.html"
    r = CliRunner().invoke(cli, ["report", str(ZOO / "llama.tpu-v5e.hlo"), "-o", str(out), "--budget", "2MiB",
                                 "--json"])
    assert r.exit_code == 0, r.output
    d = ReportData.from_dict(__import__("json").loads(r.output))
    assert d.budget_bytes == 2 * MiB and d.baseline_peak_bytes == max(d.baseline_timeline)
    assert out.read_text() == render_html(d)  # the page is the JSON's data, rendered
    r = CliRunner().invoke(cli, ["report", str(tmp_path / "nope.hlo")])
    assert r.exit_code == 2 and "nope.hlo" in r.output
