"""Shared test set-up.

All launches in one pytest process share one forkserver (multiprocessing keeps a single one per
process), so only the first launch of the session pays for starting it and importing torch.
Each test runs in a temporary working directory, so run directories land there.
"""

from __future__ import annotations

import os

import psutil
import pytest


@pytest.fixture(autouse=True)
def _run_dirs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path / "runs"))


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def helper_pids() -> set[int]:
    """PIDs of multiprocessing's long-lived helpers here: forkserver, resource tracker."""
    from multiprocessing import forkserver, resource_tracker

    pids = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
    return {pid for pid in pids if pid}


def rank_children() -> list[psutil.Process]:
    """Live descendants of this test process other than multiprocessing's helpers: the ranks."""
    helpers = helper_pids()
    ranks = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.pid not in helpers and child.status() != psutil.STATUS_ZOMBIE:
                ranks.append(child)
        except psutil.NoSuchProcess:
            pass
    return ranks
