r"""QK-clip (MuonClip) at run time: attention layers report per-head max logits, owners rescale.

Report, reduce, rescale: Note: QK-clip at run time (docs/design.md); the rule and the plan
records: Note: QK-clip, :mod:`dmuon.plan._records.qk_clip_records`.
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch
import torch.nn as nn

from dmuon import _tags
from dmuon._dtensor import is_dtensor
from dmuon.exec._comm import collective_calls as C
from dmuon._tags import dedicated_info

__all__ = ["record", "wants_logits", "max_logits_eager", "max_logits_sdpa", "stats", "QKClipRuntime", "QKClipNonFinite"]


def record(module: nn.Module, max_logits: torch.Tensor) -> bool:
    """Report ``module``'s per-head max logits for the current forward (``(H,)``, any float dtype).

    Returns True if recorded; False when ``module`` is not a QK-clip layer of a dmuon plan (a
    model used without dmuon, or outside ``plan.qk_clip``) or gradients are disabled. Never
    communicates.

    Raises:
        ValueError: ``max_logits`` is not ``(H,)`` for the layer's ``H`` q heads.
    """
    tag = _tags.read(module, _tags.QK_CLIP)
    if tag is None or not torch.is_grad_enabled():
        return False
    rt = tag[0]()
    if rt is None:
        return False
    return rt.record(tag[1], max_logits)


def wants_logits(module: nn.Module) -> bool:
    """True when :func:`record` would keep a value for ``module`` now (a QK-clip layer of a live
    dmuon plan, gradients enabled): lets an SDPA model skip :func:`max_logits_sdpa`'s extra pass
    otherwise."""
    tag = _tags.read(module, _tags.QK_CLIP)
    return tag is not None and torch.is_grad_enabled() and tag[0]() is not None


def max_logits_eager(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(H,)`` max over batch, query and key positions of pre-softmax ``scores``
    ``(B, H, T_q, T_k)`` (already scaled by ``1/√d_h``), gradient-free.

    ``mask``: a bool tensor broadcastable to ``scores`` (True = attended) or an additive float
    mask (``-inf`` / very negative = masked); masked positions are excluded. No extra FLOPs
    beyond one max-reduction over the scores.
    """
    s = scores.detach()
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.detach()
    return s.float().amax(dim=(0, 2, 3))


