"""Stage 3 of the planner: ``buffers`` packs each hook boundary's dedicated parameters into flat
buffers (segments per owner, alignment, presence flags)."""
