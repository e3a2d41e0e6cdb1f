"""Measured per-rank memory of one training step, FSDP2 + AdamW against dmuon, next to the plan's
memory model (``plan.rank_stats()[r].memory``, ``plan.adamw_rank_stats()[0].memory``).

    python benchmarks/measured_memory.py                      # dense + MoE, bf16 mp and none, N = 2
    python benchmarks/measured_memory.py --models dense --mp bf16 --json out.json

CPU, gloo, 2 processes (:func:`dmuon._launch.run_distributed`). Per configuration (model, mixed
precision, variant) every rank builds the model under a :class:`LiveStorages` dispatch mode that
sees every tensor storage an aten op returns (subclass tensors such as DTensor flattened to their
local tensors), follows ``UntypedStorage.resize_`` (FSDP2 and dmuon grow and free their unsharded
/ packed storage that way, outside the dispatcher) and drops a storage when it is freed
(``weakref.finalize``). Live bytes = the sum of the live storages' ``nbytes()`` (storages only
gloo's worker threads allocate are not seen). Steps: one warm-up, one to find the step's peak,
one more in which the live storages are classified at the start, after the backward and the
first time the peak is reached again. Classification walks the objects that hold tensors
(optimizer state, dmuon's runtime buffers, FSDP2's ``FSDPParam`` / ``FSDPParamGroup`` /
``FSDPCommContext`` attributes, the module parameters and their ``.grad``); the rest is labelled
by when it was created: forward compute outside any collective = activations saved for the
backward, backward compute = activation gradients and temporaries.

Variants: ``adamw`` = ``fully_shard`` every block then the root, FSDP2 defaults
(``reshard_after_forward=None``: blocks resharded after forward, the root kept unsharded until
its backward), ``torch.optim.AdamW``; ``dmuon`` = ``dmuon.dedicate_params(model, mesh,
reshard_after_forward=True, mp_policy=...)``, the same ``fully_shard`` calls, ``dmuon.Muon``.
Mixed precision: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` or none; storage
fp32. Results: ``benchmarks/results/2026-12-07-measured-memory.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch

MODELS: dict[str, dict[str, int]] = {
    # parameters dominate: wide layers, large vocabulary, 64 tokens per rank
    "dense": dict(vocab_size=8192, d_model=512, n_layers=4, n_heads=8, d_mlp=2048, seq_len=32),
    # 8 SwiGLU experts per block (expert stacks, ranges owned by each rank), top-2
    "moe": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, d_mlp=512, seq_len=32, n_experts=8, top_k=2),
}
BATCH = 2  # sequences per rank
#: ops whose output is a view: a storage first seen as one was allocated where the dispatch mode
#: does not see it (gloo allocates its reduce-scatter copy on its worker thread; the main thread
#: meets it when ``work.wait()`` splits it into the output)
OPTIMIZER_PHASES = ("optimizer.step", "zero_grad")
VIEW_OPS = frozenset(
    ("split", "split_with_sizes", "chunk", "view", "slice", "narrow", "select", "as_strided", "unbind", "alias", "t")
)
#: dmuon_exact: dmuon.Muon(ns_batching="exact"); dmuon_allgather: dedicate_params(collectives="all_gather")
#: (on a CPU mesh "auto" picks broadcasts; all-gathered buffers cut expert stacks into ranges that
#: every rank assembles)
VARIANTS = ("adamw", "dmuon", "dmuon_exact", "dmuon_allgather")
MPS = ("bf16", "none")


# ==============================================================================================
# Live storage tracking
# ==============================================================================================


@dataclass
class _Info:
    nbytes: int
    phase: str  # the step phase when created (or last regrown)
    ctx: str  # innermost labelled runtime function then ("" = plain compute)
    op: str
    dtype: str
    shape: tuple
    external: bool = False  # first seen as a view: allocated where the dispatcher did not see it


class LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Every live CPU tensor storage: bytes now, the peak, and classified snapshots.

    ``phase`` / ``ctx`` are set by module hooks and wrapped runtime functions (:func:`install_contexts`)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary

        self.keys = WeakIdKeyDictionary()  # storage -> int key
        self.infos: dict[int, _Info] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.next_key = 0
        self.current = 0
        self.external = 0  # bytes of the live storages marked external (gloo's worker-thread copies)
        self.peak = 0  # every storage seen
        # without the external ones (what the step itself allocates), per part of the step
        # ("fwd_bwd", "optimizer"): (bytes, phase, context)
        self.peaks: dict[str, tuple] = {}
        self.phase = "setup"
        self.ctx: list[str] = []
        self.phase_peaks: dict[str, tuple[int, str]] = {}
        # part -> classify the live storages at every new maximum of the part above this (the last
        # one taken is the step's peak; the step before set the threshold, 1% under its peak: an
        # MoE step routes differently after an update, so its peak moves a little)
        self.snapshot_at: dict[str, int] = {}
        self.snapped: dict[str, int] = {}
        self.snapshots: dict[str, dict] = {}
        self.classify = None  # () -> [(tensor, label)]
        self._orig_resize = None

    # -- bookkeeping ----------------------------------------------------------------------

    def _freed(self, key: int) -> None:
        info = self.infos.pop(key, None)
        self.refs.pop(key, None)
        if info is not None:
            self.current -= info.nbytes
            self.external -= info.nbytes if info.external else 0

    def track(self, t: torch.Tensor, op: str) -> None:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            for a in attrs:
                self.track(getattr(t, a), op)
            return
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = self.keys.get(st)
        if key is None:
            key = self.next_key
            self.next_key += 1
            self.keys[st] = key
            nb = st.nbytes()
            ext = op in VIEW_OPS
            info = _Info(nb, self.phase, self.ctx[-1] if self.ctx else "", op, str(t.dtype), tuple(t.shape), ext)
            self.infos[key] = info
            self.refs[key] = weakref.ref(st)
            weakref.finalize(st, self._freed, key)
            self.current += nb
            self.external += nb if ext else 0
        else:
            self._resized(key, st, op)
        self._note()

    def _resized(self, key: int, st, op: str) -> None:
        info = self.infos[key]
        nb = st.nbytes()
        if nb != info.nbytes:
            self.current += nb - info.nbytes
            self.external += (nb - info.nbytes) if info.external else 0
            info.nbytes = nb
            if nb:  # regrown: label it by the regrowth
                info.phase, info.ctx, info.op = self.phase, (self.ctx[-1] if self.ctx else ""), op

    def _note(self) -> None:
        where = self.ctx[-1] if self.ctx else ""
        own = self.current - self.external
        if self.current > self.peak:
            self.peak = self.current
        part = "optimizer" if self.phase in OPTIMIZER_PHASES else "fwd_bwd"
        if own > self.peaks.get(part, (-1,))[0]:
            self.peaks[part] = (own, self.phase, where)
        pp = self.phase_peaks.get(self.phase)
        if pp is None or own > pp[0]:
            self.phase_peaks[self.phase] = (own, where)
        at = self.snapshot_at.get(part)
        if at is not None and own >= at and own > self.snapped.get(part, 0):
            self.snapped[part] = own  # the latest is this step's peak of the part
            self.take(f"peak_{part}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t, name)
        return out

    def __enter__(self):
        tracker = self
        self._orig_resize = orig = torch.UntypedStorage.resize_

        @functools.wraps(orig)
        def resize_(st, size):
            out = orig(st, size)
            key = tracker.keys.get(st)
            if key is None:
                key = tracker.next_key
                tracker.next_key += 1
                tracker.keys[st] = key
                tracker.infos[key] = _Info(0, tracker.phase, "", "resize_", "?", ())
                tracker.refs[key] = weakref.ref(st)
                weakref.finalize(st, tracker._freed, key)
            tracker._resized(key, st, "resize_")
            tracker._note()
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    # -- snapshots ------------------------------------------------------------------------

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    @contextlib.contextmanager
    def context(self, label: str):
        self.ctx.append(label)
        try:
            yield
        finally:
            self.ctx.pop()

    def take(self, name: str) -> None:
        """Classify every live storage now (the walk itself allocates nothing we keep)."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            labels: dict[int, str] = {}
            for t, label in self.classify() if self.classify else ():
                for st in _storages(t):
                    key = self.keys.get(st)
                    if key is not None and key not in labels:
                        labels[key] = label
            rows = []
            for key, info in self.infos.items():
                if info.nbytes == 0:
                    continue
                label = labels.get(key) or _unlabelled(info)
                rows.append(
                    dict(
                        label=label,
                        nbytes=info.nbytes,
                        dtype=info.dtype,
                        shape=list(info.shape),
                        phase=info.phase,
                        ctx=info.ctx,
                        op=info.op,
                    )
                )
        rows.sort(key=lambda r: -r["nbytes"])
        self.snapshots[name] = dict(
            live_nbytes=self.current - self.external,
            external_nbytes=self.external,
            phase=self.phase,
            ctx=self.ctx[-1] if self.ctx else "",
            rows=rows,
        )


