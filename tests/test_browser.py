"""What a person sees: JupyterLab in a real Chromium runs the quick-start notebook.

Run alone with ``pytest -m browser`` (``make test-browser``). Needs Debian's chromium at
``/usr/bin/chromium`` (``apt-get install chromium``); the test is skipped without it. The
tests take the pictures the docs show (``docs/launch-view.png`` and others) into their temporary
folders; ``make screenshots`` (``NBLAUNCH_DOC_PICTURES=1``) saves them over the docs' own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"
    ),
]


def picture(name: str, tmp_path: Path) -> Path:
    """Where a test saves the picture ``docs/<name>``: there under ``make screenshots``, else in
    the test's temporary folder, so that running the tests leaves the checkout as it was."""
    folder = ROOT / "docs" if os.environ.get("NBLAUNCH_DOC_PICTURES") == "1" else tmp_path
    return folder / name


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _quiet_settings(settings: Path) -> None:
    """No news or update pop-ups over the notebook."""
    path = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


@pytest.fixture(scope="module")
def shared_lab(tmp_path_factory) -> Iterator[tuple[Path, str, str]]:
    """One JupyterLab for the module's tests (a start costs 5-20 s here): its root folder, base
    URL and token. Each test's notebook is in a folder of its own (its runs go next to it) and
    opens in a workspace of its own, so no test's layout or kernel shows in another's page."""
    base_dir = tmp_path_factory.mktemp("jupyterlab")
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base_dir / "config"))
    env.pop("NBLAUNCH_RUN_DIR", None)  # the default, .nblaunch/runs next to the notebook
    (base_dir / "work").mkdir()
    with running_lab(base_dir, env) as (base, token):
        yield base_dir / "work", base, token


@pytest.fixture
def jupyterlab(shared_lab, tmp_path):
    """JupyterLab serving a scratch copy of the quick-start notebook; yields its URL."""
    folder = _folder(shared_lab, tmp_path)
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", folder / "quickstart.ipynb")
    yield from _serve(shared_lab, folder, "quickstart.ipynb")


def _folder(shared_lab: tuple[Path, str, str], tmp_path: Path) -> Path:
    """The test's own folder in the shared JupyterLab's root (named as its ``tmp_path``)."""
    folder = shared_lab[0] / tmp_path.name
    folder.mkdir()
    return folder


def _serve(shared_lab: tuple[Path, str, str], folder: Path, name: str):
    """Yields the URL of notebook ``folder/name`` in the shared JupyterLab, in a workspace of
    its own; afterwards shuts its kernels down, as closing the notebook would not."""
    work, base, token = shared_lab
    path = f"{folder.relative_to(work)}/{name}"
    yield f"{base}/lab/workspaces/{folder.name}/tree/{path}?token={token}"
    headers = {"Authorization": f"token {token}"}
    with urllib.request.urlopen(urllib.request.Request(f"{base}/api/sessions", None, headers)) as r:
        sessions = json.loads(r.read())
    for session in sessions:
        if session["path"].startswith(f"{folder.relative_to(work)}/"):
            url = f"{base}/api/kernels/{session['kernel']['id']}"
            urllib.request.urlopen(urllib.request.Request(url, None, headers, method="DELETE"))


@contextlib.contextmanager
def running_lab(tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """JupyterLab on 127.0.0.1 with ``env``, its root ``tmp_path/work``; yields (base URL, token)
    once it answers, and stops it afterwards."""
    work = tmp_path / "work"
    _quiet_settings(tmp_path / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",  # CI runs as root in a throw-away container
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={work}",
            f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
            f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
            "--LabApp.expose_app_in_browser=True",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "jupyterlab.log", "wb"),  # noqa: SIM115
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        "JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()
                    ) from None
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


