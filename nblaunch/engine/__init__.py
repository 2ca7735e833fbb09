"""The engine, in the notebook's process: plan, start, relay, watch, decide, stop.

It never imports the front ends (:mod:`nblaunch.notebook`, :mod:`nblaunch.cluster`), IPython
or ipywidgets.
"""
