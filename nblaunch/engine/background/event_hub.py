"""What a run's view needs to be drawn again, and the hub that hands its events to every view.

A background or detached run outlives the cell that started it, so its view must be possible
again later: in another cell, after a page reload, in a new kernel. :class:`RunHistory` keeps
what a view shows (the run's header, each rank's state, device and last heartbeat, the last lines
of every rank, diagnoses, progress notes, metric points) within fixed bounds however long the
run, and :class:`EventHub` passes each event to every view that watches while keeping that
history, so a view that joins late is first given the history, then the live events.
"""

from __future__ import annotations

import collections
import contextvars
import itertools
import threading
from typing import Any

from nblaunch.events import Event, EventSink
from nblaunch.options import view_lines_from_env

# Metric points kept for a late view's charts; older ones are thinned to every other one.
MAX_METRIC_EVENTS = 10_000
# Diagnoses and other rare events kept (each is shown whole in a view).
MAX_RARE_EVENTS = 200
# Results up to this size (pickled) are kept: a view shows small return values.
MAX_RESULT_BYTES = 4096

# Of these kinds only the latest event counts, per rank (a state, a device, a heartbeat).
_LATEST_PER_RANK = ("state", "started", "heartbeat", "result", "finished")
# Of these only the latest event of the run (its header, how it ended).
_LATEST = ("run_info", "run_ended")


class RunHistory:
    """A run's events, kept within fixed bounds, in the order they came.

    Parameters
    ----------
    max_lines
        Output lines kept per rank (default: the view's, ``NBLAUNCH_VIEW_LINES``); every line is
        in the run directory's rank logs anyway.
    """

    def __init__(self, max_lines: int | None = None) -> None:
        self.max_lines = view_lines_from_env() if max_lines is None else max_lines
        self._order = itertools.count()
        self._lines: dict[int, collections.deque[tuple[int, Event]]] = {}
        self._metrics: list[tuple[int, Event]] = []
        self._metrics_seen = 0
        self._metric_stride = 1  # of the metric events, every n-th is kept
        self._latest: dict[tuple[str, Any], tuple[int, Event]] = {}
        self._rare: collections.deque[tuple[int, Event]] = collections.deque(maxlen=MAX_RARE_EVENTS)
        self.events_seen = 0

    def add(self, event: Event) -> None:
        """Keep ``event`` if a later view needs it."""
        self.events_seen += 1
        kept = (next(self._order), event)
        kind = event["kind"]
        if kind == "stream" or kind == "log":  # every line a rank prints: kept short
            lines = self._lines.get(event["rank"])
            if lines is None:
                lines = self._lines[event["rank"]] = collections.deque(maxlen=self.max_lines)
            lines.append(kept)
        elif kind == "metrics":
            self._metrics_seen += 1
            if (self._metrics_seen - 1) % self._metric_stride:
                return
            self._metrics.append(kept)
            if len(self._metrics) > MAX_METRIC_EVENTS:
                # Every other point, from now on too: the charts keep the whole run's shape.
                self._metrics = self._metrics[::2]
                self._metric_stride *= 2
        elif kind in _LATEST:
            self._latest[(kind, None)] = kept
        elif kind in _LATEST_PER_RANK:
            if kind == "result" and len(event.get("value_bytes", b"")) > MAX_RESULT_BYTES:
                return
            self._latest[(kind, event.get("rank"))] = kept
        elif kind == "collectives":  # the checks' traffic from other nodes: no view shows it
            return
        elif kind == "progress":
            self._latest[(kind, (event["rank"], event["what"]))] = kept
        else:
            self._rare.append(kept)

    def events(self) -> list[Event]:
        """What was kept, oldest first: the events a new view is given to catch up."""
        kept = [*self._metrics, *self._latest.values(), *self._rare]
        for lines in self._lines.values():
            kept.extend(lines)
        kept.sort(key=lambda pair: pair[0])
        return [event for _, event in kept]

    @property
    def ended(self) -> bool:
        """True once the run's last event (``run_ended``) came."""
        return ("run_ended", None) in self._latest


class _Watcher:
    """A view and the context it was made in: its output goes to the cell that asked for it."""

    def __init__(self, view: EventSink) -> None:
        self.view = view
        self.context = contextvars.copy_context()
        self.handle = view.handle  # bound once: every line a rank prints passes here
        self.handle_many = getattr(view, "handle_many", None) or self._one_by_one

    def _one_by_one(self, events: list[Event]) -> None:
        handle = self.handle
        for event in events:
            handle(event)

    def call(self, method: str, *args: Any) -> None:
        self.context.run(getattr(self.view, method), *args)


class EventHub:
    """The sink a run writes to when it may be watched by several views, or by none for a while.

    Every event goes into a :class:`RunHistory` (none with ``keep=False``: a hub whose views
    all watch from its first event) and on to each view that :meth:`watch`\\ es.
    Thread-safe: the run's thread hands it events while a notebook cell adds a view. A view is
    called in the context it was added in (ipykernel sends a cell's output by that context), so
    what it displays appears in the cell that asked for it. A view that fails is dropped: a closed
    page must not stop the run.
    """

    def __init__(self, history: RunHistory | None = None, *, keep: bool = True) -> None:
        self.history: RunHistory | None = (history or RunHistory()) if keep else None
        self.closed = False
        # Replaced, never changed in place: handle() loops over it without copying.
        self._watchers: tuple[_Watcher, ...] = ()
        self._lock = threading.Lock()  # views never call back into the hub
        self.errors: list[BaseException] = []  # what dropped views raised, for the curious

    def watch(self, view: EventSink) -> None:
        """Give ``view`` the history, then every new event; closed at once if the run is over."""
        with self._lock:
            watcher = _Watcher(view)
            for event in self.history.events() if self.history is not None else []:
                view.handle(event)
            if self.closed:
                view.flush(force=True)
                view.close()
                return
            view.flush(force=True)
            self._watchers = (*self._watchers, watcher)

    def unwatch(self, view: EventSink) -> bool:
        """Stop handing ``view`` events (it is not closed); True when it was watching."""
        with self._lock:
            kept = tuple(w for w in self._watchers if w.view is not view)
            found = len(kept) < len(self._watchers)
            self._watchers = kept
            return found

    @property
    def watching(self) -> int:
        """How many views watch now."""
        return len(self._watchers)

    def handle(self, event: Event) -> None:
        with self._lock:
            if self.history is not None:
                self.history.add(event)
            for watcher in self._watchers:
                try:
                    watcher.context.run(watcher.handle, event)
                except Exception as exc:  # a view's trouble must never stop the run
                    self._drop(watcher, exc)

    def handle_many(self, events: list[Event]) -> None:
        """``handle`` for each of ``events``, with one lock and one call per view: the lines of
        one read from a rank's pipe, a batch from a run host."""
        with self._lock:
            if self.history is not None:
                add = self.history.add
                for event in events:
                    add(event)
            for watcher in self._watchers:
                try:
                    watcher.context.run(watcher.handle_many, events)
                except Exception as exc:  # a view's trouble must never stop the run
                    self._drop(watcher, exc)

    def flush(self, force: bool = False) -> None:
        with self._lock:
            self._each("flush", force)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._each("close")
            self._watchers = ()

    def _each(self, method: str, *args: Any) -> None:
        for watcher in self._watchers:
            try:
                watcher.call(method, *args)
            except Exception as exc:  # a view's trouble must never stop the run
                self._drop(watcher, exc)

    def _drop(self, watcher: _Watcher, exc: Exception) -> None:
        self.errors.append(exc)
        self._watchers = tuple(w for w in self._watchers if w is not watcher)
