"""notebook_launcher end to end: real rank processes, CPU, gloo, 2 ranks."""

from __future__ import annotations

import gc
import html
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import psutil
import pytest
from conftest import RANKS_LEFT_CODE, assert_no_ranks_left, rank_children, wait_until

import nblaunch
from nblaunch import LaunchError, LaunchTimeoutError, RankFailedError, notebook_launcher
from nblaunch.engine.processes import supervisor as supervisor_module


def launch(function, args=(), n=2, **kwargs):
    kwargs.setdefault("display", "none")
    return notebook_launcher(function, args, n, device_type="cpu", **kwargs)


# --- running and returning -----------------------------------------------------------------------


def test_returns_values_by_rank_after_an_all_reduce():
    def hello(scale):
        import torch
        import torch.distributed as dist

        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        return dist.get_rank() * scale, total.item()

    assert launch(hello, (10,)) == [(0, 3.0), (10, 3.0)]


def test_every_rank_gets_the_torchrun_contract():
    def contract():
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        return {k: os.environ[k] for k in keys}, int(os.environ["MASTER_PORT"])

    (rank0, port0), (rank1, port1) = launch(contract)
    assert rank0 == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert rank1["RANK"] == "1" and rank1["LOCAL_RANK"] == "1"
    assert port0 == port1 > 0


def test_lambdas_closures_and_accessors_travel_by_value():
    offset = 5

    def closure():
        return nblaunch.rank() + offset, nblaunch.world_size(), str(nblaunch.device())

    assert launch(closure) == [(5, 2, "cpu"), (6, 2, "cpu")]
    assert launch(lambda: nblaunch.is_main_process()) == [True, False]


def test_process_group_is_set_up_and_torn_down():
    def check():
        import torch.distributed as dist

        return dist.is_initialized(), dist.get_backend(), dist.get_world_size()

    assert launch(check) == [(True, "gloo", 2)] * 2

    def no_group():
        import torch.distributed as dist

        return dist.is_initialized()

    assert launch(no_group, setup_process_group=False) == [False, False]


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_other_start_methods(start_method):
    def who():
        import torch.distributed as dist

        return dist.get_rank()

    assert launch(who, start_method=start_method) == [0, 1]


def test_environment_and_sys_path_of_the_caller_reach_the_ranks(tmp_path, monkeypatch):
    launch(lambda: None)  # make sure the forkserver already runs
    (tmp_path / "late_module.py").write_text("VALUE = 'imported late'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NBLAUNCH_TEST_LATE", "set after the forkserver started")

    def read():
        import late_module

        return late_module.VALUE, os.environ["NBLAUNCH_TEST_LATE"]

    assert launch(read) == [("imported late", "set after the forkserver started")] * 2


def test_rendezvous_listens_on_loopback_only():
    def listening():
        return sorted(
            {c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
        )

    for addresses in launch(listening):
        assert addresses and all(a.startswith("127.") for a in addresses), addresses


def test_accelerate_accelerator_works_unchanged_inside_a_launch():
    pytest.importorskip("accelerate")

    def with_accelerate():
        import torch
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        gathered = accelerator.gather(torch.tensor([accelerator.process_index]))
        return accelerator.num_processes, gathered.tolist()

    assert launch(with_accelerate) == [(2, [0, 1])] * 2


# --- output --------------------------------------------------------------------------------------


def test_output_is_captured_at_the_fd_level_and_prefixed(capsys):
    def chatty():
        rank = nblaunch.rank()
        print(f"python print from {rank}")
        os.write(1, f"raw fd write from {rank}\n".encode())
        os.system(f"echo child process output from {rank}")
        print(f"to stderr from {rank}", file=sys.stderr)

    launch(chatty, display="text")
    out, err = capsys.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] python print from {rank}\n" in out
        assert f"[rank {rank}] raw fd write from {rank}\n" in out
        assert f"[rank {rank}] child process output from {rank}\n" in out
        assert f"[rank {rank}] to stderr from {rank}\n" in err


def test_lines_of_two_ranks_are_never_glued(capsys):
    def many():
        for i in range(2000):
            print(f"rank {nblaunch.rank()} line {i}")

    launch(many, display="text")
    lines = [line for line in capsys.readouterr().out.splitlines() if " line " in line]
    assert len(lines) == 4000
    for line in lines:
        prefix, _, rest = line.partition("] ")
        assert rest.startswith(f"rank {prefix[-1]} line "), line
        assert rest.count("line") == 1, line


