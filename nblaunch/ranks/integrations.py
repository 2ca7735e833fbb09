"""One line of user code to chart a framework's metrics in the notebook
(:mod:`nblaunch.ranks.metrics`).

- Transformers: ``Trainer(..., callbacks=[TrainerMetrics()])``: what the Trainer logs (loss,
  learning rate, grad norm, eval metrics) goes to :func:`nblaunch.log_metrics` at its global step.
- Lightning: ``Trainer(..., logger=LightningMetrics())``: what ``self.log`` records, likewise.
- Accelerate: ``Accelerator(log_with=[AccelerateMetrics()])``: what ``accelerator.log`` records
  (Accelerate calls it on the main process only, so rank 0's values).

Each rank sends its own values (these hooks run on every rank), so a straggler or a diverging
rank shows as its own line. The classes are made on first use, so importing this module needs
neither framework.
"""

from __future__ import annotations

from typing import Any

from nblaunch.ranks.metrics import log_metrics

_CLASSES = ("AccelerateMetrics", "LightningMetrics", "TrainerMetrics")
_made: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _made:
        makers = {
            "AccelerateMetrics": _accelerate_metrics,
            "LightningMetrics": _lightning_metrics,
            "TrainerMetrics": _trainer_metrics,
        }
        _made[name] = makers[name]()
    return _made[name]


def _trainer_metrics() -> type:
    from transformers import TrainerCallback

    class TrainerMetrics(TrainerCallback):
        """A Transformers callback: every ``Trainer.log`` call becomes ``log_metrics``."""

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any):
            if logs:
                log_metrics(logs, step=state.global_step)  # numbers only; the rest is dropped

    return TrainerMetrics


def _lightning_metrics() -> type:
    from lightning.pytorch.loggers import Logger

    class LightningMetrics(Logger):
        """A Lightning logger that sends every rank's logged metrics to the notebook."""

        @property
        def name(self) -> str:
            return "nblaunch"

        @property
        def version(self) -> str:
            return "0"

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            log_metrics(metrics, step=step)

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass  # hyperparameters are not a curve

    return LightningMetrics


def _accelerate_metrics() -> type:
    from accelerate.tracking import GeneralTracker

    class AccelerateMetrics(GeneralTracker):
        """An Accelerate tracker: ``accelerator.log(values, step=...)`` becomes ``log_metrics``."""

        name = "nblaunch"
        requires_logging_directory = False
        main_process_only = False

        @property
        def tracker(self) -> None:
            return None

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            pass  # hyperparameters are not a curve

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            log_metrics(values, step=step)

    return AccelerateMetrics
