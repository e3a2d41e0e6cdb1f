"""The frozen records every planner stage passes on: ``params`` (Owner, OwnerGroup,
ExpertOwners, ParamSpec, MatrixView, dtype helpers), ``plan`` (ShardingPlan: validation,
lookups, JSON, fingerprint), ``mesh`` (mesh dim roles, ``normalize_mesh``), ``qk_clip``
(QK-clip settings)."""
