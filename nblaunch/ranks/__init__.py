"""Code that runs inside a rank process.

It imports only the shared vocabulary (:mod:`nblaunch.errors`, :mod:`nblaunch.events`,
:mod:`nblaunch.options`, :mod:`nblaunch.tracebacks`, :mod:`nblaunch.pickling`) and itself; the
forkserver preloads this package and nothing of the notebook's side.
"""
