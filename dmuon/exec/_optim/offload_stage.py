"""The Muon step of offloaded matrices: each run of :func:`dmuon._update.muon_update` copied from the
host to the compute device, updated there and copied back, double-buffered on a copy stream
(:func:`staged_runs`). Note: CPU offload (docs/design.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from dmuon import _update as _u
from dmuon.exec._runtime.streams import current_stream, has_streams

__all__ = ["staged_runs", "copy_stream"]

#: one copy stream per device, made on first use (a step's copies never overlap another step's)
_COPY_STREAMS: dict = {}


def copy_stream(device: torch.device):
    """The host-device copy stream of ``device`` (``None`` on the CPU)."""
    if not has_streams(device):
        return None
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.Stream(device=device)
    return stream


def _upload(group: Sequence[_u.Matrices], device: torch.device, stream) -> tuple[list[_u.Matrices], object]:
    """Device copies of ``group``'s tensors (allocated on the compute stream, written on ``stream``),
    and the event that marks them written (``None`` on the CPU)."""
    fields = ("param", "grad", "buf", "update")
    fresh = [
        {f: None if getattr(it, f) is None else torch.empty_like(getattr(it, f), device=device) for f in fields}
        for it in group
    ]
    if stream is None:
        for it, dev in zip(group, fresh):
            for f, t in dev.items():
                if t is not None:
                    t.copy_(getattr(it, f))
        return [dataclasses.replace(it, **dev) for it, dev in zip(group, fresh)], None
    stream.wait_stream(current_stream(device))  # the memory is free for the copy stream too
    with stream:
        for it, dev in zip(group, fresh):
            for f, t in dev.items():
                if t is not None:
                    t.copy_(getattr(it, f), non_blocking=True)
                    t.record_stream(stream)
        event = stream.record_event()
    return [dataclasses.replace(it, **dev) for it, dev in zip(group, fresh)], event


def _write_back(host: Sequence[_u.Matrices], dev: Sequence[_u.Matrices], device: torch.device, stream) -> None:
    """Copy each updated parameter and momentum buffer of ``dev`` into ``host``'s (after the compute
    stream's work on them, on ``stream``)."""
    if stream is None:
        for h, d in zip(host, dev):
            h.param.copy_(d.param)
            if h.buf is not None:
                h.buf.copy_(d.buf)
        return
    stream.wait_stream(current_stream(device))
    with stream:
        for h, d in zip(host, dev):
            h.param.copy_(d.param, non_blocking=True)
            if h.buf is not None:
                h.buf.copy_(d.buf, non_blocking=True)


def staged_runs(device: torch.device):
    """The ``stage`` argument of :func:`dmuon._update.muon_update` for matrices whose tensors live on
    the host: ``stage(groups)`` yields, for each run (list of :class:`~dmuon._update.Matrices`),
    device copies to compute on, double-buffered (module docstring); the host tensors get the
    results back before the generator finishes."""

    def stage(groups: Sequence[Sequence[_u.Matrices]]) -> Iterator[list[_u.Matrices]]:
        stream = copy_stream(device)
        if not groups:
            return
        nxt = _upload(groups[0], device, stream)
        for i, group in enumerate(groups):
            dev, event = nxt
            if event is not None:
                current_stream(device).wait_event(event)
            if i + 1 < len(groups):  # the next run's copies overlap this run's compute
                nxt = _upload(groups[i + 1], device, stream)
            yield dev
            _write_back(group, dev, device, stream)
        if stream is not None:  # host masters current before anything reads them
            stream.synchronize()

    return stage
