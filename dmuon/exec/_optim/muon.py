"""``dmuon.Muon``: Muon on dedicated matrices (owner rank only), AdamW on everything else.

The update runs once per matrix in the whole job, on its owner, with no communication. What a
dedicated parameter is, the numerical reference and the sources: Note: dmuon.Muon
(docs/design.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim.adamw import adamw as _torch_adamw

from dmuon.plan import _rules as _rules

from dmuon.exec._optim import amp as _amp
from dmuon.exec._optim import normuon_update as _nm
from dmuon.exec._state import optimizer_state as _optimizer_state
from dmuon.exec._setup import fsdp2 as _fsdp2
from dmuon.exec._setup import host_offload as _host_offload
from dmuon.exec._optim import ns_backends as _ns
from dmuon import _update as _nsc
from dmuon.exec._optim import tp_orthogonalize as _tp
from dmuon.exec._setup.guards import check_set_up_order as _check_set_up_order
from dmuon.exec._runtime.packed_buffers import dedicated_info as _info
from dmuon._update import ADJUST_LR_FNS as _ADJUST_LR_FNS
from dmuon._update import adjust_lr
from dmuon.exec._optim.muon_step import _as_dtype, muon_step
from dmuon.exec._runtime.runtime import after_skipped_step, after_step, bare_stage_runtimes, runtimes_of, wait_pending
from dmuon.exec._optim import nonfinite_skip as _skip

__all__ = ["Muon", "adjust_lr"]


def _scalar_dtype() -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype(): dtype of AdamW's "step" counter.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_dedicated(p: Tensor) -> None:
    info = _info(p)
    where = f"dedicated parameter {getattr(info, 'fqn', '?')!r}"
    shape = tuple(int(s) for s in info.shape)
    if len(shape) < 2:
        raise ValueError(
            f"{where} has shape {shape}: Muon needs a matrix (>= 2-D); leave 1-D parameters (biases, norms) to AdamW"
        )
    m, n = (int(s) for s in info.matrix_shape)
    k = int(info.num_matrices)
    grouped = getattr(info, "group", None)
    if grouped is not None and grouped.experts is not None and grouped.block is not None:
        # a holder of a range of experts (its owner, and in HSDP the owner's replicas): num_matrices
        # counts the matrices of that range
        shape = tuple(grouped.block_shape(grouped.block))
    if m <= 0 or n <= 0 or k <= 0 or k * m * n != math.prod(shape):
        raise ValueError(f"{where}: num_matrices={k} x matrix_shape={(m, n)} does not tile shape {shape}")
    if info.is_owner and grouped is not None:  # an owner-group member holds its block
        if tuple(p.shape) != grouped.block_shape(grouped.block):
            raise ValueError(
                f"{where}: this rank owns block {grouped.block} of it but holds a tensor of shape "
                f"{tuple(p.shape)}, expected {grouped.block_shape(grouped.block)}"
            )
    elif info.is_owner:
        if tuple(p.shape) != shape:
            raise ValueError(
                f"{where}: this rank owns it but holds a tensor of shape {tuple(p.shape)}, expected the full {shape}"
            )
        if torch.is_complex(p):
            raise ValueError(f"{where}: Muon does not support complex parameters")


class Muon(torch.optim.Optimizer):
    r"""Muon for dedicated matrices, AdamW for all other parameters, in one optimizer.

    On each dedicated matrix's owner rank: ``torch.optim.Muon``'s update (momentum,
    Newton-Schulz, decoupled weight decay, :func:`adjust_lr` scaling) with no communication, by
    :func:`dmuon.exec._optim.muon_step.muon_step`; everything else: torch's functional AdamW. Param
    groups, state, the step's order, NS batching, loss scaling and the numerics: docs/runtime.md
    ("The optimizer"); backends and coefficients: docs/newton_schulz.md.

    Args:
        model_or_params: an ``nn.Module`` (all of ``module.parameters()``) or an iterable of
            parameters (all of them: dedicated ones, placeholders and the rest). Param-group
            dicts are not accepted here; use :meth:`add_param_group` after construction.
        lr: Muon learning rate (before :func:`adjust_lr` scaling). Default 1e-3.
        weight_decay: Muon decoupled weight decay, ``p *= 1 - lr * weight_decay``. Default 0.1.
        momentum: Muon momentum ``mu``. Default 0.95.
        nesterov: Nesterov momentum (the NS input is ``g.lerp(buf, mu)``). Default True.
        ns_coefficients: ``(a, b, c)``, a per-step table of ``ns_steps`` triples, or a key of
            :data:`dmuon._update.NS_PRESETS` (``"muon"``, the default triple,
            ``"polar_express"`` or ``"deepseek_v4"``).
        eps: Frobenius-norm clamp of the NS normalisation. Default 1e-7.
        ns_steps: Newton-Schulz iterations, ``0 <= ns_steps < 100``. Default None: 5, or the
            length of a fixed-length preset (``"deepseek_v4"``: 10) or of an explicit table
            (:func:`dmuon._update.resolve_ns_steps`); the resolved int is
            what the param group and ``state_dict()`` hold. A fixed-length preset with another
            count raises ``ValueError`` (never a silent truncation).
        adjust_lr_fn: ``None`` | ``"original"`` | ``"match_rms_adamw"`` (see :func:`adjust_lr`).
        ns_dtype: dtype of the NS iteration. Default ``torch.bfloat16`` (as torch.optim.Muon);
            ``torch.float32`` for the tight numerical contract.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW hyper-parameters
            (torch.optim.AdamW semantics; defaults 1e-3, (0.9, 0.999), 1e-8, 1e-2).
        ns_backend: keyword-only. ``"standard"`` (default, bit-identical to torch.optim.Muon),
            ``"gram"`` (Gram Newton-Schulz) or ``"auto"`` (per matrix; needs a plan compiled
            with ``ns_backend="auto"``), see docs/newton_schulz.md.
        ns_batching: keyword-only. ``"batched"`` (default): the owned matrices of a group with the
            same ``(short, long)`` sides, dtype and device share one Newton-Schulz call per bucket
            (an expert stack's matrices one call per owned range, cut between experts above
            ``NS_BATCH_MAX_NUMEL`` elements), with momentum, decay and update
            as foreach ops: a constant number of ops per bucket. ``"exact"``: one 2-D call per matrix
            and one op per tensor, bit for bit ``torch.optim.Muon`` (and its fp32-patched form with
            ``ns_dtype=torch.float32``). The two differ only by the reduction order of batched
            against single matmuls: per matrix within ``2⁻⁴`` relative Frobenius norm in bf16
            (:data:`dmuon._update.BATCHED_BF16_REL_BOUND`), ``1e-5`` in fp32; identical on the CPU
            builds measured (docs/newton_schulz.md, "Batching").
        variant: keyword-only. ``"muon"`` (default) or ``"normuon"``: NorMuon (arXiv 2510.05491),
            Muon's update normalised per output neuron with a second-moment vector per matrix,
            its Frobenius norm restored (:mod:`dmuon.exec._optim.normuon_update`; docs/muon_variants.md).
            No extra byte on the wire; refused (``ValueError``) on TP-sharded and owner-grouped
            matrices.
        normuon_beta2: keyword-only. NorMuon's EMA factor of the second moment. Default 0.95.
        normuon_eps: keyword-only. NorMuon's epsilon of both divisions (``eps`` stays the NS
            clamp). Default 1e-10.
        skip_nonfinite: keyword-only. ``True``: a step whose gradients are non-finite (``inf`` /
            ``nan``) on any rank is skipped on every rank together (no Muon or AdamW update, no
            step counter, momentum or moment change, no QK-clip), one flag vector reduced over the
            job (on ``dmuon.clip_grad_norm_``'s all-reduce when the step was clipped, else one
            all-reduce in ``step``), and rank 0 logs one warning on the ``dmuon`` logger naming
            the rank whose local gradient was non-finite before dmuon's reduce, else the ranks
            holding one after it (:mod:`dmuon.exec._optim.nonfinite_skip`).
            ``optimizer.last_step_skipped`` / ``optimizer.skipped_steps`` tell the caller, whose
            LR scheduler it is to step or not; with a ``GradScaler`` the scaler's own check runs
            first. A pipeline stage whose plan dedicates nothing (e.g. the embedding alone)
            takes part through its runtime, found from its parameters. Default ``False``: every
            step updates (a NaN propagates, as in torch).

    Raises:
        TypeError: ``model_or_params`` is a tensor, contains param-group dicts or
            non-tensors.
        ValueError: a bad hyper-parameter, a dedicated parameter that is not a matrix (1-D),
            whose tag does not tile its shape or whose owner tensor is not full-size, duplicate
            parameters, or an empty parameter list.
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
        ns_coefficients: _nsc.Coefficients = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: Optional[int] = None,
        adjust_lr_fn: Optional[str] = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        *,
        ns_backend: str = "standard",
        ns_batching: str = "batched",
        variant: str = "muon",
        normuon_beta2: float = _nm.NORMUON_BETA2,
        normuon_eps: float = _nm.NORMUON_EPS,
        skip_nonfinite: bool = False,
    ) -> None:
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}")
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
                "ns_batching": ns_batching,
                "variant": variant,
                "normuon_beta2": normuon_beta2,
                "normuon_eps": normuon_eps,
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
        if not dedicated:  # every rank warns alike (its Muon group stays, empty, for add_param_group)
            warnings.warn(
                f"dmuon.Muon: none of its {len(params)} parameters is dedicated, so Muon runs on nothing and "
                "every parameter trains with AdamW. Call dmuon.dedicate_params(model, mesh) on this model before "
                "building dmuon.Muon (and pass the same model); if dedicate_params ran and its plan dedicated "
                "nothing (dmuon.plan.compile warned why), fix the plan (hook_boundary_predicate=, predicate=) "
                "or train with torch.optim.AdamW.",
                stacklevel=2,
            )
        groups = [
            {"params": dedicated, "use_muon": True},
            {"params": others, "use_muon": False},
        ]
        # Per-group dicts carry every hyper-parameter; `defaults` stays empty so that
        # Optimizer.add_param_group does not leak Muon keys into AdamW groups or back.
        super().__init__(groups, {})
        self._set_up_checked = False  # _check_set_up_order runs at the first step
        self.skip_nonfinite = skip_nonfinite
        self.last_step_skipped = False  # skip_nonfinite: whether the last step() skipped the update
        self.skipped_steps = 0  # skip_nonfinite: steps skipped so far (not saved in state_dict())
        if skip_nonfinite:  # the runtimes check every reduce buffer their rank packs
            for rt in runtimes_of(dedicated) + bare_stage_runtimes(others):  # (a stage with nothing
                rt.check_nonfinite = True  # dedicated still joins the flags' reduce)
        # DTensor momentum for torch.distributed.checkpoint (no-ops without a live runtime)
        _optimizer_state.register_optimizer_hooks(self)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _collect(model_or_params) -> list[Tensor]:
        if isinstance(model_or_params, nn.Module):
            params = list(model_or_params.parameters())
        elif isinstance(model_or_params, Tensor):
            raise TypeError(
                "dmuon.Muon takes an nn.Module or an iterable of parameters, got a single Tensor; wrap it in a list"
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
            raise ValueError(f"unknown adjust_lr_fn {h['adjust_lr_fn']!r}; expected one of {_ADJUST_LR_FNS}")
        h["nesterov"] = bool(h["nesterov"])
        # Resolve preset names, validate the table against ns_steps, normalise lists to
        # tuples; a constant schedule is stored as its single triple (torch's layout).
        coeffs = h["ns_coefficients"]
        steps = h["ns_steps"] = _nsc.resolve_ns_steps(coeffs, h["ns_steps"])
        schedule = _nsc.coefficient_schedule(coeffs, steps)
        if isinstance(coeffs, str):
            coeffs = _nsc.NS_PRESETS[coeffs]
        if _nsc._is_triple(coeffs):
            h["ns_coefficients"] = tuple(float(v) for v in coeffs)
        else:
            h["ns_coefficients"] = schedule
        h["ns_dtype"] = _as_dtype(h["ns_dtype"], "ns_dtype")
        _ns.get_ns_backend(h["ns_backend"])  # ValueError naming the known backends
        _nsc.check_ns_batching(h.setdefault("ns_batching", "batched"))
        if h["variant"] not in _nm.VARIANTS:
            raise ValueError(f"unknown variant {h['variant']!r}; expected one of {_nm.VARIANTS}")
        if not 0.0 <= h["normuon_beta2"] < 1.0:
            raise ValueError(f"normuon_beta2 must be in [0, 1), got {h['normuon_beta2']}")
        if not 0.0 <= h["normuon_eps"]:
            raise ValueError(f"normuon_eps must be >= 0, got {h['normuon_eps']}")
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
                raise ValueError("param group mixes dedicated and non-dedicated parameters; split it or set 'use_muon'")
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
        if use_muon and "ns_coefficients" in group and "ns_steps" not in group:
            group["ns_steps"] = None  # the group's own coefficients decide (resolve_ns_steps)
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
                if group["variant"] == "normuon":
                    _nm.check_supported(_info(p))
                    if _offload_of(_info(p)) is not None:
                        raise ValueError(
                            f"dmuon.Muon: variant='normuon' with offloaded matrices ({_info(p).fqn!r}; "
                            "dedicate_params(offload_policy=CPUOffloadPolicy(...))) is not supported yet; "
                            "use variant='muon' or drop offload_policy"
                        )
        super().add_param_group(group)
        if use_muon:
            self._init_muon_state(group)
        else:
            # eager, so that every rank's optimizer.state is non-empty from construction:
            # torch.distributed.checkpoint never dummy-steps it
            for p in params:
                if len(self.state[p]) == 0:
                    self._init_adamw_state(p, self.state[p])

    def _init_muon_state(self, group: dict) -> None:
        normuon = group["variant"] == "normuon"
        for p in group["params"]:
            info = _info(p)
            if info.is_owner:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    offload = _offload_of(info)
                    state["momentum_buffer"] = (
                        torch.zeros_like(p, memory_format=torch.preserve_format)
                        if offload is None
                        else _host_offload.host_zeros(p.shape, p.dtype, offload)
                    )
                if normuon and _nm.SECOND_MOMENT_KEY not in state:
                    state[_nm.SECOND_MOMENT_KEY] = _nm.new_second_moment(p, info)
            else:
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
        this optimizer's keys (Muon: ``momentum_buffer``; NorMuon also
        ``second_momentum_buffer``; AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``) and tensors of
        the parameter's (full logical) shape. A parameter with no entry at all starts from zeros,
        as torch treats a parameter that never stepped.

        The variant (``"muon"`` / ``"normuon"``) is this optimizer's, not the state dict's: a Muon
        state dict loads into ``variant="normuon"`` with zero second moments and a ``UserWarning``
        (momenta and hyper-parameters loaded); a NorMuon state dict into ``variant="muon"`` is
        refused (``ValueError``), since its second moments would be dropped silently.

        Raises:
            ValueError: a state dict of another optimizer layout or another model (the message
                names the first mismatching group, key or parameter FQN), a NorMuon state dict
                into a Muon optimizer, or a bad hyper-parameter.
        """
        self._check_loadable(state_dict)
        state_dict = dict(state_dict)
        groups = []
        zero_second_moments = []
        for saved, current in zip(state_dict["param_groups"], self.param_groups):
            saved = dict(saved)
            if saved.get("use_muon"):
                keys = self._muon_defaults.keys()
                checker = self._checked_muon_hparams
                saved.setdefault("ns_backend", "standard")  # checkpoints from before ns_backend
                saved.setdefault("ns_batching", current.get("ns_batching", "batched"))  # from before ns_batching
                # the variant is this optimizer's (a Muon state dict into NorMuon: zero second moments;
                # the reverse was refused by _check_loadable); NorMuon's settings default to this group's
                variant = current.get("variant", "muon")
                if variant == "normuon" and saved.get("variant", "muon") != "normuon":
                    zero_second_moments.append(len(groups))
                saved["variant"] = variant
                for k in ("normuon_beta2", "normuon_eps"):
                    saved.setdefault(k, current.get(k, self._muon_defaults[k]))
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
        if zero_second_moments:
            warnings.warn(
                f"dmuon.Muon.load_state_dict: loading a Muon state dict (Muon param groups {zero_second_moments} "
                f"without '{_nm.SECOND_MOMENT_KEY}') into variant='normuon': NorMuon's second moments start at "
                "zero (as at a NorMuon run's first step); momenta and everything else are loaded",
                UserWarning,
                stacklevel=2,
            )
        super().load_state_dict(state_dict)
        # Optimizer.__setstate__ adds defaults["differentiable"]; keep defaults empty so that
        # later add_param_group calls do not grow an extra key.
        self.defaults.pop("differentiable", None)
        for group in self.param_groups:
            if group["use_muon"]:
                self._init_muon_state(group)

    def _check_loadable(self, state_dict: dict) -> None:
        """Raise ``ValueError`` naming the first mismatch between ``state_dict`` and this
        optimizer (see :meth:`load_state_dict`); local, no collective:
        :func:`dmuon.exec._state.optimizer_state.check_loadable`."""
        _optimizer_state.check_loadable(self, state_dict)

    # ------------------------------------------------------------------ loss scaling

    def _unscale_grads_for_scaler(self, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool) -> dict:
        """``GradScaler._unscale_grads_`` for this optimizer: :func:`dmuon.exec._optim.amp.unscale_grads`."""
        return _amp.unscale_grads(self, inv_scale, found_inf, allow_fp16)

    # ------------------------------------------------------------------ step

    def _dedicated_params(self) -> list[Tensor]:
        return [p for g in self.param_groups if g["use_muon"] for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One optimisation step over all groups; returns ``closure()``'s loss (or None).

        Order: ``closure`` (with grad enabled) → ``runtime.wait_pending(dedicated)`` →
        Muon groups and AdamW groups in ``param_groups`` order →
        ``runtime.after_step(dedicated)``. See docs/runtime.md ("The optimizer").
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
        # pipeline stages whose plan dedicates nothing: the job's flags and the step's bookkeeping
        bare = bare_stage_runtimes(p for g in self.param_groups if not g["use_muon"] for p in g["params"])
        if self.skip_nonfinite and self._skip_this_step(dedicated, bare):
            after_skipped_step(dedicated)
            for rt in bare:
                rt.after_step(skipped=True)
            return loss
        self.last_step_skipped = False
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group_step(group)
            else:
                self._adamw_group_step(group)
        after_step(dedicated)
        for rt in bare:
            rt.after_step()
        return loss

    def _skip_this_step(self, dedicated: list[Tensor], bare: list = ()) -> bool:
        """``skip_nonfinite``: the job's flags (collective unless the clip carried them); on a skip,
        rank 0 of the job logs it (:mod:`dmuon.exec._optim.nonfinite_skip`)."""
        import torch.distributed as dist

        runtimes = runtimes_of(dedicated) + [rt for rt in bare if rt.check_nonfinite]
        group = runtimes[0].global_group() if runtimes else None  # as dmuon.clip_grad_norm_'s reduce
        params = [p for g in self.param_groups for p in g["params"]]
        device = next((p.device for p in params if p.grad is not None), torch.device("cpu"))
        if runtimes:
            device = runtimes[0].device
        flags = _skip.reduce_flags(params, runtimes, group, device)
        if not flags.skip:
            return False
        self.last_step_skipped = True
        self.skipped_steps += 1
        first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0
        if first:
            step = (runtimes[0].steps_done if runtimes else self.skipped_steps - 1) + 1  # 1-based
            _skip.LOG.warning(_skip.skip_message(flags, step))
        return True

    def _muon_group_step(self, group: dict) -> None:
        """Muon on the matrices of ``group`` this rank owns that have a gradient:
        :func:`dmuon.exec._optim.muon_step.muon_step`."""
        muon_step(group, self.state)

    def _adamw_group_step(self, group: dict) -> None:
        """torch's functional AdamW on the group's parameters with a gradient, one call per device
        (FSDP2's ``CPUOffloadPolicy`` keeps some on the host, the others stay on the accelerator)."""
        by_device: dict = {}
        for p in group["params"]:
            if p.grad is not None:
                by_device.setdefault(p.device, []).append(p)
        for params in by_device.values():
            self._adamw_step(group, params)

    def _adamw_step(self, group: dict, group_params: list[Tensor]) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        for p in group_params:
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
    runs = _rules.choose_ns_backend(tuple(info.matrix_shape), mode, steps=group["ns_steps"])
    if runs != planned and (mode == "auto" or planned != "standard"):
        raise ValueError(
            f"dmuon.Muon: ns_backend={mode!r} (ns_steps={group['ns_steps']}) runs {runs!r} Newton-Schulz "
            f"on {info.fqn!r} {tuple(info.matrix_shape)}, but its plan records {planned!r}; compile the "
            f"plan with ns_backend={mode!r} (dmuon.plan.compile / dmuon.dedicate_params; 'auto' assumes "
            f"ns_steps={_rules.NS_STEPS}) or build dmuon.Muon with the plan's ns_backend"
        )


def _offload_of(info):
    """The :class:`~dmuon.exec._setup.host_offload.HostOffload` of a dedicated matrix's runtime, or None."""
    runtime = getattr(info, "runtime", None)
    rt = runtime() if callable(runtime) else None
    return getattr(rt, "offload", None)


def _is_dcp_dummy_step(dedicated: list[Tensor]) -> bool:
    """A step whose non-owner placeholders hold gradients: only ``torch.distributed.checkpoint``'s
    state initialisation (``p.grad = zeros_like(p)`` on every parameter) makes those."""
    return any(p.grad is not None and not _info(p).is_owner for p in dedicated)
