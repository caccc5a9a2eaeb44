"""Hardware is data: a `HardwareProfile` is read from YAML (`cost_models/profiles/<name>.yaml`,
or a file written by `autosearch calibrate`), and a `Cluster` is a profile times a node count.

Example:
    >>> from autosearch import Cluster
    >>> c = Cluster.parse("h100-sxm:32x8")
    >>> c.world_size, c.profile.peak_flops["bf16"] / 1e12
    (256, 989.4)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autosearch.core._io import (
    MAX_DEVICES,
    check_keys,
    check_name,
    positive_int,
    read_yaml_mapping,
)
from autosearch.core.attention_kernels import AttentionShapes, parse_attention_shapes
from autosearch.core.data import data_path
from autosearch.core.errors import SpecError
from autosearch.core.gemm_tiles import OPERAND_BYTES, parse_tiles, tiled_time_s
from autosearch.core.schema import kind_of, read_mapping, read_names, read_path

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
# Backward time over forward time, the defaults of a profile that does not measure them:
# a GEMM's backward is two GEMMs of its size (dgrad + wgrad); fused attention's backward does
# 5 GEMMs per tile against 2 forward, plus recomputing the softmax: 2.5x (Dao 2023, sec. 3.2).
GEMM_BACKWARD_OVER_FORWARD = 2.0
ATTENTION_BACKWARD_OVER_FORWARD = 2.5
# The first line of every profile `autosearch calibrate` writes (such a file must hold every key).
PROFILE_MARKER = "# Hardware profile written by `autosearch calibrate`"


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level of the interconnect, per GPU and per direction, for the alpha-beta model.

    Args:
        bandwidth_bytes_per_s: peak unidirectional bandwidth available to one GPU.
        latency_s: alpha, the fixed cost of one message (one step of a ring).
        efficiency: achieved fraction of the peak for large messages (nccl-tests "busbw" / peak).
        op_efficiency: optional per-collective factors on top of `efficiency` (see `op_factor`).
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float = 1.0
    op_efficiency: dict[str, float] = field(default_factory=dict)

    @property
    def achieved_bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency

    def op_factor(self, op: str) -> float:
        """Bandwidth of collective `op` (all_reduce, all_gather, reduce_scatter, p2p) relative to
        the
        link's achieved bandwidth: 1 for NCCL, where every op runs at the same bus bandwidth;
        measured for gloo on CPU, where reduce-scatter is several times slower than all-reduce."""
        return self.op_efficiency.get(op, 1.0)


@dataclass(frozen=True, kw_only=True)
class GemmEfficiency:
    """GEMM time as a function of shape, in a form calibration fits by least squares.

    time(m, n, k) = launch_s + 2mnk / (peak * max_efficiency) * (1 + half_dim/m + half_dim/n +
    half_dim/k)

    i.e. efficiency = max_efficiency / (1 + half_dim * (1/m + 1/n + 1/k)): large GEMMs approach
    max_efficiency; a thin dimension (a small head size, a small micro-batch) costs in proportion
    to the bytes of the operand it leaves under-used (the roofline of Williams et al. 2009).

    With `sm_count` and `tiles` (a GPU profile anchored to a measured per-shape table), the
    shape terms are tiles and waves over the SMs instead (`autosearch.core.gemm_tiles`): a
    2,880-wide layer no longer costs what a 3,072-wide one does, per FLOP.
    """

    max_efficiency: dict[str, float]
    half_dim: float
    launch_s: float = 0.0
    backward_over_forward: float = GEMM_BACKWARD_OVER_FORWARD
    sm_count: int = 0  # SMs the tiles spread over (0: the smooth curve above)
    tiles: tuple[tuple[int, int, float], ...] = ()  # (rows, columns, relative efficiency)
    k_overhead_bytes: float = 0.0  # K-loop prologue + epilogue, in K bytes of an operand

    def time_s(self, m: float, n: float, k: float, peak_flops: float, precision: str) -> float:
        if self.tiles:
            return self.grouped_time_s(1, m, n, k, peak_flops, precision)
        return self.smooth_time_s(m, n, k, peak_flops, precision)

    def smooth_time_s(
        self, m: float, n: float, k: float, peak_flops: float, precision: str
    ) -> float:
        """The smooth curve above, whether or not the profile has tiles."""
        hd = self.half_dim
        return self.launch_s + 2.0 * m * n * k / (peak_flops * self.max_efficiency[precision]) * (
            1.0 + hd / m + hd / n + hd / k
        )

    def grouped_time_s(
        self, groups: float, m: float, n: float, k: float, peak_flops: float, precision: str
    ) -> float:
        """`groups` GEMMs of m x n x k in one launch, their tiles sharing the SMs in waves (1:
        a plain GEMM). Needs `tiles`."""
        k0 = self.k_overhead_bytes / OPERAND_BYTES.get(precision, 2)
        rate = peak_flops * self.max_efficiency[precision]
        return self.launch_s + tiled_time_s(groups, m, n, k, rate, self.sm_count, self.tiles, k0)


@dataclass(frozen=True, kw_only=True)
class Host:
    """The host a node's GPUs offload to: its link to each GPU, its memory and its cores.

    Args:
        link: the host-device link in words (``pcie5 x16``, ``nvlink-c2c``).
        bandwidth_bytes_per_s: peak host-device bandwidth per GPU and per direction.
        efficiency: achieved fraction of it for large pinned copies.
        memory_bytes: host memory of one node.
        memory_bandwidth_bytes_per_s: host memory bandwidth of one node (every socket).
        cores: CPU cores of one node.
        reserved_bytes: host memory of one node that training cannot use for offload (the OS,
            the framework, data loaders).
    """

    link: str
    bandwidth_bytes_per_s: float
    efficiency: float = 1.0
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    cores: int
    reserved_bytes: float = 0.0

    @property
    def achieved_bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True, eq=False)
class HardwareProfile:
    """One accelerator (and the node it sits in), as the cost model sees it.

    Every number comes from the YAML file, which cites its sources; calibration writes the same
    format and lists in `measured` the fields it measured (all others keep their defaults).
    """

    name: str
    description: str = ""
    device_type: str = "cuda"
    architecture: str = ""  # GPU architecture (ampere, hopper): what kernels a runtime has for it
    gpus_per_node: int
    peak_flops: dict[str, float]
    memory_capacity_bytes: float
    memory_bandwidth_bytes_per_s: float
    memory_efficiency: float
    reserved_memory_bytes: float = 0.0
    cache_bytes: float = 0.0
    cache_bandwidth_bytes_per_s: float = 0.0
    intra_node: Link
    inter_node: Link
    gemm: GemmEfficiency
    attention_efficiency: dict[str, float]
    attention_backward_over_forward: float = ATTENTION_BACKWARD_OVER_FORWARD
    attention_kernels: dict[str, float] = field(default_factory=dict)
    # a kernel's efficiency by shape (autosearch/core/attention_kernels.py); where a kernel has
    # one, the attention core's time reads it instead of the flat `attention_kernels` value
    attention_shapes: dict[str, AttentionShapes] = field(default_factory=dict)
    kernel_launch_s: float = 0.0
    step_overhead_s: float = 0.0
    nvlink_domain: int = 0  # GPUs in one NVLink (scale-up) domain; 0: one node (gpus_per_node)
    aliases: tuple[str, ...] = ()  # short names the CLI reads as this profile, with a note
    device_names: tuple[str, ...] = ()  # what the driver calls exactly this part
    sources: tuple[str, ...] = ()
    measured: tuple[str, ...] = ()
    calibration: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    host: Host | None = None  # what offload to host memory reads (None: not described)

    @property
    def achieved_memory_bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.memory_efficiency

    def stream_bandwidth_bytes_per_s(self, working_set_bytes: float) -> float:
        """Bandwidth of a memory-bound kernel touching `working_set_bytes`: the last-level cache's
        when it fits there (a CPU's 8 MiB L3 streams at 5-8x its DRAM rate), else the memory's."""
        if self.cache_bytes and working_set_bytes <= self.cache_bytes:
            return self.cache_bandwidth_bytes_per_s
        return self.memory_bandwidth_bytes_per_s * self.memory_efficiency

    def defaults_used(self) -> tuple[str, ...]:
        """Groups of fields not measured on this machine (datasheet or default values)."""
        groups = {
            "peak_flops": ("peak_flops",),
            "memory": ("memory_bandwidth", "memory_efficiency"),
            "intra_node": ("intra_node",),
            "inter_node": ("inter_node",),
            "gemm": ("gemm",),
            "attention": ("attention",),
        }
        return tuple(
            g
            for g, prefixes in groups.items()
            if not any(m.startswith(prefixes) for m in self.measured)
        )

    def variant(self, devices_per_node: int) -> "HardwareProfile | None":
        """The profile calibrated for another number of processes per node, if one was recorded
        (CPU calibrations: 1 process with every core is not 2 processes with one core each)."""
        variants = (self.calibration or {}).get("variants") or {}
        target = variants.get(devices_per_node) or variants.get(str(devices_per_node))
        if not target:
            return None
        if self.path and not os.path.isabs(target):
            target = os.path.join(os.path.dirname(self.path), target)
        return HardwareProfile.load(target)

    def oversubscribed(self, factor: float) -> "HardwareProfile":
        """This CPU profile shared by `factor` times more processes than it was measured with: each
        process gets 1/factor of the compute and memory bandwidth (time-sharing of the cores)."""
        return dataclasses.replace(
            self,
            peak_flops={k: v / factor for k, v in self.peak_flops.items()},
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s / factor,
            cache_bandwidth_bytes_per_s=self.cache_bandwidth_bytes_per_s / factor,
            description=f"{self.description} (oversubscribed x{factor:g})",
        )

    def scaled_compute(self, factor: float, *, why: str) -> "HardwareProfile":
        """This profile with every compute efficiency (GEMM ceilings, fused attention) times
        `factor`: what a runtime without this architecture's own kernels reaches on it."""
        gemm = dataclasses.replace(
            self.gemm, max_efficiency={k: v * factor for k, v in self.gemm.max_efficiency.items()}
        )
        return dataclasses.replace(
            self,
            gemm=gemm,
            attention_efficiency={k: v * factor for k, v in self.attention_efficiency.items()},
            attention_kernels={k: v * factor for k, v in self.attention_kernels.items()},
            attention_shapes={k: v.scaled(factor) for k, v in self.attention_shapes.items()},
            description=f"{self.description} (kernels of {why}: x{factor:g})",
        )

    # ---- YAML ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any],
        *,
        what: str = "hardware profile",
        path: str | None = None,
        complete: bool = False,
    ) -> "HardwareProfile":
        """Read and check a profile: every number finite and inside its physical range (an
        efficiency in (0, 1], a latency >= 0, ...). A file written by `autosearch calibrate` (it
        has `measured` or `calibration`, or its header says so: `complete`) must hold every key, so
        a
        truncated file is refused."""
        try:
            return cls._from_dict(data, what, path, complete)
        except (KeyError, TypeError, AttributeError) as exc:
            raise SpecError(
                f"{what} is malformed ({exc!r}); "
                "compare with cost_models/profiles/a100-sxm4-80gb.yaml"
            ) from None

    @classmethod
    def _from_dict(
        cls, data: dict[str, Any], what: str, path: str | None, complete: bool
    ) -> "HardwareProfile":
        data = read_mapping(data, what, fix="a mapping of key: value (a profile YAML)")
        # the kinds of the lists and mappings first: `measured` or `calibration` mark a file
        # written by calibration, and a wrong kind there is named as such, not as missing keys
        sources = read_names(data.get("sources"), f"{what}: sources")
        measured = read_names(data.get("measured"), f"{what}: measured")
        calibration = read_mapping(
            data.get("calibration"), f"{what}: calibration", fix="a mapping (what calibrate ran)"
        )
        required = ["name", "gpus_per_node", "peak_flops", "memory", "intra_node", "inter_node"]
        required += ["gemm", "attention"]
        written_by_calibration = complete or bool(measured or calibration)
        if written_by_calibration:  # everything `to_dict` writes
            required += ["kernel_launch_s", "step_overhead_s", "measured", "calibration"]
        missing = [k for k in required if k not in data]
        if missing:
            cut = " (the file looks truncated)" if written_by_calibration else ""
            raise SpecError(f"{what}: missing key(s) {', '.join(missing)}{cut}")
        num = _NumberReader(what)
        peak = {
            str(k): num(v, f"peak_flops.{k}", high=1e18)
            for k, v in _mapping(data["peak_flops"], what, "peak_flops").items()
        }
        if not any(p in peak for p in PRECISIONS):
            raise SpecError(f"{what}: peak_flops needs at least one of {PRECISIONS}")
        mem = _mapping(data["memory"], what, "memory")
        capacity = num(mem["capacity_bytes"], "memory.capacity_bytes", high=1e15)

        def link(d: Any, name: str) -> Link:
            d = _mapping(d, what, name)
            return Link(
                bandwidth_bytes_per_s=num(
                    d["bandwidth_bytes_per_s"], f"{name}.bandwidth_bytes_per_s", high=1e14
                ),
                latency_s=num(d["latency_s"], f"{name}.latency_s", zero=True, high=1.0),
                efficiency=num(d.get("efficiency", 1.0), f"{name}.efficiency", high=1.0),
                op_efficiency={
                    str(k): num(v, f"{name}.op_efficiency.{k}", high=10.0)
                    for k, v in read_mapping(
                        d.get("op_efficiency"),
                        f"{what}: {name}.op_efficiency",
                        fix="a mapping of collective: factor (e.g. {reduce_scatter: 0.5})",
                    ).items()
                },
            )

        g = _mapping(data["gemm"], what, "gemm")
        gemm = GemmEfficiency(
            max_efficiency={
                str(k): num(v, f"gemm.max_efficiency.{k}", high=1.0)
                for k, v in _mapping(g["max_efficiency"], what, "gemm.max_efficiency").items()
            },
            half_dim=num(g.get("half_dim", 0.0), "gemm.half_dim", zero=True, high=1e6),
            launch_s=num(g.get("launch_s", 0.0), "gemm.launch_s", zero=True, high=1.0),
            backward_over_forward=num(
                g.get("backward_over_forward", GEMM_BACKWARD_OVER_FORWARD),
                "gemm.backward_over_forward",
                high=100.0,
            ),
            sm_count=int(num(g.get("sm_count", 0), "gemm.sm_count", zero=True, high=1e5)),
            tiles=parse_tiles(
                read_mapping(
                    g.get("tiles"),
                    f"{what}: gemm.tiles",
                    fix="a mapping of ROWSxCOLUMNS: relative efficiency (e.g. {128x256: 1.0})",
                ),
                what,
            ),
            k_overhead_bytes=num(
                g.get("k_overhead_bytes", 0.0), "gemm.k_overhead_bytes", zero=True, high=1e6
            ),
        )
        if gemm.tiles and gemm.sm_count < 1:
            raise SpecError(
                f"{what}: gemm.tiles needs gemm.sm_count (the SMs the tiles spread over, "
                "e.g. 132 on an H100 SXM)"
            )
        missing_eff = [p for p in peak if p not in gemm.max_efficiency]
        if missing_eff:
            raise SpecError(
                f"{what}: gemm.max_efficiency has no value for {', '.join(missing_eff)}"
            )
        attention = _mapping(data["attention"], what, "attention")
        att = {
            str(k): num(v, f"attention.flash_efficiency.{k}", high=1.0)
            for k, v in _mapping(
                attention["flash_efficiency"], what, "attention.flash_efficiency"
            ).items()
        }
        return cls(
            name=check_name(str(data["name"]), f"{what}: name"),
            description=_text(data.get("description", ""), what, "description"),
            device_type=_text(data.get("device_type", "cuda"), what, "device_type"),
            architecture=_text(data.get("architecture", ""), what, "architecture"),
            gpus_per_node=positive_int(data["gpus_per_node"], f"{what}: gpus_per_node"),
            peak_flops=peak,
            memory_capacity_bytes=capacity,
            memory_bandwidth_bytes_per_s=num(
                mem["bandwidth_bytes_per_s"], "memory.bandwidth_bytes_per_s", high=1e14
            ),
            memory_efficiency=num(mem.get("efficiency", 1.0), "memory.efficiency", high=1.0),
            reserved_memory_bytes=num(
                mem.get("reserved_bytes", 0.0), "memory.reserved_bytes", zero=True, high=capacity
            ),
            cache_bytes=num(
                mem.get("cache_bytes", 0.0), "memory.cache_bytes", zero=True, high=capacity
            ),
            cache_bandwidth_bytes_per_s=num(
                mem.get("cache_bandwidth_bytes_per_s", 0.0),
                "memory.cache_bandwidth_bytes_per_s",
                zero=True,
                high=1e15,
            ),
            intra_node=link(data["intra_node"], "intra_node"),
            inter_node=link(data["inter_node"], "inter_node"),
            gemm=gemm,
            attention_efficiency=att,
            attention_kernels={
                str(k): num(v, f"attention.kernels.{k}", high=1.0)
                for k, v in read_mapping(
                    attention.get("kernels"), f"{what}: attention.kernels"
                ).items()
            },
            attention_shapes=parse_attention_shapes(attention.get("shapes"), what),
            attention_backward_over_forward=num(
                attention.get("backward_over_forward", ATTENTION_BACKWARD_OVER_FORWARD),
                "attention.backward_over_forward",
                high=100.0,
            ),
            kernel_launch_s=num(
                data.get("kernel_launch_s", 0.0), "kernel_launch_s", zero=True, high=1.0
            ),
            step_overhead_s=num(
                data.get("step_overhead_s", 0.0), "step_overhead_s", zero=True, high=3600.0
            ),
            nvlink_domain=_nvlink_domain(data.get("nvlink_domain", 0), what),
            aliases=_names(data.get("aliases"), what, "aliases"),
            device_names=_names(data.get("device_names"), what, "device_names"),
            sources=sources,
            measured=measured,
            calibration=calibration,
            path=path,
            host=_host(data.get("host"), what, num),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "device_type": self.device_type,
            "architecture": self.architecture,
            "sources": list(self.sources),
            "gpus_per_node": self.gpus_per_node,
            "peak_flops": dict(self.peak_flops),
            "memory": {
                "capacity_bytes": self.memory_capacity_bytes,
                "bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
                "efficiency": self.memory_efficiency,
                "reserved_bytes": self.reserved_memory_bytes,
                **(
                    {
                        "cache_bytes": self.cache_bytes,
                        "cache_bandwidth_bytes_per_s": self.cache_bandwidth_bytes_per_s,
                    }
                    if self.cache_bytes
                    else {}
                ),
            },
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
            "gemm": {
                "max_efficiency": dict(self.gemm.max_efficiency),
                "half_dim": self.gemm.half_dim,
                "launch_s": self.gemm.launch_s,
                "backward_over_forward": self.gemm.backward_over_forward,
                **(
                    {
                        "sm_count": self.gemm.sm_count,
                        "tiles": {f"{r}x{c}": e for r, c, e in self.gemm.tiles},
                        "k_overhead_bytes": self.gemm.k_overhead_bytes,
                    }
                    if self.gemm.tiles
                    else {}
                ),
            },
            "attention": {
                "flash_efficiency": dict(self.attention_efficiency),
                "backward_over_forward": self.attention_backward_over_forward,
                **({"kernels": dict(self.attention_kernels)} if self.attention_kernels else {}),
                **(
                    {"shapes": {k: v.to_dict() for k, v in self.attention_shapes.items()}}
                    if self.attention_shapes
                    else {}
                ),
            },
            "kernel_launch_s": self.kernel_launch_s,
            "step_overhead_s": self.step_overhead_s,
            **({"nvlink_domain": self.nvlink_domain} if self.nvlink_domain else {}),
            **({"aliases": list(self.aliases)} if self.aliases else {}),
            **({"device_names": list(self.device_names)} if self.device_names else {}),
            **({"host": self.host.to_dict()} if self.host is not None else {}),
            "measured": list(self.measured),
            "calibration": dict(self.calibration),
        }

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def load(cls, name_or_path: "str | os.PathLike | HardwareProfile") -> "HardwareProfile":
        """A profile by catalog name (``h100-sxm``) or by the path of a YAML file."""
        if isinstance(name_or_path, HardwareProfile):
            return name_or_path
        key = read_path(
            name_or_path,
            "gpu",
            fix="a profile name (`autosearch hardware` lists them), the path of a profile YAML, "
            "or a HardwareProfile",
        )
        # a file rewritten since it was read (calibrate, then tune, in one process) is read again
        mtime = os.path.getmtime(key) if os.path.isfile(key) else None
        return _load_profile(key, mtime)


