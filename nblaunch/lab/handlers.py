"""The REST handlers under ``/nblaunch/api/``, behind the Jupyter server's own authentication.

- ``GET /nblaunch/api/runs``: every run and pool of this user the panel lists (JSON list);
- ``GET /nblaunch/api/runs/<id>``: one run's record and its picture (``"view"``), live for a
  detached run; ``?since=TAG`` answers 304 while its ``tag`` (the picture's version, the state and a
  pool's holder) is still ``TAG``;
- ``GET /nblaunch/api/runs/<id>/events``: the same picture as server-sent events, one at each
  change, until the run ended (the server is fed by the host's socket; the panel follows this);
- ``POST /nblaunch/api/runs/<id>/stop``: what ``nblaunch runs stop ID`` does; the reply has the
  state after the stop;
- ``POST /nblaunch/api/runs/<id>/clear``: removes an ended run's directory (and its entry);
- ``GET /nblaunch/api/runs/<id>/logs/<name>``: the end of a rank log, ``host.log`` or
  ``metrics.jsonl`` as plain text (the run directories are hidden from Jupyter's contents).

An id the list does not show (another user's run, or none) is 404 on both.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import tornado.iostream
import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from nblaunch.lab.runs import RunsIndex

API = "nblaunch/api"
# How often an event stream looks whether its run's picture changed, and how long one lasts
# at most (the panel opens another).
STREAM_STEP_S = 0.25
STREAM_LIMIT_S = 3600.0
# Any name a run directory may have (a space, "=", "+", non-ASCII: the panel encodes it and
# the router decodes it); the id is then only compared with the names the list shows.
_ID = r"(?P<run_id>[^/]+)"
_LOG = r"(?P<name>[^/]+)"


class _RunsHandler(APIHandler):
    index: RunsIndex

    def initialize(self, index: RunsIndex) -> None:
        self.index = index

    async def name_kernels(self, records: list[dict[str, Any]]) -> None:
        """Add to each pool's holder which kernel of this server it is, and its notebook."""
        held = [r["holder"] for r in records if r.get("holder")]
        if not held:
            return
        kernels = self.settings.get("kernel_manager")
        sessions = self.settings.get("session_manager")
        by_pid: dict[int, dict[str, Any]] = {}
        for kernel_id in kernels.list_kernel_ids() if kernels is not None else []:
            provisioner = getattr(kernels.get_kernel(kernel_id), "provisioner", None)
            if isinstance(getattr(provisioner, "pid", None), int):  # a local kernel
                by_pid[provisioner.pid] = {"kernel_id": kernel_id, "path": None}
        if sessions is not None and by_pid:
            for session in await sessions.list_sessions():
                for kernel in by_pid.values():
                    if session.get("kernel", {}).get("id") == kernel["kernel_id"]:
                        kernel["path"] = session.get("path")
        for holder in held:
            holder["kernel"] = by_pid.get(holder["pid"])  # None: not a kernel of this server

    async def detail(self, run_id: str) -> dict[str, Any]:
        """The run's record and picture, with its ``tag`` (what changes when the panel redraws).

        Raises
        ------
        tornado.web.HTTPError
            404: the list does not show ``run_id`` (none, or another user's).
        """
        # Off the server's event loop: a first look at a run connects to its host.
        detail = await asyncio.to_thread(self.index.detail, run_id)
        if detail is None:
            raise tornado.web.HTTPError(404, f"no run {run_id} of yours is listed")
        await self.name_kernels([detail])
        holder = detail.get("holder") or {}
        detail["tag"] = f"{detail['view']['version']}.{detail['state']}.{holder.get('pid')}"
        return detail

    def reply(self, body: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(body))


class RunsHandler(_RunsHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        records = await asyncio.to_thread(self.index.records)  # off the event loop
        await self.name_kernels(records)
        self.reply({"runs": records})


class RunHandler(_RunsHandler):
    @tornado.web.authenticated
    async def get(self, run_id: str) -> None:
        detail = await self.detail(run_id)
        since = self.get_query_argument("since", None)
        if since is not None and since == detail["tag"]:
            self.set_status(304)
            self.finish()
            return
        self.reply(detail)


class EventsHandler(_RunsHandler):
    _gone = False

    def on_connection_close(self) -> None:
        self._gone = True  # the page closed the view: end the stream now, not at its next change

    @tornado.web.authenticated
    async def get(self, run_id: str) -> None:
        detail = await self.detail(run_id)  # a 404 before the stream starts
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Accel-Buffering", "no")  # a proxy in front must not hold it back
        sent, deadline = None, time.monotonic() + STREAM_LIMIT_S
        try:
            while True:
                if detail["tag"] != sent:
                    self.write(f"data: {json.dumps(detail)}\n\n")
                    await self.flush()
                    sent = detail["tag"]
                if detail["state"] != "running" or time.monotonic() > deadline or self._gone:
                    break
                await asyncio.sleep(STREAM_STEP_S)
                if self._gone:
                    return
                detail = await self.detail(run_id)
        except (tornado.iostream.StreamClosedError, tornado.web.HTTPError):
            return  # the page went away, or the run's directory did
        self.finish()


class StopHandler(_RunsHandler):
    @tornado.web.authenticated
    async def post(self, run_id: str) -> None:
        stopped = await asyncio.to_thread(self.index.stop, run_id)  # it waits for the host
        if stopped is None:
            raise tornado.web.HTTPError(404, f"no run {run_id} of yours is listed")
        self.reply(stopped)


class LogHandler(_RunsHandler):
    @tornado.web.authenticated
    async def get(self, run_id: str, name: str) -> None:
        text = await asyncio.to_thread(self.index.log, run_id, name)
        if text is None:
            raise tornado.web.HTTPError(404, f"no log {name} of a run {run_id} of yours")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")  # never rendered as HTML
        self.finish(text, set_content_type="text/plain; charset=utf-8")


class ClearHandler(_RunsHandler):
    @tornado.web.authenticated
    async def post(self, run_id: str) -> None:
        cleared = await asyncio.to_thread(self.index.clear, run_id)
        if cleared is None:
            raise tornado.web.HTTPError(404, f"no run {run_id} of yours is listed")
        self.reply(cleared)


def handlers(base_url: str, index: RunsIndex) -> list[tuple[str, type, dict[str, Any]]]:
    """The routes, under the server's ``base_url``."""
    where = url_path_join(base_url, API)
    options = {"index": index}
    return [
        (url_path_join(where, "runs"), RunsHandler, options),
        (url_path_join(where, "runs", _ID), RunHandler, options),
        (url_path_join(where, "runs", _ID, "events"), EventsHandler, options),
        (url_path_join(where, "runs", _ID, "stop"), StopHandler, options),
        (url_path_join(where, "runs", _ID, "clear"), ClearHandler, options),
        (url_path_join(where, "runs", _ID, "logs", _LOG), LogHandler, options),
    ]
