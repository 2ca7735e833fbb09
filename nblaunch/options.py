"""The choices every front end offers, in one table; the options of a launch, checked once;
and the environment switches.

The Python API, ``%%distributed``, ``%dist``, the pool and the command line build one
:class:`LaunchOptions` (and a :class:`NodeOptions` for several machines) from their own
arguments; it is checked when made and passed whole to the plan, so a new option or choice is
added here once.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import string
from typing import Any

from nblaunch.errors import LaunchError

# How ranks are started (see nblaunch.engine.processes.supervisor): the first is the default.
START_METHODS = ("forkserver", "spawn", "fork")
# Kinds of device a rank can use; None (not listed) means "detect".
# The device types nblaunch names in its help; any other torch knows (a PrivateUse1 plug-in's
# name) is accepted too (check_device_type).
DEVICE_TYPES = ("cuda", "cpu", "xla", "xpu", "npu", "hpu", "mps")
DEVICE_TYPE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
# How the notebook may start the other nodes' join commands itself (nblaunch.cluster.node_start).
START_NODES = ("ssh", "srun", "ray", "slurm")
# Where a run is shown: a widget in a notebook, text in a terminal, or nowhere.
DISPLAY_MODES = ("auto", "widget", "text", "none")
# Levels of the loggers nblaunch.get_logger gives ranks.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Default hang_timeout: how long nothing may move while ranks wait in collectives.
DEFAULT_HANG_TIMEOUT_S = 300.0
# Where the other nodes join when the caller gives no port (torchrun's default).
DEFAULT_RDZV_PORT = 29400
# torch's own default for the join timeout of the c10d rendezvous.
DEFAULT_RDZV_TIMEOUT_S = 600.0
# Accelerate's mixed-precision modes (accelerate.utils.PrecisionType), set for the ranks.
MIXED_PRECISIONS = ("no", "fp8", "fp16", "bf16")
# How often the engine looks at quiet ranks (exits, the hang watchdog, timeout=) by default.
DEFAULT_MONITOR_INTERVAL_S = 0.05
# The text view's line prefix: torchrun's log_line_prefix_template fields, "${rank}" or "{rank}".
DEFAULT_LINE_PREFIX = "[rank ${rank}] "
# A run id chosen by the caller (rdzv_id=): it names store keys and a file, so plain characters.
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

TRUE_VALUES = ("1", "true", "yes", "on")
# What Accelerate (accelerate.utils.str_to_bool) reads as false.
FALSE_VALUES = ("0", "false", "no", "off", "n", "f")


def env_switch(name: str) -> bool | None:
    """A yes/no environment switch: True, False, or None when it is unset or empty.

    Raises
    ------
    LaunchError
        Any other value, naming the variable and the values it takes.
    """
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return None
    if text in TRUE_VALUES:
        return True
    if text in FALSE_VALUES:
        return False
    raise LaunchError(
        f"{name}={os.environ[name]!r}: set it to 1, true, yes or on, or to 0, false, no or off "
        "(or unset it)"
    )


def env_flag(*names: str) -> bool:
    """True when any of the environment variables is 1/true/yes/on (any case)."""
    return any(env_switch(name) for name in names)


def env_off(name: str) -> bool:
    """True when the environment variable is set to 0/false/no/off (any case)."""
    return env_switch(name) is False


def env_whole(name: str, default: int, minimum: int, meaning: str) -> int:
    """A whole-number environment setting of at least ``minimum`` (``default`` when unset).

    Raises
    ------
    LaunchError
        Anything else, naming the variable, what it means and what it may be.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise LaunchError(
            f"{name}={os.environ[name]!r}: set it to {meaning} (a whole number, at least "
            f"{minimum}; unset: {default})"
        )
    return value


# Run directories kept under the default base: the newest finished ones (0 keeps every one).
KEEP_RUNS = 50
# Lines a view keeps per rank (NBLAUNCH_VIEW_LINES); the rank logs keep everything.
VIEW_LINES = 200


def keep_runs_from_env() -> int:
    """``NBLAUNCH_KEEP_RUNS``: how many finished run directories to keep (0 keeps every one)."""
    return env_whole(
        "NBLAUNCH_KEEP_RUNS", KEEP_RUNS, 0, "how many finished run directories to keep (0: all)"
    )


def log_level_from_env() -> str | None:
    """The ranks' log level from ``NBLAUNCH_LOG_LEVEL`` (or Accelerate's ``ACCELERATE_LOG_LEVEL``).

    Raises
    ------
    LaunchError
        A level ``logging`` does not know, naming the variable and the levels.
    """
    for name in ("NBLAUNCH_LOG_LEVEL", "ACCELERATE_LOG_LEVEL"):
        text = os.environ.get(name, "").strip()
        if text:
            if text.upper() not in LOG_LEVELS:
                raise LaunchError(f"{name}={text!r}: set it to one of {', '.join(LOG_LEVELS)}")
            return text
    return None


