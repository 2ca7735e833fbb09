"""LaunchView, TextView and choosing a view, driven with scripted events (no processes, no kernel).

The run model, the HTML and the summary alone are tested without widgets in test_views.py.
"""

from __future__ import annotations

import signal
import threading
import time

import ipywidgets
import pytest

from nblaunch.errors import LaunchError
from nblaunch.events import NullView, RunState
from nblaunch.notebook.views import (
    DeferredView,
    LaunchView,
    TextView,
    choose,
    choose_view,
    make_view,
    render,
    summary,
    widget,
)


def run_info(world_size: int = 2, run_dir: str = "/tmp/runs/r1") -> dict:
    return {
        "kind": "run_info",
        "world_size": world_size,
        "device_kind": "CPU",
        "start_method": "forkserver",
        "debug": True,
        "run_dir": run_dir,
        "warnings": ["4 CPU ranks on 2 cores: ranks will share cores"],
        "started_at": time.time(),
    }


def line(rank: int, text: str, *, fd: int = 1, carriage: bool = False) -> dict:
    return {"kind": "stream", "rank": rank, "fd": fd, "text": text, "carriage": carriage}


def state(rank: int, value: RunState, detail: str = "") -> dict:
    return {"kind": "state", "rank": rank, "state": value, "detail": detail}


def rank1_failed() -> dict:
    """The launcher's root-cause diagnosis for rank 1 raising ValueError: boom."""
    return {
        "kind": "diagnosis",
        "title": "rank 1 of 2 failed: rank 1 raised ValueError: boom",
        "body": "Traceback ...",
        "severity": "error",
        "rank": 1,
        "secondary": [],
    }


@pytest.fixture
def displayed(monkeypatch) -> list:
    """What the view displays (widget, summary), instead of printing reprs to the terminal."""
    shown: list = []
    monkeypatch.setattr(widget, "_display", lambda obj, **kw: shown.append(obj))
    return shown


@pytest.fixture
def view(displayed) -> LaunchView:
    v = LaunchView(max_lines=5)
    v.handle(run_info())
    return v


def html(v: LaunchView, part: str) -> str:
    return v._widgets[part].value


def log_html(v: LaunchView, tab: int) -> str:
    return v._widgets["tabs"].children[tab].value


# --- choosing a view -----------------------------------------------------------------------------


def test_make_view_modes(monkeypatch):
    assert isinstance(make_view("none"), NullView)
    assert isinstance(make_view("text"), TextView)
    assert isinstance(make_view("widget"), LaunchView)
    monkeypatch.setattr(choose, "in_notebook_kernel", lambda: False)
    assert isinstance(make_view("auto"), TextView)
    monkeypatch.setattr(choose, "in_notebook_kernel", lambda: True)
    assert isinstance(make_view("auto"), LaunchView)
    monkeypatch.setattr(choose, "widgets_available", lambda: False)
    assert isinstance(make_view("auto"), TextView)
    with pytest.raises(LaunchError, match="display='html' is not one of"):
        make_view("html")


def test_choose_view_defers_what_each_front_end_defers(monkeypatch):
    monkeypatch.setattr(choose, "in_notebook_kernel", lambda: True)
    launch = choose_view("auto")  # notebook_launcher: the live widget only
    assert isinstance(launch, DeferredView) and isinstance(launch.view, LaunchView)
    assert isinstance(choose_view("text"), TextView)
    task = choose_view("text", defer="always")  # a pool task: any view
    assert isinstance(task, DeferredView) and isinstance(task.view, TextView)
    assert isinstance(choose_view("widget", defer="never"), LaunchView)  # multi-node
    for defer in ("widget", "always", "never"):
        assert isinstance(choose_view("none", defer=defer), NullView)
    with pytest.raises(ValueError, match="defer='sometimes'"):
        choose_view("auto", defer="sometimes")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="display='html' is not one of"):
        choose_view("html")


