"""A small GPT-style decoder used by ``python -m dmuon train`` and the tests.

Its parameter names and shapes (dense, MoE, expert-parallel) and which of them dmuon's default
predicate dedicates: Note: the main job's model (docs/design.md). Every linear layer has
``bias=False`` and positions are learned, so it builds on the ``meta`` device too.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "Attention",
    "MLP",
    "MoE",
    "GroupedExperts",
    "lm_loss",
    "per_head_views",
    "qk_clip_spec",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the decoder.

    Attributes:
        vocab_size: number of token ids (256 for the byte tokenizer).
        d_model: residual width.
        n_layers: number of transformer blocks (``layers.0`` .. ``layers.{n_layers-1}``).
        n_heads: attention heads; ``d_model % n_heads == 0``; head dim = d_model // n_heads.
        d_mlp: hidden width of the MLP.
        seq_len: maximum sequence length (rows of ``pos_embed``), in tokens.
        tie_embeddings: share ``lm_head.weight`` with ``embed.weight`` (default False).
        norm_eps: epsilon of the RMSNorms.
        n_experts: 0 (default) = dense MLP; ``E > 0`` = a Mixture-of-Experts MLP of ``E``
            SwiGLU experts of hidden width ``d_mlp`` in every block (:class:`MoE`).
        top_k: experts per token (token-choice routing), ``1 <= top_k <= n_experts``.
        ep: expert-parallel degree: each rank holds ``n_experts / ep`` experts of every stack
            (1 = every expert on every rank); ``ep > 1`` needs ``n_experts`` divisible by it.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_mlp: int = 512
    seq_len: int = 64
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    n_experts: int = 0
    top_k: int = 2
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_mlp", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.top_k <= self.n_experts):
            raise ValueError(
                f"GPTConfig: n_experts must be >= 0 and 1 <= top_k <= n_experts, got n_experts="
                f"{self.n_experts}, top_k={self.top_k}"
            )
        if self.ep < 1 or (self.ep > 1 and (not self.n_experts or self.n_experts % self.ep)):
            raise ValueError(
                f"GPTConfig: ep must be >= 1 and, when > 1, divide n_experts > 0; got ep={self.ep}, "
                f"n_experts={self.n_experts}"
            )
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/o projections (no bias)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        d = cfg.d_model
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d_model) -> (B, T, d_model)."""
        b, t, _ = x.shape
        # (B, T, H*Dh) -> (B, H, T, Dh); H = n_heads / TP degree under colwise tensor parallelism
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        from dmuon import qk_clip  # QK-clip layer of a live plan: report the per-head max logits

        if qk_clip.wants_logits(self):  # SDPA never materialises them: one extra QKᵀ pass
            qk_clip.record(self, qk_clip.max_logits_sdpa(q, k, is_causal=True))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """``down_proj(gelu(up_proj(x)))``, no bias."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.down_proj = nn.Linear(cfg.d_mlp, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d_model) -> (B, T, d_model)."""
        return self.down_proj(F.gelu(self.up_proj(x)))


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts as 3-D stacks in torchtitan's ``GroupedExperts`` layout, each expert's
    slice in ``nn.Linear`` ``(out, in)`` orientation: ``w1``, ``w3`` ``(E, d_mlp, d_model)``
    (gate and up), ``w2`` ``(E, d_model, d_mlp)`` (down). Expert ``e`` maps ``x`` to
    ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``.

    The forward loops over the experts with ``index_select`` / ``index_add`` (no grouped GEMM:
    fine on CPU and for this job's sizes); an expert that no token reached still gets a zero
    gradient slice, since the stack's gradient is one tensor.

    Under expert parallelism the stacks hold only the experts ``held``, a range of
    ``num_local_experts`` consecutive global ids (:func:`dmuon._train.moe_ep.expert_range`),
    and the block calls :meth:`grouped` on the rows the all-to-all brought. ``num_experts`` is
    always the global ``E`` (as torchtitan's; dmuon reads it to check the stacks' local shape).
    """

    def __init__(self, num_experts: int, d_model: int, d_mlp: int, *, held: range | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.held = range(num_experts) if held is None else held
        self.num_local_experts = len(self.held)
        self.w1 = nn.Parameter(torch.empty(self.num_local_experts, d_mlp, d_model))
        self.w3 = nn.Parameter(torch.empty(self.num_local_experts, d_mlp, d_model))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, d_model, d_mlp))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: (T, d_model); idx, weights: (T, K) routed experts and their weights -> (T, d_model).
        Every expert in the process (no expert parallelism)."""
        if self.num_local_experts != self.num_experts:
            raise RuntimeError("GroupedExperts.forward needs every expert; an EP rank's experts run in grouped()")
        out = torch.zeros_like(x)
        flat_idx = idx.reshape(-1)
        flat_w = weights.reshape(-1, 1).to(x.dtype)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(idx.shape[1])
        order = torch.argsort(flat_idx, stable=True)  # token slots grouped by expert
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            rows = token.index_select(0, slots)
            h = x.index_select(0, rows)
            h = F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())
            out = out.index_add(0, rows, (h @ self.w2[e].t()) * flat_w.index_select(0, slots))
        return out

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows grouped by local expert, ``counts[e]`` rows for local expert ``e`` -> each row
        through its expert's SwiGLU (unweighted), same shape."""
        outs = []
        for e, h in enumerate(x.split(counts)):
            if h.shape[0]:
                h = F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())
                h = h @ self.w2[e].t()
            outs.append(h)
        return torch.cat(outs) if outs else x


