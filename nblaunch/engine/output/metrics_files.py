"""Metrics on disk: every rank's ``metrics`` events in ``<run dir>/metrics.jsonl``, read back by
:func:`load_metrics`, and TensorBoard files at the end of a run when TensorBoard is installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def metric_lines(event: Mapping[str, Any]) -> str:
    """The ``metrics.jsonl`` lines of one ``metrics`` event: one per metric name."""
    return "".join(
        json.dumps(
            {
                "rank": event["rank"],
                "step": event["step"],
                "time": event["time"],
                "name": name,
                "value": value if math.isfinite(value) else str(value),
            }
        )
        + "\n"
        for name, value in event["values"].items()
    )


def write_tensorboard_files(run_dir: Path) -> None:
    """TensorBoard event files of a finished run's ``metrics.jsonl``, one TensorBoard run per
    rank (``<run dir>/tensorboard/rank<N>``), when TensorBoard is installed; else nothing.

    Written with TensorBoard's own writer, not torch's ``SummaryWriter``: this runs in the
    notebook's process, which never imports torch (importing it cost the kernel ~187 MB).
    """
    if importlib.util.find_spec("tensorboard") is None:  # tensorboard is optional
        return
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writers: dict[int, Any] = {}
    try:
        for row in load_metrics(run_dir, table=False):
            writer = writers.get(row["rank"])
            if writer is None:
                log_dir = run_dir / "tensorboard" / f"rank{row['rank']}"
                writer = writers[row["rank"]] = EventFileWriter(str(log_dir))
            value = Summary.Value(tag=row["name"], simple_value=row["value"])
            event = Event(wall_time=row["time"], step=row["step"], summary=Summary(value=[value]))
            writer.add_event(event)
    finally:
        for writer in writers.values():
            writer.close()


def load_metrics(run_dir: str | Path, table: bool = True) -> Any:
    """A run's metrics as a table: a pandas ``DataFrame`` when pandas is installed (and
    ``table``), else a list of dicts, with columns ``rank``, ``step``, ``time``, ``name`` and
    ``value``.

    Raises
    ------
    FileNotFoundError
        The run directory has no ``metrics.jsonl`` (no rank called :func:`log_metrics`).
    """
    path = Path(run_dir) / METRICS_FILE
    rows = []
    with path.open() as file:
        for line in file:
            if line.strip():
                row = json.loads(line)
                row["value"] = float(row["value"])  # "nan" and "inf" were written as text
                rows.append(row)
    if not table:
        return rows
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows, columns=["rank", "step", "time", "name", "value"])
