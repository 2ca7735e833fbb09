"""The run host's life: load what the notebook left, run it, serve it, leave the outcome behind.

The host runs the same engine as a blocking launch (:class:`~nblaunch.engine.run.run.Run`), writing
to an :class:`~nblaunch.engine.background.event_hub.EventHub` that the socket's clients watch; the
rank logs and ``metrics.jsonl`` are written as in any run. When the run ends it writes the outcome
(``result.pkl``) and what a view of it shows (``history.pkl``), both 0600, sends the outcome to
every attached notebook, waits until each took what it was sent, and exits. SIGTERM (``nblaunch
runs stop``) and a client's stop request stop the run as the interrupt button stops a blocking one.

The outcome never depends on the disk: when ``result.pkl`` cannot be written (the disk is full,
the directory turned read-only), the host keeps the outcome and hands it to every notebook that
attaches, trying the file again every :data:`RETRY_S`; it ends once the file is written,
:data:`HOLD_AFTER_TAKEN_S` after a notebook first took the outcome, after :data:`HOLD_S` at most,
or on SIGTERM (``nblaunch runs stop ID``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nblaunch import tracebacks
from nblaunch.engine.background.background_run import state_of, stopped_error
from nblaunch.engine.background.event_hub import EventHub
from nblaunch.engine.detached import host_files
from nblaunch.engine.detached import registry as detached
from nblaunch.engine.plan.run_dirs import RunLease
from nblaunch.engine.run.run import Run
from nblaunch.events import Lifecycle
from nblaunch.host.outcome import pickled, write_private
from nblaunch.host.serve import StreamServer

if TYPE_CHECKING:
    from nblaunch.cluster.run import MultiNodeLaunch

# The outcome the disk refused is kept this long at most for a notebook to attach and take it,
HOLD_S = 24 * 3600.0
# and this long after the first notebook took it (another kernel may attach too).
HOLD_AFTER_TAKEN_S = 600.0
# How often the host tries the outcome's file again while it holds the outcome.
RETRY_S = 10.0


def main(argv: list[str]) -> int:
    """``RUN_DIR LEASE_FD``: run the detached run in ``RUN_DIR``; 0 when it ran (whatever its
    outcome), 2 when it could not be started."""
    if len(argv) != 2:
        print("usage: python -m nblaunch.host RUN_DIR LEASE_FD", file=sys.stderr)
        return 2
    run_dir, lease_fd = Path(argv[0]), int(argv[1])
    launch = pickle.loads((run_dir / host_files.LAUNCH_FILE).read_bytes())
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
    run: Run | MultiNodeLaunch
    if launch.get("nodes") is not None:  # this host is the notebook node of a multi-node run
        from nblaunch.cluster.run import MultiNodeLaunch

        run = MultiNodeLaunch(plan, hub, launch["nodes"])
    else:
        run = Run(plan, hub)
    run_id = launch.get("run_id", plan.run_id)  # unique in the registry (detached.claim_id)
    server = StreamServer(detached.socket_path(run_dir), hub, run.request_stop)
    entry = detached.Entry(
        run_id=run_id,
        run_dir=run_dir,
        pid=os.getpid(),
        socket=server.path,
        kind=launch["kind"],
        started_at=time.time(),
        world_size=plan.world_size,
        state=Lifecycle.RUNNING,
        function=launch.get("function", ""),
        origin=launch.get("origin", ""),
    )
    signal.signal(signal.SIGTERM, lambda *_: run.request_stop())
    server.start()
    entry.write()
    say(f"run host {os.getpid()} serving {run_id} on {server.path}")
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
    written = write_outcome(run_dir, blob, hub)
    entry.state = state_of(outcome.get("error"))
    try:
        entry.write()
    except OSError as exc:
        say(f"run host {os.getpid()}: the registry entry could not be updated: {exc}")
    lease.release()
    held = threading.Event()  # SIGTERM from now on: let go of a held outcome
    signal.signal(signal.SIGTERM, lambda *_: held.set())
    server.finish(blob)
    if not written:
        hold_outcome(server, run_dir, blob, hub, held)
    server.close()
    say(f"run host {os.getpid()}: the run ended ({entry.state})")
    return 0


def write_outcome(run_dir: Path, blob: bytes, hub: EventHub) -> bool:
    """Leave the outcome and the view's history in ``run_dir``; False when the disk refused the
    outcome (the history is best effort: a view of the ended run then shows the rank logs)."""
    try:
        write_private(run_dir / host_files.RESULT_FILE, blob)  # whole or none: never half
    except OSError as exc:
        say(f"run host {os.getpid()}: {host_files.RESULT_FILE} could not be written ({exc})")
        return False
    try:
        write_private(run_dir / host_files.HISTORY_FILE, pickle.dumps(hub.history.events()))
    except OSError as exc:
        say(f"run host {os.getpid()}: {host_files.HISTORY_FILE} could not be written ({exc})")
    return True


def hold_outcome(
    server: StreamServer, run_dir: Path, blob: bytes, hub: EventHub, let_go: threading.Event
) -> None:
    """Keep serving the outcome the disk refused, until it is written, taken (and
    :data:`HOLD_AFTER_TAKEN_S` passed), :data:`HOLD_S` passed, or ``let_go`` is set."""
    say(
        f"run host {os.getpid()}: keeping the outcome for attach() (up to {HOLD_S / 3600:g} h, "
        f"{HOLD_AFTER_TAKEN_S / 60:g} min after a notebook took it)"
    )
    began = time.monotonic()
    taken_at: float | None = None
    next_try = began + RETRY_S
    while not let_go.wait(0.5):
        now = time.monotonic()
        if taken_at is None and server.delivered:
            taken_at = now
        if now >= next_try:
            if write_outcome(run_dir, blob, hub):
                return
            next_try = now + RETRY_S
        if now - began > HOLD_S or (taken_at is not None and now - taken_at > HOLD_AFTER_TAKEN_S):
            break
    server.finish(blob)  # whoever attached last gets all of it first


def say(text: str) -> None:
    """A line in ``host.log``, which may be on the disk that is full: never an error."""
    with contextlib.suppress(OSError, ValueError):
        print(text, flush=True)