def _host(value: Any, what: str, num: "_NumberReader") -> Host | None:
    """A profile's ``host:`` section (None where it has none)."""
    if value is None:
        return None
    d = _mapping(value, what, "host")
    return Host(
        link=_text(d["link"], what, "host.link"),
        bandwidth_bytes_per_s=num(
            d["bandwidth_bytes_per_s"], "host.bandwidth_bytes_per_s", high=1e14
        ),
        efficiency=num(d.get("efficiency", 1.0), "host.efficiency", high=1.0),
        memory_bytes=num(d["memory_bytes"], "host.memory_bytes", high=1e15),
        memory_bandwidth_bytes_per_s=num(
            d["memory_bandwidth_bytes_per_s"], "host.memory_bandwidth_bytes_per_s", high=1e14
        ),
        cores=positive_int(d["cores"], f"{what}: host.cores"),
        reserved_bytes=num(
            d.get("reserved_bytes", 0.0), "host.reserved_bytes", zero=True, high=1e15
        ),
    )


def profile_names() -> list[str]:
    """Names of the profiles shipped in `cost_models/profiles/`."""
    return sorted(p.name[:-5] for p in _profiles_dir().iterdir() if p.name.endswith(".yaml"))


def profile_aliases() -> dict[str, str]:
    """{short name: profile name} from every shipped profile's `aliases` (``h100`` -> h100-sxm)."""
    return {a.lower(): p.name for p in _catalog() for a in p.aliases}


