"""What a learner sees: JupyterLab in a real browser (headless Chromium), notebook 02 run from its menu,
the temperature and top-p sliders moved, and the chart and the continuation checked to change.

Needs Debian's `chromium` (apt-get install chromium) and playwright (in the test extras); without the
browser the test is skipped, saying so. JupyterLab listens on a free loopback port with a random token."""
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here: install Debian's with "
                                "`apt-get install chromium` (or your OS's Chromium) to run the browser test")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]   # no calls home: this machine's network is closed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab on a copy of notebook 02 (the browser's autosave must not touch the course's copy)."""
    shutil.copy(ROOT / "notebooks" / "02_sampling.ipynb", tmp_path / "02_sampling.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={tmp_path}", "--LabApp.news_url=",
           "--ServerApp.port_retries=0"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                              env=dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config")))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _set_slider(page, description: str, value: str) -> None:
    """Type a value into a slider's readout, as a learner can; it fires one change, like a release."""
    slider = page.locator(".widget-slider", has=page.locator(".widget-label", has_text=description))
    readout = slider.locator(".widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(value)
    page.keyboard.press("Enter")


def _chart_and_text(page):
    return (page.locator(".widget-output img").first.get_attribute("src"),
            page.locator(".widget-html").last.inner_text())


def test_notebook_02_sliders_redraw_the_chart_and_the_continuation(jupyterlab, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (in the test extras)")
    base, token = jupyterlab
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/02_sampling.ipynb?token={token}")
            page.locator(".jp-Notebook").wait_for()
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                                   ".jp-Toolbar-kernelStatus", timeout=120_000)
            time.sleep(2)                                    # the kernel connects, the document settles
            assert page.locator(".jp-mod-dirty").count() == 0, "the notebook opened marked as modified"

            # the stored outputs go first: their widgets, rendered from the saved state, already say "drawn in"
            page.locator(".lm-MenuBar-itemLabel", has_text="Edit").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Clear Outputs of All Cells").first.click()
            page.locator(".widget-html").first.wait_for(state="detached")
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            status = page.locator(".widget-html", has_text="drawn in")
            status.wait_for(timeout=600_000)                  # the whole notebook runs first (a few minutes)
            status.scroll_into_view_if_needed()               # Run All ends at the last cell, far below the
            page.locator(".widget-output img").first.wait_for()   # sliders: cells out of view are not drawn
            page.screenshot(path=str(tmp_path / "before.png"))
            before = _chart_and_text(page)
            assert "Once upon a time" in before[1] and len(before[1]) > 80, before[1]

            for description, value, shown in (("temperature", "1.50", "T 1.50"), ("top-p", "0.50", "top-p 0.50")):
                _set_slider(page, description, value)
                page.locator(".widget-html", has_text=shown).wait_for(timeout=120_000)
                after = _chart_and_text(page)
                page.screenshot(path=str(tmp_path / f"after_{description}.png"))
                assert after[0] != before[0], f"the chart did not change when {description} moved"
                assert after[1] != before[1], f"the continuation did not change when {description} moved"
                before = after
        finally:
            browser.close()
