"""Every ``NBLAUNCH_*`` setting is checked when a launch reads it: a bad value is a
``LaunchError`` that names the variable and the values it takes, before anything starts.

The fault sweep found them taken silently: ``NBLAUNCH_KEEP_RUNS=abc`` turned pruning off,
``MAX_PROCESSES=-3`` said "more than the limit of -3", ``RUN_DIR=""`` wrote into the working
directory, and ``DEBUG=maybe``, ``LOG_LEVEL=LOUD``, ``SPARE_RANKS=abc``, ``PRESTART=abc`` and
``VIEW_LINES=-5`` were accepted.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from nblaunch import LaunchError, notebook_launcher

BAD = [
    ("NBLAUNCH_KEEP_RUNS", "abc", "how many finished run directories to keep"),
    ("NBLAUNCH_KEEP_RUNS", "-3", "at least 0"),
    ("NBLAUNCH_MAX_PROCESSES", "-3", "how many CPU ranks may run at most.*at least 1"),
    ("NBLAUNCH_MAX_PROCESSES", "many", "a whole number"),
    ("NBLAUNCH_RUN_DIR", "", "set but empty"),
    ("NBLAUNCH_RUN_DIR", "  ", "set but empty"),
    ("NBLAUNCH_DEBUG", "maybe", "1, true, yes or on, or to 0, false, no or off"),
    ("ACCELERATE_DEBUG_MODE", "sure", "1, true, yes or on"),
    ("NBLAUNCH_LOG_LEVEL", "LOUD", "one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("NBLAUNCH_SPARE_RANKS", "abc", "0, false, no or off"),
    ("NBLAUNCH_PRESTART", "abc", "0, false, no or off"),
    ("NBLAUNCH_VIEW_LINES", "-5", "how many lines a view keeps per rank.*at least 1"),
]


@pytest.mark.parametrize(("name", "value", "says"), BAD)
def test_a_bad_value_is_named_before_anything_starts(name, value, says, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=f"{name}.*{says}") as caught:
        notebook_launcher(print, num_processes=1, device_type="cpu", display="none")
    assert str(caught.value).startswith(name)
    assert not (tmp_path / ".nblaunch").exists()  # nothing was made


@pytest.mark.parametrize(
    ("name", "value"),
    [("NBLAUNCH_DEBUG", "Yes"), ("NBLAUNCH_DEBUG", "off"), ("NBLAUNCH_LOG_LEVEL", "info")],
)
def test_good_values_in_any_case_are_taken(name, value, monkeypatch, tmp_path):
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv(name, value)
    from nblaunch.engine.plan.launch_plan import plan_launch
    from nblaunch.options import LaunchOptions

    plan = plan_launch(print, 1, LaunchOptions(device_type="cpu"))
    if name == "NBLAUNCH_DEBUG":
        assert plan.debug is (value == "Yes")
    else:
        assert plan.log_level == "info"


def test_a_bad_prestart_does_not_break_import_in_a_notebook():
    # Read when nblaunch is imported in IPython: a warning that names it, and the import works.
    code = (
        "import IPython, warnings; shell = IPython.InteractiveShell.instance()\n"
        "warnings.simplefilter('always')\n"
        "import nblaunch; print('imported', nblaunch.notebook_launcher.__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**_env(), "NBLAUNCH_PRESTART": "abc"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "imported notebook_launcher" in done.stdout, done.stderr
    assert "NBLAUNCH_PRESTART='abc'" in done.stderr and "as if it were unset" in done.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("NBLAUNCH_")}
