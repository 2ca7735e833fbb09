"""``%%distributed`` and ``%dist`` in IPython's test shell and in a real Jupyter kernel (nbclient).

Cells run on 2 real CPU ranks (gloo). The kernel tests run one notebook of small cells in one
kernel, so the kernel and its forkserver start once.
"""

from __future__ import annotations

import linecache
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest
from conftest import rank_children
from IPython.core.error import UsageError
from IPython.testing.globalipapp import get_ipython

from nblaunch.notebook import dist_commands
from nblaunch.notebook.cell import build_cell_task, names_read
from nblaunch.ranks.cell import CellTask, to_notebook

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ip():
    from nblaunch.engine.processes.supervisor import warm_up

    shell = get_ipython()
    shell.run_line_magic("load_ext", "nblaunch")
    warm_up()  # the forkserver the extension starts in the background is up: not a rank
    yield shell
    shell.run_line_magic("unload_ext", "nblaunch")


def distributed(ip, line: str, cell: str):
    return ip.run_cell_magic("distributed", f"-n 2 {line}".strip(), cell)


# --- which names a cell reads --------------------------------------------------------------------


def test_names_read_skips_what_the_cell_binds_first():
    cell = (
        "x = a + 1\n"  # a is read; x is bound before its read below
        "y = x * 2\n"
        "import numpy as np\n"
        "z = np.zeros(3)\n"
        "w = w + 1\n"  # read before being bound
        "n += 1\n"  # an augmented assignment reads
        "for i in range(k):\n"  # i is bound by the loop; k is read
        "    total = i\n"
        "squares = [j * j for j in js]\n"  # j is the comprehension's own
        "def f(p):\n"
        "    return p + later + big_helper()\n"  # p is local; later is bound below
        "later = 3\n"
        "class C:\n"
        "    attr = class_level\n"
    )
    assert names_read(cell) == ["a", "w", "n", "range", "k", "js", "class_level", "big_helper"]


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        # Python 3.12+ inlines these comprehensions (PEP 709); their targets are still theirs.
        ("squares = [j * j for j in js]", ["js"]),
        ("s = {j for j in js if j > cut}", ["js", "cut"]),
        ("d = {k: v for k, v in pairs}", ["pairs"]),
        ("g = sum(j for j in js)", ["sum", "js"]),
        # the inner iterable sees the outer target; only the outermost runs in the cell
        ("m = [[i * j for j in row] for row, i in rows]", ["rows"]),
        # a comprehension target that the cell also reads itself is read
        ("s = [j for j in js]\nprint(j)", ["js", "print", "j"]),
        ("s = [j for j in js]\ndef f():\n    return j", ["js", "j"]),
        # the walrus binds in the cell, not the comprehension; but only if js is not empty
        ("s = [last := j for j in js]\nprint(last)", ["js", "print", "last"]),
        # annotations run when the def runs
        ("def f(x: Tensor) -> int:\n    return [t for t in x]", ["Tensor", "int"]),
    ],
)
def test_names_read_leaves_out_comprehension_targets_on_every_python(cell, expected):
    assert names_read(cell) == expected


def test_only_what_the_cell_reads_is_shipped_and_modules_go_by_name():
    import math

    user_ns = {
        "math": math,
        "used": [1, 2],
        "huge_unrelated": bytearray(50_000_000),
        "lock": threading.Lock(),  # unpicklable, but the cell does not read it
        "rank": 99,  # the rank's own value wins: never shipped
    }
    task = build_cell_task("print(math.pi, used, rank)\nlock = None\n", user_ns)
    assert task.names == ("math", "used")
    assert len(task.shipped) < 1000  # the module went by name, the big buffer not at all


def test_an_unpicklable_name_is_refused_before_anything_starts(ip):
    ip.user_ns["lock"] = threading.Lock()
    before = rank_children()
    with pytest.raises(UsageError) as info:
        distributed(ip, "", "with lock:\n    pass\n")
    message = str(info.value)
    assert "'lock'" in message and "_thread.lock" in message
    assert "\n" not in message
    assert rank_children() == before


