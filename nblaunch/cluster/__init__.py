"""Other machines: a multi-node run, ``nblaunch join``, starting nodes, trust.

The notebook node: :mod:`.run` (the launch and the run), :mod:`.head` (hosting the store,
gathering the nodes, talking to them), :mod:`.plan` (each node's ranks). A joined node:
:mod:`.join` (the command) and :mod:`.node_run` (its ranks). Both: :mod:`.store` (the rendezvous
store), :mod:`.channel` (the records on it), :mod:`.trust` (the run's secret). Starting the
other nodes' ``join`` from the notebook: :mod:`.node_start`.
"""
