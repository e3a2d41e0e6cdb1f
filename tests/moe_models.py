"""Mixture-of-Experts test models: a torchtitan-style ``GroupedExperts`` block and
tiny Hugging Face Qwen3-MoE / gpt-oss built from configs (nothing is downloaded).

``GroupedLM``: token model, blocks at ``layers.N`` with a dense matrix (``attn``), a router
(``moe.router`` ``(E, D)``, top-k softmax over the chosen logits) and ``moe.experts``
(:class:`GroupedExperts`: ``w1`` / ``w3`` ``(E, F, D)``, ``w2`` ``(E, D, F)``, torchtitan's
``w1_EFD`` layout). A fixed (non-learned) buffer ``moe.blocked`` adds ``-1e4`` to the logit of the
LAST expert, so the last expert of every stack never gets a token: its gradient is zero in every
step (other experts' are not), and only weight decay moves it. Experts without a token on a rank
are skipped (no compute), as a grouped-GEMM implementation would.

All builders are module-level functions (pickled to the ranks by the distributed tests) and
seed nothing themselves: the caller seeds (``torch.manual_seed``) before building.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 13
BLOCKED = -1e4  # added to the last expert's router logit: it never wins a top-k slot


class GroupedExperts(nn.Module):
    """torchtitan ``GroupedExperts``: ``E`` SwiGLU experts as three 3-D stacks."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[-1]))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``(T, D)``, ``idx`` / ``weights`` ``(T, k)``: the chosen experts and their gates."""
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:  # no token for this expert here: no compute, no gradient
                continue
            h = x[tok]
            y = (F.silu(h @ self.w1[e].T) * (h @ self.w3[e].T)) @ self.w2[e].T
            out = out.index_add(0, tok, y * weights[tok, slot].unsqueeze(-1))
        return out


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        blocked = torch.zeros(num_experts)
        if num_experts > top_k:
            blocked[-1] = BLOCKED
        self.register_buffer("blocked", blocked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x) + self.blocked
        top, idx = logits.topk(self.top_k, dim=-1)
        return self.experts(x, idx, top.softmax(dim=-1)).reshape(shape)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim, bias=False)  # a dense matrix next to the stacks
        self.moe = MoE(dim, hidden, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + torch.tanh(self.attn(h))
        return x + self.moe(h)


class GroupedLM(nn.Module):
    def __init__(self, num_experts: int = 4, *, dim: int = 8, hidden: int = 6, n_layers: int = 2, top_k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(MoEBlock(dim, hidden, num_experts, top_k) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def grouped(num_experts: int = 4) -> GroupedLM:
    return GroupedLM(num_experts)


def grouped_one_layer(num_experts: int = 4) -> GroupedLM:
    return GroupedLM(num_experts, n_layers=1)


def grouped_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def grouped_batches(steps: int, rows: int = 12, seq: int = 6, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, seq), generator=g) for _ in range(steps)]


# ---------------------------------------------------------------------------- Hugging Face

HF_VOCAB = 32


def qwen3_moe(num_experts: int = 4, num_layers: int = 2):
    """Tiny Qwen3-MoE: fused ``gate_up_proj`` ``(E, 2F, D)`` (gate rows first), ``down_proj``
    ``(E, D, F)``, router ``mlp.gate`` ``(E, D)``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    c = Qwen3MoeConfig(
        vocab_size=HF_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=num_experts,
        num_experts_per_tok=2,
    )
    return Qwen3MoeForCausalLM(c).float()


def gpt_oss(num_experts: int = 4, num_layers: int = 2):
    """Tiny gpt-oss: ``gate_up_proj`` ``(E, D, 2F)`` stored (in, out), gate / up interleaved,
    ``down_proj`` ``(E, F, D)`` (in, out), biases ``(E, 2F)`` / ``(E, D)``. Its experts are
    initialised to zero by transformers' own init; drawn here so that the experts train."""
    from transformers import GptOssConfig, GptOssForCausalLM

    c = GptOssConfig(
        vocab_size=HF_VOCAB,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
    )
    model = GptOssForCausalLM(c).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0, 0.1)
    return model


def qwen2_moe():
    """Tiny Qwen2-MoE: a shared expert and its ``(1, D)`` ``shared_expert_gate``."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    c = Qwen2MoeConfig(
        vocab_size=HF_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return Qwen2MoeForCausalLM(c).float()


def deepseek_v3():
    """Tiny DeepSeek-V3: one dense layer, one MoE layer with shared experts and the
    ``e_score_correction_bias`` buffer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    c = DeepseekV3Config(
        vocab_size=HF_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_group=1,
        topk_group=1,
    )
    return DeepseekV3ForCausalLM(c).float()


def hf_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def hf_batches(steps: int, rows: int = 12, seq: int = 6, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, HF_VOCAB, (rows, seq), generator=g) for _ in range(steps)]
