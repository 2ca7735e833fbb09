"""The files a run host keeps in its run directory, by name (besides the rank logs).

A leaf: the detached runs' client (:mod:`nblaunch.engine.detached.attached`), the host
(:mod:`nblaunch.host`), the view of a lost run (:mod:`nblaunch.engine.detached.lost_runs`) and the
runs panel all name them.
"""

LAUNCH_FILE = "launch.pkl"  # the plan and payload the host runs
RESULT_FILE = "result.pkl"  # the outcome, once the run ended
HISTORY_FILE = "history.pkl"  # what a view of the ended run shows
HOST_LOG = "host.log"
SOCKET_FILE = "stream.sock"
HOLDER_FILE = "holder.json"  # a detached pool's attached process: {"pid": ..., "since": ...}
POOL_FILE = "pool.json"  # a detached pool's ranks: {"pids": [...], "devices": [...]}
