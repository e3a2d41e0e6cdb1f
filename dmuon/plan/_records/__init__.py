"""The frozen records every planner stage passes on: ``owners`` (Owner, OwnerGroup,
ExpertOwners), ``params`` (ParamSpec, MatrixView, ExpertStack, Fsdp2Unit), ``fields`` (field
checks, dtype strings), ``plan`` (ShardingPlan: the record and its validation), ``plan_index``
(its lookups by FQN), ``plan_json`` (JSON, fingerprint), ``plan_figures`` (the nominal schedule,
cost, baseline, per-rank stats), ``mesh`` (mesh dim roles, ``normalize_mesh``), ``qk_clip``
(QK-clip settings), ``collectives`` (how each buffer's collective was chosen)."""
