"""A clear message when a DCP checkpoint's dedicated set differs from the model's.

:class:`DCPLoadPlanner` and :func:`explain_mismatch`; why the error needs explaining: Note: DCP
load errors (docs/design.md).
"""

from __future__ import annotations

import functools

from dmuon import _registry

__all__ = ["DCPLoadPlanner", "explain_mismatch", "install", "dedicated_set_mismatch"]
_MUON_KEYS = ("momentum_buffer",)
_ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")


def dedicated_set_mismatch(wanted_keys, saved_keys) -> tuple[list[str], list[str]]:
    """``(dedicated here but not in the checkpoint, dedicated in the checkpoint but not here)``:
    parameter keys (``<prefix>state.<fqn>``) whose optimizer-state kind differs."""
    saved = set(saved_keys)
    here, there = [], []
    for key in wanted_keys:
        base, _, leaf = key.rpartition(".")
        if not base or key in saved:
            continue
        if leaf in _MUON_KEYS and any(f"{base}.{k}" in saved for k in _ADAMW_KEYS):
            here.append(base)
        elif leaf in _ADAMW_KEYS and any(f"{base}.{k}" in saved for k in _MUON_KEYS):
            if base not in there:
                there.append(base)
    return here, there


def _stacks(bases, shape_of, kinds=_MUON_KEYS + _ADAMW_KEYS) -> list[str]:
    """The parameter FQNs among ``bases`` (``<prefix>state.<fqn>`` keys) whose state tensors are
    3-D: expert stacks (dedicated by default with ``experts="auto"``, on AdamW with ``"off"``)."""
    out = []
    for base in bases:
        for leaf in kinds:
            shape = shape_of(f"{base}.{leaf}")
            if shape is not None and len(shape) == 3:
                out.append(base.split("state.", 1)[1] if "state." in base else base)
                break
    return out


def _names(fqns) -> str:
    return ", ".join(fqns[:4]) + (f" (+{len(fqns) - 4} more)" if len(fqns) > 4 else "")


def _explained(exc: RuntimeError, state_dict, metadata) -> RuntimeError | None:
    """The dmuon error for torch's ``exc`` when it is a dedicated-set mismatch, else None."""
    if "Missing key in checkpoint state_dict" not in str(exc):
        return None
    here, there = dedicated_set_mismatch(state_dict, metadata.state_dict_metadata)
    if not here and not there:
        return None
    parts = []
    if here:
        parts.append(
            f"dedicated (Muon) here but AdamW in the checkpoint: {', '.join(here[:4])}{' ...' if len(here) > 4 else ''}"
        )
    if there:
        parts.append(
            f"dedicated (Muon) in the checkpoint but AdamW here: {', '.join(there[:4])}{' ...' if len(there) > 4 else ''}"
        )
    stacks_here = _stacks(here, lambda k: getattr(state_dict.get(k), "shape", None))
    stacks_there = _stacks(
        there, lambda k: getattr(metadata.state_dict_metadata.get(k), "size", None), kinds=_MUON_KEYS
    )
    experts = ""
    if stacks_here:
        experts += (
            f" Expert stacks dedicated here but not in the checkpoint: {_names(stacks_here)}: the checkpoint "
            "was saved with experts='off' (expert stacks on AdamW, the selection before expert support); "
            'pass experts="off" to dmuon.dedicate_params / dmuon.plan.compile to load it.'
        )
    if stacks_there:
        experts += (
            f" Expert stacks dedicated in the checkpoint but not here: {_names(stacks_there)}: the checkpoint "
            "was saved with experts='auto' (the default); drop experts=\"off\" to load it."
        )
    return RuntimeError(
        "dmuon: the checkpoint's dedicated set differs from this model's (the predicate, the "
        f"hook-boundary choice or the experts= setting changed since it was saved): {'; '.join(parts)}."
        f"{experts} Compile with the "
        "predicate the checkpoint was saved with, or load only the model state dict (its keys do not "
        f"depend on the dedicated set) and start the optimizer fresh. torch: {exc}"
    )


def explain_mismatch(fn):
    """The wrapper of DCP's ``create_default_local_load_plan`` (registry entry ``dcp.load_plan``):
    torch's "Missing key" error, explained when the dedicated set differs; unchanged otherwise."""

    @functools.wraps(fn)
    def wrapper(state_dict, metadata, *args, **kwargs):
        try:
            return fn(state_dict, metadata, *args, **kwargs)
        except RuntimeError as exc:
            new = _explained(exc, state_dict, metadata)
            if new is None:
                raise
            raise new from exc

    return wrapper


def _planner_base():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    return DefaultLoadPlanner


class DCPLoadPlanner(_planner_base()):
    """``torch.distributed.checkpoint.DefaultLoadPlanner`` whose local planning explains a
    dedicated-set mismatch (the patch-free path)::

        dcp.load(state, checkpoint_id=path, planner=dmuon.DCPLoadPlanner())

    Same constructor arguments as ``DefaultLoadPlanner``; behaviour is unchanged otherwise."""

    def create_local_plan(self):
        try:
            return super().create_local_plan()
        except RuntimeError as exc:
            new = _explained(exc, self.state_dict, self.metadata)
            if new is None:
                raise
            raise new from exc


def install() -> None:
    """Wrap DCP's local load planning now (``dmuon._registry.install("dcp")``), even with the
    automatic installs disabled. Idempotent; a torch without it is left alone."""
    _registry.install("dcp")
