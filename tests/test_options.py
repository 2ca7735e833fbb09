"""The options every front end builds (``nblaunch.options``): checked when made, frozen,
and the same refusals whichever front end made them. No process is started here."""

from __future__ import annotations

import dataclasses

import pytest

from nblaunch.errors import LaunchError
from nblaunch.options import DEFAULT_RDZV_TIMEOUT_S, LaunchOptions, NodeOptions


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"start_method": "thread"}, "start_method='thread' is not one of forkserver, spawn, fork"),
        ({"device_type": "tpu"}, "device_type='tpu': torch calls these devices 'xla'"),
        ({"device_type": "CUDA:0"}, "device_type='CUDA:0' is not a device type: use one of cuda"),
        ({"timeout": 0}, "timeout must be a positive number of seconds or None, got 0"),
        ({"hang_timeout": True}, "hang_timeout must be a positive number"),
        ({"hang_timeout": "5"}, "hang_timeout must be a positive number"),
    ],
)
def test_bad_launch_options_are_refused_when_made(changes, message):
    with pytest.raises(LaunchError, match=message):
        LaunchOptions(**changes)
    with pytest.raises(LaunchError, match=message):  # a change is checked again
        LaunchOptions().replace(**changes)


def test_launch_options_are_frozen_and_replace_makes_a_copy():
    options = LaunchOptions(device_type="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.timeout = 5  # type: ignore[misc]
    longer = options.replace(hang_timeout=30)
    assert (options.hang_timeout, longer.hang_timeout) == (300.0, 30)
    assert longer.device_type == "cpu"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, "h:1"), "num_nodes must be a whole number of machines >= 1, got 0"),
        ((True, "h:1"), "num_nodes must be a whole number"),
        ((2, None), "num_nodes=2 needs rdzv_endpoint='host:port'"),
        ((2, "h:1", -1), "rdzv_timeout must be a positive number of seconds, got -1"),
        ((2, "h:1", None, "../up"), "rdzv_id='../up': a run id is 1 to 64 letters"),
        ((2, "h:1", None, None, "mpirun"), "start_nodes='mpirun' is not one of ssh, srun"),
        ((2, "h:1", None, None, "ssh"), "start_nodes='ssh' needs hostfile="),
        ((2, "h:1", None, None, None, "hosts"), "hostfile= is for start_nodes='ssh'"),
    ],
)
def test_bad_node_options_are_refused_when_made(args, message):
    with pytest.raises(LaunchError, match=message):
        NodeOptions(*args)


def test_srun_needs_a_slurm_allocation(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(LaunchError, match="inside a Slurm allocation"):
        NodeOptions(2, "h:1", start_nodes="srun")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert NodeOptions(2, "h:1", start_nodes="srun").start_nodes == "srun"


def test_node_options_default_the_rendezvous_timeout():
    assert NodeOptions(2, "h:1").rdzv_timeout == DEFAULT_RDZV_TIMEOUT_S
    assert NodeOptions(2, "h:1").replace(num_nodes=3).num_nodes == 3
