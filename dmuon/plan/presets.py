"""Shape-faithful model builders for planning (meta device by default).

Every builder constructs under ``with torch.device(device)``, so on ``"meta"`` (the default)
nothing is allocated and even the 405B shape builds in well under a second. The modules have
working ``forward`` methods (simplified: no rotary embeddings, dense MoE routing), so small
configurations on CPU also serve as test models. Parameter names follow Hugging Face Llama
(``model.layers.N.self_attn.q_proj.weight``), timm ViT (``blocks.N.attn.qkv.weight``) and a
Mixtral-like MoE with stacked 3-D expert weights (``layers.N.mlp.experts.w1`` of shape
``(E, m, n)``, torchtitan layout) and Hugging Face fused-layout MoEs (Qwen3-MoE, DeepSeek-V3:
``model.layers.N.mlp.experts.gate_up_proj`` ``(E, 2F, D)`` and ``down_proj`` ``(E, D, F)``,
router ``model.layers.N.mlp.gate.weight`` ``(E, D)``).

:data:`PRESETS` maps a CLI name to a zero-argument builder (meta device, float32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRESETS",
    "llama",
    "llama3_8b",
    "llama3_70b",
    "llama3_405b",
    "tiny_llama",
    "vit",
    "vit_b16",
    "moe",
    "mixtral_8x7b",
    "tiny_moe",
    "hf_moe",
    "qwen3_30b_a3b",
    "deepseek_v3",
    "megatron_tp_shard_dims",
    "expert_parallel_variant",
    "TP_COLWISE",
    "TP_ROWWISE",
]


# --------------------------------------------------------------------------- Llama


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


# --------------------------------------------------------------------------- ViT (timm naming)


class ViTAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class ViTMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = ViTAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ViTMlp(dim, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, in_chans: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    """timm-named ViT; ``forward(images (B, C, H, W)) -> logits (B, num_classes)``."""

    def __init__(self, *, img_size: int, patch: int, dim: int, depth: int, num_heads: int, mlp_hidden: int, num_classes: int) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(patch, 3, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (img_size // patch) ** 2 + 1, dim))
        self.blocks = nn.ModuleList(ViTBlock(dim, num_heads, mlp_hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def vit(
    *,
    img_size: int = 224,
    patch: int = 16,
    dim: int = 768,
    depth: int = 12,
    num_heads: int = 12,
    mlp_hidden: int = 3072,
    num_classes: int = 1000,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
) -> VisionTransformer:
    """ViT with timm names: ``patch_embed.proj`` (Conv2d), ``blocks.N.attn.qkv`` ``(3*dim, dim)``,
    ``blocks.N.attn.proj``, ``blocks.N.mlp.fc1`` ``(mlp_hidden, dim)``, ``blocks.N.mlp.fc2``, ``head``."""
    with torch.device(device):
        model = VisionTransformer(
            img_size=img_size,
            patch=patch,
            dim=dim,
            depth=depth,
            num_heads=num_heads,
            mlp_hidden=mlp_hidden,
            num_classes=num_classes,
        )
    return model.to(dtype) if dtype != torch.float32 else model


def vit_b16(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> VisionTransformer:
    """ViT-B/16: 12 blocks, dim 768, 12 heads, MLP 3072, 224x224 images, 1000 classes."""
    return vit(device=device, dtype=dtype)


# --------------------------------------------------------------------------- MoE


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

    def __init__(self, *, vocab: int, hidden: int, kv_dim: int, ffn: int, num_layers: int, num_experts: int, top_k: int, head_dim: int) -> None:
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
    (select them with a predicate such as :func:`dmuon.plan.selection.matrix_predicate`; the
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
    return moe(num_layers=2, hidden=32, kv_dim=16, ffn=48, num_experts=4, vocab=64, head_dim=8, device=device, dtype=dtype)


# --------------------------------------------------------------------------- HF fused-layout MoE


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

    def __init__(self, hidden: int, num_heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v_dim: int) -> None:
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
                LlamaMLP(hidden, dense_ffn) if i < first_dense else HFSparseMoeBlock(hidden, moe_ffn, num_experts, top_k, shared_ffn),
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
    return hf_moe(num_layers=48, hidden=2048, num_experts=128, moe_ffn=768, top_k=8, vocab=151936,
                  num_heads=32, num_kv_heads=4, head_dim=128, device=device, dtype=dtype)


def deepseek_v3(device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> HFMoEForCausalLM:
    """DeepSeek-V3-like shapes: 61 layers, hidden 7168, vocab 129280; the first 3 layers dense
    (SwiGLU FFN 18432), the other 58 an MoE of 256 routed experts of FFN 2048 (top-8) plus one
    shared expert of FFN 2048 as a 2-D MLP (``mlp.shared_experts``); 671 B parameters.

    Simplified: multi-head latent attention (128 heads; q LoRA rank 1536, kv LoRA rank 512,
    head dims 128 nope + 64 rope, v 128) keeps the projection shapes and names of the real model
    (:class:`MLAttention`) but not its rotary arithmetic; the router has no
    ``e_score_correction_bias`` (a 1-D vector, AdamW either way), and there is no multi-token
    prediction layer. For planning, only the shapes matter."""
    return hf_moe(num_layers=61, hidden=7168, num_experts=256, moe_ffn=2048, top_k=8, vocab=129280,
                  num_heads=128, mla=dict(q_lora=1536, kv_lora=512, nope=128, rope=64, v_dim=128),
                  first_dense=3, dense_ffn=18432, shared_ffn=2048, device=device, dtype=dtype)


#: CLI name -> zero-argument builder (meta device, float32)
#: Linear layers a Megatron-style TP plan splits by output features (``ColwiseParallel``:
#: weight ``Shard(0)``) and by input features (``RowwiseParallel``: ``Shard(1)``).
TP_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv", "fc1")
TP_ROWWISE = ("o_proj", "down_proj", "proj", "fc2")


def megatron_tp_shard_dims(model: nn.Module) -> dict[str, int]:
    """``{fqn: dim}`` of every 2-D ``nn.Linear`` weight a Megatron-style TP plan shards: 0 for
    :data:`TP_COLWISE` module names, 1 for :data:`TP_ROWWISE`; for ``dmuon.plan.compile(...,
    tp_size=T, tp_shard_dims=...)`` on a model that is not parallelised (e.g. a preset on the
    meta device). Embeddings, heads, norms and 3-D expert stacks are left out."""
    out: dict[str, int] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            leaf = name.rpartition(".")[2]
            if leaf in TP_COLWISE:
                out[f"{name}.weight"] = 0
            elif leaf in TP_ROWWISE:
                out[f"{name}.weight"] = 1
    return out


def expert_parallel_variant(model: nn.Module, ep: int) -> nn.Module:
    """``model`` (in place) as one rank of expert parallelism ``ep`` holds it: every 3-D
    parameter under a module path containing ``experts`` (the stacks of the presets) cut to
    ``E/ep`` experts, on the meta device; routers and everything else unchanged. For
    ``dmuon.plan.compile(model, mesh, ep=ep)`` on a preset (``python -m dmuon plan --ep``).

    Raises:
        ValueError: ``ep < 1``, no expert stack, or ``ep`` not dividing a stack's experts.
    """
    if ep < 1:
        raise ValueError(f"expert_parallel_variant: ep must be >= 1, got {ep}")
    found = False
    for mod_name, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.ndim != 3 or "experts" not in mod_name:
                continue
            if p.shape[0] % ep:
                raise ValueError(f"expert_parallel_variant: ep={ep} does not divide the {p.shape[0]} experts of "
                                 f"{mod_name}.{name}")
            found = True
            mod._parameters[name] = nn.Parameter(
                torch.empty((p.shape[0] // ep, *p.shape[1:]), dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
            )
    if not found:
        raise ValueError("expert_parallel_variant: the model has no expert stack (a 3-D parameter under 'experts')")
    return model


PRESETS: dict[str, Callable[[], nn.Module]] = {
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "llama3-405b": llama3_405b,
    "tiny-llama": tiny_llama,
    "vit-b16": vit_b16,
    "moe": mixtral_8x7b,
    "tiny-moe": tiny_moe,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "deepseek-v3": deepseek_v3,
}
