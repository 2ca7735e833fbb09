"""nblaunch in JupyterLab: a server extension that lists, shows and stops this user's runs.

The Jupyter server loads it with the package (``jupyter-config/.../nblaunch.json`` enables it);
its REST handlers (:mod:`nblaunch.lab.handlers`) serve the "nblaunch" sidebar panel, whose
prebuilt JupyterLab extension ships in ``labextension/`` (sources in the repository's
``labextension/`` folder), so no kernel and no Node.js are needed to use it.
"""

from __future__ import annotations

from typing import Any

LABEXTENSION = "nblaunch-lab"


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "nblaunch.lab"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": LABEXTENSION}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Add the handlers to a running Jupyter server (``server_app`` is its ``ServerApp``)."""
    from nblaunch.lab.handlers import handlers
    from nblaunch.lab.runs import RunsIndex

    web_app = server_app.web_app
    index = RunsIndex(server_app.root_dir)
    web_app.add_handlers(".*$", handlers(web_app.settings["base_url"], index))
    server_app.log.info(
        "nblaunch: the runs panel's API is at %snblaunch/api/runs", web_app.settings["base_url"]
    )


# The name older servers look for.
load_jupyter_server_extension = _load_jupyter_server_extension
