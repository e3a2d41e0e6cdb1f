"""A small torchtitan-style MoE LM for the expert-parallel tests (tests/exec/test_moe_ep.py).

``MoELM(ep=1)``: every expert in the process (the single-process reference). ``MoELM(ep=k)``
with a process group: each rank's ``GroupedExperts`` holds its ``E/k`` consecutive experts
(``w1``/``w3`` ``(E/k, F, D)``, ``w2`` ``(E/k, D, F)``, plain parameters) and the MoE block
sends every routed token to the rank holding its expert and back with
``torch.distributed.nn.functional.all_to_all_single`` (autograd-aware; uneven splits).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, FF, E, TOP_K, LAYERS, HEADS = 48, 16, 24, 8, 2, 2, 2


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim**0.5)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The constructor's draws again (``randn`` is ``normal_`` on an empty tensor), for
        ``dmuon.init_params`` after ``to_empty``: with the stacks full size there (E experts),
        the same values as ``MoELM(ep=1)`` built with the same seed."""
        for w in (self.w1, self.w2, self.w3):
            w.normal_().div_(w.shape[2] ** 0.5)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: tokens grouped by expert (``counts[e]`` rows for local expert ``e``)."""
        outs = []
        for e, chunk in enumerate(x.split(counts)):
            h = F.silu(chunk @ self.w1[e].T) * (chunk @ self.w3[e].T)
            outs.append(h @ self.w2[e].T)
        return torch.cat(outs) if outs else x[:0]


class MoE(nn.Module):
    def __init__(self, ep: int = 1, group=None):
        super().__init__()
        self.ep = ep
        self.group = group  # the EP process group (None: the world)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = GroupedExperts(E // ep, D, FF)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, D)
        n = tokens.shape[0]
        scores = torch.softmax(self.router(tokens), dim=-1)
        top_v, top_i = scores.topk(TOP_K, dim=-1)  # (n, k)
        flat_e = top_i.reshape(-1)
        flat_tok = torch.arange(n).repeat_interleave(TOP_K)
        order = torch.argsort(flat_e, stable=True)
        x_sorted = tokens[flat_tok[order]]
        counts = torch.bincount(flat_e, minlength=E)
        if self.ep == 1:
            y_sorted = self.experts(x_sorted, counts.tolist())
        else:
            y_sorted = self._dispatch(x_sorted, counts)
        y = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)
        out = (y.view(n, TOP_K, D) * top_v.unsqueeze(-1)).sum(1)
        return out.reshape(shape)

    def _dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        import warnings

        import torch.distributed as dist

        with warnings.catch_warnings():  # deprecated in favour of a private module; still the autograd-aware one
            warnings.simplefilter("ignore", FutureWarning)
            from torch.distributed.nn.functional import all_to_all_single as _a2a

        group = self.group if self.group is not None else dist.group.WORLD

        def all_to_all_single(out, inp, out_split, in_split):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return _a2a(out, inp, out_split, in_split, group=group)

        ep, el = self.ep, E // self.ep
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)  # [src rank, local expert] tokens this rank gets
        send_split = counts.view(ep, el).sum(1).tolist()
        rc = recv_counts.view(ep, el)
        recv_split = rc.sum(1).tolist()
        x_recv = all_to_all_single(x_sorted.new_empty(sum(recv_split), D), x_sorted, recv_split, send_split)
        chunks = x_recv.split(rc.flatten().tolist())  # src-major, local expert minor
        by_expert = torch.cat([chunks[s * el + e] for e in range(el) for s in range(ep)])
        y = self.experts(by_expert, rc.sum(0).tolist())
        ychunks = y.split(rc.T.flatten().tolist())  # local expert major, src minor
        back = torch.cat([ychunks[e * ep + s] for s in range(ep) for e in range(el)])
        return all_to_all_single(back.new_empty(sum(send_split), D), back, send_split, recv_split)


class Block(nn.Module):
    def __init__(self, ep: int = 1, group=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.norm2 = nn.LayerNorm(D)
        self.moe = MoE(ep, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.o(a)
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    def __init__(self, ep: int = 1, group=None):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(ep, group) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


EXPERT_ATTRS = ("w1", "w2", "w3")


def is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_ATTRS and ".experts." in name


def full_model(seed: int = 0) -> MoELM:
    torch.manual_seed(seed)
    return MoELM(ep=1)


def ep_model(ep: int, rank: int, seed: int = 0, group=None) -> MoELM:
    """The EP model of EP coordinate ``rank``: the full model's weights, experts ``rank*E/ep ..``
    only; ``group``: the EP process group its all-to-all runs on (None: the world)."""
    full = full_model(seed).state_dict()
    model = MoELM(ep=ep, group=group)
    el = E // ep
    local = {k: (v[rank * el : (rank + 1) * el] if is_expert(k) else v) for k, v in full.items()}
    model.load_state_dict(local)
    return model


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))


def global_batches(steps: int, world: int, per_rank: int = 2, seq: int = 9, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (world * per_rank, seq), generator=g) for _ in range(steps)]