class MoE(nn.Module):
    """Token-choice top-k Mixture-of-Experts MLP: router ``gate`` ``nn.Linear(d_model, E)``, the
    softmax over all ``E`` router logits, then each token's ``top_k`` largest probabilities as
    its experts' weights (not renormalised), experts :class:`GroupedExperts`.

    After each forward, :attr:`aux_loss` holds the Switch-Transformer load-balancing loss of that
    forward, ``E · Σ_e f_e · P_e`` (``f_e``: fraction of the token slots routed to expert ``e``,
    ``P_e``: mean router probability of ``e``; 1.0 when the load is uniform), which the training
    loop adds to the LM loss times ``--aux-loss-coef`` so that experts stay used.

    With ``cfg.ep > 1`` the experts are this rank's ``E/ep`` (``ep_rank`` in the EP group
    ``ep_group``), and the forward sends the routed token slots to their experts' ranks and back
    (:func:`dmuon._train.moe_ep.dispatch_combine`); router, balance loss and load are
    computed on this rank's tokens exactly as without EP.
    """

    def __init__(self, cfg: GPTConfig, *, ep_group=None, ep_rank: int = 0) -> None:
        super().__init__()
        from dmuon._train.moe_ep import expert_range

        self.top_k = cfg.top_k
        self.num_experts = cfg.n_experts
        self.ep = cfg.ep
        self.ep_group = ep_group
        held = expert_range(cfg.n_experts, cfg.ep, ep_rank)
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, cfg.d_mlp, held=held)
        self.aux_loss: torch.Tensor | None = None
        self.expert_load: torch.Tensor | None = None  # (E,) token slots per expert, last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d_model) -> (B, T, d_model)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.gate(flat).float().softmax(-1)  # (T, E)
        weights, idx = probs.topk(self.top_k, dim=-1)  # (T, K)
        load = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
        frac = load.to(probs.dtype) / idx.numel()
        self.aux_loss = self.num_experts * (frac * probs.mean(0)).sum()
        self.expert_load = load.detach()
        if self.ep == 1:
            return self.experts(flat, idx, weights).view(shape)
        if self.ep_group is None:
            raise RuntimeError(f"MoE with ep={self.ep} needs its EP process group (GPT(..., ep_group=...))")
        from dmuon._train.moe_ep import dispatch_combine

        out = dispatch_combine(flat, idx, weights, self.experts, num_experts=self.num_experts, group=self.ep_group)
        return out.view(shape)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (``mlp`` an
    :class:`MLP`, or an :class:`MoE` when ``cfg.n_experts > 0``)."""

    def __init__(self, cfg: GPTConfig, *, ep_group=None, ep_rank: int = 0) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MoE(cfg, ep_group=ep_group, ep_rank=ep_rank) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d_model) -> (B, T, d_model)."""
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model over ``cfg.vocab_size`` token ids.

    Args:
        cfg: the shape.
        seed: initialisation seed. The same (cfg, seed) gives bit-identical parameters on every
            rank and every machine (the draws come from a private CPU ``torch.Generator``, in
            ``named_parameters()`` order, independent of the global RNG).
        device: where to allocate. ``"meta"`` skips initialisation (for planning only).
        ep_group: with ``cfg.ep > 1``, the EP process group of ``cfg.ep`` ranks the MoE blocks
            dispatch over (:func:`dmuon._train.moe_ep.new_ep_group`); this rank's index
            in it picks its experts. None (planning, or ``ep = 1``): ``ep_rank``.
        ep_rank: the rank's index in its EP group when ``ep_group`` is None.

    With ``cfg.ep > 1`` the parameters are the ``ep = 1`` model's, each expert stack cut to the
    rank's experts: the same ``(cfg, seed)`` gives every rank its slice of the same full init,
    so the EP model computes what the ``ep = 1`` model computes.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        ep_group=None,
        ep_rank: int = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        if ep_group is not None:
            import torch.distributed as dist

            if dist.get_world_size(ep_group) != cfg.ep:
                raise ValueError(f"ep_group has {dist.get_world_size(ep_group)} ranks, cfg.ep = {cfg.ep}")
            ep_rank = dist.get_rank(ep_group)
        with torch.device(device or "cpu"):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_embed = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.layers = nn.ModuleList(Block(cfg, ep_group=ep_group, ep_rank=ep_rank) for _ in range(cfg.n_layers))
            self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if torch.device(device or "cpu").type != "meta":
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init (GPT-2 style).

        Norm weights = 1; embeddings and linear weights ~ N(0, 0.02²), except the residual
        output projections ``o_proj`` / ``down_proj`` / ``experts.w2``, whose std is
        0.02 / sqrt(2 · n_layers).
        Draws are made on the CPU with a generator seeded by ``seed`` and copied to the
        parameter's device, so the values do not depend on the device or the global RNG.
        Under expert parallelism each expert stack is drawn at its full ``(E, ...)`` shape and the
        rank keeps its experts' slice, so every draw is the ``ep = 1`` model's.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = 0.02
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        held = {}  # id(expert stack) -> the global experts this rank holds
        for module in self.modules():
            if isinstance(module, GroupedExperts):
                for p in (module.w1, module.w2, module.w3):
                    held[id(p)] = slice(module.held.start, module.held.stop)
        for name, p in self.named_parameters():  # remove_duplicate=True: tied weight drawn once
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            s = resid_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")) else std
            cut = held.get(id(p))
            shape = p.shape if cut is None else (self.cfg.n_experts, *p.shape[1:])
            draw = torch.empty(shape, dtype=torch.float32).normal_(0.0, s, generator=gen)
            p.copy_(draw if cut is None else draw[cut])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) int64 ids with T <= seq_len -> logits (B, T, vocab_size), float."""
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.embed(tokens) + self.pos_embed(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def aux_loss(self) -> torch.Tensor | None:
        """Mean over blocks of the MoE load-balancing losses of the last forward
        (:attr:`MoE.aux_loss`); None for the dense model."""
        losses = [layer.mlp.aux_loss for layer in self.layers if isinstance(layer.mlp, MoE)]
        if not losses or any(loss is None for loss in losses):
            return None
        return torch.stack(losses).mean()

    def expert_load(self) -> torch.Tensor | None:
        """(n_layers, E) token slots routed to each expert in the last forward (this rank's
        tokens); None for the dense model."""
        loads = [layer.mlp.expert_load for layer in self.layers if isinstance(layer.mlp, MoE)]
        if not loads or any(load is None for load in loads):
            return None
        return torch.stack(loads)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats/token.

    logits: (B, T, V) float; targets: (B, T) int64 -> scalar.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def per_head_views(cfg: GPTConfig) -> dict:
    """``matrix_views`` for :func:`dmuon.plan.compile`: q/k/v as ``n_heads`` row blocks, o_proj
    as ``n_heads`` column blocks (``python -m dmuon train --matrix-views per-head``)."""
    from dmuon.plan import views

    return {
        "*.attn.[qkv]_proj.weight": views.heads(cfg.n_heads),
        "*.attn.o_proj.weight": views.heads(cfg.n_heads, dim=1),
    }


def qk_clip_spec(model: GPT, tau: float):
    """:class:`dmuon.plan._records.qk_clip_records.QKClip` of every block's attention (``--qk-clip TAU``)."""
    from dmuon.plan import qk_clip as plan_qk_clip

    cfg = model.cfg
    return plan_qk_clip.attention_qk_clip(
        model, tau, suffix="attn", q="q_proj", k="k_proj", num_heads=cfg.n_heads, head_dim=cfg.head_dim
    )


