"""Failures in real training code: what nblaunch, torchrun and Accelerate report, and how fast.

Run: ``.venv/bin/python benchmarks/bench_real.py`` (every scenario x every launcher, about
15-20 minutes, most of it in rows that hang for the whole ``--limit``). Prints one markdown
table and writes it to ``benchmarks/results/bench_real.md`` (with the raw rows next to it in
``bench_real.json``).

- ``--only SCENARIO[,SCENARIO]`` and ``--rows LAUNCHER[,LAUNCHER]`` pick cells (launchers:
  ``nblaunch``, ``nblaunch-debug``, ``torchrun``, ``accelerate``); ``--limit S`` changes how long
  a row may go on after its fault (120 s). A partial run prints its table and writes nothing,
  unless ``--merge``: then its cells replace the same cells of the stored results, and the
  stored table says which rows were measured later.
- ``--check`` runs the chosen scenarios without their fault (under torchrun unless ``--rows``
  says otherwise) and fails unless every rank finished every step: the fault is the only
  difference between a healthy run and a measured one.

The six scenarios are in ``real_scenarios.py`` (2 CPU ranks, gloo, tiny models, fixed seeds).
Rows:

- nblaunch: ``notebook_launcher(fn, num_processes=2, display="none")``, default ``hang_timeout``;
- nblaunch debug: the same with ``debug=True``;
- torchrun: ``python -m torch.distributed.run --nproc-per-node 2 real_scenarios.py NAME``
  (the script wraps the scenario in torchrun's ``@record``, as torchrun's docs advise, so its
  summary carries the root cause's exception);
- Accelerate: ``accelerate.notebook_launcher(fn, num_processes=2)`` with
  ``ACCELERATE_USE_CPU=1``, from a small driver (this file with ``--drive``).

Each row runs in a fresh process group of its own, with ``NBLAUNCH_BENCH_ROW=<uuid>`` in its
environment. Columns:

- time to an error: from the moment a rank committed the fault (the scenario writes the time to
  a file) to the moment the caller got the exception (nblaunch, Accelerate: the driver's
  ``except``) or torchrun exited with an error;
- first line of the error: for nblaunch, ``Type: first line of the message``; for a
  ``ChildFailedError`` (torchrun, and what Accelerate raises) whose own first line is blank, its
  root cause condensed: rank, exit code, and the last line of that rank's traceback;
- right rank: whether the ranks the report blames are exactly the scenario's culprits (the rule
  is printed under the table). nblaunch's blamed rank is ``exc.rank``, else the rank in its
  ``raised on rank N`` note (every rank for ``raised on every rank``), else the rank(s) the
  first line starts with; a
  ``ChildFailedError`` blames its root-cause rank, the failure with the earliest error-file
  timestamp; those are whole seconds, so when the raising rank and its peer (which then sees
  "Connection closed by peer") fail within the same second the tie goes to the first rank in
  the failure list, and this cell can change from one run to the next;
- processes left: processes with the row's marker still alive 2 s after the driver returned (or
  after its group was killed at the limit); they are then killed by pid.

A row with no error ``--limit`` seconds after its fault is killed (``os.killpg``) and reported as
"no error in N s".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from real_scenarios import FAULT_FILE_ENV, SCENARIOS, WORLD_SIZE  # noqa: E402

LAUNCHERS = {
    "nblaunch": "nblaunch (default)",
    "nblaunch-debug": "nblaunch debug=True",
    "torchrun": "torchrun",
    "accelerate": "Accelerate notebook_launcher",
}
MARKER_ENV = "NBLAUNCH_BENCH_ROW"
LIMIT_S = 120.0
STARTUP_S = 120.0  # a row that has not reached its fault this long after starting is stopped
LEFTOVER_WAIT_S = 2.0
FIRST_LINE_CHARS = 240
# Variables a launcher sets in its ranks: never inherited by a row from whatever ran us.
LAUNCHER_VARIABLES = re.compile(
    r"(RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|ROLE_WORLD_SIZE|"
    r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|ACCELERATE_.*|NBLAUNCH_BENCH_ROW)"
)


@dataclass
class Outcome:
    """What one launch ended with, as the driver (or torchrun's output) tells it."""

    kind: str  # "raised", "returned", "timeout", "no-fault"
    first_line: str = ""
    blamed: list[int] = field(default_factory=list)
    error_time: float | None = None
    returned: object = None


@dataclass
class Row:
    scenario: str
    launcher: str
    outcome: Outcome
    fault_time: float | None
    left: int
    wall_s: float
    measured: str  # when the run that measured it started, "YYYY-MM-DD HH:MM"

    @property
    def seconds_to_error(self) -> float | None:
        if self.outcome.kind != "raised" or None in (self.outcome.error_time, self.fault_time):
            return None
        return self.outcome.error_time - self.fault_time

    @property
    def right_rank(self) -> bool:
        culprits = SCENARIOS[self.scenario].culprits
        return self.outcome.kind == "raised" and set(self.outcome.blamed) == culprits


# --- reading reports -----------------------------------------------------------------------------


def first_line(text: str) -> str:
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= FIRST_LINE_CHARS else line[: FIRST_LINE_CHARS - 1] + "…"


def subject_ranks(line: str) -> list[int]:
    """The rank(s) a sentence is about: the first ``rank N`` / ``ranks N, M`` / ``rank(s) N``."""
    match = re.search(r"\branks?(?:\(s\))? (\d+(?:(?:, | and )\d+)*)", line)
    return [int(n) for n in re.findall(r"\d+", match.group(1))] if match else []


def nblaunch_blamed(exc: BaseException) -> list[int]:
    rank = getattr(exc, "rank", None)
    if isinstance(rank, int):
        return [rank]
    for note in getattr(exc, "__notes__", ()):
        match = re.search(r"raised on rank (\d+)", note)
        if match:
            return [int(match.group(1))]
        match = re.search(r"raised on every rank \((\d+) of", note)
        if match:  # debug mode's verdict, reached together: the report names every rank's call
            return list(range(int(match.group(1))))
    match = re.search(r"comparing the calls of ranks ([\d, ]+) at collective", str(exc))
    if match:  # the out-of-band checks: the ranks whose calls disagree
        return [int(rank) for rank in match.group(1).split(", ")]
    return subject_ranks(str(exc).splitlines()[0] if str(exc) else "")


def child_failure_line(rank: int, exitcode: int, signal_name: str, message: str) -> str:
    signal_part = f" ({signal_name})" if signal_name else ""
    last = [line.strip() for line in message.splitlines() if line.strip()]
    return f"ChildFailedError: root cause rank {rank} (exitcode {exitcode}{signal_part}): " + (
        last[-1] if last else "<no message>"
    )


def parse_torchrun_output(text: str) -> tuple[str, list[int]]:
    """Condense the root-cause block of torchrun's ChildFailedError summary."""
    block = text.rpartition("Root Cause (first observed failure):")[2]
    if not block:
        return first_line(text.splitlines()[-1] if text else ""), []
    block = block.split("=" * 20)[0]
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", block, re.M)
    exitcode = re.search(r"^\s*exitcode\s*:\s*(-?\d+).*?(?:\((SIG\w+)\))?$", block, re.M)
    traceback = block.partition("traceback :")[2] or block
    if not rank or not exitcode:
        return first_line(block), []
    line = child_failure_line(
        int(rank.group(1)), int(exitcode.group(1)), exitcode.group(2) or "", traceback
    )
    return first_line(line), [int(rank.group(1))]


# --- one row -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def marked_processes(marker: str) -> list[int]:
    """Pids whose environment holds ``NBLAUNCH_BENCH_ROW=<marker>``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


def row_environment(marker: str, fault_file: Path, workdir: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not LAUNCHER_VARIABLES.fullmatch(key)}
    env.update(
        {
            MARKER_ENV: marker,
            FAULT_FILE_ENV: str(fault_file),
            "NBLAUNCH_RUN_DIR": str(workdir / "runs"),
            "OMP_NUM_THREADS": "1",  # 2 cores, 2 ranks
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def run_row(
    scenario: str,
    launcher: str,
    limit: float,
    healthy: bool = False,
    show_output: bool = False,
    measured: str = "",
) -> tuple[Row, str]:
    """Run one cell in its own session; return the row and the row's output."""
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        workdir = Path(tmp)
        marker = uuid.uuid4().hex
        fault_file, result_file, log_file = (workdir / n for n in ("fault", "result", "log"))
        port = str(free_port())
        if launcher == "torchrun":
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(WORLD_SIZE),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                str(HERE / "real_scenarios.py"),
                scenario,
                *(["--healthy"] if healthy else []),
            ]
        else:
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--drive",
                launcher,
                scenario,
                str(result_file),
                port,
                *(["--healthy"] if healthy else []),
            ]
        started = time.time()
        with open(log_file, "wb") as log:
            process = subprocess.Popen(
                command,
                cwd=workdir,
                env=row_environment(marker, fault_file, workdir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killpg stops what we started
            )
            timed_out = wait_bounded(process, fault_file, started, limit)
        ended = time.time()
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        time.sleep(LEFTOVER_WAIT_S)
        leftovers = marked_processes(marker)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output = log_file.read_text(errors="replace")
        fault_time = float(fault_file.read_text().split()[0]) if fault_file.exists() else None
        if timed_out:
            kind = "timeout" if fault_time is not None or healthy else "no-fault"
            outcome = Outcome(kind)
        elif launcher == "torchrun":
            if process.returncode == 0:
                outcome = Outcome("returned")  # check() reads the ranks' lines in the output
            else:
                line, blamed = parse_torchrun_output(output)
                outcome = Outcome("raised", line, blamed, ended)
        elif result_file.exists():
            outcome = Outcome(**json.loads(result_file.read_text()))
        else:
            outcome = Outcome("raised", f"driver exited {process.returncode} without a result")
        if not healthy and fault_time is None and outcome.kind != "timeout":
            # Failed before the fault: an environment problem, not a measurement.
            outcome.first_line = f"(before the fault) {outcome.first_line}".strip()
            outcome.kind = "no-fault"
        if show_output or outcome.kind == "no-fault":
            tail = "\n".join(output.splitlines()[-40:])
            print(
                f"--- output of {scenario} / {launcher} (last 40 lines):\n{tail}\n---", flush=True
            )
        row = Row(
            scenario, launcher, outcome, fault_time, len(leftovers), ended - started, measured
        )
        return row, output


def wait_bounded(process: subprocess.Popen, fault_file: Path, started: float, limit: float) -> bool:
    """Wait for the row to end; True if it had to be stopped (``limit`` s after its fault, or
    ``STARTUP_S + limit`` after its start if the fault never came)."""
    fault_seen: float | None = None
    while True:
        try:
            process.wait(timeout=0.05)
            return False
        except subprocess.TimeoutExpired:
            pass
        now = time.time()
        if fault_seen is None and fault_file.exists():
            fault_seen = now
        if fault_seen is not None and now - fault_seen > limit:
            return True
        if now - started > STARTUP_S + limit:
            return True


# --- the driver (a fresh process per row) --------------------------------------------------------


def drive(launcher: str, scenario: str, result_file: str, port: str, healthy: bool) -> None:
    """Launch one scenario the way a notebook would, and write what came back."""
    function = SCENARIOS[scenario].function
    result: dict
    try:
        if launcher.startswith("nblaunch"):
            from nblaunch import notebook_launcher

            returned = notebook_launcher(
                function,
                kwargs={"healthy": healthy},
                num_processes=WORLD_SIZE,
                display="none",
                debug=True if launcher == "nblaunch-debug" else None,
            )
        elif launcher == "accelerate":
            os.environ["ACCELERATE_USE_CPU"] = "1"
            from accelerate import notebook_launcher

            # The function's first positional argument is ``healthy``.
            returned = notebook_launcher(
                function, args=(healthy,), num_processes=WORLD_SIZE, use_port=port
            )
        else:
            raise ValueError(f"unknown launcher {launcher!r}")
        result = {"kind": "returned", "returned": repr(returned)}
    except Exception as exc:  # what the notebook cell would show
        caught = time.time()
        line, blamed = describe(exc)
        result = {"kind": "raised", "first_line": line, "blamed": blamed, "error_time": caught}
        import traceback

        traceback.print_exc()
    Path(result_file).write_text(json.dumps(result))


def describe(exc: BaseException) -> tuple[str, list[int]]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, ChildFailedError):
        rank, failure = exc.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        signal_name = failure.signal_name() if failure.exitcode < 0 else ""
        return first_line(child_failure_line(rank, failure.exitcode, signal_name, message)), [rank]
    text = str(exc)
    return first_line(f"{type(exc).__name__}: {text}"), nblaunch_blamed(exc)


