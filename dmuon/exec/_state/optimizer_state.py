"""Optimizer state dicts of :class:`dmuon.Muon`: momenta as full-shape DTensors, the
checkpoint hooks, and the checks ``dmuon.Muon.load_state_dict`` runs before loading.

Every dedicated matrix's Muon momentum lives on its owner only. ``torch.distributed.checkpoint``
(DCP) and its ``get_/set_optimizer_state_dict`` helpers need, on every rank, the same keys with
tensors of full logical shape; dmuon hooks in at :class:`dmuon.Muon`'s ``state_dict`` /
``load_state_dict`` hooks (the layout and its scatter / gather:
:mod:`dmuon.exec._state.dtensor_layout`; the model's side: :mod:`dmuon.exec._state.model_state`):

Optimizer (:func:`register_optimizer_hooks`, called by ``dmuon.Muon``)
    ``state_dict()`` pre-hook: :meth:`dmuon.Muon.init_state` (so every parameter, also one that
    never had a gradient, has state: keys are identical on every rank). Post-hook: for every
    dedicated parameter, on every rank, ``{"momentum_buffer": DTensor}`` scattered from the
    owner (HSDP: in the owner's row, then each chunk broadcast to the other rows); the state
    is ordered by parameter index on every rank (DCP's gather runs collectives in dict order).
    ``load_state_dict`` pre-hook: each momentum DTensor is gathered chunk-wise to the owner; on
    other ranks the entry is dropped (non-owners keep no state for placeholders). Before any
    gather, one all-reduce checks that every rank of the mesh passes the same entries
    (:func:`_check_same_entries`: otherwise the same ``ValueError`` on every rank, not a hang).

:func:`wrap_unflatten_optim_state_dict` (registry entry ``dcp.unflatten_optim``): DCP's
``set_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` unflattens only the state
names ``optimizer.state`` holds on the rank; a non-owner holds none for a dedicated matrix, so
the wrapper adds the plan's names (momentum, NorMuon's second moment) on every rank.

:func:`check_loadable`: the local checks of a state dict against the optimizer, before any
collective of the hooks (``dmuon.Muon.load_state_dict``).

All collectives run on dmuon's own groups and are charged to the ledger as ``"other"``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from dmuon._dtensor import is_dtensor, local_tensor
from dmuon._tags import dedicated_info
from dmuon.exec._comm import collective_calls as C
from dmuon.exec._optim import normuon_update as _nm
from dmuon.exec._state import normuon_state as _nms
from dmuon.exec._state.dtensor_layout import (
    _as_dtensor,
    _chunk_dtensor,
    _chunk_rows,
    _coords,
    _ep_dtensor,
    _ep_rows,
    _full_on,
    _grouped_full,
    _is_own_layout,
    _load_grouped,
    _my_rows,
    _placements,
    _scatter_chunks,
)

__all__ = ["register_optimizer_hooks", "check_loadable", "wrap_unflatten_optim_state_dict"]


def _momentum_to_dtensor(runtime, slot, info, buf):
    """The owner's momentum ``buf`` as a full-shape DTensor on every rank.

    The owner ``(s, r)`` scatters in its row; in HSDP each ``(s', r)`` then broadcasts its chunk
    over its replicate group, so every rank holds one chunk and never the whole matrix. With TP
    every TP coordinate does this for its own shard (its owner holds that shard's momentum).
    """
    g = runtime.groups
    owner_replicate = _coords(runtime, info.owner_global_rank)[0]
    shape = tuple(slot.shape)
    if g.replicate == owner_replicate:
        full = local_tensor(buf) if buf is not None else None
        chunk = _scatter_chunks(runtime, shape, slot.logical.dtype, full, info.owner_global_rank)
    else:
        chunk = torch.empty(
            (_chunk_rows(shape[0], g.shape[1]), *shape[1:]), dtype=slot.logical.dtype, device=runtime.device
        )
    if g.shape[0] > 1:
        C.broadcast(chunk, src=g.rank_of(owner_replicate, g.shard), group=g.replicate_group, phase="other")
    return _as_dtensor(runtime, slot, chunk)


def _grouped_momentum_to_dtensor(runtime, info, p, buf):
    """The owner group's momentum (each member holds its block) as a full-shape DTensor: the
    members broadcast their blocks in the owners' row (every rank of that row holds the matrix
    for a moment), each keeps its row chunk; HSDP: each chunk is broadcast over its replicate
    group, as for one owner."""
    g = runtime.groups
    gm = runtime.grouped_by_fqn[info.fqn]
    group_info = info.group
    owner_replicate = _coords(runtime, group_info.ranks[0])[0]
    shape = tuple(group_info.shape)
    N = g.shape[1]
    c = _chunk_rows(shape[0], N)
    chunk = torch.zeros((c, *shape[1:]), dtype=p.dtype, device=runtime.device)
    if g.replicate == owner_replicate:

        def block(j):
            if buf is None:  # state cleared by hand: the step would start from zeros too
                return torch.zeros(group_info.block_shape(j), dtype=p.dtype, device=runtime.device)
            return buf

        full = _grouped_full(runtime, gm, block)
        rows = _my_rows(shape[0], N, g.shard)
        chunk[:rows].copy_(full[g.shard * c : g.shard * c + rows])
    if g.shape[0] > 1:
        C.broadcast(chunk, src=g.rank_of(owner_replicate, g.shard), group=g.replicate_group, phase="other")
    return _chunk_dtensor(runtime, shape, shape, _placements(runtime), chunk)


# ----------------------------------------------------------------------------------------------
# Optimizer hooks (dmuon.Muon)
# ----------------------------------------------------------------------------------------------


def _live_info(p):
    info = dedicated_info(p)
    ref = getattr(info, "runtime", None)
    rt = ref() if callable(ref) else None
    return (info, rt) if rt is not None else (None, None)


def _optimizer_runtimes(opt) -> list:
    seen: dict[int, object] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            _, rt = _live_info(p)
            if rt is not None:
                seen.setdefault(id(rt), rt)
    return list(seen.values())


def register_optimizer_hooks(opt) -> None:
    """Checkpoint hooks of a :class:`dmuon.Muon` (no-ops for parameters without a live runtime)."""
    opt.register_state_dict_pre_hook(_optim_state_dict_pre_hook)
    opt.register_state_dict_post_hook(_optim_state_dict_post_hook)
    opt.register_load_state_dict_pre_hook(_optim_load_state_dict_pre_hook)
    opt.register_step_pre_hook(_optim_step_pre_hook)


def _optim_state_dict_pre_hook(opt) -> None:
    if _optimizer_runtimes(opt) and hasattr(opt, "init_state"):
        opt.init_state()  # every parameter has state: identical keys on every rank


def _optim_state_dict_post_hook(opt, state_dict):
    runtimes = _optimizer_runtimes(opt)
    if not runtimes:
        return None
    for rt in runtimes:
        rt.prepare_state_access("optimizer.state_dict()")
    params = [p for group in opt.param_groups for p in group["params"]]
    normuon = {id(p) for group in opt.param_groups if group.get("variant") == "normuon" for p in group["params"]}
    state = dict(state_dict["state"])
    for idx, p in enumerate(params):
        info, rt = _live_info(p)
        if rt is None:
            continue
        entry = dict(state.get(idx, {}))
        if id(p) in normuon:  # NorMuon's second moment, laid out like the momentum (before it: dict order)
            v = _nms.second_moment_to_dtensor(rt, info, p, entry.get(_nm.SECOND_MOMENT_KEY))
            # the same key order on every rank (DCP gathers in dict order); momentum filled below
            entry = {"momentum_buffer": entry.get("momentum_buffer"), _nm.SECOND_MOMENT_KEY: v}
        if getattr(info, "ep_local", False):  # this rank's experts' momentum, no copy
            buf = entry.get("momentum_buffer")
            if buf is None:
                buf = torch.zeros_like(p)
            entry["momentum_buffer"] = _ep_dtensor(rt, info.fqn, buf)
            state[idx] = entry
            continue
        if getattr(info, "group", None) is not None:
            entry["momentum_buffer"] = _grouped_momentum_to_dtensor(rt, info, p, entry.get("momentum_buffer"))
            state[idx] = entry
            continue
        slot = rt.slots_by_fqn[info.fqn]
        buf = None
        if info.is_owner:
            buf = entry.get("momentum_buffer")
            if buf is None:  # state cleared by hand: the step would start from zeros too
                buf = torch.zeros(slot.shape, dtype=p.dtype, device=p.device)
        entry["momentum_buffer"] = _momentum_to_dtensor(rt, slot, info, buf)
        state[idx] = entry
    order = sorted(state, key=lambda k: (0, k, "") if isinstance(k, int) else (1, 0, str(k)))
    state_dict["state"] = {k: state[k] for k in order}
    # torch.dtype values as strings ("torch.bfloat16"): DCP's full-state-dict gather accepts only
    # tensors, numbers, strings, lists and dicts; dmuon.Muon.load_state_dict parses the strings
    state_dict["param_groups"] = [
        {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in group.items()}
        for group in state_dict["param_groups"]
    ]
    return state_dict


def _optim_load_state_dict_pre_hook(opt, state_dict):
    runtimes = _optimizer_runtimes(opt)
    if not runtimes:
        return None
    for rt in runtimes:
        rt.check_idle("optimizer.load_state_dict()")
        rt.prepare_state_access("optimizer.load_state_dict()")
    params = [p for group in opt.param_groups for p in group["params"]]
    saved = [k for group in state_dict["param_groups"] for k in group["params"]]
    if len(saved) != len(params):
        return None  # torch's own check raises the usual error
    state = dict(state_dict["state"])
    _check_same_entries(runtimes, saved, params, state)
    for key, p in zip(saved, params):
        info, rt = _live_info(p)
        if rt is None:
            continue
        entry = state.get(key)
        v_saved = entry.get(_nm.SECOND_MOMENT_KEY) if isinstance(entry, dict) else None
        if v_saved is not None:  # NorMuon's second moment: gathered to the owner like the momentum
            v = _nms.second_moment_from_saved(rt, info, p, v_saved)
            entry = {k: x for k, x in entry.items() if k != _nm.SECOND_MOMENT_KEY}
            if v is not None:
                entry[_nm.SECOND_MOMENT_KEY] = v
            state[key] = entry
        value = entry.get("momentum_buffer") if isinstance(entry, dict) else None
        if value is None:
            if not info.is_owner:
                state.pop(key, None)
            continue
        g = rt.groups
        if getattr(info, "ep_local", False):  # this rank's experts' rows
            entry = dict(entry)
            entry["momentum_buffer"] = _ep_rows(rt, info.fqn, value).to(device=p.device, dtype=p.dtype, copy=True)
            state[key] = entry
            continue
        if getattr(info, "group", None) is not None:  # every rank joins the gather; owners keep their block
            block = _load_grouped(rt, rt.grouped_by_fqn[info.fqn], value, None)
            if info.is_owner:
                entry = dict(entry)
                entry["momentum_buffer"] = block.to(device=p.device, dtype=p.dtype, copy=True).contiguous()
                state[key] = entry
            else:
                state.pop(key, None)
            continue
        owner_replicate = _coords(rt, info.owner_global_rank)[0]
        dst = info.owner_global_rank if g.replicate == owner_replicate else None
        slot = rt.slots_by_fqn[info.fqn]
        if not is_dtensor(value) or not _is_own_layout(rt, value, slot):
            dst = info.owner_global_rank  # full tensor / foreign DTensor: every rank takes part
        full = _full_on(rt, slot, value, dst)
        if info.is_owner:
            entry = dict(entry)
            full = full.reshape(slot.shape)
            entry["momentum_buffer"] = slot.tp.wrap(full) if slot.tp is not None else full
            state[key] = entry
        else:
            state.pop(key, None)
    state_dict["state"] = state
    return state_dict


#: the state names of a Muon entry whose values every rank of the mesh passes to a load (one chunk each)
_GATHERED_NAMES = ("momentum_buffer", _nm.SECOND_MOMENT_KEY)


def _check_same_entries(runtimes, saved, params, state) -> None:
    """Every rank of a runtime's mesh must pass the same dedicated entries: each holds one chunk of
    a momentum DTensor, and the gather to the owner needs all of them. A rank without the entry
    would skip its part of the gather while the others wait (a hang), so one all-reduce (SUM, per
    runtime over its job's ranks, ledger phase ``"other"``) counts the ranks that pass each entry,
    and every rank raises the same ``ValueError`` when some but not all do."""
    import torch.distributed as dist

    for rt in runtimes:
        names, present = [], []
        for key, p in zip(saved, params):
            info, r = _live_info(p)
            if r is not rt:
                continue
            entry = state.get(key)
            for name in _GATHERED_NAMES:
                names.append((info.fqn, name))
                present.append(int(isinstance(entry, dict) and entry.get(name) is not None))
        if not names:
            continue
        group = rt.groups.job_group
        counts = torch.tensor(present, dtype=torch.int64, device=rt.device)
        C.all_reduce_sum(counts, group=group, phase="other")
        world = dist.get_world_size(group)
        bad = [(fqn, name, int(c)) for (fqn, name), c in zip(names, counts.tolist()) if 0 < c < world]
        if bad:
            fqn, name, c = bad[0]
            raise ValueError(
                f"dmuon: optimizer.load_state_dict: the state dict holds {name!r} of the dedicated matrix {fqn!r} "
                f"on {c} of the {world} ranks of its mesh ({len(bad)} such entries); every rank must pass it (each "
                "holds one chunk, gathered to the owner). torch.distributed.checkpoint's set_optimizer_state_dict(..., "
                "options=StateDictOptions(flatten_optimizer_state_dict=True)) drops it on the ranks that do not own "
                "the matrix unless dmuon's 'dcp.unflatten_optim' integration is installed (DMUON_NO_PATCHES=1 or "
                "dmuon.integrations.disable() remove it): call dmuon.integrations.enable('dcp'), or unflatten the "
                "state dict against get_optimizer_state_dict(model, optimizer)'s layout before loading it "
                "(docs/pipeline_parallel.md, 'Checkpoints')"
            )


def wrap_unflatten_optim_state_dict(original):
    """DCP's ``_unflatten_optim_state_dict(optim, state_dict, info)``: for a :class:`dmuon.Muon`,
    the entries of its dedicated matrices also get the plan's state names (``momentum_buffer``;
    NorMuon: the second moment) that ``state_dict`` holds under ``state.<fqn>.<name>``, on every
    rank. torch reads the names from ``optim.state``, which holds none for a matrix the rank does
    not own; without them that rank would skip its part of the load's gather to the owner."""

    @functools.wraps(original)
    def _unflatten_optim_state_dict(optim, state_dict, info, *args, **kwargs):
        osd = original(optim, state_dict, info, *args, **kwargs)
        if not _optimizer_runtimes(optim):
            return osd
        entries = osd.get("state", {})
        for group in optim.param_groups:
            if not group.get("use_muon"):
                continue
            names = ("momentum_buffer",) + ((_nm.SECOND_MOMENT_KEY,) if group.get("variant") == "normuon" else ())
            for p in group["params"]:
                if _live_info(p)[1] is None:
                    continue
                if p in optim.state and not optim.state[p]:  # the empty entry torch's read left on a non-owner
                    del optim.state[p]
                for fqn in info.fqn_param_mapping.get(p, ()):
                    entry = entries.get(fqn)
                    if not isinstance(entry, dict):
                        continue
                    for name in names:
                        key = f"state.{fqn}.{name}"
                        if name not in entry and key in state_dict:
                            entry[name] = state_dict[key]
        return osd

    return _unflatten_optim_state_dict


def _optim_step_pre_hook(opt, args, kwargs):
    """Fail loudly on torch.distributed.checkpoint's dummy-step state initialisation.

    ``get/set_optimizer_state_dict`` run ``optimizer.step()`` with zero gradients on every
    parameter when ``optimizer.state`` is empty on a rank (e.g. a rank that owns no matrix,
    before its first step). That step would run on some ranks only (dmuon's HSDP broadcast would
    hang) and would advance AdamW's step counters; placeholders never get gradients otherwise.
    """
    if not opt.state:  # nothing to initialise on this rank: dmuon.Muon.step makes it a local no-op
        return None
    for group in opt.param_groups:
        if not group.get("use_muon"):
            continue
        for p in group["params"]:
            info, rt = _live_info(p)
            if rt is not None and not info.is_owner and p.grad is not None:
                raise RuntimeError(
                    "dmuon: optimizer.step() with a gradient on a non-owner placeholder "
                    f"({info.fqn!r}): only torch.distributed.checkpoint's dummy-step initialisation "
                    "of an empty optimizer state makes one, on some ranks only. dmuon.Muon creates its "
                    "state at construction; if optimizer.state was cleared, call "
                    "optimizer.init_state() on every rank before the next checkpoint save/load"
                )
    return None


# ----------------------------------------------------------------------------------------------
# dmuon.Muon.load_state_dict's checks (local, before any collective of the hooks)
# ----------------------------------------------------------------------------------------------

_MUON_STATE_KEYS = frozenset({"momentum_buffer"})  # NorMuon adds normuon.SECOND_MOMENT_KEY
_ADAMW_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})


