"""The messages on a detached pool's socket, by kind: its host (:mod:`nblaunch.host.pool`) and
the notebook's client of it (:mod:`nblaunch.notebook.pool_detached`) both name them from here.

Every message is ``(kind, body)`` framed by :mod:`nblaunch.engine.detached.wire`; a task's events
and its outcome travel as ``wire.EVENTS`` and ``wire.OUTCOME``, as a detached run's do.
"""

# The notebook asks.
HELLO = "hello"  # {"who": ..., "take_over": bool}: the first message of a connection
TASK = "task"  # {"payload", "ranks", "description", "timeout", "hang_timeout"}
INTERRUPT = "interrupt"  # the interrupt button, during a task
STATUS = "status"  # -> STATUS {"rows", "text"}
RESTART = "restart"  # -> INFO, with "error" when the fresh ranks did not start
CLOSE = "close"  # the pool ends, and its host

# The host answers or tells.
INFO = "info"  # what the notebook shows without asking again (host.pool.pool_info)
WAIT = "wait"  # {"holder"}: another kernel runs a cell; taken over when it ends
REFUSED = "refused"  # {"holder"}: another kernel drives the pool
TAKEN = "taken"  # {"by", "at"}: another kernel took the pool over
ENDED = "ended"  # {"why"}: the pool ended (stopped from outside, idle limit)
