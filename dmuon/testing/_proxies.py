"""Proxies: the 2-D matrices ``torch.optim.Muon`` is given for each Muon-target parameter, as
slices of the real parameter (:class:`Proxy`), and their constructors (:func:`matrix`,
:func:`conv`, :func:`matrix_view`, :func:`expert_stack`, :func:`proxies_for`,
:func:`proxies_from_plan`). Part of :mod:`dmuon.testing` (its docstring: the reference)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Optional, Union

from torch import Tensor

__all__ = [
    "Proxy",
    "EXPERT_LAYOUTS",
    "matrix",
    "conv",
    "matrix_view",
    "expert_stack",
    "proxies_for",
    "proxies_from_plan",
]


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
        raise KeyError(
            f"stack_layouts names parameters that are not dedicated 3-D stacks of the plan: {sorted(stack_layouts)}"
        )
    return out


def _shape(shape: Sequence[int], nd: int, what: str) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != nd:
        raise ValueError(f"{what}: expected a {nd}-D shape, got {shape}")
    return shape
