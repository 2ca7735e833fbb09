"""A rank's accelerator: its one device pinned, its backend, plug-ins, XLA's runtime, and the
context a spare rank makes ahead."""
