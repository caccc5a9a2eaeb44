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
from autosearch.distributed.plan import ParallelPlan

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
    if len(sizes) != n_chunks or min(sizes) < 0 or sum(sizes) != n_blocks:
        return (
            f"{n_blocks} blocks do not split into pp*virtual_stages = {n_chunks} chunks of "
            f"{sizes} blocks; the sizes must add up to {n_blocks}"
        )
    # the first chunk may hold the embedding alone and the last the output alone (Megatron-
    # Core's "E|..." and "...|L" layouts); a chunk between them would hold no parameter
    empty = [c for c in range(1, n_chunks - 1) if not sizes[c]]
    if empty:
        return (
            f"pipeline chunk {empty[0]} of {sizes} holds no block; the Engine runs an empty chunk"
            " only first (the embedding alone) or last (the output alone): move a block into it"
        )
    edges = [sum(sizes[:i]) for i in range(n_chunks + 1)]
    return list(zip(edges, edges[1:]))


def split_pipeline(
    model: nn.Module, plan: ParallelPlan, strategy: "Strategy", *, pp_rank: int
) -> list[tuple[int | None, nn.Module]]:
    """This rank's stages of `model`, as (stage index, module) pairs."""
    n_chunks = strategy.pp * strategy.virtual_stages
    from autosearch.distributed.plan import get_path, set_path

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


class TiedWeights:
    """Weights tied between the first and the last pipeline stage (the token embedding and the
    output projection): each stage holds its own copy, and every step the two copies' gradients
    are summed over the ranks holding those stages, so both apply the same update (Megatron-LM's
    embedding group, Shoeybi et al. 2019). The copies start equal: `broadcast` sends the first
    stage's to the last after initialisation.

    Args:
        holders: ``(module, attribute, first)`` per copy this rank holds (module.attribute is the
            parameter; `first`: held by the first stage).
        group: the process group of the two ranks.
        src: the global rank holding the first stage.
    """

    def __init__(self, holders: list[tuple[nn.Module, str, bool]], group, src: int):
        self.holders, self.group, self.src = holders, group, src

    @classmethod
    def build(
        cls,
        groups: list[list[str]],
        parts: list[tuple[int | None, nn.Module]],
        mesh: "DeviceMesh",
        n_chunks: int,
    ) -> "TiedWeights | None":
        """The tied copies of this rank's stages, from the tied parameter names of the whole
        model (`parallelize.tied_parameters`); None when nothing is tied. Every rank calls it:
        it creates one group per (first, last) pair of pipeline ranks."""
        import torch.distributed as dist

        from autosearch.distributed.plan import get_path

        if not groups:
            return None
        pp_mesh = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0)  # type: ignore[union-attr]
        lines = pp_mesh.reshape(pp_mesh.shape[0], -1)
        mine, src = None, -1
        for j in range(lines.shape[1]):
            first, last = int(lines[0, j]), int(lines[-1, j])
            group = dist.new_group([first, last])
            if dist.get_rank() in (first, last):
                mine, src = group, first
        holders = []
        for stage, part in parts:
            for names in groups:
                for name in names:
                    owner, _, leaf = name.rpartition(".")
                    module = get_path(part, owner) if owner else part
                    if module is None or getattr(module, leaf, None) is None:
                        continue
                    if stage not in (0, n_chunks - 1):
                        raise SpecError(
                            f"the tied weight {name} is held by pipeline stage {stage}; a tied "
                            "weight must sit in the first and the last stage (embedding, output)"
                        )
                    holders.append((module, leaf, stage == 0))
                    break
        return cls(holders, mine, src)

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    @torch.no_grad()
    def broadcast(self) -> None:
        """Give the last stage's copies the first stage's values."""
        import torch.distributed as dist

        for module, leaf, _ in self.holders:
            dist.broadcast(self._local(getattr(module, leaf)), src=self.src, group=self.group)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the copies' gradients over the two stages (after the step's last backward)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for module, leaf, _ in self.holders:
            param = getattr(module, leaf)
            grad = param.grad
            if grad is None:
                continue
            if (
                isinstance(grad, DTensor)
                and isinstance(param, DTensor)
                and grad.placements != param.placements
            ):
                # under tp the embedding's gradient comes back replicated (torch 2.13) while the
                # weight, and the output projection's gradient, are sharded by vocabulary rows:
                # keep this rank's rows, so both stages add tensors of one shape
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(self._local(grad), group=self.group)

    def duplicates(self) -> set[int]:
        """The parameters (by id) of the last stage's copies: the global gradient norm counts
        each tied weight once, on the first stage."""
        return {id(getattr(m, leaf)) for m, leaf, first in self.holders if not first}
