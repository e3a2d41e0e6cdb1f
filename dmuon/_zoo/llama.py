"""Llama-3 shapes with Hugging Face names (``model.layers.N.self_attn.q_proj.weight``); simplified
forward (no rotary embeddings)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LlamaAttention(nn.Module):
    """Grouped-query attention; q/o are (hidden, hidden), k/v are (kv_dim, hidden)."""

    def __init__(self, hidden: int, kv_dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(b, t, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden: int, kv_dim: int, intermediate: int, head_dim: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden, kv_dim, head_dim)
        self.mlp = LlamaMLP(hidden, intermediate)
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, kv_dim: int, intermediate: int, num_layers: int, head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hidden, kv_dim, intermediate, head_dim) for _ in range(num_layers)
        )
        self.norm = nn.RMSNorm(hidden, eps=1e-5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``model.*`` + ``lm_head``; ``forward(tokens (B, T) int64) -> logits (B, T, vocab)``."""

    def __init__(
        self,
        *,
        vocab: int,
        hidden: int,
        kv_dim: int,
        intermediate: int,
        num_layers: int,
        head_dim: int,
        tie_embeddings: bool,
    ) -> None:
        super().__init__()
        self.model = LlamaModel(vocab, hidden, kv_dim, intermediate, num_layers, head_dim)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


def llama(
    *,
    num_layers: int,
    hidden: int,
    kv_dim: int,
    intermediate: int,
    vocab: int = 128256,
    head_dim: int = 128,
    tie_embeddings: bool = False,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """Llama-shaped causal LM. Per layer: q, o ``(hidden, hidden)``; k, v ``(kv_dim, hidden)``;
    gate, up ``(intermediate, hidden)``; down ``(hidden, intermediate)``; two RMSNorm weights.
    Plus ``model.embed_tokens`` ``(vocab, hidden)``, ``model.norm``, ``lm_head`` ``(vocab, hidden)``.
    """
    if hidden % head_dim or kv_dim % head_dim or (hidden // head_dim) % (kv_dim // head_dim):
        raise ValueError(f"hidden {hidden} and kv_dim {kv_dim} must be multiples of head_dim {head_dim} (GQA)")
    with torch.device(device):
        model = LlamaForCausalLM(
            vocab=vocab,
            hidden=hidden,
            kv_dim=kv_dim,
            intermediate=intermediate,
            num_layers=num_layers,
            head_dim=head_dim,
            tie_embeddings=tie_embeddings,
        )
    return model.to(dtype) if dtype != torch.float32 else model


def llama3_8b(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Llama-3-8B shapes: 32 layers, hidden 4096, kv 1024, MLP 14336, vocab 128256."""
    return llama(num_layers=32, hidden=4096, kv_dim=1024, intermediate=14336, device=device, dtype=dtype)


def llama3_70b(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Llama-3-70B shapes: 80 layers, hidden 8192, kv 1024, MLP 28672, vocab 128256."""
    return llama(num_layers=80, hidden=8192, kv_dim=1024, intermediate=28672, device=device, dtype=dtype)


def llama3_405b(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Llama-3.1-405B shapes: 126 layers, hidden 16384, kv 1024, MLP 53248, vocab 128256."""
    return llama(num_layers=126, hidden=16384, kv_dim=1024, intermediate=53248, device=device, dtype=dtype)


def tiny_llama(
    device: torch.device | str = "meta", dtype: torch.dtype = torch.float32, *, tie_embeddings: bool = False
) -> LlamaForCausalLM:
    """4 layers, hidden 64, kv 32, MLP 160, vocab 256, head_dim 16 (runs on CPU in milliseconds)."""
    return llama(
        num_layers=4,
        hidden=64,
        kv_dim=32,
        intermediate=160,
        vocab=256,
        head_dim=16,
        tie_embeddings=tie_embeddings,
        device=device,
        dtype=dtype,
    )