def _unlabelled(info: _Info) -> str:
    if info.external:
        return f"backend copy, allocated off the dispatcher (first seen in {info.ctx or info.phase} as {info.op})"
    if info.ctx:
        return f"other in {info.ctx}"
    if info.phase.startswith("fwd"):
        return "activations (forward compute)"
    if info.phase.startswith("bwd"):
        return "backward compute (activation grads, temporaries)"
    return f"other ({info.phase})"


def _storages(t):
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not isinstance(t, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for a in attrs:
            yield from _storages(getattr(t, a))
        return
    if t.device.type != "meta":
        yield t.untyped_storage()


def _tensors_in(obj, depth: int = 3):
    """Tensors in ``obj``: a tensor, or containers / NamedTuples / dataclass-like objects of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or obj is None or isinstance(obj, (str, int, float, bool, torch.nn.Module)):
        return
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth - 1)
    elif hasattr(obj, "_fields"):  # NamedTuple
        for v in obj:
            yield from _tensors_in(v, depth - 1)


def classifier(model, opt):
    """``() -> [(tensor, label)]``, most specific first (the first label of a storage wins)."""

    def walk():
        from torch.distributed.tensor import DTensor

        from dmuon.exec import get_model_runtime

        # optimizer state
        for st in opt.state.values():
            for k, v in st.items():
                for t in _tensors_in(v):
                    yield t, f"optimizer state ({k})"
        for k, v in vars(opt).items():
            if k not in ("param_groups", "state", "defaults"):
                for t in _tensors_in(v):
                    yield t, f"optimizer other ({k})"
        # dmuon's runtime
        rt = get_model_runtime(model)
        if rt is not None:
            for b in rt.boundaries:
                for gm in b.grouped:
                    if gm.compute.grad is not None:
                        yield gm.compute.grad, "dmuon: local full grad before packing"
                    if gm.writer is not None:
                        yield gm.writer, "dmuon: assembled stack (compute)"
                for slot in b.slots:
                    if slot.compute.grad is not None:
                        yield slot.compute.grad, "dmuon: local full grad before packing"
                for gb in b.gathers:  # before the segments: a non-held segment's wire is a view of it
                    yield gb.gathered, "dmuon: all-gathered buffer"
                for seg in b.segments:
                    if seg.master is not None and seg.master is not seg.wire:
                        yield seg.master, "dmuon: owned master (param dtype)"
                        yield seg.wire, "dmuon: held segment's wire copy"
                    elif seg.held:
                        yield seg.wire, "dmuon: owned master (param dtype)"
                    else:
                        yield seg.wire, "dmuon: received packed buffer"
                    if seg.reduce_buf is not None:
                        yield seg.reduce_buf, "dmuon: reduce buffer (" + ("held" if seg.held else "sent") + ")"
                for gb in b.gathers:
                    if gb.rs_in is not None:
                        yield gb.rs_in, "dmuon: reduce-scatter input"
                        yield gb.rs_out, "dmuon: reduce-scatter output"
            ctx = rt.boundaries[0].comm_ctx if rt.boundaries else None
            if ctx is not None:
                for t in _tensors_in(ctx.staged_grads):
                    yield t, "dmuon: staged owner grads"
        # FSDP2's state
        for m in model.modules():
            get = getattr(m, "_get_fsdp_state", None)
            pg = get()._fsdp_param_group if get is not None else None
            if pg is None:
                continue
            for fp in pg.fsdp_params:
                up = getattr(fp, "_unsharded_param", None)
                if up is not None and up.grad is not None:
                    yield up.grad, "fsdp2: unsharded grad"
                for k, v in vars(fp).items():
                    if k in ("sharded_param", "_sharded_param_data"):
                        for t in _tensors_in(v):
                            yield t, "fsdp2: sharded param"
                        if isinstance(v, DTensor) and v.grad is not None:
                            yield v.grad, "fsdp2: sharded grad"
                    elif k == "_unsharded_param":
                        yield v, "fsdp2: unsharded param"
                    else:
                        for t in _tensors_in(v):
                            yield t, f"fsdp2: FSDPParam.{k}"
            for k, v in vars(pg).items():
                if k != "fsdp_params":
                    for t in _tensors_in(v):
                        yield t, f"fsdp2: FSDPParamGroup.{k}"
            for k, v in vars(pg.comm_ctx).items():
                for t in _tensors_in(v):
                    yield t, f"fsdp2: FSDPCommContext.{k}"
        # what the modules hold now (FSDP2's and dmuon's swaps covered above)
        for _, p in model.named_parameters():
            if isinstance(p, DTensor):
                yield p, "fsdp2: sharded param"
                if p.grad is not None:
                    yield p.grad, "fsdp2: sharded grad"
            else:
                yield p, "dmuon: owned master (param dtype)"
                if p.grad is not None:
                    yield p.grad, "dmuon: owner grad (reduced)"
        for _, b in model.named_buffers():
            yield b, "module buffers"

    return lambda: list(walk())


def install_contexts() -> None:
    """Label what FSDP2's and dmuon's runtime functions allocate (once per process)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

    from dmuon.exec._runtime._boundary import grad_reduce, hook_boundary

    def wrap(owner, name, label):
        orig = getattr(owner, name)

        @functools.wraps(orig)
        def inner(*a, **k):
            t = _TRACKER[0]
            if t is None:
                return orig(*a, **k)
            with t.context(label):
                return orig(*a, **k)

        setattr(owner, name, inner)

    for name, label in (
        ("unshard", "fsdp2.unshard (all-gather)"),
        ("wait_for_unshard", "fsdp2.wait_for_unshard (copy-out)"),
        ("reshard", "fsdp2.reshard"),
        ("post_backward", "fsdp2.post_backward (reduce-scatter)"),
        ("finalize_backward", "fsdp2.finalize_backward"),
    ):
        wrap(fpg.FSDPParamGroup, name, label)
    for name, label in (
        ("_unshard", "dmuon.unshard (broadcast)"),
        ("_assemble_grouped", "dmuon.assemble stacks"),
        ("_reshard", "dmuon.reshard"),
    ):
        wrap(hook_boundary.HookBoundary, name, label)
    from dmuon import _update

    for name, label in (
        ("momentum_", "muon: momentum (Nesterov input)"),
        ("orthogonalize_batch", "muon: stack + cast back"),
        ("orthogonalize_each", "muon: NS per matrix"),
        ("_newton_schulz", "muon: Newton-Schulz"),
        ("decay_and_apply_", "muon: decay + apply"),
    ):
        wrap(_update, name, label)
    wrap(torch.optim.AdamW, "step", "adamw.step")
    wrap(grad_reduce, "launch_reduce", "dmuon.launch_reduce")
    wrap(grad_reduce, "finish_reduces", "dmuon.finish_reduces")


_TRACKER: list = [None]


# ==============================================================================================
# One configuration
# ==============================================================================================


def _phase_hooks(model, tracker: LiveStorages) -> None:
    """``fwd:<module>`` / ``bwd:<module>`` phases for every block and the root; registered first
    (``prepend``) so that FSDP2's and dmuon's hooks run inside the phase."""

    def mark_fwd(name):
        def pre(module, args):
            tracker.set_phase(f"fwd:{name}")

        return pre

    def mark_bwd(name):
        def post(module, args, output):
            if torch.is_grad_enabled():
                for t in torch.utils._pytree.tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda g: tracker.set_phase(f"bwd:{name}"))
                        break
            tracker.set_phase("fwd:root")
            return output

        return post

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(mark_fwd(f"layers.{i}"), prepend=True)
        layer.register_forward_hook(mark_bwd(f"layers.{i}"), prepend=True)
    model.register_forward_pre_hook(mark_fwd("root"), prepend=True)
    model.register_forward_hook(mark_bwd("root (head)"), prepend=True)


