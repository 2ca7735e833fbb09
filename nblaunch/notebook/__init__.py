"""The notebook's front ends: ``notebook_launcher``, the magics, the pool and the views.

The only package that imports IPython or ipywidgets.
"""
