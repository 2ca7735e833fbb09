"""A run's life: start, watch, stop, restart; and how its ranks are stopped."""
