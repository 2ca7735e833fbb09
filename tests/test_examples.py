"""Every Python example in README.md and docs/ runs as written, or says why it does not.

A page's ```python blocks run in order, as the cells of one notebook, in a real kernel (nbclient),
on 2 CPU ranks where they launch. The pages share one kernel, reset before each page (its names,
``%load_ext``, working directory and cell numbers) and restarted when a page left a pool or
processes behind: a kernel per page cost about 10 s a page in starts and imports. An HTML
comment right above a block changes that:

- ``<!-- not run: REASON -->``: the block is not run; the reason is required (needs a GPU,
  several hosts, a framework's data ...).
- ``<!-- raises: NAME -->``: the block must raise the exception ``NAME`` (a hang, a failing rank).
- ``<!-- new kernel -->``: this block and the ones after it run in a new kernel (the kernel is
  restarted: a detached run attached to after a restart).
- ``<!-- output -->`` above a non-Python block (```text): the output of the Python block before
  it; every line must be in what that block printed or displayed (the live view's "All ranks"
  log included). A line ``...`` stands for lines left out, ``.../`` for the start of a path, and
  a decimal number (a time) matches any decimal number.

Each page runs in a scratch directory of its own, with the repository and ``tests/`` on
``PYTHONPATH``. The quick start's blocks (README.md, docs/getting-started.md) are the cells of
notebooks/quickstart.ipynb, which tests/test_quickstart.py runs and checks: here they are
checked to be those cells, and not run a second and third time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT, load_run_notebook
from test_quickstart import TOTAL_SHOWN

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 120
KINDS = ("not run", "raises", "new kernel", "output")

_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*([a-z ]+?)\s*(?::\s*(.*?))?\s*-->$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

run_notebook = load_run_notebook()


@dataclass
class Example:
    """One ```python block of a page, with the markers above it."""

    page: Path
    line: int
    code: str
    not_run: str | None = None
    raises: str | None = None
    new_kernel: bool = False
    output: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{_shown(self.page)}:{self.line}"


def _shown(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def examples(page: Path) -> list[Example]:
    """The page's Python examples, in order, with their markers and expected output."""
    lines = page.read_text().splitlines()
    found: list[Example] = []
    markers: dict[str, str] = {}
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        marker = _MARKER.match(stripped)
        fence = _FENCE.match(stripped)
        if marker and marker.group(1) in KINDS:
            markers[marker.group(1)] = marker.group(2) or ""
        elif fence:
            close = fence.group(1)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == close), None)
            assert end is not None, f"{_shown(page)}:{i + 1}: a code block never closes"
            indent = len(lines[i]) - len(lines[i].lstrip())
            body = "\n".join(line[indent:] for line in lines[i + 1 : end])
            if fence.group(2) == "python":
                found.append(
                    Example(
                        page,
                        i + 1,
                        body,
                        not_run=markers.get("not run"),
                        raises=markers.get("raises"),
                        new_kernel="new kernel" in markers,
                    )
                )
                assert "output" not in markers, f"{found[-1].where}: output marks a text block"
            elif "output" in markers:
                assert found, f"{_shown(page)}:{i + 1}: output of no example"
                found[-1].output += [line.strip() for line in body.splitlines() if line.strip()]
            markers = {}
            i = end
        elif stripped:
            markers = {}  # a marker counts only right above its block
        i += 1
    return found


def _cell_text(cell: nbformat.NotebookNode, notebook: nbformat.NotebookNode) -> str:
    """What a cell printed and displayed, the live view's "All ranks" log included."""
    parts: list[str] = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("display_data", "execute_result"):
            data = output.get("data", {})
            view = data.get("application/vnd.jupyter.widget-view+json")
            if view:
                parts += run_notebook.all_ranks_log(notebook, view["model_id"])
            parts.append(data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append(_ANSI.sub("", "\n".join(output.traceback)))
    return "\n".join(parts)


def _shows(text: str, line: str) -> bool:
    """Whether ``text`` has ``line`` in it, with the page's abridgements."""
    if line in ("...", "…"):
        return True
    pattern = re.escape(line).replace(re.escape(".../"), r"\S*/")
    pattern = re.sub(r"\d+\\\.\d+", lambda _: r"\d+\.\d+", pattern)
    return re.search(pattern, text) is not None


def _errors(cell: nbformat.NotebookNode) -> list[str]:
    """The names of the exceptions a cell raised; IPython prints a magic's UsageError instead."""
    names = []
    for output in cell.get("outputs", []):
        if output.output_type == "error":
            names.append(output.ename)
        elif output.output_type == "stream" and output.text.startswith("UsageError:"):
            names.append("UsageError")
    return names


# What the last page set up (names, the magics, the working directory, cell numbers) is reset
# before a page, so that each page runs as if in a kernel of its own. Modules stay imported
# (torch, nblaunch) and the ranks' forkserver stays up: that is what sharing saves.
RESET_CODE = """
def _reset(workdir, env):
    import os
    os.chdir(workdir)
    os.environ.update(env)
    ip = get_ipython()
    if "nblaunch" in ip.extension_manager.loaded:
        ip.extension_manager.unload_extension("nblaunch")
    # reset drops __main__'s __spec__ and the like, which multiprocessing reads at each launch
    kept = {{k: v for k, v in ip.user_ns.items() if k.startswith("__") and k.endswith("__")}}
    ip.reset(new_session=True)  # what %reset -f clears, and the cell numbers start at 1
    ip.user_ns.update({{k: v for k, v in kept.items() if k not in ip.user_ns}})
    ip.execution_count = 1
_reset({workdir!r}, {env!r})
"""

# Whether the last page left something that a reset does not undo: a pool, or processes (ranks,
# a run's host) other than multiprocessing's helpers and the spare ranks. Then a new kernel.
LEFT_CODE = """
import psutil
from nblaunch.engine.pool import pool_engine
from nblaunch.engine.processes import spares, supervisor
from multiprocessing import forkserver, resource_tracker
for _, _, process in list(supervisor._leaving):
    process.join(5.0)  # ranks a finished run let go exit on their own
helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
helpers.update(spares.pids())
left = [p.pid for p in psutil.Process().children(recursive=True)
        if p.pid not in helpers and p.status() != psutil.STATUS_ZOMBIE]
if left or pool_engine.current_pool() is not None:
    raise RuntimeError(f"left behind: pool {pool_engine.current_pool()}, {left}")
"""


class PageKernel:
    """One kernel (nbclient's) that runs the pages one after another.

    Each page's notebook runs after ``RESET_CODE``; the kernel restarts (a new process) for a
    page's ``<!-- new kernel -->`` block, and when the last page left a pool or processes, or
    failed. A kernel per page cost a kernel start, importing torch and nblaunch, and a new
    forkserver importing torch for the ranks: about 10 s a page here.
    """

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        from nbclient import NotebookClient

        starter = NotebookClient(
            nbformat.v4.new_notebook(),
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": str(cwd)}},
        )
        starter.km = starter.create_kernel_manager()
        starter.start_new_kernel(env=env)
        starter.start_new_kernel_client()
        self.km, self.kc = starter.km, starter.kc
        self.clean = True  # nothing ran since the kernel started

    def restart(self) -> None:
        from jupyter_core.utils import run_sync

        run_sync(self.km.restart_kernel)()
        run_sync(self.kc.wait_for_ready)(timeout=60)
        self.clean = True

    def _client(self, notebook: nbformat.NotebookNode, workdir: Path):
        from nbclient import NotebookClient

        client = NotebookClient(
            notebook,
            km=self.km,
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            allow_errors=True,
            store_widget_state=True,
            resources={"metadata": {"path": str(workdir)}},
        )
        client.kc = self.kc
        return client

    def _quiet(self, client, code: str) -> dict:
        """Run ``code`` without a cell number or output; its reply's content."""
        reply = client.wait_for_reply(self.kc.execute(code, silent=True, store_history=False))
        return reply["content"]

    def _nothing_left(self, client) -> bool:
        """Whether the last page left nothing that a reset does not undo (a kernel that does not
        answer left too much)."""
        try:
            return self._quiet(client, LEFT_CODE)["status"] == "ok"
        except Exception:  # TimeoutError, a dead kernel
            return False

    def run(self, notebook: nbformat.NotebookNode, workdir: Path, env: dict[str, str]) -> None:
        """Run ``notebook``'s cells in order, as a page, in ``workdir`` with ``env`` set."""
        client = self._client(notebook, workdir)
        if not self.clean and not self._nothing_left(client):
            self.restart()
        reset = self._quiet(client, RESET_CODE.format(workdir=str(workdir), env=env))
        assert reset["status"] == "ok", reset
        self.clean = False
        try:
            client.execute()
        except BaseException:
            self.restart()  # a cell that timed out or a dead kernel: the next page gets a new one
            raise

    def close(self) -> None:
        from jupyter_core.utils import run_sync

        self.kc.stop_channels()
        run_sync(self.km.shutdown_kernel)(now=False)


@pytest.fixture(scope="module")
def page_kernel(tmp_path_factory):
    """One kernel for every page, with the repository and ``tests/`` on its ``PYTHONPATH``."""
    import os

    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    kernel = PageKernel(tmp_path_factory.mktemp("examples"), env)
    yield kernel
    kernel.close()


def _run(batch: list[Example], kernel: PageKernel, workdir: Path) -> None:
    """Run ``batch`` as the cells of one notebook in ``kernel`` and check each cell."""
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(example.code) for example in batch]
    )
    env = {
        "NBLAUNCH_RUN_DIR": str(workdir / "runs"),
        "NBLAUNCH_DETACHED_DIR": str(workdir / "detached"),
    }
    kernel.run(notebook, workdir, env)
    for example, cell in zip(batch, notebook.cells, strict=True):
        errors = _errors(cell)
        text = _cell_text(cell, notebook)
        if example.raises:
            assert errors == [example.raises], (
                f"{example.where}: should raise {example.raises}; it showed:\n{text}"
            )
        else:
            assert not errors, f"{example.where} raised:\n{text}"
        for line in example.output:
            assert _shows(text, line), f"{example.where}: shows {line!r}; the cell:\n{text}"


def _to_run(page: Path) -> list[Example]:
    """The page's examples that this file runs: not marked, and not a quick-start cell."""
    cells = set(_quickstart_cells())
    return [e for e in examples(page) if e.not_run is None and e.code.strip("\n") not in cells]


def _runnable_pages() -> list[Path]:
    return [page for page in PAGES if _to_run(page)]


def test_every_python_block_is_found_and_unrun_ones_say_why():
    for page in PAGES:
        text = page.read_text()
        found = examples(page)
        # The parser sees every block the page has (none hides inside another block).
        assert len(found) == len(re.findall(r"^\s*```python\s*$", text, re.M)), page
        for example in found:
            if example.not_run is not None:
                assert len(example.not_run.split()) >= 2, f"{example.where}: say why it is not run"
                assert example.raises is None and not example.output, example.where
    # The suite runs something, and leaves out no more than the quick start's cells.
    assert len(_runnable_pages()) >= 5
    for page in PAGES:
        left_out = [e for e in examples(page) if e.not_run is None and e not in _to_run(page)]
        assert len(left_out) <= len(_quickstart_cells()), page


