"""Vision Transformer shapes with timm names (``blocks.N.attn.qkv.weight``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def __init__(
        self, *, img_size: int, patch: int, dim: int, depth: int, num_heads: int, mlp_hidden: int, num_classes: int
    ) -> None:
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
