"""dmuon.plan: pure planning for DMuon (one owner rank per Muon matrix on FSDP2).

Nothing here imports ``torch.distributed`` or ``dmuon.exec``; plans speak in ranks as ints and
work on meta-device models. Entry points::

    plan = dmuon.plan.compile(model, mesh, ...)     # -> ShardingPlan (frozen, validated)
    dmuon.plan.schedule(plan, step=None)            # -> StepSchedule: every rank's ops, in order
    dmuon.plan.diff(plan_a, plan_b)                 # -> PlanDiff keyed by FQN

The stages ``compile`` runs and the folder of each: docs/design.md, "dmuon/plan/ by stage". Model
shapes to plan live in :mod:`dmuon._zoo`, outside the planner.
"""

from dmuon.plan._records import qk_clip_records as qk_clip
from dmuon.plan._model import views
from dmuon.plan._cost.cost_model import BaselineByteCost, ByteCost, MemoryTerms, RankStats
from dmuon.plan._tools.diff import CollectiveChange, CostDelta, ParamChange, PlanDiff, SettingChange, diff
from dmuon.plan._layout.buffer_layout import Boundary, BufferLayout
from dmuon.plan._records.mesh import MESH_DIM_NAMES, MeshDimRoles, mesh_dim_roles, normalize_mesh, parse_mesh_text
from dmuon.plan._model.parallel import megatron_tp_shard_dims
from dmuon.plan._records.plan import ShardingPlan
from dmuon.plan._records.qk_clip_records import QKClip
from dmuon.plan._records.policies import ExpertPolicy, TPPolicy
from dmuon.plan._records.collective_records import CollectiveSettings
from dmuon.plan._records.owners import ExpertOwners, Owner, OwnerGroup
from dmuon.plan._records.params import ExpertStack, MatrixView, ParamSpec
from dmuon.plan._scheduling.ops import MicroBatch, Op, ScheduleError, Step
from dmuon.plan._scheduling.step_schedule import StepSchedule
from dmuon.plan._scheduling.schedule_replay import replay
from dmuon.plan._scheduling.builder import schedule
from dmuon.plan._cost.stage_bytes import pipeline_cost
from dmuon.plan._model.selection import matrix_predicate
from dmuon.plan._model.pipeline_split import PipelineSplit, split_model, stage_model
from dmuon.plan._stage_plans import StagePlans, compile_stages
from dmuon.plan._compile import compile  # last: dmuon.plan.compile is the function (it shadows its module)

__all__ = [
    "compile",
    "TPPolicy",
    "ExpertPolicy",
    "compile_stages",
    "StagePlans",
    "PipelineSplit",
    "split_model",
    "stage_model",
    "schedule",
    "pipeline_cost",
    "replay",
    "Step",
    "MicroBatch",
    "StepSchedule",
    "Op",
    "ScheduleError",
    "diff",
    "ShardingPlan",
    "Owner",
    "OwnerGroup",
    "ExpertOwners",
    "ExpertStack",
    "ParamSpec",
    "MatrixView",
    "QKClip",
    "views",
    "qk_clip",
    "ByteCost",
    "BaselineByteCost",
    "RankStats",
    "MemoryTerms",
    "PlanDiff",
    "ParamChange",
    "CostDelta",
    "SettingChange",
    "CollectiveChange",
    "CollectiveSettings",
    "BufferLayout",
    "Boundary",
    "matrix_predicate",
    "normalize_mesh",
    "mesh_dim_roles",
    "MeshDimRoles",
    "MESH_DIM_NAMES",
    "parse_mesh_text",
    "megatron_tp_shard_dims",
]
