"""The run host: the process a detached run's engine lives in, apart from any kernel.

``python -m nblaunch.host RUN_DIR LEASE_FD`` (started by :mod:`nblaunch.engine.detached.registry`)
runs the plan and payload the notebook left in ``RUN_DIR`` (:mod:`nblaunch.host.main`) and serves
the run's events to every notebook that attaches (:mod:`nblaunch.host.serve`).
"""