@contextlib.contextmanager
def _open(url: str, height: int):
    """Chromium with the notebook at ``url`` open and its kernel idle; yields the page and
    closes the browser at the end."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": height})
            page.goto(url, timeout=90_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            _kernel_idle(page)
            yield page
        finally:
            browser.close()


@contextlib.contextmanager
def _running(url: str, height: int):
    """:func:`_open`, then every cell started."""
    with _open(url, height) as page:
        # Not awaited: the command's promise settles only when every cell has run.
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        yield page


def test_quickstart_in_jupyterlab_shows_both_ranks_done(jupyterlab, tmp_path):
    from playwright.sync_api import expect

    with _running(jupyterlab, height=1600) as page:
        # The launch cell's view: the %%distributed cell below starts a view of its own.
        launch_cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
        view = launch_cell.locator(".nbl-root")
        expect(view).to_be_visible(timeout=120_000)
        ranks = view.locator(".nbl-ranks")
        expect(ranks).to_contain_text("rank 0 · DONE", timeout=120_000)
        expect(ranks).to_contain_text("rank 1 · DONE", timeout=30_000)
        # The "All ranks" tab is the one showing; it holds rank 1's lines.
        shown_log = view.locator(".nbl-log:visible")
        expect(shown_log).to_have_count(1)
        expect(shown_log).to_contain_text("[1] rank 1 step 7: all_reduce -> 15")
        summary = launch_cell.locator(".jp-OutputArea-output", has_text="finished in")
        expect(summary.last).to_contain_text("rank 1")
        page.wait_for_timeout(500)  # let the last repaint settle before the picture
        outputs = launch_cell.locator(".jp-Cell-outputWrapper")
        outputs.scroll_into_view_if_needed()
        shot = picture("launch-view.png", tmp_path)
        outputs.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000


CHART_CELLS = [
    "import nblaunch\n"
    "def train(steps):\n"
    "    import math, time\n"
    "    for step in range(steps):\n"
    "        loss = math.exp(-step / 20) + 0.05 * nblaunch.rank()\n"
    "        nblaunch.log_metrics({'loss': loss, 'lr': 0.1 * 0.97 ** step}, step=step)\n"
    "        time.sleep(0.1)\n"
    "    return step",
    "nblaunch.notebook_launcher(train, (150,), num_processes=2, device_type='cpu')",
]


def _notebook(shared_lab: tuple[Path, str, str], tmp_path: Path, name: str, cells: list[str]):
    """JupyterLab serving a new notebook ``name`` made of ``cells``; yields its URL."""
    import nbformat

    work = _folder(shared_lab, tmp_path)
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    # A kernel to start without asking, as a saved notebook has.
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(notebook, work / name)
    yield from _serve(shared_lab, work, name)


@pytest.fixture
def chart_notebook(shared_lab, tmp_path):
    yield from _notebook(shared_lab, tmp_path, "charts.ipynb", CHART_CELLS)


def test_the_loss_chart_moves_while_ranks_train(chart_notebook, tmp_path):
    from playwright.sync_api import expect

    shots = [picture(f"metrics-chart-{n}.png", tmp_path) for n in (1, 2)]
    with _running(chart_notebook, height=1400) as page:
        charts = page.locator(".nbl-root .nbl-charts")
        expect(charts).to_be_visible(timeout=120_000)
        expect(charts.locator("polyline").first).to_be_attached(timeout=30_000)
        expect(page.locator(".nbl-root .nbl-ranks")).to_contain_text("RUNNING")

        def points() -> int:  # points on the first rank's loss line now
            return len(charts.locator("polyline").first.get_attribute("points").split())

        first = points()
        view = page.locator(".jp-Cell", has=charts).locator(".jp-Cell-outputWrapper")
        view.screenshot(path=str(shots[0]))
        page.wait_for_timeout(3000)
        second = points()
        view.screenshot(path=str(shots[1]))
        assert second > first  # the line grew while the ranks trained
        assert charts.locator("svg").count() >= 2  # loss, lr (and steps/s)
        assert charts.locator("polyline").count() >= 4  # a line per rank in each
    assert all(shot.stat().st_size > 5_000 for shot in shots)


DEBUG_CELLS = [
    "%load_ext nblaunch",
    "%%distributed -n 2\n"
    "import nblaunch, torch, torch.distributed as dist\n"
    "x = torch.arange(3) + 10 * rank\n"
    "nblaunch.breakpoint(rank=1)\n"
    "dist.all_reduce(x)\n"
    "x.tolist()",
]


@pytest.fixture
def debug_notebook(shared_lab, tmp_path):
    yield from _notebook(shared_lab, tmp_path, "debug.ipynb", DEBUG_CELLS)


def test_a_rank_s_breakpoint_is_answered_in_the_notebook(debug_notebook, tmp_path):
    from playwright.sync_api import expect

    shot = picture("debugger.png", tmp_path)
    with _running(debug_notebook, height=900) as page:
        prompt = page.locator(".jp-Stdin-input")
        expect(prompt).to_be_visible(timeout=120_000)
        expect(page.locator(".jp-Stdin-prompt").first).to_contain_text("[rank 1] (Pdb)")
        ranks = page.locator(".nbl-root .nbl-ranks")
        expect(ranks).to_contain_text("DEBUGGING")
        expect(ranks).to_contain_text("waiting for rank 1 (in the debugger)")
        prompt.fill("p x")
        prompt.press("Enter")
        expect(
            page.locator(".jp-OutputArea-output", has_text="tensor([10, 11, 12])")
        ).to_be_visible(timeout=30_000)
        expect(page.locator(".jp-Stdin-input")).to_have_count(2, timeout=30_000)  # the next one
        page.wait_for_timeout(300)
        cell = page.locator(".jp-Cell", has=page.locator(".nbl-root"))
        cell.locator(".jp-Cell-outputWrapper").screenshot(path=str(shot))
        page.locator(".jp-Stdin-input").last.fill("c")
        page.locator(".jp-Stdin-input").last.press("Enter")
        expect(page.locator(".jp-OutputArea-output", has_text="[10, 12, 14]")).to_be_visible(
            timeout=60_000
        )
    assert shot.stat().st_size > 5_000


BACKGROUND_CELLS = [
    "import nblaunch, time\n"
    "def train(steps):\n"
    "    for step in range(steps):\n"
    "        print(f'step {step}', flush=True)\n"
    "        nblaunch.log_metrics({'loss': 1 / (step + 1)}, step=step)\n"
    "        time.sleep(0.1)\n"
    "    return step",
    "h = nblaunch.notebook_launcher(train, (600,), num_processes=2, device_type='cpu', "
    "block=False)",
    "6 * 7",
    "h.view()",
]


@pytest.fixture
def background_notebook(shared_lab, tmp_path):
    yield from _notebook(shared_lab, tmp_path, "background.ipynb", BACKGROUND_CELLS)


def _run_cell(page, index: int) -> None:
    """Run the notebook's cell ``index`` as a person would (select it, run it)."""
    page.evaluate(
        "(i) => { const n = window.jupyterapp.shell.currentWidget.content;"
        " n.activeCellIndex = i; window.jupyterapp.commands.execute('notebook:run-cell'); }",
        index,
    )


