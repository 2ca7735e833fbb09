"""The forkserver imports what ranks would import each time (torch._dynamo) while it is idle,
never while a fork request waits. The selector in this process, and the suite's forkserver."""

from __future__ import annotations

import selectors
import socket
import sys
import threading
import time

import pytest
from conftest import wait_until

import nblaunch
from nblaunch.engine.processes import forkserver_idle


@pytest.fixture
def pieces(tmp_path, monkeypatch):
    """Two modules of this test's own that note when they were imported, and one that fails;
    ``selectors.DefaultSelector`` put back afterwards."""
    for name, body in (
        ("idle_piece_a", "import time\nAT = time.monotonic()\n"),
        ("idle_piece_b", "import time\nAT = time.monotonic()\n"),
        ("idle_piece_broken", "raise RuntimeError('a piece that fails')\n"),
    ):
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(selectors, "DefaultSelector", selectors.DefaultSelector)
    yield ("idle_piece_a", "idle_piece_broken", "idle_piece_b")
    for name in ("idle_piece_a", "idle_piece_b"):
        sys.modules.pop(name, None)


def test_a_waiting_request_is_served_before_any_import(pieces):
    forkserver_idle.install(pieces, quiet_s=0.2)
    listener, client = socket.socketpair()
    with listener, client, selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        client.send(b"fork")
        assert [key.fileobj for key, _ in selector.select()] == [listener]
        assert "idle_piece_a" not in sys.modules


def test_idle_waits_import_one_piece_each_and_a_failing_one_is_passed_over(pieces):
    original = selectors.DefaultSelector
    forkserver_idle.install(pieces, quiet_s=0.2)
    listener, client = socket.socketpair()
    began = time.monotonic()
    threading.Timer(1.5, client.send, (b"fork",)).start()
    with listener, client, selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        assert [key.fileobj for key, _ in selector.select()] == [listener]
    first, last = sys.modules["idle_piece_a"].AT, sys.modules["idle_piece_b"].AT
    assert 0.2 <= first - began < 1.0  # after one quiet wait
    assert last - first >= 0.4  # two more waits: the broken piece's, then its own
    assert selectors.DefaultSelector is original  # what is forked from now on sees torch's own


def test_imported_outside_the_forkserver_it_changes_nothing():
    assert selectors.DefaultSelector.__name__ != "IdleImportingSelector"
    assert not forkserver_idle._imported_by_forkserver()


def test_ranks_forked_after_the_forkserver_was_idle_have_torch_dynamo():
    def has_dynamo():
        import sys

        return "torch._dynamo" in sys.modules

    nblaunch.notebook_launcher(has_dynamo, (), 2, device_type="cpu", display="none")
    assert wait_until(
        lambda: (
            nblaunch.notebook_launcher(has_dynamo, (), 2, device_type="cpu", display="none")
            == [True, True]
        ),
        timeout=30,
        interval=1.0,  # a quiet second for the forkserver between launches
    )
