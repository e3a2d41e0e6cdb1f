"""Small attention models for the matrix-view and QK-clip tests (tests/exec/test_muon_variants.py).

``AttnLM(kind)``: token embedding, ``layers.N`` blocks (attention + MLP), head. Attention kinds:

* ``"gqa"``: separate ``q_proj`` (H·d_h, D), ``k_proj`` / ``v_proj`` (H_kv·d_h, D) with q / k
  biases (Qwen2-like; the k bias frozen: its gradient is zero in exact arithmetic, so AdamW
  would only amplify rounding noise), ``o_proj`` (D, H·d_h); H = 4, H_kv = 2, d_h = 4, D = 16;
* ``"mha"``: the same with H_kv = H = 4, no biases (Llama-like MHA);
* ``"fused"``: GPT-2 style ``c_attn`` Conv1D weight (D, 3·D) with bias, ``x @ W + b`` (the k
  third of the bias detached, so its gradient is exactly 0 instead of rounding noise), then
  ``c_proj`` (D, D) Conv1D; H = 4.

Each attention layer computes its logits eagerly and reports their per-head max through
``self.report`` (``dmuon.qk_clip.record`` by default; the single-process reference swaps in a
recorder of its own).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

D, H, D_H = 16, 4, 4


class Conv1D(nn.Module):
    """GPT-2's Conv1D: weight (in, out), ``x @ W + b``."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.3)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return x @ self.weight + self.bias


def _report(module, max_logits):
    import dmuon

    dmuon.qk_clip.record(module, max_logits)


class Attention(nn.Module):
    def __init__(self, kind: str, gain: float):
        super().__init__()
        self.kind = kind
        self.h_kv = 2 if kind == "gqa" else H
        if kind == "fused":
            self.c_attn = Conv1D(D, 3 * D)
            self.c_proj = Conv1D(D, D)
        else:
            bias = kind == "gqa"
            self.q_proj = nn.Linear(D, H * D_H, bias=bias)
            self.k_proj = nn.Linear(D, self.h_kv * D_H, bias=bias)
            self.v_proj = nn.Linear(D, self.h_kv * D_H, bias=False)
            self.o_proj = nn.Linear(H * D_H, D, bias=False)
            if bias:  # a k bias gets no gradient (softmax is shift-invariant per query): frozen, or AdamW
                self.k_proj.bias.requires_grad_(False)  # would amplify rounding noise; QK-clip still rescales it
        with torch.no_grad():  # large logits, different per head: some heads above tau, some below
            for i, p in enumerate(self.qk_weights()):
                p.mul_(gain)
        self.report = _report

    def qk_weights(self):
        return [self.c_attn.weight] if self.kind == "fused" else [self.q_proj.weight, self.k_proj.weight]

    def forward(self, x):
        b, t, _ = x.shape
        if self.kind == "fused":  # the k bias detached: its gradient is exactly 0 (see the module docstring)
            b_ = self.c_attn.bias
            q, k, v = (x @ self.c_attn.weight + torch.cat([b_[:D], b_[D : 2 * D].detach(), b_[2 * D :]])).split(
                D, dim=-1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, H, D_H).transpose(1, 2)
        k = k.view(b, t, self.h_kv, D_H).transpose(1, 2).repeat_interleave(H // self.h_kv, dim=1)
        v = v.view(b, t, self.h_kv, D_H).transpose(1, 2).repeat_interleave(H // self.h_kv, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D_H)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        from dmuon.exec._optim.qk_clip import max_logits_eager

        self.report(self, max_logits_eager(scores, mask))
        y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        y = y.transpose(1, 2).reshape(b, t, H * D_H)
        return self.c_proj(y) if self.kind == "fused" else self.o_proj(y)


class AttnBlock(nn.Module):
    def __init__(self, kind: str, gain: float):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = Attention(kind, gain)
        self.fc = nn.Linear(D, D, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.fc(F.gelu(x))


class AttnLM(nn.Module):
    def __init__(self, kind: str = "gqa", *, vocab: int = 7, n_layers: int = 2, gain: float = 1.0, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.layers = nn.ModuleList(AttnBlock(kind, gain * (1 + i)) for i in range(n_layers))
        self.head = nn.Linear(D, vocab)
        with torch.no_grad():
            self.embed.weight.mul_(2.0)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def apply_clip_reference(params, qk, maxes) -> int:
    """QK-clip's rule, head by head, on a single-process model's ``params`` (FQN -> parameter), with
    ``maxes`` the step's max logits per attention module (FQN -> ``(H,)``); written independently of
    ``dmuon.exec._optim.qk_clip``. Returns the number of clipped heads."""
    clipped = 0
    for a in qk.attention:
        S = maxes[a.module]
        for h in range(a.q.num_heads):
            s = float(S[h])
            if s <= qk.tau:
                continue
            clipped += 1
            targets = (
                [(a.q, h, qk.tau / s)] if a.gqa else [(a.q, h, math.sqrt(qk.tau / s)), (a.k, h, math.sqrt(qk.tau / s))]
            )
            for rows, head, f in targets:
                lo = rows.offset + head * rows.head_dim
                params[rows.fqn].data.narrow(rows.dim, lo, rows.head_dim).mul_(f)
                if rows.bias is not None:
                    params[rows.bias].data[lo : lo + rows.head_dim].mul_(f)
    return clipped
