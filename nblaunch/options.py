"""The choices every front end offers, in one table, and the environment switches.

The Python API, ``%%distributed``, ``%dist``, the pool and the command line all validate and
document their choices from here, so a new start method or device type is added once.
"""

from __future__ import annotations

import os

# How ranks are started (see nblaunch.supervisor): the first is the default.
START_METHODS = ("forkserver", "spawn", "fork")
# Kinds of device a rank can use; None (not listed) means "detect".
DEVICE_TYPES = ("cuda", "cpu", "xla")
# How the notebook may start the other nodes' join commands itself (nblaunch.node_start).
START_NODES = ("ssh", "srun")
# Where a run is shown: a widget in a notebook, text in a terminal, or nowhere.
DISPLAY_MODES = ("auto", "widget", "text", "none")
# Levels of the loggers nblaunch.get_logger gives ranks.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Default hang_timeout: how long nothing may move while ranks wait in collectives.
DEFAULT_HANG_TIMEOUT_S = 300.0

TRUE_VALUES = ("1", "true", "yes", "on")
# What Accelerate (accelerate.utils.str_to_bool) reads as false.
FALSE_VALUES = ("0", "false", "no", "off", "n", "f")


def env_flag(*names: str) -> bool:
    """True when any of the environment variables is 1/true/yes/on (any case)."""
    return any(os.environ.get(name, "").strip().lower() in TRUE_VALUES for name in names)


def env_off(name: str) -> bool:
    """True when the environment variable is set to 0/false/no/off (any case)."""
    return os.environ.get(name, "").strip().lower() in FALSE_VALUES


def debug_from_env() -> bool:
    """Debug mode from ``NBLAUNCH_DEBUG`` (or Accelerate's ``ACCELERATE_DEBUG_MODE``)."""
    return env_flag("NBLAUNCH_DEBUG", "ACCELERATE_DEBUG_MODE")
