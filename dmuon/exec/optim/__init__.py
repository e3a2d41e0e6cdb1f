"""Optimizer layer: ``muon`` (``dmuon.Muon``), ``muon_step`` (one Muon step as stateless
functions), ``newton_schulz`` (NS backends and coefficient presets), ``tp_orthogonalize``
(NS of matrices several ranks hold), ``experts`` (expert stacks to and from matrices),
``qk_clip`` (QK-clip at run time), ``clip`` (``clip_grad_norm_``), ``amp`` (loss scaling)."""
