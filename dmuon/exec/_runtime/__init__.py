"""Runtime layer: what runs around every forward and backward. ``runtime`` (one model's
runtime: its state, delegating to ``replicas`` (HSDP replica broadcasts), ``streams``
(accelerator streams) and ``ep_stacks`` (local EP stacks)), ``_boundary`` (one hook boundary's
state machine and what the boundaries share), ``packed_buffers`` (packed tensors: segments,
slots), ``pipeline_hooks`` (under ``torch.distributed.pipelining``)."""