def test_full_output_goes_to_per_rank_log_files(tmp_path):
    run_dir = tmp_path / "run"
    launch(lambda: print(f"logged by {nblaunch.rank()}"), run_dir=run_dir)
    for rank in (0, 1):
        assert f"logged by {rank}" in (run_dir / f"rank{rank}.log").read_text()


def tqdm_bars():
    """Real tqdm bars (on stderr) with other output between and after them, as a Trainer does."""
    import time

    from tqdm import tqdm

    rank = nblaunch.rank()
    for _ in tqdm(range(5)):  # ends with the "\\n" tqdm writes on close
        time.sleep(0.01)
    print(f"[transformers] next {rank}", flush=True)
    bar = tqdm(total=6)  # drawn at 0/6, then the Trainer's logger writes to the same stderr
    time.sleep(0.1)
    print(f"[transformers] warning {rank}", file=sys.stderr, flush=True)
    for _ in range(6):
        bar.update()
        time.sleep(0.01)
    bar.write(f"{{'loss': 0.{rank}}}")  # the Trainer's loss lines: tqdm.write, to stdout
    bar.close()
    for _ in tqdm(range(4), leave=False):  # cleared on close
        time.sleep(0.01)
    print(f"after leave=False {rank}", flush=True)


def _glued(line: str) -> bool:
    """A progress bar's state and another line run together."""
    return "it/s]" in line and any(w in line for w in ("[transformers]", "loss", "after"))


def test_progress_bars_end_where_the_next_output_begins_in_the_text_view(capfd, tmp_path):
    launch(tqdm_bars, display="text", run_dir=tmp_path / "run")
    out, err = capfd.readouterr()
    lines = (out + err).splitlines()
    assert not [line for line in lines if _glued(line)], out + err
    assert "[rank 0] " not in lines and "[rank 1] " not in lines  # no blank "\\r" lines
    for rank in (0, 1):
        mine = [line.removeprefix(f"[rank {rank}] ") for line in lines if f"[rank {rank}]" in line]
        for text in (f"[transformers] next {rank}", f"[transformers] warning {rank}"):
            assert text in mine
        assert f"{{'loss': 0.{rank}}}" in mine and f"after leave=False {rank}" in mine
        assert len([line for line in mine if "5/5 [" in line]) == 1  # the last state, once
        assert mine.index(f"[transformers] warning {rank}") > min(
            i for i, line in enumerate(mine) if "0/6 [" in line
        )
        log = (tmp_path / "run" / f"rank{rank}.log").read_text()
        assert not [line for line in log.split("\n") if _glued(line)], log
        assert f"\n[transformers] warning {rank}\n" in log


def _gloo_log(line: str) -> bool:
    """torch 2.8's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks. ..." as a group
    starts (2.9 and later do not): the rank's output, but not the test's."""
    return line.startswith("[Gloo] ")


def test_progress_bars_in_the_widget_keep_each_last_state_once(monkeypatch, tmp_path):
    from nblaunch.notebook.views import LaunchView, choose, widget

    views = []
    monkeypatch.setattr(widget, "_display", lambda obj, **kw: None)
    monkeypatch.setattr(
        choose, "make_view", lambda display: views.append(LaunchView()) or views[-1]
    )
    launch(tqdm_bars, display="widget", run_dir=tmp_path / "run")
    (view,) = views
    for rank in (0, 1):
        lines = [line[2] for line in view.model.rank_lines[rank]]
        assert not [line for line in lines if _glued(line)], lines
        assert all(line.strip() for line in lines), lines  # no blank or cleared bar lines
        bars = [line for line in lines if "it/s]" in line]
        assert [bar.split("|")[-1].split()[0] for bar in bars] == ["5/5", "0/6", "6/6"], lines
        others = [line for line in lines if "it/s]" not in line and not _gloo_log(line)]
        # "next" (stdout) and "warning" (stderr, 0.1 s later) come down two pipes: a relay that
        # a loaded machine held up for longer reads both at once, in either order.
        assert sorted(others[:2]) == [
            f"[transformers] next {rank}",
            f"[transformers] warning {rank}",
        ]
        assert others[2:] == [f"{{'loss': 0.{rank}}}", f"after leave=False {rank}"]
        assert lines.index(f"{{'loss': 0.{rank}}}") < lines.index(bars[-1])  # bar below it
    # The two ranks' bars interleave in the All ranks tab without mixing.
    everything = [(line[0], line[2]) for line in view.model.all_lines if not _gloo_log(line[2])]
    assert len(everything) == 14
    assert not [text for _, text in everything if _glued(text)]


