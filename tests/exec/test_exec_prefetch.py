"""Prefetch and overlap order, read from the sequence of posted collectives, with the
buffers all-gathered (collectives="auto" on this model) and broadcast.

Forward: the next boundary's broadcast is posted before the current boundary computes.
Backward (Z3): the previous boundary's broadcast is posted before the current boundary's
gradient reduce, and every reduce is posted (async) as soon as its boundary's backward is done,
so reduces overlap the backward of earlier boundaries.
"""

from __future__ import annotations

import torch

import pytest

from dmuon.exec import get_model_runtime
from shared_launch import shared_run
from oracle import global_batches, lm_loss, make_model


def _run(collectives):
    import torch.distributed as dist

    import dmuon
    from dmuon.exec._comm import collective_calls as C

    rank = dist.get_rank()
    model = make_model("tiny")  # 3 boundaries: layers.0 .. layers.2
    dmuon.dedicate_params(model, reshard_after_forward=True, collectives=collectives)
    rt = get_model_runtime(model)
    owner_of = {}
    for b in rt.boundaries:
        for seg in b.segments:
            owner_of[seg.wire.untyped_storage()._cdata] = b.fqn
        for gb in b.gathers:
            owner_of[gb.gathered.untyped_storage()._cdata] = b.fqn
    events = []
    orig = {
        name: getattr(C, name) for name in ("broadcast_many", "all_gather_into", "reduce_many", "reduce_scatter_into")
    }

    def bcast(items, **kw):  # a run of broadcasts (one per segment) on one group
        events.extend((kw["phase"], owner_of.get(t.untyped_storage()._cdata, "?")) for t, _ in items)
        return orig["broadcast_many"](items, **kw)

    def gather(output, tensor, **kw):  # one all-gather per all-gathered buffer
        events.append((kw["phase"], owner_of.get(output.untyped_storage()._cdata, "?")))
        return orig["all_gather_into"](output, tensor, **kw)

    def reduce(items, **kw):
        events.extend((kw["phase"], launching[-1] if launching else "?") for _ in items)
        return orig["reduce_many"](items, **kw)

    def reduce_scatter(output, tensor, **kw):
        events.append((kw["phase"], launching[-1] if launching else "?"))
        return orig["reduce_scatter_into"](output, tensor, **kw)

    launching = []
    for b in rt.boundaries:

        def launch(orig=b._launch_reduce, fqn=b.fqn):
            launching.append(fqn)
            orig()
            launching.pop()

        b._launch_reduce = launch

    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: events.append(("computed", f"layers.{i}")))
    C.broadcast_many, C.all_gather_into, C.reduce_many, C.reduce_scatter_into = bcast, gather, reduce, reduce_scatter
    try:
        loss = lm_loss(model, global_batches(1)[0].chunk(2)[rank])
        loss.backward()
    finally:
        for name, fn in orig.items():
            setattr(C, name, fn)
    dist.barrier()
    kinds = sorted({buf.collective for b in rt.plan.boundaries for buf in b.buffers})
    return kinds, events


def _worker():
    torch.set_num_threads(1)
    return [_run(collectives) for collectives in ("auto", "broadcast")]


def _collapse(events):
    """Consecutive duplicates (one collective per segment) collapse to one event."""
    out = []
    for e in events:
        if not out or out[-1] != e:
            out.append(e)
    return out


@pytest.mark.parametrize("case", [0, 1], ids=["all_gather", "broadcast"])
def test_prefetch_and_overlap_order(case):
    results = [r[case] for r in shared_run("test_exec_prefetch", _worker, 2, timeout_s=240)]
    assert results[0] == results[1]  # the same collective sequence on every rank
    kinds, events = results[0]
    assert kinds == [("all_gather", "broadcast")[case]]  # collectives="auto" all-gathers this model's buffers
    ev = _collapse(events)
    fwd = [e for e in ev if e[0] in ("forward_broadcast", "computed")]
    assert fwd == [
        ("forward_broadcast", "layers.0"),
        ("forward_broadcast", "layers.1"),  # prefetched before layers.0 computes
        ("computed", "layers.0"),
        ("forward_broadcast", "layers.2"),
        ("computed", "layers.1"),
        ("computed", "layers.2"),
    ]
    bwd = [e for e in ev if e[0] in ("backward_broadcast", "reduce")]
    assert bwd == [
        ("backward_broadcast", "layers.2"),
        ("backward_broadcast", "layers.1"),  # prefetched before layers.2's reduce
        ("reduce", "layers.2"),  # posted as soon as layers.2's backward is done
        ("backward_broadcast", "layers.0"),
        ("reduce", "layers.1"),
        ("reduce", "layers.0"),
    ]
