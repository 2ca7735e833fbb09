"""The runs panel in daily use, in JupyterLab in a real Chromium: closed views let go of their
streams, a pool's and a lost run's views say what goes on, escapes are coloured, odd run names
open, Stop asks first, and a run that fails while the panel is closed is told of.

One JupyterLab and one page for the module (a start costs 20-30 s here); each test starts the
runs it looks at, from a terminal (a process that exits), as a person would.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, wait_until
from test_browser import CHROMIUM, CHROMIUM_FLAGS, picture, running_lab
from test_lab import start_detached

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"
    ),
]


class Lab:
    """The module's JupyterLab (root ``work``), its registry, and a Chromium page on it that
    counts the event streams it opened and those that ended."""

    def __init__(self, base: str, token: str, work: Path, registry: Path, page) -> None:
        self.base, self.token, self.work, self.registry, self.page = (
            base,
            token,
            work,
            registry,
            page,
        )
        self.streams_started: list[str] = []
        self.streams_ended: list[str] = []
        page.on("request", self._started)
        page.on("requestfinished", self._ended)
        page.on("requestfailed", self._ended)

    def _started(self, request) -> None:
        if request.url.split("?")[0].endswith("/events"):
            self.streams_started.append(request.url)

    def _ended(self, request) -> None:
        if request.url.split("?")[0].endswith("/events"):
            self.streams_ended.append(request.url)

    def open_streams(self) -> int:
        return len(self.streams_started) - len(self.streams_ended)

    def show_panel(self) -> None:
        tab = self.page.locator('.jp-SideBar li[data-id="nblaunch-runs"]')
        if "lm-mod-current" not in (tab.get_attribute("class") or ""):
            tab.click()

    def row(self, run_id: str):
        return self.page.locator(f'.nbl-lab-run[data-id="{run_id}"]')

    def view(self, run_id: str):
        """A run's view: by its DOM id (an id of [A-Za-z0-9_-] is its own), else the one shown."""
        if re.fullmatch(r"[A-Za-z0-9_-]+", run_id):
            return self.page.locator(f"#nblaunch-run-{run_id}")
        return self.page.locator(".nbl-lab-view:visible")

    def close_tab(self) -> None:
        """Close the main area's current tab, as its x does."""
        self.page.locator(
            "#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabCloseIcon"
        ).click()

    def delete_sessions(self) -> None:
        headers = {"Authorization": f"token {self.token}"}
        request = urllib.request.Request(f"{self.base}/api/sessions", None, headers)
        with urllib.request.urlopen(request, timeout=10) as answer:
            sessions = json.loads(answer.read())
        for session in sessions:
            url = f"{self.base}/api/sessions/{session['id']}"
            urllib.request.urlopen(urllib.request.Request(url, None, headers, method="DELETE"))

    def entry(self, run_id: str) -> dict:
        return json.loads((self.registry / f"{run_id}.json").read_text())


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    base_dir = tmp_path_factory.mktemp("labdaily")
    work, registry = base_dir / "work", base_dir / "detached"
    work.mkdir()
    config = base_dir / "config" / "jupyter_server_config.d"
    config.mkdir(parents=True)
    shutil.copy(ROOT / "jupyter-config" / "jupyter_server_config.d" / "nblaunch.json", config)
    share = base_dir / "share"
    (share / "labextensions").mkdir(parents=True)
    (share / "labextensions" / "nblaunch-lab").symlink_to(
        ROOT / "nblaunch" / "lab" / "labextension"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NBLAUNCH_DETACHED_DIR", str(registry))
        patch.delenv("NBLAUNCH_RUN_DIR", raising=False)
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base_dir / "config"))
        env["JUPYTER_PATH"] = str(share)
        with running_lab(base_dir, env) as (base, token), sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS
            )
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 800})
                page.goto(f"{base}/lab?token={token}", timeout=90_000)
                lab = Lab(base, token, work, registry, page)
                page.locator('.jp-SideBar li[data-id="nblaunch-runs"]').wait_for(timeout=90_000)
                lab.show_panel()
                yield lab
            finally:
                browser.close()
                for path in registry.glob("*.json"):  # no run host outlives the module
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        entry = json.loads(path.read_text())
                        if entry["state"] == "running":
                            os.kill(entry["pid"], signal.SIGKILL)