def test_a_quick_silent_run_shows_nothing_and_a_quick_failure_its_summary(displayed):
    quiet = choose_view("widget")
    for event in (run_info(), {"kind": "run_ended", "ok": True, "elapsed_s": 0.1, "ranks": {}}):
        quiet.handle(event)
    quiet.close()
    assert displayed == []
    failed = choose_view("widget")
    failed.handle(run_info())
    failed.handle(state(1, RunState.FAILED, "ValueError: boom"))
    failed.handle({"kind": "run_ended", "ok": False, "elapsed_s": 0.1, "ranks": {1: "boom"}})
    failed.close()
    (shown,) = displayed  # the summary alone, no widget tree
    assert shown["text/plain"].splitlines()[:2] == [
        "nblaunch: failed in 0.10 s",
        "  rank 1: FAILED · boom",
    ]


def test_not_in_a_kernel_here():
    assert choose.in_notebook_kernel() is False


# --- the view ------------------------------------------------------------------------------------


def test_displays_once_in_the_launching_cell_with_header_and_tabs(view, displayed):
    assert displayed == [view._widgets["root"]]
    head = html(view, "head")
    for part in ("2 ranks", "CPU", "forkserver", "debug on", "/tmp/runs/r1", "share cores"):
        assert part in head
    assert view._widgets["tabs"].titles == ("All ranks", "rank 0", "rank 1")


def test_lines_reach_the_all_ranks_tab_tagged_and_their_rank_tab(view):
    view.handle(line(0, "hello from zero"))
    view.handle(line(1, "hello from one", fd=2))
    view.flush(force=True)
    everything = log_html(view, 0)
    assert everything.index("[0]</span> hello from zero") < everything.index("hello from one")
    assert "[1]</span> <span class='nbl-err'>hello from one" in everything
    assert "hello from one" in log_html(view, 2) and "hello from one" not in log_html(view, 1)
    assert "hello from one" in html(view, "ranks")  # the badge shows the rank's last line


def test_lines_are_bounded_per_rank_and_point_to_the_log_file(view):
    for i in range(12):
        view.handle(line(0, f"line {i}"))
    view.flush(force=True)
    rank0 = log_html(view, 1)
    assert "line 11" in rank0 and "line 6" not in rank0 and "line 7" in rank0
    assert "7 earlier lines in /tmp/runs/r1/rank0.log" in rank0
    assert len(view.model.all_lines) == 5 and len(view.model.rank_lines[0]) == 5
    assert view.model.lines_received == 12


def test_carriage_return_updates_one_line_in_place(view):
    view.handle(line(0, "before"))
    view.handle(line(0, "", carriage=True))
    for pct in (10, 50, 90):
        view.handle(line(0, f"train {pct}%", carriage=True))
    view.handle(line(0, "train 100%"))
    view.handle(line(0, "after"))
    view.flush(force=True)
    rank0 = log_html(view, 1)
    assert "train 10%" not in rank0 and "train 90%" not in rank0
    assert rank0.count("train 100%") == 1
    assert rank0.index("before") < rank0.index("train 100%") < rank0.index("after")
    assert log_html(view, 0).count("train 100%") == 1
    assert view.model.lines_received == 3


def log_record(rank: int, message: str, level: str = "WARNING") -> dict:
    return {
        "kind": "log",
        "rank": rank,
        "level": level,
        "name": "train",
        "message": message,
        "in_order": False,
        "seq": 0,
        "time": time.time(),
    }


def test_a_cleared_bar_leaves_no_line_and_a_log_record_never_replaces_a_bar(view):
    view.handle(line(0, "before"))
    view.handle(line(0, "", fd=2, carriage=True))
    view.handle(line(0, " 50%| 2/4", fd=2, carriage=True))
    view.handle(log_record(0, "loss is nan"))  # not the bar's last state
    view.handle(line(0, "          ", fd=2, carriage=True))
    view.handle(line(0, "          ", fd=2))  # tqdm leave=False: the bar ends blank
    view.handle(line(0, "after"))
    view.handle(line(1, "", carriage=True))
    view.handle(line(1, ""))  # a bare "\r" then the end: no line either
    view.handle(line(1, ""))  # but a blank line printed on purpose stays
    texts = [entry[2] for entry in view.model.rank_lines[0]]
    assert texts == ["before", "WARNING train: loss is nan", "after"]
    assert [entry[2] for entry in view.model.rank_lines[1]] == [""]
    assert view.model.line_counts[0] == 3 and len(view.model.all_lines) == 4
    view.flush(force=True)
    assert "50%" not in log_html(view, 1)


