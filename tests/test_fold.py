"""Alike lines of many ranks folded in "All ranks": pure functions of the kept lines."""

from __future__ import annotations

import io
import time

from test_views import fed, line, run_info

from nblaunch.notebook.views import render
from nblaunch.notebook.views import text as text_view
from nblaunch.notebook.views.fold import fold_lines, rank_ranges
from nblaunch.notebook.views.text import TextView


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
    # Rank 1's copy comes 16 * 4 + 1 lines after rank 0's: another fold.
    late = [[0, 1, "ready"], *([[0, 1, ""]] * 64), [1, 1, "ready"]]
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


# --- the rule of docs/view.md, "What folds": issue 40 (6) and issue 44 (2, 3) -----------------


def test_a_number_equal_to_the_rank_folds_only_where_the_line_names_a_rank():
    # 8 ranks, print(f"error count {r}") and print(f"on shard {r}"): whole numbers, must match.
    for template in ("error count {}", "on shard {}"):
        lines = [[r, 1, template.format(r)] for r in range(8)]
        assert folded(lines) == [([r], template.format(r)) for r in range(8)]
    # Where the line names it as the rank (or its device), it is the rank's number.
    for template in ("[rank{}]: ready", "rank={} ready", "Rank {} of 8", "using cuda:{}"):
        lines = [[r, 1, template.format(r)] for r in range(8)]
        assert folded(lines) == [(list(range(8)), template.format("0 … 7"))]
    # A rank that names another rank's number: literal, as printed (rank 0 names its own).
    waits = [[r, 1, "waiting for rank 0"] for r in range(8)]
    assert folded(waits) == [
        ([0], "waiting for rank 0"),
        ([1, 2, 3, 4, 5, 6, 7], "waiting for rank 0"),
    ]
    assert len(folded([[0, 1, "waiting for rank 1"], [1, 1, "waiting for rank 0"]], 4)) == 2


def test_a_range_joins_only_the_same_line_of_each_ranks_output():
    # Rank 2 printed two loss lines before rank 4 printed its first: 4's first joins 2's first.
    lines = [[2, 1, "loss 0.50"], [2, 1, "loss -1.000"], [4, 1, "loss 0.41"]]
    assert folded(lines) == [([2, 4], "loss 0.41 … 0.50"), ([2], "loss -1.000")]
    # The k a view counted as lines came holds even when earlier lines were dropped: rank 0's
    # second loss line is the first kept, and rank 1's first is still there.
    kept = [[1, 1, "loss 0.1", 0], [0, 1, "loss 0.3", 1], [1, 1, "loss 0.2", 1]]
    assert folded(kept) == [([1], "loss 0.1"), ([0, 1], "loss 0.2 … 0.3")]


def test_a_ranks_lines_keep_their_order_in_folds():
    # Rank 0 printed b then a; rank 1 a then b: rank 1's b may not join the fold above its a.
    lines = [[0, 1, "b"], [0, 1, "a"], [1, 1, "a"], [1, 1, "b"]]
    assert folded(lines, 4) == [([0], "b"), ([0, 1], "a"), ([1], "b")]
    # Rank 1 printed x before rank 0 printed a line of its own, then x: x moves below it
    # rather than split in two groups (issue 44, 3).
    lines = [[1, 1, "x"], [2, 1, "x"], [0, 1, "only rank 0"], [0, 1, "x"], [3, 1, "x"]]
    assert folded(lines, 4) == [([0], "only rank 0"), ([0, 1, 2, 3], "x")]
    # Ranks 1 and 2 went on to y before rank 0's own line: x and y move below it together.
    lines = [[1, 1, "x"], [1, 1, "y"], [2, 1, "x"], [0, 1, "only rank 0"], [2, 1, "y"]]
    lines += [[0, 1, "x"], [0, 1, "y"], [3, 1, "x"], [3, 1, "y"]]
    assert folded(lines, 4) == [([0], "only rank 0"), ([0, 1, 2, 3], "x"), ([0, 1, 2, 3], "y")]


TORCH_WARNING = (
    "[W1204 18:18:{:02d}.{:09d} reducer.cpp:1529] Warning: find_unused_parameters=True was "
    "specified in DDP constructor, but did not find any unused parameters in the forward pass."
)


