"""Apply a Strategy to a model with torch.distributed: one ``apply_*`` per mechanism, composed
in `parallelize` (torchtitan style). Order matters and is the one torchtitan uses: pipeline split
first, then expert parallel (`autosearch.models.moe`), context parallel (on the attention cores),
float8 linears, tensor parallel, activation checkpointing, per-block compile (with async TP),
autocast, and data parallel last.

How ZeRO stages are run is the table in `autosearch/core/dp_modes.py` (the analytic cost model
reads the same table; tests/test_dp_modes.py checks both, and docs/engine.md prints it). With
context parallelism the data-parallel group is dp x cp (the cp ranks hold the same parameters and
see different tokens), as in torchtitan and the cost model.

FSDP2 shards each block as one unit, then the root. Zero 0 and 1 keep fp32 parameters and use
autocast; zero 2 and 3 with 16-bit amp also use ``MixedPrecisionPolicy(param_dtype=amp dtype,
reduce_dtype=float32)``. With dp = 1 there is nothing to shard and no wrapper is applied. Under
pipeline parallelism `torch.distributed.pipelining` decides when gradients are reduced: once per
step, after the last micro-batch, for DDP and FSDP alike.

Weights tied between the embedding and the output projection stay one parameter under tensor
parallel (both shard it by vocabulary rows; `apply_tp` ties the two DTensors again); under
pipeline parallel the first stage holds the embedding and the last the output, each its copy,
and the Trainer sums their gradients over the two stages every step (`TiedWeights`, as
Megatron-LM's embedding group does).
"""

from __future__ import annotations