#: ``parallelize_module`` plan of one :class:`Block` (Megatron-style): q/k/v and up colwise
#: (``Shard(0)`` weights, heads split over the TP ranks), o and down rowwise (``Shard(1)``).
TP_BLOCK_PLAN = {
    "attn.q_proj": "colwise",
    "attn.k_proj": "colwise",
    "attn.v_proj": "colwise",
    "attn.o_proj": "rowwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def apply_tensor_parallel(model: GPT, tp_mesh) -> None:
    """Tensor-parallelise every block of ``model`` over the 1-D ``tp_mesh`` in place
    (:data:`TP_BLOCK_PLAN`; embeddings, norms and ``lm_head`` stay replicated).

    Call it before ``dmuon.dedicate_params`` and ``fully_shard`` (the order of calls of
    docs/tensor_parallel.md: TP first, then dmuon and FSDP2 on the data-parallel mesh).

    Raises:
        ValueError: ``n_heads`` or ``d_mlp`` not divisible by the TP degree.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    T = tp_mesh.size()
    cfg = model.cfg
    if cfg.n_experts:
        raise ValueError("tensor parallelism of the MoE model is not supported (--experts with --tp)")
    if cfg.n_heads % T or cfg.d_mlp % T:
        raise ValueError(f"tensor parallel degree {T} must divide n_heads={cfg.n_heads} and d_mlp={cfg.d_mlp}")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {k: styles[v]() for k, v in TP_BLOCK_PLAN.items()})