# --- the table -----------------------------------------------------------------------------------


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[Row], limit: float) -> str:
    lines = [
        "| scenario | launcher | time to an error (s) | first line of the error | right rank "
        "| processes left |",
        "|---|---|---:|---|---|---:|",
    ]
    for row in rows:
        outcome = row.outcome
        seconds = row.seconds_to_error
        if outcome.kind == "timeout":
            line, right = f"no error in {limit:.0f} s (killed)", "-"
        elif outcome.kind == "returned":
            line, right = "no error: returned normally", "no"
        elif outcome.kind == "no-fault":
            line, right = outcome.first_line or "did not reach the fault", "-"
        else:
            blamed = ", ".join(map(str, outcome.blamed)) or "none"
            line = outcome.first_line
            right = f"{'yes' if row.right_rank else 'no'} (blames {blamed})"
        lines.append(
            "| "
            + " | ".join(
                (
                    SCENARIOS[row.scenario].fault,
                    LAUNCHERS[row.launcher],
                    f"{seconds:.1f}" if seconds is not None else "-",
                    cell(line),
                    right,
                    str(row.left),
                )
            )
            + " |"
        )
    lines.append("")
    lines.append("Right rank, per scenario (the report must blame exactly these ranks):")
    lines.append("")
    for scenario in dict.fromkeys(row.scenario for row in rows):
        lines.append(f"- {scenario} ({SCENARIOS[scenario].fault}): {SCENARIOS[scenario].rule}")
    return "\n".join(lines)


