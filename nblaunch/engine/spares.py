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

from nblaunch.engine.supervisor import RankProcess, Supervisor, main_module_has_source
from nblaunch.options import env_off

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


_lock = threading.Lock()
_spares: Spares | None = None
# One long-lived thread forks, when asked (starting a thread per launch cost ~2 ms a cell).
_worker: threading.Thread | None = None
_request: tuple[int, str] | None = None  # (world size, start method) to fork next
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


def fork_ahead(world_size: int, start_method: str) -> None:
    """Have ``world_size`` spare ranks forked in the background, when :func:`wanted`."""
    global _worker, _request
    if not wanted(start_method):
        return
    discard()
    if _worker is None:
        atexit.register(discard)  # before multiprocessing's exit, which would wait for them
        _worker = threading.Thread(target=_serve, name="nblaunch-spares", daemon=True)
        _worker.start()
    _request = (world_size, start_method)
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
    _idle.wait()
    with _lock:
        return [rank.pid for rank in _spares.ranks] if _spares is not None else []


def discard() -> None:
    """Let every spare go: each exits when its pipe closes."""
    spares = _claim()
    if spares is not None:
        _let_go(spares.ranks)


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
