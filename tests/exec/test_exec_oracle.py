"""Runtime oracle tests: processes + gloo against single-process Muon + AdamW.

One process group per world size runs every configuration of that size (Z2/Z3 x bf16/fp32 NS x
models, the 1-D mesh and the HSDP meshes; each still its own test), since process start-up
dominates on 2 cores. Each case checks, against the single-process reference
of ``tests/oracle.py``:

* losses (fp32 NS: 1e-6 relative; bf16 NS: 2e-3 relative — see BF16_* below),
* final full parameters read through ``get_model_state_dict(full_state_dict=True)``
  (fp32 NS: within 1e-4 of each tensor's largest magnitude; bf16: 5e-2),
* ledger bytes per step, total and per rank, equal to ``plan.cost`` exactly, for the buffers
  all-gathered (the default ``collectives="auto"`` on these small models) and broadcast
  (``collectives="broadcast"``), with step-1 losses bit-identical between the two kinds (on
  N <= 2 every loss and parameter),
* exactly one Newton-Schulz per dedicated matrix per step, summed over ranks (none for a matrix
  no rank used, as torch.optim.Muon skips it),
* NorMuon (``variant="normuon"``) on N = 2, 3 and HSDP (2, 2) against the NorMuon
  reference, with the same bounds, and its ledger -- every collective issued, in order, with its
  group, root, dtype and bytes -- equal to the Muon case's on the same layout: zero extra bytes,
* a matrix used by one rank only, used twice in one forward, or used by no rank,
* offload of owned state (``dedicate_params`` and ``fully_shard`` given
  ``CPUOffloadPolicy(pin_memory=False)``) at N = 2 and on HSDP (2, 2), Z2 and Z3, against the same
  oracle; and its copy path: every held master is a tensor of its own, never the broadcast buffer,
  and no momentum or update op of the step runs on a host master or momentum (they run on copies),
* no full-size storage for non-held segments after a Z3 forward, a no-grad forward and the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import dmuon
from dmuon.exec import get_model_runtime

from dmuon.testing import BF16_LOSS_RTOL, BF16_PARAM_TOL, FP32_LOSS_RTOL, FP32_PARAM_TOL
from shared_launch import shared_run
from oracle import dmuon_optimizer, global_batches, lm_loss, make_model, reference_run

STEPS = 3
# bf16 Newton-Schulz amplifies reduction-order noise (README, "The oracle guarantee"). Measured on
# this suite (3 steps, N = 2..4): worst loss deviation 1.9e-6 relative, parameters 9.5e-3 of
# max|p| (fp32 NS: 2.3e-7 and 3.0e-6). The bounds, with margin, are the contract's, defined once
# in dmuon.testing (the checker users run): BF16_LOSS_RTOL 2e-3, BF16_PARAM_TOL 5e-2,
# FP32_LOSS_RTOL 1e-6, FP32_PARAM_TOL 1e-4.

CASES = [
    # (model kind, reshard_after_forward, ns fp32[, collectives[, variant]]); the default collectives="auto"
    # all-gathers these small buffers on every N >= 2 but "two" at N = 4 (asserted), the last two force broadcasts
    ("tiny", True, True),
    ("tiny", False, True),
    ("tiny", True, False),
    ("two", True, True),
    ("two", False, False),
    ("gated", True, True),
    ("gated", False, True),
    ("tiny", True, True, "broadcast"),
    ("tiny", False, True, "broadcast"),
]


def _non_held_storage_nbytes(model) -> int:
    rt = get_model_runtime(model)
    return sum(seg.wire.untyped_storage().nbytes() for b in rt.boundaries for seg in b.segments if not seg.held)


class _CopySpy:
    """Offload's copy path, watched over the steps: the storages the step's momentum and update ops
    (``dmuon._update.momentum_`` / ``decay_and_apply_``) write, against the host masters and momenta."""

    def __init__(self, model, opt):
        import dmuon._update as U

        self.U, self.rt, self.opt, self.written = U, get_model_runtime(model), opt, []
        self.orig = (U.momentum_, U.decay_and_apply_)
        self.grad_nbytes = None  # the owners' host gradients at the first step

        def step(*args, _step=opt.step, **kw):
            if self.grad_nbytes is None:
                owned = [p for g in opt.param_groups if g["use_muon"] for p in g["params"] if _is_owner(p)]
                self.grad_nbytes = sum(p.grad.untyped_storage().nbytes() for p in owned if p.grad is not None)
            return _step(*args, **kw)

        opt.step = step

    def __enter__(self):
        momentum, apply = self.orig

        def spy_momentum(grads, bufs, **kw):
            self.written += [b.untyped_storage().data_ptr() for b in bufs]
            return momentum(grads, bufs, **kw)

        def spy_apply(params, updates, **kw):
            self.written += [p.untyped_storage().data_ptr() for p in params]
            return apply(params, updates, **kw)

        self.U.momentum_, self.U.decay_and_apply_ = spy_momentum, spy_apply

    def __exit__(self, *exc):
        self.U.momentum_, self.U.decay_and_apply_ = self.orig

    def report(self) -> dict:
        held = [seg for b in self.rt.boundaries for seg in b.segments if seg.held]
        host = {seg.master.untyped_storage().data_ptr() for seg in held}
        momenta = [s["momentum_buffer"] for s in self.opt.state.values() if "momentum_buffer" in s]
        host |= {m.untyped_storage().data_ptr() for m in momenta}
        return dict(
            held=len(held),
            owned_momenta=len(momenta),
            # host bytes of owned state, as the memory model's offload terms count them
            master_nbytes=sum(seg.master.untyped_storage().nbytes() for seg in held),
            wire_nbytes=sum(seg.wire.untyped_storage().nbytes() for seg in held),
            momentum_nbytes=sum(m.untyped_storage().nbytes() for m in momenta),
            grad_nbytes=self.grad_nbytes,
            master_is_wire=sum(
                seg.master.untyped_storage().data_ptr() == seg.wire.untyped_storage().data_ptr() for seg in held
            ),
            masters_on_host=all(seg.master.device.type == "cpu" for seg in held),
            ops_written=len(self.written),
            ops_on_host_state=sum(p in host for p in self.written),
        )


def _is_owner(p) -> bool:
    from dmuon._tags import dedicated_info

    info = dedicated_info(p)
    return info is not None and info.is_owner


def _worker(cases, mesh_shape=None, replicate_async=True):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import dmuon
    from dmuon.exec._comm.collective_calls import LEDGER, metered
    from ns_spy import counting_ns

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if mesh_shape is not None:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    out = []
    for kind, z3, ns_fp32, *rest in cases:
        collectives = rest[0] if rest else "auto"
        variant = rest[1] if len(rest) > 1 else "muon"
        offload = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if rest[2:] == ["offload"] else {}
        model = make_model(kind)
        if hasattr(model, "set_rank"):
            model.set_rank(rank)
        plan = dmuon.dedicate_params(
            model, mesh, reshard_after_forward=z3, replicate_async=replicate_async, collectives=collectives, **offload
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **offload)
        fully_shard(model, mesh=mesh, **offload)
        opt = dmuon_optimizer(model, torch.float32 if ns_fp32 else torch.bfloat16, variant=variant)
        losses, ledgers, ns_calls, storage, ops = [], [], [], {}, []
        copies = _CopySpy(model, opt) if offload else contextlib.nullcontext()
        for step, batch in enumerate(global_batches(STEPS)):
            local = batch.chunk(world)[rank]
            LEDGER.reset()
            with counting_ns() as step_ns, metered(record=True) as led, copies:  # NS calls of this step
                loss = lm_loss(model, local)
                if step == 0:
                    storage["after_forward"] = _non_held_storage_nbytes(model)
                loss.backward()
                opt.step()
                opt.zero_grad()
                storage.setdefault("after_step", _non_held_storage_nbytes(model))
                ledgers.append(LEDGER.snapshot())
            ns_calls.append(step_ns.matrices)
            ops.append([tuple(dataclasses.astuple(op)) for op in led.ops])
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        # read through the state-dict API right after step(): waits for pending replicate broadcasts
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        full = {k: v.detach().clone() for k, v in full.items()}
        # the next forward never uses a stale replica: same input -> same output on every rank
        probe = global_batches(1, seed=9)[0][:2, :-1]
        if hasattr(model, "set_rank"):
            model.set_rank(0)
        with torch.no_grad():
            logits = model(probe)
        storage["after_no_grad_forward"] = _non_held_storage_nbytes(model)
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits)
        same_output_everywhere = all(torch.equal(gathered[0], g) for g in gathered)
        out.append(
            dict(
                plan_json=plan.to_json(),
                losses=losses,
                ledgers=ledgers,
                ns_calls=ns_calls,
                ops=ops,
                storage=storage,
                same_output_everywhere=same_output_everywhere,
                full=full if rank == 0 else None,
                copy_path=copies.report() if offload else None,
            )
        )
        dist.barrier()
    return out


WORLDS = [1, 2, 3, 4]
HSDP_CASES = [("tiny", True, True), ("tiny", False, True), ("two", True, False), ("tiny", True, True, "broadcast")]
# offload of owned state (CPUOffloadPolicy(pin_memory=False) to dedicate_params and fully_shard), Z3 and Z2,
# at N = 2 and on HSDP (2, 2)
OFFLOAD_CASES = [("tiny", True, True, "auto", "muon", "offload"), ("two", False, False, "auto", "muon", "offload")]
OFFLOAD_WORLDS = (2,)
OFFLOAD_MESHES = (((2, 2), True),)
HSDP_MESHES = [((2, 2), True), ((2, 2), False), ((2, 1), True), ((1, 4), False), ((3, 1), False)]


# NorMuon (variant="normuon") on the layouts the issue names, each next to a Muon case of the same
# (model, Z3, fp32 NS) whose ledger it must equal
NORMUON_CASE = ("tiny", True, True, "auto", "normuon")
NORMUON_WORLDS = (2, 3)
NORMUON_MESHES = (((2, 2), True),)


def _configs(world):
    """Every configuration of one world size, run in ONE launch (``label, cases, mesh_shape,
    replicate_async``): the 1-D mesh, then the HSDP meshes of that size."""
    extra = ([NORMUON_CASE] if world in NORMUON_WORLDS else []) + (OFFLOAD_CASES if world in OFFLOAD_WORLDS else [])
    out = [(f"world={world}", CASES + extra, None, True)]
    for mesh_shape, replicate_async in HSDP_MESHES:
        if mesh_shape[0] * mesh_shape[1] == world:
            extra = [NORMUON_CASE] if (mesh_shape, replicate_async) in NORMUON_MESHES else []
            extra += OFFLOAD_CASES if (mesh_shape, replicate_async) in OFFLOAD_MESHES else []
            out.append(
                (
                    f"mesh={mesh_shape} replicate_async={replicate_async}",
                    HSDP_CASES + extra,
                    mesh_shape,
                    replicate_async,
                )
            )
    return out


def _configs_worker(configs):
    return [_worker(cases, mesh_shape, replicate_async) for _, cases, mesh_shape, replicate_async in configs]


def _results(world, label):
    """Every rank's results of configuration ``label``, from the launch of its world size."""
    configs = _configs(world)
    runs = shared_run(("test_exec_oracle", world), _configs_worker, world, configs, timeout_s=240 * len(configs))
    i = [c[0] for c in configs].index(label)
    return [r[i] for r in runs]