def _param_name(opt, p: Tensor) -> str:
    """FQN of ``p`` (dedicated: its tag; else looked up in its model, when dmuon knows it)."""
    info = dedicated_info(p)
    if info is not None:
        return info.fqn
    for q in opt._dedicated_params():
        rt = getattr(dedicated_info(q), "runtime", None)
        model = rt().model_ref() if callable(rt) and rt() is not None else None
        if model is not None:
            for name, r in model.named_parameters():
                if r is p:
                    return name
    return f"<parameter of shape {tuple(p.shape)}>"


def check_loadable(opt, state_dict: dict) -> None:
    """Raise ``ValueError`` naming the first mismatch between ``state_dict`` and the optimizer
    ``opt`` (see :meth:`dmuon.Muon.load_state_dict`); local, no collective."""
    how = (
        "load a checkpoint saved by this model's dmuon.Muon (same model, predicate and "
        "param groups; the world size may differ)"
    )
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"dmuon.Muon.load_state_dict: the state dict has {len(saved_groups)} param groups, this "
            f"optimizer {len(opt.param_groups)}; {how}"
        )
    index: dict[Any, tuple[Tensor, bool, frozenset]] = {}
    for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        kind = "Muon" if group["use_muon"] else "AdamW"
        if bool(saved.get("use_muon", group["use_muon"])) != group["use_muon"]:
            raise ValueError(
                f"dmuon.Muon.load_state_dict: param group {g} is a {kind} group here but not in the state dict; {how}"
            )
        if len(saved["params"]) != len(group["params"]):
            extra = group["params"][len(saved["params"])] if len(group["params"]) > len(saved["params"]) else None
            first = (
                f" (first parameter without a saved counterpart: {_param_name(opt, extra)!r})"
                if extra is not None
                else ""
            )
            raise ValueError(
                f"dmuon.Muon.load_state_dict: {kind} param group {g} holds {len(group['params'])} parameters "
                f"here but {len(saved['params'])} in the state dict{first}. The dedicated set or the model "
                f"differs (another predicate or hook-boundary choice dedicates other matrices); {how}"
            )
        want = _ADAMW_STATE_KEYS
        if group["use_muon"]:
            want = _MUON_STATE_KEYS
            saved_variant, variant = saved.get("variant", "muon"), group.get("variant", "muon")
            if saved_variant == "normuon" and variant != "normuon":
                raise ValueError(
                    f"dmuon.Muon.load_state_dict: Muon param group {g} of the state dict is NorMuon's "
                    f"(variant='normuon', with '{_nm.SECOND_MOMENT_KEY}' entries) but this optimizer runs "
                    f"variant={variant!r}. Build dmuon.Muon(..., variant='normuon') to resume it, or drop the "
                    f"'{_nm.SECOND_MOMENT_KEY}' entries and the groups' 'variant' key to continue with Muon"
                )
            if variant == "normuon":  # without second moments: a Muon state dict, zeros (a warning)
                want = _MUON_STATE_KEYS | {_nm.SECOND_MOMENT_KEY}
        for key, p in zip(saved["params"], group["params"]):
            index[key] = (p, group["use_muon"], want)
    for key, entry in state_dict.get("state", {}).items():
        if key not in index:
            raise ValueError(
                f"dmuon.Muon.load_state_dict: state key {key!r} indexes no parameter of the state dict's "
                f"param groups; {how}"
            )
        p, use_muon, want = index[key]
        got = set(entry) if isinstance(entry, dict) else set()
        name = _param_name(opt, p)
        if got and got != want and not (_nm.SECOND_MOMENT_KEY in want and got == _MUON_STATE_KEYS):
            raise ValueError(
                f"dmuon.Muon.load_state_dict: the state of {name!r} (key {key!r}) has keys {sorted(got)}, "
                f"expected {sorted(want)} ({'Muon' if use_muon else 'AdamW'}); {how}"
            )
        shape = tuple(dedicated_info(p).shape) if use_muon else tuple(p.shape)
        if use_muon and getattr(dedicated_info(p), "ep_local", False):  # saved at the stack's global shape
            runtime = dedicated_info(p).runtime()
            shape = tuple(runtime.plan.param(dedicated_info(p).fqn).shape) if runtime is not None else shape
        for k in sorted(got - {"step"}):
            value = entry[k]
            want_shape, what = shape, "the parameter"
            if k == _nm.SECOND_MOMENT_KEY:
                info = dedicated_info(p)
                want_shape = _nm.second_moment_shape(
                    shape, matrix_shape=info.matrix_shape, experts=info.experts, view=info.view
                )
                what = "NorMuon's second-moment shape"
            if isinstance(value, Tensor) and tuple(value.shape) != want_shape:
                raise ValueError(
                    f"dmuon.Muon.load_state_dict: state {k!r} of {name!r} has shape {tuple(value.shape)}, "
                    f"{what} {want_shape}; {how}"
                )