def load_stored() -> tuple[list[Row], dict]:
    path = RESULTS / "bench_real.json"
    if not path.exists():
        return [], {}
    data = json.loads(path.read_text())
    rows = [Row(**{**r, "outcome": Outcome(**r["outcome"])}) for r in data["rows"]]
    return rows, data


def write_results(rows: list[Row], limit: float, header: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    runs = sorted({row.measured for row in rows})
    text = f"# bench_real\n\n{header}\n\n{table(rows, limit)}\n"
    if len(runs) > 1:
        text += "\nRows come from several runs (`--merge`):\n\n"
        for run in runs:
            cells = [f"{row.scenario} / {row.launcher}" for row in rows if row.measured == run]
            text += f"- {run}: {', '.join(cells)}\n"
    (RESULTS / "bench_real.md").write_text(text)
    (RESULTS / "bench_real.json").write_text(
        json.dumps(
            {"limit": limit, "header": header, "rows": [asdict(row) for row in rows]}, indent=1
        )
        + "\n"
    )


def nblaunch_state() -> str:
    """Which nblaunch the nblaunch rows measured: the commit, and a digest of uncommitted
    changes under ``nblaunch/`` (others edit it while benchmarks run)."""
    import hashlib

    def git(*args: str) -> str:
        result = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return result.stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown commit"
    changed = [line[3:] for line in git("status", "--porcelain", "--", "nblaunch").splitlines()]
    if not changed:
        return f"nblaunch at {commit}"
    digest = hashlib.sha256(git("diff", "HEAD", "--", "nblaunch").encode())
    for name in sorted(git("ls-files", "--others", "--exclude-standard", "nblaunch").split()):
        digest.update((ROOT / name).read_bytes())
    return (
        f"nblaunch at {commit} with uncommitted changes to {len(changed)} files "
        f"(digest {digest.hexdigest()[:10]})"
    )


def pick(value: str | None, choices, what: str) -> list[str]:
    if value is None:
        return list(choices)
    picked = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in picked if name not in choices]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (choose from {', '.join(choices)})")
    return picked


