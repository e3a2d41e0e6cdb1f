"""Prefetch and overlap order (issue #7), read from the sequence of posted collectives.

Forward: the next boundary's broadcast is posted before the current boundary computes.
Backward (Z3): the previous boundary's broadcast is posted before the current boundary's
gradient reduce, and every reduce is posted (async) as soon as its boundary's backward is done,
so reduces overlap the backward of earlier boundaries.
"""

from __future__ import annotations

import torch

from dist_utils import run_distributed
from dmuon.exec import get_model_runtime
from oracle import global_batches, lm_loss, make_model


def _worker():
    import torch.distributed as dist

    import dmuon
    from dmuon.exec.comm import collectives as C

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = make_model("tiny")  # 3 boundaries: layers.0 .. layers.2
    dmuon.dedicate_params(model, reshard_after_forward=True)
    rt = get_model_runtime(model)
    owner_of = {}
    for b in rt.boundaries:
        for seg in b.segments:
            owner_of[seg.wire.untyped_storage()._cdata] = b.fqn
    events = []
    orig_bcast, orig_reduce = C.broadcast, C.reduce_sum

    def bcast(tensor, **kw):
        events.append((kw["phase"], owner_of.get(tensor.untyped_storage()._cdata, "?")))
        return orig_bcast(tensor, **kw)

    def reduce(tensor, **kw):
        events.append((kw["phase"], launching[-1] if launching else "?"))
        return orig_reduce(tensor, **kw)

    launching = []
    for b in rt.boundaries:
        def launch(orig=b._launch_reduce, fqn=b.fqn):
            launching.append(fqn)
            orig()
            launching.pop()

        b._launch_reduce = launch

    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: events.append(("computed", f"layers.{i}")))
    C.broadcast, C.reduce_sum = bcast, reduce
    try:
        loss = lm_loss(model, global_batches(1)[0].chunk(2)[rank])
        loss.backward()
    finally:
        C.broadcast, C.reduce_sum = orig_bcast, orig_reduce
    dist.barrier()
    return events


def _collapse(events):
    """Consecutive duplicates (one collective per segment) collapse to one event."""
    out = []
    for e in events:
        if not out or out[-1] != e:
            out.append(e)
    return out


def test_prefetch_and_overlap_order():
    results = run_distributed(_worker, 2, timeout_s=120)
    assert results[0] == results[1]  # the same collective sequence on every rank
    ev = _collapse(results[0])
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
