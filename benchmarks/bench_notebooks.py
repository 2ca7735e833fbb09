"""Five public training sources, healthy and with injected faults: nblaunch in a real notebook
kernel against Accelerate's ``notebook_launcher`` (issue 56).

Run: ``.venv/bin/python benchmarks/bench_notebooks.py`` (about 10 minutes on 2 cores). Writes
``benchmarks/results/bench_notebooks.md`` (and the raw rows in ``bench_notebooks.json``).
``--limit S``: how long an Accelerate row may go on after its fault (60 s).

The sources and faults are in ``notebook_sources.py`` (what was adapted, and why, is there).

- nblaunch: one notebook, executed by nbclient in a fresh kernel as a person would run it top to
  bottom: ``%load_ext nblaunch``, then a cell per source and fault calling
  ``notebook_launcher(source, (fault,), num_processes=2)``; each cell notes the time its
  ``except`` caught the error, then re-raises it, so the saved notebook keeps the error as a
  person would see it. "What the saved notebook keeps" is read from the saved file: the
  summary's rank lines and story, and the last frame of the error's traceback.
- Accelerate: ``accelerate.notebook_launcher(source, (fault,), num_processes=2)`` with
  ``ACCELERATE_USE_CPU=1`` from a driver process of its own (``--drive``), stopped ``--limit``
  seconds after the fault when no error came. Accelerate's launcher returns nothing, so each
  rank writes its result to a file for the healthy comparison.

Time to an error: from the fault (the rank writes the time to a file) to the caller's
``except``. Rank named: nblaunch's ``exc.rank``, its ``raised on rank N`` note, or the ranks its
report names first (``bench_real.nblaunch_blamed``); Accelerate's ``ChildFailedError`` root
cause. The right rank is rank 1 for every fault (it is the one that raises, has a batch fewer,
gathers fewer or runs out of memory).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_real import (  # noqa: E402
    RESULTS,
    describe,
    first_line,
    free_port,
    marked_processes,
    row_environment,
    wait_bounded,
)
from notebook_sources import SOURCE_FAULTS, SOURCES  # noqa: E402

LIMIT_S = 60.0
CULPRIT = 1
SETUP = """\
%load_ext nblaunch
import json, os, sys, time, traceback
sys.path.insert(0, {here!r})
os.environ["ACCELERATE_USE_CPU"] = "1"
import notebook_sources
from nblaunch import notebook_launcher
from bench_real import nblaunch_blamed, subject_ranks


def noted(key, error=None, result=None):
    '''Write what the cell got: the time of the error, its first line, the rank and line named.'''
    record = {{"key": key, "caught": time.time()}}
    if error is None:
        record["result"] = result
    else:
        frames = traceback.extract_tb(error.__traceback__)
        frames = [f for f in frames if "nblaunch" not in f.filename]
        last = frames[-1] if frames else None
        first = (str(error).strip().splitlines() or [""])[0][:240]
        record.update(
            type=type(error).__name__,
            first_line=first,
            # the rank a report's first line is about (an out-of-memory named as the cause)
            blamed=subject_ranks(first) if first.startswith("rank") else nblaunch_blamed(error),
            line=(
                f"{{os.path.basename(last.filename)}}:{{last.lineno}} "
                f"`{{(last.line or '').strip()}}`"
            ) if last else "",
        )
    with open(os.path.join({out!r}, key + ".json"), "w") as file:
        json.dump(record, file)
"""
CELL = """\
os.environ["BENCH_REAL_FAULT_FILE"] = {fault_file!r}
try:
    result = notebook_launcher(notebook_sources.{source}, ({fault!r},), num_processes=2)
except Exception as error:
    noted({key!r}, error)
    raise
