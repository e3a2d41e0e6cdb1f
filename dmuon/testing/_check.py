"""The one-call checker of :mod:`dmuon.testing`: dmuon on ``world_size`` local CPU processes
against the single-process reference (:func:`check_against_reference`, its :class:`Report`),
and the bounds of the numerical contract it checks against (:func:`bounds`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from dmuon.testing._proxies import proxies_from_plan
from dmuon.testing._reference import reference_run

__all__ = [
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
            "from the non-EP model yourself (dmuon.testing.reference_run), as tests/exec/test_moe_ep.py does"
        )
    loss_bound, param_bound = bounds(ns_dtype)
    optimizer_kwargs = dict(optimizer_kwargs or {})
    if "ns_dtype" in optimizer_kwargs:
        raise TypeError("check_against_reference: pass ns_dtype as its own argument, not in optimizer_kwargs")
    ref_hp = dict(optimizer_kwargs if reference_kwargs is None else reference_kwargs)
    ref_hp.pop("ns_backend", None)
    ref_hp.pop("ns_dtype", None)

    results = run_distributed(
        _dmuon_worker,
        world_size,
        model_fn,
        loss_fn,
        batches,
        mesh_shape,
        seed,
        dict(dedicate_kwargs or {}),
        dict(fully_shard_kwargs or {}),
        {**optimizer_kwargs, "ns_dtype": ns_dtype},
        timeout_s=timeout_s,
        threads=threads,
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
