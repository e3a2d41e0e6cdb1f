"""The simulator's engine: workloads, hardware records, lowering and replay."""
