"""ParallelDims: the parallel degrees of one run, their checks, and the device mesh.

Rank layout (the one the cost model assumes): tp innermost, then dp, pp outermost, i.e.
``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``; tp peers are neighbours (same node first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autosearch.core.dp_modes import DPMode, dp_mode
from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from autosearch.core.strategy import Strategy


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
                f"strategy {strategy.short()} needs dp*tp*pp ="
                f" {strategy.dp}*{strategy.tp}*{strategy.pp} = {strategy.world_size} processes but"
                f" this run has {world_size}; launch it with `torchrun"
                f" --nproc_per_node={strategy.world_size} ...` or choose degrees whose product is"
                f" {world_size}"
            )
        return cls(strategy.dp, strategy.tp, strategy.pp, world_size, strategy.zero_stage)

    @property
    def mode(self) -> DPMode:
        """How data parallelism runs (the table in `autosearch.core.dp_modes`)."""
        return dp_mode(zero_stage=self.zero_stage, dp=self.dp, tp=self.tp, pp=self.pp)

    @property
    def dp_mode(self) -> str:
        """The name of `mode`: ``none`` (dp=1), ``ddp``, ``hsdp``, ``ddp_zero1``,
        ``fsdp_zero1-3``."""
        return self.mode.name

    @property
    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Shape and names of the world mesh; HSDP adds a trailing size-1 ``dp_shard`` dim."""
        if self.mode.hsdp_replicate:
            return (self.pp, self.dp, 1, self.tp), ("pp", "dp", "dp_shard", "tp")
        return (self.pp, self.dp, self.tp), ("pp", "dp", "tp")

    def build_mesh(self, device_type: str) -> "DeviceMesh | None":
        """The world DeviceMesh (``None`` for a single process, which needs no process group)."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
