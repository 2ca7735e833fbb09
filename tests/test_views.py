"""The run model, its HTML and the static summary, as pure functions: no widgets, no kernel.

Events go into a :class:`RunModel`; the assertions read its state and what ``render`` and
``summary`` make of it. LaunchView itself (widgets, throttling, the Stop button) is tested in
test_widgets.py.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

from nblaunch.events import RunState
from nblaunch.notebook.views import RunModel, ansi, render, summary
from nblaunch.notebook.views.model import TEXT


def run_info(world_size: int = 2, run_dir: str = "/tmp/runs/r1") -> dict:
    return {
        "kind": "run_info",
        "world_size": world_size,
        "device_kind": "CPU",
        "start_method": "forkserver",
        "debug": False,
        "run_dir": run_dir,
        "warnings": [],
        "notes": ["ranks pinned to cores"],
        "started_at": 0.0,
    }


def line(rank: int, text: str, *, fd: int = 1, carriage: bool = False) -> dict:
    return {"kind": "stream", "rank": rank, "fd": fd, "text": text, "carriage": carriage}


def state(rank: int, value: RunState, detail: str = "") -> dict:
    return {"kind": "state", "rank": rank, "state": value, "detail": detail}


def ended(ok: bool, ranks: dict[int, str], elapsed_s: float = 1.5) -> dict:
    return {"kind": "run_ended", "ok": ok, "elapsed_s": elapsed_s, "ranks": ranks}


def diagnosis(title: str, severity: str = "error", body: str = "", secondary=()) -> dict:
    return {
        "kind": "diagnosis",
        "title": title,
        "body": body,
        "severity": severity,
        "rank": 1,
        "secondary": list(secondary),
    }


def fed(*events: dict, max_lines: int = 200) -> RunModel:
    model = RunModel(max_lines)
    for event in events:
        model.handle(event)
    return model


def texts(model: RunModel, rank: int) -> list[str]:
    return [entry[TEXT] for entry in model.rank_lines.get(rank, ())]


def test_the_model_and_its_renderers_import_neither_ipywidgets_nor_ipython():
    code = (
        "import sys, nblaunch.notebook.views\n"
        "print(sorted(m for m in ('ipywidgets', 'IPython') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


# --- the model -----------------------------------------------------------------------------------


def test_lines_are_kept_bounded_counted_and_name_what_changed():
    model = fed(run_info(), *(line(i % 2, f"line {i}") for i in range(10)), max_lines=3)
    assert texts(model, 0) == ["line 4", "line 6", "line 8"]
    assert [entry[TEXT] for entry in model.all_lines] == ["line 7", "line 8", "line 9"]
    assert model.line_counts == {0: 5, 1: 5} and model.lines_received == 10
    assert model.changed == {0, 1}
    model.changed.clear()
    model.handle(state(1, RunState.RUNNING))
    model.handle(diagnosis("slow", "warning"))
    assert model.changed == {"ranks", "panel"}


def test_a_bar_is_redrawn_in_place_and_a_cleared_one_leaves_nothing():
    model = fed(
        line(0, "before"),
        line(0, "", fd=2, carriage=True),  # the bare "\r" a bar starts with: no line
        line(0, " 10%| 1/10", fd=2, carriage=True),
        line(0, " 90%| 9/10", fd=2, carriage=True),
        line(0, "100%| 10/10", fd=2),  # the bar's last state ends its line
        line(0, "", fd=2, carriage=True),
        line(0, " 50%| 1/2", fd=2, carriage=True),
        line(0, "          ", fd=2),  # tqdm leave=False: cleared
        line(0, "after"),
    )
    assert texts(model, 0) == ["before", "100%| 10/10", "after"]
    assert model.lines_received == 3 and model.line_counts[0] == 3
    assert model.open_lines == {}


def test_a_log_record_is_a_line_of_its_own_on_stderr_from_warning_up():
    record = {
        "kind": "log",
        "rank": 1,
        "level": "WARNING",
        "name": "train",
        "message": "loss is nan",
        "in_order": False,
        "seq": 0,
        "time": 0.0,
    }
    model = fed(record, {**record, "level": "INFO", "message": "step 3"})
    assert [(fd, text) for _, fd, text in model.rank_lines[1]] == [
        (2, "WARNING train: loss is nan"),
        (1, "INFO train: step 3"),
    ]


def test_the_tqdm_bar_a_rank_draws_now_is_read_from_its_open_line():
    bar = "train: 42%|████      | 42/100 [00:01<00:02, 30.12it/s]"
    model = fed(line(0, f"\x1b[32m{bar}\x1b[0m", fd=2, carriage=True), line(1, "no bar"))
    assert model.progress_bar(0) == (0.42, "42/100 · 30.12it/s · ETA 00:02")
    assert model.progress_bar(1) is None
    model.handle(line(0, bar, fd=2))  # the bar's line ended: no longer drawn
    assert model.progress_bar(0) is None


def test_a_finding_is_kept_once_and_updated_in_place():
    model = fed(
        diagnosis("rank 1 failed", body="Traceback"),
        diagnosis("rank 1 failed", body="Traceback"),
        diagnosis("rank 0 is slow", "warning", body="3 s behind"),
        diagnosis("rank 0 is slow", "warning", body="5 s behind"),
    )
    assert [(d["title"], d["body"]) for d in model.diagnoses] == [
        ("rank 1 failed", "Traceback"),
        ("rank 0 is slow", "5 s behind"),
    ]


def test_states_outcome_word_and_the_ranks_a_live_view_expects():
    model = fed(run_info(world_size=3), state(1, RunState.STOPPED, "interrupted"))
    assert model.state(0) is RunState.STOPPED  # never reported
    assert model.outcome_word() == "stopped"
    model.expect_ranks()
    assert model.states == {0: RunState.STARTING, 1: RunState.STOPPED, 2: RunState.STARTING}
    model.handle(state(2, RunState.FAILED, "boom"))
    assert model.outcome_word() == "failed"
    model.handle(ended(True, {}))
    assert model.outcome_word() == "finished"


def test_only_small_results_are_kept():
    model = fed(
        {"kind": "result", "rank": 0, "value_bytes": pickle.dumps(64.0)},
        {"kind": "result", "rank": 1, "value_bytes": b"x" * 5000},
    )
    assert set(model.results) == {0}


# --- the HTML ------------------------------------------------------------------------------------


def test_the_header_shows_the_clock_while_running_and_the_outcome_after():
    model = fed(run_info())
    head = render.head_html(model, elapsed_s=12.4)
    assert head.startswith(
        "<div class='nbl-head'>nblaunch · <b>2 ranks</b> · CPU · forkserver · checks off · 12 s"
    )
    assert "logs: /tmp/runs/r1" in head and "ranks pinned to cores" in head
    model.handle(ended(False, {}, elapsed_s=3.25))
    assert "· <b>failed</b> in 3.2 s<br>" in render.head_html(model, elapsed_s=99.0)


def test_a_rank_row_shows_its_badge_device_and_last_line_or_its_failure():
    model = fed(
        run_info(),
        {"kind": "started", "rank": 0, "pid": 1, "host": "h", "device": "cuda:0"},
        state(0, RunState.RUNNING),
        line(0, "step <3>"),
        line(0, "   "),
        state(1, RunState.FAILED, "ValueError: boom"),
        line(1, "last words"),
    )
    ranks = render.ranks_html(model)
    assert ranks == (
        "<div class='nbl-ranks'>"
        "<div class='nbl-rank'><span class='nbl-badge' style='background:#e0f2fe;"
        "color:#075985'>rank 0 · RUNNING</span><span class='nbl-dim'>cuda:0</span>"
        "<span class='nbl-last' title='step &lt;3&gt;'>step &lt;3&gt;</span></div>"
        "<div class='nbl-rank'><span class='nbl-badge' style='background:#fee2e2;"
        "color:#991b1b'>rank 1 · FAILED</span>"
        "<span class='nbl-last' title='ValueError: boom'>ValueError: boom</span></div>"
        "</div>"
    )


def test_the_panel_names_the_root_cause_first_and_folds_the_rest():
    model = fed(
        diagnosis("rank 1 failed", body="Traceback\nValueError", secondary=["rank 0 saw it"]),
        diagnosis("rank 0 failed"),
        diagnosis("rank 2 is slow", "warning"),
    )
    panel = render.panel_html(model)
    root, rest = panel.split("</details>")
    assert "⛔ rank 1 failed</div><pre>Traceback\nValueError</pre>" in root
    assert "2 other failures (consequences)" in root
    assert "<li>rank 0 saw it</li><li>rank 0 failed</li>" in root
    assert "⚠ rank 2 is slow" in rest and "#fffbeb" in rest


def test_a_log_tab_counts_earlier_lines_and_cuts_long_ones():
    model = fed(
        run_info(),
        *(line(0, f"l{i}") for i in range(4)),
        line(1, "y" * 12, fd=2),
        max_lines=3,
    )
    assert render.log_html(model, 0, max_line_chars=100) == (
        "<div class='nbl-log'><pre><span class='nbl-dim'>… 1 earlier line in "
        "/tmp/runs/r1/rank0.log</span>\nl1\nl2\nl3\n</pre></div>"
    )
    assert render.log_html(model, 1, max_line_chars=10) == (
        "<div class='nbl-log'><pre><span class='nbl-err'>yyyyyyyyyy</span>"
        "<span class='nbl-dim'> … (2 more characters)</span>\n</pre></div>"
    )
    everything = render.log_html(model, None, max_line_chars=100)
    assert "<span class='nbl-tag' style='color:#2563eb'>[0]</span> l2\n" in everything
    assert "<span class='nbl-tag' style='color:#c2410c'>[1]</span> <span class='nbl-err'>" in (
        everything
    )


def test_progress_notes_and_charts_are_empty_until_there_is_something():
    model = fed(run_info())
    assert render.progress_html(model) == "" and render.charts_html(model) == ""
    model.handle(
        {
            "kind": "progress",
            "rank": 0,
            "what": "batch_size",
            "text": "retrying with 64",
            "data": {},
        }
    )
    model.handle({"kind": "metrics", "rank": 0, "step": 0, "values": {"loss": 1.0}, "time": 0.0})
    assert render.progress_html(model) == (
        "<div class='nbl-progress'><div><b>rank 0</b> · batch_size: retrying with 64</div></div>"
    )
    assert render.charts_html(model).startswith("<")


def test_ansi_colours_become_spans_and_other_escapes_go():
    text = "\x1b[1;31mred\x1b[0m & \x1b[2K\x1b[38;2;1;2;3mrgb"
    assert ansi.to_html(text) == (
        "<span style='color:#cd3131;font-weight:bold'>red</span> &amp; "
        "<span style='color:#010203'>rgb</span>"
    )
    assert ansi.plain(text) == "red & rgb"
    assert ansi.strip_to_html("<\x1b[31mx") == "&lt;x"


# --- the static summary --------------------------------------------------------------------------


def test_the_summary_text_tells_the_whole_run():
    model = fed(
        run_info(),
        *(line(0, f"step {i}") for i in range(3)),
        line(1, "\x1b[31moops\x1b[0m", fd=2),
        {"kind": "result", "rank": 0, "value_bytes": pickle.dumps({"loss": 0.5})},
        state(0, RunState.DONE),
        state(1, RunState.FAILED, "ValueError: boom"),
        diagnosis("rank 1 of 2 failed: rank 1 raised ValueError: boom"),
        diagnosis("rank 1 was slow", "warning"),
        ended(False, {0: "returned", 1: "ValueError: boom"}),
        max_lines=2,
    )
    bundle = summary.summary_bundle(model)
    assert bundle["text/plain"] == "\n".join(
        [
            "nblaunch: failed in 1.50 s",
            "  rank 0: DONE · returned {'loss': 0.5}",
            "  rank 1: FAILED · ValueError: boom",
            "  logs: /tmp/runs/r1",
            "error: rank 1 of 2 failed: rank 1 raised ValueError: boom",
            "note: rank 1 was slow",
            "--- rank 0, last 2 lines",
            "  … 1 earlier line in /tmp/runs/r1/rank0.log",
            "  step 1",
            "  step 2",
            "--- rank 1, last 1 line",
            "  oops",
        ]
    )
    page = bundle["text/html"]
    assert page.startswith("<div><b>nblaunch</b> failed in 1.50 s<table")
    assert "<span style='color:#9a3412'><span style='color:#cd3131'>oops</span></span>" in page
    assert "<code>rank1.log</code>" in page and "returned {&#x27;loss&#x27;: 0.5}" in page


def test_the_summary_of_a_run_without_a_directory_or_lines_is_short():
    model = fed(run_info(run_dir=""), ended(True, {0: "returned", 1: "returned"}, 0.25))
    assert summary.summary_bundle(model)["text/plain"] == (
        "nblaunch: finished in 0.25 s\n  rank 0: STOPPED · returned\n  rank 1: STOPPED · returned"
    )


def test_the_end_of_a_run_that_restarted_says_so_in_the_summary_and_the_widgets_head():
    restarted = {**ended(True, {0: "returned", 1: "returned"}, 0.25), "restarts": 2}
    model = fed(run_info(run_dir=""), restarted)
    text = summary.summary_bundle(model)["text/plain"]
    assert text.startswith("nblaunch: finished in 0.25 s after 2 restarts\n"), text
    assert "finished</b> in 0.2 s after 2 restarts" in render.head_html(model, 0.0)


def test_the_saved_summary_carries_no_raw_control_byte():
    # Fault sweep case 11: a rank's raw ESC/OSC bytes reached the saved text/plain summary.
    model = fed(
        run_info(),
        line(0, "title\x1b]0;owned\x07 and a lone \x1b here, a bell \x07, a NUL \x00"),
        state(0, RunState.FAILED, "ValueError: \x1b[2Jcleared"),
        ended(False, {0: "ValueError: \x1b[2Jcleared\x08", 1: "returned"}),
    )
    text = summary.summary_bundle(model)["text/plain"]
    assert not any(ord(c) < 32 and c not in "\n\t" for c in text)
    assert "title and a lone \\x1b here, a bell \\x07, a NUL \\x00" in text
    assert "ValueError: cleared\\x08" in text


def test_a_hundred_thousand_metric_names_keep_the_view_small():
    # Fault sweep case 8: 100k names in one call left ~214 MB per run in the kernel (the live
    # view lives as long as its widget). The view charts MAX_SERIES names and counts the rest.
    import gc
    import tracemalloc

    from nblaunch.notebook.charts import MAX_LEFT_OUT_NAMES, MAX_SERIES

    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        model = fed(run_info())
        for step in range(3):
            event = {"kind": "metrics", "rank": 0, "step": step, "time": 1.0 + step}
            event["values"] = {f"m{i}": float(i) for i in range(100_000)}
            model.handle(event)
            del event
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(model.metrics.series) == MAX_SERIES + 1  # and steps/s, derived
    assert len(model.metrics.left_out) == MAX_LEFT_OUT_NAMES
    assert kept < 5 * 2**20, f"the model keeps {kept / 2**20:.1f} MB"
    note = "10,000 or more other metric names are not charted (every value is in metrics.jsonl)"
    model.handle(ended(True, {0: "returned", 1: "returned"}))
    assert note in summary.summary_bundle(model)["text/plain"]
    assert note in render.charts_html(model)


def test_only_plain_small_values_get_a_short_repr():
    assert summary.short_repr(pickle.dumps([1, 2, 3])) == "[1, 2, 3]"
    assert summary.short_repr(pickle.dumps("s" * 200)) == f"'{'s' * 27}...{'s' * 28}'"
    assert summary.short_repr(pickle.dumps(RunState.DONE)) == ""  # not a plain type
    assert summary.short_repr(b"not a pickle") == ""
