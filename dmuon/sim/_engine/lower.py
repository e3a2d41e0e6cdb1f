"""Lowering: a step schedule's ops (dmuon's, or an alternative's) -> the simulator's ops, timed.

:func:`dmuon.sim._engine.sim_replay.replay_ops` replays the result. What the lowering adds and the two
things it changes in the table (coalescing, the token all-to-all): Note: lowering a schedule
(docs/design.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dmuon.plan._cost import baseline as _baseline
from dmuon.plan._cost import flops as _flops
from dmuon.plan import _rules as _rules
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._records.owners import OwnerGroup
from dmuon.plan._scheduling.ops import Op
from dmuon.sim._engine import alternatives as _alt
from dmuon.sim._engine.coalesce import coalesced_collective_s
from dmuon.sim._engine.hardware import (
    OP_COLLECTIVE,
    Hardware,
    blocking_wait_s_at,
    busy_factors,
    collective_s,
    dtensor_gather_s_at,
    elementwise_s,
    fsdp2_call_s_at,
    matmul_s,
    ns_batch_factor_at,
    ns_call_s,
    ns_mean_dim,
    step_compute_factor_at,
    train_activation_s,
    train_attention_s,
    train_elementwise_s,
    train_matmul_s,
    train_norm_s,
)
from dmuon.sim._engine.sim_memory import buffer_wire_numel
from dmuon.sim._engine.workload import Work, Workload

#: channel of dmuon's collectives, by ledger phase: a phase's collective may be a broadcast or an
#: all-gather (forward / backward), a reduce or a reduce-scatter (gradients). HSDP's replicate
#: phases run on the replicate process group, whose stream (NCCL) or worker thread (gloo) is not
#: the shard group's: a channel of their own, concurrent with the shard-group reduces
_PHASE_CHANNEL = {
    "forward_broadcast": "bcast",
    "backward_broadcast": "bcast",
    "replicate_broadcast": "replicate",
    "reduce": "reduce",
    "replicate_reduce": "replicate",
    "tp": "tp",
    "owner_group": "tp",
    "qk_clip": "tp",
}
#: channel of the other collectives (FSDP2's, the alternatives', all-to-alls), by kind
_CHANNEL = {
    "broadcast": "bcast",
    "reduce": "reduce",
    "reduce_scatter": "reduce",
    "all_reduce": "tp",
    "all_gather": "tp",
    "fsdp2_all_gather": "fsdp2_ag",
    "fsdp2_reduce_scatter": "fsdp2_rs",
    "fsdp2_all_reduce": "fsdp2_rs",
    "all_to_all": "a2a",
}
_CHANNELS = ("bcast", "reduce", "replicate", "fsdp2_ag", "fsdp2_rs", "tp", "a2a")
#: dmuon's collectives that the runtime coalesces per boundary phase and group where the backend can
_COALESCED_KINDS = ("broadcast", "reduce")


def _channel(op: Op) -> str:
    """The channel an op's collective runs on: dmuon's by phase (:data:`_PHASE_CHANNEL`), the
    others by kind."""
    return (not op.external and _PHASE_CHANNEL.get(op.phase)) or _CHANNEL[op.kind]


@dataclasses.dataclass(slots=True)
class _SimOp:
    kind: str
    label: str
    group: tuple[int, ...]
    deps: tuple[int, ...]
    collective: bool
    seconds: Any  # collective: float; local: float or np.ndarray aligned with group
    host_s: float = 0.0
    channel: str = ""
    ns: bool = False
    deferred: bool = False  # HSDP replicate broadcast with replicate_async: waited for in the next step


def tp_activation_all_reduce_s(hw: Hardware, tp_size: int, tokens: int, hidden: int, itemsize: int) -> float:
    """One Megatron tensor-parallel activation all-reduce of ``tokens x hidden`` on ``tp_size``
    ranks of one node (0 without TP); a boundary runs two in its forward and two in its backward
    (a selective recompute none: it saves them)."""
    if tp_size <= 1 or not hidden:
        return 0.0
    return collective_s(hw, "all_reduce", tuple(range(tp_size)), tokens * hidden * itemsize)


def _work_s(hw: Hardware, w: Work, factor: float, dtype: str, itemsize: int) -> float:
    """Seconds of ``factor`` x the forward of ``w``: matmuls at the training-matmul efficiency
    (:func:`~dmuon.sim.hardware.train_matmul_s`), attention
    (:func:`~dmuon.sim.hardware.train_attention_s`), norms and the activation function
    (:func:`~dmuon.sim.hardware.train_norm_s`, :func:`~dmuon.sim.hardware.train_activation_s`),
    the other elementwise bytes and operators with autograd; the first two times the busy-node
    matmul factor, the rest times the memory factor (:func:`~dmuon.sim.hardware.busy_factors`)."""
    busy_c, busy_m = busy_factors(hw)
    t_c = sum(train_matmul_s(hw, f, d, dtype) for f, d in w.matmuls)
    t_c += train_attention_s(hw, w.attention_flops, w.attention_d, w.attention_head_d, dtype)
    t_m = train_norm_s(hw, w.norm_numel, itemsize) + train_activation_s(hw, w.activation_numel, itemsize)
    t_m += train_elementwise_s(hw, w.elementwise_nbytes, w.ops)
    return factor * (busy_c * t_c + busy_m * t_m)


def _ns_s(
    hw: Hardware,
    wl: Workload,
    spec: Any,
    flops: int,
    batch_factor: float = 1.0,
    backend: str = "standard",
    numel: int | None = None,
    batch: float = 1.0,
) -> float:
    """One matrix's Muon update: the Newton-Schulz call (calibrated as a whole where the record has
    ``ns_efficiency`` — on the Gram curve for ``backend="gram"``,
    :func:`~dmuon.sim.hardware.ns_call_s` — else its matmuls on the plain curve plus its norm / axpy passes) times
    ``batch_factor`` (its share of a batched call, :func:`_ns_batch_factors`), and the update's
    elementwise work (momentum, Nesterov, decay, apply: 6 passes, ``muon_ops_per_matrix``);
    matmuls times the busy-node matmul factor, passes times the memory factor. ``numel``: the
    elements the op updates (default ``spec.local_numel``; an expert stack's range op: its share,
    :func:`_op_numel`). ``batch``: the matrices of the batched call it runs in
    (``ns_batching="batched"``): a call's operators (the NS steps' and the foreach update's) are
    issued once per call, so each matrix pays ``1 / batch`` of their per-operator cost."""
    isz = itemsize_nbytes(spec.dtype)
    numel = spec.local_numel if numel is None else numel
    busy_c, busy_m = busy_factors(hw)
    update = busy_m * elementwise_s(hw, 6 * numel * isz, wl.muon_ops_per_matrix / batch)
    d = ns_mean_dim(*spec.matrix_shape)
    if hw.ns_efficiency:
        return busy_c * ns_call_s(hw, flops, d, backend) * batch_factor + update
    mm = matmul_s(hw, flops, d, hw.ns_dtype)
    passes = elementwise_s(
        hw, 2 * _rules.NS_STEPS * numel * itemsize_nbytes(hw.ns_dtype), wl.ns_ops_per_step * _rules.NS_STEPS / batch
    )
    return (busy_c * mm + busy_m * passes) * batch_factor + update


def _op_numel(spec: Any, flops: int) -> int:
    """Elements a Newton-Schulz op of ``spec`` updates: the whole parameter, or for an expert
    stack's op over one owner's range of experts (its FLOPs a share of the stack's), that share
    of the stack's elements (every expert of a stack has the same size)."""
    if spec.experts is None:
        return spec.local_numel
    total = _flops.spec_ns_flops(spec)
    return spec.local_numel if total <= 0 or flops >= total else spec.local_numel * flops // total


def _owner_group_fqns(plan: Any) -> set[str]:
    """The plan's matrices owned by an owner group (sharded Gram NS on its members)."""
    return {spec.fqn for spec, owner in zip(plan.params, plan.owners) if isinstance(owner, OwnerGroup)}


def _ns_backend(spec: Any, grouped: set[str]) -> str:
    """The Newton-Schulz a dmuon matrix's update runs, ``"gram"`` or ``"standard"``: Gram for the
    plan's ``ns_backend="gram"`` matrices, TP-sharded ones with ``tp_ns="gram"`` and owner-group
    matrices (``grouped``; sharded Gram NS, :mod:`dmuon.exec._optim.tp_orthogonalize`)."""
    gram = spec.ns_backend == "gram" or (spec.tp_size > 1 and spec.tp_ns == "gram") or spec.fqn in grouped
    return "gram" if gram else "standard"


def _ns_batch_factors(
    ops: Sequence[Op], specs: dict[str, Any], grouped: set[str], hw: Hardware, variant: str, ns_batching: str
) -> dict[int, tuple[float, float]]:
    """Op id -> ``(factor, batch)``: the per-matrix factor of the batched NS call its matrices run
    in (:func:`~dmuon.sim.hardware.ns_batch_factor_at`, 1 on a record without a calibrated
    ``ns_batch_factor``) and the number of matrices of that call (ops not listed: ``(1, 1)``).

    With ``ns_batching="batched"`` (the workload's, ``dmuon.Muon``'s default) ``dmuon.Muon`` (and
    the naive baseline, which batches as it does) runs NS per bucket, in every NS dtype: on each rank, the matrices it orthogonalises with the same ``(short, long)`` side and
    dtype, in parameter order, cut into calls by :func:`dmuon.plan._rules.ns_batch_pieces` (a view's
    blocks enter one by one, an expert stack as its ``E`` matrices, cut between experts above the cap; the optimizer buckets per param
    group, the simulator assumes one Muon param group). Here a bucket is keyed by the
    op's group (its members run the same calls), so each matrix gets the batch size of its call; an
    op whose matrices fall in several calls gets their factors weighted by NS FLOPs (``specs``: fqn ->
    spec; ``grouped``: :func:`_owner_group_fqns`). The TP and
    owner-group paths (Gram buckets, gathered TP matrices) and dion's all-to-all (one matrix per
    owner per batch) are not batched this way: factor 1. ``ns_batching="exact"``: nothing batched."""
    if variant not in ("z2", "z3", "naive") or ns_batching != "batched":
        return {}
    # key -> [(op id, a, b, count, matrices per unit)]
    buckets: dict[tuple, list[tuple[int, int, int, int, int]]] = {}
    for op in ops:
        if op.kind != "newton_schulz":
            continue
        spec = specs[op.fqns[0]]
        if spec.tp_size > 1 or spec.fqn in grouped:
            continue
        if spec.experts is not None and spec.view is None:  # an op covers one owner's range of experts
            total = _flops.spec_ns_flops(spec)
            count = spec.num_matrices if total <= 0 else max(1, round(spec.num_matrices * op.flops / total))
            mpe = spec.experts.matrices_per_expert
            entries = [(tuple(spec.matrix_shape), count, mpe if count % mpe == 0 else 1)]  # cut between experts
        elif spec.view is None:
            entries = [(tuple(spec.matrix_shape), spec.num_matrices, spec.num_matrices)]
        else:
            entries = [(block, 1, 1) for block in spec.matrices]
        for (m, n), count, unit in entries:
            a, b = _rules.ns_bucket_sides(m, n)
            buckets.setdefault((op.group, a, b, spec.dtype), []).append((op.id, a, b, count, unit))
    weighted: dict[int, list[float]] = {}  # op id -> [sum of flops x factor, sum of flops x batch, sum of flops]
    for entries in buckets.values():
        numels = [e[3] * e[1] * e[2] for e in entries]
        for run in _rules.ns_batch_pieces(numels, [e[4] * e[1] * e[2] for e in entries]):
            counts = [(p.stop - p.start) * entries[p.entry][4] for p in run]
            batch = sum(counts)
            for p, count in zip(run, counts):
                op_id, a, b = entries[p.entry][:3]
                f = _flops.ns_flops(a, b, num_matrices=count)
                acc = weighted.setdefault(op_id, [0.0, 0.0, 0.0])
                acc[0] += f * ns_batch_factor_at(hw, ns_mean_dim(a, b), batch)
                acc[1] += f * batch
                acc[2] += f
    return {i: (num / den, b / den) for i, (num, b, den) in weighted.items() if den > 0}


def _adamw_s(hw: Hardware, wl: Workload, tensors: Sequence[tuple[int, int]], dtensor: bool) -> float:
    """AdamW over ``(numel, itemsize)`` tensors: 7 accesses per element (read p, g, m, v; write
    p, m, v), ``adamw_ops_per_tensor`` operators each, plus DTensor dispatch per operator."""
    nbytes = sum(7 * n * isz for n, isz in tensors)
    ops = wl.adamw_ops_per_tensor * len(tensors)
    return busy_factors(hw)[1] * (elementwise_s(hw, nbytes, ops) + (ops * hw.dtensor_op_s if dtensor else 0.0))


def _lower(ops: Sequence[Op], plan: Any, hw: Hardware, wl: Workload, *, variant: str, num_ranks: int) -> list[_SimOp]:
    """Schedule ops -> simulator ops, with the root's work, hooks and the optimizer added."""
    dtype = hw.compute_dtype
    N = plan.mesh_shape[1]
    dmuon = variant in ("z2", "z3")
    over = hw.oversubscription
    busy_m = busy_factors(hw)[1]
    # forward / backward compute between the step's blocking collectives (shard groups of N)
    step_f = over * step_compute_factor_at(hw, N)
    work = dict(wl.boundaries)
    isz = itemsize_nbytes(wl.activation_dtype)
    fwd_s = {f: _work_s(hw, w, 1.0, dtype, isz) * step_f for f, w in work.items()}
    bwd_s = {f: _work_s(hw, w, w.backward_factor, dtype, isz) * step_f for f, w in work.items()}
    # activation checkpointing: what each boundary's backward recomputes (dmuon.sim.workload)
    rec_s = {f: _work_s(hw, w.recompute, 1.0, dtype, isz) * step_f for f, w in work.items() if w.recompute is not None}
    # tensor parallelism: Megatron's activation all-reduces, two per boundary forward (and recompute)
    # and two per backward, on the node's TP group, exposed
    tp_ar = {
        f: 2 * tp_activation_all_reduce_s(hw, plan.tp_size, wl.tokens_per_rank // wl.micro_batches, w.hidden, isz)
        for f, w in work.items()
    }
    fwd_s = {f: t + tp_ar[f] for f, t in fwd_s.items()}
    bwd_s = {f: t + tp_ar[f] for f, t in bwd_s.items()}
    rec_s = {f: t + (tp_ar[f] if work[f].recompute_all_to_all else 0.0) for f, t in rec_s.items()}
    embed_f = _work_s(hw, wl.embed, 1.0, dtype, isz) * step_f
    embed_b = _work_s(hw, wl.embed, wl.embed.backward_factor, dtype, isz) * step_f
    head = _work_s(hw, wl.head, 1.0 + wl.head.backward_factor, dtype, isz) * step_f
    hook = 2 * hw.hook_s if dmuon else 0.0
    boundary_nbytes = {
        b.fqn: sum(buffer_wire_numel(buf, N) * itemsize_nbytes(buf.dtype) for buf in b.buffers) for b in plan.boundaries
    }
    specs = {s.fqn: s for s in plan.params}
    everyone = tuple(range(num_ranks))
    out: list[_SimOp] = []
    remap: dict[int, int] = {}
    root_ag: dict[int, list[int]] = {}
    first_fwd: set[int] = set()
    first_bwd: set[int] = set()
    last_bwd: dict[int, int] = {}
    reducing: set[int] = set()  # micro-batches whose backward reduces (the others run inside no_sync)
    for op in ops:
        if op.kind == "backward":
            last_bwd[op.micro_batch] = op.id
        elif op.phase == "reduce":
            reducing.add(op.micro_batch)
    grad_colls: list[int] = []
    coll_cache: dict = {}
    waited: set[tuple] = set()
    grouped = _owner_group_fqns(plan)
    batch_factors = _ns_batch_factors(ops, specs, grouped, hw, variant, wl.ns_batching)
    # the model's token all-to-all under expert parallelism (Note: lowering a schedule)
    a2a_groups = _alt.ep_groups(plan)
    if a2a_groups and plan.tp_size > 1:
        raise ValueError("dmuon.sim: expert parallelism with tensor parallelism is not simulated")
    moe = {f: w for f, w in work.items() if w.experts is not None and w.dispatch_nbytes} if a2a_groups else {}
    exp_s = {
        f: (
            _work_s(hw, w.experts, 1.0, dtype, isz) * step_f,
            _work_s(hw, w.experts, w.backward_factor, dtype, isz) * step_f,
        )
        for f, w in moe.items()
    }
    last_compute = [-1]  # the latest compute op on every rank (what a token all-to-all waits for)
    block: list[Op] = []  # dmuon broadcasts / reduces of one boundary phase, coalesced (Note: lowering a schedule)

    def host_s(op: Op, k: int, nbytes: int) -> float:
        """A collective's cost on the calling thread: issue, and the per-kind extras."""
        kind = op.kind
        host = hw.issue_s
        if kind.startswith("fsdp2_"):
            host += fsdp2_call_s_at(hw, k) + elementwise_s(hw, 2 * k * nbytes, 1)  # copy-out / copy-in
        elif dmuon and (
            kind in ("broadcast", "reduce", "all_reduce", "reduce_scatter")
            or (kind == "all_gather" and op.phase in ("forward_broadcast", "backward_broadcast"))
        ):
            # the runtime blocks once per boundary's broadcasts / all-gathers (before its forward /
            # backward) and once per micro-batch on its gradient collectives (finish_reduces); the
            # packing is charged with the boundary's backward, below
            grad = kind in ("reduce", "reduce_scatter")
            wait_key = ("reduce", op.micro_batch) if grad else (op.phase, op.boundary, op.micro_batch)
            if wait_key not in waited:
                waited.add(wait_key)
                host += blocking_wait_s_at(hw, k)
        elif kind == "all_to_all":
            host += elementwise_s(hw, 2 * nbytes, 2)
        elif kind == "all_gather" and variant == "naive":  # DTensor.full_tensor() + redistribute back
            host += dtensor_gather_s_at(hw, k)
        return host

    def flush() -> None:
        """Emit the pending coalesced block: one op per group, in first-appearance order."""
        by_group: dict[tuple[int, ...], list[Op]] = {}
        for op in block:
            by_group.setdefault(op.group, []).append(op)
        for group, run in by_group.items():
            first = run[0]
            deps = tuple(dict.fromkeys(remap[d] for o in run for d in o.deps))
            secs = coalesced_collective_s(hw, first.kind, group, [o.nbytes for o in run], [o.root for o in run])
            label = f"{first.phase} {first.boundary or ''}".strip() + (f" x{len(run)}" if len(run) > 1 else "")
            for o in run:
                remap[o.id] = len(out)
            out.append(
                _SimOp(
                    first.kind,
                    label,
                    group,
                    deps,
                    True,
                    secs,
                    host_s(first, len(group), first.nbytes),
                    _channel(first),
                    deferred=first.phase == "replicate_broadcast" and plan.replicate_async,
                )
            )
        block.clear()

    def token_a2a(b: str, mb: int, deps: tuple[int, ...]) -> tuple[int, ...]:
        """One token all-to-all of boundary ``b`` on every EP group; the new ops' indices."""
        nbytes = moe[b].dispatch_nbytes
        ids = []
        for grp in a2a_groups:
            key = ("all_to_all", grp, nbytes)
            secs = coll_cache.get(key)
            if secs is None:
                secs = coll_cache[key] = collective_s(hw, "all_to_all", grp, nbytes)
            ids.append(len(out))
            out.append(
                _SimOp(
                    "all_to_all",
                    f"tokens {b} mb{mb}",
                    grp,
                    deps,
                    True,
                    secs,
                    hw.issue_s + elementwise_s(hw, 2 * nbytes, 2),
                    "a2a",
                )
            )
        return tuple(ids)

    def compute(kind: str, label: str, deps: tuple[int, ...], secs: Any) -> int:
        last_compute[0] = len(out)
        out.append(_SimOp(kind, label, everyone, deps, False, secs))
        return last_compute[0]

    for op in ops:
        mb = op.micro_batch
        kind = op.kind
        coalesce = hw.coalesces and dmuon and not op.external and kind in _COALESCED_KINDS
        if block and not (
            coalesce
            and (kind, op.phase, op.boundary, mb)
            == (block[0].kind, block[0].phase, block[0].boundary, block[0].micro_batch)
        ):
            flush()
        if coalesce:
            block.append(op)
            continue
        if kind == "forward" and mb not in first_fwd:
            first_fwd.add(mb)
            compute("forward", "embed", tuple(root_ag.get(mb, ())), embed_f)
        if kind in ("backward", "recompute") and mb not in first_bwd:
            first_bwd.add(mb)
            compute("backward", "head", tuple(root_ag.get(mb, ())), head)
        deps = tuple(dict.fromkeys(map(remap.__getitem__, op.deps)))  # coalesced ops share one
        if kind in OP_COLLECTIVE:
            nbytes = op.nbytes
            k = len(op.group)
            key = (kind, op.group, nbytes)
            secs = coll_cache.get(key)
            if secs is None:
                secs = coll_cache[key] = collective_s(hw, OP_COLLECTIVE[kind], op.group, nbytes)
            label = f"{op.phase} {op.boundary or ''}".strip()
            s = _SimOp(
                kind,
                label,
                op.group,
                deps,
                True,
                secs,
                host_s(op, k, nbytes),
                _channel(op),
                deferred=op.phase == "replicate_broadcast" and plan.replicate_async,
            )
            if kind == "fsdp2_all_gather" and op.boundary == "":
                root_ag.setdefault(mb, []).append(len(out))
            if kind in ("fsdp2_reduce_scatter", "fsdp2_all_reduce") or (
                kind == "all_to_all" and variant == "all_to_all"
            ):
                grad_colls.append(len(out))
        elif kind in ("forward", "backward", "recompute"):
            b = op.boundary
            if kind == "recompute":
                secs = rec_s.get(b, fwd_s[b]) + hook
            else:
                secs = (fwd_s[b] if kind == "forward" else bwd_s[b]) + hook
            if kind == "backward" and dmuon and mb in reducing:  # packing the gradients for their reduce
                secs += elementwise_s(hw, 2 * boundary_nbytes.get(b, 0), 2) * busy_m * over
            if b in moe and (kind != "recompute" or work[b].recompute_all_to_all):
                # dense | dispatch | experts | combine, or its reverse in the backward
                e_s = exp_s[b][kind == "backward"]
                if kind == "backward":
                    sent = token_a2a(b, mb, (last_compute[0],) if last_compute[0] >= 0 else ())
                    x = compute(kind, f"{b} experts", sent + deps, e_s)
                    sent = token_a2a(b, mb, (x,))
                    s = _SimOp(kind, b or "", everyone, sent, False, secs - e_s)
                else:
                    a = compute(kind, b or "", deps, secs - e_s)
                    sent = token_a2a(b, mb, (a,))
                    x = compute(kind, f"{b} experts", sent, e_s)
                    sent = token_a2a(b, mb, (x,))
                    s = _SimOp(kind, f"{b} combined", everyone, sent, False, 0.0)
            else:
                s = _SimOp(kind, b or "", op.group, deps, False, secs)
            last_compute[0] = len(out)
        elif kind == "newton_schulz":
            spec = specs[op.fqns[0]]
            backend = _ns_backend(spec, grouped) if dmuon else "standard"  # the baselines: torch's iteration
            factor, batch = batch_factors.get(op.id, (1.0, 1.0))
            secs = _ns_s(hw, wl, spec, op.flops, factor, backend, _op_numel(spec, op.flops), batch) * over
            if not dmuon:  # FSDP2 shards: DTensor dispatch of the update's operators
                secs += wl.muon_ops_per_matrix * hw.dtensor_op_s * over
            s = _SimOp(kind, op.fqns[0], op.group, deps, False, secs, ns=True)
        else:
            raise ValueError(f"dmuon.sim: cannot simulate op kind {kind!r} ({op.describe()})")
        remap[op.id] = len(out)
        out.append(s)
        if hw.comm_engine == "threads" and (kind.startswith("fsdp2_") or (kind == "all_gather" and variant == "naive")):
            # Calls that return only when the collective is done, on gloo: every FSDP2 collective
            # (its all-gathers, prefetches included — unshard_async_op is off — and its gradient
            # reduce-scatter / all-reduce in the post-backward hook are issued without async_op;
            # on GPUs streams run them beside the compute) and DTensor.full_tensor() (the naive
            # baseline's gather: every gather precedes the first NS, as in its step). NCCL only
            # makes the compute stream wait, which the deps express.
            out.append(_SimOp("wait", s.label, op.group, (len(out) - 1,), False, 0.0))
        if op.kind == "backward" and last_bwd.get(mb) == op.id:
            compute("backward", "embed", (len(out) - 1,), embed_b)
    if block:
        flush()
    # the optimizer: AdamW on this rank's FSDP2 shards (DTensors), after its gradient collectives
    # (expert stacks as torchtitan shards them, dmuon.plan._cost.baseline.fsdp2_param_shard)
    tensors: list[tuple[int, int]] = []
    ep = _alt.plan_ep(plan)
    for u in plan.fsdp2_units:
        for p, shape, dt, g in zip(u.params, u.shapes, u.dtypes, u.requires_grad):
            if g:
                tensors.append((_baseline.fsdp2_param_shard(p, tuple(shape), N, ep=ep)[1], itemsize_nbytes(dt)))
    if variant == "adamw":  # naive / all_to_all: Muon's elementwise work on the shards is in the NS ops
        tensors += [(_baseline.spec_fsdp2_shard(s, N)[1], itemsize_nbytes(s.dtype)) for s in plan.params]
    out.append(_SimOp("optimizer", "adamw", everyone, tuple(grad_colls), False, _adamw_s(hw, wl, tensors, True) * over))
    return out
