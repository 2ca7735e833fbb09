"""A run that goes on while the notebook does other things, and the hub that hands its events to
every view."""
