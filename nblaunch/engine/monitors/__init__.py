"""What watches a run from the notebook's side: the monitor protocol and registry, the hang watchdog
and its proofs, the collective checks, stragglers, batch-size restarts, debugger prompts."""
