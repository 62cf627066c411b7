"""Regenerate docs/report.png: a real plan's HTML report, rendered by headless Chromium.

    hloopt plan fixtures/zoo/llama.py:small --device tpu-v5e --budget 1.66GiB --html /tmp/report.html
    python docs/make_report_png.py /tmp/report.html docs/report.png

The budget lies between the least peak any policy reaches and the all-on-device peak, so the
plan offloads and the transfer lanes have bars. Needs selenium, chromium and chromedriver (the
browser tests' setup). The viewport shows the summary, the memory chart and the transfer lanes.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path


def main(src: str, out: str, width: int = 1280, height: int = 950) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
                f"--window-size={width},{height}"):
        opts.add_argument(arg)
    profile = tempfile.mkdtemp(prefix="hloopt-shot-")
    opts.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver") or "chromedriver"))
    try:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        driver.get(Path(src).resolve().as_uri())
        driver.save_screenshot(out)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
