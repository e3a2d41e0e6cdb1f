"""A small GPT-style decoder used by ``python -m dmuon train`` and the tests.

Parameter names (what the planner and the hook-boundary heuristic see)::

    embed.weight                       (vocab_size, d_model)   nn.Embedding  -> AdamW
    pos_embed.weight                   (seq_len, d_model)      nn.Embedding  -> AdamW
    layers.{i}.attn_norm.weight        (d_model,)              RMSNorm       -> AdamW
    layers.{i}.attn.q_proj.weight      (d_model, d_model)      Linear        -> Muon (dedicated)
    layers.{i}.attn.k_proj.weight      (d_model, d_model)      Linear        -> Muon (dedicated)
    layers.{i}.attn.v_proj.weight      (d_model, d_model)      Linear        -> Muon (dedicated)
    layers.{i}.attn.o_proj.weight      (d_model, d_model)      Linear        -> Muon (dedicated)
    layers.{i}.mlp_norm.weight         (d_model,)              RMSNorm       -> AdamW
    layers.{i}.mlp.up_proj.weight      (d_mlp, d_model)        Linear        -> Muon (dedicated)
    layers.{i}.mlp.down_proj.weight    (d_model, d_mlp)        Linear        -> Muon (dedicated)
    norm.weight                        (d_model,)              RMSNorm       -> AdamW
    lm_head.weight                     (vocab_size, d_model)   Linear        -> AdamW (outside every block)

The "-> Muon" column is what dmuon's default predicate selects: every 2-D parameter inside a
hook boundary (``layers.{i}``) that is not an ``nn.Embedding`` weight. ``lm_head`` sits outside
the blocks, so it stays with FSDP2 + AdamW, as is usual for Muon.

Every linear layer has ``bias=False``; positions are learned (``pos_embed``), so the model holds
no buffers and builds on the ``meta`` device as well as on a real one.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "Attention", "MLP", "lm_loss", "per_head_views", "qk_clip_spec"]


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
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_mlp: int = 512
    seq_len: int = 64
    tie_embeddings: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_mlp", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )

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
        from dmuon.exec import qk_clip  # QK-clip layer of a live plan: report the per-head max logits

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


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

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
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.device(device or "cpu"):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_embed = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
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
        output projections ``o_proj`` / ``down_proj``, whose std is 0.02 / sqrt(2 · n_layers).
        Draws are made on the CPU with a generator seeded by ``seed`` and copied to the
        parameter's device, so the values do not depend on the device or the global RNG.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = 0.02
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():  # remove_duplicate=True: tied weight drawn once
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            s = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            draw = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, s, generator=gen)
            p.copy_(draw)

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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats/token.

    logits: (B, T, V) float; targets: (B, T) int64 -> scalar.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def per_head_views(cfg: GPTConfig) -> dict:
    """``matrix_views`` for :func:`dmuon.plan.compile`: q/k/v as ``n_heads`` row blocks, o_proj
    as ``n_heads`` column blocks (``python -m dmuon train --matrix-views per-head``)."""
    from dmuon.plan.views import heads

    return {"*.attn.[qkv]_proj.weight": heads(cfg.n_heads), "*.attn.o_proj.weight": heads(cfg.n_heads, dim=1)}


def qk_clip_spec(model: GPT, tau: float):
    """:class:`dmuon.plan.qk_clip.QKClip` of every block's attention (``--qk-clip TAU``)."""
    from dmuon.plan.qk_clip import attention_qk_clip

    cfg = model.cfg
    return attention_qk_clip(model, tau, suffix="attn", q="q_proj", k="k_proj", num_heads=cfg.n_heads, head_dim=cfg.head_dim)


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
    if cfg.n_heads % T or cfg.d_mlp % T:
        raise ValueError(f"tensor parallel degree {T} must divide n_heads={cfg.n_heads} and d_mlp={cfg.d_mlp}")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {k: styles[v]() for k, v in TP_BLOCK_PLAN.items()})
