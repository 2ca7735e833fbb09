"""The troubleshooting notebook, executed in a real Jupyter kernel (nbclient)."""

from __future__ import annotations

import html
import re
import shutil

import nbformat
import pytest
from conftest import ROOT, WIDGET_STATE, WIDGET_VIEW, load_run_notebook

NOTEBOOK = ROOT / "notebooks" / "troubleshooting.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> nbformat.NotebookNode:
    """The notebook executed once, in a scratch directory."""
    workdir = tmp_path_factory.mktemp("troubleshooting")
    path = workdir / NOTEBOOK.name
    shutil.copy(NOTEBOOK, path)
    notebook = nbformat.read(path, as_version=4)
    load_run_notebook().execute(notebook, path, timeout=240)
    return notebook


def _cell(notebook: nbformat.NotebookNode, needle: str) -> nbformat.NotebookNode:
    return next(c for c in notebook.cells if c.cell_type == "code" and needle in c.source)


def _result(cell: nbformat.NotebookNode) -> str:
    return next(o for o in cell.outputs if o.output_type == "execute_result").data["text/plain"]


def _all_ranks_text(notebook: nbformat.NotebookNode, cell: nbformat.NotebookNode) -> str:
    """The "All ranks" tab of the cell's live view, as saved in the notebook, as plain text."""
    state = notebook.metadata["widgets"][WIDGET_STATE]["state"]

    def tab(model_id: str):
        model = state[model_id]
        if model["model_name"] == "TabModel":
            return model
        for ref in model["state"].get("children", []):
            found = tab(ref.removeprefix("IPY_MODEL_"))
            if found:
                return found
        return None

    view = next(o.data[WIDGET_VIEW]["model_id"] for o in cell.outputs if WIDGET_VIEW in o.data)
    first = tab(view)["state"]["children"][0].removeprefix("IPY_MODEL_")
    return html.unescape(re.sub(r"<[^>]+>", "", state[first]["state"]["value"]))


@pytest.mark.slow
def test_only_the_cells_meant_to_fail_fail(executed):
    failed = [
        (c.metadata.get("tags", []), o.ename)
        for c in executed.cells
        for o in c.get("outputs", [])
        if o.output_type == "error"
    ]
    assert failed == [(["raises-exception"], "DistributedOperationException")] * 3


@pytest.mark.slow
def test_in_order_logging_shows_each_step_in_rank_order_without_hanging(executed):
    cell = _cell(executed, "notebook_launcher(train_logging")
    assert _result(cell) == "[0, 1]"
    lines = [line for line in _all_ranks_text(executed, cell).splitlines() if "train:" in line]
    assert lines == [
        "[0] INFO train: starting (logged by rank 0 only)",
        "[0] INFO train: in order: step 0",
        "[1] INFO train: in order: step 0",
        "[0] INFO train: in order: step 1",
        "[1] INFO train: in order: step 1",
        "[0] INFO train: in order: step 2",
        "[1] INFO train: in order: step 2",
        "[1] INFO train: in order: one more message from rank 1",
    ]


@pytest.mark.slow
def test_with_the_checks_off_the_mismatch_goes_unnoticed(executed):
    cell = _cell(executed, "notebook_launcher(mismatched_broadcast, num_processes=2, debug=False)")
    assert "[0.0, 0.0, 0.0, 0.0, 0.0]" in _result(cell)  # rank 1's tensor, half filled


@pytest.mark.slow
def test_by_default_the_checks_report_the_shapes_and_the_cell_lines(executed):
    cell = _cell(executed, "notebook_launcher(mismatched_broadcast, num_processes=2)")
    error = next(o for o in cell.outputs if o.output_type == "error")
    assert error.evalue.startswith(
        "Cannot apply desired operation due to shape mismatches. All shapes across devices "
        "must be valid.\n\nOperation: `nblaunch.ranks.ops.broadcast`\nInput shapes:\n"
        "  - Process 0: [1, 5]\n  - Process 1: [1, 2, 5]\n"
    )
    assert "  - Process 1: cell line 7" in error.evalue
    assert "comparing the calls of ranks 0, 1 at collective #1" in error.evalue


@pytest.mark.slow
def test_debug_mode_reports_the_shapes_and_the_cell_lines(executed):
    cell = _cell(executed, "notebook_launcher(mismatched_broadcast, num_processes=2, debug=True)")
    error = next(o for o in cell.outputs if o.output_type == "error")
    assert error.evalue.startswith(
        "Cannot apply desired operation due to shape mismatches. All shapes across devices "
        "must be valid.\n\nOperation: `nblaunch.ranks.ops.broadcast`\nInput shapes:\n"
        "  - Process 0: [1, 5]\n  - Process 1: [1, 2, 5]\n"
    )
    assert "  - Process 1: cell line 7" in error.evalue

    cell = _cell(executed, "notebook_launcher(diverging_collectives")
    error = next(o for o in cell.outputs if o.output_type == "error")
    assert (
        "rank 0 called broadcast at cell line 7 while rank 1 called all_reduce at cell line 9"
    ) in error.evalue


@pytest.mark.slow
def test_early_stopping_stops_both_ranks_at_the_same_epoch(executed):
    cell = _cell(executed, "notebook_launcher(train_with_early_stop")
    assert _result(cell) == "[3, 3]"
