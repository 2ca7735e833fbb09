"""The relay on real pipes, without rank processes: line splitting, progress lines, log files."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from nblaunch.relay import MAX_LINE_BYTES, Relay
from nblaunch.supervisor import RankProcess
from nblaunch.widgets import RecordingView


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
    write(writers, 0, b"10%\r50%\r")  # the last \r may be half of \r\n: held back
    pump(relay)
    assert recorder.lines(0) == [("10%", True)]
    write(writers, 0, b"\ndone\r\n")
    pump(relay)
    assert recorder.lines(0) == [("10%", True), ("50%", False), ("done", False)]


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