def test_closed_views_let_go_of_their_streams_and_the_page_keeps_working(lab, tmp_path):
    from playwright.sync_api import expect

    run_id = start_detached(lab.work, 3000, 0.1)
    lab.show_panel()
    row = lab.row(run_id)
    expect(row).to_contain_text("running", timeout=30_000)
    expect(row.locator(".nbl-lab-name")).to_have_text("train")  # what it runs, then its id
    expect(row.locator(".nbl-lab-when")).to_contain_text("from train.py · started")
    for _ in range(8):  # past Chromium's six connections per host
        row.click()
        expect(lab.view(run_id).locator(".nbl-lab-rank")).to_have_count(2, timeout=20_000)
        lab.close_tab()
        expect(lab.view(run_id)).to_have_count(0)
    assert len(lab.streams_started) >= 8
    assert wait_until(lambda: lab.page.wait_for_timeout(100) or lab.open_streams() == 0, 10), (
        f"{len(lab.streams_started)} streams started, {len(lab.streams_ended)} ended"
    )
    # The page still works: a new view fills, and Jupyter's own requests answer at once.
    row.click()
    expect(lab.view(run_id).locator(".nbl-lab-step")).to_contain_text("last step", timeout=10_000)
    answered = lab.page.evaluate(
        """async token => {
            const began = performance.now();
            const response = await fetch('/api/contents?token=' + token);
            return [response.status, performance.now() - began];
        }""",
        lab.token,
    )
    assert answered[0] == 200 and answered[1] < 5000, answered
    # Stop asks first: Cancel leaves the run going; Stop stops it, and says so at once.
    view = lab.view(run_id)
    view.locator(".nbl-lab-stop").click()
    dialog = lab.page.locator(".jp-Dialog")
    expect(dialog).to_contain_text(f"Stop the run {run_id}?")
    dialog.locator(".jp-mod-reject").click()
    lab.page.wait_for_timeout(1000)
    assert lab.entry(run_id)["state"] == "running"
    view.locator(".nbl-lab-stop").click()
    expect(dialog).to_be_visible()
    lab.page.wait_for_timeout(300)  # the dialog's fade-in, before the picture
    lab.page.screenshot(path=str(picture("lab-stop.png", tmp_path)))
    lab.page.locator(".jp-Dialog .jp-mod-accept").click()
    expect(view.locator(".nbl-lab-run-state")).to_have_text("STOPPED", timeout=15_000)
    assert lab.entry(run_id)["state"] == "stopped"
    lab.close_tab()


POOL = """
import time, nblaunch
pool = nblaunch.start_pool(2, detach=True, device_type="cpu")
print(pool.entry.run_id, flush=True)
time.sleep(120)
"""


def test_a_running_pools_view_shows_its_ranks_running_on_their_devices(lab):
    from playwright.sync_api import expect

    (lab.work / "pool.py").write_text(POOL)
    terminal = subprocess.Popen(
        [sys.executable, "pool.py"], cwd=lab.work, stdout=subprocess.PIPE, text=True
    )
    try:
        pool_id = terminal.stdout.readline().strip()
        lab.show_panel()
        lab.row(pool_id).click()
        view = lab.view(pool_id)
        badges = view.locator(".nbl-lab-rank")
        expect(badges).to_have_count(2, timeout=20_000)
        for rank in range(2):
            expect(badges.nth(rank)).to_contain_text(f"rank {rank} · RUNNING")
            expect(badges.nth(rank).locator(".nbl-lab-device")).to_have_text("cpu")
        expect(view.locator(".nbl-lab-holder")).to_contain_text(f"held by pid {terminal.pid}")
    finally:
        terminal.kill()
        terminal.wait(10)
        with contextlib.suppress(OSError, ValueError, KeyError):
            os.kill(lab.entry(pool_id)["pid"], signal.SIGTERM)
    lab.close_tab()


