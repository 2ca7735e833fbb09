"""Training metrics from every rank: :func:`log_metrics`, one event to the notebook.

:func:`log_metrics` sends ``{name: value}`` with the step, the rank and the time to the notebook
as one ``metrics`` event (one pipe write, no collective, no waiting on peers). The notebook keeps
every such event in ``<run dir>/metrics.jsonl`` (:mod:`nblaunch.engine.output.metrics_files`, which
also reads it back with ``load_metrics``) and charts them (:mod:`nblaunch.notebook.charts`).
"""

from __future__ import annotations

import numbers
import time
import warnings
from collections.abc import Mapping
from typing import Any

from nblaunch.ranks import this_rank

# Added by log_metrics on CUDA ranks: peak allocated device memory, GiB.
CUDA_PEAK = "cuda peak GiB"  # "<device type> peak GiB" on other accelerators that count

_steps: dict[int, int] = {}  # rank -> next automatic step, inside a rank
_too_large: set[str] = set()  # metric names already said to be too large for a float


def log_metrics(values: Mapping[str, float], step: int | None = None) -> None:
    """Send numeric metrics of this rank to the notebook's charts and ``metrics.jsonl``.

    Outside an nblaunch rank (a plain script, under torchrun) it does nothing.

    Parameters
    ----------
    values
        Metric names and numbers, e.g. ``{"loss": 0.31, "lr": 1e-4}``. Values that are not
        numbers (or tensors of one element) are left out.
    step
        The training step; by default this rank's calls are counted 0, 1, 2, ...

    Raises
    ------
    TypeError
        ``values`` is not a mapping of names to numbers, or ``step`` is not a whole number.
    """
    if not isinstance(values, Mapping):
        raise TypeError(
            f"log_metrics(values): values must be a dict of names to numbers, e.g. "
            f"{{'loss': 0.31}}, got a {type(values).__name__}: {values!r:.60}"
        )
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise TypeError(
            f"log_metrics(step=...): step must be a whole number (the training step), got a "
            f"{type(step).__name__}: {step!r:.60}"
        )
    context = this_rank.current()
    if context is None:
        return
    found = {}
    for name, value in values.items():
        number = _number(str(name), value)
        if number is not None:
            found[str(name)] = number
    if not found:
        return
    if context.device.type not in ("cpu", "xla"):  # a leaking or heavier rank shows at a glance
        from nblaunch.ranks.device import devices

        peak = devices.peak_memory_bytes(context.device)
        if peak is not None:
            found[f"{context.device.type} peak GiB"] = peak / 2**30
    if step is None:
        step = _steps.get(context.rank, 0)
    _steps[context.rank] = int(step) + 1
    this_rank.emit(
        {
            "kind": "metrics",
            "rank": context.rank,
            "step": int(step),
            "values": found,
            "time": time.time(),
        }
    )


def _number(name: str, value: Any) -> float | None:
    """``value`` as a float, or None to leave it out (not a number; too large for a float,
    which is said once per name)."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        if name not in _too_large:
            _too_large.add(name)
            warnings.warn(
                f"log_metrics: {name} = {str(value)[:20]}... does not fit a float; it is left "
                "out of the charts and metrics.jsonl (said once per name)",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
