r"""Pipeline parallelism in the simulator: one step of a pipelined model, dmuon or FSDP2 + AdamW.

:func:`simulate_pipeline` prices a step of ``pp`` pipeline ranks, each holding ``V`` stages
(:class:`dmuon.plan.StagePlans`: one dmuon plan per stage over the stage's data-parallel mesh),
``M`` micro-batches, a schedule of :mod:`dmuon.sim._pipeline.pp_schedule`, in three parts:

1. **Each stage alone.** :func:`dmuon.sim.simulate` replays the stage's own step (its plan's
   schedule of :func:`dmuon.plan._cost.stage_bytes.pipeline_step`, the step whose bytes
   :func:`dmuon.plan.pipeline_cost` counts: ``M`` micro-batches, one reduce after the last
   backward, Z2's buffers broadcast once per step, activation checkpointing's recompute included)
   on its data-parallel ranks. From rank 0's timeline: the time until its last
   backward ends (``pipeline_part_s``), split into one micro-batch's forward and backward in the
   proportion of their compute, and the rest of the step (``tail_s``: the gradient collectives
   still exposed, Newton-Schulz, the optimizer).
2. **The pipeline.** :func:`~dmuon.sim._pipeline.pp_schedule.replay_pipeline` replays the schedule's
   actions on those forward / backward seconds, with each activation (and gradient) send priced
   as a point-to-point transfer of ``tokens / M · hidden`` activation-dtype bytes between a rank
   and its peer ``dp · tp`` ranks away (mesh order ``(pp, dp, tp)``, so the hardware's link
   between them: InfiniBand once a stage's ranks fill a node).
3. **The step** of pipeline rank ``r`` ends at its last backward in the pipeline plus the tails of
   its stages (run one after another); the step is the latest rank. Its bubble is the rank's idle
   time in the pipeline (the schedule's fill and drain, and waits on sends).

Memory per pipeline rank: for each of its stages the stage's peak less its activations (the
largest over the stage's data-parallel ranks, :func:`dmuon.sim._engine.sim_memory.memory`), plus
the most activation bytes the schedule holds at once (every in-flight micro-batch's, per stage), plus the
largest activations a recompute rebuilds during one boundary's backward.

Assumptions (stated, not measured): stages that share one plan object
(:func:`dmuon.plan.compile_stages` with ``reuse_equal_stages=True``) are simulated once; dmuon's
and FSDP2's collectives overlap with a stage's compute in the pipeline as they do back to back
(part 1); the pipeline's sends do not contend with them for the link; the last stage's logits and
the loss are not held across micro-batches; a stage's ranks are numbered from 0 in its own
simulation (which node boundary they cross is the first stage's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dmuon.plan._cost.stage_bytes import pipeline_step
from dmuon.plan._scheduling.ops import Step
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.sim._engine.hardware import Hardware, collective_s
from dmuon.sim._engine.records import MemoryBreakdown
from dmuon.sim._engine.workload import AC_MODES

from dmuon.sim._pipeline import pp_schedule as _ps

__all__ = [
    "StageTime",
    "PipelineRank",
    "PipelineSimulation",
    "simulate_pipeline",
    "stage_memory",
    "stage_step",
    "pipeline_peak_nbytes",
    "send_seconds",
    "AC_MODES",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StageTime:
    """One stage's own step (part 1 of the module docstring), in one variant.

    Attributes:
        stage: the stage index.
        step_s: its ``M`` micro-batches back to back, the optimizer included.
        pipeline_part_s: until its last backward ends.
        forward_s / backward_s: one micro-batch's forward / backward (recompute included) in
            the pipeline.
        tail_s: ``step_s - pipeline_part_s``.
        recompute_s: activation checkpointing's recompute in the step (rank 0).
        exposed_comm_s: communication its critical rank waited for.
        ns_s: its busiest rank's Newton-Schulz seconds.
        memory: the peak terms of its rank with the largest peak.
        activation_nbytes: one micro-batch's activations.
        recompute_transient_nbytes: what a recompute rebuilds in one boundary's backward.
        send_nbytes: one activation send to the next stage.
        dmuon_nbytes: dmuon's bytes in the step, summed over the stage's ranks (the ledger's
            rule; equal to :func:`dmuon.plan.pipeline_cost`'s total; 0 for ``adamw``).
    """

    stage: int
    step_s: float
    pipeline_part_s: float
    forward_s: float
    backward_s: float
    tail_s: float
    recompute_s: float
    exposed_comm_s: float
    ns_s: float
    memory: MemoryBreakdown
    activation_nbytes: int
    recompute_transient_nbytes: int
    send_nbytes: int
    dmuon_nbytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PipelineRank:
    """One pipeline rank's step: ``end_s = pipeline_end_s + tail_s``; ``bubble_s`` = its idle
    time in the pipeline; ``peak_memory_nbytes`` = its stages' peaks without activations + the
    in-flight activations (``activation_nbytes``, ``in_flight`` micro-batches) + one recompute."""

    pp_rank: int
    stages: tuple[int, ...]
    pipeline_end_s: float
    busy_s: float
    bubble_s: float
    tail_s: float
    end_s: float
    in_flight: int
    activation_nbytes: int
    peak_memory_nbytes: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSimulation:
    """A pipelined step (module docstring) of one variant (``"z2"``, ``"z3"``, ``"adamw"``)."""

    variant: str
    schedule: str
    pp_size: int
    stages_per_rank: int
    micro_batches: int
    ac: str
    send_s: tuple[float, ...]
    stages: tuple[StageTime, ...]
    ranks: tuple[PipelineRank, ...]

    @property
    def step_s(self) -> float:
        return max(r.end_s for r in self.ranks)

    @property
    def critical_rank(self) -> int:
        return max(self.ranks, key=lambda r: (r.end_s, -r.pp_rank)).pp_rank

    @property
    def bubble_s(self) -> float:
        return self.ranks[self.critical_rank].bubble_s

    @property
    def peak_memory_nbytes(self) -> tuple[int, ...]:
        return tuple(r.peak_memory_nbytes for r in self.ranks)

    def _crit_stages(self) -> list[StageTime]:
        return [self.stages[s] for s in self.ranks[self.critical_rank].stages]

    @property
    def ns_s(self) -> float:
        return sum(s.ns_s for s in self._crit_stages())

    @property
    def exposed_comm_s(self) -> float:
        return sum(s.exposed_comm_s for s in self._crit_stages())

    @property
    def recompute_s(self) -> float:
        return sum(s.recompute_s for s in self._crit_stages())

    def terms(self) -> dict[str, float]:
        """The critical rank's step by term (seconds): bubble, exposed communication, NS,
        recompute, and the rest (``compute``: forward, backward, optimizer)."""
        t = dict(bubble=self.bubble_s, exposed_comm=self.exposed_comm_s, ns=self.ns_s, recompute=self.recompute_s)
        t["compute"] = max(0.0, self.step_s - sum(t.values()))
        return t

    def bound(self) -> str:
        """What bounds the step beside the model's own compute: the largest of bubble, exposed
        communication, NS and recompute on the critical rank."""
        t = self.terms()
        t.pop("compute")
        name = max(t, key=t.get)
        return {"exposed_comm": "exposed communication", "ns": "Newton-Schulz"}.get(name, name)


def stage_step(plan: Any, micro_batches: int, ac: str) -> Step:
    """The stage's step as :func:`dmuon.sim.simulate` replays it: :func:`dmuon.plan.pipeline_cost`'s
    step (:func:`~dmuon.plan._cost.stage_bytes.pipeline_step`) of ``micro_batches`` micro-batches;
    with activation checkpointing every boundary recomputed."""
    rec = tuple(b.fqn for b in plan.boundaries) if ac != "none" else ()
    return pipeline_step(micro_batches, rec)


def stage_memory(
    plan: Any,
    workload: Any,
    variant: str,
    *,
    fsdp2_reshard_after_forward: bool | None = None,
    micro_batches: int = 1,
) -> MemoryBreakdown:
    """The peak terms of the stage's rank with the largest peak in ``variant``
    (:func:`dmuon.sim._engine.sim_memory.memory` as :func:`dmuon.sim.simulate` calls it: dmuon on the plan in
    that mode); more than one micro-batch: every gradient accumulates to the step's reduce."""
    from dmuon.sim._engine.sim_memory import memory

    if variant in ("z2", "z3") and plan.reshard_after_forward != (variant == "z3"):
        plan = dataclasses.replace(plan, reshard_after_forward=variant == "z3")
    fsdp2 = None if variant in ("z2", "z3") else fsdp2_reshard_after_forward
    mems = memory(plan, workload, variant, fsdp2_reshard_after_forward=fsdp2, accumulate=micro_batches > 1)
    return max(mems, key=lambda m: m.peak_nbytes)


def pipeline_peak_nbytes(
    split: Any,
    stage_memories: Sequence[MemoryBreakdown],
    stage_activation_nbytes: Sequence[int],
    stage_recompute_nbytes: Sequence[int],
    order: Sequence[Sequence[Any]],
) -> tuple[int, ...]:
    """Peak bytes per pipeline rank (module docstring): its stages' peaks less their activations,
    plus the most activation bytes its actions in ``order`` hold at once (a forward holds its
    stage's micro-batch activations until that micro-batch's backward), plus its largest recompute."""
    out = []
    for r in range(split.pp_size):
        mine = split.rank_stages(r)
        static = sum(stage_memories[s].peak_nbytes - stage_memories[s].activations_nbytes for s in mine)
        held = peak = 0
        for a in order[r]:
            held += stage_activation_nbytes[a.stage] if a.kind == "F" else -stage_activation_nbytes[a.stage]
            peak = max(peak, held)
        out.append(static + peak + max(stage_recompute_nbytes[s] for s in mine))
    return tuple(out)


def send_seconds(hw: Hardware, pp_size: int, dp_tp_ranks: int, send_nbytes: int) -> float:
    """One activation send between neighbouring pipeline ranks, ``dp_tp_ranks`` apart (mesh order
    ``(pp, dp, tp)``): a two-rank transfer on the link between them (0 without PP)."""
    return collective_s(hw, "broadcast", (0, dp_tp_ranks), send_nbytes) if pp_size > 1 else 0.0


def _stage_time(
    stage: int, plan: Any, hw: Hardware, wl: Any, variant: str, micro_batches: int, ac: str, fsdp2_reshard: bool
) -> StageTime:
    from dmuon.sim._engine.simulate import simulate

    sim = simulate(
        plan,
        hw,
        wl,
        stage_step(plan, micro_batches, ac),
        variant=variant,
        timeline_ranks=(0,),
        fsdp2_reshard_after_forward=fsdp2_reshard if variant not in ("z2", "z3") else None,
    )
    tl = sim.timelines.get(0, ())
    comp = [i for i in tl if i.lane == "compute"]
    last_bwd = max((i.end_s for i in comp if i.kind == "backward"), default=0.0)
    fwd = sum(i.end_s - i.start_s for i in comp if i.kind == "forward")
    bwd = sum(i.end_s - i.start_s for i in comp if i.kind in ("backward", "recompute"))
    rec = sum(i.end_s - i.start_s for i in comp if i.kind == "recompute")
    per_mb = last_bwd / micro_batches
    share = fwd / (fwd + bwd) if fwd + bwd > 0 else 0.5
    mem = stage_memory(plan, wl, variant, fsdp2_reshard_after_forward=fsdp2_reshard, micro_batches=micro_batches)
    hidden = max((w.hidden for _, w in wl.boundaries), default=0)
    send = (wl.tokens_per_rank // micro_batches) * hidden * itemsize_nbytes(wl.activation_dtype)
    return StageTime(
        stage=stage,
        step_s=sim.step_s,
        pipeline_part_s=last_bwd,
        forward_s=per_mb * share,
        backward_s=per_mb * (1 - share),
        tail_s=max(0.0, sim.step_s - last_bwd),
        recompute_s=rec,
        exposed_comm_s=sim.exposed_comm_s,
        ns_s=sim.ns_s,
        memory=mem,
        activation_nbytes=wl.activation_nbytes,
        recompute_transient_nbytes=wl.recompute_transient_nbytes,
        send_nbytes=int(send),
        dmuon_nbytes=sim.dmuon_nbytes,
    )


def simulate_pipeline(
    stage_plans: Any,
    hardware: Hardware,
    *,
    tokens_per_rank: int,
    seq_len: int,
    micro_batches: int,
    schedule: str = "1f1b",
    ac: str = "none",
    variants: Sequence[str] = ("adamw", "z2"),
    activation_dtype: str = "torch.bfloat16",
    top_k: int = 2,
) -> dict[str, PipelineSimulation]:
    """Simulate one pipelined step per variant (module docstring).

    Args:
        stage_plans: :func:`dmuon.plan.compile_stages`' result (its split and one plan per stage).
        hardware: the hardware record.
        tokens_per_rank: tokens each data-parallel rank (each pipeline) processes per step.
        seq_len: tokens per sequence.
        micro_batches: micro-batches per step (each ``tokens_per_rank / micro_batches`` tokens).
        schedule: one of :data:`dmuon.sim._pipeline.pp_schedule.SCHEDULES`.
        ac: activation checkpointing, one of :data:`AC_MODES` (:func:`dmuon.sim.from_plan`).
        variants: ``"z2"`` / ``"z3"`` (dmuon) and ``"adamw"`` (FSDP2 + AdamW; under pipeline
            parallelism with ``reshard_after_forward=False``, as torchtitan sets it, else True).
        activation_dtype / top_k: as :func:`dmuon.sim.from_plan`.

    Raises:
        ValueError: an unknown schedule or AC mode, micro-batches that do not divide the tokens,
            or a schedule that does not fit the split's stages per rank.
    """
    from dmuon.sim._engine.workload import from_plan

    split = stage_plans.split
    P, V, M = split.pp_size, split.stages_per_rank, micro_batches
    if ac not in AC_MODES:
        raise ValueError(f"unknown activation checkpointing {ac!r}: one of {AC_MODES}")
    if M < 1 or tokens_per_rank % M:
        raise ValueError(f"micro-batches ({M}) must be >= 1 and divide the tokens per rank ({tokens_per_rank:,})")
    order = _ps.pipeline_order(schedule, P, M, V)
    plans = stage_plans.plans
    dp_tp = plans[0].world_size * plans[0].tp_size
    out: dict[str, PipelineSimulation] = {}
    wls = [
        from_plan(
            p,
            tokens_per_rank=tokens_per_rank,
            seq_len=seq_len,
            micro_batches=M,
            activation_dtype=activation_dtype,
            top_k=top_k,
            ac=ac,
        )
        for p in plans
    ]
    for variant in variants:
        cache: dict[tuple, StageTime] = {}
        stages = []
        for s, (plan, wl) in enumerate(zip(plans, wls)):
            key = (id(plan), s == 0, s == len(plans) - 1)
            st = cache.get(key)
            if st is None:
                st = cache[key] = _stage_time(s, plan, hardware, wl, variant, M, ac, P == 1)
            stages.append(dataclasses.replace(st, stage=s))
        send_s = tuple(send_seconds(hardware, P, dp_tp, st.send_nbytes) for st in stages)
        rp = _ps.replay_pipeline(
            order,
            [st.forward_s for st in stages],
            [st.backward_s for st in stages],
            send_s=send_s,
            activation_nbytes=[st.activation_nbytes for st in stages],
        )
        peaks = pipeline_peak_nbytes(
            split,
            [st.memory for st in stages],
            [st.activation_nbytes for st in stages],
            [st.recompute_transient_nbytes for st in stages],
            order,
        )
        ranks = []
        for r in range(P):
            mine = split.rank_stages(r)
            tail = sum(stages[s].tail_s for s in mine)
            ranks.append(
                PipelineRank(
                    pp_rank=r,
                    stages=mine,
                    pipeline_end_s=rp.end_s[r],
                    busy_s=rp.busy_s[r],
                    bubble_s=rp.idle_s[r],
                    tail_s=tail,
                    end_s=rp.end_s[r] + tail,
                    in_flight=rp.in_flight[r],
                    activation_nbytes=rp.activation_nbytes[r],
                    peak_memory_nbytes=peaks[r],
                )
            )
        out[variant] = PipelineSimulation(
            variant=variant,
            schedule=schedule,
            pp_size=P,
            stages_per_rank=V,
            micro_batches=M,
            ac=ac,
            send_s=send_s,
            stages=tuple(stages),
            ranks=tuple(ranks),
        )
    return out
