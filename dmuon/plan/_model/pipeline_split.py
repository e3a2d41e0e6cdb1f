"""Pipeline stages of a model, split as torchtitan splits it (pure; no process group).

torchtitan's default split (``torchtitan.distributed.pipeline_parallel``,
``_generate_llm_fqn_per_model_part``) spreads ``num_layers + input_weight + output_weight``
"effective layers" over ``S`` stages, ``L // S`` each and one more for the first ``L % S``
stages; the input modules (the embedding) count as ``input_weight`` layers of the first stage and
the output modules (final norm and head) as ``output_weight`` layers of the last. Its default is
``input_weight = output_weight = 1`` (``pipeline_parallel_first_stage_less_layers`` /
``..._last_stage_less_layers``). With ``V`` stages per rank (looped schedules such as
Interleaved1F1B) there are ``S = pp * V`` stages and rank ``r`` holds stages ``r, r + pp, ...``
(torchtitan's "loop" style).

:func:`split_model` finds the model's layer container and the modules before and after it;
:func:`stage_fqns` is torchtitan's rule on those names; :func:`stage_model` is one stage as a
module that shares the original submodules and keeps their FQNs (for planning: it is never run).
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

from dmuon.plan._model.boundaries import CONTAINER_NAMES

__all__ = ["PipelineSplit", "stage_fqns", "split_model", "stage_model", "DEFAULT_SPLIT"]

#: what :attr:`PipelineSplit.method` says for torchtitan's default weights
DEFAULT_SPLIT = "torchtitan's default split: the embedding and the head count as one layer each"

_INT = re.compile(r"[0-9]+\Z")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSplit:
    """The stages of a model under pipeline parallelism.

    Attributes:
        pp_size: pipeline ranks.
        stages_per_rank: stages each pipeline rank holds (1, or ``V`` for looped schedules).
        input_weight / output_weight: layers the input / output modules count as.
        layers: FQN of the layer container (``"model.layers"``).
        num_layers: layers in it.
        input_modules / output_modules: FQNs of the modules before / after it that hold
            parameters (``("model.embed_tokens",)``, ``("model.norm", "lm_head")``).
        stages: per stage, the module FQNs it holds, in model order.
    """

    pp_size: int
    stages_per_rank: int
    input_weight: int
    output_weight: int
    layers: str
    num_layers: int
    input_modules: tuple[str, ...]
    output_modules: tuple[str, ...]
    stages: tuple[tuple[str, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def method(self) -> str:
        if (self.input_weight, self.output_weight) == (1, 1):
            return DEFAULT_SPLIT
        return (
            f"torchtitan's split with the embedding counted as {self.input_weight} and the head as "
            f"{self.output_weight} layers"
        )

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """Stages pipeline rank ``pp_rank`` holds ("loop" style: ``pp_rank + v * pp_size``)."""
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in 0..{self.pp_size - 1}, got {pp_rank}")
        return tuple(pp_rank + v * self.pp_size for v in range(self.stages_per_rank))

    def stage_layers(self, stage: int) -> tuple[int, ...]:
        """Indices of the layers stage ``stage`` holds."""
        prefix = self.layers + "."
        return tuple(int(f[len(prefix) :]) for f in self.stages[stage] if f.startswith(prefix))

    def describe(self) -> str:
        """One line per stage: its rank, its layers and its other modules."""
        lines = [
            f"{self.num_stages} stages on {self.pp_size} pipeline ranks ({self.stages_per_rank} per rank), "
            f"{self.num_layers} layers of {self.layers}; {self.method}"
        ]
        for s, mods in enumerate(self.stages):
            idx = self.stage_layers(s)
            other = [m for m in mods if not m.startswith(self.layers + ".")]
            span = f"layers {idx[0]}-{idx[-1]}" if len(idx) > 1 else (f"layer {idx[0]}" if idx else "no layers")
            lines.append(
                f"  stage {s} (pp rank {s % self.pp_size}): {span}" + (f" + {', '.join(other)}" if other else "")
            )
        return "\n".join(lines)


def stage_fqns(
    num_stages: int,
    num_layers: int,
    *,
    input_weight: int = 1,
    output_weight: int = 1,
    layers: str = "layers",
    input_modules: tuple[str, ...] = ("tok_embeddings",),
    output_modules: tuple[str, ...] = ("norm", "lm_head"),
) -> tuple[tuple[str, ...], ...]:
    """Module FQNs per stage by torchtitan's rule (module docstring); with the default names it
    returns what ``_generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight,
    output_weight)`` returns, as tuples.

    Raises:
        ValueError: fewer than one stage, more stages than effective layers, an empty stage, or a
            weight above the layers per stage (torchtitan's checks and messages).
    """
    if num_stages < 1:
        raise ValueError("pipeline split: the number of stages must be at least 1")
    body = [f"{layers}.{i}" for i in range(num_layers)]
    if num_stages == 1:
        return (tuple(input_modules) + tuple(body) + tuple(output_modules),)
    effective = num_layers + input_weight + output_weight
    if num_stages > effective:
        raise ValueError(
            f"pipeline split: {num_stages} stages cannot be more than the {effective} effective layers "
            f"({num_layers} layers + input weight {input_weight} + output weight {output_weight})"
        )
    per, extra = divmod(effective, num_stages)
    if input_weight > per:
        raise ValueError(f"pipeline split: input weight ({input_weight}) exceeds the minimum layers per stage ({per})")
    if output_weight > per:
        raise ValueError(
            f"pipeline split: output weight ({output_weight}) exceeds the minimum layers per stage ({per})"
        )
    out = []
    cur = 0
    for s in range(num_stages):
        n = per + (s < extra)
        mods: list[str] = []
        if s == 0:
            mods += input_modules
            n -= input_weight
        elif s == num_stages - 1:
            n -= output_weight
        take = min(n, num_layers - cur)
        mods += body[cur : cur + take]
        cur += take
        if s == num_stages - 1:
            mods += output_modules
        out.append(tuple(mods))
    return tuple(out)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _find_layers(model: nn.Module, layers: str | None) -> str:
    if layers is not None:
        try:
            model.get_submodule(layers)
        except AttributeError:
            raise ValueError(f"pipeline split: the model has no module {layers!r} (layers=)") from None
        return layers
    found = [
        n
        for n, m in model.named_modules()
        if n.rpartition(".")[2] in CONTAINER_NAMES
        and isinstance(m, (nn.ModuleList, nn.ModuleDict))
        and len(m)
        and all(_INT.match(k) for k in m._modules)
    ]
    if not found:
        raise ValueError(
            "pipeline split: no layer container found (an nn.ModuleList / ModuleDict of numbered layers "
            f"named one of {sorted(CONTAINER_NAMES)}); name it with layers='...'"
        )
    return min(found, key=lambda n: (n.count("."), n))


def split_model(
    model: nn.Module,
    pp_size: int,
    *,
    stages_per_rank: int = 1,
    input_weight: int = 1,
    output_weight: int = 1,
    layers: str | None = None,
) -> PipelineSplit:
    """``model``'s pipeline stages by torchtitan's rule (module docstring): ``pp_size *
    stages_per_rank`` stages. Only names and module structure are read (meta models work).

    The input modules are the children holding parameters that come before the branch holding the
    layer container, on each level from the root down to it (``model.embed_tokens``); the output
    modules those after it (``model.norm``, ``lm_head``), in registration order.

    Raises:
        ValueError: no layer container (name one with ``layers=``), a parameter held directly by
            a module above the container (with more than one stage: no stage could hold it), or a
            split torchtitan refuses (:func:`stage_fqns`).
    """
    if pp_size < 1 or stages_per_rank < 1:
        raise ValueError(f"pipeline split: pp ({pp_size}) and stages per rank ({stages_per_rank}) must be >= 1")
    path = _find_layers(model, layers)
    before: list[str] = []
    after_levels: list[list[str]] = []  # per level, outermost first; the inner level's come first in model order
    parts = path.split(".")
    mod = model
    prefix = ""
    one = pp_size * stages_per_rank == 1  # one stage holds the whole model, whatever holds parameters
    for part in parts:
        direct = [n for n, p in mod._parameters.items() if p is not None]
        if direct and not one:
            raise ValueError(
                f"pipeline split: {prefix.rstrip('.') or 'the root module'} holds parameters directly "
                f"({direct[0]!r}), outside any module a stage can hold"
            )
        seen = False
        after: list[str] = []
        after_levels.append(after)
        for name, child in mod._modules.items():
            if child is None:
                continue
            if name == part:
                seen = True
                continue
            if _has_params(child):
                (after if seen else before).append(prefix + name)
        mod = mod._modules[part]
        prefix += part + "."
    after = [f for level in reversed(after_levels) for f in level]
    container = model.get_submodule(path)
    keys = list(container._modules)
    if keys != [str(i) for i in range(len(keys))]:
        raise ValueError(f"pipeline split: the layers of {path} must be numbered 0..{len(keys) - 1}")
    stages = stage_fqns(
        pp_size * stages_per_rank,
        len(keys),
        input_weight=input_weight,
        output_weight=output_weight,
        layers=path,
        input_modules=tuple(before),
        output_modules=tuple(after),
    )
    return PipelineSplit(
        pp_size=pp_size,
        stages_per_rank=stages_per_rank,
        input_weight=input_weight,
        output_weight=output_weight,
        layers=path,
        num_layers=len(keys),
        input_modules=tuple(before),
        output_modules=tuple(after),
        stages=stages,
    )


class _Part(nn.Module):
    """A container of a stage: holds the original submodules under their original names."""

    def forward(self, *args, **kwargs):  # pragma: no cover - planning only
        raise RuntimeError("a dmuon.plan stage model is for planning; split the model for training as torchtitan does")


def stage_model(model: nn.Module, split: PipelineSplit, stage: int) -> nn.Module:
    """Stage ``stage`` of ``split`` as a module for :func:`dmuon.plan.compile`: the modules it
    holds, shared with ``model`` (not copied), under their original FQNs
    (``model.layers.12.mlp.down_proj.weight`` stays so), so plans, owners and checkpoints keep
    the names of the whole model. Containers on the way are plain modules; the leaves keep their
    types. For planning only: calling it raises. With one stage it is ``model`` itself."""
    if not 0 <= stage < split.num_stages:
        raise ValueError(f"stage must be in 0..{split.num_stages - 1}, got {stage}")
    if split.num_stages == 1:  # the whole model, parameters held above the layers included
        return model
    root = _Part()
    for fqn in split.stages[stage]:
        *parents, leaf = fqn.split(".")
        node = root
        src = model
        for p in parents:
            src = src._modules[p]
            nxt = node._modules.get(p)
            if nxt is None:
                nxt = _Part()
                node.add_module(p, nxt)
            node = nxt
        node.add_module(leaf, src._modules[leaf])
    return root
