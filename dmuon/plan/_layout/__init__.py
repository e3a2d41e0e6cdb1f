"""Stage 3 of the planner: ``buffers`` packs each hook boundary's dedicated parameters into flat
buffers (segments per owner, alignment, presence flags, all-gather slots); ``slots`` re-places
expert ranges for equal slots; ``collectives`` chooses each buffer's collective."""
