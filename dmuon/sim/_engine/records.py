"""The simulator's result records: :class:`Simulation` (the step), :class:`RankTime` (one rank),
:class:`MemoryBreakdown` (peak bytes by term, :func:`dmuon.sim._engine.sim_memory.memory`), :class:`PathStep`
(the critical path) and :class:`Interval` (a timeline bar). Made by :func:`dmuon.sim.simulate`."""

from __future__ import annotations

import dataclasses

__all__ = ["Interval", "PathStep", "MemoryBreakdown", "RankTime", "Simulation", "Simulations"]


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    """One bar of a rank's timeline: ``lane`` is ``"compute"`` or a channel name."""

    start_s: float
    end_s: float
    lane: str
    kind: str
    label: str


@dataclasses.dataclass(frozen=True, slots=True)
class PathStep:
    """One op of the critical path, on ``rank``, and why it could not start earlier."""

    rank: int
    kind: str
    label: str
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Peak bytes on one rank, by term (:func:`memory`)."""

    parameters_nbytes: int
    gradients_nbytes: int
    optimizer_state_nbytes: int
    transient_nbytes: int
    activations_nbytes: int

    @property
    def peak_nbytes(self) -> int:
        return (
            self.parameters_nbytes
            + self.gradients_nbytes
            + self.optimizer_state_nbytes
            + self.transient_nbytes
            + self.activations_nbytes
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankTime:
    """One rank's step: ``busy_s + comm_wait_s + idle_s == step_s`` of the simulation.

    Attributes:
        busy_s: thread busy (compute and issuing). comm_wait_s: a compute op waiting for a
        collective. idle_s: done, waiting for the step to end (others, or own collectives still
        running: ``tail_comm_s`` of it). ns_s: Newton-Schulz time. exposed_comm_s:
        ``comm_wait_s + tail_comm_s``. memory: :class:`MemoryBreakdown`.
    """

    rank: int
    busy_s: float
    comm_wait_s: float
    idle_s: float
    tail_comm_s: float
    ns_s: float
    end_s: float
    memory: MemoryBreakdown

    @property
    def exposed_comm_s(self) -> float:
        return self.comm_wait_s + self.tail_comm_s


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Simulation:
    """The simulated step.

    Attributes:
        variant: ``"z2"`` / ``"z3"`` (dmuon), ``"adamw"``, ``"naive"``, ``"all_to_all"``, or a
            caller's label. hardware: the record's name.
        step_s: the slowest rank's end.
        ranks: per-rank :class:`RankTime` (schedule-rank order).
        exposed_comm_s: communication the critical rank waited for (its ``exposed_comm_s``).
        ns_s: Newton-Schulz seconds of the busiest rank by NS time (the most); ns_share: ``ns_s / step_s``.
        critical_rank: the rank that ends last; critical_op: the last op of the critical path.
        critical_path: :class:`PathStep` records, first to last.
        timelines: ``{rank: (Interval, ...)}`` for the ranks asked for.
        comm_nbytes: bytes on the wire per step, summed over ranks (Note: the byte
            rule, docs/design.md; FSDP2's included).
        dmuon_nbytes: of those, dmuon's own collectives by the ledger's rule (``plan.cost``'s
            total for the nominal step, :func:`dmuon.plan.pipeline_cost`'s for a pipelined one);
            0 for the alternatives.
        deferred_comm_s: HSDP with ``replicate_async``: how far the replicate broadcasts run
            past ``step_s`` (they are waited for before the next step's broadcast of their
            boundary, so they must hide behind the next forward; not in ``step_s``).
        collectives_per_rank: collective calls each rank issues in the step (dmuon's, FSDP2's,
            the model's token all-to-alls; a coalesced group of broadcasts / reduces once).
    """

    variant: str
    hardware: str
    step_s: float
    ranks: tuple[RankTime, ...]
    exposed_comm_s: float
    ns_s: float
    critical_rank: int
    critical_op: str
    critical_path: tuple[PathStep, ...]
    timelines: dict[int, tuple[Interval, ...]] = dataclasses.field(compare=False)
    comm_nbytes: int
    deferred_comm_s: float = 0.0
    collectives_per_rank: tuple[int, ...] = ()
    dmuon_nbytes: int = 0

    @property
    def ns_share(self) -> float:
        return self.ns_s / self.step_s if self.step_s else 0.0

    @property
    def peak_memory_nbytes(self) -> tuple[int, ...]:
        return tuple(r.memory.peak_nbytes for r in self.ranks)

    def path_seconds(self) -> dict[str, float]:
        """Seconds of the critical path by op kind."""
        out: dict[str, float] = {}
        for p in self.critical_path:
            out[p.kind] = out.get(p.kind, 0.0) + p.end_s - p.start_s
        return out

    def _repr_html_(self) -> str:
        """Its figures and the timeline of its first kept rank (:mod:`dmuon.sim._pages.sim_html`)."""
        from dmuon.sim._pages.sim_html import simulation_html

        return simulation_html({self.variant: self}, rank=min(self.timelines, default=0))

    def summary(self) -> str:
        busy = max(self.ranks, key=lambda r: r.end_s)
        path = ", ".join(
            f"{k} {1e3 * v:.1f}" for k, v in sorted(self.path_seconds().items(), key=lambda kv: -kv[1])[:5]
        )
        return (
            f"{self.variant}: step {1e3 * self.step_s:.2f} ms on {self.hardware}; critical rank {self.critical_rank} "
            f"(busy {1e3 * busy.busy_s:.2f}, comm wait {1e3 * busy.comm_wait_s:.2f}, idle {1e3 * busy.idle_s:.2f} ms); "
            f"exposed comm {1e3 * self.exposed_comm_s:.2f} ms; NS {1e3 * self.ns_s:.2f} ms ({100 * self.ns_share:.1f} %); "
            f"peak memory {max(self.peak_memory_nbytes) / 2**30:.2f} GiB; critical path ms: {path}"
        )


class Simulations(dict):
    """``{variant: Simulation}`` (what :func:`dmuon.sim.simulate_variants` returns): a dict that
    draws itself: every variant's figures and rank 0's timeline per variant, the recommended dmuon
    mode and the variants whose peak is above the device's memory (``memory_nbytes``, 0 = unknown)
    (:mod:`dmuon.sim._pages.sim_html`; ``to_html()`` for a standalone page)."""

    memory_nbytes: int = 0

    def to_html(self, *, rank: int = 0) -> str:
        from dmuon.sim._pages.sim_html import simulation_html

        return simulation_html(self, rank=rank, standalone=True, memory_nbytes=self.memory_nbytes)

    def _repr_html_(self) -> str:
        from dmuon.sim._pages.sim_html import simulation_html

        return simulation_html(self, memory_nbytes=self.memory_nbytes)
