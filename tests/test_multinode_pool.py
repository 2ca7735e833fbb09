"""A pool across two "nodes" on one machine (127.0.0.2 hosts, the joiner is a real
``python -m nblaunch join`` process): state across cells, failures and interrupts on the other
node, restarts the node joins by itself, a lost node, and the magics in a real kernel.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import cloudpickle
import pytest
from conftest import Kernel
from test_multinode import TwoNodes

from nblaunch.errors import RankFailedError
from nblaunch.events import Lifecycle
from nblaunch.notebook.pool import current_pool
from nblaunch.ranks.namespace import rank_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.slow


@pytest.fixture
def nodes(tmp_path):
    two = TwoNodes(tmp_path)
    yield two
    pool = current_pool()
    if pool is not None:
        pool.close()
    for joiner in two.joiners:
        joiner.close()


def _remember() -> float:
    import torch
    import torch.distributed as dist

    import nblaunch.ranks.namespace

    rank = dist.get_rank()
    nblaunch.ranks.namespace.rank_namespace()["x"] = rank + 1
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return total.item()


def _recall() -> tuple[int | None, int]:
    return rank_namespace().get("x"), os.getpid()


def _fail_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return 0


def _sleep() -> None:
    time.sleep(60)


def _interrupt_in(seconds: float) -> threading.Timer:
    """The notebook's interrupt button, ``seconds`` from now."""
    timer = threading.Timer(seconds, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_a_pool_on_two_nodes_keeps_state_and_survives_failures_interrupts_restarts(nodes):
    joiner = nodes.start_joiner()  # before the pool: it waits for the pinned run id
    pool = nodes.start_pool()
    assert pool.world_size == 2 and "on 2 nodes" in pool.describe()
    assert pool.run(_remember) == [3.0, 3.0]  # a collective across the nodes
    first = pool.run(_recall)
    assert [x for x, _ in first] == [1, 2]  # each rank kept its name from the last task
    remote_pid = first[1][1]
    assert remote_pid in {p.pid for p in joiner.descendants()}

    rows = pool.status()
    assert [(r["rank"], r["node"], r["alive"]) for r in rows] == [(0, 0, True), (1, 1, True)]
    assert rows[1]["pid"] == remote_pid and rows[1]["names"] == ["x"]
    assert "rank 1 on node 1" in pool.status_text()

    with pytest.raises(ValueError, match="boom on rank 1"):  # the other node's own exception
        pool.run(_fail_on_rank_1)
    assert pool.state is Lifecycle.IDLE
    assert pool.run(_recall) == first  # same processes, same names
    # Tasks of the notebook's node alone end before the other node reads them and their keys
    # go; the next task with its rank must still reach it (it waited for the first key, and
    # the pull hung; pytest-timeout bounds it).
    for _ in range(3):
        assert pool.pull("x", rank=0) == 1
    began = time.monotonic()
    assert pool.pull("x", rank=1) == 2
    assert time.monotonic() - began < 5

    began = time.monotonic()
    _interrupt_in(1.0)
    with pytest.raises(KeyboardInterrupt):
        pool.run(_sleep)  # both ranks sleep; the remote one is interrupted through the store
    assert time.monotonic() - began < 10
    assert pool.state is Lifecycle.IDLE
    assert pool.run(_recall) == first

    pool.restart()  # the joined node joins the new start by itself
    again = pool.run(_recall)
    assert [x for x, _ in again] == [None, None]  # fresh ranks
    assert again[1][1] != remote_pid
    assert pool.run(_remember) == [3.0, 3.0]

    pool.close()
    assert joiner.wait(20) == 0, joiner.output()  # a closed pool ends the join command
    assert joiner.output().count("joining run") == 2


def test_a_lost_node_fails_the_cell_at_once_and_the_pool_restarts_without_it(nodes):
    joiner = nodes.start_joiner()
    pool = nodes.start_pool()
    threading.Timer(1.0, joiner.process.terminate).start()  # the node's job is cancelled
    began = time.monotonic()
    with pytest.raises(
        RankFailedError, match=r"node 1 \(.*\), rank 1, stopped its ranks on its own"
    ) as failure:
        pool.run(_sleep)
    assert time.monotonic() - began < 15
    assert pool.state is Lifecycle.BROKEN
    assert "The pool lost node 1" in "\n".join(getattr(failure.value, "__notes__", []))
    assert joiner.wait(10) != 0

    pool.restart(num_nodes=1)  # carry on with the node that remains
    assert pool.world_size == 1
    assert pool.run(_remember) == [1.0]


def test_the_magics_start_a_pool_across_nodes(nodes, tmp_path):
    joiner = nodes.start_joiner()
    kernel = Kernel(tmp_path)
    try:
        assert kernel.run("%load_ext nblaunch")["error"] is None
        started = kernel.run(
            f"%dist start -n 1 --nodes 2 --rdzv-endpoint {nodes.endpoint} --run-id "
            f"{nodes.run_id} --device-type cpu",
            timeout=120,
        )
        assert started["error"] is None, started
        assert "2 rank(s) on 2 nodes ready" in started["out"]
        assert f"nblaunch join {nodes.endpoint} --run-id {nodes.run_id}" in started["out"]
        cell = kernel.run("%%distributed\nimport os\nx = rank * 10\nprint('pid', os.getpid())")
        assert cell["error"] is None, cell
        cell = kernel.run("%%distributed --ranks 1\nx + 1")
        assert cell["result"] == "11", cell
        status = kernel.run("%dist status")["out"]
        assert "on 2 nodes" in status and "rank 1 on node 1" in status, status
        assert kernel.run("%dist stop")["error"] is None
        assert joiner.wait(20) == 0, joiner.output()
    finally:
        kernel.close()
