"""Set-up layer: bind a plan to a model. ``api`` (``apply``, ``dedicate_params``),
``materialize`` (meta-device models, ``to_empty``, ``init_params``), ``guards`` (checks that
stop a wrong set-up), ``fsdp2`` (``fully_shard`` leaves dedicated parameters alone; FSDP2's
per-module state), ``host_offload`` (``offload_policy=``: where offloaded state lives)."""
