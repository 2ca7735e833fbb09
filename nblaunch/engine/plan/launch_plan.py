"""Planning a launch: check every argument, decide devices, backend, port and run directory,
and serialise the function, before any process starts.

Anything wrong is a ``LaunchError`` here, naming the argument and the fix; nothing has started.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import socket
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nblaunch.engine.plan import xla
from nblaunch.engine.plan.devices import detect_devices
from nblaunch.engine.plan.run_dirs import RunLease, new_run_dir
from nblaunch.engine.processes.supervisor import check_start_method
from nblaunch.errors import LaunchError
from nblaunch.events import SETUP, RunInfo, Setup
from nblaunch.options import (
    DEFAULT_MONITOR_INTERVAL_S,
    FALSE_VALUES,
    LaunchOptions,
    check_environment,
    checks_from_env,
    debug_from_env,
    env_whole,
    log_level_from_env,
)
from nblaunch.ranks.checks import process_groups

# More CPU ranks than this per core are refused unless NBLAUNCH_MAX_PROCESSES allows them.
CPU_RANKS_PER_CORE = 4


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
    # Accelerate's mode for the ranks (ACCELERATE_MIXED_PRECISION); None leaves the variable be.
    mixed_precision: str | None = None
    # Whole-run restarts after a failure (max_restarts=), and how many happened so far.
    max_restarts: int = 0
    restart_count: int = 0
    # How long the engine waits for the ranks before it looks at quiet ones again.
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL_S
    # Every rank sends a fingerprint of each collective and the launcher compares them
    # (nblaunch.ranks.checks.fingerprints, nblaunch.engine.monitors.collective_checks); off under
    # debug mode, which checks before each call instead.
    checks: bool = False
    # How the default group meets: "xla://" on TPUs (torch_xla's rendezvous, on nblaunch's
    # store); None: nblaunch's store directly.
    init_method: str | None = None
    # The port of each rank's TPU runtime on this host (TPU_PROCESS_ADDRESSES); empty elsewhere.
    runtime_ports: list[int] = field(default_factory=list)
    # The run's hold on run_dir while it lives, so that no pruning deletes it (run_dirs).
    run_lease: RunLease | None = field(default=None, repr=False, compare=False)

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
            # torchrun's elastic agent says which attempt this is: code resumes from there.
            TORCHELASTIC_RESTART_COUNT=str(self.restart_count),
            TORCHELASTIC_MAX_RESTARTS=str(self.max_restarts),
        )
        if self.mixed_precision is not None:  # what Accelerator() reads
            env["ACCELERATE_MIXED_PRECISION"] = self.mixed_precision
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
        if self.device_type == "xla":  # the PJRT runtime's layout: one chip per rank
            env.update(xla.runtime_env(env, rank, self.world_size, self.runtime_ports))
        # The flight recorder names the collective a rank waits in (hang reports).
        process_groups.enable_flight_recorder(env)
        loopback = loopback_interface() if is_loopback(self.master_addr) else None
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

    def run_info(
        self, started_at: float, warnings: list[str] | None = None, notes: list[str] | None = None
    ) -> RunInfo:
        """The run's header for the views (``warnings``/``notes``: in place of the plan's)."""
        return {
            "kind": "run_info",
            "world_size": self.world_size,
            "device_kind": self.device_kind,
            "start_method": self.start_method,
            "debug": self.debug,
            "checks": self.checks,
            "run_dir": str(self.run_dir) if self.run_dir else "",
            "warnings": self.warnings if warnings is None else warnings,
            "notes": self.notes if notes is None else notes,
            "started_at": started_at,
        }

    def setup_message(self, rank: int) -> Setup:
        return {
            "kind": SETUP,
            "env": self.rank_env(rank),
            "sys_path": list(sys.path),
            "cwd": os.getcwd(),
            # What the caller's multiprocessing would use (a DataLoader's workers): "fork" on
            # Linux, as under torchrun, not the forkserver that started the rank.
            "mp_start_method": multiprocessing.get_start_method(),
            "backend": self.backend,
            "init_method": self.init_method,
            "device_type": self.device_type,
            "init_process_group": self.init_process_group,
            "debug": self.debug,
            "launcher_pid": os.getpid(),
            "num_threads": self.threads_per_rank if self.device_type == "cpu" else None,
            "options": {
                "log_level": self.log_level,
                "hang_timeout": self.hang_timeout,
                "checks": self.checks,
                **self.options,
            },
        }


# --- planning ------------------------------------------------------------------------------------


def plan_launch(
    function: Any, num_processes: int | None, options: LaunchOptions | None = None
) -> LaunchPlan:
    """Decide devices, backend, port and run directory for ``function`` on ``num_processes``
    ranks with ``options`` (already checked when made).

    Raises
    ------
    LaunchError
        Naming the bad argument and what to pass instead.
    """
    if not callable(function):
        raise LaunchError(
            f"function must be callable, got {type(function).__name__} {function!r:.80}"
        )
    options = options or LaunchOptions()
    check_environment()
    check_start_method(options.start_method)
    warnings: list[str] = []
    devices = detect_devices(options.device_type)
    device_type, device_count = devices.type, devices.count
    if num_processes is None:
        num_processes = 1 if devices.one_rank_default else device_count
        if device_type == "cpu":
            warnings.append(
                "no GPU found: running 1 CPU rank; pass num_processes=N (%%distributed -n N) "
                "for more CPU ranks"
            )
        elif devices.one_rank_default:
            warnings.append(
                f"{devices.kind}: running 1 rank; pass num_processes=N for N ranks, each with "
                "an XLA device of its own"
            )
    if isinstance(num_processes, bool) or not isinstance(num_processes, int):
        raise LaunchError(
            f"num_processes must be a whole number of ranks, got {num_processes!r} "
            f"({type(num_processes).__name__})"
        )
    if num_processes < 1:
        raise LaunchError(f"num_processes must be at least 1, got {num_processes}")
    if not devices.one_rank_default and num_processes > device_count:
        raise LaunchError(
            f"num_processes={num_processes} but only {device_count} {devices.kind} "
            f"device(s) are visible; use at most {device_count}, or device_type='cpu'"
        )
    if devices.one_rank_default:
        _check_cpu_ranks(num_processes, warnings)
    _check_working_directory()
    from nblaunch.engine.plan.doctor import launch_warnings  # not at import: ~9 ms

    warnings += launch_warnings(device_type, num_processes)  # old kernel, mixed GPUs
    notes = _cpu_library_notes(device_type, num_processes, warnings)
    port = choose_port(options.master_addr, options.master_port)
    run_dir, run_lease = new_run_dir(options.run_dir)
    debug = debug_from_env() if options.debug is None else bool(options.debug)
    checks = not debug and options.debug is None and checks_from_env()
    if checks:
        warnings += _recorder_warnings()
    return LaunchPlan(
        world_size=num_processes,
        device_type=device_type,
        backend=devices.backend,
        init_method=devices.init_method,
        runtime_ports=xla.runtime_ports(devices, num_processes, options.master_addr),
        start_method=options.start_method,
        master_addr=options.master_addr,
        master_port=port,
        debug=debug,
        checks=checks,
        init_process_group=bool(options.setup_process_group),
        timeout=options.timeout,
        hang_timeout=options.hang_timeout,
        log_level=options.log_level or log_level_from_env(),
        run_dir=run_dir,
        run_lease=run_lease,
        device_kind=devices.kind,
        warnings=warnings,
        notes=notes,
        # nblaunch.ranks.debugger reads it in the ranks (kept out of the options when off).
        options={"debug_on_error": True} if options.debug_on_error else {},
        mixed_precision=options.mixed_precision,
        max_restarts=options.max_restarts,
        monitor_interval=options.monitor_interval,
    )


def _recorder_warnings() -> list[str]:
    """What the checks cannot see when the user turned torch's flight recorder off."""
    if process_groups.recorder_size() != 0:
        return []
    return [
        "TORCH_FR_BUFFER_SIZE=0 turns torch's flight recorder off: the checks see only "
        "collectives called from Python (dist.all_reduce, ...), not those torch issues itself "
        "(DDP's gradient all-reduce, FSDP's all-gathers); unset it (nblaunch keeps "
        f"{process_groups.FLIGHT_RECORDER_ENTRIES} entries) or use debug=True"
    ]


def _check_cpu_ranks(num_processes: int, warnings: list[str]) -> None:
    """Refuse far more CPU ranks than cores (each one is a process with torch loaded: ~300 MB);
    ``NBLAUNCH_MAX_PROCESSES`` raises the limit. Warn when ranks will share cores."""
    cores = os.cpu_count() or 1
    limit = CPU_RANKS_PER_CORE * cores
    limit = env_whole("NBLAUNCH_MAX_PROCESSES", limit, 1, "how many CPU ranks may run at most")
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
        if num_processes == 1:  # Accelerate runs one process undistributed ("NO")
            return ["CPU rank: ACCELERATE_USE_CPU=1 set so Accelerate and Transformers use the CPU"]
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


@functools.lru_cache(maxsize=16)
def is_loopback(address: str) -> bool:
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


def choose_port(master_addr: str, master_port: int | None) -> int:
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
        found = first_unpicklable(label, value, depth=0)
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


def first_unpicklable(label: str, value: Any, depth: int) -> str | None:
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
            found = first_unpicklable(sub_label, sub_value, depth + 1)
            if found:
                return found
    return f"{label} (a {type(value).__module__}.{type(value).__qualname__})"
