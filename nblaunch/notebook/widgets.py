"""The views' old import path, kept for the front ends that still import from it.

``notebook.pool`` and ``cluster.multinode`` import ``make_view`` and ``DeferredView`` from here;
once they call :func:`nblaunch.notebook.views.choose_view`, this module goes. New code imports
from :mod:`nblaunch.notebook.views`.
"""

from nblaunch.notebook.views.choose import DeferredView, make_view
from nblaunch.notebook.views.widget import LaunchView

__all__ = ["DeferredView", "LaunchView", "make_view"]