def _grouped(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["label"]] = out.get(r["label"], 0) + r["nbytes"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _train_step(model, opt, tracker: LiveStorages, batch: torch.Tensor, snap: bool) -> None:
    """One step (forward, backward, optimizer step, zero_grad), its phases marked; ``snap``:
    classified snapshots at the start and after the backward."""
    import torch.nn.functional as F

    tracker.set_phase("step start")
    if snap:
        tracker.take("start")
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    del logits
    tracker.set_phase("bwd:loss")
    loss.backward()
    tracker.set_phase("after backward")
    if snap:
        tracker.take("after_backward")
    del loss
    tracker.set_phase("optimizer.step")
    opt.step()
    tracker.set_phase("zero_grad")
    opt.zero_grad()
    tracker.set_phase("idle")


def run_config(mesh, model_name: str, mp_name: str, variant: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    import dmuon
    from dmuon._train.byte_gpt import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**MODELS[model_name])
    mp = (
        fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp_name == "bf16" else None
    )
    fs_kw = {} if mp is None else dict(mp_policy=mp)
    tracker = LiveStorages()
    _TRACKER[0] = tracker
    gc.collect()
    with tracker:
        model = GPT(cfg, seed=0)
        total_numel = sum(p.numel() for p in model.parameters())
        ref_plan = dmuon.plan.compile(model, world, mp_policy=mp)  # the model's prediction (same as dedicate_params')
        if variant.startswith("dmuon"):
            collectives = "all_gather" if variant == "dmuon_allgather" else "auto"
            plan = dmuon.dedicate_params(model, mesh, reshard_after_forward=True, mp_policy=mp, collectives=collectives)
        for layer in model.layers:
            fsdp.fully_shard(layer, mesh=mesh, **fs_kw)
        fsdp.fully_shard(model, mesh=mesh, **fs_kw)
        if variant == "adamw":
            opt = torch.optim.AdamW(model.parameters())
        else:
            opt = dmuon.Muon(model, ns_batching="exact" if variant == "dmuon_exact" else "batched")
        _phase_hooks(model, tracker)
        tracker.classify = classifier(model, opt)
        gen = torch.Generator().manual_seed(100 + rank)
        batch = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)

        step = functools.partial(_train_step, model, opt, tracker, batch)

        step(False)  # warm-up: lazy init, optimizer state
        gc.collect()
        base = tracker.current - tracker.external
        tracker.peak, tracker.peaks, tracker.phase_peaks = base, {}, {}
        step(False)
        peaks_a, peak_raw, phase_peaks = dict(tracker.peaks), tracker.peak, dict(tracker.phase_peaks)
        tracker.peak, tracker.peaks, tracker.phase_peaks = tracker.current - tracker.external, {}, {}
        tracker.snapshot_at = {part: int(0.99 * v[0]) for part, v in peaks_a.items()}
        step(True)
        peaks_b = dict(tracker.peaks)
        snaps = tracker.snapshots
    _TRACKER[0] = None
    if variant.startswith("dmuon"):
        stats = plan.rank_stats()[rank]
        model_terms = stats.memory
    else:
        model_terms = ref_plan.adamw_rank_stats()[0].memory
    out = dict(
        model=model_name,
        mp=mp_name,
        variant=variant,
        rank=rank,
        total_numel=total_numel,
        idle_nbytes=base,
        peak_nbytes=max(v[0] for v in peaks_a.values()),
        peaks={
            part: dict(nbytes=v[0], phase=v[1], ctx=v[2], repeat_nbytes=peaks_b[part][0]) for part, v in peaks_a.items()
        },
        peak_with_backend_copies_nbytes=peak_raw,
        phase_peaks={k: v[0] for k, v in phase_peaks.items()},
        snapshots={
            name: dict(
                live_nbytes=s["live_nbytes"],
                external_nbytes=s["external_nbytes"],
                phase=s["phase"],
                ctx=s["ctx"],
                groups=_grouped(s["rows"]),
                top=s["rows"][:25],
                all_rows=s["rows"],
            )
            for name, s in snaps.items()
        },
        model_terms={k: getattr(model_terms, k) for k in model_terms.TERMS},
        model_peak_nbytes=model_terms.peak_nbytes,
    )
    if variant.startswith("dmuon"):
        out["plan_peak_transient_nbytes"] = stats.peak_transient_nbytes
        out["plan_owned_nbytes"] = stats.owned_nbytes
    del model, opt, tracker
    gc.collect()
    return out