def _cases(label):
    """The cases of configuration ``label``."""
    for w in WORLDS:
        for c in _configs(w):
            if c[0] == label:
                return c[1]
    raise KeyError(label)


@pytest.mark.parametrize("world", WORLDS)
def test_matches_single_process_muon_adamw(world):
    results = _results(world, f"world={world}")
    _check_against_oracle(results, _cases(f"world={world}"), f"world={world}")


@pytest.mark.parametrize("mesh_shape, replicate_async", HSDP_MESHES)
def test_hsdp_matches_single_process_muon_adamw(mesh_shape, replicate_async):
    world = mesh_shape[0] * mesh_shape[1]
    label = f"mesh={mesh_shape} replicate_async={replicate_async}"
    results = _results(world, label)
    _check_against_oracle(results, _cases(label), label)


_NORMUON_LABELS = [f"world={w}" for w in NORMUON_WORLDS] + [f"mesh={m} replicate_async={a}" for m, a in NORMUON_MESHES]


@pytest.mark.parametrize("label", _NORMUON_LABELS)
def test_normuon_ledger_equals_muon_ledger(label):
    """NorMuon moves no extra byte: every rank issues the same collectives as Muon on the same
    layout (kind, phase, group, root, dtype, elements, bytes), in the same order, every step."""
    world = next(w for w in WORLDS if any(c[0] == label for c in _configs(w)))
    cases = _cases(label)
    results = _results(world, label)
    i_nm = cases.index(NORMUON_CASE)
    i_mu = cases.index(NORMUON_CASE[:3])
    for r in results:
        assert r[i_nm]["ops"] == r[i_mu]["ops"], label
        assert r[i_nm]["ledgers"] == r[i_mu]["ledgers"], label
        assert r[i_nm]["ops"][0], label  # the layout does move bytes


