"""Memory on a rank: its counts and helpers, and the batch-size search that retries after running
out of it."""
