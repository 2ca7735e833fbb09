"""The REST handlers under ``/nblaunch/api/``, behind the Jupyter server's own authentication.

- ``GET /nblaunch/api/runs``: every run and pool of this user the panel lists (JSON list);
- ``GET /nblaunch/api/runs/<id>``: one run's record and its picture (``"view"``), live for a
  detached run; ``?since=V`` answers 304 while the picture's version is still ``V``;
- ``POST /nblaunch/api/runs/<id>/stop``: what ``nblaunch runs stop ID`` does.

An id the list does not show (another user's run, or none) is 404 on both.
"""

from __future__ import annotations

import json
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from nblaunch.lab.runs import RunsIndex

API = "nblaunch/api"
_ID = r"(?P<run_id>[A-Za-z0-9_.\-]+)"


class _RunsHandler(APIHandler):
    index: RunsIndex

    def initialize(self, index: RunsIndex) -> None:
        self.index = index

    def reply(self, body: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(body))


class RunsHandler(_RunsHandler):
    @tornado.web.authenticated
    def get(self) -> None:
        self.reply({"runs": self.index.records()})


class RunHandler(_RunsHandler):
    @tornado.web.authenticated
    def get(self, run_id: str) -> None:
        detail = self.index.detail(run_id)
        if detail is None:
            raise tornado.web.HTTPError(404, f"no run {run_id} of yours is listed")
        since = self.get_query_argument("since", None)
        if since is not None and since == str(detail["view"]["version"]):
            self.set_status(304)
            self.finish()
            return
        self.reply(detail)


class StopHandler(_RunsHandler):
    @tornado.web.authenticated
    def post(self, run_id: str) -> None:
        stopped = self.index.stop(run_id)
        if stopped is None:
            raise tornado.web.HTTPError(404, f"no run {run_id} of yours is listed")
        self.reply(stopped)


def handlers(base_url: str, index: RunsIndex) -> list[tuple[str, type, dict[str, Any]]]:
    """The routes, under the server's ``base_url``."""
    where = url_path_join(base_url, API)
    options = {"index": index}
    return [
        (url_path_join(where, "runs"), RunsHandler, options),
        (url_path_join(where, "runs", _ID), RunHandler, options),
        (url_path_join(where, "runs", _ID, "stop"), StopHandler, options),
    ]
