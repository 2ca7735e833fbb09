"""What a run handle (``block=False``, ``detach=True``, ``attach()``) gives back reads as a
blocking launch's: the rank's traceback, the runs listed once, the view's lines in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


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
