"""Other machines: the head of a multi-node run, ``nblaunch join``, starting nodes, trust."""