def test_torch_glog_and_logging_timestamps_pids_and_thread_ids_fold():
    torch_lines = [[r, 2, TORCH_WARNING.format(4 + r // 4, 929622867 - r * 1000)] for r in range(8)]
    ((ranks, text),) = folded(torch_lines)
    assert ranks == list(range(8))
    assert text.startswith("[W1204 18:18:04.929619867 … 18:18:05.929618867 reducer.cpp:1529] ")
    glog = [
        [r, 2, f"W1204 18:18:04.{934000 + r:06d} {4100 + r} torch/distributed/run.py:793] up"]
        for r in range(8)
    ]
    assert folded(glog) == [
        (
            list(range(8)),
            "W1204 18:18:04.934000 … 18:18:04.934007 <pid> torch/distributed/run.py:793] up",
        )
    ]
    logging_lines = [
        [r, 2, f"2026-12-04 18:18:04,{900 + r} pid={4100 + r} thread {7000 + r} saved"]
        for r in range(8)
    ]
    assert folded(logging_lines) == [
        (list(range(8)), "2026-12-04 18:18:04,900 … 18:18:04,907 pid=<id> thread <id> saved")
    ]
    # Whole numbers still count: a pid-like number with no name is not an id.
    assert len(folded([[r, 1, f"job {4100 + r} done"] for r in range(8)])) == 8


LOSS = "{'loss': 5.5467571258544925, 'grad_norm': 1.25, 'learning_rate': 5e-05, 'epoch': 0.5}"


def test_the_text_view_never_splits_a_group_by_the_order_lines_arrive_in(monkeypatch):
    out = io.StringIO()
    view = TextView(out, out, max_rate=1000)
    view.handle(run_info(world_size=8))
    view.flush(force=True)
    header = out.getvalue()
    for rank in (3, 4, 5, 6):  # half the ranks' copies, then a flush, then the others'
        view.handle(line(rank, LOSS))
    time.sleep(0.002)
    view.flush()
    assert out.getvalue() == header  # the line waits for the other ranks' copies
    for rank in (0, 1, 2, 7):
        view.handle(line(rank, LOSS))
    time.sleep(0.002)
    view.flush()
    assert out.getvalue() == header + f"[rank 0-7] {LOSS}\n"
    # A line that only rank 0 prints waits HOLD_S once, and what follows it waits behind it;
    # from then on such lines are written as they come.
    monkeypatch.setattr(text_view, "HOLD_S", 0.05)
    view.handle(line(0, "step 1 loss 0.5"))
    view.handle(line(1, "after"))
    time.sleep(0.002)
    view.flush()
    assert out.getvalue() == header + f"[rank 0-7] {LOSS}\n"
    time.sleep(0.06)
    view.flush()
    assert out.getvalue().endswith("[rank 0] step 1 loss 0.5\n[rank 1] after\n")
    view.handle(line(0, "step 2 loss 0.4"))
    time.sleep(0.002)
    view.flush()
    assert out.getvalue().endswith("[rank 0] step 2 loss 0.4\n")


def test_the_text_view_prints_a_bars_state_once_when_its_line_ends_as_it_was_shown():
    # Issue 44 (4): "0%| 0/30" printed as drawn, then again as the bar's last state.
    out = io.StringIO()
    view = TextView(out, out)
    view.handle(run_info(world_size=2))
    bar = "  0%|          | 0/30 [00:00<?, ?it/s]"
    view.handle(line(0, bar, fd=2, carriage=True))
    view.handle(line(0, bar, fd=2))  # the line ends (a warning came): the same state
    view.handle(line(0, "[W1204 18:18:04.929622867 reducer.cpp:1529] Warning: x", fd=2))
    view.close()
    assert out.getvalue().count("0/30") == 1


def test_the_text_view_moves_a_waiting_line_below_a_ranks_own_rather_than_split_it():
    out = io.StringIO()
    view = TextView(out, out)
    view.handle(run_info(world_size=4))
    view.handle(line(1, LOSS))
    view.handle(line(2, LOSS))
    view.handle(line(0, "{'loss': '5.547'}"))  # rank 0's own (Trainer's) line, then its copy
    for rank in (0, 3):
        view.handle(line(rank, LOSS))
    view.close()
    assert out.getvalue().splitlines()[-2:] == ["[rank 0] {'loss': '5.547'}", f"[rank 0-3] {LOSS}"]
