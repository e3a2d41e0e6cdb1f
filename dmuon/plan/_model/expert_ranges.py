"""Expert stacks: how a 3-D Mixture-of-Experts parameter holds its Muon matrices.

The layouts recognised, expert biases and routers: Note: expert stack layouts (docs/design.md).
Pure: reads module attributes and parameter metadata only.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from dmuon.plan._records.params import ExpertStack

__all__ = [
    "ExpertStack",
    "GATE_UP_MODES",
    "EXPERT_MODES",
    "expert_stack",
    "is_stacked_bias",
    "expert_max_split",
    "expert_range_count",
    "expert_range_weights",
    "ROUTER_MODES",
    "ROUTER_NAMES",
    "is_router",
]

# how a fused gate/up projection is orthogonalised: "split" = gate and up separately (what the
# unfused model gets from torch.optim.Muon, the default), "fused" = one (2F, D) matrix per expert
GATE_UP_MODES = ("split", "fused")
# compile(experts=...): "auto" = recognised expert stacks are selected by the default rule and
# every expert has its own owner; "off" = the selection before expert support (2-D only)
EXPERT_MODES = ("auto", "off")
# ExpertPolicy(routers=...): the optimizer of MoE routers under the default rule: "muon" = dedicated like
# every other 2-D matrix in a block, "adamw" = left to FSDP2 and AdamW (docs/moe.md, "Routers")
ROUTER_MODES = ("muon", "adamw")
# names of a router module (the module holding the (E, D) ``weight``), or of its parent
# (torchtitan's ``moe.router.gate``)
ROUTER_NAMES = ("gate", "router")


def _in_experts_path(module_fqn: str, module: Any) -> bool:
    parts = module_fqn.split(".") if module_fqn else []
    return any("experts" in part.lower() for part in parts) or "experts" in type(module).__name__.lower()


def expert_stack(
    shape: tuple[int, ...], attr: str, module_fqn: str, module: Any, *, gate_up: str = "split"
) -> ExpertStack | None:
    """The :class:`ExpertStack` of a parameter ``module.<attr>`` of ``shape``, or None when it
    is not a recognised expert stack (see Note: expert stack layouts in docs/design.md for the rules).

    Args:
        gate_up: ``"split"`` (default) or ``"fused"``, :data:`GATE_UP_MODES`.
    """
    if gate_up not in GATE_UP_MODES:
        raise ValueError(f"expert_gate_up must be one of {GATE_UP_MODES}, got {gate_up!r}")
    if len(shape) != 3 or attr.endswith("bias"):
        return None
    split = gate_up == "split"
    E = int(shape[0])
    if isinstance(getattr(module, "is_transposed", None), bool) and isinstance(
        getattr(module, "is_concatenated", None), bool
    ):  # transformers' use_experts_implementation marks its experts modules
        transposed = module.is_transposed
        fused = attr == "gate_up_proj" and getattr(module, "has_gate", True)
        form = ("concat" if module.is_concatenated else "interleave") if fused else ""
        layout = "hf" if not transposed and module.is_concatenated else "hf-transposed"
        if type(module).__name__.lower().startswith("gptoss"):
            layout = "gpt-oss"
        return ExpertStack(num_experts=E, transposed=transposed, gate_up=form, split=split, layout=layout)
    if not _in_experts_path(module_fqn, module):
        return None
    if attr in ("w1", "w2", "w3", "w1_EFD", "w2_EDF", "w3_EFD"):  # torchtitan < 0.3 / >= 0.3 names
        return ExpertStack(num_experts=E, layout="torchtitan")
    if attr == "gate_up_proj":  # transformers' fused layout without the implementation markers
        return ExpertStack(num_experts=E, gate_up="concat", split=split, layout="hf")
    if attr in ("down_proj", "up_proj"):
        return ExpertStack(num_experts=E, layout="hf")
    return ExpertStack(num_experts=E, layout="generic")


def is_router(module_fqn: str, attr: str, shape: tuple[int, ...], stacks: dict[str, int]) -> bool:
    """True for the ``weight`` of an MoE router: a 2-D ``(E, D)`` parameter of a module named
    ``gate`` or ``router`` (or of a module inside one named ``router``, torchtitan's
    ``moe.router.gate``) that sits next to a recognised expert stack of ``E`` experts: one whose
    module path starts with the router's parent block (``layers.0.mlp.gate`` and
    ``layers.0.mlp.experts``; gpt-oss ``mlp.router``; torchtitan ``moe.router.gate`` and
    ``moe.experts``). ``stacks``: ``{module_fqn: E}`` of the model's recognised expert stacks
    (``E`` global: under expert parallelism the router still scores all experts).

    Qwen2-MoE's ``shared_expert_gate`` ``(1, D)`` is not a router (its name, and one row).
    """
    if attr != "weight" or len(shape) != 2:
        return False
    parts = module_fqn.split(".") if module_fqn else []
    if not parts or parts[-1] not in ROUTER_NAMES:
        return False
    depth = 2 if len(parts) >= 2 and parts[-2] == "router" else 1  # the block holding router and experts
    block = ".".join(parts[:-depth])
    prefix = block + "." if block else ""
    return any(fqn.startswith(prefix) and E == int(shape[0]) for fqn, E in stacks.items())


def is_stacked_bias(shape: tuple[int, ...], attr: str) -> bool:
    """True for a 2-D parameter whose name ends in ``bias`` (an expert bias stack ``(E, out)``):
    a stack of vectors, never a Muon matrix."""
    return len(shape) == 2 and attr.endswith("bias")


def expert_max_split(num_experts: int, num_shards: int) -> int:
    """The most owners an expert stack of ``num_experts`` can get on ``num_shards`` shard ranks:
    ``min(E, N)`` contiguous ranges of experts (each expert whole on one owner); what a local
    expert-parallel stack gets (one range per rank) and :func:`expert_range_count`'s cap."""
    return max(1, min(num_experts, num_shards))


def expert_range_count(
    num_experts: int, num_shards: int, per_expert_weight: int, mean_slot_weight: Fraction | int, slack: float
) -> int:
    """How many contiguous ranges an expert stack is cut into (fewer ranges: fewer owners, so
    fewer segments and broadcasts per boundary): ``min(E, N, ceil(E / g))`` with ``g = max(1,
    floor(slack * mean_slot_weight / per_expert_weight))`` experts per range at most, where
    ``mean_slot_weight`` is the total LPT weight over the number of owner slots.

    So every range weighs at most ``max(per_expert_weight, slack * mean)`` (ranges of
    :func:`~dmuon.plan._records.owners.balanced_sizes` hold ``<= g`` experts), and the LPT bound
    ``max load <= mean + largest piece`` becomes ``mean + max(largest dense matrix, slack * mean)``
    (one expert heavier than ``slack * mean`` gives ``g = 1``: :func:`expert_max_split` ranges)."""
    cap = expert_max_split(num_experts, num_shards)
    if per_expert_weight <= 0:
        return 1
    g = max(1, math.floor(Fraction(slack) * Fraction(mean_slot_weight) / per_expert_weight))
    return max(1, min(cap, -(-num_experts // g)))


def expert_range_weights(per_expert_weight: int, num_experts: int, k: int) -> tuple[int, ...]:
    """Weights of the ``k`` contiguous ranges of :func:`~dmuon.plan._records.owners.balanced_sizes`
    ``(E, k)``: every expert of a stack weighs the same (``per_expert_weight``)."""
    from dmuon.plan._records.owners import balanced_sizes

    return tuple(per_expert_weight * size for size in balanced_sizes(num_experts, k))
