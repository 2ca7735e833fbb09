"""Shared test set-up.

All launches in one pytest process share one forkserver (multiprocessing keeps a single one per
process), so only the first launch of the session pays for starting it and importing torch.
Each test runs in a temporary working directory, so run directories land there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@pytest.fixture(autouse=True)
def _run_dirs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path / "runs"))


@pytest.fixture(autouse=True, scope="session")
def _no_spares_in_the_test_process():
    """No spare ranks after this process's own launches. nblaunch forks them where IPython runs
    and ``__main__`` has no source: a notebook's kernel, and also a pytest-xdist worker once a
    test made IPython's test shell (plain pytest's ``__main__`` has one). There they would outlive
    tests that check no rank is left, and reap a forkserver a test killed to see it replaced.
    The spares' tests run real kernels."""
    from nblaunch.engine.processes import spares

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spares, "wanted", lambda start_method: False)
        yield


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def pytest_configure(config: pytest.Config) -> None:
    # A shell without job control starts its background jobs with SIGINT ignored (POSIX), and
    # Python then leaves it ignored: every interrupt a test sends would be a no-op (a matrix
    # run started that way failed the launcher's interrupt test after its 60 s). A notebook's
    # kernel always takes SIGINT; so do the tests.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# The files that take one worker longest, a minute or more each (`--durations=0` of `make test`
# on this project's 2 cores, 2026-12-07: test_ray.py 181 s down to test_real_training.py 62 s),
# handed out first so that the short files even out the end: pytest-xdist's loadfile gives a
# worker the next file in collection order once it is almost done (`make test` turns off its
# reordering by number of tests, which sends these few-test files last).
LONGEST_FILES = (
    "test_ray.py",
    "test_multinode_network.py",
    "test_browser.py",
    "test_examples.py",
    "test_slurm.py",
    "test_soak.py",
    "test_detached_faults.py",
    "test_launcher.py",
    "test_compat.py",
    "test_lab_browser_daily.py",
    "test_detached.py",
    "test_multinode.py",
    "test_real_training.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: k for k, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest as is


def skip_unless_accelerates_test_ops_runs_on_cpu() -> None:
    """Skip where Accelerate's own ``test_ops`` cannot run distributed on CPU ranks: before 1.16
    it makes ``PartialState()`` without ``cpu=``, which on a machine without GPUs is
    ``DistributedType.NO`` under any launcher (``accelerate launch --cpu`` too, checked with
    1.15.0, the newest for Python 3.10)."""
    accelerate = pytest.importorskip("accelerate")
    from packaging.version import Version

    if Version(accelerate.__version__) < Version("1.16"):
        pytest.skip(f"Accelerate {accelerate.__version__}'s test_ops runs undistributed on CPU")


def helper_pids() -> set[int]:
    """PIDs of multiprocessing's long-lived helpers here: forkserver, resource tracker."""
    from multiprocessing import forkserver, resource_tracker

    pids = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
    return {pid for pid in pids if pid}


def rank_children() -> list[psutil.Process]:
    """Live descendants of this test process other than multiprocessing's helpers: the ranks.

    Ranks that a finished run let go (``Supervisor.let_go``: they said their last and exit on
    their own) get up to 5 s to exit first, as the next launch would give them; one still
    there after that is listed.
    """
    from nblaunch.engine.processes import supervisor

    for _, _, process in list(supervisor._leaving):
        process.join(5.0)
    helpers = helper_pids()
    ranks = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.pid not in helpers and child.status() != psutil.STATUS_ZOMBIE:
                ranks.append(child)
        except psutil.NoSuchProcess:
            pass
    return ranks


def assert_no_ranks_left(timeout: float) -> None:
    """Wait up to ``timeout`` s for :func:`rank_children` to be empty; else fail naming each
    process left (pid, parent, age, command line), so a failure says what stayed."""
    if wait_until(lambda: not rank_children(), timeout):
        return
    left = []
    for process in rank_children():
        with contextlib.suppress(psutil.Error):
            age = time.time() - process.create_time()
            command = " ".join(process.cmdline())[:300]
            left.append(f"pid {process.pid} (parent {process.ppid()}, {age:.1f} s old): {command}")
    raise AssertionError(f"left {timeout} s after the ranks were stopped:\n" + "\n".join(left))


# Run in a kernel: the pids of its live descendants other than multiprocessing's helpers and
# the spare ranks waiting for the next launch (nblaunch.engine.processes.spares): ranks left behind.
RANKS_LEFT_CODE = """
import psutil
import nblaunch.engine.processes.spares
from multiprocessing import forkserver, resource_tracker
helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
helpers.update(nblaunch.engine.processes.spares.pids())
print(sorted(p.pid for p in psutil.Process().children(recursive=True)
             if p.pid not in helpers and p.status() != psutil.STATUS_ZOMBIE))
"""


class Kernel:
    """A real IPython kernel (jupyter_client, as nbclient drives it) to run cells in.

    jupyter_client directly, rather than nbclient, because the tests press the interrupt
    button (``interrupt_kernel``) and kill kernels.
    """

    def __init__(self, cwd) -> None:
        from jupyter_client.manager import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd), env={**os.environ})
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def run(
        self,
        code: str,
        timeout: float = 60,
        interrupt_after: float | None = None,
        answers: list[str] | None = None,
        answer_after: float | None = 0.0,
    ) -> dict:
        """Run one cell; return its printed text, result, error name and message, and seconds.

        With ``answers``, the cell may ask for input (``input()``, a rank's debugger): each
        prompt is recorded in ``"prompts"`` and gets the next answer ``answer_after`` seconds
        later ("c" once they run out), as a person typing into the notebook would; with
        ``answer_after=None`` nobody answers (a person who walked away, or presses interrupt),
        and ``interrupt_after`` counts from the first prompt: the button is pressed at it.
        ``"interrupted_at"``: the seconds into the cell at which the interrupt was sent.
        """
        msg_id = self.client.execute(code, allow_stdin=answers is not None)
        pending = list(answers or [])
        cell = {
            "out": "",
            "result": None,
            "error": None,
            "message": "",
            "traceback": [],
            "seconds": 0.0,
            "prompts": [],
            "interrupted_at": None,
        }
        began = time.monotonic()
        # When the interrupt's clock starts: at a prompt, when the cell waits at one
        clock: float | None = None if answers is not None and answer_after is None else began
        while time.monotonic() - began < timeout:
            due = interrupt_after and cell["interrupted_at"] is None and clock is not None
            if due and time.monotonic() - clock > interrupt_after:
                self.manager.interrupt_kernel()  # the notebook's interrupt button
                cell["interrupted_at"] = time.monotonic() - began
            if answers is not None:
                with contextlib.suppress(queue.Empty):
                    request = self.client.get_stdin_msg(timeout=0.01)
                    cell["prompts"].append(request["content"]["prompt"])
                    if clock is None:
                        clock = time.monotonic()
                    if answer_after is not None:
                        time.sleep(answer_after)
                        self.client.input(pending.pop(0) if pending else "c")
            try:
                msg = self.client.get_iopub_msg(timeout=0.05)
            except Exception:  # queue.Empty
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                cell["out"] += content["text"]
            elif kind == "execute_result":
                cell["result"] = content["data"].get("text/plain")
            elif kind == "error":
                cell["error"], cell["message"] = content["ename"], content["evalue"]
                cell["traceback"] = [_plain(line) for line in content["traceback"]]
            elif kind == "status" and content["execution_state"] == "idle":
                cell["seconds"] = time.monotonic() - began
                return cell
        raise TimeoutError(f"cell did not finish within {timeout} s: {code!r}")

    def pid(self) -> int:
        return int(self.run("import os\nprint(os.getpid())")["out"])

    def close(self) -> None:
        self.client.stop_channels()
        if self.manager.has_kernel:
            self.manager.shutdown_kernel(now=True)


