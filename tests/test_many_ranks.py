"""Past eight ranks: the rank grid, the rank picker and the summary grouped by state, driven
with scripted events (no processes, no kernel). The browser test at 16 ranks is in
test_browser.py."""

from __future__ import annotations

import io

import pytest
from test_widgets import displayed, line, run_info, state  # noqa: F401  (a fixture)

from nblaunch.events import RunState
from nblaunch.notebook.views import LaunchView, TextView
from nblaunch.notebook.views.text import _summary_text


def sixty_four_ranks(view) -> None:
    """64 ranks: 62 return, rank 17 fails, rank 40 stalls; every rank prints the same loop."""
    view.handle(run_info(world_size=64))
    for step in (10, 20):
        for rank in range(64):
            view.handle(line(rank, f"epoch 0 step {step} loss {0.40 + rank / 1000:.3f}"))
    for rank in range(64):
        if rank == 17:
            view.handle(state(17, RunState.FAILED, "ValueError: bad batch"))
        elif rank == 40:
            view.handle(state(40, RunState.STALLED, "waiting in all_reduce at train.py:12"))
        else:
            view.handle(state(rank, RunState.DONE))


@pytest.fixture
def big(displayed) -> LaunchView:  # noqa: F811
    view = LaunchView(max_lines=200)
    sixty_four_ranks(view)
    view.flush(force=True)
    return view


def test_a_grid_of_badges_replaces_the_rows_and_the_odd_ranks_stand_out(big):
    grid = big._widgets["ranks"].value
    assert grid.count("class='nbl-cell") == 64 and "nbl-rank'" not in grid
    assert "<b>62 DONE</b> · <b>1 FAILED</b> (rank 17) · <b>1 STALLED</b> (rank 40)" in grid
    assert "<span class='nbl-cell nbl-hot' style='background:#fee2e2;color:#991b1b' " in grid
    assert "title='rank 17 · FAILED\nValueError: bad batch'>17</span>" in grid
    assert "title='rank 3 · DONE\nepoch 0 step 20 loss 0.403'>3</span>" in grid


def test_all_ranks_keeps_lines_for_every_eight_ranks(displayed):  # noqa: F811
    view = LaunchView(max_lines=10)
    view.handle(run_info(world_size=64))
    for i in range(100):
        view.handle(line(i % 64, f"line {i}"))
    assert len(view.model.all_lines) == 80 and len(view.model.rank_lines[0]) == 2


def test_eight_ranks_keep_their_rows_and_tabs(displayed):  # noqa: F811
    view = LaunchView()
    view.handle(run_info(world_size=8))
    view.flush(force=True)
    assert view._widgets["ranks"].value.count("nbl-rank'") == 8
    assert len(view._widgets["tabs"].titles) == 9


def test_a_rank_picker_replaces_a_tab_per_rank(big):
    tabs = big._widgets["tabs"]
    assert tabs.titles == ("All ranks", "One rank")
    all_ranks = tabs.children[0].value
    assert all_ranks.count("nbl-tag") == 2  # 128 lines, two folded lines
    assert "[0-63]</span> epoch 0 step 20 loss 0.400 … 0.463" in all_ranks
    picker, one = tabs.children[1].children
    assert "epoch 0 step 20 loss 0.400" in one.value
    picker.value = 17  # what the browser's pick does once the kernel reads it
    big.flush(force=True)
    assert "loss 0.417" in one.value and "loss 0.400" not in one.value


class Comm:
    """A widget's comm as ipykernel 7 has it: asked on the shell thread where to route."""

    def _reply_subshell_for(self, data, default):
        return default


class Picker:
    def __init__(self) -> None:
        self.options = [(f"rank {r}", r) for r in range(64)]
        self.comm = Comm()


def test_a_pick_is_noticed_on_the_shell_thread_while_the_run_is_busy(big):
    picker = Picker()
    big._hook_picker(picker)
    assert picker.comm._reply_subshell_for({"method": "update", "state": {"index": 40}}, 7) == 7
    big.flush(force=True)
    one = big._widgets["tabs"].children[1].children[1]
    assert "loss 0.440" in one.value and "loss 0.400" not in one.value


def test_the_summary_of_64_ranks_is_grouped_by_state(big):
    outcomes = {r: f"returned {r}" for r in range(64)} | {17: "ValueError: bad batch", 40: ""}
    big.handle({"kind": "run_ended", "ok": False, "elapsed_s": 3.0, "ranks": outcomes})
    lines = big.summary_bundle()["text/plain"].splitlines()
    assert lines[1:4] == [
        "  rank 17 FAILED: ValueError: bad batch",
        "  rank 40 STALLED: waiting in all_reduce at train.py:12",
        "  62 (0-16,18-39,41-63) DONE: returned (62 different values)",
    ]
    assert lines[-2:] == [
        "  [0-63] epoch 0 step 10 loss 0.400 … 0.463",
        "  [0-63] epoch 0 step 20 loss 0.400 … 0.463",
    ]
    assert "--- rank 17, last 2 lines" in lines and "--- rank 3, last 2 lines" not in lines
    html = big.summary_bundle()["text/html"]
    assert html.count("<tr>") == 3 and "62 (0-16,18-39,41-63)" in html


def test_the_text_view_folds_alike_lines_from_four_ranks_on():
    out = io.StringIO()
    view = TextView(out, out)
    view.handle(run_info(world_size=8))
    for rank in range(8):
        view.handle(line(rank, f"epoch 0 step 40 loss {0.41 + rank / 100:.2f}"))
    view.handle(line(3, "only three", fd=2))
    view.handle({"kind": "log", "rank": 5, "level": "INFO", "message": "saved", "name": "x"})
    view.close()
    written = out.getvalue().splitlines()[-3:]
    assert written == [
        "[rank 0-7] epoch 0 step 40 loss 0.41 … 0.48",
        "[rank 3] only three",
        "[rank 5] INFO saved",
    ]
    two = io.StringIO()
    view = TextView(two, two, line_prefix="[${rank}]: ")
    view.handle(run_info(world_size=2))
    view.handle(line(0, "same"))
    view.handle(line(1, "same"))
    view.close()
    assert two.getvalue().endswith("[0]: same\n[1]: same\n")  # two ranks: every line


def test_the_text_views_end_groups_64_ranks_by_outcome():
    outcomes = {r: "returned" for r in range(64)} | {17: "ValueError: bad batch"}
    text = _summary_text(False, 2.0, outcomes)
    assert text == (
        "nblaunch: failed in 2.00 s\n  rank 17: ValueError: bad batch\n"
        "  ranks 0-16,18-63: returned\n"
    )
