"""A reference users can run: check dmuon on your own model against plain torch.

The numerical contract (README, "The oracle guarantee") says that ``dmuon.Muon`` on any mesh
matches ONE process running ``torch.optim.Muon`` on the Muon-target matrices and
``torch.optim.AdamW`` on the other parameters over the global batch. This module is that single
process, usable on any model, plus a one-call checker::

    import dmuon.testing
    report = dmuon.testing.check_against_reference(build_model, loss_fn, batches, world_size=2)
    print(report); assert report.passed

Two parts:

* **The single-process reference** (:class:`ReferenceOptimizer`, :func:`reference_run`):
  unmodified ``torch.optim.Muon`` + ``torch.optim.AdamW``. ``torch.optim.Muon`` only takes 2-D
  parameters, so every Muon-target parameter is described by its *proxies*
  (:class:`Proxy`): 2-D matrices in ``nn.Linear`` ``(out, in)`` orientation, each a slice
  (possibly strided, possibly transposed) of the real parameter -- the matrices dmuon
  orthogonalises one by one (a conv weight's ``(out, in*prod(k))`` view, each expert of a
  stack, each block of a per-head matrix view). Each step copies the real parameter's slices
  into the proxies (separate leaf ``nn.Parameter`` s), copies each proxy's gradient out of the
  real parameter's ``.grad``, runs ``torch.optim.Muon.step()`` on the proxies and writes them
  back into the real parameter (exactly: ``copy_`` into the slice). Constructors:
  :func:`matrix`, :func:`conv`, :func:`matrix_view`, :func:`expert_stack` (layouts
  :data:`EXPERT_LAYOUTS`), and :func:`proxies_from_plan` for the dedicated parameters of a
  :class:`dmuon.plan.ShardingPlan`. Only the dtype of the Newton-Schulz iteration is changed,
  when asked (``ns_dtype=torch.float32``; :func:`reference_newton_schulz`).
* **The one-call checker** (:func:`check_against_reference`): runs dmuon on ``world_size``
  local CPU processes (gloo, spawned, with a hard timeout) and the reference on the global
  batches, and returns a :class:`Report` of the loss and parameter deviations against the
  documented bounds (:func:`bounds`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

__all__ = [
    "Proxy",
    "EXPERT_LAYOUTS",
    "matrix",
    "conv",
    "matrix_view",
    "expert_stack",
    "proxies_for",
    "proxies_from_plan",
    "reference_newton_schulz",
    "patched_newton_schulz",
    "fp32_newton_schulz",
    "ReferenceOptimizer",
    "reference_run",
    "bounds",
    "FP32_LOSS_RTOL",
    "FP32_PARAM_TOL",
    "BF16_LOSS_RTOL",
    "BF16_PARAM_TOL",
    "Report",
    "check_against_reference",
]

# ---------------------------------------------------------------------------------------------
# bounds of the numerical contract
# ---------------------------------------------------------------------------------------------

FP32_LOSS_RTOL = 1e-6
"""fp32 (or fp64) Newton-Schulz on both sides: losses within this relative deviation."""
FP32_PARAM_TOL = 1e-4
"""fp32 (or fp64) Newton-Schulz: parameters within this fraction of each tensor's max|p|."""
BF16_LOSS_RTOL = 2e-3
"""bf16 (or fp16) Newton-Schulz: reduction-order noise is amplified; losses within this."""
BF16_PARAM_TOL = 5e-2
"""bf16 (or fp16) Newton-Schulz: parameters within this fraction of each tensor's max|p|."""


def bounds(ns_dtype: torch.dtype) -> tuple[float, float]:
    """``(loss relative tolerance, parameter tolerance as a fraction of max|p|)`` that the
    contract promises for Newton-Schulz in ``ns_dtype`` (README, "The oracle guarantee";
    measured over 3 steps on 2-4 ranks: fp32 2.3e-7 / 3.0e-6, bf16 1.9e-6 / 9.5e-3)."""
    if ns_dtype in (torch.float32, torch.float64):
        return FP32_LOSS_RTOL, FP32_PARAM_TOL
    if ns_dtype in (torch.bfloat16, torch.float16):
        return BF16_LOSS_RTOL, BF16_PARAM_TOL
    raise ValueError(f"ns_dtype must be a floating dtype (bf16, fp16, fp32, fp64), got {ns_dtype!r}")