def test_a_notebook_function_holding_an_unpicklable_object_is_named(ip):
    ip.run_cell("import threading\n_held = threading.RLock()\ndef guarded():\n    return _held\n")
    with pytest.raises(UsageError, match=r"'guarded'.*'_held'.*RLock"):
        distributed(ip, "", "guarded()\n")


# --- running cells -------------------------------------------------------------------------------


def test_modules_functions_closures_classes_and_tensors_reach_the_ranks(ip):
    ip.run_cell(
        "import math\n"
        "import torch\n"
        "weights = torch.arange(4.0)\n"
        "def make_adder(k):\n"
        "    def add(x):\n"
        "        return x + k\n"
        "    return add\n"
        "add_ten = make_adder(10)\n"
        "def where_am_i():\n"
        "    return f'{rank}/{world_size} on {device}'\n"  # the rank's globals, as in a notebook
        "class Scaler:\n"
        "    def __call__(self, x):\n"
        "        return x * world_size\n"
    )
    value = distributed(
        ip,
        "",
        "import torch.distributed as dist\n"
        "total = weights.clone() * (rank + 1)\n"
        "dist.all_reduce(total)\n"
        "(add_ten(total.sum().item()), math.floor(math.pi), where_am_i(), Scaler()(2), rank)\n",
    )
    # (0+1+2+3) * (1 + 2) = 18, plus 10
    assert value == (28.0, 3, "0/2 on cpu", 4, 0)


def test_the_last_expression_of_rank_0_is_the_result(ip):
    result = ip.run_cell("%%distributed -n 2\nx = rank * 10\nf'rank {rank} of {world_size}: {x}'")
    assert result.success
    assert result.result == "rank 0 of 2: 0"
    assert ip.user_ns["_"] == "rank 0 of 2: 0"
    quiet = ip.run_cell("%%distributed -n 2\nrank + 1;")
    assert quiet.success and quiet.result is None
    nothing = ip.run_cell("%%distributed -n 2\ny = 1\n")
    assert nothing.success and nothing.result is None


def test_outputs_bind_rank_0_values_on_the_cpu(ip):
    ip.user_ns.pop("model", None)
    ip.user_ns.pop("history", None)
    distributed(
        ip,
        "-o model,history,grads",
        "import torch\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(rank)\n"
        "model = DDP(torch.nn.Linear(3, 1))\n"
        "out = model(torch.ones(2, 3)).sum()\n"
        "out.backward()\n"
        "history = [out.item(), {'rank': rank, 'prediction': out * 2}]\n"
        "grads = model.module.weight.grad\n",
    )
    import torch

    model = ip.user_ns["model"]
    assert type(model) is torch.nn.Linear  # DistributedDataParallel unwrapped
    assert model.weight.device.type == "cpu"
    history = ip.user_ns["history"]
    assert history[1]["rank"] == 0
    prediction = history[1]["prediction"]
    assert isinstance(prediction, torch.Tensor) and not prediction.requires_grad
    assert prediction.item() == pytest.approx(2 * history[0])
    assert ip.user_ns["grads"].shape == (1, 3)


def test_an_output_the_cell_did_not_define_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="-o nowhere: the cell did not define nowhere"):
        distributed(ip, "-o defined,nowhere", "defined = 1\n")
    assert ip.user_ns["defined"] == 1


def test_the_failing_ranks_error_is_raised_with_the_cells_line_numbers(ip):
    cell = "x = 1\nif rank == 1:\n    raise ValueError(f'boom on rank {rank}')\ny = 2\n"
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        distributed(ip, "", cell)
    assert any("rank 1 of 2" in note for note in getattr(info.value, "__notes__", []))
    frames = traceback.extract_tb(info.value.__traceback__)
    cell_frames = [f for f in frames if f.filename == frames[-1].filename]
    # Line 1 of the cell is the %%distributed line: the raise is on line 4.
    assert cell_frames[-1].lineno == 4
    assert linecache.getline(cell_frames[-1].filename, 4).strip().startswith("raise ValueError")
    assert linecache.getline(cell_frames[-1].filename, 1).startswith("%%distributed -n 2")
    # No launcher frame between the magic and the cell.
    assert not [f for f in frames if f.filename.endswith(("launcher.py", "worker.py"))]


