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
Modules: ``llama`` (Llama-3), ``vit`` (ViT-B/16), ``moe`` (Mixtral-like, torchtitan stacks),
``hf_moe`` (Qwen3-MoE, DeepSeek-V3, Kimi-K2 in transformers' fused layout). The zoo is for planning,
simulation and tests; the planner never imports it (``python -m dmuon plan`` and ``simulate`` do).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dmuon._zoo.hf_moe import deepseek_v3, hf_moe, kimi_k2, qwen3_30b_a3b
from dmuon._zoo.llama import llama, llama3_8b, llama3_70b, llama3_405b, tiny_llama
from dmuon._zoo.moe import mixtral_8x7b, moe, tiny_moe
from dmuon._zoo.vit import vit, vit_b16

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
    "kimi_k2",
]

#: CLI name -> zero-argument builder (meta device, float32)
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
    "kimi-k2": kimi_k2,
}