# ---------------------------------------------------------------------------------------------
# proxies
# ---------------------------------------------------------------------------------------------

_Index = Union[int, tuple[int, int, int]]


@dataclasses.dataclass(frozen=True)
class Proxy:
    """One 2-D matrix Muon orthogonalises, as a slice of the real parameter.

    :meth:`of` maps the parameter (or its gradient) ``t`` to the slice:
    ``t.view(view)`` if ``view`` is set, then indexed with ``index`` (one entry per leading
    dim: an ``int``, or ``(start, stop, step)`` for a slice), then transposed if ``transpose``.
    The result is a view of ``t`` (so ``proxy.of(p).copy_(x)`` writes into ``p``) of shape
    ``shape``, the matrix in ``nn.Linear`` ``(out, in)`` orientation: ``torch.optim.Muon``'s
    ``adjust_lr`` and the transposition inside Newton-Schulz read this orientation.

    Attributes:
        shape: ``(out, in)`` of the matrix.
        index: per leading dim of the (viewed) parameter, an int or ``(start, stop, step)``.
        view: a shape to ``view`` the parameter as first (a conv weight's ``(out, in*prod(k))``), or None.
        transpose: the slice is stored ``(in, out)``; the matrix is its transpose.
        label: what it is, for messages (``"expert 3 gate"``).
    """

    shape: tuple[int, int]
    index: tuple[_Index, ...] = ()
    view: Optional[tuple[int, ...]] = None
    transpose: bool = False
    label: str = ""

    def of(self, t: Tensor) -> Tensor:
        """The proxy's matrix inside ``t`` (the parameter or a tensor of its shape): a view."""
        x = t.view(self.view) if self.view is not None else t
        if self.index:
            x = x[tuple(i if isinstance(i, int) else slice(*i) for i in self.index)]
        x = x.T if self.transpose else x
        if tuple(x.shape) != tuple(self.shape):
            raise ValueError(f"proxy {self.label or self}: slice has shape {tuple(x.shape)}, expected {self.shape}")
        return x


EXPERT_LAYOUTS = ("linear", "hf_gate_up", "in_out", "gpt_oss_gate_up")
"""Layouts of a 3-D expert stack ``W`` of ``E`` experts (:func:`expert_stack`):

* ``"linear"``: ``(E, m, n)``, each ``W[e]`` in ``(out, in)`` orientation: torchtitan
  ``GroupedExperts`` ``w1`` / ``w3`` ``(E, F, D)`` and ``w2`` ``(E, D, F)``; HF fused
  ``down_proj`` ``(E, D, F)``; a generic stack. E proxies ``W[e]``.
* ``"hf_gate_up"``: HF transformers 5.x fused ``gate_up_proj`` ``(E, 2F, D)``, gate rows first,
  then up: 2E proxies ``W[e, :F]``, ``W[e, F:]`` (gate0, up0, gate1, up1, ...); ``fused=True``:
  E proxies ``W[e]`` ``(2F, D)`` (the same as ``"linear"``).
* ``"in_out"``: gpt-oss ``down_proj`` ``(E, F, D)`` stored ``(in, out)``: E proxies
  ``W[e].T`` ``(D, F)``.
* ``"gpt_oss_gate_up"``: gpt-oss ``gate_up_proj`` ``(E, D, 2F)`` stored ``(in, out)``, gate and
  up interleaved along the last dim: 2E proxies ``W[e][:, ::2].T``, ``W[e][:, 1::2].T``, each
  ``(F, D)``; ``fused=True``: E proxies ``W[e].T`` ``(2F, D)`` (the same as ``"in_out"``).
"""


def matrix(shape: Sequence[int]) -> tuple[Proxy, ...]:
    """A plain 2-D parameter ``(m, n)``: one proxy, itself."""
    shape = _shape(shape, 2, "matrix")
    return (Proxy(shape=shape),)


