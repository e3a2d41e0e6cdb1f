r"""What one training step computes, per hook boundary, derived from a plan term by term.

:func:`from_plan` reads every parameter the plan knows (the dedicated matrices and FSDP2's units)
and derives, for ``tokens_per_rank`` tokens per rank and step in sequences of ``seq_len``, each
boundary's FLOPs, bytes, operators and activation memory. The rule of each term: Note: the
workload terms (docs/design.md). Every field can be overridden with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dmuon.plan import _rules
from dmuon.plan._cost.baseline import is_expert_stack
from dmuon.plan._records.fields import itemsize_nbytes

__all__ = ["Work", "Workload", "from_plan", "model_top_k", "ACTIVATION_BYTES_PER_TOKEN_HIDDEN", "AC_MODES"]

#: activation checkpointing modes of :func:`from_plan` (Note: the workload terms, docs/design.md)
AC_MODES = ("none", "full", "selective")

#: activation bytes per token and hidden unit of one transformer layer in bf16 with flash
#: attention (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
#: Models", 2022: 34·s·b·h + 5·a·s²·b; the second term is gone with flash attention)
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
_OPS_PER_MATRIX = 2
_OPS_PER_NORM = 6
_OPS_PER_BOUNDARY = 10
_LOSS_PASSES = 4
_DEFAULT_HEAD_DIM = 128
#: leaf modules whose output feeds the MLP's activation (``gate_proj`` wins where present: SwiGLU)
_ACTIVATION_INPUTS = ("up_proj", "fc1", "c_fc", "w1")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """The forward of one unit (a hook boundary, or a part of the root) for one micro-batch.

    Attributes:
        fqn: the boundary's module FQN (``""`` for root parts, with ``label`` saying which).
        label: what it is (``"boundary"``, ``"embed"``, ``"head"``).
        matmuls: ``(flops, d)`` pairs: FLOPs of one matmul and its mean dimension
            ``(m·n·k)^(1/3)`` (for the efficiency curve).
        attention_flops: forward attention FLOPs (causal factor applied).
        attention_d: mean dimension of the attention matmuls over the whole width
            ``(seq_len² · d_attn)^(1/3)`` (the matmul curves).
        attention_head_d: mean dimension of one head's attention ``(seq_len² · head_dim)^(1/3)``
            (a calibrated attention curve; 0 = no attention).
        elementwise_nbytes: forward memory-bound bytes besides norms and the activation.
        norm_numel: elements the unit's norms normalise in the forward.
        activation_numel: elements through the MLP's activation function in the forward.
        ops: forward operator count.
        activation_nbytes: activations kept for the backward.
        backward_factor: backward cost / forward cost of every term (2).
        experts: the part of this Work that runs on the routed tokens (its expert stacks'
            matmuls and elementwise terms, included in the ones above), or None without stacks.
        dispatch_nbytes: bytes one rank sends in one token all-to-all of this boundary under
            expert parallelism (``tokens · top_k · hidden · itemsize``; 0 without stacks).
        hidden: the hidden size (the width of the activation between boundaries).
        recompute: what the backward recomputes under activation checkpointing (None: nothing).
        recompute_all_to_all: the recompute runs the token all-to-alls again (full AC: yes;
            selective AC saves their outputs).
        activation_full_nbytes: the activations without checkpointing (what a recompute
            rebuilds; equal to ``activation_nbytes`` without AC).
    """

    fqn: str
    label: str
    matmuls: tuple[tuple[int, float], ...] = ()
    attention_flops: int = 0
    attention_d: float = 1.0
    attention_head_d: float = 0.0
    elementwise_nbytes: int = 0
    norm_numel: int = 0
    activation_numel: int = 0
    ops: int = 0
    activation_nbytes: int = 0
    backward_factor: float = 2.0
    experts: Work | None = None
    dispatch_nbytes: int = 0
    hidden: int = 0
    recompute: Work | None = None
    recompute_all_to_all: bool = True
    activation_full_nbytes: int = 0

    @property
    def matmul_flops(self) -> int:
        return sum(f for f, _ in self.matmuls)

    @property
    def flops(self) -> int:
        """Forward FLOPs: matmuls + attention."""
        return self.matmul_flops + self.attention_flops


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """Per-micro-batch compute of every hook boundary, and the root's parts.

    Attributes:
        tokens_per_rank: tokens each rank processes per step (all micro-batches).
        micro_batches: micro-batches per step (the schedule's; terms below are per micro-batch).
        seq_len: tokens per sequence.
        activation_dtype: dtype of activations (the compute dtype).
        boundaries: ``{boundary fqn: Work}`` as a tuple of pairs, plan order.
        embed / head: the root's work before the first boundary (embeddings) and after the last
            (final norm, ``lm_head``, loss).
        adamw_ops_per_tensor: operators of one AdamW update of one tensor (single-tensor path).
        muon_ops_per_matrix: elementwise operators of one Muon update besides the NS matmuls
            (momentum, Nesterov, normalisation, decay, update).
        ns_ops_per_step: operators per Newton-Schulz iteration step (3 matmuls + 2 axpys).
        ns_batching: ``dmuon.Muon(ns_batching=...)`` of the job: ``"batched"`` (default; NS per
            bucket of same-shape matrices, its operators issued once per call) or ``"exact"`` (one
            call per matrix); ``dataclasses.replace`` to price the other.
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"`` (Note: the workload terms, docs/design.md).
    """

    tokens_per_rank: int
    micro_batches: int = 1
    seq_len: int
    activation_dtype: str
    boundaries: tuple[tuple[str, Work], ...]
    embed: Work
    head: Work
    adamw_ops_per_tensor: int = 8
    muon_ops_per_matrix: int = 8
    ns_ops_per_step: int = 5
    ns_batching: str = "batched"
    activation_checkpointing: str = "none"

    def __post_init__(self) -> None:
        if self.ns_batching not in _rules.NS_BATCHING_MODES:
            raise ValueError(
                f"Workload.ns_batching must be one of {_rules.NS_BATCHING_MODES}, got {self.ns_batching!r}"
            )

    def work(self, fqn: str) -> Work:
        for f, w in self.boundaries:
            if f == fqn:
                return w
        raise KeyError(f"workload has no boundary {fqn!r}")

    @property
    def forward_flops(self) -> int:
        """Forward FLOPs per micro-batch and rank, root included."""
        return sum(w.flops for _, w in self.boundaries) + self.embed.flops + self.head.flops

    @property
    def activation_nbytes(self) -> int:
        return (
            sum(w.activation_nbytes for _, w in self.boundaries)
            + self.embed.activation_nbytes
            + self.head.activation_nbytes
        )

    @property
    def recompute_transient_nbytes(self) -> int:
        """Under activation checkpointing, the most one boundary's backward rebuilds
        (``activation_full_nbytes - activation_nbytes``); 0 without."""
        return max(
            (w.activation_full_nbytes - w.activation_nbytes for _, w in self.boundaries if w.recompute is not None),
            default=0,
        )


def _mean_dim(m: float, n: float, k: float) -> float:
    return (max(m, 1) * max(n, 1) * max(k, 1)) ** (1.0 / 3.0)


def _is_embedding(fqn: str) -> bool:
    module = fqn.rpartition(".")[0]
    leaf = module.rpartition(".")[2]
    return "embed" in leaf and "patch" not in leaf


def _unit_work(
    fqn: str,
    label: str,
    params: list[tuple[str, tuple[int, ...], int]],
    *,
    tokens: int,
    seq_len: int,
    itemsize: int,
    top_k: int,
    causal: bool,
    head_dim: int | None,
    ac: str = "none",
) -> Work:
    """The Work of one unit from its ``(fqn, local shape, ep)`` parameters (``ep``: an expert
    stack's expert-parallel degree, its local shape ``(E/ep, m, n)``)."""
    matmuls: list[tuple[int, float]] = []
    exp_matmuls: list[tuple[int, float]] = []
    exp_elem = 0
    exp_ops = 0
    elem = 0
    norm_numel = 0
    act_by_leaf: dict[str, int] = {}
    ops = _OPS_PER_BOUNDARY if label == "boundary" else 0
    d_attn = 0
    hidden = 0
    sides = []
    out_numel = 0  # matmul outputs of the forward (selective AC saves half)
    ep_max = 1
    for name, shape, ep in params:
        if len(shape) == 1:
            norm_numel += tokens * shape[0]
            ops += _OPS_PER_NORM
            hidden = max(hidden, shape[0])
            continue
        if _is_embedding(name):
            elem += 2 * tokens * shape[-1] * itemsize
            ops += 1
            continue
        if is_expert_stack(name, shape):  # (E/ep, m, n) stacks: each token visits top_k of the E experts
            e, m, n = shape
            E = e * ep
            t_e = tokens * min(top_k, E) / E * ep  # tokens per local expert: ep ranks' share
            for _ in range(e):
                exp_matmuls.append((int(2 * t_e * m * n), _mean_dim(t_e, m, n)))
            exp_elem += int(2 * tokens * min(top_k, E) * m * itemsize)
            exp_ops += _OPS_PER_MATRIX * e
            sides.append(min(m, n))
            out_numel += tokens * min(top_k, E) * m
            ep_max = max(ep_max, ep)
            continue
        m = shape[0]
        n = math.prod(shape[1:])
        matmuls.append((2 * tokens * m * n, _mean_dim(tokens, m, n)))
        ops += _OPS_PER_MATRIX
        sides.append(min(m, n))
        out_numel += tokens * m
        leaf = name.rpartition(".")[0].rpartition(".")[2]
        if label == "boundary" and (leaf == "gate_proj" or leaf in _ACTIVATION_INPUTS):
            act_by_leaf[leaf] = act_by_leaf.get(leaf, 0) + tokens * m
        else:
            elem += 2 * tokens * m * itemsize
        if leaf == "q_proj":
            d_attn = max(d_attn, m)
        elif leaf == "qkv":
            d_attn = max(d_attn, m // 3)
    # SwiGLU: the activation runs on gate_proj's output; up_proj's is the multiplier (one pass)
    act_numel = act_by_leaf.pop("gate_proj", 0)
    if act_numel:
        elem += sum(2 * n * itemsize for n in act_by_leaf.values())
    else:
        act_numel = sum(act_by_leaf.values())
    att = 0
    att_d = 1.0
    att_head_d = 0.0
    if d_attn and label == "boundary":
        att = int(2 * 2 * tokens * seq_len * d_attn * (0.5 if causal else 1.0))
        att_d = _mean_dim(seq_len, seq_len, d_attn)
        att_head_d = _mean_dim(seq_len, seq_len, min(head_dim or _DEFAULT_HEAD_DIM, d_attn))
    hidden = hidden or (min(sides) if sides else 0)
    act = ACTIVATION_BYTES_PER_TOKEN_HIDDEN * tokens * hidden * itemsize // 2 if label == "boundary" else 0
    experts = None
    dispatch = 0
    if exp_matmuls:
        experts = Work(fqn=fqn, label="experts", matmuls=tuple(exp_matmuls), elementwise_nbytes=exp_elem, ops=exp_ops)
        dispatch = tokens * top_k * hidden * itemsize
    work = Work(
        fqn=fqn,
        label=label,
        matmuls=tuple(matmuls + exp_matmuls),
        attention_flops=att,
        attention_d=att_d,
        attention_head_d=att_head_d,
        elementwise_nbytes=int(elem + exp_elem),
        norm_numel=int(norm_numel),
        activation_numel=int(act_numel),
        ops=ops + exp_ops,
        activation_nbytes=int(act),
        experts=experts,
        dispatch_nbytes=int(dispatch),
        hidden=int(hidden),
        activation_full_nbytes=int(act),
    )
    if ac == "none" or label != "boundary":
        return work
    if ac == "full":  # the boundary keeps its input; its backward recomputes all of its forward
        return dataclasses.replace(work, activation_nbytes=int(tokens * hidden * itemsize), recompute=work)
    # selective (Note: the workload terms): input, attention output, half the matmul outputs, the all-to-all outputs
    saved = itemsize * (tokens * hidden + tokens * d_attn + out_numel // 2) + (2 * dispatch if ep_max > 1 else 0)
    rec = dataclasses.replace(
        work,
        matmuls=tuple((f // 2, d) for f, d in work.matmuls),
        attention_flops=0,
        attention_head_d=0.0,
        experts=None,
        dispatch_nbytes=0,
    )
    return dataclasses.replace(work, activation_nbytes=int(min(act, saved)), recompute=rec, recompute_all_to_all=False)


def model_top_k(model: Any, default: int = 2) -> int:
    """The experts per token of ``model``'s routing: the first integer ``top_k`` attribute of its
    modules (``dmuon._zoo``' MoE blocks, ``dmuon._train``'s :class:`~dmuon._train.byte_gpt.MoE`,
    transformers' ``top_k`` on most MoE blocks), else ``default``."""
    for module in model.modules():
        k = getattr(module, "top_k", None)
        if isinstance(k, int) and not isinstance(k, bool) and k > 0:
            return k
    return default


def from_plan(
    plan: Any,
    *,
    tokens_per_rank: int,
    seq_len: int,
    micro_batches: int = 1,
    activation_dtype: str = "torch.bfloat16",
    top_k: int = 2,
    causal: bool = True,
    head_dim: int | None = None,
    ac: str = "none",
) -> Workload:
    """The :class:`Workload` of ``plan``'s model (every term: Note: the workload terms, docs/design.md).

    Args:
        plan: a :class:`dmuon.plan.ShardingPlan` (its dedicated params and FSDP2 units).
        tokens_per_rank: tokens per rank per step (each TP rank of a group sees the same tokens;
            with TP, shapes are one TP rank's shards, so FLOPs are per TP rank).
        seq_len: sequence length (attention).
        micro_batches: gradient-accumulation micro-batches per step; terms are per micro-batch.
        activation_dtype: the compute dtype (activation bytes, elementwise bytes).
        top_k: experts each token visits in 3-D ``experts`` stacks.
        causal: causal attention (factor 1/2 on attention FLOPs).
        head_dim: attention head dimension (``attention_head_d``); None = ``min(128, d_attn)``
            (Llama-3's, Mistral's, Qwen's head size).
        ac: activation checkpointing of every boundary: ``"none"``, ``"full"`` or
            ``"selective"`` (Note: the workload terms); the step must recompute every boundary
            (``MicroBatch(recompute=...)``) for its cost to be replayed.

    Raises:
        ValueError: non-positive tokens, sequence length, micro-batches or head dimension, or an
            unknown ``ac``.
    """
    if ac not in AC_MODES:
        raise ValueError(f"from_plan: ac must be one of {AC_MODES}, got {ac!r}")
    if tokens_per_rank <= 0 or seq_len <= 0 or micro_batches <= 0 or (head_dim is not None and head_dim <= 0):
        raise ValueError("from_plan: tokens_per_rank, seq_len, micro_batches and head_dim must be positive")
    tokens = tokens_per_rank / micro_batches
    isz = itemsize_nbytes(activation_dtype)
    per_boundary: dict[str, list[tuple[str, tuple[int, ...], int]]] = {b.fqn: [] for b in plan.boundaries}
    ep = max((spec.ep_size for spec in plan.params), default=1)
    for spec in plan.params:
        per_boundary.setdefault(plan.boundary(spec.fqn), []).append((spec.fqn, tuple(spec.local_shape), spec.ep_size))
    root: list[tuple[str, tuple[int, ...], int]] = []
    for unit in plan.fsdp2_units:
        pairs = [(p, tuple(s), ep) for p, s in zip(unit.params, unit.shapes)]
        if unit.fqn == "":
            root.extend(pairs)
        else:
            per_boundary.setdefault(unit.fqn, []).extend(pairs)
    kw = dict(tokens=int(tokens), seq_len=seq_len, itemsize=isz, top_k=top_k, causal=causal, head_dim=head_dim)
    bounds = tuple((fqn, _unit_work(fqn, "boundary", ps, ac=ac, **kw)) for fqn, ps in per_boundary.items())
    embed = _unit_work("", "embed", [p for p in root if _is_embedding(p[0])], **kw)
    head_params = [p for p in root if not _is_embedding(p[0])]
    head = _unit_work("", "head", head_params, **kw)
    vocab = max((s[0] for n, s, _ in head_params if len(s) == 2), default=0)
    head = dataclasses.replace(
        head, elementwise_nbytes=head.elementwise_nbytes + _LOSS_PASSES * int(tokens) * vocab * 4, ops=head.ops + 6
    )
    return Workload(
        tokens_per_rank=tokens_per_rank,
        micro_batches=micro_batches,
        seq_len=seq_len,
        activation_dtype=activation_dtype,
        boundaries=bounds,
        embed=embed,
        head=head,
        activation_checkpointing=ac,
    )
