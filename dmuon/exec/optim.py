"""``dmuon.Muon``: Muon on dedicated matrices (owner rank only), AdamW on everything else.

A *dedicated* parameter is one that :func:`dmuon.exec.apply` tagged with ``p._dmuon`` (a
``DedicatedInfo`` with fields ``fqn, owner_global_rank, is_owner, matrix_shape, num_matrices,
shape``). On its owner rank the parameter is the full master tensor and, after backward,
its ``.grad`` holds the data-parallel average; on every other rank it is a zero-size
placeholder that never gets a gradient. So the Muon update below runs once per matrix in the
whole job, on the owner, with no communication. Every other parameter (typically an FSDP2
``DTensor`` shard) gets AdamW through torch's own functional implementation.

Numerical reference: a single process running ``torch.optim.Muon`` on the dedicated
parameters and ``torch.optim.AdamW`` on the rest. On one process with 2-D dedicated
parameters and the default bf16 iteration this class is bit-identical to that pair.

Sources: Muon, Jordan et al. 2024 (https://kellerjordan.github.io/posts/muon/);
``"match_rms_adamw"`` learning-rate scaling, Liu et al., "Muon is Scalable for LLM
Training" (Moonlight, arXiv 2502.16982); AdamW, Loshchilov & Hutter (arXiv 1711.05101).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim.adamw import adamw as _torch_adamw

from dmuon.plan import cost as _cost
from dmuon.plan.records import dtype_str
from dmuon.plan.render import fmt_names

from . import checkpoint as _checkpoint
from . import fsdp2 as _fsdp2
from . import newton_schulz as _ns
from . import tp_orthogonalize as _tp
from .runtime import after_step, wait_pending

__all__ = ["Muon", "adjust_lr"]

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def adjust_lr(lr: float, adjust_lr_fn: Optional[str], matrix_shape: Sequence[int]) -> float:
    """Learning rate of the orthogonalised update of one ``(m, n)`` matrix.

    Same rule and float op order as ``torch.optim._muon._adjust_lr``:

    - ``None`` / ``"original"`` (Jordan et al. 2024): ``lr * sqrt(max(1, m / n))``;
    - ``"match_rms_adamw"`` (Moonlight, arXiv 2502.16982): ``lr * 0.2 * sqrt(max(m, n))``,
      which gives the update the RMS of a typical AdamW update so AdamW's lr and weight
      decay transfer.

    ``matrix_shape`` is the matrix view ``(m, n)`` (for a conv weight ``(out, in·kh·kw)``,
    for an expert stack one expert's ``(m, n)``), never the raw parameter shape.

    Raises:
        ValueError: an unknown ``adjust_lr_fn``.
    """
    A, B = matrix_shape[0], matrix_shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    else:
        raise ValueError(
            f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected one of {_ADJUST_LR_FNS}"
        )
    return lr * ratio


def _scalar_dtype() -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype(): dtype of AdamW's "step" counter.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _as_dtype(value: Any, what: str) -> torch.dtype:
    if isinstance(value, str):
        resolved = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"{what}: {value!r} does not name a torch dtype")
        value = resolved
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{what} must be a real floating-point torch.dtype, got {value!r}")
    return value


def _info(p: Tensor):
    return getattr(p, "_dmuon", None)


def _check_dedicated(p: Tensor) -> None:
    info = _info(p)
    where = f"dedicated parameter {getattr(info, 'fqn', '?')!r}"
    shape = tuple(int(s) for s in info.shape)
    if len(shape) < 2:
        raise ValueError(
            f"{where} has shape {shape}: Muon needs a matrix (>= 2-D); leave 1-D parameters "
            "(biases, norms) to AdamW"
        )
    m, n = (int(s) for s in info.matrix_shape)
    k = int(info.num_matrices)
    if m <= 0 or n <= 0 or k <= 0 or k * m * n != math.prod(shape):
        raise ValueError(
            f"{where}: num_matrices={k} x matrix_shape={(m, n)} does not tile shape {shape}"
        )
    grouped = getattr(info, "group", None)
    if info.is_owner and grouped is not None:  # an owner-group member holds its block
        if tuple(p.shape) != grouped.block_shape(grouped.block):
            raise ValueError(
                f"{where}: this rank owns block {grouped.block} of it but holds a tensor of shape "
                f"{tuple(p.shape)}, expected {grouped.block_shape(grouped.block)}"
            )
    elif info.is_owner:
        if tuple(p.shape) != shape:
            raise ValueError(
                f"{where}: this rank owns it but holds a tensor of shape {tuple(p.shape)}, "
                f"expected the full {shape}"
            )
        if torch.is_complex(p):
            raise ValueError(f"{where}: Muon does not support complex parameters")


class Muon(torch.optim.Optimizer):
    r"""Muon for dedicated matrices, AdamW for all other parameters, in one optimizer.

    Args:
        model_or_params: an ``nn.Module`` (all of ``module.parameters()``) or an iterable of
            parameters (all of them: dedicated ones, placeholders and the rest). Param-group
            dicts are not accepted here; use :meth:`add_param_group` after construction.
        lr: Muon learning rate (before :func:`adjust_lr` scaling). Default 1e-3.
        weight_decay: Muon decoupled weight decay, ``p *= 1 - lr * weight_decay``. Default 0.1.
        momentum: Muon momentum ``mu``. Default 0.95.
        nesterov: Nesterov momentum (the NS input is ``g.lerp(buf, mu)``). Default True.
        ns_coefficients: ``(a, b, c)``, a per-step table of ``ns_steps`` triples, or a key of
            :data:`dmuon.exec.newton_schulz.NS_PRESETS`: ``"muon"`` (the default triple) or
            ``"polar_express"`` (Amsel et al., arXiv 2505.16932: 8 per-step triples, the
            first ``ns_steps`` used, the last repeated beyond 8). A preset name is resolved
            at construction; the group stores the triple or the per-step table.
        eps: Frobenius-norm clamp of the NS normalisation. Default 1e-7.
        ns_steps: Newton-Schulz iterations, ``0 <= ns_steps < 100``. Default 5.
        adjust_lr_fn: ``None`` | ``"original"`` | ``"match_rms_adamw"`` (see :func:`adjust_lr`).
        ns_dtype: dtype of the NS iteration. Default ``torch.bfloat16`` (as torch.optim.Muon);
            ``torch.float32`` for the tight numerical contract.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW hyper-parameters
            (torch.optim.AdamW semantics; defaults 1e-3, (0.9, 0.999), 1e-8, 1e-2).
        ns_backend: keyword-only. ``"standard"`` (default): :func:`~dmuon.exec.newton_schulz.
            newton_schulz`, bit-identical to torch.optim.Muon as described below.
            ``"gram"``: :func:`~dmuon.exec.newton_schulz.gram_newton_schulz` (Gram
            Newton-Schulz with its default restarts and safe fallback): the same polynomial in
            exact arithmetic, fewer FLOPs for matrices with ``max(m, n) >> min(m, n)``;
            numerically it differs (tests/test_optim_single.py, after 5 steps, relative to each
            tensor's largest magnitude: parameters within 1e-12 of the standard backend with
            ``ns_dtype`` fp64, 1e-4 with fp32, 0.15 with bf16; measured 8e-15, 5e-6, 5e-2).
            An option, never a silent default.
            ``"auto"``: :func:`~dmuon.exec.newton_schulz.auto_newton_schulz`, per matrix
            (per NS batch, which shares one shape) Gram NS where the short side is at least
            ``GRAM_AUTO_MIN_SIDE`` = 256 and it needs fewer FLOPs for the shape and ``ns_steps``,
            the standard iteration elsewhere
            (:func:`dmuon.plan.cost.choose_ns_backend`); opt-in. Needs a plan compiled with
            ``ns_backend="auto"`` (``dedicate_params(..., ns_backend="auto")``), which records
            each matrix's backend in its ``ParamSpec`` so that ``cost_model="ns_flops"``
            balances the FLOPs that run; a mismatch between the plan's record and what this
            optimizer would run raises ``ValueError`` (a default plan still accepts ``"gram"``).
            Measured deviation and savings: docs/newton_schulz.md.

    Param groups (fixed layout, whatever the model holds):
        ``param_groups[0]``: the Muon group, every dedicated parameter (owners' masters and
        non-owners' zero-size placeholders, in the given order), keys ``"params", "lr",
        "momentum", "nesterov", "weight_decay", "ns_coefficients", "ns_steps", "eps",
        "adjust_lr_fn", "ns_dtype", "ns_backend", "use_muon"=True``.
        ``param_groups[1]``: the AdamW group, every other parameter, keys ``"params", "lr",
        "betas", "eps", "weight_decay", "use_muon"=False``.
        Both groups always exist (either may be empty), so a ``LambdaLR`` with two lambdas
        ``[muon_fn, adamw_fn]`` works on every rank and every model. Groups added later with
        :meth:`add_param_group` are appended; their missing keys come from the constructor
        arguments of their kind (``"use_muon"`` defaults to whether the params are dedicated).

    State (``optimizer.state[p]``):
        dedicated, this rank the owner: ``"momentum_buffer"``, full parameter shape and dtype,
        created as zeros at construction (so state keys are known before the first step);
        non-owner placeholders: no state.
        AdamW params: ``"step"`` (0-d float32 CPU tensor, as torch keeps it), ``"exp_avg"``,
        ``"exp_avg_sq"`` (like the param, DTensor shards for FSDP2 params), created as zeros at
        construction (and by :meth:`add_param_group`): the numbers torch's lazy first-step
        initialisation would make, so the steps are identical; only the allocation moves to
        construction. Reason: ``torch.distributed.checkpoint``'s ``get/set_optimizer_state_dict``
        run a dummy ``step()`` on every rank whose ``optimizer.state`` is empty, and with lazy
        state that would be exactly the ranks that own no matrix, so a job resumed into a fresh
        optimizer would step on some ranks only. A rank whose state is empty even so (it owns
        no matrix and holds no AdamW parameter) turns that dummy step into a local no-op.
        :meth:`init_state` re-creates any entry missing (e.g. after ``state.clear()``).

    Muon step, for each dedicated parameter this rank owns whose ``.grad`` is not None
    (others are skipped exactly as torch.optim.Muon skips a gradient-less parameter: no
    momentum, no decay). With the matrix view ``(k, m, n)`` = ``(num_matrices,) +
    matrix_shape`` of the tag (``(m, n)`` when ``k == 1``)::

        buf.lerp_(g, 1 - momentum)                      # elementwise, full shape
        u = g.lerp(buf, momentum) if nesterov else buf
        o = newton_schulz(u.view(k, m, n), ...)         # each (m, n) matrix on its own
                                                        # (gram_newton_schulz if ns_backend="gram")
        p.mul_(1 - lr * weight_decay)
        p.add_(o.view_as(p), alpha=-adjust_lr(lr, adjust_lr_fn, (m, n)))

    — ``torch.optim._muon._single_tensor_muon``'s ops in its order. Conv weights
    ``(out, in, kh, kw)`` use their tag's ``(out, in·kh·kw)`` view; expert stacks
    ``(E, m, n)`` orthogonalise each expert's matrix separately. A matrix with a plan
    ``MatrixView`` (``info.view``: per-head / split-QKV blocks) runs the NS and the
    ``adjust_lr`` scaling on each block as a matrix of its own (momentum and decay are
    elementwise), i.e. torch.optim.Muon given every block as a parameter; with TP
    (``tp_ns="local"``) each TP rank does so for the blocks in its shard.

    NS batching (how the NS calls are grouped; the math per matrix is the same):
        ``ns_dtype`` bf16 / fp16 (default): no batching. One 2-D :func:`newton_schulz` call per
        matrix, an expert stack loops over its ``E`` matrices, so a 2-D parameter is
        bit-identical to torch.optim.Muon and an expert stack to torch.optim.Muon run on
        each slice.
        ``ns_dtype`` fp32 / fp64: the owned matrices of one group that have a gradient are
        bucketed by ``(min(m, n), max(m, n), dtype, device)`` in parameter order (a tall
        matrix enters its bucket transposed, which is exactly what the NS does to it anyway,
        so e.g. an MLP's ``(4d, d)`` and ``(d, 4d)`` weights share one call); each bucket is
        concatenated into one ``(B, d, D)`` batch (at most ``2**26`` elements per call; a
        larger single unit runs alone) and orthogonalised by one batched call
        (``bmm``/``baddbmm``, per-matrix norms). A bucket of a single 2-D matrix uses the 2-D
        path. This differs from the per-matrix loop only by ``bmm`` vs ``mm`` reduction order,
        inside the fp32 numerical contract. Costs one transient copy of the bucket's updates.

    Step hooks: ``step()`` first evaluates ``closure`` (if any), then calls
    ``dmuon.exec.runtime.wait_pending(params)`` (to finish in-flight gradient reduces), runs
    the Muon and AdamW groups, and finally calls ``dmuon.exec.runtime.after_step(params)``
    (HSDP replicate broadcast). ``params`` is the list of all dedicated parameters of this
    optimizer (placeholders included), in param-group order. Both are no-ops for parameters
    whose tag has no live runtime, so this class works without ``dmuon.exec.apply``. The first
    ``step()`` also checks the set-up order (:func:`_check_set_up_order`: built after
    ``fully_shard``, every non-dedicated parameter in a ``fully_shard`` unit) and raises the same
    ``RuntimeError`` on every rank otherwise.

    Loss scaling: ``torch.amp.GradScaler`` (and ``ShardedGradScaler``) call
    :meth:`_unscale_grads_for_scaler` for this optimizer (installed by ``import dmuon``,
    :mod:`dmuon.exec.amp`), so every rank agrees on skipping a step with an inf/NaN gradient.

    AdamW: torch's functional ``torch.optim.adamw.adamw`` with ``amsgrad=False,
    maximize=False, foreach=None, fused=None, capturable=False, differentiable=False``, i.e.
    torch.optim.AdamW's defaults including its foreach choice (per-tensor loop on CPU,
    foreach kernels on CUDA), so the result is bit-identical to ``torch.optim.AdamW``.

    ``ns_dtype`` is stored in its group as a ``torch.dtype`` (``torch.save`` and
    ``torch.load(weights_only=True)`` handle it); :meth:`load_state_dict` also accepts it as
    a string such as ``"torch.bfloat16"``, and tuples that a serialiser turned into lists.

    Raises:
        TypeError: ``model_or_params`` is a tensor, contains param-group dicts or
            non-tensors.
        ValueError: a bad hyper-parameter (negative lr / weight decay / momentum / eps, beta
            outside [0, 1), unknown ``adjust_lr_fn``, ``ns_steps`` outside [0, 100),
            malformed ``ns_coefficients``, non-float ``ns_dtype``, unknown ``ns_backend``),
            a dedicated parameter
            that is not a matrix (1-D), whose tag does not tile its shape or whose owner
            tensor is not full-size, duplicate parameters, or an empty parameter list.
        RuntimeError (in step): sparse gradients; at the first step, a set-up order mistake
            (built before ``fully_shard``, or parameters outside every ``fully_shard`` unit).
    """

    def __init__(
        self,
        model_or_params: Union[nn.Module, Iterable[Tensor]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: _ns.Coefficients = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        *,
        ns_backend: str = "standard",
    ) -> None:
        params = self._collect(_fsdp2.sharded_params_for_optimizer(model_or_params))
        self._muon_defaults = self._checked_muon_hparams(
            {
                "lr": lr,
                "momentum": momentum,
                "nesterov": nesterov,
                "weight_decay": weight_decay,
                "ns_coefficients": ns_coefficients,
                "ns_steps": ns_steps,
                "eps": eps,
                "adjust_lr_fn": adjust_lr_fn,
                "ns_dtype": ns_dtype,
                "ns_backend": ns_backend,
            }
        )
        self._adamw_defaults = self._checked_adamw_hparams(
            {
                "lr": adamw_lr,
                "betas": adamw_betas,
                "eps": adamw_eps,
                "weight_decay": adamw_weight_decay,
            }
        )
        dedicated = [p for p in params if _info(p) is not None]
        others = [p for p in params if _info(p) is None]
        groups = [
            {"params": dedicated, "use_muon": True},
            {"params": others, "use_muon": False},
        ]
        # Per-group dicts carry every hyper-parameter; `defaults` stays empty so that
        # Optimizer.add_param_group does not leak Muon keys into AdamW groups or back.
        super().__init__(groups, {})
        self._set_up_checked = False  # _check_set_up_order runs at the first step
        # DTensor momentum for torch.distributed.checkpoint (no-ops without a live runtime)
        _checkpoint.register_optimizer_hooks(self)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _collect(model_or_params) -> list[Tensor]:
        if isinstance(model_or_params, nn.Module):
            params = list(model_or_params.parameters())
        elif isinstance(model_or_params, Tensor):
            raise TypeError(
                "dmuon.Muon takes an nn.Module or an iterable of parameters, got a single "
                "Tensor; wrap it in a list"
            )
        else:
            params = list(model_or_params)
        for i, p in enumerate(params):
            if isinstance(p, dict):
                raise TypeError(
                    "dmuon.Muon builds its own param groups from an nn.Module or an iterable "
                    "of parameters; param-group dicts are not accepted (use add_param_group "
                    "after construction)"
                )
            if not isinstance(p, Tensor):
                raise TypeError(f"parameter {i} is a {type(p).__name__}, not a Tensor")
        if not params:
            raise ValueError("dmuon.Muon got an empty parameter list")
        seen: set[int] = set()
        for p in params:
            if id(p) in seen:
                raise ValueError(
                    "dmuon.Muon got the same parameter twice; pass each tensor once "
                    "(nn.Module.parameters() already removes tied duplicates)"
                )
            seen.add(id(p))
        return params

    @staticmethod
    def _checked_muon_hparams(h: dict) -> dict:
        h = dict(h)
        lr = h["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Muon learning rate must be >= 0, got {lr}")
        if not 0.0 <= h["momentum"]:
            raise ValueError(f"momentum must be >= 0, got {h['momentum']}")
        if not 0.0 <= h["weight_decay"]:
            raise ValueError(f"weight_decay must be >= 0, got {h['weight_decay']}")
        if not 0.0 <= h["eps"]:
            raise ValueError(f"eps must be >= 0, got {h['eps']}")
        if h["adjust_lr_fn"] not in _ADJUST_LR_FNS:
            raise ValueError(
                f"unknown adjust_lr_fn {h['adjust_lr_fn']!r}; expected one of {_ADJUST_LR_FNS}"
            )
        h["nesterov"] = bool(h["nesterov"])
        # Resolve preset names, validate the table against ns_steps, normalise lists to
        # tuples; a constant schedule is stored as its single triple (torch's layout).
        coeffs, steps = h["ns_coefficients"], h["ns_steps"]
        schedule = _ns.coefficient_schedule(coeffs, steps)
        if isinstance(coeffs, str):
            coeffs = _ns.NS_PRESETS[coeffs]
        if _ns._is_triple(coeffs):
            h["ns_coefficients"] = tuple(float(v) for v in coeffs)
        else:
            h["ns_coefficients"] = schedule
        h["ns_dtype"] = _as_dtype(h["ns_dtype"], "ns_dtype")
        _ns.get_ns_backend(h["ns_backend"])  # ValueError naming the known backends
        return h

    @staticmethod
    def _checked_adamw_hparams(h: dict) -> dict:
        h = dict(h)
        lr = h["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor adamw_lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"AdamW learning rate must be >= 0, got {lr}")
        if not 0.0 <= h["eps"]:
            raise ValueError(f"AdamW eps must be >= 0, got {h['eps']}")
        if not 0.0 <= h["weight_decay"]:
            raise ValueError(f"AdamW weight_decay must be >= 0, got {h['weight_decay']}")
        betas = tuple(h["betas"])
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW betas must be two numbers in [0, 1), got {h['betas']!r}")
        h["betas"] = betas
        return h

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Append a Muon or AdamW group; missing keys come from the constructor arguments.

        ``"use_muon"`` defaults to True when every param is dedicated, False when none is.

        Raises:
            ValueError: mixed dedicated / non-dedicated params without ``"use_muon"``, a
                dedicated param in an AdamW group or vice versa, or a bad hyper-parameter.
        """
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        group["params"] = params
        tagged = [_info(p) is not None for p in params]
        use_muon = group.get("use_muon")
        if use_muon is None:
            if any(tagged) and not all(tagged):
                raise ValueError(
                    "param group mixes dedicated and non-dedicated parameters; split it or "
                    "set 'use_muon'"
                )
            use_muon = bool(params) and all(tagged)
        use_muon = bool(use_muon)
        if use_muon and not all(tagged):
            raise ValueError("a Muon group ('use_muon': True) may hold only dedicated parameters")
        if not use_muon and any(tagged):
            raise ValueError(
                "dedicated parameters (tagged p._dmuon) must be in a Muon group, not AdamW: "
                "their AdamW state would exist only on the owner"
            )
        defaults = self._muon_defaults if use_muon else self._adamw_defaults
        for key, value in defaults.items():
            group.setdefault(key, value)
        hparams = {k: group[k] for k in defaults}
        checked = (self._checked_muon_hparams if use_muon else self._checked_adamw_hparams)(hparams)
        group.update(checked)
        group["use_muon"] = use_muon
        if use_muon:
            for p in params:
                _check_dedicated(p)
                tp = getattr(_info(p), "tp", None)  # None: no TP (or a test double)
                if (tp is not None and tp.method == "gram") or getattr(_info(p), "group", None) is not None:
                    what = "TP-sharded" if tp is not None else "owner-grouped"
                    _tp.check_gram_steps(group["ns_steps"], _info(p).runtime().plan, _info(p).fqn, what)
            for p in params:
                _check_planned_ns_backend(p, group)
        super().add_param_group(group)
        if use_muon:
            self._init_muon_state(group)
        else:
            # eager, so that every rank's optimizer.state is non-empty from construction (see
            # "State" in the class docstring): torch.distributed.checkpoint never dummy-steps it
            for p in params:
                if len(self.state[p]) == 0:
                    self._init_adamw_state(p, self.state[p])

    def _init_muon_state(self, group: dict) -> None:
        for p in group["params"]:
            info = _info(p)
            if info.is_owner and "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format
                )
            elif not info.is_owner:
                self.state.pop(p, None)

    @torch.no_grad()
    def init_state(self) -> None:
        """Create every state entry now: Muon momentum (already eager) and AdamW
        ``step``/``exp_avg``/``exp_avg_sq`` (zeros, as torch's lazy init makes them).

        Numerically a no-op: the first step with a gradient would create identical tensors.
        """
        for group in self.param_groups:
            if group["use_muon"]:
                self._init_muon_state(group)
                continue
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self._init_adamw_state(p, state)

    @staticmethod
    def _init_adamw_state(p: Tensor, state: dict) -> None:
        # torch.optim.Adam._init_group, capturable=False and fused=False branch.
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # ------------------------------------------------------------------ (de)serialisation

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_muon_defaults"] = self._muon_defaults
        state["_adamw_defaults"] = self._adamw_defaults
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Standard ``Optimizer.load_state_dict``, plus: ``ns_dtype`` may be a string,
        tuple-valued hyper-parameters may arrive as lists, and owned dedicated matrices
        missing from the loaded state get a zero momentum buffer (the eager-state invariant).

        Before anything else (so before any collective of the checkpoint hooks, on every rank
        alike) the state dict is checked against this optimizer: the same number of groups of
        the same kinds and sizes, state keys that index a parameter, each entry with exactly
        this optimizer's keys (Muon: ``momentum_buffer``; AdamW: ``step``, ``exp_avg``,
        ``exp_avg_sq``) and tensors of the parameter's (full logical) shape. A parameter with
        no entry at all starts from zeros, as torch treats a parameter that never stepped.

        Raises:
            ValueError: a state dict of another optimizer layout or another model (the message
                names the first mismatching group, key or parameter FQN), or a bad
                hyper-parameter.
        """
        self._check_loadable(state_dict)
        state_dict = dict(state_dict)
        groups = []
        for saved in state_dict["param_groups"]:
            saved = dict(saved)
            if saved.get("use_muon"):
                keys = self._muon_defaults.keys()
                checker = self._checked_muon_hparams
                saved.setdefault("ns_backend", "standard")  # checkpoints from before ns_backend
            else:
                keys = self._adamw_defaults.keys()
                checker = self._checked_adamw_hparams
            if all(k in saved for k in keys):
                hp = {k: saved[k] for k in keys}
                if isinstance(hp.get("ns_coefficients"), list):
                    coeffs = hp["ns_coefficients"]
                    hp["ns_coefficients"] = (
                        tuple(tuple(t) for t in coeffs)
                        if coeffs and isinstance(coeffs[0], (list, tuple))
                        else tuple(coeffs)
                    )
                saved.update(checker(hp))
            groups.append(saved)
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        # Optimizer.__setstate__ adds defaults["differentiable"]; keep defaults empty so that
        # later add_param_group calls do not grow an extra key.
        self.defaults.pop("differentiable", None)
        for group in self.param_groups:
            if group["use_muon"]:
                self._init_muon_state(group)

    _MUON_STATE_KEYS = frozenset({"momentum_buffer"})
    _ADAMW_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})

    def _param_name(self, p: Tensor) -> str:
        """FQN of ``p`` (dedicated: its tag; else looked up in its model, when dmuon knows it)."""
        info = _info(p)
        if info is not None:
            return info.fqn
        for q in self._dedicated_params():
            rt = getattr(_info(q), "runtime", None)
            model = rt().model_ref() if callable(rt) and rt() is not None else None
            if model is not None:
                for name, r in model.named_parameters():
                    if r is p:
                        return name
        return f"<parameter of shape {tuple(p.shape)}>"

    def _check_loadable(self, state_dict: dict) -> None:
        """Raise ``ValueError`` naming the first mismatch between ``state_dict`` and this
        optimizer (see :meth:`load_state_dict`); local, no collective."""
        how = (
            "load a checkpoint saved by this model's dmuon.Muon (same model, predicate and "
            "param groups; the world size may differ)"
        )
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"dmuon.Muon.load_state_dict: the state dict has {len(saved_groups)} param groups, this "
                f"optimizer {len(self.param_groups)}; {how}"
            )
        index: dict[Any, tuple[Tensor, bool]] = {}
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            kind = "Muon" if group["use_muon"] else "AdamW"
            if bool(saved.get("use_muon", group["use_muon"])) != group["use_muon"]:
                raise ValueError(
                    f"dmuon.Muon.load_state_dict: param group {g} is a {kind} group here but not in the "
                    f"state dict; {how}"
                )
            if len(saved["params"]) != len(group["params"]):
                extra = group["params"][len(saved["params"])] if len(group["params"]) > len(saved["params"]) else None
                first = f" (first parameter without a saved counterpart: {self._param_name(extra)!r})" if extra is not None else ""
                raise ValueError(
                    f"dmuon.Muon.load_state_dict: {kind} param group {g} holds {len(group['params'])} parameters "
                    f"here but {len(saved['params'])} in the state dict{first}. The dedicated set or the model "
                    f"differs (another predicate or hook-boundary choice dedicates other matrices); {how}"
                )
            for key, p in zip(saved["params"], group["params"]):
                index[key] = (p, group["use_muon"])
        for key, entry in state_dict.get("state", {}).items():
            if key not in index:
                raise ValueError(
                    f"dmuon.Muon.load_state_dict: state key {key!r} indexes no parameter of the state dict's "
                    f"param groups; {how}"
                )
            p, use_muon = index[key]
            want = self._MUON_STATE_KEYS if use_muon else self._ADAMW_STATE_KEYS
            got = set(entry) if isinstance(entry, dict) else set()
            name = self._param_name(p)
            if got and got != want:
                raise ValueError(
                    f"dmuon.Muon.load_state_dict: the state of {name!r} (key {key!r}) has keys {sorted(got)}, "
                    f"expected {sorted(want)} ({'Muon' if use_muon else 'AdamW'}); {how}"
                )
            shape = tuple(_info(p).shape) if use_muon else tuple(p.shape)
            for k in sorted(got - {"step"}):
                value = entry[k]
                if isinstance(value, Tensor) and tuple(value.shape) != shape:
                    raise ValueError(
                        f"dmuon.Muon.load_state_dict: state {k!r} of {name!r} has shape {tuple(value.shape)}, "
                        f"the parameter {shape}; {how}"
                    )

    # ------------------------------------------------------------------ loss scaling

    @torch.no_grad()
    def _unscale_grads_for_scaler(self, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool) -> dict:
        """``GradScaler._unscale_grads_`` for this optimizer (installed by ``import dmuon``, see
        :mod:`dmuon.exec.amp`): finish in-flight reduces, unscale every local gradient (a DTensor
        through its local shard) with torch's kernel per (device, dtype), then SUM-all-reduce the
        inf flag over the default process group so that every rank skips the same step.

        Collectives: one all-reduce of one float (when a process group is initialised), on
        every rank alike, whatever the gradients hold.

        Returns: ``{found_inf.device: found_inf}`` (0.0 or 1.0 on every rank), as the scaler expects.

        Raises:
            ValueError: an fp16 gradient with ``allow_fp16=False`` (torch's rule), on the rank that
                holds it, before the collective; sparse gradients are not supported.
        """
        import torch.distributed as dist

        wait_pending(self._dedicated_params())
        by_device: dict[torch.device, dict[torch.dtype, list[Tensor]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("dmuon.Muon: loss scaling does not support sparse gradients")
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                local = grad.to_local() if hasattr(grad, "to_local") else grad  # DTensor: its shard
                by_device.setdefault(local.device, {}).setdefault(local.dtype, []).append(local)
        flags = []
        for device, per_dtype in by_device.items():
            flag = torch.zeros_like(found_inf, device=device)
            scale = inv_scale.to(device)
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, scale)
            flags.append(flag.to(found_inf.device))
        for flag in flags:
            found_inf.add_(flag)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from . import collectives as C

            C.all_reduce_sum(found_inf, group=None, phase="other")
        found_inf.clamp_(max=1.0)
        return {found_inf.device: found_inf}

    # ------------------------------------------------------------------ step

    def _dedicated_params(self) -> list[Tensor]:
        return [p for g in self.param_groups if g["use_muon"] for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One optimisation step over all groups; returns ``closure()``'s loss (or None).

        Order: ``closure`` (with grad enabled) → ``runtime.wait_pending(dedicated)`` →
        Muon groups and AdamW groups in ``param_groups`` order →
        ``runtime.after_step(dedicated)``. See the class docstring.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dedicated = self._dedicated_params()
        if not self.state and _is_dcp_dummy_step(dedicated):
            # torch.distributed.checkpoint's _init_optim_state on a rank with nothing to initialise
            # (no owned matrix, no AdamW parameter): no state to create, no collective to join
            for p in dedicated:
                p.grad = None
            return loss
        wait_pending(dedicated)
        if not self._set_up_checked:
            _check_set_up_order(self, dedicated)
            self._set_up_checked = True
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group_step(group)
            else:
                self._adamw_group_step(group)
        after_step(dedicated)
        return loss

    def _muon_group_step(self, group: dict) -> None:
        """Muon on the matrices of ``group`` this rank owns that have a gradient (see the class
        docstring): momentum, then Newton-Schulz per matrix or per bucket, then the update."""
        lr = group["lr"]
        if isinstance(lr, Tensor):
            lr = lr.item()
        weight_decay, adjust_lr_fn = group["weight_decay"], group["adjust_lr_fn"]
        orthogonalize, ns_kw = _ns_settings(group)

        def apply(p: Tensor, ortho: Tensor, matrix_shape) -> None:
            _apply_update(p, ortho, lr, weight_decay, adjust_lr(lr, adjust_lr_fn, matrix_shape))

        # fp32 / fp64 NS batched by bucket (the rule in dmuon.plan.cost, which the simulator prices by)
        batched = dtype_str(ns_kw["dtype"]) in _cost.NS_BATCHED_DTYPES
        buckets: dict[tuple, list[tuple[Tensor, Tensor, int, int, int]]] = {}
        tp_entries: list[tuple[Tensor, Tensor, Any]] = []
        grouped_entries: list[tuple[Tensor, Tensor, Any]] = []
        for p in group["params"]:
            info = _info(p)
            grad = p.grad
            if not info.is_owner or grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            state = self.state[p]
            tp = getattr(info, "tp", None)
            view = getattr(info, "view", None)
            og = getattr(info, "group", None)
            if og is not None:  # owner group: momentum on this rank's block, sharded Gram NS below
                update = _momentum_update(grad, state, group["momentum"], group["nesterov"])
                grouped_entries.append((p, update, og))
                continue
            if tp is not None:  # TP-sharded: momentum on the local shard, NS on the TP group below
                update = _tp_momentum_update(grad, state, tp, group["momentum"], group["nesterov"])
                if tp.method != "local":
                    tp_entries.append((p, update, tp))
                    continue
                # view blocks inside this rank's shard: orthogonalised here like untouched matrices
                per = tp.shape[tp.shard_dim] // tp.size
                blocks = _view_blocks(p.to_local(), update, view, lo=tp.rank * per, length=per)
            elif view is not None:
                update = _momentum_update(grad, state, group["momentum"], group["nesterov"])
                blocks = _view_blocks(p, update, view, lo=0, length=int(info.shape[view.dim]))
            else:
                blocks = None
            if blocks is not None:  # each block as its own matrix: its NS, its adjust_lr
                for p_block, u_block in blocks:
                    m, n = p_block.shape
                    if batched:
                        buckets.setdefault(_bucket_key(u_block, m, n), []).append((p_block, u_block, 1, m, n))
                    else:
                        apply(p_block, _orthogonalize_matrices(u_block, 1, m, n, orthogonalize, ns_kw), (m, n))
                continue
            update = _momentum_update(grad, state, group["momentum"], group["nesterov"])
            m, n = (int(s) for s in info.matrix_shape)
            k = int(info.num_matrices)
            if batched:
                buckets.setdefault(_bucket_key(update, m, n), []).append((p, update, k, m, n))
                continue
            apply(p, _orthogonalize_matrices(update, k, m, n, orthogonalize, ns_kw), (m, n))

        for (d, D, _, _), entries in buckets.items():
            for chunk in _chunks(entries, d * D):
                for (p, _, _, m, n), o in zip(chunk, _orthogonalize_bucket(chunk, orthogonalize, ns_kw)):
                    apply(p, o, (m, n))

        if tp_entries:
            _tp.orthogonalize_and_apply(
                tp_entries, steps=group["ns_steps"], orthogonalize=orthogonalize, ns_kw=ns_kw, apply=apply
            )
        if grouped_entries:
            _tp.orthogonalize_groups_and_apply(grouped_entries, steps=group["ns_steps"], ns_kw=ns_kw, apply=apply)

    def _adamw_group_step(self, group: dict) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            has_complex |= torch.is_complex(p)
            state = self.state[p]
            if len(state) == 0:
                self._init_adamw_state(p, state)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _torch_adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            grad_scale=None,
            found_inf=None,
            has_complex=has_complex,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


# ----------------------------------------------------------------------------------------------
# One Muon step, piece by piece (each torch.optim._muon._single_tensor_muon's ops, in its order)
# ----------------------------------------------------------------------------------------------


def _check_planned_ns_backend(p: Tensor, group: dict) -> None:
    """The backend ``group`` runs on ``p`` must be the one its plan recorded
    (``ParamSpec.ns_backend``, ``dmuon.plan.compile(ns_backend=...)``), so that
    ``cost_model="ns_flops"`` balanced the FLOPs that run. ``"auto"`` must meet a plan compiled
    with ``ns_backend="auto"``; a plan that records Gram NS must meet a Muon that runs Gram NS
    there. (A plan compiled with the default ``"standard"`` accepts ``ns_backend="gram"``: its
    LPT weights are then the standard iteration's, as before ``ns_backend`` reached the plan.)
    No plan (a tag without a live runtime) or a TP-sharded matrix (``tp_ns`` decides): nothing
    to check.

    Raises:
        ValueError: naming the parameter, the two backends and the fix.
    """
    info = _info(p)
    if getattr(info, "tp", None) is not None or getattr(info, "group", None) is not None:
        return  # sharded Gram NS over the TP / owner group, whatever the group's backend
    runtime = getattr(info, "runtime", None)
    rt = runtime() if callable(runtime) else None
    plan = getattr(rt, "plan", None)
    if plan is None:
        return
    spec = plan.param(info.fqn)
    planned = spec.ns_backend
    mode = group["ns_backend"]
    if mode == "auto" and spec.view is not None:
        raise ValueError(
            f"dmuon.Muon: ns_backend='auto' with a matrix view ({info.fqn!r}) is not supported yet (its blocks "
            f"may differ in shape, so in the backend 'auto' picks); use ns_backend='standard' or 'gram'"
        )
    runs = _cost.choose_ns_backend(tuple(info.matrix_shape), mode, steps=group["ns_steps"])
    if runs != planned and (mode == "auto" or planned != "standard"):
        raise ValueError(
            f"dmuon.Muon: ns_backend={mode!r} (ns_steps={group['ns_steps']}) runs {runs!r} Newton-Schulz "
            f"on {info.fqn!r} {tuple(info.matrix_shape)}, but its plan records {planned!r}; compile the "
            f"plan with ns_backend={mode!r} (dmuon.plan.compile / dmuon.dedicate_params; 'auto' assumes "
            f"ns_steps={_cost.NS_STEPS}) or build dmuon.Muon with the plan's ns_backend"
        )


SET_UP_ORDER = (
    "dmuon.dedicate_params(model, mesh) -> fully_shard(block) for each block -> fully_shard(model) -> "
    "dmuon.Muon(model, ...)"
)


def _fsdp_managed_params(model: nn.Module) -> set[int] | None:
    """ids of the sharded parameters the ``fully_shard`` units in ``model`` manage (None if this
    torch's FSDP2 state does not expose them)."""
    from . import fsdp2

    managed: set[int] = set()
    for module in model.modules():
        state = fsdp2.fsdp_state(module)
        if state is None:
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for fp in getattr(group, "fsdp_params", None) or ():
                sharded = getattr(fp, "sharded_param", None)
                if sharded is None:
                    return None
                managed.add(id(sharded))
    return managed


def _check_set_up_order(opt: "Muon", dedicated: list[Tensor]) -> None:
    """First ``step()``: the optimizer must hold the model's FSDP2-sharded parameters.

    Two set-up mistakes would otherwise train without an error: ``dmuon.Muon`` built before
    ``fully_shard`` (it holds the pre-shard tensors that ``fully_shard`` replaced, so every
    non-dedicated parameter stays at its initial value), and a missing ``fully_shard`` (e.g. the
    final ``fully_shard(model)``: parameters outside every unit get no gradient averaging and the
    ranks drift apart). Local and structural, so every rank raises alike; skipped for a
    data-parallel mesh of one rank and without a live dmuon runtime. (Skipping only the per-block
    ``fully_shard`` calls is not an error: the root unit then manages every parameter, at the
    cost of one large all-gather.)

    Raises:
        RuntimeError: naming the count, the first parameters and the set-up order.
    """
    from .runtime import _runtimes

    runtimes = _runtimes(dedicated)
    if not runtimes or runtimes[0].world_numel == 1:
        return
    model = runtimes[0].model_ref()
    if model is None:
        return
    named = {id(p): n for n, p in model.named_parameters()}
    others = [p for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    stale = [p for p in others if id(p) not in named]
    if stale:
        raise RuntimeError(
            f"dmuon.Muon: {len(stale)} of its parameters are no longer parameters of the model "
            "(fully_shard replaced them with sharded DTensors after the optimizer was built), so they "
            f"would never be updated: build dmuon.Muon after fully_shard. Set-up order: {SET_UP_ORDER}"
        )
    managed = _fsdp_managed_params(model)
    if managed is None:
        return
    unmanaged = [named[id(p)] for p in others if p.requires_grad and id(p) not in managed]
    if unmanaged:
        shown = fmt_names([repr(n) for n in unmanaged], 4)
        raise RuntimeError(
            f"dmuon.Muon: {len(unmanaged)} non-dedicated parameters ({shown}) are not managed by any "
            "fully_shard unit, so their gradients are never averaged across ranks and the replicas "
            "drift apart: call fully_shard on every block, then fully_shard(model) (it takes every "
            f"parameter left over). Set-up order: {SET_UP_ORDER}"
        )


def _is_dcp_dummy_step(dedicated: list[Tensor]) -> bool:
    """A step whose non-owner placeholders hold gradients: only ``torch.distributed.checkpoint``'s
    state initialisation (``p.grad = zeros_like(p)`` on every parameter) makes those."""
    return any(p.grad is not None and not _info(p).is_owner for p in dedicated)


def _ns_settings(group: dict) -> tuple[Callable, dict]:
    """The group's Newton-Schulz backend and its keyword arguments (``coefficients, steps, eps,
    dtype``)."""
    orthogonalize = _ns.get_ns_backend(group.get("ns_backend", "standard"))
    ns_kw = dict(
        coefficients=_ns.coefficient_schedule(group["ns_coefficients"], group["ns_steps"]),
        steps=group["ns_steps"],
        eps=group["eps"],
        dtype=_as_dtype(group["ns_dtype"], "ns_dtype"),
    )
    return orthogonalize, ns_kw


def _momentum_update(grad: Tensor, state: dict, momentum: float, nesterov: bool) -> Tensor:
    """``buf.lerp_(g, 1 - momentum)``; the NS input is ``g.lerp(buf, momentum)`` (Nesterov) or
    ``buf``. The buffer is created as zeros when missing (e.g. state cleared by hand), as torch does."""
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def _tp_momentum_update(grad: Tensor, state: dict, tp, momentum: float, nesterov: bool) -> Tensor:
    """:func:`_momentum_update` of a TP-sharded matrix on its local shard (the buffer is a
    DTensor with the matrix's placement); returns the local NS input."""
    g_local = tp.local(grad)
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = tp.wrap(torch.zeros_like(g_local))
    b_local = tp.local(buf)
    b_local.lerp_(g_local, 1 - momentum)
    return g_local.lerp(b_local, momentum) if nesterov else b_local


def _orthogonalize_matrices(update: Tensor, k: int, m: int, n: int, orthogonalize, ns_kw: dict) -> Tensor:
    """Unbatched NS: one 2-D call per ``(m, n)`` matrix (an expert stack loops over its ``k``)."""
    if k == 1:
        mat = update if tuple(update.shape) == (m, n) else update.reshape(m, n)
        return orthogonalize(mat, **ns_kw)
    stack = update.reshape(k, m, n)
    ortho = torch.empty((k, m, n), dtype=ns_kw["dtype"], device=update.device)
    for i in range(k):
        ortho[i] = orthogonalize(stack[i], **ns_kw)
    return ortho


def _view_blocks(p: Tensor, update: Tensor, view, *, lo: int, length: int) -> list[tuple[Tensor, Tensor]]:
    """``(parameter block, update block)`` pairs of a :class:`~dmuon.plan.records.MatrixView`
    for the blocks inside ``[lo, lo + length)`` of its dim (``p`` / ``update`` hold that range:
    the whole matrix, or one TP rank's shard). Parameter blocks are views (updated in place);
    update blocks are contiguous copies, as ``torch.optim.Muon`` sees a block of its own."""
    out = []
    for off, size in zip(view.offsets(), view.sizes):
        if lo <= off < lo + length:
            start = off - lo
            out.append((p.narrow(view.dim, start, size), update.narrow(view.dim, start, size).contiguous()))
    return out


def _bucket_key(update: Tensor, m: int, n: int) -> tuple:
    """Batched NS bucket: tall and wide matrices of the same (min, max) side share one (NS of a
    tall G is the transpose of NS of the wide Gᵀ; newton_schulz itself transposes)."""
    return (*_cost.ns_bucket_sides(m, n), update.dtype, update.device)


def _orthogonalize_bucket(chunk: list, orthogonalize, ns_kw: dict) -> list[Tensor]:
    """Batched NS of one chunk of bucket entries ``(p, update, k, m, n)``: one call on their
    ``(B, d, D)`` concatenation (a lone 2-D matrix uses the 2-D path); one result per entry,
    in its own orientation."""
    if len(chunk) == 1 and chunk[0][2] == 1:
        _, update, _, m, n = chunk[0]
        mat = update if tuple(update.shape) == (m, n) else update.reshape(m, n)
        return [orthogonalize(mat, **ns_kw)]
    # (k, d, D) wide views; tall (k, D, d) matrices enter transposed.
    views = [u.reshape(k, m, n).mT if m > n else u.reshape(k, m, n) for _, u, k, m, n in chunk]
    stack = views[0] if len(views) == 1 else torch.cat(views)
    ortho = orthogonalize(stack, **ns_kw)
    return [o.mT if m > n else o for o, (_, _, _, m, n) in zip(ortho.split([e[2] for e in chunk]), chunk)]


def _apply_update(p: Tensor, ortho: Tensor, lr: float, weight_decay: float, scaled_lr: float) -> None:
    """Decoupled weight decay, then the scaled orthogonalised update (``_single_tensor_muon``)."""
    p.mul_(1 - lr * weight_decay)
    p.add_(ortho if ortho.shape == p.shape else ortho.reshape(p.shape), alpha=-scaled_lr)


def _chunks(entries: list, matrix_numel: int) -> Iterable[list]:
    """Bucket entries ``(p, update, k, m, n)`` as batched NS calls (:func:`dmuon.plan.cost.ns_batch_runs`)."""
    for run in _cost.ns_batch_runs([entry[2] * matrix_numel for entry in entries]):
        yield [entries[i] for i in run]
