"""Stage 5 of the planner: what a plan costs. Bytes per rank and phase (summed from the
schedule), Newton-Schulz FLOPs, memory, and the FSDP2 baselines.

``model`` (the records: ByteCost, BaselineByteCost, RankStats), ``flops`` (Newton-Schulz FLOPs
and the NS schedule they count over; a leaf the rules import), ``nbytes`` (the ledger's byte
rule per collective, FSDP2 shard sizes, ByteCost summed from a schedule), ``weights`` (LPT
weights), ``memory`` (per-rank figures of a DMuon plan), ``baseline`` (FSDP2 + naive Muon),
``seconds`` (the alpha-beta rule that picks each buffer's collective)."""