# --- failures ------------------------------------------------------------------------------------


def raise_on_rank_1():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone


@pytest.mark.slow
def test_the_failing_ranks_own_exception_is_the_root_cause_every_time():
    for _ in range(10):
        with pytest.raises(ValueError, match="boom on rank 1") as info:
            launch(raise_on_rank_1)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "raised on rank 1 of 2" in notes


def test_remote_traceback_shows_the_users_source_line():
    def deep():
        value = {"a": 1}
        return value["missing key"]  # the line the traceback must show

    with pytest.raises(KeyError) as info:
        launch(deep)
    text = "".join(traceback.format_exception(info.value))
    assert 'return value["missing key"]  # the line the traceback must show' in text


NESTED_FAILURE = """
import sys

from nblaunch import notebook_launcher


def inner(values):
    total = sum(values)
    return total / (len(values) - len(values))


def middle(x):
    scaled = [v * 2 for v in x]
    return {"key": inner(scaled)}["key"] + 1


def train():
    data = [1, 2, 3]
    result = middle(data)
    return result


if __name__ == "__main__":
    if "--local" in sys.argv:
        train()
    notebook_launcher(train, num_processes=2, display="none", device_type="cpu")
"""


def frame_blocks(text: str, filename: str, names=("train", "middle", "inner")) -> list[str]:
    """The lines Python shows for each frame of ``names`` in ``filename``: header, source, marks."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.startswith(f'  File "{filename}"') and line.rsplit(" in ", 1)[-1] in names:
            block = [line]
            for following in lines[i + 1 :]:
                if not following.startswith("    "):
                    break
                block.append(following)
            blocks.append("\n".join(block))
    return blocks


def test_terminal_tracebacks_carry_pythons_own_markers(tmp_path):
    script = tmp_path / "nested.py"
    script.write_text(NESTED_FAILURE)
    env = {**os.environ, "NBLAUNCH_RUN_DIR": str(tmp_path / "runs")}

    def run(*command):
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 1, done.stderr
        return done.stderr

    local = frame_blocks(run(sys.executable, str(script), "--local"), str(script))
    assert len(local) == 3
    if sys.version_info >= (3, 11):  # Python marks the failing expression in each frame
        assert "~~~~~~^~~~~~~~~~~~~~~~~~~~~~~~~~~~~" in local[2]
    launched = run(sys.executable, str(script))
    assert frame_blocks(launched, str(script)) == local
    assert "ZeroDivisionError: division by zero" in launched
    cli = run(sys.executable, "-m", "nblaunch", "run", str(script), "-n", "2")
    assert frame_blocks(cli, str(script)) == local


def test_a_frame_whose_markers_are_unsure_gets_none(tmp_path):
    """Recursion through one line that fails elsewhere on it, and a file changed since."""
    import pickle

    from tblib import pickling_support

    from nblaunch import tracebacks

    source = tmp_path / "recursive.py"
    source.write_text(
        "def down(n):\n"
        "    return down(n - 1) if n else {}['gone']\n"
        "def edited():\n"
        "    return 1 + {}['missing']\n"
    )
    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    for function, args in ((namespace["down"], (2,)), (namespace["edited"], ())):
        try:
            function(*args)
        except KeyError as exc:
            text = "".join(traceback.format_exception(exc))
            pickling_support.install(exc)
            remote = pickle.loads(pickle.dumps(exc))
        if function is namespace["edited"]:  # the file changed after the rank read it
            source.write_text(source.read_text().replace("1 + ", "10 + "))
            import linecache

            linecache.checkcache(str(source))
        rebuilt = "".join(traceback.format_exception(tracebacks.make_readable(remote, text)))
        blocks = frame_blocks(rebuilt, str(source), names=("down", "edited"))
        assert blocks, rebuilt
        for block in blocks:
            assert "^" not in block and "~" not in block, rebuilt  # none rather than wrong ones


def test_secondary_failures_never_win():
    from nblaunch.errors import is_secondary_failure

    assert is_secondary_failure(
        "torch.distributed.DistBackendError",
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
    )
    assert is_secondary_failure("builtins.RuntimeError", "Connection reset by peer")
    assert not is_secondary_failure("builtins.ValueError", "boom on rank 1")


@pytest.mark.parametrize(
    ("body", "exitcode", "signum"),
    [
        ("os._exit(3)", 3, None),
        ("os.kill(os.getpid(), signal.SIGKILL)", -9, signal.SIGKILL),
        ("import ctypes; ctypes.string_at(0)", -11, signal.SIGSEGV),
    ],
)
def test_a_rank_that_dies_without_an_exception(body, exitcode, signum):
    namespace = {}
    exec(
        textwrap.dedent(
            f"""
            def die():
                import os, signal, time
                import nblaunch
                if nblaunch.rank() == 1:
                    print("last words", flush=True)
                    {body}
                time.sleep(30)
            """
        ),
        namespace,
    )
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(namespace["die"])
    assert time.monotonic() - started < 10
    error = info.value
    assert (error.rank, error.exitcode, error.signal) == (1, exitcode, signum)
    assert "rank 1 of 2" in str(error) and "last words" in str(error)


def return_then_crash() -> str | None:
    import threading

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:  # returns, then its process ends before the run does
        threading.Thread(target=lambda: (time.sleep(0.3), os._exit(1)), daemon=True).start()
        return "rank 1 returned"
    time.sleep(0.1)
    dist.all_reduce(torch.ones(1))  # waits for rank 1, which never comes
    return None


def test_a_rank_that_returned_and_then_crashed_is_the_root_cause():
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(return_then_crash, debug=True)
    assert time.monotonic() - started < 10
    assert (info.value.rank, info.value.exitcode) == (1, 1)
    assert str(info.value).startswith(
        "rank 1 of 2 exited with code 1 after it returned, while the other ranks still ran"
    )


def test_an_exception_that_cannot_be_recreated_becomes_rank_failed_error():
    def odd():
        class Unpicklable(Exception):
            def __reduce__(self):
                raise TypeError("no pickling")

        raise Unpicklable("strange failure")

    with pytest.raises(RankFailedError, match="strange failure") as info:
        launch(odd, n=1)
    assert "Unpicklable" in info.value.remote_traceback


def test_a_rank_that_ignores_sigterm_at_a_timeout_is_killed_with_a_warning():
    """At a timeout the ranks were not known to be blocked: one that ignores SIGTERM is named.
    (After a failure they are, and are killed quietly: see tests/test_containment.py.)"""

    def stubborn():
        import signal as sig
        import time as t

        if nblaunch.rank() == 0:
            sig.signal(sig.SIGTERM, sig.SIG_IGN)
        t.sleep(60)

    with pytest.warns(RuntimeWarning, match="rank 0 .* ignored SIGTERM"):
        with pytest.raises(LaunchTimeoutError):
            launch(stubborn, timeout=3)
    assert_no_ranks_left(5)


def test_timeout_stops_the_run_and_names_running_ranks():
    def slow():
        import time as t

        if nblaunch.rank() == 1:
            t.sleep(60)

    started = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match=r"rank\(s\) 1 of 2 still running"):
        launch(slow, timeout=1.5, setup_process_group=False)
    assert time.monotonic() - started < 8
    assert_no_ranks_left(5)


def test_interrupt_stops_every_rank_and_the_next_launch_works():
    def forever():
        import time as t

        t.sleep(60)

    handler_before = signal.getsignal(signal.SIGINT)
    timer = threading.Timer(1.5, signal.raise_signal, (signal.SIGINT,))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(forever)
    assert time.monotonic() - started < 1.5 + 5
    assert_no_ranks_left(5)
    assert signal.getsignal(signal.SIGINT) is handler_before
    assert launch(lambda: nblaunch.rank()) == [0, 1]


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_processes": 0}, "at least 1"),
        ({"num_processes": -2}, "at least 1"),
        ({"num_processes": 2.5}, "whole number"),
        ({"num_processes": "2"}, "whole number"),
        ({"num_processes": True}, "whole number"),
        ({"num_processes": 2, "start_method": "thread"}, "start_method='thread'"),
        ({"num_processes": 2, "device_type": "cuda"}, "no CUDA device"),
        ({"num_processes": 2, "timeout": -1}, "timeout must be"),
        ({"num_processes": 2, "display": "fancy"}, "display='fancy'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kwargs, message):
    with pytest.raises(LaunchError, match=message):
        notebook_launcher(print, **kwargs)
    assert not rank_children()


def test_a_non_callable_is_refused():
    with pytest.raises(LaunchError, match="must be callable"):
        notebook_launcher("train", num_processes=2)


def test_fork_is_refused_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(supervisor_module, "cuda_initialized", lambda: True)
    with pytest.raises(LaunchError, match="CUDA is already initialised.*forkserver"):
        launch(print, start_method="fork")


def test_a_busy_port_is_named():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"master_port={port} .* is busy"):
            launch(print, master_port=port)


def test_unpicklable_arguments_and_variables_are_named():
    lock = threading.Lock()
    with pytest.raises(LaunchError, match=r"args\[1\] \(a _thread.lock\)"):
        launch(print, ("fine", lock))
    with pytest.raises(LaunchError, match=r"kwargs\['data'\]\['conn'\] \(a socket.socket\)"):
        with socket.socket() as conn:
            notebook_launcher(print, (), 2, kwargs={"data": {"conn": conn}}, display="none")
    generator = (i for i in range(3))
    with pytest.raises(LaunchError, match="variable 'generator' used by the function"):
        launch(lambda: list(generator))
    assert not rank_children()


# --- no leaks, no orphans ------------------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_fifty_launches_leak_no_processes_threads_or_descriptors():
    launch(lambda: None)  # warm: forkserver and first-time imports
    # Ranks a good run let go are joined at the next start; join the last run's here.
    assert wait_until(lambda: supervisor_module.reap_let_go() == 0, timeout=5)
    # Earlier tests' objects that hold a descriptor (a run's checks socket) go at a collection:
    # one during the loop made the count smaller, not larger. Count after collecting, both times.
    gc.collect()
    fds, threads = _open_fds(), threading.active_count()
    for _ in range(50):
        assert launch(lambda: nblaunch.rank()) == [0, 1]
    assert_no_ranks_left(5)
    assert wait_until(lambda: supervisor_module.reap_let_go() == 0, timeout=5)
    gc.collect()
    assert threading.active_count() == threads
    assert _open_fds() == fds


SCRIPT_WITHOUT_MAIN_GUARD = """
import os, sys, time
import nblaunch

