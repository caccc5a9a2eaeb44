"""Apply a Strategy to a model with torch.distributed: one ``apply_*`` per mechanism, composed
in `parallelize` (torchtitan style). Order matters and is the one torchtitan uses: pipeline split
first, then tensor parallel, activation checkpointing, autocast, and data parallel last.

How ZeRO stages are run is the table in `autosearch/core/dp_modes.py` (the analytic cost model
reads the same table; tests/test_dp_modes.py checks both, and docs/engine.md prints it).

FSDP2 shards each block as one unit, then the root. Zero 0 and 1 keep fp32 parameters and use
autocast; zero 2 and 3 with 16-bit amp also use ``MixedPrecisionPolicy(param_dtype=amp dtype,
reduce_dtype=float32)``. With dp = 1 there is nothing to shard and no wrapper is applied. Under
pipeline parallelism `torch.distributed.pipelining` decides when gradients are reduced: once per
step, after the last micro-batch, for DDP and FSDP alike.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.engine.parallel_dims import ParallelDims
from autosearch.engine.plan import ParallelPlan, get_path

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from autosearch.core.strategy import Strategy

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def blocks_of(module: nn.Module, plan: ParallelPlan) -> "nn.ModuleDict | nn.ModuleList | None":
    """The container of repeated blocks the plan names, if the module has one."""
    container = get_path(module, plan.blocks)
    return container if isinstance(container, (nn.ModuleDict, nn.ModuleList)) else None


def world_mesh(mesh: "DeviceMesh | None") -> "DeviceMesh":
    """The world mesh, which every run of more than one process has (`ParallelDims.build_mesh`);
    a degree above 1 implies one."""
    if mesh is None:
        raise ValueError("a degree above 1 needs the DeviceMesh of ParallelDims.build_mesh")
    return mesh


def apply_tp(
    module: nn.Module,
    tp_mesh: "DeviceMesh",
    plan: ParallelPlan,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
) -> None:
    """Megatron-style tensor parallel with DTensor `parallelize_module` and the model's own plan.

    Entries naming modules this part does not hold (a pipeline stage without embeddings) are
    skipped.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if plan.tp_plan is None:  # strategy_problems refuses tp > 1 without a plan before this
        raise SpecError("tp > 1 needs ParallelPlan(tp_plan=...)")
    styles = plan.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    names = [name for name, _ in module.named_modules()]
    present = {
        key: style
        for key, style in styles.items()
        if any(fnmatch.fnmatchcase(n, key) for n in names)
    }
    parallelize_module(module, tp_mesh, present)


def apply_ac(module: nn.Module, plan: ParallelPlan, recompute: str) -> None:
    """Activation checkpointing (Chen et al. 2016) with non-reentrant `checkpoint_wrapper`.

    ``full`` checkpoints every block (without a block container: every top-level child with
    parameters); ``selective`` checkpoints only each block's attention core, the softmax(QK^T)V
    part whose activations grow with s^2 (Korthikanti et al. 2022, sec. 5).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if recompute == "none":
        return
    container = blocks_of(module, plan)
    if recompute == "full":
        if container is None:
            targets = [
                (module, name, child)
                for name, child in module.named_children()
                if any(True for _ in child.parameters())
            ]
        else:
            targets = [(container, name, child) for name, child in container.named_children()]
        for parent, name, child in targets:
            parent.register_module(name, checkpoint_wrapper(child))
        return
    if container is None or plan.attention_core is None:  # strategy_problems refuses it before
        raise SpecError("recompute=selective needs ParallelPlan(blocks=..., attention_core=...)")
    parent_path, _, leaf = plan.attention_core.rpartition(".")
    for block in container.values() if isinstance(container, nn.ModuleDict) else container:
        parent = block.get_submodule(parent_path) if parent_path else block
        parent.register_module(leaf, checkpoint_wrapper(getattr(parent, leaf)))


def apply_amp(module: nn.Module, amp: str, device_type: str) -> None:
    """Run the module's forward under ``torch.autocast`` (bf16, or fp16 with a gradient scaler).

    The forward itself is wrapped, not the training step, so that backward and the loss run
    outside autocast, and each pipeline stage autocasts its own forward.
    """
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return
    forward = module.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = autocast_forward


def apply_data_parallel(
    module: nn.Module,
    dims: ParallelDims,
    mesh: "DeviceMesh | None",
    plan: ParallelPlan,
    amp: str,
    device: torch.device,
) -> nn.Module:
    """DDP or FSDP2 over the dp group as the ZeRO stage asks (table in the module docstring)."""
    mode = dims.mode
    if mode.wrapper == "none":
        return module
    if mode.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(
            module, process_group=world_mesh(mesh).get_group("dp"), device_ids=device_ids
        )

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = world_mesh(mesh)
    dp_mesh = world["dp", "dp_shard"] if mode.hsdp_replicate else world["dp"]
    reshard = mode.reshard_after_forward
    dtype = AMP_DTYPES[amp]
    mp_policy = MixedPrecisionPolicy()
    if dtype is not None and mode.mixed_precision_policy:
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    container = blocks_of(module, plan)
    if container is not None:
        for block in list(container.children()):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    return module


def parallelize(
    model: nn.Module,
    strategy: "Strategy",
    dims: ParallelDims,
    mesh: "DeviceMesh | None",
    plan: ParallelPlan,
    *,
    device: torch.device,
    loss_parallel: bool = False,
    materialize=None,
) -> list[tuple[int | None, nn.Module]]:
    """The parts of `model` this rank runs, each parallelized: ``[(stage index or None, module)]``.

    Without pipeline parallelism there is one part (stage None); with it, `virtual_stages` parts.
    For a model built on the meta device, ``materialize(part)`` allocates and initialises a part
    once it holds only this rank's shards: after FSDP2 (which shards meta parameters as they
    are), but before DDP, which broadcasts real parameters when it wraps them.
    """
    from autosearch.engine.pipeline import split_pipeline

    parts: list[tuple[int | None, nn.Module]] = [(None, model)]
    if dims.pp > 1:
        pp_rank = world_mesh(mesh).get_local_rank("pp")
        parts = split_pipeline(model, plan, strategy, pp_rank=pp_rank)
    out: list[tuple[int | None, nn.Module]] = []
    for stage, part in parts:
        if dims.tp > 1:
            apply_tp(
                part,
                world_mesh(mesh)["tp"],
                plan,
                sequence_parallel=strategy.sequence_parallel,
                loss_parallel=loss_parallel,
            )
        apply_ac(part, plan, strategy.recompute)
        apply_amp(part, strategy.amp, device.type)
        early = materialize is not None and dims.mode.wrapper == "ddp"
        if early:
            materialize(part)
        part = apply_data_parallel(part, dims, mesh, plan, strategy.amp, device)
        if materialize is not None and not early:
            materialize(part)
        out.append((stage, part))
    return out
