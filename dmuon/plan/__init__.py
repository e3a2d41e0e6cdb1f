"""dmuon.plan: pure planning for DMuon (one owner rank per Muon matrix on FSDP2).

Nothing here imports ``torch.distributed`` or ``dmuon.exec``; plans speak in ranks as ints and
work on meta-device models. Entry points::

    plan = dmuon.plan.compile(model, mesh, ...)     # -> ShardingPlan (frozen, validated)
    dmuon.plan.schedule(plan, step=None)            # -> StepSchedule: every rank's ops, in order
    dmuon.plan.diff(plan_a, plan_b)                 # -> PlanDiff keyed by FQN
    dmuon.plan.presets.PRESETS["llama3-8b"]()       # meta-device model shapes

Modules: ``snapshot`` (read-only model snapshot), ``boundaries`` (hook-boundary rules),
``selection`` (dedicated params and matrix views), ``partition`` (constrained LPT),
``layout`` (packed buffers), ``step_schedule`` (every rank's ops in one step; deadlock replay),
``cost`` (bytes/FLOPs/memory summed from the schedule; the FSDP2 baseline), ``rules`` (NS backend
choice and batching, Gram restarts, accepted modes, wire dtypes, owner-group dims),
``mesh`` (mesh dim roles, ``normalize_mesh``), ``plan`` (the ``ShardingPlan`` record, JSON),
``compile`` (the planner), ``diff``, ``render``, ``presets``, ``cli``, ``views`` (matrix
views: per-head / split-QKV orthogonalisation) and ``qk_clip`` (QK-clip settings), see
docs/muon_variants.md.
See docs/planning.md.
"""

from . import presets, qk_clip, views
from .cost import BaselineByteCost, ByteCost, RankStats
from .diff import CostDelta, ParamChange, PlanDiff, SettingChange, diff
from .layout import Boundary, BufferLayout
from .mesh import MESH_DIM_NAMES, MeshDimRoles, mesh_dim_roles, normalize_mesh
from .plan import ShardingPlan
from .qk_clip import QKClip
from .records import ExpertOwners, ExpertStack, MatrixView, Owner, OwnerGroup, ParamSpec
from .step_schedule import MicroBatch, Op, ScheduleError, Step, StepSchedule, replay, schedule
from .selection import matrix_predicate
from .compile import compile  # last: dmuon.plan.compile is the function (it shadows its module)

__all__ = [
    "compile",
    "schedule",
    "replay",
    "Step",
    "MicroBatch",
    "StepSchedule",
    "Op",
    "ScheduleError",
    "diff",
    "presets",
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
    "PlanDiff",
    "ParamChange",
    "CostDelta",
    "SettingChange",
    "BufferLayout",
    "Boundary",
    "matrix_predicate",
    "normalize_mesh",
    "mesh_dim_roles",
    "MeshDimRoles",
    "MESH_DIM_NAMES",
]
