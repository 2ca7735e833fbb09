"""The relay on real pipes, without rank processes: line splitting, progress lines, log files."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from nblaunch.engine.output.lines import MAX_LINE_BYTES
from nblaunch.engine.output.relay import Relay
from nblaunch.engine.processes.supervisor import RankProcess
from nblaunch.notebook.views import RecordingView


class Recorder(RecordingView):
    def lines(self, rank: int | None = None) -> list[tuple[str, bool]]:
        return [
            (e["text"], e["carriage"])
            for e in self.events
            if e["kind"] == "stream" and (rank is None or e["rank"] == rank)
        ]


@pytest.fixture
def pipes(tmp_path):
    """Two fake ranks: the relay reads their pipes; the test writes into them."""
    context = multiprocessing.get_context("fork")
    ranks, writers = [], {}
    for rank in (0, 1):
        conn, child_conn = context.Pipe(duplex=True)
        stdout_r, stdout_w = context.Pipe(duplex=False)
        stderr_r, stderr_w = context.Pipe(duplex=False)
        ranks.append(RankProcess(rank, None, conn, stdout_r, stderr_r))
        writers[rank] = (stdout_w, stderr_w, child_conn)
    recorder = Recorder()
    relay = Relay(ranks, recorder, tmp_path)
    yield relay, recorder, writers, tmp_path
    relay.close()
    for rank in ranks:
        for end in (rank.conn, rank.stdout_r, rank.stderr_r):
            end.close()
    for ends in writers.values():
        for end in ends:
            end.close()


def write(writers, rank: int, data: bytes, fd: int = 1) -> None:
    os.write(writers[rank][fd - 1].fileno(), data)


def pump(relay, times: int = 3) -> None:
    for _ in range(times):
        relay.poll(0.05)


def test_lines_are_split_per_rank_even_when_chunks_interleave(pipes):
    relay, recorder, writers, _ = pipes
    write(writers, 0, b"rank 0 first half ")
    write(writers, 1, b"rank 1 whole line\nrank 1 start ")
    pump(relay)
    write(writers, 0, b"and second half\n")
    write(writers, 1, b"and end\n")
    pump(relay)
    assert recorder.lines(0) == [("rank 0 first half and second half", False)]
    assert recorder.lines(1) == [("rank 1 whole line", False), ("rank 1 start and end", False)]


def test_carriage_returns_update_one_line_and_crlf_is_a_plain_end(pipes):
    relay, recorder, writers, _ = pipes
    write(writers, 0, b"10%\r50%\r")  # the last \r may be half of \r\n: 50% is shown, held
    pump(relay)
    assert recorder.lines(0) == [("10%", True), ("50%", True)]
    write(writers, 0, b"\ndone\r\n")
    pump(relay)
    assert recorder.lines(0) == [("10%", True), ("50%", True), ("50%", False), ("done", False)]


def test_stderr_is_tagged_and_invalid_utf8_is_replaced(pipes):
    relay, recorder, writers, _ = pipes
    write(writers, 1, b"bad \xff\xfe bytes\n", fd=2)
    pump(relay)
    (event,) = [e for e in recorder.events if e["kind"] == "stream"]
    assert (event["rank"], event["fd"]) == (1, 2)
    assert event["text"] == "bad \ufffd\ufffd bytes"


def test_a_very_long_line_arrives_in_bounded_pieces(pipes):
    relay, recorder, writers, _ = pipes
    size = 3 * MAX_LINE_BYTES + 10
    stdout_w = writers[0][0]
    stdout_w_fd = os.dup(stdout_w.fileno())
    stdout_w.close()  # so the relay sees the end of the stream after the long line

    def write_long_line() -> None:  # more than a pipe holds: written while the relay reads
        with os.fdopen(stdout_w_fd, "wb") as out:
            out.write(b"x" * size)

    writer = threading.Thread(target=write_long_line)
    writer.start()
    deadline = time.monotonic() + 10
    while (writer.is_alive() or len(recorder.lines(0)) < 3) and time.monotonic() < deadline:
        relay.poll(0.05)
    relay.drain_output(timeout=0.2)  # ends the unfinished last piece
    writer.join(10)
    pieces = [text for text, _ in recorder.lines(0)]
    assert "".join(pieces) == "x" * size
    assert max(len(p) for p in pieces) <= MAX_LINE_BYTES


def test_every_byte_goes_to_the_rank_log_file(pipes):
    relay, _, writers, tmp_path = pipes
    write(writers, 0, b"progress 1\rprogress 2\rfinal\n")
    write(writers, 0, b"to stderr\n", fd=2)
    pump(relay)
    relay.drain_output(timeout=0.2)
    log = (tmp_path / "rank0.log").read_bytes()
    assert b"progress 1\rprogress 2\rfinal\n" in log and b"to stderr\n" in log
    assert (tmp_path / "rank1.log").read_bytes() == b""


def test_events_from_ranks_are_returned_and_shown(pipes):
    relay, recorder, writers, _ = pipes
    writers[1][2].send({"kind": "result", "rank": 1, "value_bytes": b"x"})
    received = []
    for _ in range(5):
        received += relay.poll(0.05)
    assert received == [{"kind": "result", "rank": 1, "value_bytes": b"x"}]
    assert received[0] in recorder.events


# --- progress lines end where the next output begins --------------------------------------------


def test_a_bar_is_shown_as_it_stands_and_its_last_state_ends_at_its_newline(pipes):
    relay, recorder, writers, _ = pipes
    write(writers, 0, b"\r  0%| 0/6", fd=2)  # tqdm draws: "\r" first, no line end
    pump(relay)
    assert recorder.lines(0) == [("", True), ("  0%| 0/6", True)]  # shown before it is redrawn
    write(writers, 0, b"\r100%| 6/6", fd=2)
    pump(relay)
    write(writers, 0, b"\n", fd=2)  # tqdm's close
    pump(relay)
    assert recorder.lines(0)[2:] == [("100%| 6/6", True), ("100%| 6/6", False)]


def test_output_on_the_other_stream_ends_the_bar_and_the_log_breaks_the_line(pipes):
    relay, recorder, writers, tmp_path = pipes
    write(writers, 0, b"\r  0%| 0/4", fd=2)
    pump(relay)
    write(writers, 0, b"[transformers] next\n")
    pump(relay)
    write(writers, 0, b"\r 50%| 2/4", fd=2)
    pump(relay)
    assert recorder.lines(0) == [
        ("", True),
        ("  0%| 0/4", True),
        ("  0%| 0/4", False),  # the bar's last state, ended where stdout's line begins
        ("[transformers] next", False),
        ("", True),
        (" 50%| 2/4", True),  # the bar goes on below the line
    ]
    relay.drain_output(timeout=0.2)
    log = (tmp_path / "rank0.log").read_bytes()
    assert b"\r  0%| 0/4\n[transformers] next\n\r 50%| 2/4" in log


def log_record(message: str) -> dict:
    """An INFO record of rank 1, as its event channel carries it."""
    return {
        "kind": "log",
        "rank": 1,
        "level": "INFO",
        "name": "train",
        "message": message,
        "in_order": False,
        "seq": 0,
        "time": time.time(),
    }


def test_a_log_record_ends_the_bar(pipes):
    relay, recorder, writers, tmp_path = pipes
    write(writers, 1, b"\rstep 3/9", fd=2)
    pump(relay)
    writers[1][2].send(log_record("saved"))
    pump(relay)
    assert recorder.lines(1)[-1] == ("step 3/9", False)
    relay.drain_output(timeout=0.2)
    assert b"\rstep 3/9\nINFO:train: saved\n" in (tmp_path / "rank1.log").read_bytes()


def test_a_bars_own_newline_read_after_the_log_record_adds_no_blank_line(pipes):
    relay, recorder, writers, _ = pipes
    write(writers, 1, b"\revaluating 100%", fd=1)
    pump(relay)
    writers[1][2].send(log_record("done"))  # print() then log.info(): read first here
    pump(relay)
    write(writers, 1, b"\nnext\n", fd=1)
    pump(relay)
    finished = [text for text, carriage in recorder.lines(1) if not carriage]
    assert finished == ["evaluating 100%", "next"], finished  # no blank line between


def test_text_after_a_drawn_bar_on_the_same_stream_is_a_line_of_its_own(pipes):
    relay, recorder, writers, tmp_path = pipes
    write(writers, 0, b"\r  0%| 0/6", fd=2)
    pump(relay)
    time.sleep(0.1)  # the Trainer's logger writes to stderr some time after the bar was drawn
    write(writers, 0, b"[transformers] warning\n", fd=2)
    pump(relay)
    assert recorder.lines(0)[-2:] == [("  0%| 0/6", False), ("[transformers] warning", False)]
    relay.drain_output(timeout=0.2)
    assert b"\r  0%| 0/6\n[transformers] warning\n" in (tmp_path / "rank0.log").read_bytes()


def test_a_warning_right_after_a_whole_tqdm_state_is_a_line_of_its_own(pipes):
    # Issue 44 (4): DDP's C++ warning came on the bar's stderr within 20 ms of tqdm's first
    # draw; it was glued to the bar, and the text view showed "0/30" twice.
    relay, recorder, writers, _ = pipes
    write(writers, 0, b"\r  0%|          | 0/30 [00:00<?, ?it/s]", fd=2)
    write(writers, 0, b"[W1204 18:18:04.929622867 reducer.cpp:1529] Warning: x\n", fd=2)
    relay.poll(0.05)  # whether the relay reads in between or not
    pump(relay)
    finished = [text for text, carriage in recorder.lines(0) if not carriage]
    assert finished == [
        "  0%|          | 0/30 [00:00<?, ?it/s]",
        "[W1204 18:18:04.929622867 reducer.cpp:1529] Warning: x",
    ]


def test_the_rest_of_the_same_write_continues_the_bar(pipes):
    relay, recorder, writers, _ = pipes
    write(writers, 0, b"\rdone")  # print("\rdone", 10): two writes, microseconds apart
    write(writers, 0, b" 10\n")
    relay.poll(0.05)  # whether the relay reads in between or not
    pump(relay)
    assert recorder.lines(0)[-1] == ("done 10", False)
    assert ("done", False) not in recorder.lines(0)


def test_a_cleared_bar_ends_blank_and_tqdm_write_lands_above_the_bar(pipes):
    relay, recorder, writers, _ = pipes
    write(writers, 0, b"\r 33%| 2/6", fd=2)
    pump(relay)
    # tqdm.write, read in one go: clear the bar, print the line, draw the bar again. The two
    # pipes were ready together; the bar's own redraw must come after the line, not before.
    write(writers, 0, b"\r          \r", fd=2)
    write(writers, 0, b"{'loss': 0.5}\n")
    write(writers, 0, b"\r 33%| 2/6\r100%| 6/6\n", fd=2)
    pump(relay)
    after = recorder.lines(0)[2:]
    assert after.index(("          ", False)) < after.index(("{'loss': 0.5}", False))
    assert after.index(("{'loss': 0.5}", False)) < after.index(("100%| 6/6", False))
    assert [t for t, carriage in after if not carriage] == [
        "          ",
        "{'loss': 0.5}",
        "100%| 6/6",
    ]
