"""Optimizer layer: ``muon`` (``dmuon.Muon``), ``muon_step`` (gathers each layout's matrices and
runs the update of :mod:`dmuon._update`, the plain functions: momentum, Newton-Schulz, coefficient
presets, decay), ``ns_backends`` (Newton-Schulz backends by name, resolved there at call time; Gram
NS and its sharded form are plain functions too, :mod:`dmuon._ns_gram`), ``tp_orthogonalize`` (NS
of matrices several ranks hold), ``expert_update`` (expert stacks to and from matrices),
``normuon_update`` (NorMuon's second-moment layout), ``qk_clip`` (QK-clip at run time),
``grad_clip`` (``clip_grad_norm_``), ``amp`` (loss scaling), ``offload_stage`` (the offloaded
step's double-buffered host-device copies)."""
