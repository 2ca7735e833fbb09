"""Hang diagnosis on real training code: DDP's collectives are issued from C++ in backward().

Real processes, 2 CPU ranks on gloo, the default hang_timeout (300 s): each case must end in
seconds because the process groups' own counts show a rank waiting in a collective its peer
will never issue.
"""

from __future__ import annotations

import inspect
import re
import sys
import time

import pytest
from conftest import rank_children, wait_until

from nblaunch import DistributedHangError, RankFailedError, notebook_launcher


def launch(function, args=(), **kwargs):
    kwargs.setdefault("display", "none")
    return notebook_launcher(function, args, num_processes=2, device_type="cpu", **kwargs)


def line_of(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def shown(text: str) -> str:
    return re.sub(r"[^\s\"]*test_real_training\.py", "test_real_training.py", text)


def ddp_uneven_inputs():
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 5 if dist.get_rank() == 0 else 4  # rank 1 has one batch fewer
    for _ in range(batches):
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()  # rank 0 waits here
        optimizer.step()
        optimizer.zero_grad()
    return batches


def ddp_early_break():
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    for step in range(20):
        model(torch.randn(8, 4)).sum().backward()  # rank 0 waits here
        if dist.get_rank() == 1 and step == 3:
            break  # a local condition on one rank only
    return "done"


def assert_nothing_left() -> None:
    assert wait_until(lambda: not rank_children(), timeout=10), rank_children()


@pytest.mark.parametrize(
    ("function", "returned_after"),
    [(ddp_uneven_inputs, "rank 1 returned after 9 collectives"), (ddp_early_break, None)],
)
def test_a_rank_that_left_a_ddp_loop_is_reported_in_seconds(function, returned_after):
    started = time.monotonic()
    with pytest.raises(DistributedHangError) as info:
        launch(function)  # the default hang_timeout: 300 s
    elapsed = time.monotonic() - started
    assert elapsed < 30, elapsed
    text = shown(str(info.value))
    assert text.startswith("rank 1 of 2 returned while rank 0 waits in a collective"), text
    if returned_after:
        assert returned_after in text
    line = line_of(function, "rank 0 waits here")
    assert "rank 0 waits in DDP gradient all-reduce (collective #" in text
    assert f"at test_real_training.py:{line} in {function.__name__}" in text, text[:600]
    assert "model.join()" in text  # DDP's own remedy for uneven inputs
    assert_nothing_left()


def test_a_hang_in_a_function_from_site_packages_names_its_frame_not_the_bootstrap(tmp_path):
    package_dir = tmp_path / "site-packages"
    package_dir.mkdir()
    (package_dir / "sleepy_lib.py").write_text(
        "import time\n"
        "import torch.distributed as dist\n"
        "\n"
        "def train():\n"
        "    if dist.get_rank() == 1:\n"
        "        time.sleep(120)\n"
        "    dist.barrier()\n"
    )
    sys.path.insert(0, str(package_dir))
    try:
        import sleepy_lib

        with pytest.raises(DistributedHangError) as info:
            launch(sleepy_lib.train, hang_timeout=2)
    finally:
        sys.path.remove(str(package_dir))
        sys.modules.pop("sleepy_lib", None)
    text = str(info.value)
    assert "<string>" not in text.splitlines()[0]
    assert re.match(r"rank 1 of 2 is stuck at \S*sleepy_lib\.py:6 in train outside", text), text
    assert re.search(r"rank 0: in barrier \(collective #1\) at \S*sleepy_lib\.py:7 in train", text)
    assert_nothing_left()


def bad_subgroup():
    import torch.distributed as dist

    dist.new_group(ranks=[0, 7])  # no rank 7 in a 2-rank run


def test_the_debug_mode_hint_is_only_given_for_failures_inside_collectives():
    with pytest.raises((ValueError, RankFailedError)) as info:
        launch(bad_subgroup)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on rank" in notes
    assert "debug=True" not in notes  # torch.distributed was involved, but no collective