@pytest.fixture
def kernel(tmp_path):
    kernel = Kernel(tmp_path)
    yield kernel
    kernel.close()


def kernel_pool_pids(kernel: Kernel) -> list[int]:
    """The pids of the pool running in ``kernel``."""
    cell = kernel.run(
        "import nblaunch.notebook.pool\nprint(nblaunch.notebook.pool.current_pool().pids)"
    )
    return [int(p) for p in cell["out"].strip()[1:-1].split(",")]


def _plain(text: str) -> str:
    """``text`` without ANSI colour codes."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def load_run_notebook():
    """``scripts/run_notebook.py`` (what ``make demo`` runs) as a module."""
    spec = importlib.util.spec_from_file_location("run_notebook", ROOT / "scripts/run_notebook.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_notebook"] = module
    spec.loader.exec_module(module)
    return module


# One notebook, saved without widget state (as GitHub, nbviewer or a colleague's Lab shows it),
# run in one kernel for two tests: test_launcher reads each rank's last lines in the first two
# cells, test_metrics the charts in the last.
WIDGETLESS_CELLS = {
    "trained": "from nblaunch import notebook_launcher\n"
    "\n"
    "def train(steps):\n"
    "    from tqdm import tqdm\n"
    "    import nblaunch\n"
    "    rank = nblaunch.rank()\n"
    "    bar = tqdm(total=steps)  # as the Trainer's progress callback does\n"
    "    for step in range(steps):\n"
    "        bar.update()\n"
    "        bar.write(str({'loss': round(1 / (step + 1 + rank), 4), 'epoch': step}))\n"
    "    bar.close()\n"
    "    print(f'rank {rank} done')\n"
    "    return rank * 10\n"
    "\n"
    "notebook_launcher(train, (30,), 2)\n",
    "failed": "def fail():\n"
    "    import nblaunch\n"
    "    import torch.distributed as dist\n"
    "    print(f'rank {nblaunch.rank()} about to fail')\n"
    "    dist.barrier()  # both lines printed before rank 1 fails and rank 0 is stopped\n"
    "    if nblaunch.rank() == 1:\n"
    "        raise ValueError('boom on rank 1')\n"
    "\n"
    "notebook_launcher(fail, (), 2)\n",
    "charted": "import nblaunch\n"
    "def chart():\n"
    "    import time\n"
    "    for step in range(20):\n"
    "        nblaunch.log_metrics({'loss': 1 / (step + 1)})\n"
    "        time.sleep(0.02)\n"
    "nblaunch.notebook_launcher(chart, num_processes=2, device_type='cpu')",
}


@pytest.fixture(scope="session")
def widgetless_notebook(tmp_path_factory):
    """``WIDGETLESS_CELLS`` run by nbclient without widget state, saved and read back: the
    notebook and its cells by name."""
    import nbformat
    from nbclient import NotebookClient

    directory = tmp_path_factory.mktemp("widgetless")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in WIDGETLESS_CELLS.values()]
    NotebookClient(
        notebook,
        timeout=180,
        kernel_name="python3",
        allow_errors=True,  # the "failed" cell fails; the others are checked to have not
        resources={"metadata": {"path": str(directory)}},
        store_widget_state=False,
    ).execute()
    path = directory / "widgetless.ipynb"
    nbformat.write(notebook, path)
    saved = nbformat.read(path, as_version=4)
    return saved, dict(zip(WIDGETLESS_CELLS, saved.cells, strict=True))