def test_text_view_prints_a_bars_last_state_once_and_nothing_for_a_cleared_one():
    import io

    out, err = io.StringIO(), io.StringIO()
    v = TextView(out, err)
    for text in ("", "  0%| 0/3", " 33%| 1/3", "100%| 3/3"):
        v.handle(line(0, text, fd=2, carriage=True))
    v.handle(line(0, "100%| 3/3", fd=2))
    v.handle(line(1, "", fd=2, carriage=True))
    v.handle(line(1, "     ", fd=2, carriage=True))
    v.handle(line(1, "     ", fd=2))  # cleared
    v.handle(line(1, "next"))
    v.close()
    assert err.getvalue() == "[rank 0]   0%| 0/3\n[rank 0] 100%| 3/3\n"
    assert out.getvalue() == "[rank 1] next\n"


def test_html_is_escaped_ansi_colours_render_and_long_lines_are_cut(view):
    view.handle(line(0, "<script>alert(1)</script> & \ufffd\ufffd bytes"))
    view.handle(line(0, "\x1b[1;31mred bold\x1b[0m plain \x1b[2K\x1b[38;5;28mgreen\x1b[39m"))
    view.handle(line(1, "x" * 5000))
    view.flush(force=True)
    rank0 = log_html(view, 1)
    assert "<script>" not in rank0 and "&lt;script&gt;alert(1)&lt;/script&gt; &amp;" in rank0
    assert "\ufffd\ufffd bytes" in rank0
    assert "<span style='color:#cd3131;font-weight:bold'>red bold</span> plain " in rank0
    assert "<span style='color:#008700'>green</span>" in rank0
    assert "\x1b" not in rank0 and "\x1b" not in html(view, "ranks")
    rank1 = log_html(view, 2)
    assert "x" * 1000 in rank1 and "x" * 1001 not in rank1
    assert "4000 more characters" in rank1


def test_badges_follow_state_events_only(view):
    ranks = html(view, "ranks")
    assert "rank 0 · STARTING" in ranks and "rank 1 · STARTING" in ranks
    view.handle({"kind": "started", "rank": 0, "pid": 1, "host": "h", "device": "cpu"})
    view.handle(state(0, RunState.RUNNING))
    view.handle(state(1, RunState.FAILED, "ValueError: boom"))
    view.handle(line(0, "done training"))  # output alone never changes a state
    view.flush(force=True)
    ranks = html(view, "ranks")
    assert "rank 0 · RUNNING" in ranks and "rank 1 · FAILED" in ranks
    assert "ValueError: boom" in ranks
    assert "#fee2e2" in ranks  # FAILED's colour


def test_root_cause_shown_once_with_secondary_failures_folded(view):
    assert view._widgets["panel"].layout.display == "none"
    root = {
        "kind": "diagnosis",
        "title": "rank 1 of 2 failed: rank 1 raised ValueError: boom",
        "body": 'Traceback (most recent call last):\n  File "<cell>", line 3\nValueError: boom',
        "severity": "error",
        "rank": 1,
        "secondary": ["rank 0 raised RuntimeError: Connection reset by peer (a consequence)"],
    }
    view.handle(root)
    view.handle(dict(root))  # the same finding again
    view.handle({**root, "title": "rank 0 of 2 failed: late", "secondary": []})
    view.handle({**root, "title": "rank 1 is slow", "severity": "warning", "secondary": []})
    view.flush(force=True)
    panel = html(view, "panel")
    assert view._widgets["panel"].layout.display != "none"
    assert panel.count("ValueError: boom</div>") == 1  # the title, once
    assert "File &quot;&lt;cell&gt;&quot;, line 3" in panel
    folded = panel[panel.index("<details>") : panel.index("</details>")]
    assert "2 other failures" in folded
    assert "Connection reset by peer" in folded and "rank 0 of 2 failed: late" in folded
    assert "rank 1 is slow" in panel[panel.index("</details>") :]


