"""The run host's life: load what the notebook left, run it, serve it, leave the outcome behind.

The host runs the same engine as a blocking launch (:class:`~nblaunch.engine.run.Run`), writing
to an :class:`~nblaunch.engine.history.EventHub` that the socket's clients watch; the rank logs
and ``metrics.jsonl`` are written as in any run. When the run ends it writes the outcome
(``result.pkl``) and what a view of it shows (``history.pkl``), both 0600, sends the outcome to
every attached notebook and exits. SIGTERM (``nblaunch runs stop``) and a client's stop request
stop the run as the interrupt button stops a blocking one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

from nblaunch import tracebacks
from nblaunch.engine import detached
from nblaunch.engine.background import RUNNING, state_of, stopped_error
from nblaunch.engine.history import EventHub
from nblaunch.engine.run import Run
from nblaunch.engine.run_dirs import RunLease
from nblaunch.host.outcome import pickled, write_private
from nblaunch.host.serve import StreamServer


def main(argv: list[str]) -> int:
    """``RUN_DIR LEASE_FD``: run the detached run in ``RUN_DIR``; 0 when it ran (whatever its
    outcome), 2 when it could not be started."""
    if len(argv) != 2:
        print("usage: python -m nblaunch.host RUN_DIR LEASE_FD", file=sys.stderr)
        return 2
    run_dir, lease_fd = Path(argv[0]), int(argv[1])
    launch = pickle.loads((run_dir / detached.LAUNCH_FILE).read_bytes())
    os.environ["NBLAUNCH_DETACHED_DIR"] = launch["registry"]  # the notebook's registry
    sys.path[:] = launch["sys_path"]  # the ranks import what the notebook could
    lease = RunLease.adopt(run_dir, lease_fd)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is no reason to stop
    if launch["kind"] == "pool":
        from nblaunch.host.pool import serve_pool

        return serve_pool(run_dir, launch, lease)
    return run_detached(run_dir, launch, lease)


def run_detached(run_dir: Path, launch: dict[str, Any], lease: RunLease) -> int:
    """Run a one-shot detached run to its end; the lease is held until the outcome is written
    (the run alone would let go when its ranks ended)."""
    plan = dataclasses.replace(launch["plan"], run_lease=None)
    hub = EventHub()
    run = Run(plan, hub)
    server = StreamServer(detached.socket_path(run_dir, plan.run_id), hub, run.request_stop)
    entry = detached.Entry(
        run_id=plan.run_id,
        run_dir=run_dir,
        pid=os.getpid(),
        socket=server.path,
        kind=launch["kind"],
        started_at=time.time(),
        world_size=plan.world_size,
        state=RUNNING,
        function=launch.get("function", ""),
    )
    signal.signal(signal.SIGTERM, lambda *_: run.request_stop())
    server.start()
    entry.write()
    print(f"run host {os.getpid()} serving {plan.run_id} on {server.path}", flush=True)
    outcome: dict[str, Any]
    try:
        outcome = {"values": run.execute(launch["payload"])}
    except KeyboardInterrupt:
        outcome = {"error": stopped_error(run_dir)}
    except BaseException as exc:  # the run's outcome, for whoever attaches
        # With the rank's frames and text: the notebook shows them as a blocking launch does.
        root = run.outcome.root
        outcome = {"error": tracebacks.portable(exc), "traceback": root.traceback if root else ""}
    blob = pickled(outcome, plan.world_size)
    write_private(run_dir / detached.RESULT_FILE, blob)
    write_private(run_dir / detached.HISTORY_FILE, pickle.dumps(hub.history.events()))
    entry.state = state_of(outcome.get("error"))
    entry.write()
    lease.release()
    server.finish(blob)
    print(f"run host {os.getpid()}: the run ended ({entry.state})", flush=True)
    return 0
