"""Starting, watching and stopping rank processes.

The supervisor owns the launcher's processes and every pipe to them. It never signals a PID it
did not start, escalates politely (SIGINT or SIGTERM, a grace period, then SIGKILL with a warning
naming the rank that ignored the request), and closes every descriptor it opened, so a kernel can
launch again and again without leaking processes, threads or file descriptors.

Ranks start through ``torch.multiprocessing`` with one of three methods:

- ``forkserver`` (default): a server process with torch preloaded forks each rank. After the first
  launch a start costs about a fork, and CUDA initialised in the notebook does no harm.
- ``spawn``: a fresh interpreter per rank; slowest, safest.
- ``fork``: fork the notebook itself; refused once CUDA is initialised in it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import psutil

from nblaunch.errors import FORKSERVER_LOST, LaunchError
from nblaunch.options import env_off, refuse_unknown_start_method
from nblaunch.ranks import containment, semaphores
from nblaunch.ranks.worker import RANK_FEATURES

PIPE_SIZE = 1 << 20
# Modules the forkserver imports once, so that every rank it forks has them already.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "cloudpickle",
    "tblib.pickling_support",
    "nblaunch.ranks.worker",
    "nblaunch.ranks.default_group",
    "nblaunch.pickling",
    "nblaunch.ranks.cell",  # what a %%distributed cell unpickles into (5 ms to import)
    *RANK_FEATURES,
    # Not imported before serving: it makes the server import torch._dynamo (which a rank's
    # first optimizer imports: 1 s per rank) while no launch waits on it.
    "nblaunch.engine.processes.forkserver_idle",
]


def warm_up(start_method: str = "forkserver") -> None:
    """Start the forkserver now, so that it imports torch before the first launch needs it.

    Returns at once: multiprocessing starts the server process and listens for it, and the
    server imports ``FORKSERVER_PRELOAD`` on its own; the first rank waits only for what is
    left of that. A no-op for other start methods and when the forkserver already runs.
    """
    if start_method != "forkserver":
        return
    import multiprocessing
    from multiprocessing import forkserver

    # __main__ is not preloaded, so the caller's main module plays no part here (no need to
    # hide it, as Supervisor.start must when it prepares rank processes).
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    with contextlib.suppress(Exception):
        forkserver.ensure_running()


def _forkserver_died(wait_s: float = 5.0) -> bool:
    """Whether multiprocessing's forkserver has ended (waiting up to ``wait_s`` for one that is
    ending); left unreaped, so that the next start sees it gone and starts another."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def warm_up_if_interactive() -> None:
    """In a notebook or IPython session, start the forkserver in the background (see
    :func:`warm_up`), so the first launch does not wait for torch to be imported.

    Not inside a rank, not under torchrun (code that imports nblaunch there never launches),
    not in a plain script (which launches at once anyway), and never when
    ``NBLAUNCH_PRESTART=0``. It touches no accelerator: the forkserver is a fresh process.
    """
    if "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    ipython = sys.modules.get("IPython")
    if ipython is None or ipython.get_ipython() is None:
        return
    try:
        if env_off("NBLAUNCH_PRESTART"):
            return
    except LaunchError as exc:  # at import: say it, and start as if it were unset
        warnings.warn(f"{exc}; the forkserver starts now as if it were unset", stacklevel=2)
    threading.Thread(target=warm_up, name="nblaunch-warm-up", daemon=True).start()