def test_progress_and_heartbeats_render(view):
    assert view._widgets["progress"].layout.display == "none"
    view.handle(
        {
            "kind": "progress",
            "rank": 0,
            "what": "batch_size",
            "text": "out of memory at batch_size=128, retrying with 64 (attempt 2)",
            "data": {"batch_size": 64, "attempt": 2},
        }
    )
    view.handle(
        {
            "kind": "heartbeat",
            "rank": 1,
            "where": "train.py:3 in train",
            "collective": "all_reduce",
            "wait_s": 3.0,
            "busy_s": 4.0,
            "last_output": time.time(),
            "stack": "",
        }
    )
    view.flush(force=True)
    assert "retrying with 64 (attempt 2)" in html(view, "progress")
    assert view._widgets["progress"].layout.display != "none"
    ranks = html(view, "ranks")
    assert "compute 25% · wait 75% · in all_reduce" in ranks and "width:25%" in ranks


def test_flush_sends_at_most_max_rate_messages_a_second(displayed, monkeypatch):
    sent: list[float] = []
    original = ipywidgets.Widget._send

    def counting_send(self, msg, buffers=None):
        sent.append(time.monotonic())
        return original(self, msg, buffers)

    monkeypatch.setattr(ipywidgets.Widget, "_send", counting_send)
    v = LaunchView(max_lines=50, max_rate=20.0)
    v.handle(run_info(world_size=4))
    start = time.monotonic()
    sent.clear()
    before = v.messages_sent  # the first render, when the view appeared
    i = 0
    while time.monotonic() - start < 1.5:
        for _ in range(200):  # four ranks printing as fast as they can
            v.handle(line(i % 4, f"line {i}"))
            i += 1
        v.flush()
    elapsed = time.monotonic() - start
    assert i > 10_000
    assert v.messages_sent - before == len(sent)  # the view's own count matches what went out
    assert len(sent) / elapsed <= 20 * 1.25 + 6  # max_rate, plus the one render that overdraws
    assert v.renders >= 2  # but it did keep the browser up to date


def test_handle_is_cheap_and_memory_stays_bounded(view):
    start = time.perf_counter()
    for i in range(400_000):
        view.handle(line(i & 1, f"rank {i & 1} line {i} with some typical text"))
    took = time.perf_counter() - start
    assert took < 8.0  # about 1-2 µs a line on a quiet machine
    assert len(view.model.all_lines) == 5 and all(
        len(lines) == 5 for lines in view.model.rank_lines.values()
    )
    assert view.model.lines_received == 400_000
    view.flush(force=True)
    assert "line 399999" in log_html(view, 0)


def test_close_shows_a_static_summary(view, displayed):
    view.handle(state(0, RunState.DONE))
    view.handle(state(1, RunState.FAILED, "ValueError: boom"))
    view.handle(
        {
            "kind": "run_ended",
            "ok": False,
            "elapsed_s": 2.5,
            "ranks": {0: "returned", 1: "ValueError: <boom>"},
        }
    )
    view.close()
    view.close()  # closing twice shows one summary
    assert len(displayed) == 2
    summary = displayed[1]
    text, page = summary["text/plain"], summary["text/html"]
    assert text.splitlines()[0] == "nblaunch: failed in 2.50 s"
    assert "rank 0: DONE · returned" in text and "rank 1: FAILED · ValueError: <boom>" in text
    assert "logs: /tmp/runs/r1" in text
    assert "ValueError: &lt;boom&gt;" in page and "rank1.log" in page and "/tmp/runs/r1" in page
    assert ">DONE<" in page and ">FAILED<" in page
    assert "failed</b> in 2.5 s" in html(view, "head")
    assert view._widgets["stop"].disabled


def test_close_without_a_run_shows_nothing(displayed):
    v = LaunchView()
    v.close()
    assert displayed == []


# --- the Stop button -----------------------------------------------------------------------------


@pytest.fixture
def sigint_calls():
    calls: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGINT, previous)


def test_stop_interrupts_this_process_once_and_only_while_running(view, sigint_calls):
    assert view.request_stop() is True
    assert view.request_stop() is False  # one interrupt per click burst
    deadline = time.monotonic() + 2
    while not sigint_calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sigint_calls == [signal.SIGINT]
    view.stop_requested = False
    view.handle({"kind": "run_ended", "ok": True, "elapsed_s": 1.0, "ranks": {}})
    view.close()
    assert view.request_stop() is False  # a click after the run must not interrupt the kernel