def profile_for_device(device_name: str) -> HardwareProfile | None:
    """The shipped profile of exactly the GPU the driver names (``NVIDIA H100 80GB HBM3`` ->
    h100-sxm), from each profile's `device_names`; None for a part no profile lists (an H100
    PCIe or NVL, a GH200: other clocks, memory and links than the SXM board)."""
    key = _device_key(device_name)
    for profile in _catalog():
        if key in {_device_key(n) for n in profile.device_names}:
            return profile
    return None


def _device_key(name: str) -> str:
    """A device name compared without case, spacing or the vendor's prefix."""
    words = name.upper().replace("_", " ").split()
    return " ".join(words[1:] if words[:1] in (["NVIDIA"], ["AMD"]) else words)


def _catalog() -> list[HardwareProfile]:
    return [HardwareProfile.load(name) for name in profile_names()]


def _profiles_dir() -> Path:
    """`cost_models/profiles/`, found without importing `cost_models` (which sits above this
    floor: it imports the specs, never the other way round)."""
    return data_path("profiles")


def _link_dict(link: Link) -> dict[str, Any]:
    out = dataclasses.asdict(link)
    if not out["op_efficiency"]:
        del out["op_efficiency"]
    return out


@functools.lru_cache(maxsize=64)
def _load_profile(key: str, mtime: float | None = None) -> HardwareProfile:
    if key.lower() in profile_names():
        text = (_profiles_dir() / f"{key.lower()}.yaml").read_text(encoding="utf-8")
        return HardwareProfile.from_dict(yaml.safe_load(text), what=f"profile {key!r}")
    if key.endswith((".yaml", ".yml")) or os.path.sep in key or os.path.exists(key):
        data = read_yaml_mapping(key, what="hardware profile")
        return HardwareProfile.from_dict(
            data,
            what=f"hardware profile {key!r}",
            path=os.path.abspath(key),
            complete=_written_by_calibration(key),
        )
    raise SpecError(
        f"unknown GPU {key!r}; known profiles: {', '.join(profile_names())}.{_close_gpus(key)}"
        " Pass one of these names (`autosearch hardware` lists them), or the path of a profile"
        " YAML (e.g. one written by `autosearch calibrate`)."
    )