def _check_against_oracle(results, cases, label):
    from dmuon.plan import ShardingPlan

    for case_idx, (kind, z3, ns_fp32, *rest) in enumerate(cases):
        collectives = rest[0] if rest else "auto"
        variant = rest[1] if len(rest) > 1 else "muon"
        offload = rest[2:] == ["offload"]
        per_rank = [r[case_idx] for r in results]
        plan = ShardingPlan.from_json(per_rank[0]["plan_json"])
        assert all(ShardingPlan.from_json(r["plan_json"]) == plan for r in per_rank)
        kinds = {buf.collective for b in plan.boundaries for buf in b.buffers}
        # dedicate_params priced collectives="auto" with its process group's (gloo) link record:
        # these latency-bound buffers all-gather on every N >= 2 but the two-matrix model's at N = 4
        assert plan.collectives.link == "gloo", label
        gloo_plan = dmuon.plan.compile(
            make_model(kind),
            plan.mesh_shape,
            reshard_after_forward=z3,
            collectives=collectives,
            collective_backend="gloo",
        )
        want = {buf.collective for b in gloo_plan.boundaries for buf in b.buffers}
        if collectives == "auto" and plan.mesh_shape[1] > 1 and not (kind == "two" and plan.mesh_shape[1] == 4):
            assert want == {"all_gather"}, (label, kind)
        assert kinds == want, (label, kinds)
        ref_losses, ref_state, ref_ns_calls = reference_run(
            make_model(kind),
            set(plan.dedicated),
            global_batches(STEPS),
            ns_fp32=ns_fp32,
            world=len(per_rank),
            variant=variant,
        )
        loss_tol = FP32_LOSS_RTOL if ns_fp32 else BF16_LOSS_RTOL
        param_tol = FP32_PARAM_TOL if ns_fp32 else BF16_PARAM_TOL
        where = f"{label} model={kind} z3={z3} ns_fp32={ns_fp32} collectives={collectives} variant={variant}"
        where += " offload" if offload else ""
        if offload:  # the copy path: masters of their own on the host, every step op on a copy
            reports = [r["copy_path"] for r in per_rank]
            assert sum(c["held"] for c in reports) > 0, (where, reports)
            assert sum(c["owned_momenta"] for c in reports) == len(plan.dedicated), (where, reports)
            # the memory model's offload terms are the bytes the runtime holds between steps: host
            # masters (whole held segments), no device broadcast copy (each lives only while its
            # boundary is unsharded), host momenta and owners' host gradients
            from dmuon.plan._cost.rank_memory import held_segment_nbytes

            stats = plan.rank_stats(offload=True)
            masters = held_segment_nbytes(plan)
            for rank, c in enumerate(reports):
                got = (c["master_nbytes"], c["wire_nbytes"], c["momentum_nbytes"], c["grad_nbytes"])
                want = (masters[rank], stats[rank].memory.parameters_nbytes, stats[rank].memory.host_momentum_nbytes)
                assert got == want + (stats[rank].owned_nbytes,) and want[1] == 0, (where, rank, got, want)
            for c in reports:
                assert c["masters_on_host"] and c["master_is_wire"] == 0, (where, c)
                assert c["ops_on_host_state"] == 0, (where, c)
                assert c["ops_written"] >= 2 * STEPS * (c["owned_momenta"] > 0), (where, c)
        for got, want in zip(per_rank[0]["losses"], ref_losses):
            assert math.isclose(got, want, rel_tol=loss_tol), (where, got, want)
        full = per_rank[0]["full"]
        assert set(full) == set(ref_state), where
        for k, want in ref_state.items():
            got = full[k]
            assert got.shape == want.shape, (where, k)
            scale = want.abs().max().item() or 1.0
            err = (got - want).abs().max().item()
            assert err <= param_tol * scale, (where, k, err, scale)
        # bytes per step: exact, total and per rank
        cost = plan.cost
        for step in range(STEPS):
            per_rank_bytes = [sum(v for p, v in r["ledgers"][step].items() if p != "other") for r in per_rank]
            assert tuple(per_rank_bytes) == tuple(cost.per_rank_nbytes), (where, step)
            assert sum(per_rank_bytes) == cost.total_nbytes
            for phase, field in [
                ("forward_broadcast", "forward_broadcast_nbytes"),
                ("backward_broadcast", "backward_broadcast_nbytes"),
                ("reduce", "reduce_nbytes"),
                ("replicate_reduce", "replicate_reduce_nbytes"),
                ("replicate_broadcast", "replicate_broadcast_nbytes"),
            ]:
                assert sum(r["ledgers"][step][phase] for r in per_rank) == getattr(cost, field), (where, phase)
            # exactly one Newton-Schulz per dedicated matrix per step, across all ranks
            assert sum(r["ns_calls"][step] for r in per_rank) == ref_ns_calls[step], where
        # non-owners hold no full-size storage for dedicated matrices
        for r in per_rank:
            assert r["same_output_everywhere"], where
            assert r["storage"]["after_no_grad_forward"] == 0, where
            assert r["storage"]["after_step"] == 0, where
            if z3:
                assert r["storage"]["after_forward"] == 0, where
    _check_kinds_agree(results, cases, label)


def _check_kinds_agree(results, cases, label):
    """The same case moved by broadcasts and by all-gathers: step-1 losses bit-identical (same
    parameters, any transport); on N <= 2 every loss and final parameter too (a SUM of two
    gradients is the same in any order); on N >= 3 the reduce and the reduce-scatter may sum in
    different orders, so later steps agree within the oracle's bounds (checked above)."""
    from dmuon.plan import ShardingPlan

    index = {tuple(c): i for i, c in enumerate(cases)}
    for case in cases:
        if len(case) < 4 or case[3] == "auto" or case[4:] not in ((), ("muon",)):
            continue  # a broadcast twin of a Muon case
        auto = index.get(tuple(case[:3]))
        if auto is None:
            continue
        a, b = results[0][auto], results[0][index[tuple(case)]]
        where = f"{label} {case[:3]}: auto vs {case[3]}"
        assert a["losses"][0] == b["losses"][0], where
        if ShardingPlan.from_json(a["plan_json"]).mesh_shape[1] <= 2:
            assert a["losses"] == b["losses"], where
            assert all(torch.equal(a["full"][k], b["full"][k]) for k in a["full"]), where