import fnmatch
import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.distributed.plan import ParallelPlan, get_path
from autosearch.engine.parallel_dims import ParallelDims

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
    tied = tied_parameters(module)
    parallelize_module(module, tp_mesh, present)
    for group in tied:  # each style distributed its own copy: share the first one again
        first = module.get_parameter(group[0])
        for name in group[1:]:
            other = module.get_parameter(name)
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                raise SpecError(
                    f"tied parameters {group} are sharded differently by the tp plan "
                    f"({getattr(first, 'placements', None)} vs "
                    f"{getattr(other, 'placements', None)}); shard them alike or untie them"
                )
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, first)


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """Names of the parameters that are one tensor (tied), a list per group of two or more."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def apply_cp(module: nn.Module, cp_mesh: "DeviceMesh") -> None:
    """Context parallel (`autosearch.distributed.context_parallel`): every submodule that
    declares a
    ``context_parallel`` attribute (the model, its attention layers and cores) gets the cp group;
    the model then computes global positions and its attention cores attend over the whole
    sequence. The data loader shards the sequences."""
    from autosearch.distributed.context_parallel import ContextParallel

    cp = ContextParallel.of(cp_mesh)
    for sub in module.modules():
        if hasattr(type(sub), "context_parallel"):
            setattr(sub, "context_parallel", cp)  # noqa: B010 - a plain attribute, not a module


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """The linears float8 training converts: those whose dimensions are multiples of 16
    (``torch._scaled_mm``'s constraint; torchtitan's filter)."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def apply_fp8(
    module: nn.Module, plan: ParallelPlan, recipe: str, *, emulate: bool = False
) -> None:
    """Float8 linears in every block with torchao (``convert_to_float8_training``, the
    ``tensorwise`` or ``rowwise`` recipe), as torchtitan's float8 converter: the embedding and
    the output projection stay in the amp dtype. `emulate` runs the float8 matmuls in fp32 with
    float8-rounded operands (torchao's emulation, for tests)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:  # strategy_problems says so before anything is built
        raise SpecError("fp8 needs torchao: pip install 'autosearch[fp8]'") from None

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    container = blocks_of(module, plan)
    if container is None:  # strategy_problems refuses it before
        raise SpecError("fp8 needs ParallelPlan(blocks=...) naming the model's blocks")
    for block in list(container.children()):
        convert_to_float8_training(block, config=config, module_filter_fn=fp8_filter)


def apply_ac(
    module: nn.Module, plan: ParallelPlan, recompute: str, num_layers: int | None = None
) -> None:
    """Activation checkpointing (Chen et al. 2016) with non-reentrant `checkpoint_wrapper`.

    ``full`` checkpoints every block (without a block container: every top-level child with
    parameters), or with `num_layers` only the first `num_layers` blocks of this pipeline chunk
    (Megatron-LM's ``--recompute-method block``); ``selective`` checkpoints only each block's
    attention core, the softmax(QK^T)V part whose activations grow with s^2 (Korthikanti et al.
    2022, sec. 5); ``selective_op`` checkpoints each block with an op-level policy that saves
    the outputs of matmuls and attention and recomputes the rest (`op_sac_context`).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if recompute == "none":
        return
    container = blocks_of(module, plan)
    if recompute in ("full", "selective_op"):
        if container is None:
            targets = [
                (module, name, child)
                for name, child in module.named_children()
                if any(True for _ in child.parameters())
            ]
        else:
            targets = [(container, name, child) for name, child in container.named_children()]
        if recompute == "full" and num_layers is not None:
            targets = targets[:num_layers]
        for parent, name, child in targets:
            if recompute == "full":
                wrapped = checkpoint_wrapper(child)
            else:
                wrapped = checkpoint_wrapper(
                    child, context_fn=op_sac_context, preserve_rng_state=False
                )
            parent.register_module(name, wrapped)
        return
    if container is None or plan.attention_core is None:  # strategy_problems refuses it before
        raise SpecError("recompute=selective needs ParallelPlan(blocks=..., attention_core=...)")
    parent_path, _, leaf = plan.attention_core.rpartition(".")
    for block in container.values() if isinstance(container, nn.ModuleDict) else container:
        try:
            parent = block.get_submodule(parent_path) if parent_path else block
        except AttributeError:  # a block without attention (a hybrid's Mamba / MLP block)
            continue
        if getattr(parent, leaf, None) is None:
            continue
        parent.register_module(leaf, checkpoint_wrapper(getattr(parent, leaf)))


@functools.cache
def _op_sac_save_list() -> frozenset:
    """Ops whose outputs op-level selective recompute keeps (torchtitan 0.3's
    ``_get_default_save_ops``): the partitioner's compute-intensive ops (matmuls, attention
    kernels), the attention kernels of every SDPA backend (the CPU one included), the maximum
    that float8 scaling reads, the reduce-scatter of sequence parallel, and the router's top-k,
    so that the recompute routes each token to the experts its forward chose (torchtitan saves
    it for that reason: `_get_default_save_ops` @ b5bcd76)."""
    from torch._functorch.partitioners import get_default_op_list

    aten = torch.ops.aten
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}  # type: ignore[attr-defined]
    ops |= {
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten.max.default,
        aten.linear.default,
        aten.topk.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
    return frozenset(ops)


def op_sac_policy():
    """The op-level selective recompute policy of one checkpointed call (torchtitan's
    ``SelectiveAC``): save the outputs of what `_op_sac_save_list` names except every second
    matmul (mm, addmm: a linear with a bias, linear), recompute everything else. The forward and
    its recompute count matmuls separately, so both make the same choices."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save, matmuls = _op_sac_save_list(), (aten.mm.default, aten.addmm.default, aten.linear.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            counts[mode] += 1
            if counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_sac_context():
    """The forward and recompute contexts of op-level selective recompute (`op_sac_policy`)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(op_sac_policy())


def apply_compile(
    module: nn.Module, plan: ParallelPlan, *, fullgraph: bool, tp_mesh: "DeviceMesh | None"
) -> None:
    """``torch.compile`` each block in place (``Module.compile``: parameter names unchanged),
    after tensor parallel and checkpointing, before data parallel (torchtitan's
    ``apply_compile``). With `tp_mesh` (async TP), Inductor's micro-pipeline TP pass is turned on
    and the tp group gets symmetric memory (CUDA only; torchtitan's
    ``_maybe_enable_async_tp``)."""
    if tp_mesh is not None:
        import torch._inductor.config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
        torch._inductor.config._micro_pipeline_tp = True
    container = blocks_of(module, plan)
    if container is None:  # strategy_problems refuses it before
        raise SpecError("compile needs ParallelPlan(blocks=...) naming the model's blocks")
    for block in container.children():
        # an MoE block's routed counts size its expert GEMMs where no grouped kernel takes the
        # operands (`models.moe.grouped_mm`'s loop): one graph break there, eager in between
        block.compile(fullgraph=fullgraph and not _routes_tokens(block))
    for name in plan.first_stage:
        embedding = get_path(module, name)
        if embedding is not None and any(_is_dtensor(p) for p in embedding.parameters()):
            # torch 2.13: a compiled block whose input is the alias DTensor.to_local() returns
            # (the tp embedding's output) passes a plain-tensor gradient to the redistribute
            # backward, which fails ("'Tensor' object has no attribute '_local_tensor'"); the
            # block gets a copy instead
            embedding.register_forward_hook(_copy_output)


def _routes_tokens(block: nn.Module) -> bool:
    from autosearch.models.moe import MoE

    return any(isinstance(m, MoE) for m in block.modules())


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _copy_output(_module: nn.Module, _inputs, output):
    return (
        output.clone() if isinstance(output, torch.Tensor) and not _is_dtensor(output) else output
    )


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


def apply_offload_activations(module: nn.Module, plan: ParallelPlan, device: torch.device) -> None:
    """Every tensor a block saves for backward kept in host memory (``offload_activations:
    layers``): each block is called under ``torch.autograd.graph.save_on_cpu``, pinned on CUDA,
    and its tensors come back as backward reaches the block. The copies run on the compute
    stream (the cost model's `activation_offload_overlap` 0 for this runtime). On a CPU device
    the tensors are already in host memory: the hooks copy them, and nothing is freed.

    The context is entered around the block's call, outside its compiled region (Dynamo does not
    trace ``save_on_cpu``): the block's class becomes a subclass whose ``__call__`` enters it, as
    FSDP2's ``fully_shard`` swaps a module's class (the saved tensors of a compiled block are
    then those of its compiled autograd function)."""
    container = blocks_of(module, plan)
    if container is None:
        return
    pin = device.type == "cuda"
    for block in container.children():
        block.__class__ = _offloaded_class(type(block))
        block._offload_pin_memory = pin  # type: ignore[assignment]


_OFFLOADED: dict[type, type] = {}  # a block class -> its offloading subclass, made once


def _offloaded_class(cls: type) -> type:
    if cls not in _OFFLOADED:

        def __call__(self, *args, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=self._offload_pin_memory):
                return cls.__call__(self, *args, **kwargs)

        _OFFLOADED[cls] = type(f"Offloaded{cls.__name__}", (cls,), {"__call__": __call__})
    return _OFFLOADED[cls]


def apply_data_parallel(
    module: nn.Module,
    dims: ParallelDims,
    mesh: "DeviceMesh | None",
    plan: ParallelPlan,
    amp: str,
    device: torch.device,
    *,
    offload_params: bool = False,
) -> nn.Module:
    """DDP or FSDP2 over the dp group as the ZeRO stage asks (table in the module docstring).
    `offload_params`: FSDP2's ``CPUOffloadPolicy`` keeps the parameter shards, their gradients
    and so the optimizer step on the host (pinned on CUDA); each gather copies a shard up."""
    from autosearch.models import moe

    mode = dims.mode
    if mode.wrapper == "none":
        return module
    if mode.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        experts = moe.expert_param_names(module)  # reduced over edp by the Trainer
        if experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, experts)
        device_ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(
            module, process_group=world_mesh(mesh).get_group(dims.dp_axis), device_ids=device_ids
        )

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = world_mesh(mesh)
    dp_mesh = world[dims.dp_axis, "dp_shard"] if mode.hsdp_replicate else world[dims.dp_axis]
    reshard = mode.reshard_after_forward
    dtype = AMP_DTYPES[amp]
    mp_policy = MixedPrecisionPolicy()
    if dtype is not None and mode.mixed_precision_policy:
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    fsdp: dict = {"reshard_after_forward": reshard, "mp_policy": mp_policy}
    if offload_params:
        from torch.distributed.fsdp import CPUOffloadPolicy

        fsdp["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    moe.shard_experts(module, **fsdp)
    container = blocks_of(module, plan)
    if container is not None:
        for block in list(container.children()):
            fully_shard(block, mesh=dp_mesh, **fsdp)
    fully_shard(module, mesh=dp_mesh, **fsdp)
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
    from autosearch.models.moe import apply_ep, expert_mesh, moe_layers

    ep_mesh = None  # parallel folding: under tp, each tp rank routes its own tokens too
    if moe_layers(model) and (strategy.ep > 1 or strategy.etp > 1 or dims.tp > 1):
        ep_mesh = expert_mesh(
            world_mesh(mesh),
            ep=strategy.ep,
            pp=dims.pp,
            dp=dims.dp,
            cp=dims.cp,
            tp=dims.tp,
            etp=strategy.etp,
        )
    out: list[tuple[int | None, nn.Module]] = []
    for stage, part in parts:
        if ep_mesh is not None:
            apply_ep(
                part,
                ep_mesh,
                etp=strategy.etp,
                tp_mesh=world_mesh(mesh)["tp"] if dims.tp > 1 else None,
                sequence_parallel=strategy.sequence_parallel,
            )
        if dims.cp > 1:
            apply_cp(part, world_mesh(mesh)["cp"])
        if strategy.fp8 != "none":
            apply_fp8(part, plan, strategy.fp8)
        if dims.tp > 1:
            apply_tp(
                part,
                world_mesh(mesh)["tp"],
                plan,
                sequence_parallel=strategy.sequence_parallel,
                loss_parallel=loss_parallel,
            )
        # Checkpointing runs inside the compiled blocks (torchtitan's order), except full
        # recompute, which checkpoints each compiled block: torch 2.13's AOT autograd fails on a
        # whole checkpointed block of DTensor parameters ("expected all
        # tensors_saved_with_vc_check to be Tensors ... DeviceMesh").
        compile_first = strategy.compile and strategy.recompute == "full"
        if not compile_first:
            apply_ac(part, plan, strategy.recompute, strategy.recompute_num_layers)
        if strategy.compile:
            apply_compile(
                part,
                plan,
                # the CPU context-parallel attention calls c10d collectives, which Dynamo
                # does not trace: it runs between the compiled graphs
                fullgraph=plan.compile_fullgraph and (dims.cp == 1 or device.type == "cuda"),
                tp_mesh=world_mesh(mesh)["tp"] if strategy.async_tp else None,
            )
        if compile_first:
            apply_ac(part, plan, strategy.recompute, strategy.recompute_num_layers)
        if strategy.offload_activations != "none":
            apply_offload_activations(part, plan, device)
        apply_amp(part, strategy.amp, device.type)
        early = materialize is not None and dims.mode.wrapper == "ddp"
        if early:
            materialize(part)
        part = apply_data_parallel(
            part,
            dims,
            mesh,
            plan,
            strategy.amp,
            device,
            offload_params=strategy.offload_params,
        )
        if materialize is not None and not early:
            materialize(part)
        out.append((stage, part))
    return out
