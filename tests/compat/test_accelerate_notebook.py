"""Accelerate's notebook example computes the same with nblaunch's ``notebook_launcher``
imported in place of Accelerate's, keywords and all (``accelerate_notebook.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat

EXAMPLE = Path(__file__).resolve().parent / "accelerate_notebook.py"


def run_example(which: str, out_dir: Path) -> list[dict]:
    """Run the example in a fresh process, as a fresh notebook would; each rank's results."""
    out_dir.mkdir()
    env = dict(os.environ, ACCELERATE_USE_CPU="1")  # what nblaunch sets on CPU ranks
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), which, str(out_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_accelerates_notebook_example_trains_as_under_accelerates_launcher(tmp_path):
    pytest.importorskip("accelerate")
    theirs = run_example("accelerate", tmp_path / "accelerate")
    ours = run_example("nblaunch", tmp_path / "nblaunch")
    assert ours == theirs
    assert [r["mixed_precision"] for r in ours] == ["bf16", "bf16"]
    assert [r["distributed_type"] for r in ours] == ["DistributedType.MULTI_CPU"] * 2
    assert ours[0]["losses"] != ours[1]["losses"]  # each rank saw its own shard of the data
