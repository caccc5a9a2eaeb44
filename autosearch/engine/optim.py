"""Rebuild the user's optimizer over the parallelized parameters, and the fp16 gradient scaler.

The user hands over an optimizer built on the unparallelized model (or a callable that builds
one from parameters). After parallelization the parameters are new objects (DTensor shards,
pipeline copies), so the Engine builds one optimizer per model part with the same class, the
same defaults, and the same per-group settings, matched by parameter name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from autosearch.engine.parallel_dims import ParallelDims

# Name segments that wrappers add to parameter names (DDP adds a leading "module.").
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def clean_name(name: str, *, ddp: bool = False) -> str:
    """A parameter name without checkpoint-wrapper / compile segments (and DDP's ``module.``)."""
    if ddp and name.startswith("module."):
        name = name[len("module.") :]
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


class OptimizerRecipe:
    """How to rebuild an optimizer: its class, defaults, and per-group settings by parameter
    name."""

    def __init__(self, optimizer: "torch.optim.Optimizer | Callable", names: dict[int, str]):
        if isinstance(optimizer, torch.optim.Optimizer):
            # An instance: rebuild with its class, constructor defaults and per-group settings.
            self.cls = type(optimizer)
            # Only the defaults the constructor takes (AdamW.defaults holds more, e.g.
            # decoupled_weight_decay).
            accepted = inspect.signature(self.cls.__init__).parameters
            self.defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            self.group_of: dict[str, dict[str, Any]] = {}
            for group in optimizer.param_groups:
                settings = {k: v for k, v in group.items() if k != "params"}
                for p in group["params"]:
                    if id(p) in names:
                        self.group_of[names[id(p)]] = settings
            self.factory = None
        elif callable(optimizer):
            self.factory = optimizer
        else:
            raise SpecError(
                "optimizer must be a torch.optim.Optimizer or a callable params -> Optimizer, got"
                f" {type(optimizer).__name__}; e.g. torch.optim.AdamW(model.parameters(), lr=3e-4)"
            )

    def param_groups(self, part: nn.Module) -> list[dict[str, Any]]:
        from torch.nn.parallel import DistributedDataParallel

        ddp = isinstance(part, DistributedDataParallel)
        groups: dict[tuple, dict[str, Any]] = {}
        for name, p in part.named_parameters():
            if not p.requires_grad:
                continue
            settings = self.group_of.get(clean_name(name, ddp=ddp), {})
            key = tuple(sorted((k, repr(v)) for k, v in settings.items()))
            groups.setdefault(key, {"params": [], **settings})["params"].append(p)
        return list(groups.values())

    def build(
        self, part: nn.Module, *, zero1_group=None, offload: bool = False
    ) -> torch.optim.Optimizer:
        """The optimizer of `part`: ZeroRedundancyOptimizer over `zero1_group` (ZeRO-1 with
        DDP), or with `offload` torchao's CPUOffloadOptimizer (the states and the step on the
        host, each gradient copied down as backward produces it)."""
        params = [p for p in part.parameters() if p.requires_grad]
        if self.factory is not None:
            optimizer = self.factory(params)
            if zero1_group is None and not offload:
                return optimizer
            # ZeRO-1 needs the class and settings: read them from what the factory built.
            cls = type(optimizer)
            accepted = inspect.signature(cls.__init__).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            groups = [dict(group) for group in optimizer.param_groups]
        else:
            cls, defaults, groups = self.cls, self.defaults, self.param_groups(part)
        if zero1_group is not None:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(
                groups, optimizer_class=cls, process_group=zero1_group, **defaults
            )
        if offload:
            from torchao.optim import CPUOffloadOptimizer

            return CPUOffloadOptimizer(groups, optimizer_class=cls, **defaults)
        return cls(groups, **defaults)


def build_optimizers(
    parts: list[nn.Module],
    recipe: OptimizerRecipe,
    dims: "ParallelDims",
    mesh: "DeviceMesh | None",
    *,
    offload: bool = False,
) -> list[torch.optim.Optimizer]:
    """One optimizer per model part; ZeroRedundancyOptimizer over dp for ZeRO-1 with DDP;
    with `offload`, torchao's CPUOffloadOptimizer (``offload_optimizer`` on a GPU without
    ``offload_params``: with them FSDP2's CPUOffloadPolicy keeps the shards on the CPU, and
    the optimizer steps there as built; on a CPU device the states are in host memory
    already)."""
    zero1_group = None
    if dims.mode.zero_redundancy_optimizer:
        if mesh is None:
            raise ValueError("ZeRO-1 runs over dp > 1 processes, which have a DeviceMesh")
        zero1_group = mesh.get_group(dims.dp_axis)
    return [recipe.build(part, zero1_group=zero1_group, offload=offload) for part in parts]


def make_grad_scaler(amp: str, device_type: str, distributed: bool):
    """A loss scaler for fp16 (Micikevicius et al. 2018), else None.

    `ShardedGradScaler` all-reduces the "found inf" flag over every rank, so that all pipeline
    stages and shards skip the same steps; it works with plain and DTensor gradients.
    """
    if amp != "fp16":
        return None
    if distributed:
        import torch.distributed as dist

        return _LocalShardGradScaler(device=device_type, process_group=dist.group.WORLD)
    return torch.amp.GradScaler(device_type)


class _LocalShardGradScaler(ShardedGradScaler):
    """`ShardedGradScaler` that unscales each gradient's local tensor (a DTensor's
    ``to_local()``, the same storage): one foreach call may then hold plain and DTensor
    gradients, or DTensors of different meshes (expert-parallel experts beside DDP's or FSDP2's
    dense gradients), which DTensor refuses to mix. Unscaling is elementwise, and the found-inf
    flag is still all-reduced over every rank."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        from types import SimpleNamespace

        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            groups = [
                {
                    "params": [
                        SimpleNamespace(
                            grad=p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                        )
                        for p in group["params"]
                        if p.grad is not None
                    ]
                }
                for group in optimizer.param_groups
            ]
        local = SimpleNamespace(param_groups=groups)
        return super()._unscale_grads_(local, inv_scale, found_inf, allow_fp16)


def total_grad_norm(
    parts: list[nn.Module], *, pp_group=None, skip: "frozenset[int] | set[int]" = frozenset()
) -> torch.Tensor:
    """The L2 norm of every gradient of the whole model, identical on every rank.

    Gradients that are DTensors (FSDP2 shards, tensor-parallel shards, sequence-parallel
    replicas) are grouped by mesh and placements; DTensor computes each group's norm from its
    local shards and `full_tensor` reduces it over that group's mesh (Partial -> Replicate), one
    collective per group. Plain gradients (DDP, or no dp) are whole already. Pipeline stages hold
    different parameters, so their squared norms are summed over the pp group (as torchtitan's
    `clip_grad_norm_` does); `skip` names (by id) the second copies of weights tied across
    stages, counted once.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for part in parts:
        for p in part.parameters():
            if p.grad is None or id(p) in skip:
                continue
            if isinstance(p.grad, DTensor):
                key = (p.grad.device_mesh, tuple(p.grad.placements))
                groups.setdefault(key, []).append(p.grad)
            else:
                plain.append(p.grad)
    device = next((g.device for gs in [plain, *groups.values()] for g in gs), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):  # always, for DTensor gradients
            norm = norm.full_tensor()
        total_sq += norm.double() ** 2
    if plain:
        total_sq += torch.nn.utils.get_total_norm(plain, norm_type=2.0).double() ** 2
    if pp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_grad_norm(
    parts: list[nn.Module],
    max_norm: float,
    *,
    pp_group=None,
    skip: "frozenset[int] | set[int]" = frozenset(),
) -> float:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``, the global-norm clipping of
    `torch.nn.utils.clip_grad_norm_` (Pascanu et al. 2013), with the norm of `total_grad_norm`.
    Returns the norm before clipping."""
    norm = float(total_grad_norm(parts, pp_group=pp_group, skip=skip))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for part in parts:
                for p in part.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
    return norm
