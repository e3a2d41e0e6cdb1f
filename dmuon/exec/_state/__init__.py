"""State layer: ``model_state`` (model state dicts: dedicated matrices as full-shape DTensors, and
``full_state_dict``), ``optimizer_state`` (``dmuon.Muon``'s state dicts: momenta as full-shape
DTensors, and the checks before loading), ``dtensor_layout`` (the state-dict DTensor layout of a
dedicated matrix and the scatter / gather both use) and ``dcp_errors`` (clear errors when a
checkpoint's dedicated set differs)."""
