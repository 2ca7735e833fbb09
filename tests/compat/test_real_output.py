"""What real training prints, as the text view shows it at 8 ranks (issue 44, 2-4; issue 40, 6).

One launch of a Transformers ``Trainer`` on 8 CPU ranks, every rank printing its logs through a
callback (``workloads.transformers_trainer(prints=True)``), checks several things at once: a line
all ranks printed alike shows once and never split in groups; torch's C++ warning, whose
timestamp differs on each rank, folds; a number that only equals the rank's is not folded as a
range; the bar's first state is printed once.
"""

from __future__ import annotations

import re

import pytest
import workloads

from nblaunch import notebook_launcher

pytestmark = [pytest.mark.compat, pytest.mark.slow]

STEPS = 4


def test_eight_trainer_ranks_print_each_line_once_and_right(tmp_path, capsys):
    pytest.importorskip("transformers")
    notebook_launcher(
        workloads.transformers_trainer,
        kwargs={"output_dir": str(tmp_path / "trainer"), "steps": STEPS, "prints": True},
        num_processes=8,
        device_type="cpu",
        display="text",
        timeout=300,
        run_dir=tmp_path / "run",
    )
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines()
    shown = "\n".join(lines)
    every = "[rank 0-7] "
    # The callback's logs (floats; Trainer's own line, rank 0's only, shows strings): one line
    # per step, every rank's copy in it.
    logs = [line for line in lines if re.search(r"\{'loss': \d", line)]
    assert len(logs) == STEPS, shown
    assert all(line.startswith(every) for line in logs), logs
    summary = [line for line in lines if re.search(r"\{'train_runtime': \d", line)]
    assert len(summary) == 1 and summary[0].startswith(every), shown
    # torch's C++ warning: "[rank3]:[W1204 18:18:04.929622867 reducer.cpp:1529] Warning: ...".
    (warning,) = [line for line in lines if "reducer.cpp" in line]
    assert warning.startswith(every) and "[rank0 … 7]:[W" in warning, warning
    # The rank's number where the line names a rank folds; a shard's number that equals it,
    # no: each rank's line as it printed it.
    assert [line for line in lines if "hello from rank" in line] == [
        f"{every}hello from rank 0 … 7"
    ]
    shards = sorted(line for line in lines if " on shard " in line)
    assert shards == [f"[rank {r}] on shard {r}" for r in range(8)]
    # Rank 0's bar: its first state once, though DDP's warning came right after it.
    assert sum(f"| 0/{STEPS} [" in line for line in lines) == 1, "\n".join(lines)
