"""ParallelDims: the parallel degrees of one run, their checks, and the device mesh.

Every degree of the device mesh declared in `autosearch.core.dimensions` (`MESH_AXES`: dp, tp, pp,
cp) is held here, so a strategy's world size and its message name them all. Rank layout (the one
the cost model assumes): tp innermost, then cp, then dp, pp outermost, i.e.
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``; tp peers are neighbours
(same node first), as in torchtitan's ``["pp", "dp", "cp", "tp"]`` mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autosearch.core import dimensions
from autosearch.core.dp_modes import DPMode, dp_mode
from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from autosearch.core.strategy import Strategy

# The mesh from the outermost dimension in; a degree of 1 other than pp, dp and tp is left out,
# so that runs without it keep their mesh.
MESH_ORDER = ("pp", "dp", "cp", "tp")
_ALWAYS = ("pp", "dp", "tp")
if set(MESH_ORDER) != set(dimensions.MESH_AXES):  # a new mesh degree must find its place here
    raise TypeError(f"MESH_ORDER {MESH_ORDER} must order every mesh axis {dimensions.MESH_AXES}")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one run, checked against the number of processes.

    Attributes:
        degrees: every mesh degree (``dims.dp``, ``dims.cp`` ... read them as attributes).
        world_size: the processes of the run.
        zero_stage: the ZeRO stage (how data parallelism shards: `mode`).
        ep: the expert-parallel degree (folded with etp into tp x cp x dp,
            `autosearch.models.moe.expert_mesh`: no axis of this mesh; it decides how ZeRO-1
            runs, `mode`).
    """

    degrees: Mapping[str, int] = field(default_factory=dict)
    world_size: int = 1
    zero_stage: int = 0
    ep: int = 1

    @classmethod
    def of(
        cls, *, world_size: int | None = None, zero_stage: int = 0, ep: int = 1, **degrees: int
    ):
        """Degrees by name (those not given are 1); the world size defaults to their product."""
        unknown = [n for n in degrees if n not in dimensions.MESH_AXES]
        if unknown:
            raise SpecError(
                f"unknown parallel degree(s) {unknown}; the mesh has {dimensions.MESH_AXES}"
            )
        full = {n: degrees.get(n, 1) for n in dimensions.MESH_AXES}
        world = math.prod(full.values()) if world_size is None else world_size
        return cls(full, world, zero_stage, ep)

    @classmethod
    def from_strategy(cls, strategy: "Strategy", world_size: int) -> "ParallelDims":
        if strategy.world_size != world_size:
            used = [n for n in dimensions.MESH_AXES if n in _ALWAYS or getattr(strategy, n) > 1]
            names = "*".join(used)
            values = "*".join(str(getattr(strategy, n)) for n in used)
            raise SpecError(
                f"strategy {strategy.short()} needs {names} = {values} = {strategy.world_size}"
                f" processes but this run has {world_size}; launch it with `torchrun"
                f" --nproc_per_node={strategy.world_size} ...` or choose degrees whose product is"
                f" {world_size}"
            )
        degrees = {n: getattr(strategy, n) for n in dimensions.MESH_AXES}
        return cls.of(
            world_size=world_size, zero_stage=strategy.zero_stage, ep=strategy.ep, **degrees
        )

    def __getattr__(self, name: str) -> Any:
        degrees = self.__dict__.get("degrees", {})
        if name in dimensions.MESH_AXES:
            return degrees.get(name, 1)
        raise AttributeError(f"ParallelDims has no {name!r}")

    @property
    def mode(self) -> DPMode:
        """How data parallelism runs over dp x cp (the table in `autosearch.core.dp_modes`)."""
        return dp_mode(
            zero_stage=self.zero_stage, dp=self.dp * self.cp, tp=self.tp, pp=self.pp, ep=self.ep
        )

    @property
    def dp_axis(self) -> str:
        """The mesh dimension data parallelism runs over: ``dp``, or with context parallel the
        flattened ``dp_cp`` (cp ranks hold the same parameters; torchtitan's ``dp_shard_cp``)."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def dp_mode(self) -> str:
        """The name of `mode`: ``none`` (dp=1), ``ddp``, ``hsdp``, ``ddp_zero1``,
        ``fsdp_zero1-3``."""
        return self.mode.name

    @property
    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Shape and names of the world mesh (`MESH_ORDER`); HSDP adds a size-1 ``dp_shard``
        dim after ``dp``."""
        shape: list[int] = []
        names: list[str] = []
        for name in MESH_ORDER:
            degree = getattr(self, name)
            if name in _ALWAYS or degree > 1:
                shape.append(degree)
                names.append(name)
            if name == "dp" and self.mode.hsdp_replicate:
                shape.append(1)
                names.append("dp_shard")
        return tuple(shape), tuple(names)

    def build_mesh(self, device_type: str) -> "DeviceMesh | None":
        """The world DeviceMesh (``None`` for a single process, which needs no process group)."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if self.cp > 1:  # every rank creates the flattened group, in the same order
            mesh["dp", "cp"]._flatten(self.dp_axis)
        return mesh
