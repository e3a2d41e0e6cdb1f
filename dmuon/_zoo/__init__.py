"""Shape-faithful model builders for planning (meta device by default).

:data:`PRESETS` maps a CLI name to a zero-argument builder (meta device, float32). The models,
their parameter names and who imports the zoo: Note: the model zoo (docs/design.md).
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
