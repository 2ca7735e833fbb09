"""A pool's engine: its ranks through their life, what follows a task's end, releases, status."""