def test_a_rank_that_dies_points_at_the_magic_line_not_the_launcher(ip):
    from nblaunch import RankFailedError

    with pytest.raises(RankFailedError, match="rank 1 of 2 exited with code 3") as info:
        distributed(ip, "", "import os\nif rank == 1:\n    os._exit(3)\n")
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].line == "%%distributed -n 2" and frames[-1].lineno == 1
    assert not [f for f in frames if f.filename.endswith(("launcher.py", "worker.py"))]


def test_a_cause_the_cell_chained_keeps_its_own_cell_lines(ip):
    cell = (
        "try:\n    {}['missing']\nexcept KeyError as e:\n    raise ValueError('wrapped') from e\n"
    )
    with pytest.raises(ValueError, match="wrapped") as info:
        distributed(ip, "", cell)
    cause = info.value.__cause__
    assert isinstance(cause, KeyError)
    (frame,) = traceback.extract_tb(cause.__traceback__)
    assert frame.lineno == 3 and frame.line == "{}['missing']"


def test_ipython_shows_the_cell_source_in_the_traceback(ip, capsys):
    ip.run_cell("def inner_fails():\n    return 1 / 0\n")
    result = ip.run_cell("%%distributed -n 2\nvalue = 3\ninner_fails()\n")
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert f"Cell In[{ip.execution_count}], line 3" in text
    assert "----> 3 inner_fails()" in text
    assert "return 1 / 0" in text  # the notebook function's own line, from the notebook


def test_a_syntax_error_names_the_cell_line(ip):
    with pytest.raises(SyntaxError) as info:
        distributed(ip, "", "x = 1\ny = (2 +\n")
    assert info.value.lineno == 3


def test_ipython_syntax_in_the_cell_is_refused(ip):
    with pytest.raises(UsageError, match=r"line 3: IPython syntax"):
        distributed(ip, "", "x = 1\n!ls\n")


@pytest.mark.parametrize(
    "line",
    [
        "--bogus",
        "-n 0",
        "-n two",
        "--timeout -1",
        "--hang-timeout soon",
        "--start-method thread",
        "--log-level LOUD",
        "-o 1model",
        "--ranks 0",  # needs a running pool
    ],
)
def test_bad_options_are_one_line_usage_errors(ip, line):
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("distributed", line, "1\n")
    assert "\n" not in str(info.value)


def test_nodes_options_reach_the_multinode_launcher(ip):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    line = f"-n 1 --nodes 2 --rdzv-endpoint 127.0.0.1:{port} --rdzv-timeout 2"
    joined = rf"only 1 of 2 nodes joined the rendezvous at 127.0.0.1:{port}"
    with pytest.raises(UsageError, match=joined):
        ip.run_cell_magic("distributed", line, "rank\n")
    assert not rank_children()


def test_help_lists_every_option(ip, capsys):
    doc = ip.find_cell_magic("distributed").__doc__
    for option in (
        "-n N",
        "--debug",
        "--log-level LEVEL",
        "--start-method M",
        "--timeout S",
        "--hang-timeout S",
        "-o NAMES",
        "--ranks SPEC",
    ):
        assert option in doc
    ip.run_cell("%%distributed?")
    assert "%%distributed [-n N]" in capsys.readouterr().out


# --- %dist ---------------------------------------------------------------------------------------


def test_dist_lists_what_the_extension_offers(ip, capsys):
    ip.run_line_magic("dist", "")
    out = capsys.readouterr().out
    assert "%%distributed" in out
    assert "%dist env" in out


