"""Runtime layer: what runs around every forward and backward. ``runtime`` (one model's
runtime: reduce completion, HSDP replica broadcasts, streams), ``boundary`` (one hook
boundary's state machine), ``buffers`` (packed tensors: segments, slots), ``program`` (the
schedule's ops bound to this rank's buffers and groups)."""