def _close_gpus(name: str) -> str:
    """' Did you mean X?' for a near miss of a profile name or of a short name (``h100sxm``,
    ``H100-SXM5``), else nothing."""
    import difflib

    known = profile_names() + sorted(profile_aliases())
    close = difflib.get_close_matches(name.lower(), known, n=2, cutoff=0.6)
    return f" Did you mean {' or '.join(map(repr, close))}?" if close else ""


def _written_by_calibration(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(PROFILE_MARKER)
    except OSError:
        return False


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A hardware profile times a number of nodes.

    Args:
        gpu: a profile name (``a100-sxm4-80gb``), a profile YAML path, or a HardwareProfile.
        n_nodes: number of nodes.
        gpus_per_node: devices per node (per host: what torchrun and SLURM call a node);
            defaults to the profile's.
        nvlink_domain: devices in one NVLink domain, whole nodes of them (GB200 NVL72: 72 GPUs
            on 18 hosts of 4); defaults to the profile's, else one node.
    """

    gpu: str
    n_nodes: int = 1
    gpus_per_node: int = None  # type: ignore[assignment]  # None: the profile's, set in __post_init__
    nvlink_domain: int = None  # type: ignore[assignment]  # None: the profile's, else one node
    profile: HardwareProfile = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        profile = HardwareProfile.load(self.gpu)  # refuses a gpu of another kind, naming it
        if isinstance(self.gpu, HardwareProfile):
            object.__setattr__(self, "gpu", profile.path or profile.name)
        else:
            object.__setattr__(self, "gpu", os.fspath(self.gpu))
        object.__setattr__(self, "profile", profile)
        object.__setattr__(self, "n_nodes", positive_int(self.n_nodes, "n_nodes"))
        gpn = (
            profile.gpus_per_node
            if self.gpus_per_node is None
            else positive_int(self.gpus_per_node, "gpus_per_node")
        )
        object.__setattr__(self, "gpus_per_node", gpn)
        object.__setattr__(self, "nvlink_domain", self._domain(profile, gpn))
        if self.n_nodes * gpn > MAX_DEVICES:
            raise SpecError(
                f"cluster {self.gpu}:{self.n_nodes}x{gpn} has {self.n_nodes * gpn:,} devices, "
                f"beyond the {MAX_DEVICES:,} autosearch models; use fewer nodes"
            )
        if profile.device_type == "cpu" and gpn != profile.gpus_per_node:
            # A CPU "device" is a process sharing the node's cores: use the calibration made with
            # this many processes, else time-share the measured ones.
            variant = profile.variant(gpn)
            if variant is not None:
                profile = variant
            elif gpn > profile.gpus_per_node:
                profile = profile.oversubscribed(gpn / profile.gpus_per_node)
            object.__setattr__(self, "profile", profile)

    def _domain(self, profile: HardwareProfile, gpn: int) -> int:
        """The NVLink domain size: whole nodes, at least one node."""
        given = self.nvlink_domain is not None
        domain = (
            positive_int(self.nvlink_domain, "nvlink_domain")
            if given
            else (profile.nvlink_domain or gpn)
        )
        if domain <= gpn:
            return gpn
        if domain % gpn:
            where = "nvlink_domain" if given else f"profile {profile.name!r}'s nvlink_domain"
            raise SpecError(
                f"{where} = {domain} is not a whole number of nodes of {gpn} devices; give "
                f"gpus_per_node that divides it (e.g. {profile.name}:NODESx"
                f"{profile.gpus_per_node}) or nvlink_domain as a multiple of {gpn}"
            )
        return domain

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @property
    def name(self) -> str:
        return f"{self.profile.name}:{self.n_nodes}x{self.gpus_per_node}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(
        cls,
        value: "str | os.PathLike | Mapping[str, Any] | Cluster",
        *,
        strict: bool = False,
        nnodes: int | None = None,
        gpus_per_node: int | None = None,
        what: str = "cluster",
    ) -> "Cluster":
        """The one cluster parser: ``GPU:NODESxGPUS`` (``h100-sxm:32x8``), a GPU name, a cluster
        YAML (``gpu``, ``n_nodes``, ``gpus_per_node``), a profile YAML (``path[:NODESxGPUS]``),
        or a mapping of a cluster's fields.

        Both modes refuse ``GPU:N`` (N nodes, or N GPUs?) and a cluster file or mapping without
        ``gpus_per_node``. The lenient mode (the default) reads a bare GPU name as one node of the
        profile's devices. The strict mode (the CLI and `autosearch.tune`) guesses nothing: a
        bare GPU name needs `nnodes` and `gpus_per_node`, and it reads the short names in
        each profile's `aliases` (``h100``) with a note on stderr.

        Args:
            value: the text, a mapping or a Cluster (returned as it is).
            strict: refuse what the lenient mode would guess.
            nnodes, gpus_per_node: with a bare GPU name or profile YAML (both or neither).
            what: how messages name the input (``--cluster``).

        Example:
            >>> Cluster.parse("h100-sxm", strict=True, nnodes=2, gpus_per_node=8).name
            'h100-sxm:2x8'
        """
        if isinstance(value, Cluster):
            return value
        if (nnodes is None) != (gpus_per_node is None):
            raise SpecError(
                "--nnodes and --gpus-per-node go together (e.g. --cluster h100-sxm --nnodes 32 "
                "--gpus-per-node 8), or give --cluster h100-sxm:32x8 alone"
            )
        if isinstance(value, Mapping):
            return cls._from_fields(dict(value), f"{what} (a mapping)", strict, nnodes)
        text = read_path(
            value,
            what,
            fix="GPU:NODESxGPUS (e.g. h100-sxm:1x8), a cluster or profile YAML path, a mapping "
            "of gpu, n_nodes and gpus_per_node, or a Cluster",
        )
        if not text.strip():
            raise SpecError(f"{what} is empty; give a cluster such as h100-sxm:1x8")
        text = text.strip()
        full = re.fullmatch(r"(.+?):(\d+)x(\d+)", text)
        nodes_only = re.fullmatch(r"(.+?):(\d+)", text)
        if nnodes is not None and (full or nodes_only):
            raise SpecError(
                f"{what} {text!r} already gives the nodes and devices; --nnodes and "
                "--gpus-per-node go with a bare GPU name (--cluster GPU --nnodes N "
                "--gpus-per-node G)"
            )
        if nodes_only:
            gpu, n = nodes_only.groups()
            raise SpecError(
                f"{what} {text!r} is ambiguous ({n} nodes or {n} devices?); write NODESxGPUS: "
                f"{gpu}:{n}x8 for {n} nodes of 8 devices, {gpu}:1x{n} for one node of {n}, or "
                f"--cluster {gpu} --nnodes {n} --gpus-per-node G"
            )
        if full:
            gpu, n_nodes, per_node = full.groups()
            return cls._of(_gpu_name(gpu, what, strict), int(n_nodes), int(per_node), what)
        if text.endswith((".yaml", ".yml")) and os.path.exists(text):
            data = read_yaml_mapping(text, what="cluster")
            if "gpu" not in data and "peak_flops" in data:  # a bare hardware profile
                return cls._of(text, nnodes or 1, gpus_per_node, what)
            return cls._from_fields(data, f"cluster file {text!r}", strict, nnodes)
        if ":" in text and not os.path.exists(text):
            raise SpecError(
                f"{what} {text!r} is not GPU:NODESxGPUS (example: h100-sxm:32x8) nor a YAML file"
            )
        gpu = _gpu_name(text, what, strict)
        HardwareProfile.load(gpu)  # an unknown GPU is named before the node shape is asked for
        if strict and nnodes is None and not os.path.exists(text):
            raise SpecError(
                f"{what} {text!r} does not say how many nodes and devices: write {gpu}:1x8 for "
                f"one node of 8 devices, {gpu}:NODESx8 for more, or add --nnodes N "
                "--gpus-per-node G"
            )
        return cls._of(gpu, nnodes or 1, gpus_per_node, what)

    @classmethod
    def _of(cls, gpu: str, n_nodes: int, gpus_per_node: int | None, what: str) -> "Cluster":
        # The numbers are checked before the profile is read, so the message names the input.
        positive_int(n_nodes, f"{what}: n_nodes")
        if gpus_per_node is None:  # the profile's own devices per node
            return cls(gpu=gpu, n_nodes=n_nodes)
        positive_int(gpus_per_node, f"{what}: gpus_per_node")
        return cls(gpu=gpu, n_nodes=n_nodes, gpus_per_node=gpus_per_node)._node_checked(what)

    def _node_checked(self, what: str) -> "Cluster":
        """This cluster, refused when its nodes hold more GPUs than the profile's node does
        (``h100-sxm:8x9``: an HGX board holds 8). Fewer is a partial node, and is fine; a CPU
        profile's node is processes sharing cores, and a calibrated profile's node is what was
        measured, so neither bounds it."""
        profile, gpn = self.profile, self.gpus_per_node
        if profile.device_type == "cpu" or profile.calibration or gpn <= profile.gpus_per_node:
            return self
        world, per = self.world_size, profile.gpus_per_node
        same = (
            f"{profile.name}:{world // per}x{per} for the same {world:,} GPUs"
            if world % per == 0
            else f"{profile.name}:NODESx{per}"
        )
        domain = (
            f" ({profile.nvlink_domain} GPUs, {profile.nvlink_domain // per} nodes, share one "
            "NVLink domain)"
            if profile.nvlink_domain > per
            else ""
        )
        raise SpecError(
            f"{what} {self.gpu}:{self.n_nodes}x{gpn} puts {gpn} GPUs in a node, but one "
            f"{profile.name} node holds {per}{domain}; write {same}, or fewer GPUs per node "
            "(a partial node)"
        )

    @classmethod
    def _from_fields(
        cls, data: dict[str, Any], what: str, strict: bool, nnodes: int | None
    ) -> "Cluster":
        if nnodes is not None:
            raise SpecError(
                f"{what} already gives the nodes and devices; drop --nnodes and "
                "--gpus-per-node, or give a GPU name with them"
            )
        if isinstance(data.get("gpu"), str):
            data["gpu"] = _gpu_name(data["gpu"], f"{what}: gpu", strict)
        return cls.from_dict(data, what=what)._node_checked(what)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, what: str = "cluster") -> "Cluster":
        data = read_mapping(data, what, fix="a mapping of gpu, n_nodes and gpus_per_node")
        kwargs = check_keys(data, cls, what=what)
        if "gpu" in kwargs and not isinstance(kwargs["gpu"], (str, os.PathLike)):
            read_path(kwargs["gpu"], f"{what}: gpu", fix="a profile name or a profile YAML path")
        if "gpu" in kwargs and "gpus_per_node" not in kwargs:
            raise SpecError(
                f"{what}: missing key 'gpus_per_node' (devices per node, e.g. 8); it is not "
                "guessed from the GPU"
            )
        if "gpu" not in kwargs:
            raise SpecError(
                f"{what}: missing key 'gpu' (a profile name such as h100-sxm, or a profile YAML"
                " path)"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {"gpu": self.gpu, "n_nodes": self.n_nodes, "gpus_per_node": self.gpus_per_node}
        if self.nvlink_domain != self.gpus_per_node:
            out["nvlink_domain"] = self.nvlink_domain
        return out


def _names(value: Any, what: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SpecError(f"{what}: {key} must be a list of names, got {value!r}")
    return tuple(value)


def _nvlink_domain(value: Any, what: str) -> int:
    if value in (0, None):
        return 0
    return positive_int(value, f"{what}: nvlink_domain")


# Short GPU names people say, and the profile each stands for (the strict parser prints a note
# when it reads one). "a100" is not here: it names two profiles (40 and 80 GB), so it stays an
# error.
# Short GPU names are profile data (each profile's `aliases`, `profile_aliases`). "a100" is not
# one: it names two profiles (40 and 80 GB), so it is an error.
_AMBIGUOUS_GPUS = {"a100": ("a100-sxm4-40gb", "a100-sxm4-80gb")}


def _gpu_name(name: str, what: str, strict: bool) -> str:
    """The profile a GPU name stands for: a short name a profile lists in its `aliases` (strict
    mode, with a note), refused where it names two profiles; any other name as it is."""
    low, aliases = name.lower(), profile_aliases()
    if strict and low in aliases:
        print(
            f"note: {what}: {name!r} is read as the {aliases[low]!r} profile; write "
            f"{aliases[low]} to silence this note (`autosearch hardware` lists the profiles)",
            file=sys.stderr,
        )
        return aliases[low]
    if low in _AMBIGUOUS_GPUS:
        raise SpecError(
            f"{what}: {name!r} names more than one profile: "
            f"{' or '.join(_AMBIGUOUS_GPUS[low])}; write one of them"
        )
    return name


class _NumberReader:
    """Checks one number of a profile: a real, finite value inside its physical range."""

    def __init__(self, what: str):
        self.what = what

    def __call__(self, value: Any, name: str, *, zero: bool = False, high: float) -> float:
        where = f"{self.what}: {name}"
        if isinstance(value, str):  # PyYAML reads 19.5e12 (no sign in the exponent) as text
            try:
                value = float(value)
            except ValueError:
                raise SpecError(f"{where} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{where} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise SpecError(f"{where} must be a finite number, got {value!r}")
        low_ok = value >= 0 if zero else value > 0
        if not low_ok or value > high:
            low = "0 <=" if zero else "0 <"
            raise SpecError(f"{where} = {value:g} is outside {low} value <= {high:g}")
        return value


def _mapping(value: Any, what: str, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{what}: {name} must be a mapping of key: value, got {kind_of(value)}")
    return value


def _text(value: Any, what: str, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise SpecError(f"{what}: {name} must be a text, got {kind_of(value)}")
    return value