def _body(job: dict) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon  # noqa: F401  (fully_shard integration)

    install_contexts()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for model_name in job["models"]:
        for mp_name in job["mps"]:
            for variant in job["variants"]:
                results.append(run_config(mesh, model_name, mp_name, variant))
                dist.barrier()
                if dist.get_rank() == 0:
                    print(f"  done {model_name} {mp_name} {variant}", file=sys.stderr, flush=True)
    return results


# ==============================================================================================
# Report
# ==============================================================================================


def mib(n: int) -> str:
    return f"{n / 2**20:8.2f}"


def report(ranks: list[list[dict]]) -> str:
    lines = []
    for i, r0 in enumerate(ranks[0]):
        rows = [rr[i] for rr in ranks]
        lines.append(f"== {r0['model']} ({r0['total_numel'] / 1e6:.1f} M params), mp={r0['mp']}, {r0['variant']}")
        for r in rows:
            lines.append(
                f"  rank {r['rank']}: peak {mib(r['peak_nbytes'])} MiB; idle {mib(r['idle_nbytes'])} MiB; "
                f"with gloo's own copies {mib(r['peak_with_backend_copies_nbytes'])} MiB; "
                f"model peak {mib(r['model_peak_nbytes'])} MiB"
            )
            for part, v in r["peaks"].items():
                lines.append(
                    f"    {part:<9} peak {mib(v['nbytes'])} MiB (repeat {mib(v['repeat_nbytes'])}) "
                    f"at {v['phase']} / {v['ctx'] or 'compute'}"
                )
            lines.append(
                "    model terms (MiB): " + ", ".join(f"{k[:-7]} {v / 2**20:.2f}" for k, v in r["model_terms"].items())
            )
            for name in ("start", "after_backward", "peak_fwd_bwd", "peak_optimizer"):
                s = r["snapshots"].get(name)
                if s is None:
                    continue
                lines.append(
                    f"    [{name}] live {mib(s['live_nbytes'])} MiB (+ gloo's copies {mib(s['external_nbytes'])}) "
                    f"in {s['phase']} / {s['ctx'] or 'compute'}"
                )
                for label, nb in s["groups"].items():
                    if nb >= 2**10:
                        lines.append(f"        {mib(nb)}  {label}")
                if name.startswith("peak"):
                    lines.append("      largest storages:")
                    for t in s["top"][:14]:
                        lines.append(
                            f"        {mib(t['nbytes'])}  {t['label'][:50]:<50} {t['dtype'][6:]:<9} {tuple(t['shape'])} "
                            f"made in {t['phase']} / {t['ctx'] or 'compute'} ({t['op']})"
                        )
            lines.append(
                "    max live per phase (MiB): "
                + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["phase_peaks"].items())
            )
    return "\n".join(lines)


