"""Runtime layer: what runs around every forward and backward. ``runtime`` (one model's
runtime: its state, delegating to ``reduces`` (reduce completion), ``replicas`` (HSDP replica
broadcasts), ``streams`` (accelerator streams) and ``expert_parallel`` (local EP stacks)),
``boundary`` (one hook boundary's state machine; ``boundary_host``: what it uses of the runtime),
``buffers`` (packed tensors: segments, slots), ``program`` (the schedule's ops bound to this
rank's buffers and groups)."""