def test_dist_env_prints_the_report_then_the_hostfile_check(ip, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh: the check says so without connecting
    hostfile = tmp_path / "hosts"
    hostfile.write_text("alpha\n")
    ip.run_line_magic("dist", f"env {hostfile}")
    out = capsys.readouterr().out
    assert out.index("nblaunch environment") < out.index(f"hosts in {hostfile}:")
    assert "ssh is not on PATH" in out


def test_dist_commands_come_from_the_registry(ip, capsys):
    calls = []
    dist_commands.register_dist_command(
        "echo", lambda rest: calls.append(rest) or rest.upper(), "echo"
    )
    dist_commands.register_dist_command("later", "os.path:basename", "resolved when first run")
    try:
        assert ip.run_line_magic("dist", "echo a  b") == "A  B"
        assert calls == ["a  b"]
        assert ip.run_line_magic("dist", "later /x/y.txt") == "y.txt"
        ip.run_line_magic("dist", "")
        out = capsys.readouterr().out
        assert "%dist echo" in out and "resolved when first run" in out
        with pytest.raises(UsageError, match="no such command"):
            ip.run_line_magic("dist", "nonsense")
    finally:
        dist_commands.unregister_dist_command("echo")
        dist_commands.unregister_dist_command("later")
    assert "echo" not in dist_commands.dist_commands()


def test_reload_and_unload(ip):
    ip.run_line_magic("reload_ext", "nblaunch")
    assert ip.find_cell_magic("distributed") is not None
    assert distributed(ip, "", "world_size") == 2
    ip.run_line_magic("unload_ext", "nblaunch")
    assert ip.find_cell_magic("distributed") is None
    assert ip.find_line_magic("dist") is None
    ip.run_line_magic("load_ext", "nblaunch")
    assert ip.find_line_magic("dist") is not None


def test_loading_the_extension_does_not_import_torch():
    code = (
        "import sys\n"
        "from IPython.testing.globalipapp import get_ipython\n"
        "ip = get_ipython()\n"
        "ip.run_line_magic('load_ext', 'nblaunch')\n"
        "ip.run_line_magic('dist', '')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip().endswith("False")


# --- the task on its own (what the pool uses) -----------------------------------------------------


def test_a_kept_namespace_prefers_what_the_rank_defined():
    """The pool's case: one namespace across cells, notebook values refreshed, rank state kept."""
    namespace: dict = {}
    user_ns = {"__name__": "__main__", "lr": 0.1, "state": "from the notebook"}
    exec("def step(x):\n    return x * lr + offset\n", user_ns)
    build_cell_task("offset = 1\nstate = 'from the rank'\n", user_ns)(namespace)
    task = build_cell_task("step(10), state, lr\n", user_ns, outputs=("offset",))
    first = task(namespace)
    user_ns["lr"] = 1.0  # changed in the notebook: the next cell sees the new value
    second = build_cell_task("step(10), state\n", user_ns)(namespace)
    import cloudpickle

    # step() reads lr and offset from the kept namespace, like a notebook function would.
    assert cloudpickle.loads(first.value) == (2.0, "from the rank", 0.1)
    assert cloudpickle.loads(first.outputs["offset"]) == 1
    assert cloudpickle.loads(second.value) == (11.0, "from the rank")


def test_only_the_main_rank_sends_values_back():
    task = build_cell_task("7\n", {}, outputs=("x",))
    assert isinstance(task, CellTask)
    task.main_rank = 1
    assert task(None) is None  # in-process, this is rank 0


def test_to_notebook_detaches_and_keeps_containers():
    import torch

    leaf = torch.ones(2, requires_grad=True)
    derived = leaf * 2
    moved = to_notebook({"a": [leaf, derived], "b": (1, "x")})
    assert moved["a"][0] is leaf  # already on the CPU and picklable: sent as is
    assert not moved["a"][1].requires_grad and moved["a"][1].grad_fn is None
    assert moved["b"] == (1, "x")


# --- a real kernel -------------------------------------------------------------------------------

KERNEL_CELLS = [
    "%load_ext nblaunch",
    "import torch\nscale = 2\ndef helper(x):\n    return x * scale\nweights = torch.ones(3)",
    "%%distributed -n 2\nprint(f'rank {rank} says hi')\nhelper(weights.sum().item()) + rank",
    "%%distributed -n 2\nx = 1\nif rank == 1:\n    raise ValueError('boom on one')\n",
    "%%distributed -n 2 --bogus\n1",
    "%reload_ext nblaunch",
    "%%distributed -n 2 -o total\nimport torch.distributed as dist\n"
    "total = torch.tensor([float(rank)])\ndist.all_reduce(total)",
    "print(repr(total))",
    "%dist",
]


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory):
    import nbformat
    from nbclient import NotebookClient

    workdir = tmp_path_factory.mktemp("magics-kernel")
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in KERNEL_CELLS]
    )
    statuses: dict[int, str] = {}  # cell index -> the kernel's reply: "ok" or "error"

    def record(cell, cell_index, execute_reply):
        statuses[cell_index] = execute_reply["content"]["status"]

    client = NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(workdir)}},
        on_cell_executed=record,
    )
    client.execute()
    return notebook, statuses


