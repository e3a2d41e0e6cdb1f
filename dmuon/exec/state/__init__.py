"""State layer: ``checkpoint`` (state dicts: owner-held matrices and momenta as full-shape
DTensors) and ``dcp_errors`` (clear errors when a checkpoint's dedicated set differs)."""
