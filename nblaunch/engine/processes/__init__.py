"""This machine's rank processes: started, signalled, reaped and closed (the supervisor), forked
ahead (spares), behind the engine's one seam (the backend)."""