def conv(shape: Sequence[int]) -> tuple[Proxy, ...]:
    """A conv weight ``(out, in, *k)``: one proxy, its ``(out, in*prod(k))`` view (as dmuon's
    planner and Jordan et al.'s Muon treat it). The weight must be contiguous (it is, as
    ``nn.Conv*d`` creates it)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 3:
        raise ValueError(f"conv: a conv weight is (out, in, *kernel), got shape {shape}")
    m = (shape[0], math.prod(shape[1:]))
    return (Proxy(shape=m, view=m, label="conv"),)


def matrix_view(shape: Sequence[int], dim: int, sizes: Sequence[int]) -> tuple[Proxy, ...]:
    """A 2-D parameter cut along ``dim`` (0: row blocks, 1: column blocks) into consecutive
    blocks of ``sizes`` (per-head q/k/v or o_proj, split QKV; ``dmuon.plan.MatrixView``): one
    proxy per block."""
    m, n = _shape(shape, 2, "matrix_view")
    sizes = tuple(int(s) for s in sizes)
    if dim not in (0, 1):
        raise ValueError(f"matrix_view: dim must be 0 or 1, got {dim!r}")
    if not sizes or min(sizes) < 1 or sum(sizes) != (m, n)[dim]:
        raise ValueError(f"matrix_view: sizes {sizes} must be >= 1 and sum to shape[{dim}] = {(m, n)[dim]}")
    out, lo = [], 0
    for i, s in enumerate(sizes):
        rng = (lo, lo + s, 1)
        if dim == 0:
            out.append(Proxy(shape=(s, n), index=(rng,), label=f"block {i}"))
        else:
            out.append(Proxy(shape=(m, s), index=((0, m, 1), rng), label=f"block {i}"))
        lo += s
    return tuple(out)


def expert_stack(shape: Sequence[int], layout: str = "linear", *, fused: bool = False) -> tuple[Proxy, ...]:
    """A 3-D expert stack ``(E, a, b)`` in ``layout`` (:data:`EXPERT_LAYOUTS`): the proxies
    torch.optim.Muon would be given in the unfused model, expert-major."""
    E, a, b = _shape(shape, 3, "expert_stack")
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_stack: unknown layout {layout!r}; expected one of {EXPERT_LAYOUTS}")
    out: list[Proxy] = []
    for e in range(E):
        if layout == "linear" or (layout == "hf_gate_up" and fused):
            out.append(Proxy(shape=(a, b), index=(e,), label=f"expert {e}"))
        elif layout == "hf_gate_up":
            if a % 2:
                raise ValueError(f"expert_stack: hf_gate_up needs (E, 2F, D), got {tuple(shape)}")
            f = a // 2
            out.append(Proxy(shape=(f, b), index=(e, (0, f, 1)), label=f"expert {e} gate"))
            out.append(Proxy(shape=(f, b), index=(e, (f, a, 1)), label=f"expert {e} up"))
        elif layout == "in_out" or (layout == "gpt_oss_gate_up" and fused):
            out.append(Proxy(shape=(b, a), index=(e,), transpose=True, label=f"expert {e}"))
        else:  # gpt_oss_gate_up, gate / up interleaved along the last dim
            if b % 2:
                raise ValueError(f"expert_stack: gpt_oss_gate_up needs (E, D, 2F), got {tuple(shape)}")
            f = b // 2
            out.append(Proxy(shape=(f, a), index=(e, (0, a, 1), (0, b, 2)), transpose=True, label=f"expert {e} gate"))
            out.append(Proxy(shape=(f, a), index=(e, (0, a, 1), (1, b, 2)), transpose=True, label=f"expert {e} up"))
    return tuple(out)


def proxies_for(shape: Sequence[int], *, layout: str = "linear") -> tuple[Proxy, ...]:
    """The default proxies of a parameter of ``shape``: 2-D -> :func:`matrix`, 3-D ->
    :func:`expert_stack` in ``layout``, 4-D+ -> :func:`conv`. (An ``nn.Conv1d`` weight is 3-D
    too: give it :func:`conv` yourself, or use :func:`proxies_from_plan`.)"""
    nd = len(shape)
    if nd == 2:
        return matrix(shape)
    if nd == 3:
        return expert_stack(shape, layout)
    if nd > 3:
        return conv(shape)
    raise ValueError(f"no Muon matrix view for a {nd}-D parameter of shape {tuple(shape)}")


def _stack_layout_of(spec) -> tuple[str, bool]:
    """``(layout, fused)`` of a plan's 3-D ``ParamSpec`` for :func:`expert_stack`, from its
    ``ExpertStack`` record (``ParamSpec.experts``; a stack without one is ``"linear"``)."""
    stack = spec.experts
    if stack is None:
        return "linear", False
    fused = not stack.split
    table = {
        (False, ""): "linear",
        (True, ""): "in_out",
        (False, "concat"): "hf_gate_up",
        (True, "interleave"): "gpt_oss_gate_up",
    }
    layout = table.get((stack.transposed, stack.gate_up))
    if layout is None:
        raise ValueError(
            f"proxies_from_plan: {spec.fqn}: no reference layout for {stack.describe(tuple(spec.shape))}; "
            "pass stack_layouts={fqn: layout} or build its proxies by hand"
        )
    return layout, fused


def proxies_from_plan(plan, stack_layouts: Optional[Mapping[str, str]] = None) -> dict[str, tuple[Proxy, ...]]:
    """``{fqn: proxies}`` of every dedicated parameter of ``plan`` (a
    :class:`dmuon.plan.ShardingPlan`), from its ``ParamSpec``: a ``view`` -> :func:`matrix_view`;
    an expert stack (``ParamSpec.experts``, or a 3-D stack with ``matrix_shape == shape[1:]``)
    -> :func:`expert_stack` in the layout ``stack_layouts[fqn]`` (default: the plan's record,
    orientation and gate/up split included); a conv weight (``nn.Conv1d``'s is 3-D too) ->
    :func:`conv`; else :func:`matrix`. Without an override the proxies' shapes are checked
    against the plan's ``ParamSpec.matrices`` (``ValueError`` if they differ).

    ``stack_layouts`` overrides the layout of named stacks (:data:`EXPERT_LAYOUTS`); a name that
    is not a dedicated 3-D parameter raises ``KeyError``.
    """
    stack_layouts = dict(stack_layouts or {})
    out: dict[str, tuple[Proxy, ...]] = {}
    for spec in plan.params:
        shape, (m, n) = tuple(spec.shape), tuple(spec.matrix_shape)
        if spec.view is not None:
            proxies = matrix_view(shape, spec.view.dim, spec.view.sizes)
        elif len(shape) == 3 and (spec.experts is not None or (m, n) == shape[1:]):  # an expert stack
            if spec.fqn in stack_layouts:
                out[spec.fqn] = expert_stack(shape, stack_layouts.pop(spec.fqn))
                continue
            layout, fused = _stack_layout_of(spec)
            proxies = expert_stack(shape, layout, fused=fused)
        elif len(shape) > 2:  # conv weight: (out, in * prod(k))
            proxies = conv(shape)
        else:
            proxies = matrix(shape)
        if [p.shape for p in proxies] != [tuple(b) for b in spec.matrices]:  # what dmuon orthogonalises
            raise ValueError(
                f"proxies_from_plan: {spec.fqn} {shape}: proxies {[p.shape for p in proxies]} are not the plan's "
                f"matrices {list(spec.matrices)}"
            )
        out[spec.fqn] = proxies
    if stack_layouts:
        raise KeyError(f"stack_layouts names parameters that are not dedicated 3-D stacks of the plan: {sorted(stack_layouts)}")
    return out


def _shape(shape: Sequence[int], nd: int, what: str) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != nd:
        raise ValueError(f"{what}: expected a {nd}-D shape, got {shape}")
    return shape


# ---------------------------------------------------------------------------------------------
# Newton-Schulz in a chosen dtype
# ---------------------------------------------------------------------------------------------


def reference_newton_schulz(grad: Tensor, ns_coefficients, ns_steps: int, eps: float, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` with the iteration in ``dtype`` (torch's
    is bf16) and the same arithmetic otherwise. ``ns_coefficients``: one ``(a, b, c)`` triple,
    or a per-step table of ``ns_steps`` triples (dmuon's per-step presets)."""
    table = _as_table(ns_coefficients, ns_steps)
    if len(table) != ns_steps:
        raise ValueError(f"a per-step coefficient table needs ns_steps = {ns_steps} triples, got {len(table)}")
    x = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for a, b, c in table:
        gram = x @ x.T
        upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, upd, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def _as_table(coefficients, steps: int) -> tuple[tuple[float, float, float], ...]:
    if len(coefficients) == 3 and not isinstance(coefficients[0], (tuple, list)):
        return (tuple(coefficients),) * steps
    return tuple(tuple(t) for t in coefficients)


@contextlib.contextmanager
def patched_newton_schulz(fn: Callable[[Tensor, Any, int, float], Tensor]):
    """``torch.optim.Muon``'s ``_zeropower_via_newtonschulz(grad, ns_coefficients, ns_steps, eps)``
    replaced by ``fn`` inside the block (nothing else of torch's Muon changes). Process-wide
    while it lasts: do not step another torch Muon from another thread meanwhile."""
    import torch.optim._muon as m

    orig = m._zeropower_via_newtonschulz
    m._zeropower_via_newtonschulz = fn
    try:
        yield
    finally:
        m._zeropower_via_newtonschulz = orig


def fp32_newton_schulz():
    """:func:`patched_newton_schulz` with :func:`reference_newton_schulz` in float32: the
    "reference patched to iterate in fp32" of the contract."""
    return patched_newton_schulz(reference_newton_schulz)


# ---------------------------------------------------------------------------------------------
# the single-process reference
# ---------------------------------------------------------------------------------------------

_MUON_HP = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315),
                eps=1e-7, ns_steps=5, adjust_lr_fn=None)