noted({key!r}, result=result)
"""


def rows() -> list[tuple[str, str | None]]:
    return [(source, fault) for source in SOURCES for fault in (None, *SOURCE_FAULTS[source])]


def key_of(source: str, fault: str | None) -> str:
    return f"{source}-{fault or 'healthy'}"


# --- nblaunch, in a notebook ---------------------------------------------------------------------


def run_notebook(workdir: Path) -> dict[str, dict]:
    """Every row as a cell of one notebook in a fresh kernel; what each cell noted and kept."""
    import nbformat
    from nbclient import NotebookClient

    out = workdir / "noted"
    out.mkdir()
    cells = [SETUP.format(here=str(HERE), out=str(out))]
    for source, fault in rows():
        key = key_of(source, fault)
        fault_file = str(workdir / f"{key}.fault")
        cells.append(CELL.format(fault_file=fault_file, source=source, fault=fault, key=key))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    env_marker = uuid.uuid4().hex
    os.environ["NBLAUNCH_BENCH_ROW"] = env_marker
    os.environ["NBLAUNCH_RUN_DIR"] = str(workdir / "runs")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    began = time.time()
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(workdir)}},
    ).execute()
    path = workdir / "bench.ipynb"
    nbformat.write(notebook, path)
    saved = nbformat.read(path, as_version=4)
    found: dict[str, dict] = {}
    for (source, fault), cell in zip(rows(), saved.cells[1:], strict=True):
        key = key_of(source, fault)
        noted_file = out / f"{key}.json"
        record = json.loads(noted_file.read_text()) if noted_file.exists() else {}
        fault_file = workdir / f"{key}.fault"
        if fault_file.exists() and "caught" in record:
            record["seconds"] = record["caught"] - float(fault_file.read_text().split()[0])
        record["kept"] = kept(cell)
        found[key] = record
    print(f"notebook: {time.time() - began:.0f} s, saved to {path}", flush=True)
    return found


def kept(cell) -> str:
    """What the saved notebook keeps of a cell: its summary's lines but the logs' and each
    rank's output, then the last frame of the error's traceback."""
    parts = []
    for output in cell.outputs:
        text = output.get("data", {}).get("text/plain", "")
        if output.output_type == "display_data" and text.startswith("nblaunch:"):
            for line in text.splitlines():
                if line.startswith("---"):
                    break  # each rank's last lines follow
                if not line.strip().startswith("logs:"):
                    parts.append(line.strip())
        if output.output_type == "error":
            plain = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(output.traceback))
            frame = r"^(?:File \S+?([^/\s]+):(\d+), in (\S+)|Cell In\[\d+\], line (\d+))"
            frames = re.findall(frame, plain, re.M)
            if frames:
                name, line, function, cell_line = frames[-1]
                where = f"{name}:{line} in {function}" if name else f"cell line {cell_line}"
                parts.append(f"traceback ends at {where}")
    return "; ".join(parts)


# --- Accelerate, in a driver of its own ----------------------------------------------------------


def run_accelerate(source: str, fault: str | None, limit: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-notebooks-") as tmp:
        workdir = Path(tmp)
        marker = uuid.uuid4().hex
        fault_file, result_file, log_file = (workdir / n for n in ("fault", "result", "log"))
        command = [sys.executable, __file__, "--drive", source, str(fault), str(result_file),
                   str(free_port())]  # fmt: skip
        started = time.time()
        with open(log_file, "wb") as log:
            process = subprocess.Popen(
                command,
                cwd=workdir,
                env=row_environment(marker, fault_file, workdir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            timed_out = wait_bounded(process, fault_file, started, limit)
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        time.sleep(1.0)
        for pid in marked_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        fault_time = float(fault_file.read_text().split()[0]) if fault_file.exists() else None
        if timed_out:
            return {"timeout": limit, "fault": fault_time is not None}
        if not result_file.exists():
            tail = log_file.read_text(errors="replace").splitlines()[-20:]
            return {"first_line": f"driver exited {process.returncode}", "log": tail}
        record = json.loads(result_file.read_text())
        if fault_time is not None and "caught" in record:
            record["seconds"] = record["caught"] - fault_time
        return record


def _accelerate_rank(source: str, fault: str | None, result_file: str) -> None:
    result = SOURCES[source][0](fault)
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{result_file}.rank{rank}").write_text(json.dumps(result))


def drive(source: str, fault: str | None, result_file: str, port: str) -> None:
    os.environ["ACCELERATE_USE_CPU"] = "1"
    from accelerate import notebook_launcher

    record: dict = {}
    try:
        notebook_launcher(
            _accelerate_rank, args=(source, fault, result_file), num_processes=2, use_port=port
        )
        ranks = sorted(Path(result_file).parent.glob(Path(result_file).name + ".rank*"))
        record["result"] = [json.loads(path.read_text()) for path in ranks]
    except Exception as exc:
        record["caught"] = time.time()
        line, blamed = describe(exc)
        record.update(type=type(exc).__name__, first_line=line, blamed=blamed)
        traceback.print_exc()
    Path(result_file).write_text(json.dumps(record))


# --- the table -----------------------------------------------------------------------------------


def outcome(record: dict, healthy: bool) -> str:
    if "timeout" in record:
        return f"no error in {record['timeout']:.0f} s" + ("" if record["fault"] else " (no fault)")
    if "result" in record:
        sizes = {r.get("batch_size") for r in record["result"] or [] if isinstance(r, dict)}
        if not healthy and len(sizes) == 1 and None not in sizes:
            return f"returned, every rank at batch_size={sizes.pop()}"
        return "returned" if healthy else "returned (fault unnoticed)"
    seconds = record.get("seconds")
    took = f"{seconds:.1f} s" if seconds is not None else "?"
    blamed = record.get("blamed") or []
    rank = (
        f"rank{'s' if len(blamed) > 1 else ''} {', '.join(map(str, blamed))}"
        if blamed
        else ("no rank")
    )
    return f"{took}, names {rank}: {cell(first_line(record.get('first_line', '')))[:160]}"


def same_result(ours: dict, theirs: dict) -> str:
    mine = ours.get("result")
    other = theirs.get("result")
    if not isinstance(mine, list) or not isinstance(other, list) or not other:
        return "?"
    keys = ("losses", "digest", "accuracy")
    equal = all(
        {k: m.get(k) for k in keys} == {k: o.get(k) for k in keys}
        for m, o in zip(mine, other, strict=False)
    )
    return "bit-identical" if equal and len(mine) == len(other) else "differ"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def shorter(kept_text: str) -> str:
    """What a saved notebook keeps, without the returned values' long reprs."""
    if not kept_text:
        return "the value only (a quick run that printed nothing shows no summary)"
    return re.sub(r"returned \{[^;]*", "returned {…}", kept_text)