class _KernelComm:
    """Stands in for ipykernel 7's comm: asked on the shell-channel thread where to route."""

    def __init__(self) -> None:
        self.routed: list = []

    def _reply_subshell_for(self, data, default):
        self.routed.append(data)
        return default


def test_stop_click_is_seen_on_the_shell_channel_thread(view, sigint_calls):
    button = type("Button", (), {"comm": _KernelComm()})()
    assert view._hook_stop(button) is True
    route = button.comm._reply_subshell_for
    # ipykernel calls this on its shell-channel thread while the main thread runs the launcher.
    worker = threading.Thread(target=route, args=({"method": "update", "state": {}}, None))
    worker.start()
    worker.join()
    assert not view.stop_requested  # only a click stops
    click = {"method": "custom", "content": {"event": "click"}}
    worker = threading.Thread(target=route, args=(click, "sub"))
    worker.start()
    worker.join()
    assert view.stop_requested
    assert len(button.comm.routed) == 2  # routing itself is left to the kernel
    deadline = time.monotonic() + 2
    while not sigint_calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sigint_calls == [signal.SIGINT]


def test_without_the_kernel_hook_the_button_says_so(view):
    assert view._hook_stop(object()) is False
    assert view.stop_hooked is False  # outside a kernel there is no shell-channel thread
    assert "interrupt" in view._widgets["stop"].tooltip


def test_visible_lines_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("NBLAUNCH_VIEW_LINES", "7")
    assert LaunchView().max_lines == 7
    assert LaunchView(max_lines=3).max_lines == 3
    with pytest.raises(ValueError, match="must be positive"):
        LaunchView(max_rate=0)
    monkeypatch.setenv("NBLAUNCH_VIEW_LINES", "lots")  # named, never taken silently
    with pytest.raises(LaunchError, match="NBLAUNCH_VIEW_LINES='lots'"):
        LaunchView()


def test_an_interrupted_run_reads_stopped_and_logs_show_their_level(view, displayed):
    view.handle(
        {
            "kind": "log",
            "rank": 1,
            "level": "WARNING",
            "name": "train",
            "message": "loss is nan",
            "in_order": False,
            "seq": 0,
            "time": time.time(),
        }
    )
    view.handle(state(0, RunState.STOPPED, "interrupted"))
    view.handle(state(1, RunState.STOPPED, "interrupted"))
    view.handle({"kind": "run_ended", "ok": False, "elapsed_s": 3.0, "ranks": {}})
    view.close()
    assert "<span class='nbl-err'>WARNING train: loss is nan</span>" in log_html(view, 2)
    assert "stopped</b> in 3.0 s" in html(view, "head")
    assert displayed[-1]["text/plain"].startswith("nblaunch: stopped in 3.00 s")


def test_text_view_prints_rank_prefixed_lines():
    import io

    out, err = io.StringIO(), io.StringIO()
    v = TextView(out, err)
    v.handle(run_info())
    v.handle(line(1, "hello"))
    v.handle(
        {
            "kind": "log",
            "rank": 0,
            "level": "INFO",
            "name": "train",
            "message": "step 3",
            "in_order": False,
            "seq": 0,
            "time": time.time(),
        }
    )
    v.close()
    assert "nblaunch: 2 rank(s) on CPU (forkserver, debug on)" in out.getvalue()
    assert "[rank 1] hello\n" in out.getvalue() and "[rank 0] INFO step 3\n" in err.getvalue()


# --- the static summary keeps the story ----------------------------------------------------------


