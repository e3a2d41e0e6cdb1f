"""Optimizer layer: ``muon`` (``dmuon.Muon``), ``muon_step`` (one Muon step as stateless
functions), ``ns_backends`` (Newton-Schulz backends by name, resolved there at call time),
``ns_kernel`` (the standard NS iteration, one matrix or a batch), ``ns_gram`` (Gram NS, its
fallback check and the sharded Gram NS of TP and owner groups), ``ns_coefficients`` (coefficient
presets and schedules), ``tp_orthogonalize`` (NS of matrices several ranks hold), ``experts``
(expert stacks to and from matrices), ``qk_clip`` (QK-clip at run time), ``clip``
(``clip_grad_norm_``), ``amp`` (loss scaling)."""
