"""Hugging Face fused-layout MoEs (Qwen3-MoE, DeepSeek-V3): ``model.layers.N.mlp.experts.gate_up_proj``
``(E, 2F, D)`` and ``down_proj`` ``(E, D, F)``, router ``model.layers.N.mlp.gate.weight`` ``(E, D)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmuon._zoo.llama import LlamaMLP


class HFFusedExperts(nn.Module):
    """``E`` SwiGLU experts in transformers' fused layout (Qwen3-MoE, Qwen2-MoE, Mixtral and
    DeepSeek-V3 in transformers 5.x): ``gate_up_proj`` ``(E, 2F, D)`` (gate rows ``[:F]``, up rows
    ``[F:]``), ``down_proj`` ``(E, D, F)``, each expert's slice in ``nn.Linear`` ``(out, in)``
    orientation. The module is named ``experts``, which is how dmuon recognises the stacks."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        for w in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(w, std=hidden**-0.5)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x (T, D)``, ``weights (T, E)`` (zero for unrouted experts) -> ``(T, D)``; dense."""
        gate, up = torch.einsum("td,efd->tef", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tef,edf->ted", F.silu(gate) * up, self.down_proj)
        return torch.einsum("ted,te->td", y, weights)


class HFSparseMoeBlock(nn.Module):
    """Router ``gate`` ``nn.Linear(D, E)`` (softmax, then top-k), ``experts``
    (:class:`HFFusedExperts`), and optionally ``shared_experts``, a dense SwiGLU MLP every token
    goes through (DeepSeek-V3's shared expert: ordinary 2-D matrices)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, shared_ffn: int = 0) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = HFFusedExperts(num_experts, hidden, ffn)
        self.shared_experts = LlamaMLP(hidden, shared_ffn) if shared_ffn else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.gate(flat).softmax(-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        y = self.experts(flat, torch.zeros_like(probs).scatter(-1, idx, top))
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(shape)


class GQAttention(nn.Module):
    """Grouped-query attention with an explicit head count (``q_proj`` ``(H·hd, D)``, ``k_proj`` /
    ``v_proj`` ``(H_kv·hd, D)``, ``o_proj`` ``(D, H·hd)``; Qwen3 has ``H·hd != D``) and Qwen3's
    per-head ``q_norm`` / ``k_norm``; no rotary embedding."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, -1, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention, *simplified*: the projections have the real
    shapes and names (``q_a_proj`` ``(q_lora, D)``, ``q_a_layernorm``, ``q_b_proj``
    ``(H·(nope+rope), q_lora)``, ``kv_a_proj_with_mqa`` ``(kv_lora+rope, D)``, ``kv_a_layernorm``,
    ``kv_b_proj`` ``(H·(nope+v), kv_lora)``, ``o_proj`` ``(D, H·v)``), but the forward has no
    rotary embedding: the shared rope key part is broadcast to every head as plain key features.
    Shapes (what planning reads) are exact; the arithmetic is not DeepSeek's."""

    def __init__(
        self, hidden: int, num_heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v_dim: int
    ) -> None:
        super().__init__()
        self.h, self.nope, self.rope, self.v_dim, self.kv_lora = num_heads, nope, rope, v_dim, kv_lora
        self.q_a_proj = nn.Linear(hidden, q_lora, bias=False)
        self.q_a_layernorm = nn.RMSNorm(q_lora, eps=1e-6)
        self.q_b_proj = nn.Linear(q_lora, num_heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora + rope, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(kv_lora, eps=1e-6)
        self.kv_b_proj = nn.Linear(kv_lora, num_heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.h, -1).transpose(1, 2)
        kv_a, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_a)).view(b, t, self.h, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(b, self.h, t, self.rope)], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class HFMoEDecoderLayer(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class HFMoEModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class HFMoEForCausalLM(nn.Module):
    """``model.{embed_tokens,layers.N,norm}`` + ``lm_head`` (untied); ``forward(tokens) -> logits``."""

    def __init__(self, vocab: int, hidden: int, layers: list[nn.Module]) -> None:
        super().__init__()
        self.model = HFMoEModel(vocab, hidden, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


def hf_moe(
    *,
    num_layers: int,
    hidden: int,
    num_experts: int,
    moe_ffn: int,
    top_k: int,
    vocab: int,
    num_heads: int,
    num_kv_heads: int = 0,
    head_dim: int = 128,
    mla: dict | None = None,
    first_dense: int = 0,
    dense_ffn: int = 0,
    shared_ffn: int = 0,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
) -> HFMoEForCausalLM:
    """Hugging Face-named MoE causal LM with fused expert stacks: per MoE layer
    ``model.layers.N.mlp.gate.weight`` ``(E, D)``, ``mlp.experts.gate_up_proj`` ``(E, 2F, D)``,
    ``mlp.experts.down_proj`` ``(E, D, F)`` (F = ``moe_ffn``), and with ``shared_ffn`` a dense
    ``mlp.shared_experts.{gate,up,down}_proj``; the first ``first_dense`` layers have a dense
    SwiGLU ``mlp`` of width ``dense_ffn``. Attention: grouped-query (:class:`GQAttention`) or,
    with ``mla={"q_lora", "kv_lora", "nope", "rope", "v_dim"}``, :class:`MLAttention`."""

    def attention() -> nn.Module:
        if mla is not None:
            return MLAttention(hidden, num_heads, **mla)
        return GQAttention(hidden, num_heads, num_kv_heads, head_dim)

    with torch.device(device):
        layers = [
            HFMoEDecoderLayer(
                attention(),
                LlamaMLP(hidden, dense_ffn)
                if i < first_dense
                else HFSparseMoeBlock(hidden, moe_ffn, num_experts, top_k, shared_ffn),
                hidden,
            )
            for i in range(num_layers)
        ]
        model = HFMoEForCausalLM(vocab, hidden, layers)
    return model.to(dtype) if dtype != torch.float32 else model


def qwen3_30b_a3b(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> HFMoEForCausalLM:
    """Qwen3-30B-A3B shapes: 48 layers, hidden 2048, 32 query / 4 key-value heads of 128 (q_proj
    ``(4096, 2048)``, k/v ``(512, 2048)``, o ``(2048, 4096)``), every layer an MoE of 128 experts of
    FFN 768 (top-8), vocab 151936, untied LM head; 30.5 B parameters."""
    return hf_moe(
        num_layers=48,
        hidden=2048,
        num_experts=128,
        moe_ffn=768,
        top_k=8,
        vocab=151936,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        device=device,
        dtype=dtype,
    )


def deepseek_v3(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> HFMoEForCausalLM:
    """DeepSeek-V3-like shapes: 61 layers, hidden 7168, vocab 129280; the first 3 layers dense
    (SwiGLU FFN 18432), the other 58 an MoE of 256 routed experts of FFN 2048 (top-8) plus one
    shared expert of FFN 2048 as a 2-D MLP (``mlp.shared_experts``); 671 B parameters.

    Simplified: multi-head latent attention (128 heads; q LoRA rank 1536, kv LoRA rank 512,
    head dims 128 nope + 64 rope, v 128) keeps the projection shapes and names of the real model
    (:class:`MLAttention`) but not its rotary arithmetic; the router has no
    ``e_score_correction_bias`` (a 1-D vector, AdamW either way), and there is no multi-token
    prediction layer. For planning, only the shapes matter."""
    return hf_moe(
        num_layers=61,
        hidden=7168,
        num_experts=256,
        moe_ffn=2048,
        top_k=8,
        vocab=129280,
        num_heads=128,
        mla=dict(q_lora=1536, kv_lora=512, nope=128, rope=64, v_dim=128),
        first_dense=3,
        dense_ffn=18432,
        shared_ffn=2048,
        device=device,
        dtype=dtype,
    )


def kimi_k2(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> HFMoEForCausalLM:
    """Kimi-K2-shaped (Moonshot's published configuration): 61 layers, hidden 7168, vocab 163840;
    the first layer dense (SwiGLU FFN 18432), the other 60 an MoE of 384 routed experts of FFN
    2048 (top-8) plus one shared expert of FFN 2048; multi-head latent attention with 64 heads
    (q LoRA rank 1536, kv LoRA rank 512, head dims 128 nope + 64 rope, v 128); about 1.04 T
    parameters. Simplified as :func:`deepseek_v3` (no rotary arithmetic, no router bias)."""
    return hf_moe(
        num_layers=61,
        hidden=7168,
        num_experts=384,
        moe_ffn=2048,
        top_k=8,
        vocab=163840,
        num_heads=64,
        mla=dict(q_lora=1536, kv_lora=512, nope=128, rope=64, v_dim=128),
        first_dense=1,
        dense_ffn=18432,
        shared_ffn=2048,
        device=device,
        dtype=dtype,
    )
