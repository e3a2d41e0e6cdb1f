"""Stage 5 of the planner: what a plan costs. Bytes per rank and phase (summed from the
schedule), Newton-Schulz FLOPs, memory, and the FSDP2 baselines."""