# ==============================================================================================
# Measured bytes in the model's terms
# ==============================================================================================

#: the model's terms (MemoryTerms) and what it leaves out, in report order
TERMS = (
    "parameters",
    "gradients",
    "momentum",
    "adamw",
    "held wire copy",
    "transient: dmuon buffers",
    "transient: dmuon local grads",
    "transient: fsdp2",
    "activations",
    "backward compute",
    "optimizer-step temporaries",
    "other",
)
#: gloo's own copies (:data:`VIEW_OPS`): listed, never added to a total (NCCL has none)
BACKEND = "gloo's reduce copies (not in totals)"


def term_of(row: dict) -> str:
    """The term a classified storage counts under (:data:`TERMS`)."""
    label, ctx, phase = row["label"], row["ctx"], row["phase"]
    if label.startswith("backend copy"):
        return BACKEND
    if label in ("fsdp2: sharded param", "dmuon: owned master (param dtype)"):
        return "parameters"
    if label in ("fsdp2: sharded grad", "dmuon: owner grad (reduced)", "dmuon: staged owner grads"):
        return "gradients"
    if label.startswith("other in dmuon.") and row["op"] in ("div", "clone", "_to_copy"):
        return "gradients"  # an owner's average being staged (grad_reduce._stage_owner_grads)
    if label == "optimizer state (momentum_buffer)":
        return "momentum"
    if label.startswith("optimizer state"):
        return "adamw"
    if label == "dmuon: held segment's wire copy":
        return "held wire copy"
    if label == "dmuon: local full grad before packing":
        return "transient: dmuon local grads"
    if label.startswith("dmuon:") or label.startswith("other in dmuon."):
        return "transient: dmuon buffers"
    if label.startswith("fsdp2:") or label.startswith("other in fsdp2."):
        return "transient: fsdp2"
    if label.startswith("activations"):
        return "activations"
    if label.startswith("backward compute"):
        return "backward compute"
    if ctx.startswith(("muon:", "adamw")) or phase in OPTIMIZER_PHASES:
        return "optimizer-step temporaries"
    return "other"


