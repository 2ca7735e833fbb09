"""Training metrics from every rank: :func:`log_metrics`, one event to the notebook.

:func:`log_metrics` sends ``{name: value}`` with the step, the rank and the time to the notebook
as one ``metrics`` event (one pipe write, no collective, no waiting on peers). The notebook keeps
every such event in ``<run dir>/metrics.jsonl`` (:mod:`nblaunch.engine.metrics_files`, which also
reads it back with ``load_metrics``) and charts them (:mod:`nblaunch.notebook.charts`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from nblaunch.ranks import worker

# Added by log_metrics on CUDA ranks: peak allocated device memory, GiB.
CUDA_PEAK = "cuda peak GiB"

_steps: dict[int, int] = {}  # rank -> next automatic step, inside a rank


def log_metrics(values: Mapping[str, float], step: int | None = None) -> None:
    """Send numeric metrics of this rank to the notebook's charts and ``metrics.jsonl``.

    Parameters
    ----------
    values
        Metric names and numbers, e.g. ``{"loss": 0.31, "lr": 1e-4}``. Values that are not
        numbers (or tensors of one element) are left out.
    step
        The training step; by default this rank's calls are counted 0, 1, 2, ...

    Outside an nblaunch rank (a plain script, under torchrun) it does nothing.
    """
    context = worker.current()
    if context is None:
        return
    numbers = {}
    for name, value in values.items():
        number = _number(value)
        if number is not None:
            numbers[str(name)] = number
    if not numbers:
        return
    if context.device.type == "cuda":  # a leaking or heavier rank shows at a glance
        import torch

        numbers[CUDA_PEAK] = torch.cuda.max_memory_allocated(context.device) / 2**30
    if step is None:
        step = _steps.get(context.rank, 0)
    _steps[context.rank] = int(step) + 1
    worker.emit(
        {
            "kind": "metrics",
            "rank": context.rank,
            "step": int(step),
            "values": numbers,
            "time": time.time(),
        }
    )


def _number(value: Any) -> float | None:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
