"""dmuon.sim: what a dmuon step costs on a given machine, from the plan alone.

Pure: no process group, no GPU, never imports ``torch.distributed``. Entry points::

    hw = dmuon.sim.hardware.preset("h100")                  # or load("calibration.json")
    wl = dmuon.sim.workload.from_plan(plan, tokens_per_rank=8192, seq_len=8192)
    sim = dmuon.sim.simulate(plan, hw, wl)                  # -> Simulation (step, ranks, path, timelines)
    sims = dmuon.sim.simulate_variants(plan, hw, wl)        # adamw, naive, z2, z3, all_to_all
    stages = dmuon.plan.compile_stages(model, 8, pp=4)      # one plan per pipeline stage
    pp = dmuon.sim.simulate_pipeline(stages, hw, tokens_per_rank=65536, seq_len=8192,
                                     micro_batches=8, schedule="1f1b", ac="selective")
    best = dmuon.sim.advise(builder, 1024, hw, tokens_per_rank=8192)  # the fastest layouts that fit

How it is cut: docs/design.md, "dmuon/sim/"; pipelines: docs/pipeline_simulation.md.
"""

from dmuon import _zoo as zoo
from dmuon.sim._engine import alternatives, hardware, workload
from dmuon.sim._engine.hardware import CollectiveCurve, Hardware, Link
from dmuon.sim._engine.records import Interval, MemoryBreakdown, PathStep, RankTime, Simulation, Simulations
from dmuon.sim._engine.simulate import VARIANTS, simulate, simulate_variants
from dmuon.sim._engine.variants import early_ns_schedule
from dmuon.sim._engine.workload import AC_MODES, Work, Workload, from_plan
from dmuon.sim._pipeline.pp_schedule import SCHEDULES, Action, PipelineReplay, pipeline_order, replay_pipeline
from dmuon.sim._pipeline.pp_simulate import PipelineRank, PipelineSimulation, StageTime, simulate_pipeline
from dmuon.sim._pipeline.advise_search import Advice, Candidate, Config, advise

__all__ = [
    "simulate",
    "simulate_pipeline",
    "PipelineSimulation",
    "PipelineRank",
    "StageTime",
    "pipeline_order",
    "replay_pipeline",
    "PipelineReplay",
    "Action",
    "SCHEDULES",
    "AC_MODES",
    "advise",
    "Advice",
    "Candidate",
    "Config",
    "simulate_variants",
    "Simulation",
    "Simulations",
    "RankTime",
    "MemoryBreakdown",
    "PathStep",
    "Interval",
    "Hardware",
    "Link",
    "CollectiveCurve",
    "Workload",
    "Work",
    "from_plan",
    "early_ns_schedule",
    "VARIANTS",
    "hardware",
    "workload",
    "alternatives",
    "zoo",
]