def test_the_summary_keeps_each_ranks_last_lines_and_the_error(view, displayed):
    for i in range(30):
        view.handle(line(0, f"{{'loss': {i / 10}}}"))
    view.handle(line(1, "\x1b[31mred\x1b[0m <b>", fd=2))
    view.handle({"kind": "result", "rank": 0, "value_bytes": __import__("pickle").dumps(64.0)})
    view.handle(state(0, RunState.DONE))
    view.handle(state(1, RunState.FAILED, "ValueError: boom"))
    view.handle(rank1_failed())
    view.handle(
        {"kind": "run_ended", "ok": False, "elapsed_s": 1.0, "ranks": {0: "returned", 1: "x"}}
    )
    view.close()
    text, page = displayed[-1]["text/plain"], displayed[-1]["text/html"]
    assert "rank 0: DONE · returned 64.0" in text
    assert "error: rank 1 of 2 failed: rank 1 raised ValueError: boom" in text
    # The view keeps 5 lines here (max_lines=5): the summary shows those, and counts the rest.
    assert "--- rank 0, last 5 lines\n  … 25 earlier lines in /tmp/runs/r1/rank0.log" in text
    assert "{'loss': 2.9}" in text and "{'loss': 2.5}" in text and "{'loss': 2.4}" not in text
    assert "  red <b>" in text  # escapes dropped in plain text
    assert (
        "{&#x27;loss&#x27;: 2.9}" in page and "25 earlier lines in /tmp/runs/r1/rank0.log" in page
    )
    assert "<span style='color:#cd3131'>red</span> &lt;b&gt;" in page
    assert "rank 1 raised ValueError: boom" in page


def test_the_summary_is_bounded_however_many_ranks_print(displayed, monkeypatch):
    monkeypatch.setattr(summary, "SUMMARY_TOTAL_LINES", 30)
    v = LaunchView(max_lines=100)
    v.handle(run_info(world_size=4))
    for i in range(400):
        v.handle(line(i % 4, f"rank {i % 4} line {i} " + "x" * 400))
    v.handle({"kind": "result", "rank": 0, "value_bytes": b"x" * 10_000})  # too big to show
    v.handle({"kind": "run_ended", "ok": True, "elapsed_s": 1.0, "ranks": {0: "returned"}})
    text = v.summary_bundle()["text/plain"]
    shown = [t for t in text.splitlines() if " line " in t and "earlier" not in t]
    assert len(shown) == 28  # 7 per rank: 30 lines shared by 4 ranks
    assert all(len(t) < 320 for t in shown)  # long lines are cut
    assert "… 93 earlier lines" in text and "rank 0: STARTING · returned\n" in text


def test_the_root_cause_that_comes_after_the_end_reaches_the_panel_and_summary(monkeypatch):
    calls: list = []
    monkeypatch.setattr(widget, "_display", lambda obj, **kw: calls.append((obj, kw)))
    v = LaunchView()
    v.handle(run_info())
    v.handle(state(1, RunState.FAILED, "ValueError: boom"))
    v.handle({"kind": "run_ended", "ok": False, "elapsed_s": 1.0, "ranks": {1: "ValueError"}})
    v.close()
    # The launcher names the root cause once every rank is stopped and the view is closed.
    v.handle(rank1_failed())
    assert "rank 1 raised ValueError: boom" in html(v, "panel")
    assert v._widgets["panel"].layout.display != "none"
    _, (summary, first), (updated, second) = calls
    assert "error:" not in summary["text/plain"] and "update" not in first
    assert second == {**first, "update": True} and first["display_id"]
    assert "error: rank 1 of 2 failed: rank 1 raised ValueError: boom" in updated["text/plain"]


def test_tqdm_bars_become_progress_bars_per_rank_and_for_all_ranks():
    view = LaunchView()
    view.handle(
        {
            "kind": "run_info",
            "world_size": 2,
            "device_kind": "CPU",
            "start_method": "forkserver",
            "debug": False,
            "run_dir": "",
            "warnings": [],
            "notes": [],
            "started_at": time.time(),
        }
    )
    for rank, done in ((0, 42), (1, 10)):
        view.handle(
            {
                "kind": "stream",
                "rank": rank,
                "fd": 2,
                "carriage": True,
                "text": f"train: {done}%|████      | {done}/100 [00:01<00:02, 30.12it/s]",
            }
        )
    html = render.ranks_html(view.model)
    assert "width:42%" in html and "42/100 · 30.12it/s · ETA 00:02" in html
    assert "all ranks" in html and html.index("all ranks") < html.index("rank 0 ·")
    assert html.count("nbl-pbar'") == 3  # rank 0, rank 1, and all ranks (the slowest: 10%)
    assert "10% · 10/100" in html.split("rank 0 ·")[0]