def test_markers_are_read_as_written(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- not run: needs a GPU -->\n```python\ngpu()\n```\n\n"
        "<!-- raises: ValueError -->\n\n```python\nraise ValueError\n```\n"
        "<!-- output -->\n```text\n  hello  \n```\n"
        "a paragraph\n<!-- not run: stale -->\nbetween\n```python\nx = 1\n```\n"
        "<!-- new kernel -->\n- item\n\n  ```python\n  y = 2\n  ```\n"
    )
    found = examples(page)
    assert [(e.code, e.not_run, e.raises, e.output) for e in found] == [
        ("gpu()", "needs a GPU", None, []),
        ("raise ValueError", None, "ValueError", ["hello"]),
        ("x = 1", None, None, []),
        ("y = 2", None, None, []),
    ]
    assert not found[3].new_kernel  # the marker was not right above the block


def test_output_lines_match_with_the_pages_abridgements():
    text = 'at Cell In[1]:7 in train for 1.1 s.\n  File "/venv/torch/distributed/c10d.py", line 3'
    assert _shows(text, "in train for 1.0 s.")  # a time is any decimal number
    assert not _shows(text, "in train for 2 s.")
    assert _shows(text, 'File ".../torch/distributed/c10d.py", line 3')
    assert not _shows(text, 'File ".../torch/other.py", line 3')
    assert _shows(text, "...") and not _shows(text, "[[1]]")


