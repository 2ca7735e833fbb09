"""Alike lines of many ranks folded in "All ranks": pure functions of the kept lines."""

from __future__ import annotations

from test_views import fed, line, run_info

from nblaunch.notebook.views import render
from nblaunch.notebook.views.fold import fold_lines, rank_ranges


def folded(lines, world_size=8):
    return [(fold.ranks, fold.text()) for fold in fold_lines(lines, world_size)]


def test_a_line_every_rank_prints_alike_shows_once_with_its_ranks():
    lines = [[r, 1, "epoch 0 step 40 lr 0.05"] for r in range(8)]
    assert folded(lines) == [(list(range(8)), "epoch 0 step 40 lr 0.05")]


def test_lines_that_differ_in_numbers_fold_with_each_differing_number_as_its_range():
    lines = [[r, 1, f"step 40 loss {0.41 + r / 100:.2f} lr 0.05"] for r in (3, 0, 1, 2)]
    assert folded(lines) == [([0, 1, 2, 3], "step 40 loss 0.41 … 0.44 lr 0.05")]
    (fold,) = fold_lines(lines, 8)
    assert fold.exact().splitlines()[0] == "[3] step 40 loss 0.44 lr 0.05"  # as printed


def test_whole_numbers_must_match_and_clock_times_are_measurements():
    lines = [[0, 1, "step 20 loss 0.31"], [1, 1, "step 40 loss 0.32"], [2, 1, "step 20 loss 0.33"]]
    assert folded(lines) == [([0, 2], "step 20 loss 0.31 … 0.33"), ([1], "step 40 loss 0.32")]
    bars = [
        [r, 2, f"100%|###| 60/60 [00:{9 + r:02d}<00:00, {4.9 + r / 10:.2f}it/s]"] for r in (0, 1, 2)
    ]
    assert folded(bars) == [([0, 1, 2], "100%|###| 60/60 [00:09 … 00:11<00:00, 4.90 … 5.10it/s]")]


def test_a_ranks_own_number_and_a_bars_state_may_differ():
    hello = [[r, 1, f"hello from rank {r} of 8"] for r in (5, 0, 7)]
    assert folded(hello) == [([0, 5, 7], "hello from rank 0 … 7 of 8")]
    assert len(folded([[1, 1, "rank 1 step 1"], [2, 1, "rank 2 step 1"]])) == 1
    assert len(folded([[1, 1, "rank 1 step 1"], [2, 1, "rank 2 step 2"]])) == 2
    bars = [
        [0, 2, "train  32%|███       | 19/60 [00:04<00:08,  4.56it/s]"],
        [1, 2, "train  30%|███       | 18/60 [00:04<00:09,  4.50it/s]"],
        [2, 2, "train  35%|████      | 21/60 [00:05<00:08,  4.60it/s]"],
        [3, 2, "train   0%|          | 0/60 [00:00<?, ?it/s]"],
    ]
    assert folded(bars) == [
        (
            [0, 1, 2],
            "train  30 … 35%|███       | 18 … 21/60 [00:04 … 00:05<00:08 … 00:09,  "
            "4.50 … 4.60it/s]",
        ),
        ([3], "train   0%|          | 0/60 [00:00<?, ?it/s]"),
    ]


def test_a_rank_never_folds_with_itself_nor_with_a_copy_outside_the_window():
    steps = [[0, 1, f"step {i}"] for i in range(3)]
    assert folded(steps) == [([0], "step 0"), ([0], "step 1"), ([0], "step 2")]
    # Rank 1's copy comes 4 * 4 + 1 lines after rank 0's: another fold.
    late = [[0, 1, "ready"], *([[0, 1, ""]] * 16), [1, 1, "ready"]]
    assert [ranks for ranks, text in folded(late, 4) if text] == [[0], [1]]


def test_interleaved_loops_fold_step_by_step_and_streams_apart():
    lines = []
    for step in (1, 2):
        for rank in range(4):
            lines.append([rank, 1, f"step {step}"])
            lines.append([rank, 2, f"warning at step {step}"])
    assert folded(lines, 4) == [
        ([0, 1, 2, 3], "step 1"),
        ([0, 1, 2, 3], "warning at step 1"),
        ([0, 1, 2, 3], "step 2"),
        ([0, 1, 2, 3], "warning at step 2"),
    ]
    assert folded([[0, 1, ""], [1, 1, ""]]) == [([0], ""), ([1], "")]  # blank lines stay
    # Two ranks: their lines read well apart, and each number stays exact.
    two = [[0, 1, "loss 0.4"], [1, 1, "loss 0.5"]]
    assert folded(two, 2) == [([0], "loss 0.4"), ([1], "loss 0.5")]


def test_rank_ranges_are_runs():
    assert rank_ranges([7, 0, 1, 2, 3, 5]) == "0-3,5,7"
    assert rank_ranges([4]) == "4"


def test_all_ranks_shows_folded_lines_with_the_exact_ones_on_hover():
    events = [line(r, f"loss {0.5 + r / 10:.1f}") for r in range(8)]
    model = fed(run_info(world_size=8), *events, line(2, "only two", fd=2))
    everything = render.log_html(model, None, max_line_chars=100)
    assert everything.count("nbl-tag") == 2
    assert "[0-7]</span> loss 0.5 … 1.2\n" in everything
    assert "title='[0] loss 0.5\n[1] loss 0.6" in everything
    assert "[2]</span> <span class='nbl-err'>only two</span>" in everything
    # A rank's tab keeps its own lines as printed.
    assert "loss 0.7\n" in render.log_html(model, 2, max_line_chars=100)
