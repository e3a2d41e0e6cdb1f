"""The runtime as a hook boundary sees it: :class:`BoundaryHost`.

A :class:`~dmuon.exec._runtime.boundary._BoundaryRuntime` reaches its model-wide runtime only through
``self.runtime_ref()`` (a weak reference), and only for the members listed here: settings fixed at
``apply``, four pieces of state the runtime owns, and the calls that span boundaries (prefetch
order, streams, HSDP replicas, the step check, the end of the backward).
:class:`~dmuon.exec._runtime.runtime.DmuonRuntime` provides them (structurally: it does not subclass
the Protocol). boundary.py imports this module, never the runtime's, so the two do not import each
other, not even for types. ``tests/exec/test_runtime_interface.py`` checks that boundary.py uses exactly
these members and that the runtime has each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from dmuon.exec._comm.groups import MeshGroups

__all__ = ["BoundaryHost"]


class BoundaryHost(Protocol):
    """What :mod:`dmuon.exec._runtime.boundary` uses of :class:`~dmuon.exec._runtime.runtime.DmuonRuntime`."""

    # -- settings, fixed at apply --------------------------------------------------------------
    plan: Any  # the ShardingPlan: the fully_shard mixed-precision policy is checked against it
    groups: MeshGroups  # dmuon's process groups: the ranks named by the step check's error
    num_shards: int  # N: a boundary resharded at its backward under Z2 is an error only when N > 1
    reshard_after_forward: bool  # Z3 (True) frees after every forward; Z2 keeps until the backward
    model_ref: Callable[[], nn.Module | None]  # the model (weak): FSDP2's gradient-sync flag of the root

    # -- state the runtime owns ----------------------------------------------------------------
    steps_done: int  # optimizer steps seen: part of the step check's code
    requires_gradient_sync: bool  # False inside dmuon.no_sync: the post-backward defers the reduce
    pipelined: bool  # under a pipeline schedule: several micro-batches in flight, one reduce per step
    pending_reduces: list  # _PendingReduce records: the post-backward appends, finish_reduces drains
    check_nonfinite: bool  # dmuon.Muon(skip_nonfinite=True): check every reduce buffer packed here

    # -- calls ---------------------------------------------------------------------------------
    def boundary_after(self, b: Any) -> Any:
        """The next boundary in plan order (the forward prefetch target), or None."""

    def boundary_before(self, b: Any) -> Any:
        """The previous boundary in plan order (the backward prefetch target), or None."""

    def comm_stream(self, kind: str) -> Any:
        """dmuon's ``"broadcast"`` / ``"reduce"`` stream on an accelerator; None on CPU."""

    def wait(self, works: list, what: str, *, boundary: Any = None, group: Any = None) -> None:
        """Wait for ``works`` (dmuon's timeout, the step and forward count quoted by a failure)."""

    def coalesces(self, group: Any) -> bool:
        """Whether the broadcasts / reduces of one list on ``group`` go as one coalesced group."""

    def issue_replicate_reduces(self, boundary: Any) -> None:
        """HSDP: issue the replicate reduces of the boundaries reduced before ``boundary``."""

    def wait_replicate_broadcasts(self, boundary: Any = None) -> None:
        """HSDP: wait for ``boundary``'s post-step replicate broadcasts before its next unshard."""

    def defer_round_check(self, boundary: Any, phase: str, got: torch.Tensor, expected: float) -> None:
        """Accelerators: keep received step codes on the device, compared once per optimizer step."""

    def queue_final_callback(self) -> None:
        """Queue the end-of-backward callback (once per backward)."""

    def finish_reduces(self) -> None:
        """Wait for the pending reduces and write the owners' gradients."""

    def note_reduce_input(self, bufs: list) -> None:
        """``skip_nonfinite``: note whether a reduce buffer this rank packed (its local gradients,
        before the reduce) holds a non-finite value."""
