"""The frozen records every planner stage passes on: ``params`` (Owner, OwnerGroup,
ExpertOwners, ParamSpec, MatrixView, dtype helpers), ``plan`` (ShardingPlan: the record and
its validation), ``plan_index`` (its lookups by FQN), ``plan_json`` (JSON, fingerprint),
``plan_figures`` (the nominal schedule, cost, baseline, per-rank stats), ``mesh`` (mesh dim
roles, ``normalize_mesh``), ``qk_clip`` (QK-clip settings)."""
