"""Third-party workloads under nblaunch compute exactly what they compute under torchrun.

Each workload (``workloads.py``) runs on 2 CPU ranks with ``notebook_launcher`` and is compared
with the same code run by ``python -m torch.distributed.run --nproc-per-node 2`` (cached per
session in the ``torchrun`` fixture): losses and weight digests must be bit-identical. The
Accelerate scripts check themselves; here they must pass, on 2 ranks, distributed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import workloads
from torchrun_reference import torchrun_reference
from workloads import workload_kwargs

from nblaunch import load_metrics, notebook_launcher
from tests.conftest import skip_unless_accelerates_test_ops_runs_on_cpu

pytestmark = pytest.mark.compat

LAUNCH_TIMEOUT_S = 180
# Values that say how a run went rather than what it computed.
NOT_COMPARED = ("threads", "seconds")


@pytest.fixture(scope="session")
def torchrun(tmp_path_factory):
    """``torchrun(name)``: the workload's results by rank under torchrun, once per session."""
    return torchrun_reference(tmp_path_factory)


def launch(
    workload: str, directory: Path, run_dir: Path | None = None, **kwargs: Any
) -> list[dict[str, Any]]:
    """The workload's results by rank under ``notebook_launcher`` (2 CPU ranks)."""
    return notebook_launcher(
        getattr(workloads, workload),
        kwargs={**workload_kwargs(workload, directory), **kwargs},
        num_processes=2,
        device_type="cpu",
        display="none",
        timeout=LAUNCH_TIMEOUT_S,
        run_dir=run_dir,
    )


def compared(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in result.items() if k not in NOT_COMPARED} for result in results]


def assert_each_rank_logged(run_dir: Path, name: str) -> None:
    """nblaunch's callback or logger charted the framework's own loss on both ranks."""
    rows = load_metrics(run_dir)
    table = rows if isinstance(rows, list) else rows.to_dict("records")
    ranks = {r["rank"] for r in table if r["name"] == name}
    assert ranks == {0, 1}, sorted({r["name"] for r in table})


def assert_trained_in_step(results: list[dict[str, Any]]) -> None:
    """Ranks saw different data but ended with the same weights: they really trained together."""
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["losses"] != results[1]["losses"]
    assert results[0]["weights"] == results[1]["weights"]


# --- PyTorch ------------------------------------------------------------------------------------


def test_ddp_tutorial_trains_as_under_torchrun(torchrun, tmp_path):
    ours = launch("ddp_tutorial", tmp_path)  # it calls init_process_group/destroy itself
    assert_trained_in_step(ours)
    assert compared(ours) == compared(torchrun("ddp_tutorial"))


def test_fsdp2_steps_and_dcp_round_trip_as_under_torchrun(torchrun, tmp_path):
    ours = launch("fsdp2_dcp", tmp_path)
    assert_trained_in_step(ours)
    for rank in ours:
        assert rank["fresh_differs"] and rank["loaded"] == rank["weights"]  # DCP restored it
        assert rank["next_losses"][0] == rank["next_losses"][1]  # and the optimizer state
        assert rank["after_next_step"][0] == rank["after_next_step"][1]
    assert compared(ours) == compared(torchrun("fsdp2_dcp"))


def test_dataloader_workers_start_as_under_torchrun(torchrun, tmp_path):
    reference = torchrun("dataloader_workers")
    assert [r["start_method"] for r in reference] == ["fork", "fork"]
    ours = launch("dataloader_workers", tmp_path)  # a collate_fn closure must reach the workers
    assert compared(ours) == compared(reference)


# --- Transformers, Lightning --------------------------------------------------------------------


def test_transformers_trainer_trains_as_under_torchrun_and_charts_its_loss(
    torchrun, tmp_path, monkeypatch
):
    pytest.importorskip("transformers")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)  # nblaunch sets it for CPU ranks
    # default TrainingArguments, no use_cpu; with nblaunch's TrainerMetrics callback (torchrun's
    # run has none: the same numbers also say the callback leaves training as it was)
    ours = launch("transformers_trainer", tmp_path, tmp_path / "run", metrics=True)
    assert_each_rank_logged(tmp_path / "run", "loss")
    assert [(r["parallel_mode"], r["world_size"], r["process_index"]) for r in ours] == [
        ("ParallelMode.DISTRIBUTED", 2, 0),
        ("ParallelMode.DISTRIBUTED", 2, 1),
    ]
    assert ours[0]["weights"] == ours[1]["weights"]
    assert compared(ours) == compared(torchrun("transformers_trainer"))


def test_lightning_trainer_ddp_trains_as_under_torchrun_and_charts_its_loss(torchrun, tmp_path):
    pytest.importorskip("lightning")
    # with nblaunch's LightningMetrics logger, which torchrun's run has not (as above)
    ours = launch("lightning_trainer", tmp_path, tmp_path / "run", metrics=True)
    assert_each_rank_logged(tmp_path / "run", "train_loss")
    assert [r["world_size"] for r in ours] == [2, 2]
    assert_trained_in_step(ours)
    assert compared(ours) == compared(torchrun("lightning_trainer"))


@pytest.mark.slow
def test_lightning_fabric_trains_as_under_torchrun(torchrun, tmp_path):
    pytest.importorskip("lightning")
    ours = launch("lightning_fabric", tmp_path)
    assert [r["world_size"] for r in ours] == [2, 2]
    assert_trained_in_step(ours)
    assert compared(ours) == compared(torchrun("lightning_fabric"))


# --- Accelerate's own test scripts --------------------------------------------------------------

# test_distributed_data_loop's functions that cannot pass on CPU ranks under any launcher (torchrun
# included): the join tests need ``Accelerator.multi_device``, which is False on CPU, so the join
# is a no-op there (test_can_join_uneven_inputs then hangs in DDP); the stateful tests need
# torchdata.
DATA_LOOP_SKIP = (
    "test_can_join_uneven_inputs",
    "test_join_can_override_even_batches",
    "test_join_can_override_for_mixed_type_dataloaders",
    "test_join_raises_warning_for_iterable_when_overriding_even_batches",
    "test_stateful_dataloader",
    "test_stateful_dataloader_save_state",
)


def assert_accelerate_ran_distributed(results: list[dict[str, Any]]) -> None:
    assert results == [
        {"rank": rank, "distributed_type": "DistributedType.MULTI_CPU", "num_processes": 2}
        for rank in (0, 1)
    ]


@pytest.mark.parametrize("script", ["test_ops", "test_sync", "test_script"])
def test_accelerate_test_script_passes(script, tmp_path):
    pytest.importorskip("accelerate.test_utils.scripts")
    if script == "test_ops":
        skip_unless_accelerates_test_ops_runs_on_cpu()
    # No ACCELERATE_USE_CPU here: nblaunch sets it for CPU ranks, as `accelerate launch --cpu` does
    assert_accelerate_ran_distributed(launch("accelerate_script", tmp_path, name=script))


@pytest.mark.slow
def test_accelerate_distributed_data_loop_passes(tmp_path):
    pytest.importorskip("accelerate.test_utils.scripts")
    results = launch(
        "accelerate_script", tmp_path, name="test_distributed_data_loop", skip=DATA_LOOP_SKIP
    )
    assert_accelerate_ran_distributed(results)
