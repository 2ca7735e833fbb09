"""The runs panel in JupyterLab in a real Chromium: a detached run started from a terminal is
listed, its view grows, and its Stop button stops it; no kernel runs at any point.

JupyterLab is given the package's server config file and finds the prebuilt extension through
``JUPYTER_PATH`` (a link to ``nblaunch/lab/labextension``), as an installed wheel provides both.
The test takes ``docs/lab-panel.png`` (into its temporary folder; ``make screenshots`` keeps it).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request

import pytest
from conftest import ROOT
from test_browser import CHROMIUM, CHROMIUM_FLAGS, picture, running_lab
from test_lab import start_detached

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"
    ),
]


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """JupyterLab with the runs panel, its root folder ``tmp_path/work``; yields (URL, work)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(tmp_path / "detached"))
    monkeypatch.delenv("NBLAUNCH_RUN_DIR")
    config = tmp_path / "config" / "jupyter_server_config.d"
    config.mkdir(parents=True)
    shutil.copy(ROOT / "jupyter-config" / "jupyter_server_config.d" / "nblaunch.json", config)
    share = tmp_path / "share"
    (share / "labextensions").mkdir(parents=True)
    (share / "labextensions" / "nblaunch-lab").symlink_to(
        ROOT / "nblaunch" / "lab" / "labextension"
    )
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_PATH=str(share))
    with running_lab(tmp_path, env) as (base, token):
        yield f"{base}/lab?token={token}", work, (base, token)


def _kernels(base: str, token: str) -> list:
    with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10) as answer:
        return json.loads(answer.read())


def test_the_panel_lists_a_detached_run_shows_it_live_and_stops_it(lab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    url, work, (base, token) = lab
    # A kernel's ended run of 12 ranks (its logs only): its view draws a grid of squares.
    many = work / ".nblaunch" / "runs" / "20261204-080000-000000-abcd"
    many.mkdir(parents=True)
    for rank in range(12):
        (many / f"rank{rank}.log").write_text(f"rank {rank} step 0\nrank {rank} step 1\n")
    failed_id = start_detached(work, 3, 0.05, fail=True)  # from a terminal, which exits
    run_id = start_detached(work, 3000, 0.1)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 800})
            asked: list[str] = []
            page.on("request", lambda request: asked.append(request.url))
            page.goto(url, timeout=90_000)
            tab = page.locator('.jp-SideBar li[data-id="nblaunch-runs"]')
            expect(tab).to_be_visible(timeout=90_000)
            tab.click()
            failed = page.locator(f'.nbl-lab-run[data-id="{failed_id}"]')
            expect(failed).to_have_class("nbl-lab-run nbl-lab-state-failed", timeout=60_000)
            expect(failed.locator(".nbl-lab-cause")).to_contain_text("no column 7 on rank 1")
            row = page.locator(f'.nbl-lab-run[data-id="{run_id}"]')
            expect(row).to_contain_text("running · detached · 2 ranks", timeout=30_000)
            expect(row).to_have_class("nbl-lab-run nbl-lab-state-running")
            row.click()
            view = page.locator(f"#nblaunch-run-{run_id}")
            expect(view.locator(".nbl-lab-rank")).to_have_count(2, timeout=30_000)
            expect(view.locator(".nbl-lab-rank").first).to_contain_text("rank 0 · RUNNING")
            step = view.locator(".nbl-lab-step")
            expect(step).to_contain_text("last step", timeout=30_000)

            def last_step() -> int:
                return int(step.inner_text().split()[-1])

            first = last_step()
            deadline = time.monotonic() + 30
            while last_step() < first + 5 and time.monotonic() < deadline:
                page.wait_for_timeout(250)
            assert last_step() >= first + 5, "the view did not grow"
            expect(view.locator(".nbl-lab-chart polyline")).to_have_count(2)
            page.wait_for_timeout(300)  # let the last repaint settle before the picture
            shot = picture("lab-panel.png", tmp_path)
            page.screenshot(path=str(shot))
            view.locator(".nbl-lab-stop").click()
            page.locator(".jp-Dialog .jp-mod-accept").click()  # Stop asks first
            expect(view.locator(".nbl-lab-run-state")).to_have_text("STOPPED", timeout=30_000)
            expect(view.locator(".nbl-lab-stop")).to_have_count(0)
            expect(row).to_contain_text("stopped", timeout=10_000)
            expect(view.locator(".nbl-lab-summary")).to_contain_text("finished in")
            page.locator(f'.nbl-lab-run[data-id="{many.name}"]').click()
            grid = page.locator(f"#nblaunch-run-{many.name} .nbl-lab-grid .nbl-lab-cell")
            expect(grid).to_have_count(12, timeout=30_000)
            assert "rank 11 step 1" in (grid.last.get_attribute("title") or "")
            # A run's log opens in a browser tab from its view.
            row.click()
            with page.expect_popup() as popup:
                view.locator(".nbl-lab-log-link", has_text="rank1.log").click()
            popup.value.wait_for_load_state()
            assert "step 1\n" in popup.value.locator("body").inner_text()
            # The view followed the run's event stream; it never fell back to asking each second.
            assert [url for url in asked if f"/runs/{run_id}/events" in url]
            assert not [url for url in asked if "?since=" in url]
        finally:
            browser.close()
    assert _kernels(base, token) == []  # all of it without a kernel
    assert shot.stat().st_size > 10_000