def _kernel_idle(page, timeout_ms: int = 90_000) -> None:
    page.wait_for_function(
        "() => { const p = window.jupyterapp?.shell?.currentWidget;"
        " return p?.sessionContext?.session?.kernel?.status === 'idle'; }",
        timeout=timeout_ms,
    )


def _last_step(log) -> int:
    """The highest ``step N`` a view's log shows."""
    return max(int(n) for n in re.findall(r"step (\d+)", log.inner_text()))


def test_a_background_run_s_view_comes_back_after_a_page_reload(background_notebook, tmp_path):
    """Start a background run, run another cell meanwhile, reload the page (the outputs go, the
    kernel answers at once), show the view again in a new cell, see it move, stop it there."""
    from playwright.sync_api import expect

    shots = [picture(f"background-{n}.png", tmp_path) for n in ("before-reload", "after-reload")]
    with _open(background_notebook, height=1200) as page:
        for index in (0, 1):
            _run_cell(page, index)
        ranks = page.locator(".nbl-root .nbl-ranks")
        expect(ranks).to_contain_text("rank 1 · RUNNING", timeout=120_000)
        _run_cell(page, 2)  # runs at once: the launch does not hold the kernel
        # The cell's own result, not the run's view (whose lines may hold a "42" too).
        answer = page.locator("[data-mime-type='text/plain']", has_text=re.compile(r"^42$"))
        expect(answer).to_be_visible(timeout=30_000)
        expect(ranks).to_contain_text("RUNNING")
        page.wait_for_timeout(1500)
        cell = page.locator(".jp-Cell", has=page.locator(".nbl-root"))
        cell.locator(".jp-Cell-outputWrapper").screenshot(path=str(shots[0]))

        page.reload()
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        _kernel_idle(page, 30_000)  # not "busy" or "unknown": the run holds no cell
        expect(page.locator(".nbl-root")).to_have_count(0)  # the old output is gone
        _run_cell(page, 3)  # h.view()
        view = page.locator(".nbl-root")
        expect(view.locator(".nbl-ranks")).to_contain_text("RUNNING", timeout=30_000)
        log = view.locator(".nbl-log:visible")
        expect(log).to_contain_text("step 1", timeout=30_000)  # the history came back
        expect(view.locator(".nbl-charts polyline").first).to_be_attached(timeout=30_000)

        first = _last_step(log)
        page.wait_for_timeout(2000)
        assert _last_step(log) > first  # live: the view moves
        page.locator(".jp-Cell", has=view).locator(".jp-Cell-outputWrapper").screenshot(
            path=str(shots[1])
        )
        view.locator("button", has_text="Stop").click()
        expect(view.locator(".nbl-ranks")).to_contain_text("STOPPED", timeout=30_000)
    assert all(shot.stat().st_size > 5_000 for shot in shots)


