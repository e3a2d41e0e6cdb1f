"""The single-process reference of :mod:`dmuon.testing`: unmodified ``torch.optim.Muon`` on the
proxies (:mod:`dmuon.testing._proxies`) + ``torch.optim.AdamW`` on the rest
(:class:`ReferenceOptimizer`, :func:`reference_run`), and the Newton-Schulz iteration in a chosen
dtype it patches into torch's Muon (:func:`reference_newton_schulz`,
:func:`patched_newton_schulz`, :func:`fp32_newton_schulz`)."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from dmuon.testing._newton_schulz import fp32_newton_schulz, patched_newton_schulz, reference_newton_schulz
from dmuon.testing._proxies import Proxy

__all__ = [
    "reference_newton_schulz",
    "patched_newton_schulz",
    "fp32_newton_schulz",
    "ReferenceOptimizer",
    "reference_run",
]


# ---------------------------------------------------------------------------------------------
# the single-process reference
# ---------------------------------------------------------------------------------------------

_MUON_HP = dict(
    lr=1e-3,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=(3.4445, -4.775, 2.0315),
    eps=1e-7,
    ns_steps=None,
    adjust_lr_fn=None,
)
_ADAMW_HP = dict(adamw_lr=1e-3, adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=1e-2)
_NORMUON_HP = dict(variant="muon", normuon_beta2=0.95, normuon_eps=1e-10)


class ReferenceOptimizer:
    """``torch.optim.Muon`` on the proxies of ``muon_proxies``' parameters + ``torch.optim.AdamW``
    on every other parameter of ``model``, with ``dmuon.Muon``'s hyper-parameter names and
    defaults.

    Args:
        model: the (single-process, unsharded) model.
        muon_proxies: ``{fqn: proxies}``: the Muon-target parameters (names of
            ``model.named_parameters()``) and their 2-D matrices (:func:`matrix`, :func:`conv`,
            :func:`matrix_view`, :func:`expert_stack`, :func:`proxies_from_plan`). The proxies
            of a parameter must cover each of its elements exactly once.
        ns_dtype: dtype of the Newton-Schulz iteration. ``torch.bfloat16`` (default): torch's own
            iteration, untouched (unless ``ns_coefficients`` is a per-step table, which torch's
            does not take: then :func:`reference_newton_schulz` in bf16). Another dtype:
            :func:`reference_newton_schulz` in that dtype, patched in only during ``step()``.
        newton_schulz: replaces the iteration altogether (torch's signature
            ``fn(grad, ns_coefficients, ns_steps, eps)``); overrides ``ns_dtype``.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            ``torch.optim.Muon``'s (``ns_coefficients`` may also be a per-step table or a
            preset name, as ``dmuon.Muon`` takes it).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: ``torch.optim.AdamW``'s
            ``lr, betas, eps, weight_decay``.
        variant, normuon_beta2, normuon_eps: ``"muon"`` (default: ``torch.optim.Muon.step()``)
            or ``"normuon"``: :func:`dmuon.testing._normuon_reference.normuon_step` on every proxy instead
            (the same momentum, Newton-Schulz and update as torch's Muon, NorMuon's normalisation
            in fp32 between NS and the update; its second moment per proxy in
            ``muon.state[proxy]["second_momentum_buffer"]``, ``(out,)`` fp32).

    Step (:meth:`step`), for each Muon-target parameter ``p``: each proxy's value is copied from
    its slice of ``p`` (``p`` is the source of truth, whatever changed it), its gradient from the
    same slice of ``p.grad`` (a copy; a stacked parameter's slice, so an expert no token reached
    has a ZERO gradient, not None); if ``p.grad`` is None all its proxies get ``grad = None`` and
    torch's Muon skips them. Then ``torch.optim.Muon.step()`` and each proxy written back into its
    slice of ``p`` (``copy_``: exact), then ``torch.optim.AdamW.step()``.

    Weight decay: torch's Muon applies decoupled weight decay ``p *= 1 - lr * weight_decay``
    to every proxy whose gradient is not None, so the experts of a stack that no token reached
    (zero gradient) still decay -- as ``dmuon.Muon`` does, which decays a whole stack whose
    ``.grad`` exists. A parameter whose ``.grad`` is None is neither decayed nor moved.

    Attributes:
        muon, adamw: the two torch optimizers (``muon.state[proxy]["momentum_buffer"]``; an LR
            scheduler may drive them).
        proxies: ``{fqn: tuple[Proxy, ...]}`` as given; proxy_params: ``{fqn: tuple of the
            proxies' nn.Parameter}``.
    """

    def __init__(
        self,
        model: nn.Module,
        muon_proxies: Mapping[str, Sequence[Proxy]],
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        newton_schulz: Optional[Callable] = None,
        **hp: Any,
    ) -> None:
        unknown = sorted(set(hp) - set(_MUON_HP) - set(_ADAMW_HP) - set(_NORMUON_HP))
        if unknown:
            raise TypeError(
                f"ReferenceOptimizer: unknown hyper-parameters {unknown}; expected dmuon.Muon's "
                f"{sorted(_MUON_HP) + sorted(_ADAMW_HP) + sorted(_NORMUON_HP)}"
            )
        h = {**_MUON_HP, **_ADAMW_HP, **_NORMUON_HP, **hp}
        if h["variant"] not in ("muon", "normuon"):
            raise ValueError(f"ReferenceOptimizer: variant must be 'muon' or 'normuon', got {h['variant']!r}")
        self.variant = h["variant"]
        self._normuon_hp = dict(beta2=h["normuon_beta2"], eps=h["normuon_eps"])
        if not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point:
            raise ValueError(f"ReferenceOptimizer: ns_dtype must be a floating torch.dtype, got {ns_dtype!r}")
        named = dict(model.named_parameters())
        missing = sorted(set(muon_proxies) - set(named))
        if missing:
            raise KeyError(f"ReferenceOptimizer: {missing} are not parameter names of the model (named_parameters())")
        self.model = model
        self.proxies: dict[str, tuple[Proxy, ...]] = {}
        self.proxy_params: dict[str, tuple[nn.Parameter, ...]] = {}
        self._real: dict[str, nn.Parameter] = {}
        for fqn, p in named.items():  # model order
            if fqn not in muon_proxies:
                continue
            proxies = tuple(muon_proxies[fqn])
            _check_cover(fqn, p, proxies)
            self.proxies[fqn] = proxies
            self._real[fqn] = p
            self.proxy_params[fqn] = tuple(
                nn.Parameter(
                    pr.of(p.detach()).clone(memory_format=torch.contiguous_format), requires_grad=p.requires_grad
                )
                for pr in proxies
            )

        from dmuon._update import coefficient_schedule, resolve_ns_steps

        h["ns_steps"] = resolve_ns_steps(h["ns_coefficients"], h["ns_steps"])  # dmuon.Muon's rule
        # a triple (or a preset / table that is constant) goes to torch as is; a per-step table
        # is stored in torch's group too (torch does not read it) and needs our iteration
        schedule = coefficient_schedule(h["ns_coefficients"], h["ns_steps"])
        per_step = len(set(schedule)) > 1
        coefficients = schedule if per_step else (schedule[0] if schedule else _MUON_HP["ns_coefficients"])
        if newton_schulz is not None:
            self._ns = newton_schulz
        elif ns_dtype == torch.bfloat16 and not per_step:
            self._ns = None  # torch's own iteration
        else:
            self._ns = functools.partial(reference_newton_schulz, dtype=ns_dtype)
        self.ns_dtype = ns_dtype
        muon_params = [pp for pps in self.proxy_params.values() for pp in pps]
        rest = [p for fqn, p in named.items() if fqn not in self._real]
        self.muon = torch.optim.Muon(
            muon_params if muon_params else [nn.Parameter(torch.zeros(1, 1))],  # torch rejects an empty list
            lr=h["lr"],
            weight_decay=h["weight_decay"],
            momentum=h["momentum"],
            nesterov=h["nesterov"],
            ns_coefficients=coefficients,
            eps=h["eps"],
            ns_steps=h["ns_steps"],
            adjust_lr_fn=h["adjust_lr_fn"],
        )
        self.adamw = torch.optim.AdamW(
            rest if rest else [nn.Parameter(torch.zeros(1))],
            lr=h["adamw_lr"],
            betas=h["adamw_betas"],
            eps=h["adamw_eps"],
            weight_decay=h["adamw_weight_decay"],
        )

    @torch.no_grad()
    def step(self) -> None:
        """One step of both optimizers (see the class docstring)."""
        for fqn, p in self._real.items():
            g = p.grad
            for pr, pp in zip(self.proxies[fqn], self.proxy_params[fqn]):
                pp.copy_(pr.of(p))
                pp.grad = None if g is None else pr.of(g).clone(memory_format=torch.contiguous_format)
        if self.variant == "normuon":
            self._normuon_step()
        else:
            with patched_newton_schulz(self._ns) if self._ns is not None else contextlib.nullcontext():
                self.muon.step()
        for fqn, p in self._real.items():
            for pr, pp in zip(self.proxies[fqn], self.proxy_params[fqn]):
                pr.of(p).copy_(pp)
        self.adamw.step()

    def _normuon_step(self) -> None:
        """:func:`dmuon.testing._normuon_reference.normuon_step` on every proxy with a gradient, with the
        hyper-parameters of ``self.muon``'s param group (an LR scheduler's ``lr`` included) and
        its Newton-Schulz (torch's own, or the patched iteration)."""
        import torch.optim._muon as torch_muon

        from dmuon.testing._normuon_reference import normuon_step

        ns = self._ns if self._ns is not None else torch_muon._zeropower_via_newtonschulz
        for group in self.muon.param_groups:
            lr = group["lr"].item() if isinstance(group["lr"], Tensor) else group["lr"]
            coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
            for pp in group["params"]:
                if pp.grad is None:
                    continue
                state = self.muon.state[pp]
                new, buf, v = normuon_step(
                    pp.detach(),
                    pp.grad,
                    state.get("momentum_buffer"),
                    state.get("second_momentum_buffer"),
                    lr=lr,
                    weight_decay=group["weight_decay"],
                    momentum=group["momentum"],
                    nesterov=group["nesterov"],
                    adjust_lr_fn=group["adjust_lr_fn"],
                    orthogonalize=lambda x: ns(x, coefficients, steps, eps),
                    **self._normuon_hp,
                )
                pp.copy_(new)
                state["momentum_buffer"], state["second_momentum_buffer"] = buf, v

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients of the model's parameters and of the proxies."""
        self.model.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)


