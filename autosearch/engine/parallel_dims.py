"""ParallelDims: the parallel degrees of one run, their checks, and the device mesh.

Rank layout (the one the cost model assumes): tp innermost, then dp, pp outermost, i.e.
``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``; tp peers are neighbours (same node first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autosearch.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from autosearch.strategy import Strategy

# How each ZeRO stage is run (the table in autosearch/engine/parallelize.py explains each).
# DDP only runs plain single-stage models: it rejects DTensor parameters (tp > 1), and inside
# torch.distributed.pipelining (pp > 1) its reducer fails on the first 1F1B step in torch 2.13
# ("rebuilt parameter indices size is not same as original model parameters size").
DP_MODES = {
    # (zero_stage, tp > 1 or pp > 1) -> mode
    (0, False): "ddp",        # DDP: one bucketed gradient all-reduce per step
    (0, True): "hsdp",        # FSDP2 on a (dp, 1) mesh = replicate-only: the same all-reduce
    (1, False): "ddp_zero1",  # DDP + ZeroRedundancyOptimizer (optimizer states sharded over dp)
    (1, True): "fsdp_zero1",  # FSDP2 keep-after-forward, reduce once per step (no DTensor ZeRO-1 exists)
    (2, False): "fsdp_zero2", (2, True): "fsdp_zero2",  # FSDP2 reshard_after_forward=False
    (3, False): "fsdp_zero3", (3, True): "fsdp_zero3",  # FSDP2 reshard_after_forward=True
}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one run, checked against the number of processes."""

    dp: int
    tp: int
    pp: int
    world_size: int
    zero_stage: int = 0

    @classmethod
    def from_strategy(cls, strategy: "Strategy", world_size: int) -> "ParallelDims":
        if strategy.world_size != world_size:
            raise SpecError(
                f"strategy {strategy.short()} needs dp*tp*pp = {strategy.dp}*{strategy.tp}*{strategy.pp} = "
                f"{strategy.world_size} processes but this run has {world_size}; launch it with "
                f"`torchrun --nproc_per_node={strategy.world_size} ...` or choose degrees whose product is {world_size}"
            )
        return cls(strategy.dp, strategy.tp, strategy.pp, world_size, strategy.zero_stage)

    @property
    def dp_mode(self) -> str:
        """How data parallelism runs: ``none`` (dp=1) or one of `DP_MODES`."""
        if self.dp == 1:
            return "none"
        return DP_MODES[(self.zero_stage, self.tp > 1 or self.pp > 1)]

    @property
    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Shape and names of the world mesh; HSDP adds a trailing size-1 ``dp_shard`` dim."""
        if self.dp_mode == "hsdp":
            return (self.pp, self.dp, 1, self.tp), ("pp", "dp", "dp_shard", "tp")
        return (self.pp, self.dp, self.tp), ("pp", "dp", "tp")

    def build_mesh(self, device_type: str) -> "DeviceMesh | None":
        """The world DeviceMesh (``None`` for a single process, which needs no process group)."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