def check(scenarios: list[str], launchers: list[str], limit: float, show_output: bool) -> int:
    """Run each scenario without its fault; every rank must finish every step."""
    failures = 0
    print("| scenario | launcher | healthy run | wall (s) |")
    print("|---|---|---|---:|")
    for scenario in scenarios:
        steps = SCENARIOS[scenario].steps
        for launcher in launchers:
            row, output = run_row(scenario, launcher, limit, healthy=True, show_output=show_output)
            outcome = row.outcome
            if launcher == "torchrun":
                finished = re.findall(rf"{scenario}: rank (\d+) finished (\d+) steps", output)
                ok = outcome.kind == "returned" and sorted(finished) == [
                    (str(rank), str(steps)) for rank in range(WORLD_SIZE)
                ]
                verdict = f"{len(finished)} ranks finished {steps} steps" if ok else ""
            elif launcher.startswith("nblaunch"):
                ok = outcome.kind == "returned" and outcome.returned == repr([steps] * WORLD_SIZE)
                verdict = f"returned {outcome.returned}" if ok else ""
            else:  # Accelerate's notebook_launcher returns nothing; it must not raise
                ok = outcome.kind == "returned"
                verdict = "returned" if ok else ""
            ok = ok and row.fault_time is None and row.left == 0
            if not ok:
                failures += 1
                verdict = (
                    f"FAILED: {outcome.kind} {outcome.first_line} fault file "
                    f"{'written' if row.fault_time else 'absent'}, {row.left} processes left"
                )
                print("\n".join(output.splitlines()[-30:]), file=sys.stderr)
            print(f"| {scenario} | {LAUNCHERS[launcher]} | {cell(verdict)} | {row.wall_s:.1f} |")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="SCENARIO[,SCENARIO]", help=", ".join(SCENARIOS))
    parser.add_argument("--rows", metavar="LAUNCHER[,LAUNCHER]", help=", ".join(LAUNCHERS))
    parser.add_argument(
        "--limit", type=float, default=LIMIT_S, help="seconds a row may go on after its fault"
    )
    parser.add_argument("--check", action="store_true", help="run the scenarios without faults")
    parser.add_argument("--merge", action="store_true", help="merge a partial run into results")
    parser.add_argument("--show-output", action="store_true", help="print each row's output")
    parser.add_argument("--drive", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--healthy", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.drive:
        drive(*options.drive, healthy=options.healthy)
        return
    scenarios = pick(options.only, SCENARIOS, "scenario")
    launchers = pick(options.rows, LAUNCHERS, "launcher")
    if options.check:
        failures = check(
            scenarios,
            launchers if options.rows else ["torchrun"],
            options.limit,
            options.show_output,
        )
        sys.exit(1 if failures else 0)

    state = nblaunch_state()
    measured = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    started = time.monotonic()
    rows = []
    for scenario in scenarios:
        for launcher in launchers:
            row, _ = run_row(
                scenario,
                launcher,
                options.limit,
                show_output=options.show_output,
                measured=measured,
            )
            rows.append(row)
            print(
                f"[{time.monotonic() - started:6.0f} s] {scenario} / {launcher}: "
                f"{row.outcome.kind} {row.outcome.first_line[:100]}",
                file=sys.stderr,
                flush=True,
            )
    elapsed = time.monotonic() - started
    full = scenarios == list(SCENARIOS) and launchers == list(LAUNCHERS)
    header = (
        f"2 CPU ranks (gloo), {os.cpu_count()} cores, limit {options.limit:.0f} s after the "
        f"fault; {'a full run' if full else 'this run'} took {elapsed:.0f} s "
        f"({measured}); {state}."
    )
    if nblaunch_state() != state:
        header += " nblaunch/ changed during the run: rerun the nblaunch rows."
    print(header + "\n")
    print(table(rows, options.limit))
    if full:
        write_results(rows, options.limit, header)
    elif options.merge:
        stored, data = load_stored()
        if not stored:
            raise SystemExit("nothing stored to merge into: run every row once first")
        fresh = {(row.scenario, row.launcher): row for row in rows}
        merged = [fresh.pop((row.scenario, row.launcher), row) for row in stored]
        header = f"{data['header']} Rerun with `--merge` ({measured}, {elapsed:.0f} s): "
        header += f"{', '.join(launchers)} rows of {', '.join(scenarios)}; {state}."
        if nblaunch_state() != state:
            header += " nblaunch/ changed during that run too."
        write_results(merged + list(fresh.values()), data["limit"], header)
        print(f"\nmerged {len(rows)} rows into {RESULTS / 'bench_real.md'}")


if __name__ == "__main__":
    main()
