"""The real torch_xla, on its CPU runtime (``PJRT_DEVICE=CPU``): ``make test-xla``.

Not part of ``make test``: torch_xla 2.9 needs torch 2.9 (the suite's venv has 2.13), so this
runs in a venv of its own (``.venv-xla``). Each rank owns one XLA CPU device; XLA's CPU runtime
does not span processes, so the ranks meet in nblaunch's gloo group, as docs/devices.md says.
"""

from __future__ import annotations

import os

import pytest

torch_xla = pytest.importorskip("torch_xla")
if not hasattr(torch_xla, "__version__"):  # tests/devices' stand-in, not the real one
    pytest.skip("the real torch_xla is not installed", allow_module_level=True)

import nblaunch  # noqa: E402
from nblaunch import notebook_launcher  # noqa: E402
from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload  # noqa: E402
from nblaunch.engine.run.run import Run  # noqa: E402
from nblaunch.notebook.views.recording import RecordingView  # noqa: E402
from nblaunch.options import LaunchOptions  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_runtime(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")


def _train_step():
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.runtime as xr

    device = nblaunch.device()
    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(nblaunch.rank() + 1)  # different data on each rank
    x, y = torch.randn(8, 4).to(device), torch.randn(8, 1).to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for parameter in model.parameters():  # average the gradients over the ranks (gloo)
        grad = parameter.grad.cpu()
        dist.all_reduce(grad)
        parameter.grad = (grad / nblaunch.world_size()).to(device)
    optimizer.step()
    torch_xla.sync()
    return {
        "device": str(device),
        "tensor_device": str(model.weight.device),
        "runtime": xr.device_type(),
        "local_devices": xr.addressable_device_count(),
        "loss": loss.item(),
        "weight": model.weight.detach().cpu().tolist(),
        "cpu_num_devices": os.environ.get("CPU_NUM_DEVICES"),
    }


def _fail_on_rank_1():
    import torch
    import torch.distributed as dist

    value = torch.ones(2, device=nblaunch.device()).sum().item()
    if dist.get_rank() == 1:
        raise ValueError(f"rank 1 computed {value} on {nblaunch.device()} and failed")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1, which never comes


def test_a_training_step_on_one_xla_device_per_rank_returns_every_value():
    plan = plan_launch(_train_step, 2, LaunchOptions(device_type="xla"))
    assert (plan.device_kind, plan.backend, plan.init_method) == ("XLA (CPU)", "gloo", None)
    view = RecordingView()
    values = Run(plan, view).execute(serialize_payload(_train_step))
    assert len(values) == 2
    for value in values:
        assert value["device"] == "xla:0" and value["tensor_device"] == "xla:0"
        assert (value["runtime"], value["local_devices"]) == ("CPU", 1)
        assert value["cpu_num_devices"] == "1"
    assert values[0]["loss"] != values[1]["loss"]  # each rank had its own data
    assert values[0]["weight"] == values[1]["weight"]  # and the averaged step kept them equal
    badges = {event["rank"]: event["device"] for event in view.of("started")}
    assert badges == {0: "xla:0 · XLA CPU", 1: "xla:0 · XLA CPU"}


def test_a_failing_xla_rank_raises_its_own_exception(capsys):
    with pytest.raises(ValueError, match="rank 1 computed 2.0 on xla:0 and failed") as caught:
        notebook_launcher(_fail_on_rank_1, num_processes=2, device_type="xla", display="text")
    assert any("rank 1" in note for note in caught.value.__notes__)
    header = capsys.readouterr().out
    assert "2 rank(s) on XLA (CPU)" in header, header
