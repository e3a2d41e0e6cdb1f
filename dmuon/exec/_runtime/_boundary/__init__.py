"""The hook boundary: the state machine that runs around one block's forward and backward
(``hook_boundary``: unshard, install, reshard, reduce), what the boundaries of one model share
(``comm_context``, FSDP2's comm-context pattern), the broadcasts it sends (``broadcast_send``),
its gradient reduce and that reduce's completion (``grad_reduce``), the step check
(``step_check``), the schedule's ops bound to this rank (``bound_ops``) and the all-gathered
buffers (``gather_buffers``). Nothing here imports :mod:`dmuon.exec._runtime.runtime`."""
