"""How long a new kernel takes to show a detached run's view, by the size of the run's history.

A detached run of 2 CPU ranks prints N lines in all, then keeps going; a kernel that never saw it
calls ``nblaunch.attach()`` and ``.view()`` (the live widget, as in JupyterLab). Measured in
that kernel: the seconds from the call until the view was built with the history it keeps
(``attach + view``: until the view holds the history, which comes on the view's own
connection), and the cell's wall time as the notebook sees it (from execute to idle).

    python benchmarks/bench_attach.py [--lines 1000 100000 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import Kernel  # noqa: E402  (the tests' real-kernel driver)

START = """
import nblaunch, time
def chatty(lines):
    import os, time
    rank = int(os.environ["RANK"])
    for i in range(lines // 2):
        print(f"rank {{rank}} line {{i}}")
    print("history written", flush=True)
    time.sleep(600)
h = nblaunch.notebook_launcher(chatty, ({lines},), 2, detach=True, display="none")
print(h.id)
"""

ATTACH = """
import time, json
import nblaunch.notebook.views.choose as choose
made = []
make_view = choose.make_view
choose.make_view = lambda display: made.append(make_view(display)) or made[-1]
t0 = time.perf_counter()
h = nblaunch.attach({run_id!r})
h.view()
# The history arrives on the view's own connection: wait until the view holds it.
while not (made and made[0].model.lines_received >= {expect}):
    time.sleep(0.001)
seconds = time.perf_counter() - t0
print("BENCH " + json.dumps({{"seconds": seconds, "lines": made[0].model.lines_received}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-attach-"))
    os.environ["NBLAUNCH_DETACHED_DIR"] = str(work / "detached")
    rows = []
    for lines in options.lines:
        starter = Kernel(work)
        try:
            run_id = starter.run(START.format(lines=lines), 120)["out"].strip().splitlines()[-1]
        finally:
            starter.close()
        log = next((work / ".nblaunch" / "runs").glob(f"{run_id}*")) / "rank1.log"
        deadline = time.monotonic() + 600
        while "history written" not in (log.read_text() if log.exists() else ""):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not print {lines} lines in 600 s")
            time.sleep(0.5)
        time.sleep(1.0)  # let the host relay the last lines
        viewer = Kernel(work)
        try:
            viewer.run("import nblaunch", 120)  # the import is the notebook's first cell
            # The lines the view keeps: the last NBLAUNCH_VIEW_LINES (200) of each of 2 ranks.
            out = viewer.run(ATTACH.format(run_id=run_id, expect=2 * min(lines // 2 + 1, 200)), 120)
            measured = json.loads(out["out"].split("BENCH ", 1)[1])
            rows.append((lines, measured, out["seconds"]))
        finally:
            viewer.close()
            subprocess.run(
                [sys.executable, "-m", "nblaunch", "runs", "stop", run_id],
                capture_output=True,
                timeout=60,
            )
    print(
        "| lines in the run's history | attach + view holds the history (s) | cell wall s | "
        "lines the view got |"
    )
    print("|---|---|---|---|")
    for lines, measured, wall in rows:
        print(f"| {lines:,} | {measured['seconds']:.3f} | {wall:.3f} | {measured['lines']:,} |")
    print(f"\n{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.1f} at the end.")


if __name__ == "__main__":
    main()
