"""Metrics from every rank: ``log_metrics`` in ranks, ``metrics.jsonl``, charts.

The frameworks' own loss (Transformers' Trainer, Lightning) reaching the charts is checked in
``compat/test_compat.py``, on the runs it compares with torchrun.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import WIDGET_VIEW

from nblaunch import load_metrics, log_metrics, notebook_launcher
from nblaunch.notebook.charts import MAX_POINTS, MetricSeries, render_svg, series_from
from nblaunch.notebook.views import LaunchView


def launch(function, args=(), **kwargs):
    kwargs.setdefault("display", "none")
    return notebook_launcher(function, args, num_processes=2, device_type="cpu", **kwargs)


def train_and_log(steps):
    import nblaunch

    for step in range(steps):
        nblaunch.log_metrics({"loss": 1.0 / (step + 1) + nblaunch.rank(), "note": "text"})
    nblaunch.log_metrics({"eval_acc": 0.5}, step=100)
    return steps


def test_each_ranks_metrics_reach_metrics_jsonl_and_load_metrics(tmp_path):
    launch(train_and_log, (5,), run_dir=tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert (tmp_path / "metrics.jsonl").stat().st_mode & 0o777 == 0o600
    rows = load_metrics(tmp_path)
    table = rows if isinstance(rows, list) else rows.to_dict("records")
    assert len(lines) == len(table) == 2 * 6  # 5 losses and one eval per rank; text dropped
    losses = sorted((r["rank"], r["step"], r["value"]) for r in table if r["name"] == "loss")
    assert losses[:2] == [(0, 0, 1.0), (0, 1, 0.5)]
    assert (1, 4, 1.2) in losses  # rank 1's own values, steps counted per rank
    evals = {(r["rank"], r["step"]) for r in table if r["name"] == "eval_acc"}
    assert evals == {(0, 100), (1, 100)}
    assert all(json.loads(line)["time"] > 0 for line in lines)


def test_outside_a_rank_log_metrics_does_nothing():
    log_metrics({"loss": 1.0})  # no error, nothing sent


def log_odd_values():
    import warnings

    import nblaunch

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):  # too large for a float: left out, said once
            nblaunch.log_metrics({"big": 10**400, "loss": 0.5}, step=step)
    errors = []
    for call in (lambda: nblaunch.log_metrics("loss"), lambda: nblaunch.log_metrics({}, step="x")):
        try:
            call()
        except TypeError as exc:
            errors.append(str(exc))
    return [str(w.message) for w in said], errors


def test_values_that_do_not_fit_are_dropped_once_and_bad_arguments_named(tmp_path):
    # Fault sweep case 9: 10**400 failed the run on every rank with OverflowError; step="x" and
    # a string instead of a dict raised bare errors inside the rank.
    (said, errors), _ = launch(log_odd_values, run_dir=tmp_path)
    assert len(said) == 1 and "big = 1000000000000000" in said[0] and "once per name" in said[0]
    assert errors[0].startswith("log_metrics(values): values must be a dict")
    assert errors[1].startswith("log_metrics(step=...): step must be a whole number")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {row["name"] for row in rows} == {"loss"} and len(rows) == 6
    with pytest.raises(TypeError, match="values must be a dict"):
        log_metrics(["loss", 1.0])  # checked outside a rank too


def test_charts_draw_a_line_per_rank_and_stay_bounded():
    events = [
        {"kind": "metrics", "rank": rank, "step": step, "values": {"loss": 1 / (step + 1)}}
        for step in range(3 * MAX_POINTS)
        for rank in (0, 1)
    ]
    series = series_from(events)
    points = series.series["loss"][0]
    assert len(points) <= MAX_POINTS
    assert points[0][0] == 0 and points[-1][0] == 3 * MAX_POINTS - 1  # both ends kept
    svg = render_svg(series)
    assert svg.count("<polyline") == 2 and "rank 1" in svg and ">loss<" in svg
    assert not MetricSeries()


def test_the_static_summary_carries_the_charts():
    view = LaunchView()
    view.live = False  # no widgets: the summary alone, as a quick run shows it
    for event in (
        {"kind": "metrics", "rank": 0, "step": 0, "values": {"loss": 2.0}, "time": 0.0},
        {"kind": "metrics", "rank": 0, "step": 1, "values": {"loss": 1.0}, "time": 0.0},
        {"kind": "run_ended", "ok": True, "elapsed_s": 1.0, "ranks": {0: "returned"}},
    ):
        view.handle(event)
    bundle = view.summary_bundle()
    assert "<svg" in bundle["text/html"] and "<polyline" in bundle["text/html"]
    assert "metrics: loss" in bundle["text/plain"]


def test_a_notebook_saved_without_widget_state_keeps_the_charts(widgetless_notebook):
    _, cells = widgetless_notebook  # conftest.WIDGETLESS_CELLS, run in one kernel
    charted = cells["charted"]
    assert not [out for out in charted.outputs if out.output_type == "error"]
    static = [
        out.data["text/html"]
        for out in charted.outputs
        if out.output_type == "display_data"
        and WIDGET_VIEW not in out.data
        and "text/html" in out.data
    ]
    assert static and "<svg" in static[-1], [o.output_type for o in charted.outputs]
    assert len(re.findall("<polyline", static[-1])) == 2  # one line per rank


def cost_of_log_metrics(calls):
    import time

    import nblaunch

    began = time.perf_counter()
    for step in range(calls):
        nblaunch.log_metrics({"loss": 0.5, "lr": 1e-3}, step=step)
    return (time.perf_counter() - began) / calls


def test_log_metrics_is_cheap():
    per_call = max(launch(cost_of_log_metrics, (2000,)))
    assert per_call < 200e-6, per_call  # a loose bound for CI; see the note in docs/metrics.md


def test_each_ranks_throughput_is_charted_from_its_steps_and_times():
    events = [
        {
            "kind": "metrics",
            "rank": rank,
            "step": step,
            "values": {"loss": 1.0},
            "time": step * (0.1 if rank == 0 else 0.2),
        }  # rank 1 is twice as slow
        for step in range(40)
        for rank in (0, 1)
    ]
    rates = series_from(events).series["steps/s"]
    assert {round(v) for _, v in rates[0]} == {10} and {round(v) for _, v in rates[1]} == {5}


def log_with_accelerate():
    from accelerate import Accelerator

    from nblaunch.integrations import AccelerateMetrics

    accelerator = Accelerator(cpu=True, log_with=[AccelerateMetrics()])
    accelerator.init_trackers("run")
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
    accelerator.end_training()


def test_accelerates_log_reaches_the_charts(tmp_path):
    pytest.importorskip("accelerate")
    launch(log_with_accelerate, run_dir=tmp_path)
    rows = load_metrics(tmp_path)
    table = rows if isinstance(rows, list) else rows.to_dict("records")
    assert [(r["rank"], r["step"], r["value"]) for r in table] == [
        (0, 0, 1.0),
        (0, 1, 0.5),
        (0, 2, 1 / 3),
    ]  # Accelerate logs on the main process only


def test_past_four_ranks_a_chart_shows_the_mean_and_a_band():
    events = [
        {"kind": "metrics", "rank": rank, "step": step, "values": {"loss": step + rank}}
        for step in range(5)
        for rank in range(8)
    ]
    svg = render_svg(series_from(events))
    assert svg.count("<polyline") == 1 and svg.count("<polygon") == 1
    assert "mean of 8 ranks" in svg


def test_with_tensorboard_installed_each_rank_gets_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    launch(train_and_log, (5,), run_dir=tmp_path)
    for rank in (0, 1):
        events = EventAccumulator(str(tmp_path / "tensorboard" / f"rank{rank}"))
        events.Reload()
        losses = [(s.step, round(s.value, 4)) for s in events.Scalars("loss")]
        assert losses == [(step, round(1 / (step + 1) + rank, 4)) for step in range(5)]