def table(ours: dict[str, dict], theirs: dict[str, dict]) -> str:
    lines = [
        "| source | fault | nblaunch (in a notebook) | line named | the saved notebook keeps "
        "| Accelerate `notebook_launcher` |",
        "|---|---|---|---|---|---|",
    ]
    for source, fault in rows():
        key = key_of(source, fault)
        mine, other = ours.get(key, {}), theirs.get(key, {})
        if fault is None:
            nbl = "returned" if "result" in mine else outcome(mine, True)
            acc = outcome(other, True)
            if "result" in mine and "result" in other:
                acc += f" ({same_result(mine, other)} to nblaunch's)"
        else:
            nbl, acc = outcome(mine, False), outcome(other, False)
        lines.append(
            f"| {SOURCES[source][1] if fault is None else ''} | {fault or 'none (healthy)'} | "
            f"{nbl} | {cell(mine.get('line', ''))} | {cell(shorter(mine.get('kept', '')))[:400]} "
            f"| {acc} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=LIMIT_S)
    parser.add_argument("--drive", nargs=4, metavar=("SOURCE", "FAULT", "RESULT", "PORT"))
    parser.add_argument("--only-nblaunch", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the stored rows' table again")
    options = parser.parse_args()
    if options.table:
        stored = json.loads((RESULTS / "bench_notebooks.json").read_text())
        write(table(stored["nblaunch"], stored["accelerate"]), stored["measured"], options.limit)
        return
    if options.drive:
        source, fault, result_file, port = options.drive
        drive(source, None if fault == "None" else fault, result_file, port)
        return
    measured = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory(prefix="bench-notebooks-") as tmp:
        ours = run_notebook(Path(tmp))
    theirs: dict[str, dict] = {}
    if not options.only_nblaunch:
        for source, fault in rows():
            began = time.time()
            theirs[key_of(source, fault)] = run_accelerate(source, fault, options.limit)
            print(f"accelerate {key_of(source, fault)}: {time.time() - began:.0f} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_notebooks.json").write_text(
        json.dumps({"measured": measured, "nblaunch": ours, "accelerate": theirs}, indent=1)
    )
    write(table(ours, theirs), measured, options.limit)


def write(text: str, measured: str, limit: float) -> None:
    print(text)
    (RESULTS / "bench_notebooks.md").write_text(
        f"Measured {measured} on this project's 2-core CPU machine, 2 ranks, gloo "
        f"(`python benchmarks/bench_notebooks.py --limit {limit:g}`). Fault on rank "
        f"{CULPRIT} in every row.\n\n{text}\n"
    )


if __name__ == "__main__":
    main()
