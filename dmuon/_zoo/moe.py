"""A Mixtral-like MoE with stacked 3-D expert weights in torchtitan's layout
(``layers.N.mlp.experts.w1`` of shape ``(E, m, n)``); dense routing in ``forward``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmuon._zoo.llama import LlamaAttention


class Experts(nn.Module):
    """``E`` SwiGLU experts as stacked 3-D weights: ``w1, w3: (E, ffn, hidden)``, ``w2: (E, hidden, ffn)``."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=hidden**-0.5)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)``, ``weights (T, E)`` (zero for unrouted experts) -> ``(T, hidden)``; dense."""
        h = F.silu(torch.einsum("td,efd->tef", x, self.w1)) * torch.einsum("td,efd->tef", x, self.w3)
        y = torch.einsum("tef,edf->ted", h, self.w2)
        return torch.einsum("ted,te->td", y, weights)


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        top, idx = logits.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(logits).scatter(-1, idx, top.softmax(-1))
        return self.experts(flat, weights).view(shape)


class MoELayer(nn.Module):
    def __init__(self, hidden: int, kv_dim: int, ffn: int, num_experts: int, top_k: int, head_dim: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden, kv_dim, head_dim)
        self.mlp = MoEBlock(hidden, ffn, num_experts, top_k)
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MoETransformer(nn.Module):
    """``embed``, ``layers.N.{self_attn,mlp.gate,mlp.experts}``, ``norm``, ``lm_head``."""

    def __init__(
        self,
        *,
        vocab: int,
        hidden: int,
        kv_dim: int,
        ffn: int,
        num_layers: int,
        num_experts: int,
        top_k: int,
        head_dim: int,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            MoELayer(hidden, kv_dim, ffn, num_experts, top_k, head_dim) for _ in range(num_layers)
        )
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def moe(
    *,
    num_layers: int,
    hidden: int,
    kv_dim: int,
    ffn: int,
    num_experts: int,
    top_k: int = 2,
    vocab: int = 32000,
    head_dim: int = 128,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
) -> MoETransformer:
    """MoE transformer with 3-D expert stacks ``layers.N.mlp.experts.w{1,2,3}`` ``(E, m, n)``
    (select them with a predicate such as :func:`dmuon.plan._model.selection.matrix_predicate`; the
    default rule takes 2-D parameters only)."""
    with torch.device(device):
        model = MoETransformer(
            vocab=vocab,
            hidden=hidden,
            kv_dim=kv_dim,
            ffn=ffn,
            num_layers=num_layers,
            num_experts=num_experts,
            top_k=top_k,
            head_dim=head_dim,
        )
    return model.to(dtype) if dtype != torch.float32 else model


def mixtral_8x7b(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> MoETransformer:
    """Mixtral-8x7B shapes: 32 layers, hidden 4096, kv 1024, 8 experts of FFN 14336, vocab 32000."""
    return moe(num_layers=32, hidden=4096, kv_dim=1024, ffn=14336, num_experts=8, device=device, dtype=dtype)


def tiny_moe(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> MoETransformer:
    """2 layers, hidden 32, kv 16, 4 experts of FFN 48, vocab 64, head_dim 8."""
    return moe(
        num_layers=2, hidden=32, kv_dim=16, ffn=48, num_experts=4, vocab=64, head_dim=8, device=device, dtype=dtype
    )
