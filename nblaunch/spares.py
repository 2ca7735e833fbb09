"""Spare ranks: the next launch's rank processes, forked while the notebook is idle.

A one-shot launch spends about 5 ms per rank on the forkserver forking its processes, one after
the other, and the first rank then waits for the last to join the process group. In a notebook,
where the same cell is run again and again, the processes are started ahead instead: after a
one-shot launch, a background thread forks as many ranks again. Each waits on its pipe for the
set-up message, which brings it up to the notebook's present state (environment, ``sys.path``,
working directory) exactly as it does a rank forked at launch, and only then touches a device.
The next launch with the same ranks and start method takes them; any other launch lets them go
(they exit on the end of their pipe), and so does the kernel's exit.

Only in an interactive session (a script launches once), only with the forkserver, and never
with ``NBLAUNCH_SPARE_RANKS=0``. Waiting spares cost their memory (mostly shared with the
forkserver) and nothing else: they sleep in a read.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
from dataclasses import dataclass

from nblaunch.options import env_off
from nblaunch.supervisor import RankProcess, Supervisor, main_module_has_source

SPARES_ENV = "NBLAUNCH_SPARE_RANKS"


@dataclass
class Spares:
    """Rank processes forked ahead, waiting for their set-up."""

    start_method: str
    tree_marker: str
    ranks: list[RankProcess]


_lock = threading.Lock()
_spares: Spares | None = None
_forking: threading.Thread | None = None
_atexit_registered = False


def wanted(start_method: str) -> bool:
    """True when spares pay off and are safe here (see the module's docstring)."""
    if env_off(SPARES_ENV) or start_method != "forkserver":
        return False
    ipython = sys.modules.get("IPython")
    if ipython is None or ipython.get_ipython() is None:
        return False
    # Forking from a thread must not hide __main__ from the notebook's code meanwhile.
    return not main_module_has_source()


def fork_ahead(world_size: int, start_method: str) -> None:
    """Fork ``world_size`` spare ranks on a background thread, when :func:`wanted`."""
    global _forking, _atexit_registered
    if not wanted(start_method):
        return
    discard()
    if not _atexit_registered:  # before multiprocessing's own, which would wait for them
        atexit.register(discard)
        _atexit_registered = True
    _forking = threading.Thread(
        target=_fork, args=(world_size, start_method), name="nblaunch-spares", daemon=True
    )
    _forking.start()


def _fork(world_size: int, start_method: str) -> None:
    global _spares
    supervisor = Supervisor(world_size, start_method)
    ranks: list[RankProcess] = []
    try:
        for rank in range(world_size):
            ranks.append(supervisor.fork_rank(rank))
    except Exception:  # the launch forks its own then; these are let go
        _let_go(ranks)
        return
    with _lock:
        _spares = Spares(start_method, supervisor.tree_marker, ranks)


def take(start_method: str, rank_ids: list[int]) -> Spares | None:
    """The spares for a launch of ``rank_ids`` with ``start_method``, if there are such;
    spares of another shape are let go."""
    spares = _claim()
    if spares is None:
        return None
    fits = spares.start_method == start_method and [r.rank for r in spares.ranks] == rank_ids
    if fits and all(r.process.is_alive() for r in spares.ranks):
        return spares
    _let_go(spares.ranks)
    return None


def pids() -> list[int]:
    """The processes of the spares waiting now (once the thread forking them is done)."""
    if _forking is not None:
        _forking.join()
    with _lock:
        return [rank.pid for rank in _spares.ranks] if _spares is not None else []


def discard() -> None:
    """Let every spare go: each exits when its pipe closes."""
    spares = _claim()
    if spares is not None:
        _let_go(spares.ranks)


def _claim() -> Spares | None:
    """The spares, once the thread forking them is done; nobody else gets them."""
    global _spares
    if _forking is not None:
        _forking.join()
    with _lock:
        spares, _spares = _spares, None
    return spares


def _let_go(ranks: list[RankProcess]) -> None:
    for rank in ranks:
        for end in (rank.conn, rank.stdout_r, rank.stderr_r):
            with contextlib.suppress(OSError):
                end.close()
    Supervisor(len(ranks)).let_go(ranks)