def test_a_lost_runs_view_says_why_and_its_ranks_are_lost(lab, tmp_path):
    from playwright.sync_api import expect

    run_id = start_detached(lab.work, 3000, 0.05)
    lab.show_panel()
    lab.row(run_id).click()
    view = lab.view(run_id)
    expect(view.locator(".nbl-lab-rank").first).to_contain_text("RUNNING", timeout=30_000)
    pid = lab.entry(run_id)["pid"]
    os.kill(pid, signal.SIGKILL)  # the host is killed; its ranks follow it
    expect(view.locator(".nbl-lab-run-state")).to_have_text("LOST", timeout=30_000)
    expect(view.locator(".nbl-lab-rank")).to_have_count(2)
    for rank in range(2):
        expect(view.locator(".nbl-lab-rank").nth(rank)).to_contain_text(f"rank {rank} · LOST")
    cause = view.locator(".nbl-lab-diagnosis", has_text="lost")
    expect(cause).to_contain_text(f"the run host (pid {pid}) ended")
    expect(cause).to_contain_text("The end of host.log:")
    expect(lab.row(run_id).locator(".nbl-lab-cause")).to_contain_text("lost")
    lab.page.wait_for_timeout(300)
    lab.page.screenshot(path=str(picture("lab-lost.png", tmp_path)))
    lab.close_tab()


def plant_kernel_run(lab: Lab, name: str, log: str) -> None:
    run_dir = lab.work / ".nblaunch" / "runs" / name
    run_dir.mkdir(parents=True)
    (run_dir / "rank0.log").write_text(log)


def test_escapes_are_coloured_as_the_notebooks_view_colours_them(lab):
    from playwright.sync_api import expect

    name = "20261206-090000-000000-c010"
    log = "plain start\n\x1b[31mred error\x1b[0m then \x1b[1mbold\x1b[0m\x1b[2K\r\n"
    plant_kernel_run(lab, name, log)
    lab.show_panel()
    lab.row(name).click()
    view = lab.view(name)
    last = view.locator(".nbl-lab-rank .nbl-lab-last")
    expect(last).to_have_text("red error then bold", timeout=20_000)
    red = last.locator("span", has_text="red error")
    assert red.evaluate("node => getComputedStyle(node).color") == "rgb(198, 40, 40)"
    bold = last.locator("span", has_text="bold")
    assert bold.evaluate("node => getComputedStyle(node).fontWeight") == "700"
    view.locator(".nbl-lab-all summary").click()
    text = view.locator(".nbl-lab-log").inner_text()
    assert "\x1b" not in text and "[31m" not in text and "red error" in text
    lab.close_tab()


def test_a_run_with_a_space_an_equals_a_plus_and_an_umlaut_in_its_name_opens(lab):
    from playwright.sync_api import expect

    name = "lr=0.1 +warm über"
    plant_kernel_run(lab, name, "step 0\nstep 1\n")
    lab.show_panel()
    lab.row(name).click()
    view = lab.view(name)
    expect(view.locator(".nbl-lab-rank .nbl-lab-last")).to_have_text("step 1", timeout=20_000)
    lab.close_tab()


def test_a_run_that_fails_while_the_panel_is_closed_is_told_of(lab):
    from playwright.sync_api import expect

    lab.show_panel()
    run_id = start_detached(lab.work, 60, 0.1, fail=True)
    expect(lab.row(run_id)).to_contain_text("running", timeout=30_000)
    lab.page.locator('.jp-SideBar li[data-id="filebrowser"]').click()  # the panel closes
    toast = lab.page.locator(".Toastify__toast", has_text=run_id)
    expect(toast).to_contain_text("failed", timeout=60_000)
    expect(toast).to_contain_text("no column 7 on rank 1")
    toast.get_by_text("Show").click()
    expect(lab.view(run_id).locator(".nbl-lab-run-state")).to_have_text("FAILED", timeout=20_000)
    lab.close_tab()
    lab.show_panel()