def _text(cell) -> str:
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback))
    return "\n".join(parts)


def _errors(cell) -> list:
    return [o for o in cell.outputs if o.output_type == "error"]


@pytest.mark.slow
def test_in_a_kernel_results_show_as_the_cells_result(kernel_run):
    notebook, statuses = kernel_run
    cell = notebook.cells[2]
    assert statuses[2] == "ok"
    results = [o for o in cell.outputs if o.output_type == "execute_result"]
    assert [r.data["text/plain"] for r in results] == ["6.0"]


@pytest.mark.slow
def test_in_a_kernel_the_error_fails_the_cell_with_its_line(kernel_run):
    import re

    notebook, statuses = kernel_run
    cell = notebook.cells[3]
    assert statuses[3] == "error"  # so "Run All" stops here
    (error,) = _errors(cell)
    assert error.ename == "ValueError" and error.evalue == "boom on one"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
    n = cell.execution_count
    assert f"Cell In[{n}], line 4" in text
    # The cell's own lines, numbered as in the cell (line 1 is the %%distributed line).
    assert "      3 if rank == 1:\n----> 4     raise ValueError('boom on one')" in text
    assert "raised on rank 1 of 2" in text


@pytest.mark.slow
def test_in_a_kernel_bad_options_reload_outputs_and_dist(kernel_run):
    notebook, statuses = kernel_run
    cells = notebook.cells
    assert statuses[4] == "error"
    assert "UsageError: unrecognized arguments: --bogus" in _text(cells[4])
    assert statuses[5] == statuses[6] == "ok"
    assert "tensor([1.])" in _text(cells[7])
    assert "%%distributed" in _text(cells[8])