def test_a_newer_view_replaces_the_older_one_in_the_page(background_notebook, tmp_path):
    """The launch cell's live view, then ``h.view()`` in another cell without a reload: the
    older one stops, leaving its last state as static HTML under a note; the newer one moves."""
    from playwright.sync_api import expect

    with _open(background_notebook, height=1600) as page:
        for index in (0, 1):
            _run_cell(page, index)
        cells = page.locator(".jp-Notebook .jp-Cell")
        first = cells.nth(1)
        expect(first.locator(".nbl-ranks")).to_contain_text("RUNNING", timeout=120_000)
        expect(first.locator("button", has_text="Stop")).to_be_visible()
        _run_cell(page, 3)  # h.view()
        newer = cells.nth(3)
        expect(newer.locator(".nbl-ranks")).to_contain_text("RUNNING", timeout=30_000)
        expect(first).to_contain_text("A newer view of this run replaced this one")
        expect(first.locator("button", has_text="Stop")).to_have_count(0)  # no widgets
        expect(first.locator(".nbl-ranks")).to_contain_text("rank 1")  # its last state
        frozen = first.inner_text()
        log = newer.locator(".nbl-log:visible")
        expect(log).to_contain_text("step 1", timeout=30_000)

        before = _last_step(log)
        page.wait_for_timeout(2000)
        assert _last_step(log) > before  # the newer view is live
        assert first.inner_text() == frozen  # the older one is not
        newer.locator("button", has_text="Stop").click()
        expect(newer.locator(".nbl-ranks")).to_contain_text("STOPPED", timeout=30_000)


