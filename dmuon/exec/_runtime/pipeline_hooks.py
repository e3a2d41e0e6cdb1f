"""dmuon under ``torch.distributed.pipelining`` (docs/pipeline_parallel.md).

Two wrappers give dmuon the schedule's two moments (stage initialisation and ``REDUCE_GRAD``):
Note: dmuon under pipelining (docs/design.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch.nn as nn

from dmuon.exec._runtime.runtime import DmuonRuntime, get_model_runtime

__all__ = ["SUPPORTED_SCHEDULES", "stage_runtimes", "wrap_initialize", "wrap_perform_reduce_grad"]

#: the schedules tested with dmuon (docs/pipeline_parallel.md)
SUPPORTED_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS")


def stage_runtimes(module: nn.Module) -> list[DmuonRuntime]:
    """The dmuon runtimes of the models inside a stage module (usually the stage itself), in
    module order."""
    seen: dict[int, DmuonRuntime] = {}
    for m in module.modules():
        rt = get_model_runtime(m)
        if rt is not None:
            seen.setdefault(id(rt), rt)
    return list(seen.values())


def _splits_backward(schedule) -> bool:
    """Whether the schedule splits backwards into input and weight parts (``I`` / ``W`` actions,
    the zero-bubble schedules) on any rank: read from its pipeline order, the same on every rank."""
    from torch.distributed.pipelining import schedules as S

    kinds = {S._ComputationType.BACKWARD_INPUT, S._ComputationType.BACKWARD_WEIGHT}
    kinds |= {k for k in (getattr(S._ComputationType, "OVERLAP_F_B", None),) if k is not None}
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(a is not None and a.computation_type in kinds for actions in order.values() for a in actions)


def _refuse_split_backward(schedule) -> None:
    name = type(schedule).__name__
    raise NotImplementedError(
        f"dmuon: the pipeline schedule {name} splits each backward into an input-gradient part and a later "
        "weight-gradient part (stage_backward_input / stage_backward_weight, the zero-bubble schedules); dmuon "
        "marks a block's backward done when its input gradients are ready, so the weight gradients of its "
        "dedicated matrices would arrive after their buffers were freed and would never reach their owners. "
        f"Use one of {', '.join(SUPPORTED_SCHEDULES)} (docs/pipeline_parallel.md)"
    )


@contextlib.contextmanager
def _no_reduce(runtimes):
    prev = [rt.requires_gradient_sync for rt in runtimes]
    for rt in runtimes:
        rt.requires_gradient_sync = False
    try:
        yield
    finally:
        for rt, p in zip(runtimes, prev):
            rt.requires_gradient_sync = p


def wrap_initialize(original):
    """``_PipelineSchedule._initialize_pp_stages(self, stages, ...)``: see Note: dmuon under pipelining
    (docs/design.md)."""

    @functools.wraps(original)
    def _initialize_pp_stages(self, stages, *args, **kwargs):
        runtimes = [rt for stage in stages for rt in stage_runtimes(stage.submod)]
        if not runtimes:
            return original(self, stages, *args, **kwargs)
        if _splits_backward(self):  # before any collective, on every rank alike
            _refuse_split_backward(self)
        for rt in runtimes:
            rt.pipelined = True
        bound = inspect.signature(original).bind(self, stages, *args, **kwargs).arguments
        before = (bound.get("fwd_initialized"), bound.get("bwd_initialized"))
        result = None
        try:
            with _no_reduce(runtimes):
                result = original(self, stages, *args, **kwargs)
            return result
        finally:
            if result is None or tuple(result) != before:  # the shape inference ran (or failed)
                for rt in runtimes:
                    rt.reset_after_shape_inference()

    return _initialize_pp_stages


def wrap_perform_reduce_grad(original):
    """``_PipelineStageBase.perform_reduce_grad(self, grad_scale_factor)``: dmuon's reduce of the
    step first, then FSDP2's and the schedule's scaling (the original)."""

    @functools.wraps(original)
    def perform_reduce_grad(self, grad_scale_factor, *args, **kwargs):
        for rt in stage_runtimes(self.submod):
            rt.pipelined = True
            rt.finish_pipeline_step()
        return original(self, grad_scale_factor, *args, **kwargs)

    return perform_reduce_grad