print("top level of the script ran", flush=True)

def train():
    import time
    if nblaunch.rank() == 0:
        print("PIDS", os.getpid(), os.getppid(), flush=True)
    time.sleep(float(sys.argv[2]))
    return nblaunch.rank()

print("RESULT", nblaunch.notebook_launcher(
    train, (), 2, start_method=sys.argv[1], device_type="cpu", display="text"), flush=True)
"""


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_script_without_main_guard_is_not_rerun_in_the_ranks(tmp_path, start_method):
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT_WITHOUT_MAIN_GUARD)
    done = subprocess.run(
        [sys.executable, str(script), start_method, "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("top level of the script ran") == 1
    assert "RESULT [0, 1]" in done.stdout


def test_a_temp_dir_too_deep_for_the_forkserver_s_socket_names_tmpdir_and_the_fix(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 50)
    deep.mkdir(parents=True)
    script = "import nblaunch\nnblaunch.notebook_launcher(print, (), 2, display='none')"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(deep)},
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("nblaunch.errors.LaunchError: the temporary directory"), last
    assert str(deep) in last and "set TMPDIR to a shorter directory" in last


def test_no_rank_or_forkserver_survives_the_launcher_being_killed(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT_WITHOUT_MAIN_GUARD)
    launcher = subprocess.Popen(
        [sys.executable, str(script), "forkserver", "60"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "PIDS" not in line and time.monotonic() < deadline:
            line = launcher.stdout.readline()
        assert "PIDS" in line, "the ranks never started"
        rank_pid, forkserver_pid = (int(x) for x in line.split()[-2:])
        family = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        assert rank_pid in family and forkserver_pid in family
        launcher.kill()
        launcher.wait(10)

        def all_gone():
            return not any(psutil.pid_exists(pid) and _not_zombie(pid) for pid in family)

        assert wait_until(all_gone, timeout=5), [p for p in family if psutil.pid_exists(p)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        launcher.stdout.close()


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


LEFT_BEHIND_SCRIPT = """
    import nblaunch
    from multiprocessing import shared_memory

    def progress_bar_then_fail(stuck):
        import torch
        import torch.distributed as dist
        from tqdm import tqdm

        for _ in tqdm(range(3)):  # tqdm's first bar makes a multiprocessing lock
            pass
        if nblaunch.rank() == 1:
            raise ValueError("boom on rank 1")
        if stuck:
            dist.all_reduce(torch.ones(1))  # rank 1 never comes: rank 0 is killed in here

    def leak_shared_memory():
        if nblaunch.rank() == 0:
            shared_memory.SharedMemory(create=True, size=16)  # never unlinked: a real leak

    for stuck in (False, True):
        try:
            nblaunch.notebook_launcher(
                progress_bar_then_fail, (stuck,), 2, device_type="cpu", display="none"
            )
        except ValueError as exc:
            print("caught", exc)
    nblaunch.notebook_launcher(leak_shared_memory, (), 2, device_type="cpu", display="none")
