"""Spare ranks: the next launch's rank processes, forked while the notebook is idle.

A one-shot launch spends about 5 ms per rank on the forkserver forking its processes, one after
the other, and the first rank then waits for the last to join the process group. In a notebook,
where the same cell is run again and again, the processes are started ahead instead: after a
one-shot launch, a background thread forks as many ranks again. Each waits on its pipe for the
set-up message, which brings it up to the notebook's present state (environment, ``sys.path``,
working directory) exactly as it does a rank forked at launch; a CPU spare touches nothing of
its device before it. The next launch with the same ranks and start method takes them; any
other launch lets them go (they exit on the end of their pipe), and so does the kernel's exit.

After a launch on an accelerator (a GPU), each spare also learns at fork time which device it
would get and the notebook's device environment then (``CUDA_VISIBLE_DEVICES`` and the like),
and makes its device's context while it waits (:mod:`nblaunch.ranks.device.warm_up`): the CUDA
context (0.33 s on an H200, measured by issue 41's session) is then no longer in a warm
launch. A launch whose device type or device environment differs from what the spares warmed
up with lets them go and forks fresh ranks, as for any other mismatch: never a rank on a wrong
device. CPU spares warm nothing up.

Only in an interactive session (a script launches once), only with the forkserver, and never
with ``NBLAUNCH_SPARE_RANKS=0``. Waiting spares cost their memory (mostly shared with the
forkserver) and nothing else: they sleep in a read. A warmed spare also holds its context on its
device while it waits (a few hundred MB of GPU memory).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nblaunch.engine.processes.supervisor import RankProcess, Supervisor, main_module_has_source
from nblaunch.options import env_off
from nblaunch.ranks.device import warm_up

SPARES_ENV = "NBLAUNCH_SPARE_RANKS"
# The forking waits this long, so that the cell that launched ends first: it would compete
# with the kernel's reply for the interpreter (a thread switch every 5 ms) and the CPU. A launch
# that comes sooner (cells run back to back) cancels it and forks its own ranks.
FORK_DELAY_S = 0.05


@dataclass
class Spares:
    """Rank processes forked ahead, waiting for their set-up."""

    start_method: str
    tree_marker: str
    ranks: list[RankProcess]
    device_type: str = "cpu"
    # What they warmed up with (nblaunch.ranks.device.warm_up.plan); None: nothing (CPU ranks).
    warm: dict[str, Any] | None = None


_lock = threading.Lock()
_spares: Spares | None = None
# One long-lived thread forks, when asked (starting a thread per launch cost ~2 ms a cell).
_worker: threading.Thread | None = None
# (world size, start method, device type, warm-up plan) to fork next
_request: tuple[int, str, str, dict[str, Any] | None] | None = None
_wake = threading.Event()  # a request is waiting
_idle = threading.Event()  # the worker is not forking: spares, if any, are complete
_idle.set()
_cancel = threading.Event()  # a launch came first: do not begin forking


def wanted(start_method: str) -> bool:
    """True when spares pay off and are safe here (see the module's docstring)."""
    if env_off(SPARES_ENV) or start_method != "forkserver":
        return False
    ipython = sys.modules.get("IPython")
    if ipython is None or ipython.get_ipython() is None:
        return False
    # Forking from a thread must not hide __main__ from the notebook's code meanwhile.
    return not main_module_has_source()


def fork_ahead(world_size: int, start_method: str, device_type: str = "cpu") -> None:
    """Have ``world_size`` spare ranks forked in the background, when :func:`wanted`; for a
    launch on an accelerator, each warms up its device (the notebook's device environment is
    read now, in the calling thread)."""
    global _worker, _request
    if not wanted(start_method):
        return
    warm = warm_up.plan(device_type, os.environ)
    discard()
    if _worker is None:
        atexit.register(discard)  # before multiprocessing's exit, which would wait for them
        _worker = threading.Thread(target=_serve, name="nblaunch-spares", daemon=True)
        _worker.start()
    _request = (world_size, start_method, device_type, warm)
    _cancel.clear()
    _idle.clear()
    _wake.set()


def _serve() -> None:
    global _request
    while True:
        _wake.wait()
        _wake.clear()
        request, _request = _request, None
        try:
            if request is not None and not _cancel.wait(FORK_DELAY_S):
                _fork(*request)
        finally:
            _idle.set()  # whatever happened: a launch waiting for the spares must not hang


def _fork(
    world_size: int, start_method: str, device_type: str, warm: dict[str, Any] | None
) -> None:
    global _spares
    supervisor = Supervisor(world_size, start_method)
    ranks: list[RankProcess] = []
    try:
        for rank in range(world_size):
            # A one-node launch: LOCAL_RANK is the rank, and so is its device's index.
            ranks.append(supervisor.fork_rank(rank, warm and {**warm, "index": rank}))
    except Exception:  # the launch forks its own then; these are let go
        _let_go(ranks)
        return
    with _lock:
        _spares = Spares(start_method, supervisor.tree_marker, ranks, device_type, warm)


def take(
    start_method: str,
    rank_ids: list[int],
    device_type: str = "cpu",
    env: Mapping[str, str] | None = None,
) -> Spares | None:
    """The spares for a launch of ``rank_ids`` with ``start_method`` on ``device_type``, whose
    ranks get ``env`` (rank 0's set-up environment), if there are such; spares of another shape,
    or warmed up for another device or device environment, are let go."""
    spares = _claim()
    if spares is None:
        return None
    fits = (
        spares.start_method == start_method
        and [r.rank for r in spares.ranks] == rank_ids
        and spares.device_type == device_type
        and _same_device(spares.warm, device_type, env)
    )
    if fits and all(r.process.is_alive() for r in spares.ranks):
        return spares
    _let_go(spares.ranks)
    return None


def _same_device(
    warm: dict[str, Any] | None, device_type: str, env: Mapping[str, str] | None
) -> bool:
    """Whether ranks set up with ``env`` get the devices spares warmed up with ``warm`` made
    their contexts on: the same device environment, and each rank's device its rank's index."""
    if warm is None:
        return True  # they touched no device
    if env is None:
        return False
    return env.get("LOCAL_RANK") == env.get("RANK") and warm["env"] == warm_up.device_env(
        device_type, env
    )


def pids() -> list[int]:
    """The processes of the spares waiting now (once the thread forking them is done)."""
    _idle.wait()
    with _lock:
        return [rank.pid for rank in _spares.ranks] if _spares is not None else []


def discard() -> None:
    """Let every spare go: each exits when its pipe closes."""
    spares = _claim()
    if spares is not None:
        _let_go(spares.ranks)


def warmed() -> dict[str, Any] | None:
    """What the spares waiting now warmed up with (``device_type`` and ``env``); None when
    there are none, or they warmed nothing up (CPU ranks)."""
    _idle.wait()
    with _lock:
        return None if _spares is None or _spares.warm is None else dict(_spares.warm)


def _claim() -> Spares | None:
    """The spares, once the thread forking them is done (or cancelled before it began)."""
    global _spares
    _cancel.set()
    _idle.wait()
    with _lock:
        spares, _spares = _spares, None
    return spares


def _let_go(ranks: list[RankProcess]) -> None:
    for rank in ranks:
        for end in (rank.conn, rank.stdout_r, rank.stderr_r):
            with contextlib.suppress(OSError):
                end.close()
    Supervisor(len(ranks)).let_go(ranks)