@dataclass
class RankProcess:
    """One rank: its process and the parent's ends of its pipes."""

    rank: int
    process: Any  # multiprocessing.Process
    conn: Connection  # events up, tasks down
    stdout_r: Connection
    stderr_r: Connection
    exitcode: int | None = None
    ended: bool = False  # the process has been joined, or let go (see Supervisor.let_go)
    events_open: bool = True  # its event pipe has not reached EOF

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class Supervisor:
    """Starts ``world_size`` rank processes and stops them again, whatever happened."""

    world_size: int
    start_method: str = "forkserver"
    ranks: list[RankProcess] = field(default_factory=list)
    # Where ranks note their semaphores, so those a killed rank left can be released.
    semaphore_dir: str | None = None
    # The value of containment.TREE_ENV in every rank and whatever it starts.
    tree_marker: str = field(default_factory=lambda: secrets.token_hex(8))

    def start(
        self,
        rank_ids: list[int] | None = None,
        setup: Callable[[int], dict[str, Any]] | None = None,
        wait_for_previous: bool = True,
    ) -> None:
        """Start one process per rank, running :func:`nblaunch.ranks.worker.main`.

        ``setup(rank)``, when given, is sent to each rank as soon as its process exists, so a
        rank sets itself up while the next one is still being started. With
        ``wait_for_previous`` (the default), ranks an earlier run let go are waited for first, so
        new ranks never meet their memory on a device; CPU ranks need not wait.

        Raises
        ------
        LaunchError
            When the start method is refused (``fork`` after CUDA was initialised).
        """
        check_start_method(self.start_method)
        reap_let_go(wait=wait_for_previous)
        self._prepare()
        try:
            for rank in rank_ids if rank_ids is not None else range(self.world_size):
                self.ranks.append(self.fork_rank(rank))
                if setup is not None:
                    self.send(self.ranks[-1], setup(rank))
        except BaseException:
            self.stop(grace=1.0)
            raise

    def adopt(
        self,
        ranks: list[RankProcess],
        tree_marker: str,
        setup: Callable[[int], dict[str, Any]],
        wait_for_previous: bool = True,
    ) -> None:
        """Take over rank processes forked ahead (:mod:`nblaunch.engine.processes.spares`)
        instead of starting new ones, and send each its set-up, which brings it up to this
        process's state."""
        check_start_method(self.start_method)
        reap_let_go(wait=wait_for_previous)
        self._prepare()
        self.tree_marker = tree_marker
        self.ranks.extend(ranks)
        for rank in ranks:
            self.send(rank, setup(rank.rank))

    def _prepare(self) -> None:
        # Ranks must share this process's resource tracker (forked ones too), so that what a
        # killed rank left registered can be released from here (nblaunch.ranks.semaphores).
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        if self.semaphore_dir is None:
            self.semaphore_dir = semaphores.directory()

    def fork_rank(self, rank: int, warm: dict[str, Any] | None = None) -> RankProcess:
        """Start one process running :func:`nblaunch.ranks.worker.main`; it waits for its set-up
        (a spare given ``warm`` makes its device's context meanwhile: ``ranks.warm_up``).

        Only bytes and plain records cross these pipes, so the standard library's
        multiprocessing does, and the notebook need not import torch for it (a second, and an
        interrupt in the middle leaves its torch half imported; the forkserver has torch for the
        ranks). Where torch is imported already, torch's: forked ranks then inherit it instead
        of importing it each (~15 ms a launch with the fork start method).
        """
        if "torch" in sys.modules:
            import torch.multiprocessing as mp
        else:
            import multiprocessing as mp

        from nblaunch.ranks import worker

        if self.semaphore_dir is None:
            self._prepare()
        context = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            context.set_forkserver_preload(FORKSERVER_PRELOAD)
        elif self.start_method == "fork":  # once, here: not in every rank after the fork
            worker.import_features()
        conn, child_conn = context.Pipe(duplex=True)
        stdout_r, stdout_w = context.Pipe(duplex=False)
        stderr_r, stderr_w = context.Pipe(duplex=False)
        _enlarge_pipe(stdout_w.fileno())
        process = context.Process(
            target=worker.main,
            args=(
                rank,
                child_conn,
                stdout_w,
                stderr_w,
                os.getpid(),
                self.semaphore_dir,
                self.tree_marker,
                warm,
            ),
            name=f"nblaunch-rank-{rank}",
            daemon=False,
        )
        try:
            with main_module_hidden():
                try:
                    process.start()
                except (ConnectionError, EOFError):
                    if self.start_method != "forkserver" or not _forkserver_died():
                        raise
                    # It died as it started (an interrupt of the notebook reaches the kernel's
                    # process group, the forkserver too, before it ignores SIGINT): once more,
                    # with a new one.
                    process.start()
        except OSError as exc:
            if "AF_UNIX path too long" not in str(exc):
                raise
            # multiprocessing's forkserver listens on a socket under the temp directory.
            raise LaunchError(
                f"the temporary directory {tempfile.gettempdir()} is too deep for the Unix "
                "socket of multiprocessing's forkserver (at most 107 bytes in all): set TMPDIR "
                "to a shorter directory (e.g. /tmp) before starting Python or the kernel"
            ) from None
        finally:
            for end in (child_conn, stdout_w, stderr_w):
                end.close()
        return RankProcess(rank, process, conn, stdout_r, stderr_r)

    def send(self, rank: RankProcess, message: dict[str, Any]) -> bool:
        """Send a message down a rank's pipe; False when the rank has gone."""
        try:
            rank.conn.send(message)
            return True
        except (BrokenPipeError, ConnectionResetError, OSError):
            return False

    def reap(self) -> list[RankProcess]:
        """Join ranks whose process has exited; return the newly ended ones."""
        ended = []
        for rank in self.ranks:
            if not rank.ended and not rank.process.is_alive():
                rank.process.join()
                rank.exitcode = rank.process.exitcode
                if rank.exitcode == 255 and self.start_method == "forkserver":
                    self._end_if_forkserver_lost(rank)
                rank.ended = True
                semaphores.release(self.semaphore_dir, rank.pid)  # a killed rank's locks
                ended.append(rank)
        return ended

    def _end_if_forkserver_lost(self, rank: RankProcess) -> None:
        """A forkserver that died reports every rank it started as ended with code 255, while
        the ranks run on, orphaned, out of sight (no exit status can reach this process any
        more): end such a rank and its tree, and say why it ended."""
        try:
            process = psutil.Process(rank.pid)
            # A forkserver's child runs its command line; a reused pid would not.
            orphan = process.status() != psutil.STATUS_ZOMBIE and any(
                "multiprocessing.forkserver" in part for part in process.cmdline()
            )
        except psutil.Error:
            return  # it ended: 255 is then what the forkserver's end left us to know
        if orphan:
            containment.end([*containment.descendants(rank.pid), process], grace=0.5)
            rank.exitcode = FORKSERVER_LOST

    def let_go(self, ranks: list[RankProcess]) -> None:
        """Stop watching ranks that were stopped, said their last and are exiting on their own.

        The caller need not wait ~4 ms a rank for the operating system to unmap torch's memory:
        they are joined, and anything they left is released, at the next start, which waits
        for them (up to ``LEAVE_LIMIT_S``, then kills one that did not exit).
        """
        for rank in ranks:
            rank.ended = True
            _leaving.append((time.monotonic() + LEAVE_LIMIT_S, self.semaphore_dir, rank.process))

    def alive(self) -> list[RankProcess]:
        return [r for r in self.ranks if not r.ended and r.process.is_alive()]

    def interrupt(self, ranks: list[int] | None = None) -> None:
        """Send SIGINT to each of ``ranks`` still alive (default: every live rank): a
        KeyboardInterrupt inside the task."""
        for rank in self.alive():
            if ranks is None or rank.rank in ranks:
                signal_pid(rank.pid, signal.SIGINT)

    def stop(
        self, grace: float = 2.0, *, first_signal: int = signal.SIGTERM, quiet: bool = False
    ) -> list[int]:
        """Stop every live rank and what it started: ``first_signal``, up to ``grace`` seconds,
        then SIGKILL, with a warning naming a rank that had to be killed unless ``quiet`` (a
        rank blocked in a collective after a peer failed cannot react: no news).

        Returns the ranks that had to be killed. The pipes stay open, so what the ranks wrote
        last can still be read; :meth:`close` closes them.
        """
        killed: list[int] = []
        live = self.alive()
        # Taken before the signal: a rank that dies at once can no longer end its children.
        trees = [process for rank in live for process in containment.descendants(rank.pid)]
        for rank in live:
            signal_pid(rank.pid, first_signal)
        deadline = time.monotonic() + grace
        for rank in live:
            rank.process.join(max(0.0, deadline - time.monotonic()))
        stubborn = [r for r in live if r.process.is_alive()]
        for rank in stubborn:
            if not quiet:
                warnings.warn(
                    f"rank {rank.rank} (pid {rank.pid}) ignored "
                    f"{signal.Signals(first_signal).name} for {grace:g} s; killing it",
                    RuntimeWarning,
                    stacklevel=2,
                )
            signal_pid(rank.pid, signal.SIGKILL)
            killed.append(rank.rank)
        for rank in stubborn:
            rank.process.join(5.0)
        self.reap()
        containment.end(trees, grace=0.5)
        return killed

    def close(self) -> None:
        """Close the parent's ends of every pipe and release the process objects.

        A rank that died on its own with a signal (a crash, the out-of-memory killer) could not
        end what it started: those processes are found by the run's marker and ended.
        """
        if any(rank.exitcode is not None and rank.exitcode < 0 for rank in self.ranks):
            containment.end(containment.marked(self.tree_marker), grace=0.5)
        for rank in self.ranks:
            for end in (rank.conn, rank.stdout_r, rank.stderr_r):
                with contextlib.suppress(OSError):
                    end.close()
            if rank.ended and rank.exitcode is not None:
                with contextlib.suppress(ValueError):
                    rank.process.close()


