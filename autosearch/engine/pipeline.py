"""Pipeline parallelism with `torch.distributed.pipelining`: split the model, build the schedule.

The split is done by hand, as torchtitan does: each stage is a copy of the model that keeps a
contiguous run of blocks, the embeddings only on the first stage and the head only on the last
(the model's ``forward`` skips ``None`` modules). Keeping the original module names means a
checkpoint saved under one pipeline layout loads under any other. Stages, micro-batching, the
point-to-point sends and the schedules themselves are the library's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.engine.plan import ParallelPlan

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from autosearch.core.strategy import Strategy


def stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages held by one pipeline rank: the loop placement interleaved 1F1B expects
    (rank r holds stages r, r + pp, r + 2pp, ...; Narayanan et al. 2021, sec. 2.2)."""
    return [pp_rank + i * pp for i in range(virtual_stages)]


def pipeline_bounds(
    plan: ParallelPlan, strategy: "Strategy", n_blocks: int
) -> list[tuple[int, int]] | str:
    """(start, stop) block ranges of each pipeline chunk, or why the blocks cannot split so.

    The plan's `split_points` win; otherwise the strategy's layers per chunk (its
    ``pipeline_split``, or the even split with the extra blocks in the middle chunks that the
    cost model prices, `Strategy.layers_per_chunk`).
    """
    n_chunks = strategy.pp * strategy.virtual_stages
    if plan.split_points is not None:
        return plan.chunk_bounds(n_blocks, n_chunks)
    sizes = list(strategy.layers_per_chunk(n_blocks))
    if len(sizes) != n_chunks or min(sizes) < 1 or sum(sizes) != n_blocks:
        return (
            f"{n_blocks} blocks do not split into pp*virtual_stages = {n_chunks} chunks of "
            f"{sizes} blocks; every chunk needs at least one block and the sizes must add up "
            f"to {n_blocks}"
        )
    edges = [sum(sizes[:i]) for i in range(n_chunks + 1)]
    return list(zip(edges, edges[1:]))


def split_pipeline(
    model: nn.Module, plan: ParallelPlan, strategy: "Strategy", *, pp_rank: int
) -> list[tuple[int | None, nn.Module]]:
    """This rank's stages of `model`, as (stage index, module) pairs."""
    n_chunks = strategy.pp * strategy.virtual_stages
    from autosearch.engine.plan import get_path, set_path

    keys = list(get_path(model, plan.blocks).keys())
    bounds = pipeline_bounds(plan, strategy, len(keys))
    if isinstance(bounds, str):  # strategy_problems refuses such a strategy before this
        raise SpecError(f"the pipeline split is impossible: {bounds}")
    parts: list[tuple[int | None, nn.Module]] = []
    for stage in stage_indices(pp_rank, strategy.pp, strategy.virtual_stages):
        part = copy.deepcopy(model)
        blocks = get_path(part, plan.blocks)
        start, stop = bounds[stage]
        for key in keys[:start] + keys[stop:]:
            del blocks[key]
        dropped = (plan.first_stage if stage > 0 else ()) + (
            plan.last_stage if stage < n_chunks - 1 else ()
        )
        for name in dropped:
            if get_path(part, name) is not None:
                set_path(part, name, None)
        parts.append((stage, part))
    return parts


def build_schedule(
    parts: list[tuple[int | None, nn.Module]],
    strategy: "Strategy",
    mesh: "DeviceMesh",
    device: torch.device,
    loss_fn: Callable,
):
    """PipelineStage per part and the schedule the strategy names, over the pp group.

    ``n_microbatches`` is the strategy's ``grad_accum_steps``; gradients are divided by it after
    the last backward (``scale_grads``), matching a mean loss per micro-batch.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    n_chunks = strategy.pp * strategy.virtual_stages
    group = mesh.get_group("pp")
    stages: list[_PipelineStageBase] = []
    for stage, module in parts:
        if stage is None:
            raise ValueError("a pipeline part needs its stage index (split_pipeline gives it)")
        stages.append(PipelineStage(module, stage, n_chunks, device, group=group))
    m = strategy.grad_accum_steps
    if strategy.pipeline_schedule == "gpipe":
        return ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    if strategy.pipeline_schedule == "1f1b":
        return Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
