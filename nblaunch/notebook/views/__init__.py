"""Views of a run: the live widget, text, and the static summary a saved notebook keeps.

A view is an :class:`~nblaunch.events.EventSink`: the relay hands it every event on the thread
that launched the run, it keeps what it needs and renders in ``flush`` (called many times a
second) and ``close``. Views never infer the state of a rank; they show the ``StateChange`` and
``Diagnosis`` events the launcher sends.

- ``model``: events into a run's state (:class:`RunModel`); no widgets, no IPython.
- ``ansi``, ``render``, ``summary``: the model as HTML and text, as pure functions.
- ``widget``: :class:`LaunchView`, the ipywidgets view, its throttling and its Stop button.
- ``text``: :class:`TextView`; ``recording``: :class:`RecordingView`.
- ``choose``: :func:`choose_view`, which view a front end shows, and :class:`DeferredView`.
"""

from nblaunch.notebook.views.choose import (
    LIVE_VIEW_AFTER_S,
    DeferredView,
    choose_view,
    in_notebook_kernel,
    make_view,
    widgets_available,
)
from nblaunch.notebook.views.model import RunModel
from nblaunch.notebook.views.recording import RecordingView
from nblaunch.notebook.views.summary import summary_bundle
from nblaunch.notebook.views.text import TextView
from nblaunch.notebook.views.widget import LaunchView

__all__ = [
    "LIVE_VIEW_AFTER_S",
    "DeferredView",
    "LaunchView",
    "RecordingView",
    "RunModel",
    "TextView",
    "choose_view",
    "in_notebook_kernel",
    "make_view",
    "summary_bundle",
    "widgets_available",
]
