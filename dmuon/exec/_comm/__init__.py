"""Collectives layer: ``collectives`` (every collective dmuon issues, the byte ledger, waits
with timeouts) and ``groups`` (the process groups of the data-parallel and TP mesh)."""
