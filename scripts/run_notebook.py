"""Run a notebook headless in a real Jupyter kernel and print what it shows.

Used by ``make demo``::

    python scripts/run_notebook.py notebooks/quickstart.ipynb [--save executed.ipynb]

Every cell runs in a fresh ``python3`` kernel (nbclient). For each cell the script prints its
text output, the static summary the launcher leaves behind, a one-line note for a live widget,
and errors with their traceback. The exit status is 1 when a cell raised.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def execute(notebook: nbformat.NotebookNode, path: Path, timeout: float = 300.0) -> None:
    """Execute ``notebook`` (read from ``path``) in place, in the notebook's own directory.

    Widget state is stored in the notebook's metadata, as JupyterLab does when it saves.

    Raises
    ------
    CellExecutionError
        When a cell raised; the cells run so far keep their outputs.
    """
    client = NotebookClient(
        notebook,
        timeout=int(timeout),
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.resolve())}},
        store_widget_state=True,
    )
    client.execute()


def describe(notebook: nbformat.NotebookNode) -> str:
    """What a person reading the executed notebook sees, as plain text."""
    lines: list[str] = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        lines.append(f"--- cell {index} " + "-" * 60)
        for output in cell.get("outputs", []):
            kind = output.output_type
            if kind == "stream":
                lines.append(output.text.rstrip("\n"))
            elif kind in ("display_data", "execute_result"):
                data = output.get("data", {})
                if "application/vnd.jupyter.widget-view+json" in data:
                    model_id = data["application/vnd.jupyter.widget-view+json"]["model_id"]
                    lines.append("[live rank view (widget)], its All ranks log:")
                    lines += [f"  {line}" for line in all_ranks_log(notebook, model_id)]
                elif "text/plain" in data:
                    lines.append(data["text/plain"])
            elif kind == "error":
                lines.append(_ANSI.sub("", "\n".join(output.traceback)))
    return "\n".join(lines)


def all_ranks_log(notebook: nbformat.NotebookNode, model_id: str) -> list[str]:
    """The lines of a saved live view's "All ranks" tab, from the notebook's widget state."""
    state = notebook.metadata.get("widgets", {}).get(_WIDGET_STATE, {}).get("state", {})
    pending, seen = [model_id], set()
    while pending:  # walk the widget tree from the view's root to its "All ranks" tab
        current = pending.pop(0)
        model = state.get(current, {}).get("state", {})
        if current in seen or not model:
            continue
        seen.add(current)
        if model.get("titles", [None])[0] == "All ranks" and model.get("children"):
            log = state.get(model["children"][0].removeprefix("IPY_MODEL_"), {})
            text = re.sub(r"<[^>]+>", "", log.get("state", {}).get("value", ""))
            return [line for line in html.unescape(text).splitlines() if line.strip()]
        for value in model.values():
            refs = value if isinstance(value, list) else [value]
            pending += [
                r.removeprefix("IPY_MODEL_") for r in refs if str(r).startswith("IPY_MODEL_")
            ]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--save", type=Path, help="write the executed notebook here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per cell")
    options = parser.parse_args(argv)
    started = time.monotonic()
    status = 0
    notebook = nbformat.read(options.notebook, as_version=4)
    try:
        execute(notebook, options.notebook, options.timeout)
    except CellExecutionError:
        status = 1  # the error is in the cell's outputs, printed below
    print(describe(notebook))
    print(f"--- {options.notebook} ran in {time.monotonic() - started:.1f} s")
    if options.save:
        nbformat.write(notebook, options.save)
    return status


if __name__ == "__main__":
    sys.exit(main())