def _quickstart_cells() -> list[str]:
    notebook = json.loads(QUICKSTART.read_text())
    return ["".join(c["source"]).strip("\n") for c in notebook["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_quick_start_is_the_quickstart_notebook(page):
    text = (ROOT / page).read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    shown = [e for e in examples(ROOT / page) if f"\n{e.code}\n" in section]
    assert [e.code.strip("\n") for e in shown] == _quickstart_cells()
    # The output the page shows is what tests/test_quickstart.py checks the notebook shows.
    assert [e.output for e in shown] == [[], [], [], [TOTAL_SHOWN]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", _runnable_pages(), ids=lambda page: str(page.relative_to(ROOT)).replace("/", "-")
)
def test_examples_run_as_written(page, page_kernel, tmp_path):
    batch: list[Example] = []
    for example in _to_run(page):
        if example.new_kernel and batch:
            _run(batch, page_kernel, tmp_path)
            page_kernel.restart()
            batch = []
        batch.append(example)
    _run(batch, page_kernel, tmp_path)


@pytest.mark.slow
def test_a_page_sees_nothing_of_the_page_before_in_the_shared_kernel(page_kernel, tmp_path):
    page = tmp_path / "page.md"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    left = (
        "import os\nx = 1\nos.chdir('/')\nos.environ['NBLAUNCH_RUN_DIR'] = '/'\n%load_ext nblaunch"
    )
    _run([Example(page, 1, left)], page_kernel, first)
    shows = "import os\nprint(os.getcwd(), os.environ['NBLAUNCH_RUN_DIR'])\nraise ValueError"
    _run(
        [
            Example(page, 2, "x", raises="NameError"),
            Example(page, 3, "os", raises="NameError"),
            Example(page, 4, "%%distributed -n 2\n1", raises="UsageError"),
            # its own folder and run directory, and cell numbers from 1 as in a new kernel
            Example(page, 5, shows, raises="ValueError", output=[f"{second} {second / 'runs'}"]),
        ],
        page_kernel,
        second,
    )
    cell = nbformat.v4.new_code_cell("raise ValueError")  # the reset's own cell is not counted
    page_kernel.run(nbformat.v4.new_notebook(cells=[cell]), second, {})
    assert "Cell In[1], line 1" in _cell_text(cell, nbformat.v4.new_notebook()), cell