_ADAMW_HP = dict(adamw_lr=1e-3, adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=1e-2)


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
        unknown = sorted(set(hp) - set(_MUON_HP) - set(_ADAMW_HP))
        if unknown:
            raise TypeError(
                f"ReferenceOptimizer: unknown hyper-parameters {unknown}; expected dmuon.Muon's "
                f"{sorted(_MUON_HP) + sorted(_ADAMW_HP)}"
            )
        h = {**_MUON_HP, **_ADAMW_HP, **hp}
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
                nn.Parameter(pr.of(p.detach()).clone(memory_format=torch.contiguous_format), requires_grad=p.requires_grad)
                for pr in proxies
            )

        from dmuon.exec.optim.ns_coefficients import coefficient_schedule

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
            lr=h["lr"], weight_decay=h["weight_decay"], momentum=h["momentum"], nesterov=h["nesterov"],
            ns_coefficients=coefficients, eps=h["eps"], ns_steps=h["ns_steps"], adjust_lr_fn=h["adjust_lr_fn"],
        )
        self.adamw = torch.optim.AdamW(
            rest if rest else [nn.Parameter(torch.zeros(1))],
            lr=h["adamw_lr"], betas=h["adamw_betas"], eps=h["adamw_eps"], weight_decay=h["adamw_weight_decay"],
        )

    @torch.no_grad()
    def step(self) -> None:
        """One step of both optimizers (see the class docstring)."""
        for fqn, p in self._real.items():
            g = p.grad
            for pr, pp in zip(self.proxies[fqn], self.proxy_params[fqn]):
                pp.copy_(pr.of(p))
                pp.grad = None if g is None else pr.of(g).clone(memory_format=torch.contiguous_format)
        with patched_newton_schulz(self._ns) if self._ns is not None else contextlib.nullcontext():
            self.muon.step()
        for fqn, p in self._real.items():
            for pr, pp in zip(self.proxies[fqn], self.proxy_params[fqn]):
                pr.of(p).copy_(pp)
        self.adamw.step()

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