# Ranks let go at the end of a good run: (deadline to exit, semaphore directory, process).
_leaving: list[tuple[float, str | None, Any]] = []
LEAVE_LIMIT_S = 5.0


def reap_let_go(wait: bool = False) -> int:
    """Join the ranks :meth:`Supervisor.let_go` let go that have exited, release what they
    left, and kill any that overstayed ``LEAVE_LIMIT_S``; return how many are still leaving.

    With ``wait``, wait for each to exit (up to its limit): new ranks must not start while old
    ones still hold their memory (a GPU's above all) or files.
    """
    for entry in list(_leaving):
        deadline, semaphore_dir, process = entry
        if wait:
            process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            if time.monotonic() < deadline:
                continue
            signal_pid(process.pid, signal.SIGKILL)
        process.join()
        semaphores.release(semaphore_dir, process.pid)
        with contextlib.suppress(ValueError):
            process.close()
        _leaving.remove(entry)
    return len(_leaving)


def check_start_method(start_method: str) -> None:
    """Refuse an unknown start method, and ``fork`` once CUDA is initialised here.

    Raises
    ------
    LaunchError
        With what to use instead.
    """
    refuse_unknown_start_method(start_method)
    if start_method == "fork" and cuda_initialized():
        raise LaunchError(
            "start_method='fork' cannot be used: CUDA is already initialised in this process, "
            "and a forked child cannot use it. Use the default start_method='forkserver' "
            "(or 'spawn'), or restart the kernel and launch before touching the GPU."
        )