def test_insert_attach_puts_the_cell_into_the_current_notebook(lab):
    from playwright.sync_api import expect

    notebook = {
        "cells": [{"cell_type": "code", "metadata": {}, "source": "1 + 1", "outputs": [],
                   "execution_count": None}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }  # fmt: skip
    (lab.work / "attach.ipynb").write_text(json.dumps(notebook))
    run_id = start_detached(lab.work, 3000, 0.1)
    try:
        lab.page.evaluate(
            "jupyterapp.commands.execute('docmanager:open', {path: 'attach.ipynb'}).then(() => 1)"
        )
        expect(lab.page.locator(".jp-Notebook .jp-Cell")).to_have_count(1, timeout=30_000)
        lab.show_panel()
        lab.row(run_id).click()
        view = lab.view(run_id)
        view.locator(".nbl-lab-attach").click()
        cells = lab.page.locator(".jp-Notebook .jp-Cell")
        expect(cells).to_have_count(2, timeout=10_000)
        expect(cells.nth(1)).to_contain_text(f'run = nblaunch.attach("{run_id}")')
    finally:
        os.kill(lab.entry(run_id)["pid"], signal.SIGTERM)
        lab.delete_sessions()  # the notebook's kernel (the tab stays: its cell is unsaved)


def test_the_list_filters_pages_and_says_when_the_server_cannot_be_reached(lab):
    from playwright.sync_api import expect

    planted = [f"20261101-0000{i:02d}-000000-aa{i:02d}" for i in range(55)]
    for name in planted:
        plant_kernel_run(lab, name, "step 0\n")
    lab.show_panel()
    panel = lab.page.locator("#nblaunch-runs")
    panel.locator(".nbl-lab-filter").select_option("ended")
    rows = panel.locator(".nbl-lab-run")
    expect(rows).to_have_count(50, timeout=10_000)  # a page
    more = panel.locator(".nbl-lab-more")
    expect(more).to_contain_text("more of")
    more.click()
    ended = len([run for run in _runs(lab) if run["state"] == "ended"])
    assert ended >= 55
    expect(rows).to_have_count(ended)
    panel.locator(".nbl-lab-filter").select_option("done")
    done = [run["id"] for run in _runs(lab) if run["state"] == "done"]
    expect(rows).to_have_count(len(done))
    assert sorted(rows.evaluate_all("rows => rows.map(row => row.dataset.id)")) == sorted(done)
    panel.locator(".nbl-lab-filter").select_option("")
    # The server goes away: the panel says so, and recovers when it is back.
    listing = re.compile(r".*/nblaunch/api/runs(\?.*)?$")  # Lab adds a cache-buster
    lab.page.route(listing, lambda route: route.abort())
    error = panel.locator(".nbl-lab-error")
    expect(error).to_contain_text("cannot reach the server", timeout=10_000)
    lab.page.unroute(listing)
    expect(error).to_be_empty(timeout=10_000)
    # Clear ended…: it names what goes and asks first; the ended runs' directories go.
    panel.locator(".nbl-lab-filter").select_option("ended")
    panel.locator(".nbl-lab-clear").click()
    dialog = lab.page.locator(".jp-Dialog")
    expect(dialog).to_contain_text(f"Clear {ended} ended runs?")
    dialog.locator(".jp-mod-reject").click()
    assert all((lab.work / ".nblaunch" / "runs" / name).is_dir() for name in planted)
    panel.locator(".nbl-lab-clear").click()
    dialog.locator(".jp-mod-accept").click()
    expect(panel.locator(".nbl-lab-run")).to_have_count(0, timeout=30_000)
    assert not any((lab.work / ".nblaunch" / "runs" / name).exists() for name in planted)
    assert not [run for run in _runs(lab) if run["state"] == "ended"]
    panel.locator(".nbl-lab-filter").select_option("")


SLOW_LIST = """() => {
    // Every read of the list takes 5 s more: count how many are in flight at once.
    const fetch = window.fetch;
    const seen = (window.nblSlowList = { now: 0, most: 0, asked: 0, fetch });
    window.fetch = async (...args) => {
        const url = String(args[0] && args[0].url ? args[0].url : args[0]);
        if (!/\\/nblaunch\\/api\\/runs(\\?|$)/.test(url)) {
            return fetch(...args);
        }
        seen.asked += 1;
        seen.now += 1;
        seen.most = Math.max(seen.most, seen.now);
        try {
            await new Promise(resolve => setTimeout(resolve, 5000));
            return await fetch(...args);
        } finally {
            seen.now -= 1;
        }
    };
}"""


def test_a_slow_server_is_asked_for_the_list_once_at_a_time(lab):
    lab.show_panel()
    lab.page.evaluate(SLOW_LIST)
    try:
        lab.page.wait_for_timeout(12_000)  # 6 ticks of the panel's timer
        seen = lab.page.evaluate("() => window.nblSlowList")
    finally:
        lab.page.evaluate("() => { window.fetch = window.nblSlowList.fetch; }")
    assert seen["asked"] >= 2, seen  # the patch saw the panel's reads
    assert seen["most"] == 1, seen


def _runs(lab: Lab) -> list[dict]:
    headers = {"Authorization": f"token {lab.token}"}
    request = urllib.request.Request(f"{lab.base}/nblaunch/api/runs", None, headers)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())["runs"]