# ---------------------------------------------------------------------------------------------
# the one-call checker
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`check_against_reference` measured.

    Attributes:
        world_size: ranks dmuon ran on; mesh_shape: its ``(R, N)`` (replicate, shard) mesh.
        ns_dtype: Newton-Schulz dtype of both sides (``"torch.float32"``).
        dedicated: the Muon-target parameters (the plan's), named_parameters() order.
        losses: dmuon's loss per step on the global batch (mean of the ranks' losses on their
            equal slices). reference_losses: the reference's, per step.
        loss_dev: max over steps of ``|loss - reference| / |reference|`` (relative, unitless).
        param_devs: per state-dict entry, ``max|dmuon - reference| / max|reference|`` after
            the last step (relative to the tensor's largest magnitude; 1 if the reference is 0).
        param_dev: the largest of ``param_devs``; worst_param: its name.
        loss_bound, param_bound: the bounds they are checked against (:func:`bounds`).
    """

    world_size: int
    mesh_shape: tuple[int, int]
    ns_dtype: str
    dedicated: tuple[str, ...]
    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    loss_dev: float
    param_devs: Mapping[str, float]
    param_dev: float
    worst_param: Optional[str]
    loss_bound: float
    param_bound: float

    @property
    def passed(self) -> bool:
        """Both deviations within their bounds (a NaN or inf deviation fails)."""
        return self.loss_dev <= self.loss_bound and self.param_dev <= self.param_bound

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        mark = lambda ok: "ok" if ok else "EXCEEDED"  # noqa: E731
        lines = [
            f"dmuon vs single-process torch.optim.Muon + AdamW: {verdict}",
            f"  {self.world_size} rank{'s' if self.world_size != 1 else ''}, mesh (R, N) = {self.mesh_shape}, Newton-Schulz {self.ns_dtype}, "
            f"{len(self.losses)} steps, {len(self.dedicated)} Muon-target parameters",
            f"  loss deviation   {self.loss_dev:.3g} (relative; bound {self.loss_bound:g}) {mark(self.loss_dev <= self.loss_bound)}",
            f"  param deviation  {self.param_dev:.3g} (of max|p|, worst: {self.worst_param}; bound {self.param_bound:g}) "
            f"{mark(self.param_dev <= self.param_bound)}",
            "  step  dmuon loss        reference loss",
        ]
        for i, (a, b) in enumerate(zip(self.losses, self.reference_losses)):
            lines.append(f"  {i:>4}  {a:<16.9g}  {b:.9g}")
        return "\n".join(lines)


def _slice_batch(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s contiguous slice (dim 0) of every tensor of ``batch`` (a tensor, or a
    tuple / list / dict of them; other leaves pass unchanged)."""
    if isinstance(batch, Tensor):
        if batch.shape[0] % world:
            raise ValueError(f"a global batch of {batch.shape[0]} rows does not split evenly over {world} ranks")
        return batch.chunk(world)[rank]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice_batch(b, rank, world) for b in batch)
    if isinstance(batch, dict):
        return {k: _slice_batch(v, rank, world) for k, v in batch.items()}
    return batch


