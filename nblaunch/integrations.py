"""``from nblaunch.integrations import TrainerMetrics``: the public path of the framework callbacks.

They run inside the ranks, so they live in :mod:`nblaunch.ranks.integrations`; this module keeps
the documented import working.
"""

from nblaunch.ranks.integrations import AccelerateMetrics, LightningMetrics, TrainerMetrics

__all__ = ["AccelerateMetrics", "LightningMetrics", "TrainerMetrics"]
