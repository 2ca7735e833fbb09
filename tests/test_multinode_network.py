"""Multi-node runs on a real network: hosts are network namespaces joined by veth pairs.

Host 0 runs the notebook's side (``tests/netns_notebook.py``, printing what its view shows with
the time), host 1 (and 2) a ``python -m nblaunch join``. Each namespace has only loopback and its
veth, and the hostname resolves to loopback, as on a fresh Debian or Ubuntu machine. Faults are
made for real: a link taken down, a process SIGKILLed. Each test asserts the message on each side,
how long after the fault it came, and that no process is left on any host. Needs root and
``ip``; skipped otherwise, with the reason.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until
from netns import Network, Side, alive, skip_reason

pytestmark = [pytest.mark.slow]

HERE = Path(__file__).parent
PORT = 29400
_reason = skip_reason() if sys.platform == "linux" else "network namespaces are Linux only"
if _reason:
    pytestmark.append(pytest.mark.skip(reason=_reason))


class Hosts:
    """A notebook on host 0 and joins on the others, on a private network."""

    def __init__(self, tmp_path: Path, count: int = 2) -> None:
        self.tmp_path = tmp_path
        self.net = Network(count)
        self.endpoint = f"{self.net.addresses[0]}:{PORT}"
        self.run_id = f"net{os.getpid()}"
        self.sides: list[Side] = []

    def notebook(self, function: str, num_nodes: int = 2, rdzv_timeout: float = 60) -> Side:
        run_dir = self.tmp_path / "runs" / self.run_id
        argv = [sys.executable, str(HERE / "netns_notebook.py"), self.endpoint, self.run_id]
        argv += [str(run_dir), function, str(num_nodes), str(rdzv_timeout)]
        return self._start(0, argv, "notebook.log")

    def join(self, host: int = 1) -> Side:
        argv = [sys.executable, "-m", "nblaunch", "join", self.endpoint, "--run-id", self.run_id]
        return self._start(host, argv, f"join{host}.log")

    def _start(self, host: int, argv: list[str], log: str) -> Side:
        side = Side(self.net.command(host, *argv), self.tmp_path / log)
        self.sides.append(side)
        return side

    def close(self) -> None:
        for side in self.sides:
            if side.process.poll() is None or side.tree():
                side.kill()
        self.net.close()


@pytest.fixture
def hosts(tmp_path):
    made = Hosts(tmp_path)
    yield made
    made.close()


def training(notebook: Side, timeout: float = 90) -> None:
    """Wait until rank 0 trains (a few DDP steps across the hosts went through)."""
    assert wait_until(lambda: notebook.first(lambda r: r.get("line") == "training"), timeout), (
        notebook.output()
    )


def ending(notebook: Side, timeout: float) -> dict:
    assert wait_until(lambda: notebook.first(lambda r: "end" in r), timeout), notebook.output()
    record = notebook.first(lambda r: "end" in r)
    assert record is not None
    return record


def test_three_hosts_train_through_a_link_drop_and_each_uses_the_interface_to_the_endpoint(
    tmp_path,
):
    """The hostname resolves to loopback on every host: left alone, gloo advertises 127.0.0.1
    and another host's rank cannot connect. One run also proves that a link down for two
    seconds mid-training is not a failure (the node silence bound is 8 s)."""
    three = Hosts(tmp_path, count=3)
    try:
        notebook = three.notebook("short_ddp", num_nodes=3)
        joins = [three.join(1), three.join(2)]
        training(notebook)
        three.net.link(1, up=False)
        time.sleep(2.0)
        three.net.link(1, up=True)
        end = ending(notebook, 120)
        assert end == {"t": end["t"], "end": "returned", "results": [0, 1, 2]}, notebook.output()
        header = notebook.first(lambda r: r.get("kind") == "run_info")
        assert header is not None
        bridge, address = three.net.links[0], three.net.addresses[0]
        assert f"network: gloo and NCCL use {bridge} ({address})" in str(header)
        for host, join in enumerate(joins, start=1):
            assert join.wait(15) == 0, join.output()
            link, address = three.net.links[host], three.net.addresses[host]
            assert f"network: gloo and NCCL use {link} ({address})" in join.output()
            assert f" at {address} joined" in notebook.output()  # named by its address
    finally:
        three.close()


def test_a_partitioned_node_is_named_on_both_sides_and_stops_its_own_ranks(hosts):
    notebook = hosts.notebook("ddp")
    join = hosts.join()
    training(notebook)
    pids = notebook.tree() | join.tree()
    assert len(pids) >= 4  # two sides, a rank each
    fault = time.time()
    hosts.net.link(1, up=False)
    end = ending(notebook, 30)
    assert end["type"] == "RankFailedError"
    address = hosts.net.addresses[1]
    assert f" at {address}), rank 1, sent nothing for" in end["message"]
    assert "cannot be told and stops its own ranks by itself" in end["message"]
    assert "stopped on every node" not in end["message"]
    assert end["t"] - fault < 10, end
    assert join.wait(30) == 1, join.output()
    lost = join.line_with(f"lost the notebook at {hosts.endpoint}")
    assert lost is not None, join.output()
    assert join.ended_at is not None and join.ended_at - fault < 15, join.output()
    assert notebook.wait(15) is not None
    assert wait_until(lambda: not alive(pids), 10), alive(pids)


def test_when_the_notebook_fails_after_the_start_every_join_says_why_at_once(hosts):
    notebook = hosts.notebook("fail_on_rank_0")
    join = hosts.join()
    end = ending(notebook, 120)
    assert end["type"] == "ValueError", notebook.output()
    assert join.wait(10) == 1, join.output()
    said = join.line_with("stopped by the notebook: rank 0")
    assert said is not None and "boom on the notebook's rank" in said[1], join.output()
    assert join.ended_at is not None and join.ended_at - end["t"] < 5


def test_when_the_notebook_fails_before_the_start_every_join_says_why_at_once(hosts):
    notebook = hosts.notebook("short_ddp", num_nodes=3)  # only one join comes
    join = hosts.join()
    joined = lambda r: r.get("kind") == "diagnosis" and r["title"].endswith(" joined")  # noqa: E731
    assert wait_until(lambda: notebook.first(joined), 60), notebook.output()
    notebook.process.send_signal(signal.SIGINT)  # the notebook's interrupt button
    end = ending(notebook, 30)
    assert end["type"] == "KeyboardInterrupt", notebook.output()
    assert join.wait(10) == 1, join.output()
    said = join.line_with("the notebook stopped run")
    assert said is not None and "before it started: interrupted in the notebook" in said[1], (
        join.output()
    )
    assert join.ended_at is not None and join.ended_at - end["t"] < 5


def test_a_killed_notebook_ends_every_join_and_its_ranks(hosts):
    notebook = hosts.notebook("ddp")
    join = hosts.join()
    training(notebook)
    pids = notebook.tree() | join.tree()
    fault = time.time()
    os.kill(notebook.process.pid, signal.SIGKILL)  # the kernel; its ranks follow (containment)
    assert join.wait(20) == 1, join.output()
    assert join.line_with(f"lost the notebook at {hosts.endpoint}"), join.output()
    assert join.ended_at is not None and join.ended_at - fault < 15
    assert wait_until(lambda: not alive(pids), 10), alive(pids)


def test_a_killed_join_ends_its_ranks_and_the_notebook_says_so(hosts):
    notebook = hosts.notebook("ddp")
    join = hosts.join()
    training(notebook)
    ranks = join.tree() - {join.process.pid}
    assert ranks
    fault = time.time()
    os.kill(join.process.pid, signal.SIGKILL)
    assert wait_until(lambda: not alive(ranks), 10), alive(ranks)  # containment
    end = ending(notebook, 30)
    assert end["end"] == "raised", notebook.output()
    assert "rank 1" in end["message"] or "node 1" in end["message"], end
    assert end["t"] - fault < 5, (end["t"] - fault, notebook.output())
    assert notebook.wait(15) is not None


def test_a_pool_that_loses_a_node_over_the_network_fails_the_cell_and_goes_on_without_it(hosts):
    notebook = hosts.notebook("pool")
    join = hosts.join()
    assert wait_until(lambda: notebook.first(lambda r: r.get("end") == "cell returned"), 90), (
        notebook.output()
    )
    pids = join.tree()
    fault = time.time()
    hosts.net.link(1, up=False)
    assert wait_until(lambda: notebook.first(lambda r: r.get("end") == "cell raised"), 30), (
        notebook.output()
    )
    failed = notebook.first(lambda r: r.get("end") == "cell raised")
    assert failed is not None and failed["type"] == "RankFailedError", failed
    assert "node 1 (" in failed["message"] and f" at {hosts.net.addresses[1]})" in failed["message"]
    assert failed["t"] - fault < 10, failed
    assert join.wait(30) == 1, join.output()
    assert join.ended_at is not None and join.ended_at - fault < 15, join.output()
    assert join.line_with(f"lost the notebook at {hosts.endpoint}"), join.output()
    assert wait_until(lambda: not alive(pids), 10), alive(pids)
    assert wait_until(lambda: notebook.first(lambda r: r.get("end") == "restarted"), 60), (
        notebook.output()
    )
    restarted = notebook.first(lambda r: r.get("end") == "restarted")
    assert restarted is not None and restarted["world_size"] == 1 and restarted["result"] == [0]
    assert notebook.wait(30) == 0, notebook.output()