def _check_cover(fqn: str, p: Tensor, proxies: tuple[Proxy, ...]) -> None:
    if not proxies or any(not isinstance(pr, Proxy) for pr in proxies):
        raise TypeError(f"ReferenceOptimizer: {fqn}: proxies must be a non-empty sequence of dmuon.testing.Proxy")
    count = torch.zeros(p.shape, dtype=torch.int32)
    for pr in proxies:
        try:
            pr.of(count).add_(1)
        except (RuntimeError, ValueError, IndexError) as e:
            raise ValueError(f"ReferenceOptimizer: {fqn} {tuple(p.shape)}: proxy {pr} does not fit: {e}") from None
    if not bool((count == 1).all()):
        raise ValueError(
            f"ReferenceOptimizer: the proxies of {fqn} {tuple(p.shape)} must cover every element exactly once "
            f"({int((count == 0).sum())} uncovered, {int((count > 1).sum())} covered more than once)"
        )


def reference_run(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable[Any],
    muon_proxies: Mapping[str, Sequence[Proxy]],
    *,
    ns_dtype: torch.dtype = torch.bfloat16,
    **hp: Any,
) -> tuple[list[float], dict[str, Tensor]]:
    """Train a deep copy of ``model`` with :class:`ReferenceOptimizer` on ``batches`` (global
    batches): per batch ``loss = loss_fn(model, batch); loss.backward(); step(); zero_grad()``.

    Returns ``(losses, state)``: the loss of each step (floats) and the final
    ``model.state_dict()`` (detached clones). ``model`` itself is not changed.
    """
    model = copy.deepcopy(model)
    opt = ReferenceOptimizer(model, muon_proxies, ns_dtype=ns_dtype, **hp)
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