def terms_at(snapshot: dict) -> dict[str, int]:
    out = dict.fromkeys((*TERMS, BACKEND), 0)
    for row in snapshot["all_rows"]:
        out[term_of(row)] += row["nbytes"]
    return out


def mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def headline(ranks: list[list[dict]]) -> str:
    """One row per configuration: the busiest rank's measured peaks (whole step, forward/backward,
    optimizer step) against the model's peak (MiB)."""
    lines = [
        "| model | mp | variant | busiest rank | measured peak | where | fwd/bwd peak | optimizer-step peak "
        "| model peak | measured − model |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for i in range(len(ranks[0])):
        r = max((rr[i] for rr in ranks), key=lambda x: x["peak_nbytes"])
        pk = r["peaks"]
        top = max(pk.values(), key=lambda v: v["nbytes"])
        lines.append(
            f"| {r['model']} | {r['mp']} | {r['variant']} | {r['rank']} | {mb(r['peak_nbytes'])} "
            f"| {top['phase']} / {top['ctx'] or 'compute'} | {mb(pk['fwd_bwd']['nbytes'])} "
            f"| {mb(pk['optimizer']['nbytes'])} | {mb(r['model_peak_nbytes'])} "
            f"| {(r['peak_nbytes'] - r['model_peak_nbytes']) / 2**20:+.2f} |"
        )
    return "\n".join(lines)


def markdown(ranks: list[list[dict]]) -> str:
    """Per configuration, the busiest rank: measured bytes by term at the forward/backward peak and
    at the optimizer-step peak, against the model's terms (MiB)."""
    lines = []
    for i in range(len(ranks[0])):
        r = max((rr[i] for rr in ranks), key=lambda x: x["peak_nbytes"])
        mt = r["model_terms"]
        model = {
            "parameters": mt["parameters_nbytes"],
            "gradients": mt["gradients_nbytes"],
            "momentum": mt["momentum_nbytes"] + mt["second_moment_nbytes"],
            "adamw": mt["adamw_nbytes"],
            "transient": mt["transient_nbytes"],
        }
        snaps = r["snapshots"]
        fb, op = terms_at(snaps["peak_fwd_bwd"]), terms_at(snaps["peak_optimizer"])
        lines.append(
            f"#### {r['model']}, mp={r['mp']}, {r['variant']} (rank {r['rank']}): measured peak "
            f"{r['peak_nbytes'] / 2**20:.2f} MiB, model {r['model_peak_nbytes'] / 2**20:.2f} MiB"
        )
        lines.append("")
        pk = r["peaks"]
        lines.append(
            f"| term | fwd/bwd peak ({pk['fwd_bwd']['phase']} / {pk['fwd_bwd']['ctx'] or 'compute'}) "
            f"| optimizer peak ({pk['optimizer']['ctx'] or 'compute'}) | model |"
        )
        lines.append("|---|---:|---:|---:|")
        trans = ("transient: dmuon buffers", "transient: dmuon local grads", "transient: fsdp2")
        for t in (*TERMS, BACKEND):
            m = model.get(t)
            if fb[t] or op[t] or m:
                lines.append(f"| {t} | {mb(fb[t])} | {mb(op[t])} | {'' if m is None else mb(m)} |")
            if t == trans[-1]:
                lines.append(
                    f"| *transient, the model's scope (the three above)* | {mb(sum(fb[x] for x in trans))} "
                    f"| {mb(sum(op[x] for x in trans))} | {mb(model['transient'])} |"
                )
        lines.append(
            f"| **total** | **{mb(snaps['peak_fwd_bwd']['live_nbytes'])}** "
            f"| **{mb(snaps['peak_optimizer']['live_nbytes'])}** | **{mb(r['model_peak_nbytes'])}** |"
        )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--mp", nargs="+", default=list(MPS), choices=list(MPS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None, help="write the per-term tables (markdown) here")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    from dmuon._launch import run_distributed

    job = dict(models=args.models, mps=args.mp, variants=args.variants)
    ranks = run_distributed(_body, args.nproc, job, timeout_s=args.timeout, backend="gloo", threads=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ranks, f, indent=1)
    print(report(ranks))
    if args.md:
        with open(args.md, "w") as f:
            f.write(headline(ranks) + "\n\n" + markdown(ranks) + "\n")


if __name__ == "__main__":
    main()
