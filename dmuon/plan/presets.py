"""Shape-faithful model builders for planning (meta device by default).

Every builder constructs under ``with torch.device(device)``, so on ``"meta"`` (the default)
nothing is allocated and even the 405B shape builds in well under a second. The modules have
working ``forward`` methods (simplified: no rotary embeddings, dense MoE routing), so small
configurations on CPU also serve as test models. Parameter names follow Hugging Face Llama
(``model.layers.N.self_attn.q_proj.weight``), timm ViT (``blocks.N.attn.qkv.weight``) and a
Mixtral-like MoE with stacked 3-D expert weights (``layers.N.mlp.experts.w1`` of shape
``(E, m, n)``).

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
    "megatron_tp_shard_dims",
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


PRESETS: dict[str, Callable[[], nn.Module]] = {
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "llama3-405b": llama3_405b,
    "tiny-llama": tiny_llama,
    "vit-b16": vit_b16,
    "moe": mixtral_8x7b,
    "tiny-moe": tiny_moe,
}