def _mesh_shape(mesh: Any, world_size: int) -> tuple[int, int]:
    if mesh is None:
        return (1, world_size)
    if isinstance(mesh, int):
        mesh = (mesh,)
    mesh = tuple(int(s) for s in mesh)
    if len(mesh) == 1:
        mesh = (1, mesh[0])
    if len(mesh) != 2 or math.prod(mesh) != world_size:
        raise ValueError(f"mesh must be None, N or (R, N) with R*N == world_size {world_size}, got {mesh}")
    return mesh  # type: ignore[return-value]


def _dmuon_worker(model_fn, loss_fn, batches, mesh_shape, seed, dedicate_kwargs, fully_shard_kwargs, optimizer_kwargs):
    """One rank of :func:`check_against_reference`: the README's three lines, then the steps."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.integrations import boundary_modules

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if mesh_shape[0] > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(seed)
    model = model_fn()
    plan = dmuon.dedicate_params(model, mesh, **dedicate_kwargs)
    # ignored_params explicit: the checker also runs with dmuon's patches off (DMUON_NO_PATCHES=1)
    for block in boundary_modules(model, plan):
        fully_shard(block, mesh=mesh, ignored_params=dmuon.fsdp2_ignored_params(block), **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, ignored_params=dmuon.fsdp2_ignored_params(model), **fully_shard_kwargs)
    opt = dmuon.Muon(model, **optimizer_kwargs)
    losses = []
    for batch in batches:
        loss = loss_fn(model, _slice_batch(batch, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full = {k: v.detach().clone() for k, v in full.items()} if rank == 0 else None
    return dict(plan_json=plan.to_json(), losses=losses, state=full)


def _rel_dev(got: float, want: float) -> float:
    d = abs(got - want) / max(abs(want), 1e-30)
    return d if math.isfinite(d) else math.inf


def check_against_reference(
    model_fn: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Sequence[Any],
    *,
    world_size: int,
    mesh: Union[None, int, tuple[int, ...]] = None,
    ns_dtype: torch.dtype = torch.float32,
    steps: Optional[int] = None,
    dedicate_kwargs: Optional[Mapping[str, Any]] = None,
    fully_shard_kwargs: Optional[Mapping[str, Any]] = None,
    optimizer_kwargs: Optional[Mapping[str, Any]] = None,
    reference_kwargs: Optional[Mapping[str, Any]] = None,
    stack_layouts: Optional[Mapping[str, str]] = None,
    seed: int = 0,
    timeout_s: float = 300.0,
    threads: int = 1,
) -> Report:
    """Run dmuon on ``world_size`` local CPU processes and the single-process reference, and
    compare them (README, "The oracle guarantee").

    The dmuon side, on each spawned rank (gloo): ``torch.manual_seed(seed); model = model_fn();
    plan = dmuon.dedicate_params(model, mesh, **dedicate_kwargs)``; ``fully_shard`` on each hook
    boundary of the plan, then on the model; ``dmuon.Muon(model, ns_dtype=ns_dtype,
    **optimizer_kwargs)``; then per global batch: this rank's contiguous slice (dim 0 of every
    tensor; the batch must split evenly), ``loss_fn(model, slice).backward()``, ``step()``,
    ``zero_grad()``. The final parameters are read with ``get_model_state_dict(full_state_dict=True)``.
    The reference, in this process: ``torch.manual_seed(seed); model_fn()``, then
    :func:`reference_run` on the global batches with :func:`proxies_from_plan` of dmuon's plan
    (``stack_layouts`` overrides stacks' layouts) and the same hyper-parameters.

    Args:
        model_fn: builds the model, deterministically given the seed (same init everywhere).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, a mean over the batch rows (so that
            the mean of the ranks' losses is the global batch's and the gradients agree).
        batches: global batches: tensors, or tuples / lists / dicts of tensors.
        world_size: ranks; mesh: None (1-D over them), N, or ``(R, N)`` (HSDP, ``R*N == world_size``).
        ns_dtype: Newton-Schulz dtype of both sides; sets the bounds (:func:`bounds`).
        steps: use the first ``steps`` batches (default: all).
        dedicate_kwargs / fully_shard_kwargs / optimizer_kwargs: extra keyword arguments of
            ``dmuon.dedicate_params`` / every ``fully_shard`` call / ``dmuon.Muon`` (not
            ``ns_dtype``). ``optimizer_kwargs`` also go to the reference, except ``ns_backend``
            (the reference always runs torch's standard iteration).
        reference_kwargs: hyper-parameters for the reference instead of ``optimizer_kwargs``
            (default: the same ones).
        seed: ``torch.manual_seed`` before each ``model_fn()`` (the reference's under
            ``torch.random.fork_rng``, so the caller's RNG is untouched).
        timeout_s: hard limit of the distributed run, process start-up included; every rank is
            killed after it (:class:`dmuon._launch.DistributedTimeout`).
        threads: ``torch.set_num_threads`` in each rank.

    Everything sent to the ranks is pickled: ``model_fn``, ``loss_fn`` (and any predicate in
    ``dedicate_kwargs``) must be module-level functions (or ``functools.partial`` of them), and
    a script that calls this must do so under ``if __name__ == "__main__":``.

    Returns: a :class:`Report`; ``report.passed`` says whether both deviations are within the
    bounds of ``ns_dtype``. A failing rank raises ``dmuon._launch.DistributedError`` with its
    traceback.
    """
    from dmuon._launch import run_distributed
    from dmuon.plan import ShardingPlan

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    batches = list(batches)
    if steps is not None:
        if not 1 <= steps <= len(batches):
            raise ValueError(f"steps must be in 1..{len(batches)} (the batches given), got {steps}")
        batches = batches[:steps]
    if not batches:
        raise ValueError("check_against_reference: no batches")
    for b in batches:
        _slice_batch(b, 0, world_size)  # uneven batches fail here, before any process starts
    mesh_shape = _mesh_shape(mesh, world_size)
    if (dedicate_kwargs or {}).get("ep", 1) not in (None, 1):
        raise ValueError(
            "check_against_reference: expert parallelism (dedicate_kwargs ep=...) is not covered: the reference "
            "runs the model model_fn builds, which under EP holds only one rank's experts. Build the reference "
            "from the non-EP model yourself (dmuon.testing.reference_run), as tests/test_moe_ep.py does"
        )
    loss_bound, param_bound = bounds(ns_dtype)
    optimizer_kwargs = dict(optimizer_kwargs or {})
    if "ns_dtype" in optimizer_kwargs:
        raise TypeError("check_against_reference: pass ns_dtype as its own argument, not in optimizer_kwargs")
    ref_hp = dict(optimizer_kwargs if reference_kwargs is None else reference_kwargs)
    ref_hp.pop("ns_backend", None)
    ref_hp.pop("ns_dtype", None)

    results = run_distributed(
        _dmuon_worker, world_size, model_fn, loss_fn, batches, mesh_shape, seed,
        dict(dedicate_kwargs or {}), dict(fully_shard_kwargs or {}), {**optimizer_kwargs, "ns_dtype": ns_dtype},
        timeout_s=timeout_s, threads=threads,
    )
    plan = ShardingPlan.from_json(results[0]["plan_json"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref_model = model_fn()
    ref_losses, ref_state = reference_run(
        ref_model, loss_fn, batches, proxies_from_plan(plan, stack_layouts), ns_dtype=ns_dtype, **ref_hp
    )
    losses = results[0]["losses"]
    state = results[0]["state"]
    loss_dev = max(_rel_dev(a, b) for a, b in zip(losses, ref_losses))
    if set(state) != set(ref_state):
        raise RuntimeError(
            f"check_against_reference: state-dict keys differ: only dmuon {sorted(set(state) - set(ref_state))}, "
            f"only the reference {sorted(set(ref_state) - set(state))}"
        )
    param_devs: dict[str, float] = {}
    for k, want in ref_state.items():
        got = state[k]
        if not torch.is_floating_point(want):
            param_devs[k] = 0.0 if torch.equal(got, want) else math.inf
            continue
        if got.shape != want.shape:
            param_devs[k] = math.inf
            continue
        want64, got64 = want.double(), got.double()
        scale = want64.abs().max().item() or 1.0
        d = (got64 - want64).abs().max().item() / scale if want.numel() else 0.0
        param_devs[k] = d if math.isfinite(d) else math.inf
    worst = max(param_devs, key=param_devs.get) if param_devs else None
    return Report(
        world_size=world_size,
        mesh_shape=mesh_shape,
        ns_dtype=str(ns_dtype),
        dedicated=tuple(plan.dedicated),
        losses=tuple(losses),
        reference_losses=tuple(ref_losses),
        loss_dev=loss_dev,
        param_devs=param_devs,
        param_dev=param_devs[worst] if worst is not None else 0.0,
        worst_param=worst,
        loss_bound=loss_bound,
        param_bound=param_bound,
    )