def view_lines_from_env() -> int:
    """``NBLAUNCH_VIEW_LINES``: the lines a view keeps per rank."""
    return env_whole("NBLAUNCH_VIEW_LINES", VIEW_LINES, 1, "how many lines a view keeps per rank")


def check_device_type(device_type: object) -> None:
    """Refuse a ``device_type`` that cannot name a torch device type.

    Raises
    ------
    LaunchError
        Naming the known types; ``"tpu"`` and ``"gpu"`` are told their torch names.
    """
    if device_type in ("tpu", "gpu"):
        torch_name = {"tpu": "xla", "gpu": "cuda"}[str(device_type)]
        raise LaunchError(
            f"device_type={device_type!r}: torch calls these devices {torch_name!r}; "
            f"pass device_type={torch_name!r}"
        )
    if not isinstance(device_type, str) or not DEVICE_TYPE_NAME.match(device_type):
        raise LaunchError(
            f"device_type={device_type!r} is not a device type: use one of "
            f"{', '.join(DEVICE_TYPES)}, or the name a plug-in registered with torch"
        )


def check_environment() -> None:
    """Check every ``NBLAUNCH_*`` setting a launch reads, so a bad value is named before
    anything starts (those read later, in the view or between cells, are then known good).

    Raises
    ------
    LaunchError
        The first bad value, naming the variable and what it may be.
    """
    for name in ("NBLAUNCH_DEBUG", "ACCELERATE_DEBUG_MODE", "NBLAUNCH_SPARE_RANKS"):
        env_switch(name)
    env_switch("NBLAUNCH_PRESTART")
    keep_runs_from_env()
    log_level_from_env()
    view_lines_from_env()
    if "NBLAUNCH_RUN_DIR" in os.environ and not os.environ["NBLAUNCH_RUN_DIR"].strip():
        raise LaunchError(
            "NBLAUNCH_RUN_DIR is set but empty: set it to the directory run logs go under "
            "(or unset it: .nblaunch/runs)"
        )


def debug_from_env() -> bool:
    """Debug mode from ``NBLAUNCH_DEBUG`` (or Accelerate's ``ACCELERATE_DEBUG_MODE``)."""
    return env_flag("NBLAUNCH_DEBUG", "ACCELERATE_DEBUG_MODE")


