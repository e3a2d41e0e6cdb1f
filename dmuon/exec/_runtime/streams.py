"""Accelerator streams: dmuon's broadcast and reduce streams (:func:`comm_stream`) and the helpers
that order them with the compute stream (:func:`_on_stream`, :func:`current_stream`,
:func:`has_streams`); the rules are in Note: the model runtime (docs/design.md). On CPU none
of this runs: :func:`comm_stream` answers ``None`` and :func:`_on_stream` is a null context.
``rt`` is the boundaries' :class:`~dmuon.exec._runtime._boundary.comm_context.BoundaryCommContext`
(its ``use_streams``, ``device`` and the ``_streams`` it caches); this module imports no other dmuon
module."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["comm_stream", "current_stream", "has_streams"]


def comm_stream(rt, kind: str):
    """On an accelerator (CUDA, XPU, ...): dmuon's ``"broadcast"`` or ``"reduce"`` stream (high
    priority, as FSDP2's), ordered with the compute stream by events; ``None`` on CPU or with
    ``use_streams=False``. Written against torch's accelerator-generic ``torch.Stream``."""
    if not rt.use_streams or not has_streams(rt.device):
        return None
    if rt._streams is None or rt._streams[0] != rt.device:
        rt._streams = (
            rt.device,
            {k: torch.Stream(device=rt.device, priority=-1) for k in ("broadcast", "reduce")},
        )
    return rt._streams[1][kind]


def _on_stream(stream):
    """``stream`` made current for the block (``torch.Stream`` is a context manager, on any
    accelerator), or nothing for ``None`` (CPU: a single stream)."""
    return contextlib.nullcontext() if stream is None else stream


def current_stream(device: torch.device):
    """The current (compute) stream of ``device``, whatever the accelerator (``torch.accelerator``)."""
    return torch.accelerator.current_stream(device)


def has_streams(device: torch.device) -> bool:
    """Whether ``device`` is the process's accelerator (CUDA, XPU, MPS, ...), whose work dmuon
    orders on its own streams; False on CPU, where every stream function below is skipped."""
    if device.type == "cpu" or not torch.accelerator.is_available():
        return False
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == device.type
