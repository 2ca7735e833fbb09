"""Accelerators other than CUDA, through the same engine: a test accelerator registered the way
a plug-in registers one (PrivateUse1), and XLA ranks on a stand-in ``torch_xla``.

Both live in ``tests/devices``, put on the ranks' ``sys.path`` (they get the notebook's). The
real torch_xla on its CPU runtime is ``make test-xla`` (tests/xla/), outside this suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import nblaunch
from nblaunch import LaunchError, notebook_launcher
from nblaunch.engine.plan import devices as engine_devices
from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload
from nblaunch.engine.run.run import Run
from nblaunch.notebook.views.recording import RecordingView
from nblaunch.options import LaunchOptions

ROOT = Path(__file__).resolve().parent.parent
DEVICES = ROOT / "tests" / "devices"


@pytest.fixture
def fake_accelerator(monkeypatch):
    monkeypatch.syspath_prepend(str(DEVICES))
    monkeypatch.setenv("NBLAUNCH_DEVICE_MODULES", "fake_accelerator")


def _on_the_accelerator():
    import fake_accelerator
    import torch
    import torch.distributed as dist

    from nblaunch.ranks.memory.memory import is_out_of_memory

    total = torch.tensor([nblaunch.rank() + 1.0])
    dist.all_reduce(total)
    nblaunch.free_memory()
    oom = RuntimeError("FAKEACC out of memory. Tried to allocate 2.00 GiB")
    return {
        "device": str(nblaunch.device()),
        "current": torch.fakeacc.current_device(),
        "record": fake_accelerator.RECORD,
        "backend": str(dist.get_backend_config()),
        "sum": total.item(),
        "oom": is_out_of_memory(oom),
    }


def _fail_on_rank_1():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"rank 1 on {nblaunch.device()} failed")
    # Rank 0 waits for rank 1, which never comes (barrier() would need the fake device's C++
    # hooks to pick a device, which a device registered from Python has not).
    dist.all_reduce(torch.ones(1))


def test_a_plugin_accelerator_gets_one_pinned_device_per_rank_and_its_backend(fake_accelerator):
    found = engine_devices.detect_devices(None)  # asked of a probe: the kernel imports nothing
    assert (found.type, found.count, found.kind) == ("fakeacc", 2, "Fake Accelerator")
    assert found.backend == "cpu:gloo,fakeacc:fakeccl"

    values = notebook_launcher(_on_the_accelerator, num_processes=2, device_type="fakeacc")
    for rank, value in enumerate(values):
        assert value["device"] == f"fakeacc:{rank}"
        assert value["current"] == rank  # pinned before the function ran
        assert value["record"]["set_device"][0] == rank
        assert value["record"]["groups"] == [{"rank": rank, "size": 2}]  # fakeccl made it
        assert value["record"]["empty_cache"] == [rank]  # free_memory reached the device
        assert value["backend"] == "cpu:gloo,fakeacc:fakeccl"
        assert value["sum"] == 3.0
        assert value["oom"] is True

    with pytest.raises(ValueError, match="rank 1 on fakeacc:1 failed") as caught:
        notebook_launcher(_fail_on_rank_1, num_processes=2, device_type="fakeacc")
    assert any("rank 1" in note for note in caught.value.__notes__)

    with pytest.raises(LaunchError, match="num_processes=3 but only 2 Fake Accelerator"):
        notebook_launcher(_on_the_accelerator, num_processes=3, device_type="fakeacc")


def test_counting_a_plugins_devices_and_tpu_chips_imports_no_torch_here(tmp_path):
    # The kernel must not import torch to launch (test_launcher's first-launch test, for CPU).
    pci = _pci_bus(tmp_path / "pci", [("0x1ae0", "0x006f")] * 4)
    code = textwrap.dedent(
        f"""
        import sys
        from nblaunch.engine.plan import devices
        devices.PCI_DEVICES = {pci!r}
        xla, plugin = devices.detect_devices("xla"), devices.detect_devices("fakeacc")
        print(xla.count, xla.kind, plugin.count, plugin.kind, "torch" in sys.modules)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(DEVICES)]),
        "NBLAUNCH_DEVICE_MODULES": "fake_accelerator",
        "NBLAUNCH_PRESTART": "0",
    }
    env.pop("PJRT_DEVICE", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["4", "TPU", "v6e", "2", "Fake", "Accelerator", "False"], (
        out.stdout + out.stderr
    )


def test_a_device_type_no_plugin_provides_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.delenv("NBLAUNCH_DEVICE_MODULES", raising=False)
    with pytest.raises(LaunchError, match="torch sees no hpu device.*NBLAUNCH_DEVICE_MODULES"):
        plan_launch(print, None, LaunchOptions(device_type="hpu"))
    with pytest.raises(LaunchError, match="device_type='tpu': torch calls these devices 'xla'"):
        LaunchOptions(device_type="tpu")


# --- XLA -----------------------------------------------------------------------------------------


def _pci_bus(root: Path, chips: list[tuple[str, str]]) -> str:
    for index, (vendor, device) in enumerate(chips):
        chip = root / f"0000:00:0{index}.0"
        chip.mkdir(parents=True)
        (chip / "vendor").write_text(vendor + "\n")
        (chip / "device").write_text(device + "\n")
    return str(root)


@pytest.fixture
def tpu_vm(monkeypatch, tmp_path):
    """Two v5e chips (and a device of another vendor) on a PCI bus in a temporary directory,
    and the stand-in torch_xla."""
    chips = [("0x1ae0", "0x0063"), ("0x8086", "0x0063"), ("0x1ae0", "0x0063")]
    monkeypatch.setattr(engine_devices, "PCI_DEVICES", _pci_bus(tmp_path / "pci", chips))
    monkeypatch.syspath_prepend(str(DEVICES))
    for name in ("PJRT_DEVICE", "TPU_PROCESS_BOUNDS", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_ADDRESSES"):
        monkeypatch.delenv(name, raising=False)


def _on_xla():
    import torch
    import torch.distributed as dist
    import torch_xla

    total = torch.tensor([nblaunch.rank() + 1.0])
    dist.all_reduce(total)
    return {
        "device": str(nblaunch.device()),
        "backend": dist.get_backend(),
        "sum": total.item(),
        **{key: torch_xla.RECORD[key] for key in ("runtime_env", "rendezvous", "groups")},
    }


def test_xla_ranks_set_up_the_tpu_runtime_one_chip_each_and_meet_through_xla_url(tpu_vm):
    plan = plan_launch(_on_xla, None, LaunchOptions(device_type="xla"))
    assert (plan.world_size, plan.device_kind, plan.backend) == (2, "TPU v5e", "xla")
    view = RecordingView()
    values = Run(plan, view).execute(serialize_payload(_on_xla))

    ports = plan.runtime_ports
    assert len(set(ports)) == 2
    for rank, value in enumerate(values):
        assert value["runtime_env"] == {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": str(rank),
            "PJRT_LOCAL_PROCESS_COUNT": "2",
            "TPU_VISIBLE_CHIPS": str(rank),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "2,1,1",
            "TPU_PROCESS_ADDRESSES": f"localhost:{ports[0]},localhost:{ports[1]}",
            "TPU_PROCESS_PORT": str(ports[rank]),
            "CLOUD_TPU_TASK_ID": str(rank),
            "CPU_NUM_DEVICES": None,
        }
        assert value["device"] == "xla:0"  # the one device of this rank's runtime
        # torch_xla's rendezvous met on nblaunch's store, as a client (rank 0 hosts it).
        assert value["rendezvous"] == [
            {"url": "xla://", "agent_store": True, "rank": rank, "world_size": 2}
        ]
        assert value["groups"] == [{"rank": rank, "size": 2}]
        assert (value["backend"], value["sum"]) == ("xla", 3.0)
    badges = {event["rank"]: event["device"] for event in view.of("started")}
    assert badges == {0: "xla:0 · TPU chip 0", 1: "xla:0 · TPU chip 1"}

    with pytest.raises(ValueError, match="rank 1 on xla:0 failed"):
        notebook_launcher(_fail_on_rank_1, device_type="xla", display="none")


def test_an_initialised_xla_runtime_in_the_kernel_is_refused_before_anything_starts(
    tpu_vm, monkeypatch
):
    started = types.SimpleNamespace(_xla_runtime_is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch_xla", types.SimpleNamespace(_XLAC=started))
    with pytest.raises(LaunchError, match="XLA runtime is already initialised.*Restart the kernel"):
        notebook_launcher(_on_xla, device_type="xla", display="none")


def test_a_v3_8_host_is_four_ranks_of_two_cores_in_a_two_by_two_grid(tpu_vm, tmp_path, monkeypatch):
    v3 = _pci_bus(tmp_path / "v3", [("0x1ae0", "0x0027")] * 4)
    monkeypatch.setattr(engine_devices, "PCI_DEVICES", v3)
    plan = plan_launch(_on_xla, None, LaunchOptions(device_type="xla"))
    # The chips' processes meet in gloo: xla:// would make each core a rank.
    assert (plan.world_size, plan.device_kind, plan.backend, plan.init_method) == (
        4,
        "TPU v2/v3",
        "gloo",
        None,
    )
    env = plan.rank_env(3)
    assert (env["TPU_PROCESS_BOUNDS"], env["TPU_VISIBLE_CHIPS"], env["CLOUD_TPU_TASK_ID"]) == (
        "2,2,1",
        "3",
        "3",
    )
    assert env["TPU_PROCESS_PORT"] == str(plan.runtime_ports[3])
    monkeypatch.setenv("TPU_PROCESS_BOUNDS", "1,4,1")  # a layout set in the notebook is kept
    assert plan.rank_env(3)["TPU_PROCESS_BOUNDS"] == "1,4,1"


def test_a_v2_v3_chip_runs_the_function_on_each_core_in_a_thread(monkeypatch):
    monkeypatch.syspath_prepend(str(DEVICES))
    monkeypatch.setenv("STANDIN_CORES_PER_CHIP", "2")
    for name in [n for n in sys.modules if n == "torch_xla" or n.startswith("torch_xla.")]:
        monkeypatch.delitem(sys.modules, name)
    import torch_xla

    from nblaunch.ranks.device import xla

    try:
        values = xla.call_on_each_core(lambda x: x * 2, (21,), {})
        assert values == [42, 42]
        assert sorted(torch_xla.RECORD["default_device"]) == ["xla:0", "xla:1"]
    finally:
        for name in [n for n in sys.modules if n == "torch_xla" or n.startswith("torch_xla.")]:
            del sys.modules[name]