def checks_from_env() -> bool:
    """The out-of-band collective checks: on unless ``NBLAUNCH_CHECKS`` is 0/false/no/off."""
    return not env_off("NBLAUNCH_CHECKS")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How ranks are started and watched, whatever front end asked (see
    :func:`~nblaunch.notebook_launcher` for each field). Checked when made.

    Raises
    ------
    LaunchError
        Naming the bad option and what to pass instead.
    """

    start_method: str = "forkserver"
    # None: NBLAUNCH_DEBUG (or ACCELERATE_DEBUG_MODE) decides, and the out-of-band checks
    # are on (NBLAUNCH_CHECKS=0 turns them off); False turns both off.
    debug: bool | None = None
    log_level: str | None = None
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT_S
    timeout: float | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    setup_process_group: bool = True
    device_type: str | None = None
    run_dir: str | os.PathLike[str] | None = None
    debug_on_error: bool = False
    # Accelerate's notebook_launcher keywords with a meaning here (see docs/compat.md).
    mixed_precision: str | None = None  # None: ACCELERATE_MIXED_PRECISION is left as it is
    max_restarts: int = 0
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL_S

    def __post_init__(self) -> None:
        refuse_unknown_start_method(self.start_method)
        if isinstance(self.mixed_precision, str):  # Accelerate takes "FP16" too
            object.__setattr__(self, "mixed_precision", self.mixed_precision.lower())
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISIONS:
            raise LaunchError(
                f"mixed_precision={self.mixed_precision!r} is not one of "
                f"{', '.join(MIXED_PRECISIONS)} (Accelerate's modes)"
            )
        restarts = self.max_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise LaunchError(
                f"max_restarts must be a whole number of restarts >= 0, got {restarts!r}"
            )
        if not _positive_number(self.monitor_interval):
            raise LaunchError(
                "monitor_interval must be a positive number of seconds, got "
                f"{self.monitor_interval!r}"
            )
        if self.device_type is not None:
            check_device_type(self.device_type)
        for name in ("timeout", "hang_timeout"):
            value = getattr(self, name)
            if value is not None and not _positive_number(value):
                raise LaunchError(
                    f"{name} must be a positive number of seconds or None, got {value!r}"
                )

    def replace(self, **changes: object) -> LaunchOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class NodeOptions:
    """Where and how several machines meet (see :func:`~nblaunch.notebook_launcher`'s
    ``num_nodes``, ``rdzv_*``, ``start_nodes`` and ``hostfile``). Checked when made.

    Raises
    ------
    LaunchError
        Naming the bad option and what to pass instead.
    """

    num_nodes: int
    rdzv_endpoint: str | None
    rdzv_timeout: float | None = None  # None: DEFAULT_RDZV_TIMEOUT_S
    rdzv_id: str | None = None
    start_nodes: str | None = None
    hostfile: str | os.PathLike[str] | None = None
    # start_nodes="ray" or "slurm": the cluster's options (RayCluster, SlurmCluster)
    cluster: Any = None

    def __post_init__(self) -> None:
        num_nodes = self.num_nodes
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise LaunchError(
                f"num_nodes must be a whole number of machines >= 1, got {num_nodes!r}"
            )
        if self.rdzv_endpoint is None:
            raise LaunchError(
                f"num_nodes={num_nodes} needs rdzv_endpoint='host:port': an address of this "
                "machine that the other nodes can reach, e.g. "
                f"rdzv_endpoint='{socket.gethostname()}:{DEFAULT_RDZV_PORT}'"
            )
        if self.rdzv_timeout is None:
            object.__setattr__(self, "rdzv_timeout", DEFAULT_RDZV_TIMEOUT_S)
        if not _positive_number(self.rdzv_timeout):
            raise LaunchError(
                f"rdzv_timeout must be a positive number of seconds, got {self.rdzv_timeout!r}"
            )
        if self.rdzv_id is not None and not (
            isinstance(self.rdzv_id, str) and RUN_ID.match(self.rdzv_id)
        ):
            raise LaunchError(
                f"rdzv_id={self.rdzv_id!r}: a run id is 1 to 64 letters, digits, '.', '_' or "
                "'-', starting with a letter or digit"
            )
        self._check_start_nodes()

    def _check_start_nodes(self) -> None:
        if self.start_nodes is None:
            if self.hostfile is not None:
                raise LaunchError("hostfile= is for start_nodes='ssh'; pass that too")
            return
        if self.start_nodes not in START_NODES:
            raise LaunchError(
                f"start_nodes={self.start_nodes!r} is not one of {', '.join(START_NODES)} (or "
                "None: start the printed join command yourself)"
            )
        if self.start_nodes == "ssh" and self.hostfile is None:
            raise LaunchError(
                "start_nodes='ssh' needs hostfile=: a file naming the other machines, one per line"
            )
        if self.start_nodes == "srun" and not os.environ.get("SLURM_JOB_ID"):
            raise LaunchError(
                "start_nodes='srun' works inside a Slurm allocation (SLURM_JOB_ID is not set): "
                "run Jupyter inside salloc or sbatch, or use start_nodes='ssh' with a hostfile"
            )

    def replace(self, **changes: object) -> NodeOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def format_line_prefix(template: str, rank: int | str, local_rank: int | str | None = None) -> str:
    """The prefix of ``rank``'s lines from ``template`` (``log_line_prefix_template``).

    Fields are torchrun's, ``${rank}``, ``${local_rank}`` and ``${role_name}`` (always
    ``default``), or the same in ``str.format``'s braces: ``"[{rank}] "``. A line several
    ranks printed alike has their ranges as ``rank`` (``"0-7"``).

    Raises
    ------
    LaunchError
        A field the template names that is not one of these, or a malformed template.
    """
    values = {
        "rank": rank,
        "local_rank": rank if local_rank is None else local_rank,
        "role_name": "default",
    }
    try:
        text = string.Template(template).substitute(values)
        return text.format(**values) if "{" in text else text
    except (KeyError, ValueError, IndexError) as exc:
        raise LaunchError(
            f"log_line_prefix_template={template!r} cannot be filled in ({exc}): use "
            "${rank}, ${local_rank} or ${role_name} (or {rank}, ...), e.g. '[${rank}]: '"
        ) from None


def refuse_unknown_start_method(start_method: str) -> None:
    """Raise ``LaunchError`` unless ``start_method`` is one of ``START_METHODS``."""
    if start_method not in START_METHODS:
        raise LaunchError(
            f"start_method={start_method!r} is not one of {', '.join(START_METHODS)}; "
            "the default 'forkserver' is the fast and safe choice"
        )


def _positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
