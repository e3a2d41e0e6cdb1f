"""Expert stacks as Muon matrices: the storage layout of a 3-D expert parameter to and from
its experts' matrices in ``nn.Linear`` ``(out, in)`` orientation.

The plan's :class:`~dmuon.plan._records.params.ExpertStack` says how a stack ``(E, a, b)`` holds its
matrices (stored ``(in, out)`` or ``(out, in)``; a fused gate/up projection concatenated or
interleaved along the output dim, split into gate and up or kept whole). The optimizer maps an
owner's momentum update of its experts to a ``(k, out, in)`` batch with
:func:`stack_to_matrices`, orthogonalises every matrix, and maps the result back with
:func:`matrices_to_stack` before the update. Matrix order in the batch is expert-major
(gate0, up0, gate1, up1, ...). Both are pure tensor functions (no state, no collective); for a
stack already in ``(out, in)`` orientation without a split they are reshapes.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["stack_to_matrices", "matrices_to_stack"]


def stack_to_matrices(t: Tensor, stack) -> Tensor:
    """``t`` of storage shape ``(E', a, b)`` (``E'`` experts of a stack laid out as ``stack``)
    as its ``(E' * stack.matrices_per_expert, out, in)`` Muon matrices.

    A view where the layout allows (no transpose, no interleave), else a contiguous copy."""
    e = t.shape[0]
    x = t.transpose(-2, -1) if stack.transposed else t  # (E', out_total, in)
    if stack.matrices_per_expert == 1:
        return x
    out_total, inp = x.shape[1], x.shape[2]
    f = out_total // 2
    if stack.gate_up == "concat":  # rows [gate; up]
        return x.reshape(e * 2, f, inp) if x.is_contiguous() else x.contiguous().reshape(e * 2, f, inp)
    # interleave: output rows gate0, up0, gate1, up1, ... -> (E', 2, F, in)
    return x.reshape(e, f, 2, inp).transpose(1, 2).reshape(e * 2, f, inp)


def matrices_to_stack(mats: Tensor, stack, shape: tuple[int, ...]) -> Tensor:
    """Inverse of :func:`stack_to_matrices`: ``(E' * mpe, out, in)`` matrices back to the
    storage ``shape`` ``(E', a, b)`` (a view or a copy)."""
    e = shape[0]
    if stack.matrices_per_expert == 2:
        f, inp = mats.shape[1], mats.shape[2]
        if stack.gate_up == "concat":
            x = mats.reshape(e, 2 * f, inp)
        else:
            x = mats.reshape(e, 2, f, inp).transpose(1, 2).reshape(e, 2 * f, inp)
    else:
        x = mats
    out = x.transpose(-2, -1) if stack.transposed else x
    return out.reshape(shape)