def cuda_initialized() -> bool:
    """True when this process has already initialised CUDA (so ``fork`` is unsafe)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def main_module_has_source() -> bool:
    """True when ``__main__`` is a script or module that multiprocessing would re-import in
    every ``spawn``/``forkserver`` child (a notebook kernel's ``__main__`` is neither)."""
    main = sys.modules["__main__"]
    return getattr(main, "__spec__", None) is not None or hasattr(main, "__file__")


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Keep ``spawn``/``forkserver`` children from re-running the caller's main script.

    multiprocessing re-imports ``__main__`` by path in every child it prepares. A script that
    calls the launcher at module level without an ``if __name__ == "__main__":`` guard would then
    launch again from every rank. Ranks get everything from their payload, so show
    multiprocessing a main module with no file while processes start.
    """
    real_main = sys.modules["__main__"]
    if not hasattr(real_main, "__spec__"):
        # IPython's %reset -f deletes it, and multiprocessing reads it: a new kernel has None.
        real_main.__spec__ = None
    if not main_module_has_source():  # a notebook's: nothing to hide, and nothing swapped
        yield
        return
    stand_in = types.ModuleType("__main__")
    stand_in.__spec__ = None
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        sys.modules["__main__"] = real_main


def _enlarge_pipe(fd: int) -> None:
    """Give a rank's stdout pipe room for ~1 MiB, so a fast-printing rank and the relay wake
    each other far less often (Linux only; best effort)."""
    import fcntl

    with contextlib.suppress(AttributeError, OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)


def signal_pid(pid: int | None, signum: int) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