def _many_ranks_cells(ranks: int) -> list[str]:
    """A new user's loop on ``ranks`` CPU ranks: an all_reduce a step, tqdm, a print every
    20 steps (benchmarks/bench_views.py runs the same)."""
    return [
        f"import os, time\nos.environ['NBLAUNCH_MAX_PROCESSES'] = '{ranks}'\nimport nblaunch",
        "def train(steps):\n"
        "    import torch, torch.distributed as dist\n"
        "    from tqdm import tqdm\n"
        "    print(f'hello from rank {dist.get_rank()}')\n"
        "    model = torch.nn.Linear(16, 1)\n"
        "    for step in tqdm(range(steps), mininterval=0.5):\n"
        "        loss = model(torch.randn(8, 16)).pow(2).mean()\n"
        "        loss.backward()\n"
        "        for p in model.parameters():\n"
        "            dist.all_reduce(p.grad)\n"
        "        if step % 20 == 0:\n"
        "            print(f'epoch 0 step {step} loss {loss.item():.2f} lr 0.05')\n"
        "    return dist.get_rank()",
        "started = time.monotonic()\n"
        f"results = nblaunch.notebook_launcher(train, (60,), num_processes={ranks}, "
        "device_type='cpu')\n"
        "print(f'launch returned after {time.monotonic() - started:.1f} s')",
    ]


def _show_many_ranks(url: str, ranks: int, shot: Path) -> dict[str, float]:
    """Run the loop on ``ranks`` ranks in JupyterLab; check the grid, the folded All ranks and
    the picker; save ``shot``; return when the browser showed what (s after run-all)."""
    from playwright.sync_api import expect

    times: dict[str, float] = {}
    with _running(url, height=1400) as page:
        began = time.monotonic()
        view = page.locator(".nbl-root")
        expect(view).to_be_visible(timeout=240_000)
        times["view shown"] = time.monotonic() - began
        if ranks > 8:
            grid = view.locator(".nbl-grid")
            expect(grid.locator(".nbl-cell")).to_have_count(ranks, timeout=60_000)
            expect(view).to_contain_text(f"{ranks} DONE", timeout=240_000)
        else:
            expect(view.locator(".nbl-ranks")).to_contain_text("rank 7 · DONE", timeout=240_000)
        times["every rank DONE"] = time.monotonic() - began
        log = view.locator(".nbl-log:visible")
        expect(log).to_contain_text(f"[0-{ranks - 1}] epoch 0 step 40 loss")
        returned = page.locator(".jp-OutputArea-output", has_text="launch returned after")
        expect(returned).to_be_visible(timeout=60_000)
        times["cell printed its end"] = time.monotonic() - began
        page.wait_for_timeout(500)
        outputs = page.locator(".jp-Cell", has=view).locator(".jp-Cell-outputWrapper")
        outputs.scroll_into_view_if_needed()
        # Past 8 ranks the saved summary is short enough to show under the live view.
        (outputs if ranks > 8 else view).screenshot(path=str(shot))
        if ranks > 8:  # the rank picker, in place of a tab per rank
            view.get_by_role("tab", name="One rank").click()
            view.locator("select").select_option(label="rank 5")
            expect(view.locator(".nbl-log:visible")).to_contain_text("hello from rank 5")
    assert shot.stat().st_size > 10_000
    return times


@pytest.fixture
def sixteen_ranks(shared_lab, tmp_path):
    yield from _notebook(shared_lab, tmp_path, "ranks16.ipynb", _many_ranks_cells(16))


def test_sixteen_ranks_show_a_grid_a_picker_and_folded_lines(sixteen_ranks, tmp_path):
    times = _show_many_ranks(sixteen_ranks, 16, tmp_path / "ranks16.png")
    print(f"16 ranks in JupyterLab, seconds after run-all: {times}")


@pytest.fixture(params=[8, 64])
def many_ranks(request, shared_lab, tmp_path):
    ranks = request.param
    for url in _notebook(shared_lab, tmp_path, f"ranks{ranks}.ipynb", _many_ranks_cells(ranks)):
        yield ranks, url


@pytest.mark.screenshots
def test_screenshots_at_8_and_64_ranks(many_ranks, tmp_path):
    """The pictures docs/view.md shows (64 CPU ranks: a minute or more on 2 cores)."""
    ranks, url = many_ranks
    times = _show_many_ranks(url, ranks, picture(f"view-{ranks}-ranks.png", tmp_path))
    print(f"{ranks} ranks in JupyterLab, seconds after run-all: {times}")
