"""What a run handle (``block=False``, ``detach=True``, ``attach()``) gives back reads as a
blocking launch's: the rank's traceback, the runs listed once, the view's lines in order."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

import nblaunch
from nblaunch.notebook.handle import _kernel_runs as kernel_runs
from nblaunch.notebook.views import RecordingView, RunModel, summary


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Path:
    """A registry of detached runs of this test's own (kernels started after it inherit it)."""
    path = tmp_path / "detached"
    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(path))
    return path


# Rank 1 raises a ValueError chained to a KeyError; the def is cell 2 of the kernel.
FAILING_CELL = """\
def bad(x):
    import torch.distributed as dist
    try:
        {}[x]
    except KeyError as missing:
        if dist.get_rank() == 1:
            raise ValueError(f"no value for {x}") from missing
    return x
"""


def _rank_part(traceback: list[str]) -> list[str]:
    """The traceback's parts without the calling cell's frame (the only frame not in cell 2)."""
    return [part for part in traceback if not re.match(r"Cell In\[(?!2\])\d+\]", part)]


def test_in_a_kernel_result_of_a_background_or_detached_run_raises_as_a_blocking_launch(
    registry, kernel
):
    kernel.run("import nblaunch")
    kernel.run(FAILING_CELL)
    blocking = kernel.run("nblaunch.notebook_launcher(bad, (1,), 2, display='none')", timeout=120)
    assert blocking["error"] == "ValueError", blocking
    expected = _rank_part(blocking["traceback"])
    text = "\n".join(expected)
    assert "Cell In[2], line 7, in bad()" in text and "Cell In[2], line 4, in bad()" in text
    assert "The above exception was the direct cause" in text
    assert "nblaunch" not in text.replace("[... skipping hidden", "")

    cells = [
        "h = nblaunch.notebook_launcher(bad, (1,), 2, display='none', block=False)\nh.result()",
        "h.result()",  # again, from another cell
        "h.result()",
        "d = nblaunch.notebook_launcher(bad, (1,), 2, display='none', detach=True)\nd.result()",
        "d.result()",
        "nblaunch.attach(d.id).result()",  # the outcome the host left on disk
    ]
    for code in cells:
        got = kernel.run(code, timeout=120)
        assert got["error"] == "ValueError", (code, got)
        # One frame of the calling cell (none of an earlier cell's), then the rank's, as above.
        callers = [p for p in got["traceback"] if re.match(r"Cell In\[(?!2\])\d+\]", p)]
        assert len(callers) == 1 and code.splitlines()[-1] in callers[0], (code, callers)
        assert _rank_part(got["traceback"]) == expected, code


POOL_CELL = """%%distributed
def bad(x):
    raise ValueError(f"bad {x}")
if rank == 1:
    bad(rank)
"""


@pytest.mark.slow
def test_in_a_kernel_a_detached_pools_cell_raises_as_a_pool_of_the_kernels_own(registry, kernel):
    kernel.run("%load_ext nblaunch")
    shown = []
    for start in ("%dist start -n 2", "%dist start -n 2 --detach"):
        assert "ready" in kernel.run(start, timeout=120)["out"]
        failed = kernel.run(POOL_CELL, timeout=120)
        kernel.run("%dist stop", timeout=60)
        assert failed["error"] == "ValueError", failed
        shown.append([re.sub(r"Cell In\[\d+\]", "Cell In[N]", p) for p in failed["traceback"]])
    assert "Cell In[N], line 3, in bad()" in "\n".join(shown[0])
    assert shown[1] == shown[0]


# --- the smaller cases of issue 40 (item 8) -----------------------------------------------------


def _steps(count: int) -> int:
    import torch.distributed as dist

    for i in range(count):
        print(f"step {i} of rank {dist.get_rank()}")
    return dist.get_rank()


def test_attaching_the_same_ended_run_twice_lists_it_once(registry):
    handle = nblaunch.notebook_launcher(_steps, (1,), 2, detach=True, display="none")
    assert handle.result(timeout=60) == [0, 1]
    assert nblaunch.attach(handle.id) is handle and nblaunch.attach(handle.id) is handle
    assert [h.id for h in nblaunch.runs()].count(handle.id) == 1
    # A run this kernel did not start (as after a restart): one handle, however often attached.
    kernel_runs.remove(handle)
    first, second = nblaunch.attach(handle.id), nblaunch.attach(handle.id)
    assert first is second and first.result() == [0, 1]
    assert [h.id for h in nblaunch.runs()].count(handle.id) == 1


def test_nblaunch_runs_says_what_is_wrong_with_the_registry_in_one_line(registry):
    command = [sys.executable, "-m", "nblaunch", "runs"]
    registry.mkdir(mode=0o755)
    registry.chmod(0o755)  # others may read it: not a registry nblaunch may use
    for args in ([], ["stop", "x"]):
        said = subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)
        assert said.returncode == 1, said
        assert said.stdout == "" and len(said.stderr.splitlines()) == 1, said.stderr
        assert said.stderr.startswith("nblaunch runs") and "NBLAUNCH_DETACHED_DIR" in said.stderr


@pytest.mark.slow
def test_nblaunch_runs_says_which_entries_are_pools(registry):
    command = [sys.executable, "-m", "nblaunch", "runs"]
    run = nblaunch.notebook_launcher(_steps, (1,), 2, detach=True, display="none")
    run.result(timeout=60)
    pool = nblaunch.start_pool(2, detach=True, display="none", idle_limit=60)
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=60)
        rows = {line.split()[0]: line.split()[1:3] for line in listed.stdout.splitlines()[1:]}
        assert listed.stdout.split()[:3] == ["id", "kind", "state"], listed.stdout
        assert rows[pool.entry.run_id] == ["pool", "running"], listed.stdout
        assert rows[run.id] == ["run", "done"], listed.stdout
    finally:
        pool.close()


SCRIPT = """
import sys
import nblaunch
from test_handles import _steps

if __name__ == "__main__":
    how = {"detach": True} if sys.argv[1] == "detach" else {"block": False}
    handle = nblaunch.notebook_launcher(_steps, (2000,), 2, display="text", **how)
    print("RESULT", handle.result(timeout=120), flush=True)
"""


@pytest.mark.parametrize("how", ["detach", "block=False"])
def test_in_a_script_the_view_shows_one_header_and_its_end_before_result_returns(
    registry, tmp_path, how
):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    ran = subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=180, env=env
    )
    assert ran.returncode == 0, ran.stderr
    out = ran.stdout
    assert out.count("rank(s) on CPU") == 1, out[:2000]  # the header, once
    assert out.rstrip().endswith("RESULT [0, 1]"), out[-2000:]
    assert "nblaunch: finished in" in out and "step 1999 of rank 1" in out
    assert out.index("step 1999 of rank 1") < out.index("nblaunch: finished in")


def test_a_pool_cells_ranks_read_alike_in_the_summary(registry):
    def cell_like() -> object:
        import torch.distributed as dist

        from nblaunch.ranks.cell import CellResult

        # What a pool cell's ranks return: the cell's result on the main rank, None elsewhere.
        return CellResult() if dist.get_rank() == 0 else None

    handle = nblaunch.notebook_launcher(cell_like, (), 2, block=False, display="none")
    handle.result(timeout=60)
    seen, model = RecordingView(), RunModel(200)
    handle.watch(seen)  # what a late view is given: the run's history
    for event in seen.events:
        model.handle(event)
    text = summary.summary_bundle(model)["text/plain"]
    assert "  rank 0: DONE · returned\n  rank 1: DONE · returned\n" in text, text
