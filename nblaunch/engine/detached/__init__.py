"""Detached runs and pools: the registry, starting a run host, a notebook's client of it, the
socket's framing, the host's files, a lost run's view."""
