"""``notebook_launcher`` and ``debug_launcher``: validate, plan, supervise, return or raise.

A launch goes through four steps:

1. **Validate and plan** (:func:`plan_launch`): check every argument, pick devices, backend and
   port, and serialise the function with its arguments. Anything wrong is a ``LaunchError``
   before a process starts.
2. **Start** the ranks (:class:`~nblaunch.supervisor.Supervisor`) and send each its setup and task.
3. **Watch** (:class:`Run`): relay output and events to the view, collect results, and spot the
   root cause when something fails: the first *primary* failure, never a rank that only saw its
   peer die.
4. **Finish**: stop every rank (politely, then by force), then return the results by rank or
   raise the failing rank's own exception.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import multiprocessing
import os
import pickle
import re
import secrets
import socket
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nblaunch import errors, process_groups, tracebacks
from nblaunch.errors import LaunchError, LaunchTimeoutError, RankFailedError
from nblaunch.events import Event, EventSink, RunState
from nblaunch.relay import Relay
from nblaunch.supervisor import Supervisor, check_start_method
from nblaunch.worker import SETUP, STOP, TASK, safe_str

DEVICE_TYPES = ("cuda", "cpu", "xla")
# How long a secondary failure ("connection reset by peer") waits for the primary one to show.
SECONDARY_GRACE_S = 3.0
# After a root cause, how long the other ranks get to stop before SIGKILL.
STOP_GRACE_S = 2.0
# Run directories kept under the default base (NBLAUNCH_KEEP_RUNS changes it; 0 keeps all).
KEEP_RUNS = 50
# More CPU ranks than this per core are refused unless NBLAUNCH_MAX_PROCESSES allows them.
CPU_RANKS_PER_CORE = 4
# How long the other ranks get to stop once a root cause (a failure, a death, a hang) is known.
KNOWN_CAUSE_GRACE_S = 0.5
# How long the other ranks' DistributedOperationException is waited for after the first one's.
VERDICT_WAIT_S = 1.0
# Default hang_timeout: how long nothing may move while ranks wait in collectives.
DEFAULT_HANG_TIMEOUT_S = 300.0
TRUE_VALUES = ("1", "true", "yes", "on")
# What Accelerate (accelerate.utils.str_to_bool) reads as false.
FALSE_VALUES = ("0", "false", "no", "off", "n", "f")


def env_flag(*names: str) -> bool:
    """True when any of the environment variables is 1/true/yes/on (any case)."""
    return any(os.environ.get(name, "").strip().lower() in TRUE_VALUES for name in names)


def debug_from_env() -> bool:
    """Debug mode from ``NBLAUNCH_DEBUG`` (or Accelerate's ``ACCELERATE_DEBUG_MODE``)."""
    return env_flag("NBLAUNCH_DEBUG", "ACCELERATE_DEBUG_MODE")


@dataclass
class LaunchPlan:
    """Everything decided before a process starts."""

    world_size: int
    device_type: str
    backend: str
    start_method: str
    master_addr: str
    master_port: int
    debug: bool
    init_process_group: bool
    timeout: float | None
    hang_timeout: float | None
    log_level: str | None
    run_dir: Path | None
    device_kind: str
    warnings: list[str] = field(default_factory=list)
    # Things the header says that are not problems, e.g. a variable set for Accelerate.
    notes: list[str] = field(default_factory=list)
    # Extra settings for in-rank features, e.g. where a restarted batch-size search resumes.
    options: dict[str, Any] = field(default_factory=dict)

    def rank_env(self, rank: int) -> dict[str, str]:
        """The parent's environment plus the torchrun contract for ``rank``."""
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            NODE_RANK="0",
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            TORCHELASTIC_RUN_ID=self.run_id,
        )
        if self.debug:
            env["NBLAUNCH_DEBUG"] = "1"
        if self.log_level:
            env["NBLAUNCH_LOG_LEVEL"] = self.log_level
        if self.device_type == "cpu" and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(self.threads_per_rank)
        if self.device_type == "cpu":
            # Without it Accelerate's state, and so Transformers' Trainer, looks for a GPU,
            # finds none and trains every rank alone (NOT_PARALLEL) despite the process group.
            env.setdefault("ACCELERATE_USE_CPU", "1")
        # The flight recorder names the collective a rank waits in (hang reports).
        process_groups.enable_flight_recorder(env)
        loopback = loopback_interface() if _is_loopback(self.master_addr) else None
        if loopback:  # keep single-node traffic on the loopback interface
            env.setdefault("GLOO_SOCKET_IFNAME", loopback)
            env.setdefault("NCCL_SOCKET_IFNAME", loopback)
        return env

    @property
    def threads_per_rank(self) -> int:
        return max(1, (os.cpu_count() or 1) // self.world_size)

    @property
    def run_id(self) -> str:
        return self.run_dir.name if self.run_dir else "nblaunch"

    def setup_message(self, rank: int) -> dict[str, Any]:
        return {
            "kind": SETUP,
            "env": self.rank_env(rank),
            "sys_path": list(sys.path),
            "cwd": os.getcwd(),
            # What the caller's multiprocessing would use (a DataLoader's workers): "fork" on
            # Linux, as under torchrun, not the forkserver that started the rank.
            "mp_start_method": multiprocessing.get_start_method(),
            "backend": self.backend,
            "device_type": self.device_type,
            "init_process_group": self.init_process_group,
            "debug": self.debug,
            "launcher_pid": os.getpid(),
            "num_threads": self.threads_per_rank if self.device_type == "cpu" else None,
            "options": {
                "log_level": self.log_level,
                "hang_timeout": self.hang_timeout,
                **self.options,
            },
        }


def notebook_launcher(
    function: Any,
    args: tuple[Any, ...] | list[Any] = (),
    num_processes: int | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    start_method: str = "forkserver",
    debug: bool | None = None,
    log_level: str | None = None,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT_S,
    timeout: float | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    setup_process_group: bool = True,
    device_type: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    display: str = "auto",
    num_nodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_timeout: float | None = None,
) -> list[Any]:
    """Run ``function(*args, **kwargs)`` on ``num_processes`` ranks and return what each returned.

    Parameters
    ----------
    function
        Any callable: defined in the notebook, a lambda or a closure. It travels by value.
    args, kwargs
        Its arguments; everything must pickle (checked before anything starts).
    num_processes
        Number of ranks (per node, with ``num_nodes``). Default: one per visible GPU, else 1
        (pass a number for more CPU ranks).
    start_method
        ``"forkserver"`` (default, fast after the first launch), ``"spawn"`` or ``"fork"``.
    debug
        Check every collective for mismatched shapes (default: ``NBLAUNCH_DEBUG``).
    log_level
        Level of ``nblaunch.get_logger`` loggers in the ranks (default: ``NBLAUNCH_LOG_LEVEL``).
    hang_timeout
        Seconds nothing may move while ranks wait in collectives before the run is stopped
        with ``DistributedHangError`` (default 300); ``None`` turns this check off. A rank
        that returned while others wait in a collective it never called is reported at once,
        whatever this is.
    timeout
        Stop the run after this many seconds (``LaunchTimeoutError``); ``None`` for no limit.
    master_addr, master_port
        Where rank 0 listens; the port defaults to a free one. Loopback only by default.
    setup_process_group
        Initialise the default process group before ``function`` runs (and destroy it after).
    device_type
        ``"cuda"``, ``"cpu"`` or ``"xla"``; default: what this machine has.
    run_dir
        Where per-rank logs go (default ``.nblaunch/runs/<time>-<id>``).
    display
        ``"auto"`` (widget in a notebook, text elsewhere), ``"widget"``, ``"text"``, ``"none"``.
    num_nodes, rdzv_endpoint, rdzv_timeout
        Run on ``num_nodes`` machines, ``num_processes`` ranks on each: this machine hosts the
        rendezvous on ``rdzv_endpoint`` (``"host:port"``, one of its own addresses) and prints
        the ``python -m nblaunch join`` command for the other nodes, which must join within
        ``rdzv_timeout`` seconds (default 600). See :mod:`nblaunch.multinode`.

    Returns
    -------
    list
        ``function``'s return value on each rank, indexed by rank.

    Raises
    ------
    LaunchError
        Bad arguments, an unpicklable function or argument, a busy port: nothing was started.
    RendezvousTimeoutError
        Multi-node: not every node joined within ``rdzv_timeout`` (a ``LaunchError``).
    Exception
        The failing rank's own exception, re-created here with its traceback and a note
        naming the rank.
    RankFailedError
        A rank died without a Python exception (signal, exit code).
    LaunchTimeoutError
        ``timeout`` ran out.
    KeyboardInterrupt
        The launch was interrupted; every rank has been stopped.
    """
    __tracebackhide__ = True  # the rank's traceback matters, not the launcher's frames
    from nblaunch.pool import refuse_if_running

    refuse_if_running("notebook_launcher")  # a persistent pool holds the devices
    if num_nodes != 1 or rdzv_endpoint is not None:
        from nblaunch.multinode import launch_multinode

        return launch_multinode(
            function,
            args,
            num_processes,
            num_nodes=num_nodes,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_timeout=rdzv_timeout,
            kwargs=kwargs,
            start_method=start_method,
            debug=debug,
            log_level=log_level,
            hang_timeout=hang_timeout,
            timeout=timeout,
            setup_process_group=setup_process_group,
            device_type=device_type,
            run_dir=run_dir,
            display=display,
        )
    plan = plan_launch(
        function,
        num_processes,
        start_method=start_method,
        debug=debug,
        log_level=log_level,
        hang_timeout=hang_timeout,
        timeout=timeout,
        master_addr=master_addr,
        master_port=master_port,
        setup_process_group=setup_process_group,
        device_type=device_type,
        run_dir=run_dir,
    )
    payload = serialize_payload(function, args, kwargs)
    from nblaunch.widgets import DeferredView, LaunchView, make_view

    view = make_view(display)
    if isinstance(view, LaunchView):
        view = DeferredView(view)  # a launch over in a moment gets its summary alone
    if plan.device_type == "xla":
        return _launch_xla(plan, payload)
    return Run(plan, view).execute(payload)


def debug_launcher(function: Any, args: tuple[Any, ...] = (), num_processes: int = 2) -> list[Any]:
    """Run ``function`` on ``num_processes`` CPU ranks with gloo and debug mode on.

    For testing distributed code on a laptop; otherwise the same as :func:`notebook_launcher`.
    """
    return notebook_launcher(
        function, args, num_processes, device_type="cpu", debug=True, display="auto"
    )


# --- planning ------------------------------------------------------------------------------------


def plan_launch(
    function: Any,
    num_processes: int | None,
    *,
    start_method: str = "forkserver",
    debug: bool | None = None,
    log_level: str | None = None,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT_S,
    timeout: float | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    setup_process_group: bool = True,
    device_type: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
) -> LaunchPlan:
    """Check the arguments and decide devices, backend, port and run directory.

    Raises
    ------
    LaunchError
        Naming the bad argument and what to pass instead.
    """
    if not callable(function):
        raise LaunchError(
            f"function must be callable, got {type(function).__name__} {function!r:.80}"
        )
    check_start_method(start_method)
    for name, value in (("timeout", timeout), ("hang_timeout", hang_timeout)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
        ):
            raise LaunchError(f"{name} must be a positive number of seconds or None, got {value!r}")
    warnings: list[str] = []
    device_type, device_count, device_kind = _detect_devices(device_type)
    if num_processes is None:
        if device_type == "cpu":
            num_processes = 1
            warnings.append(
                "no GPU found: running 1 CPU rank; pass num_processes=N (%%distributed -n N) "
                "for more CPU ranks"
            )
        else:
            num_processes = device_count
    if isinstance(num_processes, bool) or not isinstance(num_processes, int):
        raise LaunchError(
            f"num_processes must be a whole number of ranks, got {num_processes!r} "
            f"({type(num_processes).__name__})"
        )
    if num_processes < 1:
        raise LaunchError(f"num_processes must be at least 1, got {num_processes}")
    if device_type != "cpu" and num_processes > device_count:
        raise LaunchError(
            f"num_processes={num_processes} but only {device_count} {device_type.upper()} "
            f"device(s) are visible; use at most {device_count}, or device_type='cpu'"
        )
    if device_type == "cpu":
        _check_cpu_ranks(num_processes, warnings)
    _check_working_directory()
    from nblaunch.doctor import launch_warnings

    warnings += launch_warnings(device_type, num_processes)  # old kernel, mixed GPUs
    notes = _cpu_library_notes(device_type, num_processes, warnings)
    port = _choose_port(master_addr, master_port)
    backend = {"cuda": "nccl", "cpu": "gloo", "xla": "xla"}[device_type]
    return LaunchPlan(
        world_size=num_processes,
        device_type=device_type,
        backend=backend,
        start_method=start_method,
        master_addr=master_addr,
        master_port=port,
        debug=debug_from_env() if debug is None else bool(debug),
        init_process_group=bool(setup_process_group),
        timeout=timeout,
        hang_timeout=hang_timeout,
        log_level=log_level
        or os.environ.get("NBLAUNCH_LOG_LEVEL")
        or os.environ.get("ACCELERATE_LOG_LEVEL"),
        run_dir=_new_run_dir(run_dir),
        device_kind=device_kind,
        warnings=warnings,
        notes=notes,
    )


def _check_cpu_ranks(num_processes: int, warnings: list[str]) -> None:
    """Refuse far more CPU ranks than cores (each one is a process with torch loaded: ~300 MB);
    ``NBLAUNCH_MAX_PROCESSES`` raises the limit. Warn when ranks will share cores."""
    cores = os.cpu_count() or 1
    limit = CPU_RANKS_PER_CORE * cores
    raw = os.environ.get("NBLAUNCH_MAX_PROCESSES", "")
    if raw.strip():
        try:
            limit = int(raw)
        except ValueError:
            raise LaunchError(
                f"NBLAUNCH_MAX_PROCESSES={raw!r} is not a whole number of ranks"
            ) from None
    if num_processes > limit:
        raise LaunchError(
            f"num_processes={num_processes}: {num_processes} CPU ranks on {cores} cores is more "
            f"than the limit of {limit} ({CPU_RANKS_PER_CORE} per core; each rank is a process "
            "with torch loaded, about 300 MB). Use fewer ranks, or set "
            f"NBLAUNCH_MAX_PROCESSES={num_processes} to go past the limit."
        )
    if num_processes > cores:
        warnings.append(f"{num_processes} CPU ranks on {cores} cores: ranks will share cores")


def _check_working_directory() -> None:
    """Ranks start in the caller's working directory: it must still exist."""
    try:
        os.getcwd()
    except FileNotFoundError:
        was = os.environ.get("PWD")
        raise LaunchError(
            "the current working directory no longer exists"
            + (f" (it was {was})" if was else "")
            + "; os.chdir() to an existing directory (%cd in a notebook) and launch again."
        ) from None


def _cpu_library_notes(device_type: str, num_processes: int, warnings: list[str]) -> list[str]:
    """Say that CPU ranks get ``ACCELERATE_USE_CPU=1`` (see ``LaunchPlan.rank_env``).

    A value the caller set is kept; one that turns it off gets a warning instead of the note.
    """
    if device_type != "cpu":
        return []
    value = os.environ.get("ACCELERATE_USE_CPU")
    if value is None:
        return [
            "CPU ranks: ACCELERATE_USE_CPU=1 set so Accelerate and Transformers run "
            f"distributed on all {num_processes} ranks"
        ]
    if value.strip().lower() in FALSE_VALUES and num_processes > 1:
        warnings.append(
            f"ACCELERATE_USE_CPU={value} is set: Accelerate and Transformers will train each "
            "CPU rank alone (NOT_PARALLEL); unset it to train on all ranks together"
        )
    return []


def _detect_devices(device_type: str | None) -> tuple[str, int, str]:
    """Return (device type, how many, a name for the header)."""
    import torch

    if device_type is not None and device_type not in DEVICE_TYPES:
        raise LaunchError(f"device_type={device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
    if device_type in (None, "xla") and _xla_available():
        import torch_xla.runtime as xr  # type: ignore[import-not-found]

        return "xla", int(xr.global_runtime_device_count()), "XLA"
    if device_type == "xla":
        raise LaunchError("device_type='xla' but torch_xla cannot be imported; install torch_xla")
    # device_count() asks NVML and does not initialise CUDA, so fork stays possible.
    count = torch.cuda.device_count() if device_type in (None, "cuda") else 0
    if count:
        return (
            "cuda",
            count,
            torch.cuda.get_device_name(0) if torch.cuda.is_initialized() else "GPU",
        )
    if device_type == "cuda":
        raise LaunchError("device_type='cuda' but no CUDA device is visible to torch")
    return "cpu", os.cpu_count() or 1, "CPU"


def _xla_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


@functools.lru_cache(maxsize=16)
def _is_loopback(address: str) -> bool:
    try:
        return socket.gethostbyname(address).startswith("127.")
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def loopback_interface() -> str | None:
    """Name of the network interface that carries 127.0.0.1 ("lo" on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses):
            return name
    return None


def _choose_port(master_addr: str, master_port: int | None) -> int:
    """A free port on ``master_addr``, or check that the given one is free."""
    if master_port is not None and (
        isinstance(master_port, bool)
        or not isinstance(master_port, int)
        or not 0 < master_port < 65536
    ):
        raise LaunchError(f"master_port must be a port number (1-65535), got {master_port!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((master_addr, master_port or 0))
        except OSError as exc:
            if master_port is None:
                raise LaunchError(f"cannot listen on master_addr={master_addr!r}: {exc}") from None
            raise LaunchError(
                f"master_port={master_port} on {master_addr} is busy ({exc.strerror}); "
                "pass another port, or master_port=None to pick a free one"
            ) from None
        return probe.getsockname()[1]


def _new_run_dir(run_dir: str | os.PathLike[str] | None) -> Path:
    """Make the run's directory (rank logs) now, so a bad one fails before any rank starts.

    Raises
    ------
    LaunchError
        The directory cannot be made or written, naming it and how to choose another.
    """
    base = None
    if run_dir is not None:
        path, chosen_by = Path(run_dir), "run_dir="
    else:
        base = Path(os.environ.get("NBLAUNCH_RUN_DIR", ".nblaunch/runs"))
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = base / f"{stamp}-{secrets.token_hex(3)}"
        chosen_by = "NBLAUNCH_RUN_DIR" if "NBLAUNCH_RUN_DIR" in os.environ else "the default"
    try:
        # Private: the logs hold whatever the ranks print, tokens included.
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = None if os.access(path, os.W_OK) else "it is not writable"
    except OSError as exc:
        problem = f"{type(exc).__name__}: {exc.strerror or exc}"
    if problem:
        raise LaunchError(
            f"cannot use {path} (from {chosen_by}) for the run's logs: {problem}. Pass "
            "run_dir= a directory you can write to (or set NBLAUNCH_RUN_DIR)."
        )
    if base is not None:
        _prune_runs(base, keep=path)
    return path


# A run directory nblaunch named itself: "20261203-084512-3fa9c1".
_RUN_DIR_NAME = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")


def _prune_runs(base: Path, keep: Path) -> None:
    """Remove the oldest of nblaunch's own run directories under ``base``, keeping the newest
    ``NBLAUNCH_KEEP_RUNS`` (default ``KEEP_RUNS``; 0 keeps every one). Best effort."""
    import shutil

    try:
        limit = int(os.environ.get("NBLAUNCH_KEEP_RUNS", KEEP_RUNS))
        with os.scandir(base) as entries:  # no stat per entry: this runs at every launch
            runs = sorted(e.path for e in entries if _RUN_DIR_NAME.match(e.name) and e.is_dir())
    except (OSError, ValueError):
        return
    if limit <= 0:
        return
    for old in runs[: max(0, len(runs) - limit)]:  # names sort by time
        if old != str(keep):
            shutil.rmtree(old, ignore_errors=True)


# --- the payload ---------------------------------------------------------------------------------


def serialize_payload(
    function: Any, args: tuple[Any, ...] | list[Any] = (), kwargs: dict[str, Any] | None = None
) -> bytes:
    """Pickle ``(function, args, kwargs)`` with cloudpickle.

    Raises
    ------
    LaunchError
        When something does not pickle, naming the object (``args[1]``, ``kwargs['f']``, the
        variable ``lock`` the function uses) and its type.
    """
    from nblaunch import pickling

    if not isinstance(args, (tuple, list)):
        raise LaunchError(f"args must be a tuple of arguments, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise LaunchError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    try:
        return pickling.dumps((function, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        culprit = find_unpicklable(function, args, kwargs or {})
        what = culprit or "the function or its arguments"
        raise LaunchError(
            f"{what} cannot be sent to the ranks: {type(exc).__name__}: {exc}. "
            "Ranks are separate processes; create such objects inside the function instead "
            "of passing them in."
        ) from None


def find_unpicklable(function: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
    """Name the first object in the payload that does not pickle, e.g. ``args[0]['lock']``."""
    candidates: list[tuple[str, Any]] = [(f"args[{i}]", a) for i, a in enumerate(args)]
    candidates += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    candidates += [
        (f"variable {name!r} used by the function", value)
        for name, value in _function_references(function)
    ]
    for label, value in candidates:
        found = _first_unpicklable(label, value, depth=0)
        if found:
            return found
    return None


def _function_references(function: Any) -> list[tuple[str, Any]]:
    """Closure cells, referenced globals, defaults and bound objects of a function."""
    refs: list[tuple[str, Any]] = []
    if isinstance(function, types.MethodType):
        refs.append(("self", function.__self__))
        function = function.__func__
    if hasattr(function, "func") and hasattr(function, "args"):  # functools.partial
        refs += [(f"partial argument {i}", a) for i, a in enumerate(function.args)]
        refs += [(f"partial argument {k}", v) for k, v in (function.keywords or {}).items()]
        function = function.func
    code = getattr(function, "__code__", None)
    if code is None:
        return refs
    for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
        with contextlib.suppress(ValueError):
            refs.append((name, cell.cell_contents))
    module_globals = getattr(function, "__globals__", {})
    refs += [(name, module_globals[name]) for name in code.co_names if name in module_globals]
    refs += [(f"default {i}", d) for i, d in enumerate(function.__defaults__ or ())]
    return refs


def _first_unpicklable(label: str, value: Any, depth: int) -> str | None:
    import cloudpickle

    try:
        cloudpickle.dumps(value)
        return None
    except Exception:
        pass
    if depth < 3:
        items: list[tuple[str, Any]] = []
        if isinstance(value, dict):
            items = [(f"{label}[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = [(f"{label}[{i}]", v) for i, v in enumerate(value)]
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            items = [(f"{label}.{k}", v) for k, v in vars(value).items()]
        for sub_label, sub_value in items:
            found = _first_unpicklable(sub_label, sub_value, depth + 1)
            if found:
                return found
    return f"{label} (a {type(value).__module__}.{type(value).__qualname__})"


# --- running -------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    """What the run collected; the launcher turns it into a return value or an exception."""

    results: dict[int, bytes] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # Failure events and deaths
    finished: set[int] = field(default_factory=set)
    root: dict[str, Any] | None = None


class Monitor(Protocol):
    """Watches a run from the parent (hang detection, ...); see ``Run.monitors``."""

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        """See every event a rank sends (heartbeats, failures, ...)."""

    def check(self, run: Run) -> dict[str, Any] | None:
        """Called about 20 times a second; return a root cause to stop the run, else None.

        A root cause is a dict with ``kind``, ``rank``, ``message``, ``secondary=False`` and
        ``exception`` (the exception the caller gets).
        """


def make_monitors(plan: LaunchPlan) -> list[Monitor]:
    """The parent-side monitors for a run (empty until a feature module provides one)."""
    monitors: list[Monitor] = []
    with contextlib.suppress(ModuleNotFoundError):
        from nblaunch.watchdog import HangMonitor  # type: ignore[attr-defined]

        monitors.append(HangMonitor(plan))
    with contextlib.suppress(ModuleNotFoundError):
        from nblaunch.memory import BatchSizeMonitor

        monitors.append(BatchSizeMonitor(plan))
    return monitors


class Run:
    """One launch: start the ranks, watch them, stop them, report.

    Parameters
    ----------
    plan
        The validated launch plan.
    view
        Where events go (widget, text, none).
    """

    def __init__(self, plan: LaunchPlan, view: EventSink) -> None:
        self.plan = plan
        self.view = view
        self.supervisor = Supervisor(plan.world_size, plan.start_method)
        self.relay: Relay | None = None
        self.outcome = _Outcome()
        self.started_at = time.time()
        self.states: dict[int, RunState] = {}
        self.monitors = make_monitors(plan)
        self.task_ranks: list[int] = list(range(plan.world_size))  # the ranks running a task

    def execute(self, payload: bytes) -> list[Any]:
        """Run the payload on every rank and return the results, or raise the root cause."""
        __tracebackhide__ = True
        interrupted = False
        try:
            self.start()
            self.send_task(payload)
            self._watch()
            while self._restart_requested():  # e.g. a peer's out-of-memory left ranks blocked
                self._restart(payload)
                self._watch()
        except KeyboardInterrupt:
            interrupted = True
            self._stop_on_interrupt()
        finally:
            self._finish()
        if interrupted:
            raise KeyboardInterrupt
        return self._conclude()

    def start(self) -> None:
        """Start the ranks, open the relay, announce the run and send every rank its setup."""
        self.supervisor.start(setup=self.plan.setup_message)
        self.relay = Relay(self.supervisor.ranks, self.view, self.plan.run_dir)
        self.announce()
        for rank in self.supervisor.ranks:
            self.set_state(rank.rank, RunState.STARTING)

    def announce(self, warnings: list[str] | None = None, notes: list[str] | None = None) -> None:
        """Publish the run's header (``RunInfo``); a pool sends one per task, to each new view."""
        plan = self.plan
        self.publish(
            {
                "kind": "run_info",
                "world_size": plan.world_size,
                "device_kind": plan.device_kind,
                "start_method": plan.start_method,
                "debug": plan.debug,
                "run_dir": str(plan.run_dir) if plan.run_dir else "",
                "warnings": plan.warnings if warnings is None else warnings,
                "notes": plan.notes if notes is None else notes,
                "started_at": self.started_at,
            }
        )

    def send_task(self, payload: bytes, task_id: int = 0, ranks: list[int] | None = None) -> None:
        """Send one task to ``ranks`` (default: all); the run then waits for those ranks only."""
        self.task_ranks = list(range(self.plan.world_size)) if ranks is None else list(ranks)
        message = {
            "kind": TASK,
            "payload": payload,
            "task_id": task_id,
            # Only a task on every rank may make the default group again (a collective).
            "all_ranks": len(self.task_ranks) == self.plan.world_size,
        }
        for rank in self.task_ranks:
            self.supervisor.send(self.supervisor.ranks[rank], message)

    def publish(self, event: Event) -> None:
        if self.relay is not None:
            self.relay.publish(event)
        else:
            self.view.handle(event)

    def set_state(self, rank: int, state: RunState, detail: str = "") -> None:
        if self.states.get(rank) == state and not detail:
            return
        self.states[rank] = state
        self.publish({"kind": "state", "rank": rank, "state": state, "detail": detail})

    # --- watching --------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Relay until every rank returned, a root cause is known, or the timeout runs out."""
        assert self.relay is not None
        outcome = self.outcome
        deadline = None if self.plan.timeout is None else time.monotonic() + self.plan.timeout
        secondary_since: float | None = None
        while True:
            for event in self.relay.poll(0.05):
                self._on_event(event)
            for rank in self.supervisor.reap():
                for event in self.relay.drain_events(rank.rank):
                    self._on_event(event)
                if rank.rank not in outcome.finished:
                    self._on_death(rank.rank, rank.exitcode)
            if len(outcome.results) == len(self.task_ranks):
                return
            for monitor in self.monitors:
                root = monitor.check(self)
                if root is not None:
                    outcome.root = root
                    return
            primaries = [f for f in outcome.failures if not f["secondary"]]
            if primaries and not self._verdict_pending(primaries[0]):
                outcome.root = primaries[0]
                return
            if outcome.failures:
                secondary_since = secondary_since or time.monotonic()
                if time.monotonic() - secondary_since > SECONDARY_GRACE_S:
                    outcome.root = outcome.failures[0]
                    return
            if deadline is not None and time.monotonic() > deadline:
                self._on_timeout()
                return

    def _verdict_pending(self, first: dict[str, Any]) -> bool:
        """Debug mode's verdict is reached by every rank at once: wait briefly for the others'
        (``VERDICT_WAIT_S``), so that the report can say it was raised everywhere."""
        if not _is_verdict(first):
            return False
        failed = {f["rank"] for f in self.outcome.failures}
        waited = time.monotonic() - first.get("received_at", float("-inf"))
        return not failed >= set(self.task_ranks) and waited < VERDICT_WAIT_S

    def _on_event(self, event: dict[str, Any]) -> None:
        for monitor in self.monitors:
            monitor.on_event(self, event)
        kind = event["kind"]
        rank = event.get("rank")
        if kind == "started":
            self.set_state(rank, RunState.RUNNING)
        elif kind == "result":
            self.outcome.results[rank] = event["value_bytes"]
        elif kind == "failure":
            event = dict(event)
            event["secondary"] = errors.is_secondary_failure(event["exc_type"], event["message"])
            event["received_at"] = time.monotonic()
            self.outcome.failures.append(event)
            self.set_state(
                rank, RunState.FAILED, f"{_short_type(event['exc_type'])}: {event['message']}"[:200]
            )
        elif kind == "finished":
            self.outcome.finished.add(rank)
            if rank in self.outcome.results:
                self.set_state(rank, RunState.DONE)
        elif kind == "progress" and event.get("what") == "batch_size":
            data = event.get("data") or {}
            state = RunState.RUNNING if data.get("done") else RunState.RETRYING
            for each in data.get("ranks", [rank]):  # one rank speaks for all after agreeing
                if self.states.get(each) in (RunState.RUNNING, RunState.RETRYING):
                    self.set_state(each, state)

    def _restart_requested(self) -> bool:
        root = self.outcome.root
        # Only ranks this node started itself can be started again (not a multi-node run's);
        # otherwise the request's own exception is raised.
        return (
            root is not None and root["kind"] == "restart" and type(self.supervisor) is Supervisor
        )

    def _restart(self, payload: bytes) -> None:
        """Stop every rank and start them again with the setup options a monitor asked for.

        ``nblaunch.memory.BatchSizeMonitor`` asks for this when a rank ran out of memory while
        its peers were blocked in a collective of the same step: only fresh processes, all at
        the smaller batch size, can go on from there. Output and log files carry on.
        """
        request = self.outcome.root
        assert request is not None and self.relay is not None
        if request.get("progress"):
            self.publish(request["progress"])
        old = self.supervisor
        old.stop(grace=STOP_GRACE_S)
        self.relay.drain_output(timeout=1.0)
        for rank in old.ranks:
            self.relay.remove(rank)
        old.close()
        self.plan.options.update(request.get("options") or {})
        self.plan.master_port = _choose_port(self.plan.master_addr, None)
        self.outcome = _Outcome()
        self.monitors = make_monitors(self.plan)  # fresh processes, fresh observations
        self.supervisor = Supervisor(self.plan.world_size, self.plan.start_method)
        self.supervisor.start(setup=self.plan.setup_message)
        for rank in self.supervisor.ranks:
            self.relay.add(rank)
            self.set_state(rank.rank, RunState.STARTING, request["message"])
        self.send_task(payload)

    def _on_death(self, rank: int, exitcode: int | None) -> None:
        words, signum = errors.describe_exit(exitcode)
        self.outcome.finished.add(rank)
        self.outcome.failures.append(
            {
                "kind": "death",
                "rank": rank,
                "exitcode": exitcode,
                "signal": signum,
                "message": words,
                "exc_type": "",
                "secondary": False,
            }
        )
        self.set_state(rank, RunState.FAILED, words)

    def _on_timeout(self) -> None:
        running = sorted(r for r in range(self.plan.world_size) if r not in self.outcome.finished)
        names = ", ".join(str(r) for r in running)
        self.outcome.root = {
            "kind": "timeout",
            "rank": running[0] if running else 0,
            "message": (
                f"timeout={self.plan.timeout:g} s ran out with rank(s) {names} of "
                f"{self.plan.world_size} still running; they were stopped"
            ),
            "secondary": False,
        }

    # --- stopping --------------------------------------------------------------------------------

    def _stop_on_interrupt(self) -> None:
        """The notebook was interrupted: SIGINT every rank, then escalate; within ~5 s in all."""
        try:
            self.supervisor.interrupt()
            deadline = time.monotonic() + 1.5
            while self.supervisor.alive() and time.monotonic() < deadline:
                if self.relay is not None:
                    self.relay.poll(0.05)
                self.supervisor.reap()
                if all(r.rank in self.outcome.finished or r.ended for r in self.supervisor.ranks):
                    break
        except KeyboardInterrupt:
            pass  # a second interrupt: go straight on to stopping
        for rank in range(self.plan.world_size):
            if self.states.get(rank) not in (RunState.DONE, RunState.FAILED):
                self.set_state(rank, RunState.STOPPED, "interrupted")

    def _finish(self) -> None:
        """Stop every rank (asking nicely first when the run went well) and close everything."""
        supervisor = self.supervisor
        ok = len(self.outcome.results) == self.plan.world_size
        try:
            if ok:
                # The watch loop ends at the last Result; that rank's Finished may not be read yet.
                for rank in sorted(self.outcome.results):
                    self.set_state(rank, RunState.DONE)
                for rank in supervisor.ranks:
                    supervisor.send(rank, {"kind": STOP})
                self._relay_until_hung_up(timeout=5.0)
            else:
                reason = self._stop_reason()
                for rank in range(self.plan.world_size):
                    if rank not in self.outcome.finished and self.states.get(rank) in (
                        RunState.STARTING,
                        RunState.RUNNING,
                        RunState.STALLED,
                    ):
                        self.set_state(rank, RunState.STOPPED, reason)
            root_kind = (self.outcome.root or {}).get("kind")
            if root_kind in ("failure", "death", "hang"):
                # The cause is known and the others are most likely blocked in a collective
                # they cannot finish: they get half a second, and being killed is no news.
                supervisor.stop(grace=KNOWN_CAUSE_GRACE_S, quiet=True)
            else:
                supervisor.stop(grace=STOP_GRACE_S)
        except KeyboardInterrupt:
            supervisor.stop(grace=0.0)
            raise
        finally:
            if self.relay is not None:
                self.relay.drain_output(timeout=1.0)
                self.publish(self._run_ended(ok))
                self.relay.close()
            supervisor.close()
            self.view.close()

    def _stop_reason(self) -> str:
        """Why the ranks still running are being stopped, for their badges."""
        root = self.outcome.root or {}
        if root.get("kind") == "hang":
            return "stopped: the ranks could not make progress (see the error)"
        if root.get("kind") == "timeout":
            return f"stopped: timeout={self.plan.timeout:g} s ran out"
        if "rank" in root:
            return f"stopped after rank {root['rank']} failed"
        return "stopped"

    def _relay_until_hung_up(self, timeout: float) -> None:
        """Keep reading output while the stopped ranks shut down, until each has closed its
        pipes (its last words) or exited; those still exiting are left to exit on their own."""
        assert self.relay is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.supervisor.reap()
            if all(self.relay.hung_up(rank.rank) for rank in self.supervisor.alive()):
                break
            self.relay.poll(0.01)
        self.supervisor.let_go([r for r in self.supervisor.alive() if self.relay.hung_up(r.rank)])

    def _run_ended(self, ok: bool) -> Event:
        outcomes: dict[int, str] = {}
        for rank in self.task_ranks:
            if rank in self.outcome.results:
                outcomes[rank] = "returned"
            else:
                failure = next((f for f in self.outcome.failures if f["rank"] == rank), None)
                if failure is None:
                    outcomes[rank] = "stopped"
                elif failure["kind"] == "death":
                    outcomes[rank] = failure["message"]
                else:
                    first_line = (failure["message"].splitlines() or [""])[0]
                    outcomes[rank] = f"{_short_type(failure['exc_type'])}: {first_line}"
        return {
            "kind": "run_ended",
            "ok": ok,
            "elapsed_s": time.time() - self.started_at,
            "ranks": outcomes,
        }

    # --- reporting -------------------------------------------------------------------------------

    def _conclude(self) -> list[Any]:
        """Return the results by rank, or raise the root cause."""
        __tracebackhide__ = True
        import cloudpickle

        outcome = self.outcome
        if outcome.root is None and len(outcome.results) == len(self.task_ranks):
            values = []
            for rank in self.task_ranks:
                try:
                    values.append(cloudpickle.loads(outcome.results[rank]))
                except Exception as exc:
                    raise LaunchError(
                        f"rank {rank}'s return value cannot be unpickled here: "
                        f"{type(exc).__name__}: {exc}"
                    ) from None
            return values
        root = outcome.root or {"kind": "timeout", "rank": 0, "message": "no rank reported"}
        exc = self._exception_for(root)
        raise exc

    def _exception_for(self, root: dict[str, Any]) -> BaseException:
        """The exception to raise in the notebook for the root-cause failure."""
        n = self.plan.world_size
        rank = root["rank"]
        others = [
            _describe_failure(f)
            for f in self.outcome.failures
            if f is not root and f["rank"] != rank
        ]
        log_hint = (
            f" Its full output is in {self.plan.run_dir / f'rank{rank}.log'}."
            if self.plan.run_dir
            else ""
        )
        if "exception" in root:  # a monitor's diagnosis (e.g. a hang) brings its own exception
            exc = root["exception"]
            self.publish(
                {
                    "kind": "diagnosis",
                    "title": root.get("title", str(exc).splitlines()[0]),
                    "body": str(exc),
                    "severity": "error",
                    "rank": rank,
                    "secondary": others,
                }
            )
            hint = self._debug_hint(root, exc)
            if hint:
                add_note(exc, hint)
            return exc
        if root["kind"] == "timeout":
            return LaunchTimeoutError(root["message"], rank=rank, world_size=n)
        if root["kind"] == "death":
            tail = "\n".join(self.relay.tails.get(rank, ())) if self.relay else ""
            message = f"rank {rank} of {n} {root['message']}.{log_hint}"
            if tail:
                message += f"\nIts last output:\n{_indent(tail)}"
            exc: BaseException = RankFailedError(
                message, rank=rank, world_size=n, exitcode=root["exitcode"], signal=root["signal"]
            )
        else:
            exc = _recreate_exception(root, n)
        if isinstance(exc, SystemExit):  # never ends the caller's script or kernel
            exc = _exit_failure(exc, rank, n)
        note = f"raised on rank {rank} of {n}"
        alike = self._same_failure_everywhere(root)
        if alike:
            # Debug mode's verdict, reached by every rank together: no rank is the culprit.
            note = f"raised on every rank ({len(alike)} of {n}), with the same message"
            others = [line for line in others if line not in map(_describe_failure, alike)]
        elif root["secondary"]:
            note += " (it looks like a consequence of a peer's failure; no other cause was seen)"
        if others:
            note += "\nOther ranks:\n" + "\n".join(f"  {line}" for line in others)
        hint = self._debug_hint(root, exc)
        if hint:
            note += f"\n{hint}"
        add_note(exc, note)
        self.publish(
            {
                "kind": "diagnosis",
                "title": f"rank {rank} of {n} failed: {_describe_failure(root)}",
                "body": root.get("traceback", "") or root["message"],
                "severity": "error",
                "rank": rank,
                "secondary": others,
            }
        )
        return exc

    def _same_failure_everywhere(self, root: dict[str, Any]) -> list[dict[str, Any]]:
        """Every task rank's failure when all raised debug mode's verdict, the root's, else []."""
        if not _is_verdict(root):
            return []
        alike = {
            f["rank"]: f
            for f in self.outcome.failures
            if f["kind"] == "failure"
            and (f["exc_type"], f["message"]) == (root["exc_type"], root["message"])
        }
        return [alike[r] for r in self.task_ranks] if set(alike) == set(self.task_ranks) else []

    def _debug_hint(self, root: dict[str, Any], exc: BaseException) -> str:
        """Suggest debug mode when a run without it failed or stalled inside a collective."""
        if self.plan.debug:
            return ""
        if root["kind"] != "hang" and not _failed_in_collective(
            f"{root.get('traceback', '')}\n{root.get('message', '')}\n{safe_str(exc)}"
        ):
            return ""
        return (
            "This happened inside a torch.distributed collective: run with debug=True "
            "(%%distributed --debug, or NBLAUNCH_DEBUG=1) to check that every rank passes "
            "the same shapes, dtypes and devices to each collective."
        )


# A traceback frame inside one of torch.distributed's collectives (not its set-up calls).
_COLLECTIVE_FRAME = re.compile(
    r'distributed_c10d\.py", line \d+, in (all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*'
    r"|reduce|gather\w*|scatter\w*|all_to_all\w*|barrier|monitored_barrier|send|recv|isend|irecv"
    r"|batch_isend_irecv)\b"
)


def _failed_in_collective(text: str) -> bool:
    """True when a failure's traceback or message shows it happened in a collective: a frame of
    a torch.distributed collective, or gloo/NCCL saying the collectives did not match."""
    return bool(_COLLECTIVE_FRAME.search(text)) or "collective mismatch" in text.lower()


def _recreate_exception(failure: dict[str, Any], world_size: int) -> BaseException:
    """Unpickle the rank's own exception; fall back to ``RankFailedError`` with its traceback."""
    rank = failure["rank"]
    if failure.get("exception_bytes"):
        try:
            from tblib import pickling_support  # noqa: F401  (registers the unpicklers)

            exc = pickle.loads(failure["exception_bytes"])
            if isinstance(exc, BaseException):
                return tracebacks.make_readable(exc, failure.get("traceback", ""))
        except Exception:
            pass
    return RankFailedError(
        f"rank {rank} of {world_size} raised {failure['exc_type']}: {failure['message']}\n\n"
        f"Remote traceback:\n{failure['traceback']}",
        rank=rank,
        world_size=world_size,
        remote_traceback=failure["traceback"],
    )


def _describe_failure(failure: dict[str, Any]) -> str:
    if failure["kind"] == "failure":
        exc_type = _short_type(failure["exc_type"])
        first_line = (failure["message"].splitlines() or [""])[0]  # reports can be tables
        text = f"rank {failure['rank']} raised {exc_type}: {first_line}"
        if failure["secondary"]:
            text += " (a consequence of a peer's failure)"
        return text
    return f"rank {failure['rank']} {failure['message']}"


def _exit_failure(exit_: SystemExit, rank: int, world_size: int) -> RankFailedError:
    """``sys.exit(code)`` with a failing code on a rank, as the caller's error."""
    # The code as the rank passed it (an unpickled SystemExit keeps only its args).
    code = exit_.args[0] if len(exit_.args) == 1 else (exit_.args or None)
    return RankFailedError(
        f"rank {rank} of {world_size} called sys.exit({code!r})",
        rank=rank,
        world_size=world_size,
        exitcode=code if isinstance(code, int) else 1,  # Python exits 1 for a message
    )


def _is_verdict(failure: dict[str, Any]) -> bool:
    """Whether a failure is debug mode's DistributedOperationException (raised by every rank)."""
    return failure["kind"] == "failure" and failure["exc_type"].endswith(
        ".DistributedOperationException"
    )


def _short_type(qualified: str) -> str:
    return qualified.removeprefix("builtins.")


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note`` where Python has it (3.11+); a plain attribute before that."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


# --- TPU-like devices ----------------------------------------------------------------------------


def _launch_xla(plan: LaunchPlan, payload: bytes) -> list[Any]:  # pragma: no cover - needs XLA
    """Run on XLA devices through torch_xla's own spawn, which owns device placement there."""
    import cloudpickle
    import torch_xla.distributed.xla_multiprocessing as xmp  # type: ignore[import-not-found]

    results = xmp.spawn(_xla_trampoline, args=(payload,), start_method="fork")
    return [cloudpickle.loads(r) for r in results] if results else []


def _xla_trampoline(index: int, payload: bytes) -> bytes:  # pragma: no cover - needs XLA
    import cloudpickle

    function, args, kwargs = cloudpickle.loads(payload)
    return cloudpickle.dumps(function(*args, **kwargs))