# --- the example notebook ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_magic_notebook_trains_with_ddp_and_returns_the_model(tmp_path):
    import re
    import shutil

    import nbformat
    from nbclient import NotebookClient

    path = tmp_path / "magic.ipynb"
    shutil.copy(ROOT / "notebooks" / "magic.ipynb", path)
    notebook = nbformat.read(path, as_version=4)
    # Cells tagged raises-exception may fail; any other error fails the run here.
    NotebookClient(
        notebook,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    code = [c for c in notebook.cells if c.cell_type == "code"]
    training = next(c for c in code if c.source.startswith("%%distributed -n 2 -o model,history"))
    (result,) = [o for o in training.outputs if o.output_type == "execute_result"]
    first, last = map(
        float, re.search(r"loss (\S+) -> (\S+) on 2 ranks", str(result.data)).groups()
    )
    assert last < first / 5
    # The ranks' prints are in the live view and in the run's per-rank logs.
    run_dir = Path(tmp_path, re.search(r"logs: (\S+)", _text(training)).group(1))
    for rank in (0, 1):
        assert "epoch  0: loss" in (run_dir / f"rank{rank}.log").read_text()
    inspect = next(c for c in code if "final_loss" in c.source)
    shown = _text(inspect)
    assert "TinyNet on cpu (the notebook's class: True)" in shown
    assert float(re.search(r"loss on all data (\S+),", shown).group(1)) < first / 5
    failing = next(c for c in code if "lost half its features" in c.source)
    (error,) = _errors(failing)
    assert error.ename == "RuntimeError"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
    assert f"Cell In[{failing.execution_count}], line 3" in text
    assert "raised on rank 1 of 2" in text
    refused = next(c for c in code if c.source.startswith("%%distributed -n 2\nwith lock"))
    assert "UsageError: the cell uses variable 'lock' (a _thread.lock)" in _text(refused)


# --- on a persistent pool ------------------------------------------------------------------------


@pytest.mark.slow
def test_cells_run_on_a_running_pool_and_keep_their_state(ip):
    from nblaunch.notebook.pool_start import start_pool

    pool = start_pool(2, device_type="cpu", display="none")
    try:
        ip.run_cell(
            "import torch\npool_lr = 0.5\ndef pool_step(v):\n    return v * pool_lr + rank\n"
        )
        assert distributed_on_pool(ip, "", "kept = torch.ones(2) * (rank + 1)\nrank") == 0
        ip.user_ns["pool_lr"] = 1.0  # changed in the notebook: the pool sees the new value
        value = distributed_on_pool(ip, "--ranks 1 -o kept", "kept = kept * 10\npool_step(1)")
        assert value == 2.0  # rank 1's last expression: 1 * 1.0 + 1
        assert ip.user_ns["kept"].tolist() == [20.0, 20.0]  # rank 1's, defined two cells ago
        with pytest.raises(UsageError, match="-n, --debug: a pool is running"):
            distributed(ip, "--debug", "1")
    finally:
        pool.close()


def distributed_on_pool(ip, line: str, cell: str):
    return ip.run_cell_magic("distributed", line, cell)  # no -n: the pool's ranks


def test_a_pushed_value_is_not_sent_again_by_the_cells_that_read_it(ip, monkeypatch):
    # Fault sweep case 7: after %dist push big (512 MB), every cell reading big took 6-9 s while
    # the notebook still held it: its copy was pickled and shipped each time, for nothing.
    import nblaunch.notebook.cell as cell_module
    from nblaunch.notebook.pool_start import start_pool

    sent = []
    serialize = cell_module.serialize_names
    monkeypatch.setattr(
        cell_module,
        "serialize_names",
        lambda values: sent.append(sorted(values)) or serialize(values),
    )
    pool = start_pool(2, device_type="cpu", display="none")
    try:
        ip.run_cell("import torch\nbig = torch.ones(4_000_000)\nsmall = 2")
        ip.run_line_magic("dist", "push big")
        assert distributed_on_pool(ip, "", "float(big.sum()) * small") == 8_000_000.0
        assert sent[-1] == ["small"]  # big is on every rank already
        ip.run_line_magic("dist", "push big --ranks 1")  # only some ranks: sent again
        distributed_on_pool(ip, "", "big.numel()")
        assert sent[-1] == ["big"]
        ip.run_line_magic("dist", "push big")
        ip.run_cell("big = torch.zeros(3)")  # rebound in the notebook: no longer the pushed one
        distributed_on_pool(ip, "", "big.numel()")
        assert sent[-1] == ["big"]
        pool.restart()  # fresh ranks hold nothing
        ip.run_line_magic("dist", "push big")
        pool.restart()
        assert distributed_on_pool(ip, "", "big.numel()") == 3
        assert sent[-1] == ["big"]
    finally:
        pool.close()


# --- code that makes and destroys its own process group -------------------------------------------

# The PyTorch DDP tutorial's setup, cleanup, ToyModel and demo_basic, as a notebook cell (only
# `.to(rank)` and `device_ids=[rank]` are left out: these ranks run on the CPU).
DDP_TUTORIAL_CELL = """
import os
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'

    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))

def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model and wrap it with DDP
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    cleanup()

def all_reduce_sum():
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return total.item()
"""


def test_the_ddp_tutorial_in_cells_one_shot_and_on_the_pool(ip):
    from nblaunch.notebook.pool_start import start_pool

    assert ip.run_cell(DDP_TUTORIAL_CELL).success
    cell = "demo_basic(rank, world_size)\ndist.is_initialized()"
    assert distributed(ip, "", cell) is False
    pool = start_pool(2, device_type="cpu", display="none")
    try:
        for _ in range(2):  # every cell sets up and cleans up, as the tutorial's demos do
            assert distributed_on_pool(ip, "", cell) is False
        # A cell that does not set up finds a ready group again.
        assert distributed_on_pool(ip, "", "all_reduce_sum()") == 3.0
        # A cell on some ranks never makes the group again (that takes every rank)...
        assert distributed_on_pool(ip, "--ranks 0", "cleanup()\ndist.is_initialized()") is False
        assert distributed_on_pool(ip, "--ranks 0", "dist.is_initialized()") is False
        # ...and ranks that each destroyed theirs in a cell of their own meet again.
        distributed_on_pool(ip, "--ranks 1", "cleanup()")
        assert distributed_on_pool(ip, "", "all_reduce_sum()") == 3.0
    finally:
        pool.close()