"""


def test_killed_ranks_leave_no_semaphores_but_real_leaks_are_still_reported(tmp_path):
    pytest.importorskip("tqdm")
    script = tmp_path / "left_behind.py"
    script.write_text(textwrap.dedent(LEFT_BEHIND_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("caught boom on rank 1") == 2, done.stdout
    # The stopped ranks' tqdm locks were released by the launcher, not by the tracker at exit...
    assert "leaked semaphore" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # ...while shared memory a rank forgot to unlink is still the tracker's to report.
    assert "1 leaked shared_memory objects" in done.stderr, done.stderr


# --- in a real notebook kernel -------------------------------------------------------------------


@pytest.mark.slow
def test_in_a_kernel_errors_show_the_cell_line_and_interrupt_stops_every_rank(kernel):
    setup = kernel.run(
        "import nblaunch\n"
        "from nblaunch import notebook_launcher\n"
        "def train(seconds):\n"
        "    import time\n"
        "    if nblaunch.rank() == 1:\n"
        "        raise ValueError('boom on rank 1')\n"
        "    time.sleep(seconds)\n"
    )
    assert setup["error"] is None, setup
    failed = kernel.run("notebook_launcher(train, (0,), 2, display='text')", timeout=120)
    assert (failed["error"], failed["message"]) == ("ValueError", "boom on rank 1"), failed
    traceback_text = "\n".join(failed["traceback"])
    assert "raise ValueError('boom on rank 1')" in traceback_text  # the line that raised
    assert "launcher.py" not in traceback_text  # the launcher's own frames are hidden

    interrupted = kernel.run(
        "notebook_launcher(lambda: __import__('time').sleep(60), (), 2, display='text')",
        interrupt_after=3.0,
        timeout=60,
    )
    assert interrupted["error"] == "KeyboardInterrupt", interrupted
    assert interrupted["seconds"] < 3.0 + 5.0
    ranks_left = kernel.run(RANKS_LEFT_CODE)
    assert ranks_left["out"].strip() == "[]", ranks_left
    again = kernel.run("notebook_launcher(lambda: nblaunch.rank(), (), 2, display='none')")
    assert again["result"] == "[0, 1]", again


@pytest.mark.slow
def test_in_a_kernel_each_remote_frame_shows_its_own_cell_lines(kernel):
    setup = kernel.run(
        "from nblaunch import notebook_launcher\n"
        "def inner(values):\n"
        "    total = sum(values)\n"
        "    return total / (len(values) - len(values))\n"
        "def train():\n"
        "    data = [1, 2]\n"
        "    return {'k': inner(data)}['k']\n"
    )
    assert setup["error"] is None, setup
    failed = kernel.run("notebook_launcher(train, (), 2, display='none')", timeout=120)
    assert failed["error"] == "ZeroDivisionError", failed
    text = "\n".join(failed["traceback"])
    # Each frame shows its own function's lines, the failing one marked (not the cell's top).
    assert (
        "      5 def train():\n"
        "      6     data = [1, 2]\n"
        "----> 7     return {'k': inner(data)}['k']"
    ) in text
    assert "----> 4     return total / (len(values) - len(values))" in text


@pytest.mark.slow
def test_a_notebook_saved_without_widget_state_keeps_each_ranks_last_lines(widgetless_notebook):
    from conftest import WIDGET_VIEW

    saved, cells = widgetless_notebook  # conftest.WIDGETLESS_CELLS, run in one kernel
    assert "widgets" not in saved.metadata

    def shown(cell, mime):
        """What a viewer without widgets shows for the cell in ``mime``."""
        return "\n".join(
            out.data[mime]
            for out in cell.outputs
            if out.output_type in ("display_data", "execute_result")
            and WIDGET_VIEW not in out.data
            and mime in out.data
        )

    trained, failed = cells["trained"], cells["failed"]  # (a live view too, past 0.2 s)
    assert not [out for out in trained.outputs if out.output_type == "error"]
    text, page = shown(trained, "text/plain"), shown(trained, "text/html")
    assert "nblaunch: finished in " in text
    assert "rank 0: DONE · returned 0" in text and "rank 1: DONE · returned 10" in text
    for rank, loss in ((0, 0.0333), (1, 0.0323)):
        last = f"{{'loss': {loss}, 'epoch': 29}}"
        assert f"  {last}\n" in text, text
        assert html.escape(last) in page
        assert f"rank {rank} done" in text
        assert re.search(rf"… \d+ earlier lines in .+rank{rank}\.log", text), text
    assert not [line for line in text.splitlines() if "it/s]" in line and "loss" in line]
    assert "[30, 0]" not in text  # the cell's own result is its own output
    text = shown(failed, "text/plain")
    assert "nblaunch: failed in " in text
    assert "error: rank 1 of 2 failed: rank 1 raised ValueError: boom on rank 1" in text
    assert "rank 0 about to fail" in text and "rank 1 about to fail" in text


def test_in_a_kernel_importing_nblaunch_starts_the_forkserver_in_the_background(kernel):
    cell = kernel.run(
        "import time\n"
        "from multiprocessing import forkserver\n"
        "began = time.perf_counter()\n"
        "import nblaunch\n"
        "server = forkserver._forkserver\n"
        "while server._forkserver_pid is None and time.perf_counter() - began < 10:\n"
        "    time.sleep(0.01)\n"
        "print(server._forkserver_pid is not None)"
    )
    assert cell["out"].strip() == "True", cell  # before any launch
    first = kernel.run("nblaunch.notebook_launcher(lambda: 1, (), 2, display='none')")
    assert first["result"] == "[1, 1]", first


def test_a_plain_script_that_imports_nblaunch_starts_no_process():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time, nblaunch\n"
            "from multiprocessing import forkserver\n"
            "time.sleep(0.5)\n"
            "print(forkserver._forkserver._forkserver_pid)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "None", done


def test_the_first_launch_imports_no_torch_and_an_early_interrupt_leaves_a_usable_kernel(kernel):
    # Fault sweep case 6: the first launch imported torch in the kernel to count devices, so an
    # interrupt 0.06-0.2 s in landed inside `import torch` (the next launch failed with
    # SystemError, or hung), and the launch cell took ~1 s after an import of nblaunch alone.
    assert kernel.run("import nblaunch\ndef one(): return 1")["error"] is None
    interrupted = kernel.run(
        "nblaunch.notebook_launcher(one, num_processes=2, display='none')",
        interrupt_after=0.1,
        timeout=60,
    )
    assert interrupted["error"] in ("KeyboardInterrupt", None), interrupted
    after = kernel.run(
        "import sys, time\nt = time.perf_counter()\n"
        "print(nblaunch.notebook_launcher(one, num_processes=2, display='none'), "
        "'torch' in sys.modules, round(time.perf_counter() - t, 2))",
        timeout=120,
    )
    assert after["error"] is None, after
    *values, torch_imported, seconds = after["out"].split()
    assert values == ["[1,", "1]"] and torch_imported == "False", after["out"]
    assert float(seconds) < 5.0


def slow_teardown(marker: str) -> float:
    """Make this rank's process-group teardown take 0.6 s (as NCCL's does on a GPU) and note
    when it ended in ``marker`` + the rank."""
    import torch.distributed as dist

    from nblaunch.ranks import default_group

    original, rank = default_group.tear_down, dist.get_rank()

    def slow() -> None:
        time.sleep(0.6)
        original()
        with open(f"{marker}{rank}", "w") as file:
            file.write(repr(time.time()))

    default_group.tear_down = slow
    return time.time()


def test_the_values_come_back_before_the_process_groups_teardown(tmp_path):
    marker = str(tmp_path / "torn-down-")
    started = time.monotonic()
    launch(slow_teardown, (marker,))
    returned, took = time.time(), time.monotonic() - started
    # Both ranks finish their teardown after the launch returned, and leave nothing behind.
    assert_no_ranks_left(10)
    ended = [float((tmp_path / f"torn-down-{rank}").read_text()) for rank in (0, 1)]
    assert all(end > returned for end in ended), (ended, returned, took)
