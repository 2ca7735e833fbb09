"""The notebook's side of a multi-node test on a real network, run inside a namespace.

``python tests/netns_notebook.py ENDPOINT RUN_ID RUN_DIR FUNCTION [NUM_NODES [RDZV_TIMEOUT]]``
runs ``FUNCTION`` (a name below) as ``notebook_launcher`` would, one CPU rank per node, and
prints one JSON line per thing seen, each with the wall-clock time ``t`` (one clock for every
namespace on the machine): the view's news (``run_info``, ``diagnosis``, ``state``) and at the
end ``{"end": "returned" | "raised", ...}``. ``FUNCTION=pool`` starts a pool instead and runs
``ddp`` cells in it, printing each cell's end, until the pool loses a node; it then restarts on
the nodes that remain and runs one more cell.
"""

from __future__ import annotations

import json
import sys
import time

import cloudpickle

from nblaunch.cluster.run import launch_multinode
from nblaunch.options import LaunchOptions, NodeOptions

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def say(**fields) -> None:
    print(json.dumps({"t": time.time(), **fields}, default=str), flush=True)


class PrintingView:
    """A view that prints what a person would see, with when."""

    def handle(self, event) -> None:
        kind = event["kind"]
        if kind == "run_info":
            say(kind=kind, notes=event.get("notes", []))
        elif kind == "diagnosis":
            say(kind=kind, title=event["title"], body=event["body"])
        elif kind == "state":
            say(kind=kind, rank=event.get("rank"), state=event.get("state"))
        elif kind == "stream" and event.get("rank") == 0:
            say(kind=kind, line=event["text"].rstrip()[:200])

    def flush(self, force: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def ddp(steps: int = 1_000_000) -> int:
    """DDP on gloo, one step every 50 ms: a collective across the hosts, as training does."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    for step in range(steps):
        model(torch.ones(4, 8)).sum().backward()
        if step == 2 and dist.get_rank() == 0:
            print("training", flush=True)
        time.sleep(0.05)
    return dist.get_rank()


def short_ddp() -> int:
    return ddp(20)


def fail_on_rank_0() -> int:
    import torch.distributed as dist

    dist.barrier()  # the other node's rank is running by now
    if dist.get_rank() == 0:
        raise ValueError("boom on the notebook's rank")
    time.sleep(60)
    return 1


def lines(count: int = 50_000) -> tuple[float, float]:
    """The other node's rank prints ``count`` lines (the relay across the network); each rank
    returns when its printing began and ended."""
    import torch.distributed as dist

    began = time.time()
    if dist.get_rank() == 1:
        for i in range(count):
            print(f"rank 1 line {i}")
    return began, time.time()


FUNCTIONS = {
    "ddp": ddp,
    "short_ddp": short_ddp,
    "fail_on_rank_0": fail_on_rank_0,
    "lines": lines,
}


def run_pool(endpoint: str, run_id: str, run_dir: str, num_nodes: int) -> None:
    from nblaunch.notebook.pool_start import start_pool

    pool = start_pool(
        1,
        device_type="cpu",
        num_nodes=num_nodes,
        rdzv_endpoint=endpoint,
        rdzv_id=run_id,
        run_dir=run_dir,
        display="none",
    )
    say(kind="pool", world_size=pool.world_size)
    try:
        while True:
            try:
                pool.run(ddp, 40)
                say(end="cell returned")
            except Exception as exc:
                say(end="cell raised", type=type(exc).__name__, message=str(exc))
                break
        pool.restart(num_nodes=num_nodes - 1)
        say(end="restarted", world_size=pool.world_size, result=pool.run(short_ddp))
    finally:
        pool.close()


def main(argv: list[str]) -> None:
    endpoint, run_id, run_dir, name = argv[:4]
    num_nodes = int(argv[4]) if len(argv) > 4 else 2
    rdzv_timeout = float(argv[5]) if len(argv) > 5 else 60.0
    if name == "pool":
        run_pool(endpoint, run_id, run_dir, num_nodes)
        return
    try:
        results = launch_multinode(
            FUNCTIONS[name],
            (),
            1,
            LaunchOptions(device_type="cpu", run_dir=run_dir),
            NodeOptions(num_nodes, endpoint, rdzv_timeout, rdzv_id=run_id),
            view_factory=PrintingView,
        )
        say(end="returned", results=results)
    except BaseException as exc:
        say(end="raised", type=type(exc).__name__, message=str(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
