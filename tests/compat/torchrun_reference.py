"""The compatibility suite's reference: each workload run under torchrun, once per session.

Not a ``conftest.py``: ``tests/conftest.py`` is imported by name (``from conftest import ...``),
and a second module of that name would shadow it.

Workloads of one framework share one torchrun run (``GROUPS``), so a framework's import is paid
once; the results are cached for the session, and the nblaunch side reuses the session's one
forkserver (see ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "workloads.py"
# Workloads that one torchrun run executes in turn, and the environment it runs with.
GROUPS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    # The tutorial destroys its process group, and a second init_process_group in the same
    # torchrun worker can hang (one rank meets stale keys in the agent's store): it runs alone.
    "ddp_tutorial": (("ddp_tutorial",), {}),
    "pytorch": (("dataloader_workers", "fsdp2_dcp"), {}),
    # what `accelerate launch --cpu` sets: without it Trainer on CPU trains every rank alone
    "transformers": (("transformers_trainer",), {"ACCELERATE_USE_CPU": "1"}),
    "lightning": (("lightning_trainer",), {}),
    "fabric": (("lightning_fabric",), {}),  # apart: its test is slow, the Trainer's is not
}
TORCHRUN_TIMEOUT_S = 240  # under pytest-timeout's 300 s, so the clean-up below runs

sys.path.insert(0, str(HERE))  # the ranks import workloads by name; sys.path travels to them
from workloads import read_results, workload_kwargs  # noqa: E402


def run_torchrun(names: tuple[str, ...], directory: Path, env: dict[str, str]) -> dict[str, Any]:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 workloads.py ...``.

    ``--standalone`` picks a free port, so runs of several people on one machine do not meet
    on torchrun's default 29500.
    """
    argv = []
    for name in names:
        argv += [name, json.dumps(workload_kwargs(name, directory))]
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *(str(WORKLOADS), *argv),
    ]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NBLAUNCH_")}
    process = subprocess.Popen(
        command,
        cwd=directory,
        env={**environment, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = process.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as timeout:
        out, err = _stop(process)
        tail = (out + err)[-6000:]
        raise AssertionError(f"torchrun ran past {TORCHRUN_TIMEOUT_S} s:\n{tail}") from timeout
    finally:
        if process.poll() is None:  # interrupted: leave no torchrun behind
            _stop(process)
    results = read_results(directory)
    if process.returncode != 0 or set(results) != set(names):
        raise AssertionError(f"torchrun exited with {process.returncode}:\n{(out + err)[-6000:]}")
    return results


def torchrun_reference(tmp_path_factory: Any) -> Callable[[str], list[dict[str, Any]]]:
    """``reference(name)``: the workload's results by rank under torchrun (cached)."""
    cache: dict[str, dict[str, Any] | AssertionError] = {}

    def reference(name: str) -> list[dict[str, Any]]:
        group = next(group for group, (names, _) in GROUPS.items() if name in names)
        if group not in cache:
            names, env = GROUPS[group]
            directory = tmp_path_factory.mktemp(f"torchrun-{group}")
            try:
                cache[group] = run_torchrun(names, directory, env)
            except AssertionError as failure:  # kept too: a broken run is not paid for twice
                cache[group] = failure
        results = cache[group]
        if isinstance(results, AssertionError):
            raise results
        return results[name]

    return reference


def _stop(process: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM torchrun's agent (it stops its workers); SIGKILL it and them if it hangs."""
    workers = psutil.Process(process.pid).children(recursive=True)
    process.terminate()
    try:
        return process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
        process.kill()
        return process.communicate()