def max_logits_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    block_q: int = 128,
) -> torch.Tensor:
    """``(H,)`` per-head max of ``q·kᵀ·scale`` for attention computed by SDPA / flash attention.

    ``q``: ``(B, H, T_q, d_h)``; ``k``: ``(B, H_kv, T_k, d_h)`` (GQA: each k head serves
    ``H / H_kv`` consecutive q heads, as ``enable_gqa=True``); ``scale`` defaults to ``1/√d_h``;
    ``is_causal`` / ``attn_mask`` as in ``scaled_dot_product_attention`` (bool: True = attend;
    float: added). Gradient-free.

    Cost: an extra ``QKᵀ`` pass in fp32, ``2·B·H·T_q·T_k·d_h`` FLOPs (half of SDPA's forward
    matmul FLOPs; with ``is_causal`` the keys after each ``block_q`` rows are skipped, about
    half of that again for long sequences), and a transient ``B·H·block_q·T_k`` fp32 score
    block (queries are processed ``block_q`` rows at a time).
    """
    with torch.no_grad():
        B, H, Tq, d = q.shape
        H_kv, Tk = k.shape[1], k.shape[2]
        if H % H_kv:
            raise ValueError(f"max_logits_sdpa: {H} q heads are not a multiple of {H_kv} k heads")
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        kk = k.detach()
        if H_kv != H:
            kk = kk.repeat_interleave(H // H_kv, dim=1)
        out = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
        for start in range(0, Tq, block_q):
            qb = q.detach()[:, :, start : start + block_q]
            stop = start + qb.shape[2]
            k_end = min(Tk, stop) if is_causal else Tk  # causal: later keys are masked for these rows
            s = torch.matmul(qb.float(), kk[:, :, :k_end].float().transpose(-1, -2)) * scale
            if is_causal:
                rows = torch.arange(start, stop, device=q.device).unsqueeze(1)
                cols = torch.arange(k_end, device=q.device).unsqueeze(0)
                s = s.masked_fill(cols > rows, float("-inf"))  # SDPA's is_causal: top-left aligned tril
            if attn_mask is not None:
                m = attn_mask[..., start:stop, :k_end]
                s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
            out = torch.maximum(out, s.amax(dim=(0, 2, 3)))
        return out


def stats(model: nn.Module) -> dict[str, float | int] | None:
    """The last step's QK-clip figures of ``model``: ``{"clipped_heads": int, "max_logit": float,
    "tau": float, "nonfinite_heads": int}`` (one host read; ``nonfinite_heads``: heads whose max
    logit was inf or NaN, left unscaled with a :class:`QKClipNonFinite` warning), or None without
    QK-clip / before the first step."""
    rt = _tags.model_runtime(model)
    qk = getattr(rt, "qk_clip", None)
    if qk is None or qk.last is None:
        return None
    clipped, top, nonfinite = torch.stack([t.float() for t in qk.last]).tolist()  # one host read
    return {"clipped_heads": int(clipped), "max_logit": top, "tau": qk.spec.tau, "nonfinite_heads": int(nonfinite)}


class QKClipRuntime:
    """QK-clip state of one :class:`~dmuon.exec._runtime.runtime.DmuonRuntime` (Note: QK-clip at run time,
    docs/design.md).

    Holds one running-max vector per layer between steps (reset by :meth:`step`); nothing is
    checkpointed (the rescaled weights are ordinary parameters).
    """

    def __init__(self, runtime, model: nn.Module):
        self.spec = runtime.plan.qk_clip
        self.runtime_ref = weakref.ref(runtime)
        self.model_ref = weakref.ref(model)
        self.last = None  # (clipped head count, largest logit, non-finite head count) tensors of the last step
        modules = dict(model.named_modules())
        self._max: list[torch.Tensor | None] = [None] * len(self.spec.attention)
        for i, a in enumerate(self.spec.attention):
            _tags.write(modules[a.module], _tags.QK_CLIP, (weakref.ref(self), i))

    def record(self, index: int, max_logits: torch.Tensor) -> bool:
        a = self.spec.attention[index]
        v = max_logits.detach()
        if tuple(v.shape) != (a.q.num_heads,):
            raise ValueError(
                f"dmuon.qk_clip.record({a.module!r}): expected ({a.q.num_heads},) per-head max logits, got {tuple(v.shape)}"
            )
        v = v.float()
        cur = self._max[index]
        self._max[index] = v.clone() if cur is None else torch.maximum(cur, v.to(cur.device))
        return True

    def discard(self) -> None:
        """A step skipped on every rank (``dmuon.Muon(skip_nonfinite=True)``): drop its recorded
        max logits; no all-reduce, no rescaling."""
        self._max = [None] * len(self.spec.attention)

    def step(self) -> None:
        """The all-reduce (max) and the owners' rescaling (Note: QK-clip at run time, docs/design.md); every rank
        calls it."""
        rt = self.runtime_ref()
        device = rt.device
        parts = [
            m.to(device) if m is not None else torch.full((a.q.num_heads,), float("-inf"), device=device)
            for m, a in zip(self._max, self.spec.attention)
        ]
        self._max = [None] * len(self.spec.attention)
        vec = torch.cat(parts)
        # a NaN maximum becomes +inf before the reduce: the MAX of a NaN is backend-dependent (it
        # may vanish), +inf survives it on every rank, so every rank sees the same non-finite head
        vec.masked_fill_(vec.isnan(), float("inf"))
        rt.wait(
            [C.all_reduce_max(vec, group=rt.groups.job_group, phase="qk_clip", async_op=True)],
            "QK-clip all-reduce (max) of the per-head max logits",
            group=rt.groups.job_group,
        )
        tau = self.spec.tau
        nonfinite = torch.isposinf(vec)  # +inf: an inf or a NaN max logit on some rank
        none_reported, any_nonfinite = torch.stack(
            [torch.isneginf(vec).all(), nonfinite.any()]
        ).tolist()  # one host read
        if none_reported:  # same reduced vector on every rank: all raise
            raise RuntimeError(
                "dmuon: QK-clip is on (plan.qk_clip) but no attention layer reported its max logits this step on any "
                "rank; call dmuon.qk_clip.record(self, max_logits) in each listed module's forward (helpers: "
                "dmuon.qk_clip.max_logits_eager / max_logits_sdpa) or compile without qk_clip"
            )
        if any_nonfinite:
            _warn_nonfinite(self.spec, nonfinite, rt.steps_done)
        clip = (vec > tau) & ~nonfinite  # a non-finite head is never scaled (by 0 = tau/inf, or by NaN)
        self.last = (clip.sum(), vec.max(), nonfinite.sum())
        model = self.model_ref()
        start = 0
        with torch.no_grad():
            for a in self.spec.attention:
                S = vec[start : start + a.q.num_heads]
                over = clip[start : start + a.q.num_heads]
                start += a.q.num_heads
                ratio = torch.where(over, tau / S, torch.ones_like(S))
                if a.gqa:  # q-only rule: the shared k head stays, each clipped q head shrinks by tau/S_h
                    fq, fk = ratio, None
                else:
                    fq = fk = ratio.sqrt()
                self._scale(rt, model, a.q, fq)
                if fk is not None:
                    self._scale(rt, model, a.k, fk)

    @staticmethod
    def _scale(rt, model, rows, head_factor: torch.Tensor) -> None:
        """Multiply ``rows``' heads by ``head_factor`` on the weight's owner, and every rank's bias shard."""
        per_elem = head_factor.repeat_interleave(rows.head_dim)
        slot = rt.slots_by_fqn.get(rows.fqn) or rt.slots_by_fqn[rt.plan.param(rows.fqn).fqn]
        w = slot.logical
        if dedicated_info(w).is_owner:
            block = w.narrow(rows.dim, rows.offset, rows.span)
            f = per_elem.to(w.device, w.dtype)
            block.mul_(f.view(-1, 1) if rows.dim == 0 else f.view(1, -1))
        if rows.bias is not None:
            _scale_bias(model.get_parameter(rows.bias), rows.offset, per_elem)


def _warn_nonfinite(spec, nonfinite: torch.Tensor, step: int) -> None:
    """Warn (the same text on every rank: the reduced vector is) naming each layer, its heads whose
    max logit was non-finite, and the optimizer step; those heads are left unscaled this step."""
    flags = nonfinite.tolist()
    start, parts = 0, []
    for a in spec.attention:
        heads = [h for h in range(a.q.num_heads) if flags[start + h]]
        start += a.q.num_heads
        if heads:
            parts.append(f"{a.module!r} head(s) {heads}")
    warnings.warn(
        f"dmuon: QK-clip: non-finite max logit (inf, or NaN on some rank) at optimizer step {step} in "
        + "; ".join(parts)
        + ": those heads' W_q / W_k rows are left unscaled this step (tau / inf would zero them for good, a NaN "
        "would poison them); the forward diverged: check the loss, the learning rate and the mixed-precision "
        "settings (docs/muon_variants.md, QK-clip)",
        QKClipNonFinite,
        stacklevel=2,
    )


class QKClipNonFinite(UserWarning):
    """A QK-clip head's step maximum was non-finite; its rows were left unscaled (the message names
    the layer, the heads and the step)."""


def _scale_bias(bias: torch.Tensor, offset: int, per_elem: torch.Tensor) -> None:
    """``bias[offset : offset + len(per_elem)] *= per_elem`` on this rank's part of ``bias`` (a
    plain tensor, or an FSDP2 ``DTensor`` shard whose global offset DTensor computes)."""
    full = torch.ones(bias.shape[0], dtype=per_elem.dtype, device=per_elem.device)
    full[offset : offset + per_elem.numel()] = per_elem
    if is_dtensor(bias):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = bias.to_local()
        shape, goff = compute_local_shape_and_global_offset(bias.shape, bias.device_mesh, bias.placements)
        if local.numel():
            local.mul_(full[goff[0] : goff[0] + shape[0]].to(local.device, local.dtype))
    else:
        bias.mul_(full.to(bias.device, bias.dtype))
