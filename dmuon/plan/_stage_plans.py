"""One dmuon plan per pipeline stage: :func:`compile_stages` (pure; no process group).

Each stage is a model of its own for dmuon (its own plan, owners and buffers over the stage's
data-parallel mesh); :func:`compile_stages` splits the model as torchtitan does
(:mod:`dmuon.plan._model.pipeline_split`) and compiles every stage with the same arguments.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from torch import nn

from dmuon.plan._compile import compile as _compile
from dmuon.plan._model.pipeline_split import PipelineSplit, split_model, stage_model
from dmuon.plan._records.policies import TPPolicy, refuse_removed_keywords

__all__ = ["StagePlans", "compile_stages"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StagePlans:
    """The stages of a pipelined model and one :class:`~dmuon.plan.ShardingPlan` per stage
    (``plans[s]`` for stage ``s``; pipeline rank ``r`` holds ``split.rank_stages(r)``)."""

    split: PipelineSplit
    plans: tuple[Any, ...]

    def summary(self) -> str:
        """The split (which rule, which layers per stage), then each stage's plan summary."""
        out = [self.split.describe()]
        for s, plan in enumerate(self.plans):
            out.append(f"\n=== stage {s} of {self.split.num_stages} (pp rank {s % self.split.pp_size}) ===")
            out.append(plan.summary())
        return "\n".join(out)

    def to_html(self) -> str:
        """The split and every stage's plan page as one standalone HTML page (inline SVG, no
        JavaScript; ``python -m dmuon plan --pp K --html FILE``)."""
        from dmuon.plan._tools.html.stages_page import stages_html

        return stages_html(self, standalone=True)

    def _repr_html_(self) -> str:
        from dmuon.plan._tools.html.stages_page import stages_html

        return stages_html(self)


def _stage_signature(part: nn.Module, split: PipelineSplit, stage: int) -> tuple:
    """Parameter names (layer indices counted from the stage's first layer), shapes and dtypes."""
    idx = split.stage_layers(stage)
    prefix = split.layers + "."
    out = []
    for name, p in part.named_parameters():
        if name.startswith(prefix) and idx:
            i, _, rest = name[len(prefix) :].partition(".")
            name = f"{prefix}{int(i) - idx[0]}.{rest}"
        out.append((name, tuple(p.shape), str(p.dtype)))
    return tuple(out)


@refuse_removed_keywords("dmuon.plan.compile_stages()")
def compile_stages(
    model: nn.Module,
    mesh: Any,
    *,
    pp: int,
    stages_per_rank: int = 1,
    input_weight: int = 1,
    output_weight: int = 1,
    layers: str | None = None,
    reuse_equal_stages: bool = False,
    **compile_kwargs: Any,
) -> StagePlans:
    """Split ``model`` into ``pp * stages_per_rank`` stages as torchtitan does
    (:func:`dmuon.plan.split_model`: by default the embedding and the head count
    as one layer each) and compile each with :func:`dmuon.plan.compile` on ``mesh`` (the
    stage's data-parallel mesh: ``N`` or ``(R, N)``; the world is ``pp * R * N`` times the TP
    degree). ``compile_kwargs`` go to every stage's compile; ``tp``'s ``shard_dims`` is cut to the
    stage's parameters. FQNs stay the whole model's. ``reuse_equal_stages=True`` (for the
    simulator, which reads shapes only): a stage whose parameters have the same names relative to
    its first layer, shapes and dtypes as an earlier stage's gets that stage's plan (its FQNs).

    A stage's compile warnings are repeated with the stage named, except the "outside every hook
    boundary" one of a stage that holds no layer (the head alone: its matrices train with AdamW).

    Raises:
        ValueError: a split torchtitan refuses, a stage without a TP-sharded matrix under TP, or a
            stage's compile refusal (prefixed with the stage).
    """
    split = split_model(
        model,
        pp,
        stages_per_rank=stages_per_rank,
        input_weight=input_weight,
        output_weight=output_weight,
        layers=layers,
    )
    plans = []
    tp = compile_kwargs.get("tp")
    dims = tp.shard_dims if isinstance(tp, TPPolicy) else None
    seen: dict[tuple, Any] = {}
    for s in range(split.num_stages):
        part = stage_model(model, split, s)
        if reuse_equal_stages:
            key = _stage_signature(part, split, s)
            if key in seen:
                plans.append(seen[key])
                continue
        kw = dict(compile_kwargs)
        if dims is not None:
            names = {n for n, _ in part.named_parameters()}
            cut = {k: v for k, v in dims.items() if k in names}
            if not cut and (tp.size or 1) > 1:
                raise ValueError(
                    f"stage {s} of {split.num_stages} ({', '.join(split.stages[s])}) holds no matrix tensor "
                    "parallelism shards, so no TP plan exists for it. Fix: give every stage a layer (fewer stages, "
                    "or larger input / output weights)"
                )
            kw["tp"] = dataclasses.replace(tp, shard_dims=cut)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plans.append(_compile(part, mesh, **kw))
        except ValueError as exc:
            raise ValueError(f"stage {s} of {split.num_stages}: {exc}") from exc
        for w in caught:  # a stage without layers (the head alone) has no boundary by design: no warning
            if split.stage_layers(s) or "lie outside every hook boundary" not in str(w.message):
                # 3: the caller, past refuse_removed_keywords' wrapper
                warnings.warn(f"stage {s} of {split.num_stages}: {w.message}", w.category, stacklevel=3)
        if reuse_equal_stages:
            seen[key] = plans[-1]
    return StagePlans(split=split, plans=tuple(plans))
