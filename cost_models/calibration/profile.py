"""From measurements to a HardwareProfile: the fits of `fit.py`, and the choices where a machine
publishes no number (numpy/scipy/pandas only; no torch).

What "peak" means:
- GPU whose name matches a catalog profile (H100, H200, A100): the datasheet peak of that profile,
  and max_efficiency = the fitted large-shape GEMM rate / peak.
- CPU (or an unknown GPU): no published peak exists for a virtual machine's share of a CPU, so
  peak_flops is *measured*: the highest fitted large-shape GEMM rate over all precisions (on an
  AVX2 CPU, fp32), the same number for every precision, since a CPU has one set of vector units.
  max_efficiency[p] = that precision's fitted rate / peak (1.0 for the best precision; bf16
  without native bf16 instructions is a small fraction). MFU on such a profile is therefore a
  fraction of the best dense matmul rate this machine reaches, not of a datasheet figure.

Likewise, with no nominal bandwidth (CPU memory in a VM, gloo over loopback), the link and memory
bandwidths are the fitted achieved values with efficiency 1.0; on a GPU with a catalog match they
are the datasheet values with efficiency = fitted / datasheet.

`build_profile` composes one function per fitted term (`fit_launch`, `fit_gemm_term`,
`fit_memory_term`, `fit_attention_term`, `fit_links`, `fit_capacity`); each returns a small
record of what it fitted and the `measured` / `defaults` / `fits` entries it adds. The profile
is then made as a `HardwareProfile` and written by its own `to_dict` / `to_yaml` (one schema),
with the verdict of `quality.assess_quality` on the measurements in `calibration.quality`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from autosearch.core.hardware import (
    ATTENTION_BACKWARD_OVER_FORWARD,
    GEMM_BACKWARD_OVER_FORWARD,
    GemmEfficiency,
    HardwareProfile,
    Link,
    profile_for_device,
)
from cost_models.calibration import fit as F
from cost_models.calibration.quality import assess_quality

# Streaming arrays count as "in DRAM" when the data touched is at least 4x the last-level cache
# (McCalpin, STREAM run rules).
STREAM_CACHE_FACTOR = 4.0
# Upper ends of the ranges the profile reader (HardwareProfile.from_dict) accepts for the fitted
# terms a disturbed calibration can overshoot (an efficiency is a fraction, ...). Such a value is
# written clamped, so that the untrusted profile still loads; the raw value stays in
# `calibration.fits`, and the quality checks refuse the calibration for it.
SCHEMA_LIMITS = {
    "efficiency": 1.0,
    "max_efficiency": 1.0,
    "flash_efficiency": 1.0,
    "op_efficiency": 10.0,
    "latency_s": 1.0,
    "launch_s": 1.0,
    "kernel_launch_s": 1.0,
    "half_dim": 1e6,
    "backward_over_forward": 100.0,
    "peak_flops": 1e18,
    "bandwidth_bytes_per_s": 1e14,
    "cache_bandwidth_bytes_per_s": 1e15,
}


def catalog_profile_for(
    device_name: str, memory_bytes: float | None = None
) -> HardwareProfile | None:
    """The shipped profile of exactly this GPU (`NVIDIA H100 80GB HBM3` -> h100-sxm), or None.

    Matched against each profile's `device_names`, never by a substring: an H100 PCIe, H100 NVL
    or GH200 is not the SXM board (other clocks, memory and links). `memory_bytes` is not needed
    (the driver's name says 40 or 80 GB) and kept for callers that pass it.
    """
    return profile_for_device(device_name)


@dataclass(frozen=True, kw_only=True)
class Term:
    """What fitting one term adds to the profile's record.

    measured: names added to the profile's `measured` list.
    defaults: `calibration.defaults` entries (field -> what it holds instead of a measurement).
    fits: `calibration.fits` entries (name -> form, parameters and fit quality).
    """

    measured: tuple[str, ...] = ()
    defaults: dict[str, str] = field(default_factory=dict)
    fits: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LaunchTerm(Term):
    kernel_launch_s: float


@dataclass(frozen=True, kw_only=True)
class GemmTerm(Term):
    peak_flops: dict[str, float]
    gemm: GemmEfficiency
    peak_definition: str


@dataclass(frozen=True, kw_only=True)
class MemoryTerm(Term):
    bandwidth_bytes_per_s: float
    efficiency: float
    cache_bytes: float = 0.0
    cache_bandwidth_bytes_per_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class AttentionTerm(Term):
    efficiency: dict[str, float]
    backward_over_forward: float


@dataclass(frozen=True, kw_only=True)
class LinksTerm(Term):
    intra_node: Link
    inter_node: Link


@dataclass(frozen=True, kw_only=True)
class CapacityTerm(Term):
    capacity_bytes: float
    reserved_bytes: float


def build_profile(
    df: pd.DataFrame,
    *,
    name: str,
    machine: dict[str, Any],
    compute_world_size: int,
    gpus_per_node: int,
    statistic: str = "median",
    description: str = "",
) -> tuple[HardwareProfile, dict]:
    """Fit every term that `df` has measurements for, check them, and build the profile.

    Args:
        df: the rows of `run_microbenchmarks` (one per measurement point).
        name: the profile name.
        machine: `describe_machine(...)` (device, software, caches, load).
        compute_world_size: which world size's compute rows to fit (on CPU, processes per node
            change the threads each process has; on a GPU the rows of world size 1).
        gpus_per_node: devices per node in the profile (processes per node on CPU).
        statistic: "median" (default) or "min" of the timed calls of each point.

    Returns:
        (profile, fits): the profile and a dict of every fit (also stored in profile.calibration);
        `profile.calibration["quality"]` holds the verdict of `assess_quality`.
    """
    device = str(df["device"].iloc[0])
    base = (
        catalog_profile_for(machine.get("device_name", ""), machine.get("device_memory_bytes"))
        if device == "cuda"
        else None
    )
    cdf = df[df["world_size"] == compute_world_size]
    launch = fit_launch(cdf, statistic=statistic, base=base)
    gemm = fit_gemm_term(cdf, statistic=statistic, base=base, world_size=compute_world_size)
    memory = fit_memory_term(
        cdf, statistic=statistic, machine=machine, base=base, launch_s=launch.kernel_launch_s
    )
    attention = fit_attention_term(
        cdf, statistic=statistic, gemm=gemm, launch_s=launch.kernel_launch_s
    )
    links = fit_links(df, statistic=statistic, machine=machine, base=base)
    capacity = fit_capacity(cdf, machine=machine, base=base, gpus_per_node=gpus_per_node)
    gemm = fit_fp8_term(cdf, statistic=statistic, base=base, gemm=gemm)
    gemm, attention, catalog = _catalog_precisions(gemm, attention, base)
    terms = Terms(launch, gemm, memory, attention, links, capacity, catalog)
    threads = cdf["threads"].dropna()
    threads_per_process = int(threads.iloc[0]) if len(threads) else None
    data = _assemble(
        terms,
        name=name,
        description=description or _describe(device, machine, gpus_per_node, threads_per_process),
        device=device,
        gpus_per_node=gpus_per_node,
        sources=_sources(machine, base),
        base=base,
    ).to_dict()
    clamped = _within_schema(data)
    quality = assess_quality(
        rows=_rows_used(df, compute_world_size),
        fits=_plain(terms.fits),
        machine=machine,
        device=device,
        threads_per_process=threads_per_process,
        catalog=base,
        clamped=clamped,
    )
    data["calibration"] = _plain(
        {
            "tool": "autosearch calibrate",
            "statistic": statistic,
            "device": device,
            "compute_world_size": int(compute_world_size),
            "threads_per_process": threads_per_process,
            "machine": machine,
            "peak_definition": gemm.peak_definition,
            "defaults": terms.defaults,
            "fits": terms.fits,
            "quality": quality.to_dict(),
        }
    )
    # Read through the schema's own reader: the same checks as any profile file gets.
    return HardwareProfile.from_dict(data, what=f"calibrated profile {name!r}"), terms.fits


class Terms(NamedTuple):
    """Every fitted term of one profile, in the order their records are written."""

    launch: LaunchTerm
    gemm: GemmTerm
    memory: MemoryTerm
    attention: AttentionTerm
    links: LinksTerm
    capacity: CapacityTerm
    catalog: Term  # precisions a GPU did not measure, kept from its catalog profile

    @property
    def measured(self) -> tuple[str, ...]:
        return tuple(m for t in self for m in t.measured)

    @property
    def defaults(self) -> dict[str, str]:
        return {k: v for t in self for k, v in t.defaults.items()}

    @property
    def fits(self) -> dict[str, Any]:
        return {k: v for t in self for k, v in t.fits.items()}


def _assemble(
    terms: Terms,
    *,
    name: str,
    description: str,
    device: str,
    gpus_per_node: int,
    sources: tuple[str, ...],
    base: HardwareProfile | None = None,
) -> HardwareProfile:
    """The profile of the fitted terms (its `to_dict` is the one schema writer). What no
    microbenchmark measures comes from the catalog profile of the same GPU: its architecture
    (which kernels a runtime has for it), its attention-kernel table and its NVLink domain."""
    return HardwareProfile(
        name=name,
        description=description,
        device_type=device,
        architecture=base.architecture if base else "",
        attention_kernels=dict(base.attention_kernels) if base else {},
        nvlink_domain=base.nvlink_domain if base else 0,
        sources=sources,
        gpus_per_node=int(gpus_per_node),
        peak_flops=terms.gemm.peak_flops,
        memory_capacity_bytes=terms.capacity.capacity_bytes,
        memory_bandwidth_bytes_per_s=terms.memory.bandwidth_bytes_per_s,
        memory_efficiency=terms.memory.efficiency,
        reserved_memory_bytes=terms.capacity.reserved_bytes,
        cache_bytes=terms.memory.cache_bytes,
        cache_bandwidth_bytes_per_s=terms.memory.cache_bandwidth_bytes_per_s,
        intra_node=terms.links.intra_node,
        inter_node=terms.links.inter_node,
        gemm=terms.gemm.gemm,
        attention_efficiency=terms.attention.efficiency,
        attention_backward_over_forward=terms.attention.backward_over_forward,
        kernel_launch_s=terms.launch.kernel_launch_s,
        measured=terms.measured,
    )


# ---------------------------------------------------------------------------------------------
# One function per fitted term
# ---------------------------------------------------------------------------------------------


def fit_launch(cdf: pd.DataFrame, *, statistic: str, base: HardwareProfile | None) -> LaunchTerm:
    """Per-call overhead: the median time of a 1-element add, back to back."""
    rows = _measured(cdf, "launch", statistic)
    if not len(rows):
        return LaunchTerm(
            kernel_launch_s=base.kernel_launch_s if base else 1e-5,
            defaults={"kernel_launch_s": "not measured"},
        )
    launch_s = float(rows["t"].median())
    return LaunchTerm(
        kernel_launch_s=launch_s,
        measured=("kernel_launch_s",),
        fits={
            "kernel_launch": {
                "form": "median time of a 1-element add, back to back",
                "kernel_launch_s": launch_s,
            }
        },
    )


def fit_gemm_term(
    cdf: pd.DataFrame, *, statistic: str, base: HardwareProfile | None, world_size: int
) -> GemmTerm:
    """`GemmEfficiency` (max_efficiency per precision, half_dim, launch_s, backward_over_forward)
    and the peak it is relative to.

    The cost model charges a GEMM's backward as gemm.backward_over_forward x its forward. The
    profile takes the measured ratio (F.linear's backward is ~3x its forward on CPU, not 2x), and
    the shape fit runs on forward + backward per shape with that multiplier, so that the total
    the model charges is what was measured.
    """
    g = _measured(cdf, "gemm", statistic)
    if len(g) < 3:
        raise ValueError(f"too few GEMM measurements for world size {world_size} ({len(g)})")
    bwd_ratio = _bwd_over_fwd(g)
    ratio = bwd_ratio if bwd_ratio else GEMM_BACKWARD_OVER_FORWARD
    total = _fwd_plus_bwd(g, ["precision", "m", "n", "k"], "linear_fwd", "linear_bwd")
    points = total if len(total) >= 3 else g
    shape_args = (points["m"], points["n"], points["k"], points["precision"].tolist(), points["t"])
    mult = 1.0 + ratio if len(total) >= 3 else np.where(g["op"] == "linear_bwd", ratio, 1.0)
    gfit = F.fit_gemm(*shape_args, multiplier=mult)
    # A catalog profile with tiles (Hopper, Blackwell) keeps its architecture's tile shapes and
    # K overhead, and the rates and launch are fitted under them, where that reads this
    # device's GEMMs at least as well as the smooth curve (the H200's --quick grid, forward +
    # backward: tiles 11.2%, curve 10.4%, so that profile keeps the curve).
    tiled, tiled_err = None, None
    if base is not None and base.gemm.tiles:
        tiled = F.fit_gemm_tiled(*shape_args, shapes=base.gemm, multiplier=mult)
        # compared on the 16-bit shapes training runs (fp32 F.linear runs CUDA cores, not tiles)
        sixteen = np.isin(np.asarray(shape_args[3], dtype=object), ["bf16", "fp16"])
        if not sixteen.any():
            sixteen = np.ones(len(points), dtype=bool)
        measured_t = points["t"].to_numpy()[sixteen]
        m_, n_, k_, prec_ = shape_args[:4]
        smooth_err = F.mean_rel_residual(
            gfit.predict(m_, n_, k_, prec_, mult)[sixteen], measured_t
        )
        tiled_err = F.mean_rel_residual(
            tiled.predict(m_, n_, k_, prec_, mult)[sixteen], measured_t
        )
        if tiled_err > smooth_err:
            tiled = None
    rates = tiled.rate_flops if tiled is not None else gfit.rate_flops
    fwd = g[g["op"] == "linear_fwd"]
    fwd_fit = (
        F.fit_gemm(fwd["m"], fwd["n"], fwd["k"], fwd["precision"].tolist(), fwd["t"])
        if len(fwd) >= 3
        else None
    )
    if base is not None:
        peak = {p: base.peak_flops[p] for p in rates if p in base.peak_flops}
        definition = f"datasheet peak of catalog profile {base.name}"
    else:
        best = max(gfit.rate_flops.values())
        peak = {p: best for p in gfit.rate_flops}
        best_p = max(gfit.rate_flops, key=lambda p: gfit.rate_flops[p])
        definition = (
            f"measured: the fitted large-shape rate of F.linear in {best_p} (the best precision), "
            "the same for every precision; max_efficiency = each precision's rate / this"
        )
    measured: tuple[str, ...] = ("peak_flops",) if base is None else ()
    measured += ("gemm.max_efficiency", "gemm.half_dim", "gemm.launch_s")
    measured += ("gemm.backward_over_forward",) if bwd_ratio else ()
    tiles_record = None
    if tiled_err is not None:
        assert base is not None
        tiles_record = {
            "used": tiled is not None,
            "why": f"mean |error| on the 16-bit shapes: tile model {tiled_err:.1%} (the "
            f"tiles, SM count and K overhead of {base.name}, the rates and launch fitted), "
            f"smooth curve {smooth_err:.1%}; the better one prices GEMMs",
        }
        if tiled is not None:
            tiles_record.update(
                rate_flops=tiled.rate_flops,
                launch_s=tiled.launch_s,
                quality=tiled.quality.to_dict(),
            )
    record = {
        "form": "t_fwd+bwd = (1 + r) (launch + 2mnk / (peak * max_eff[p]) * (1 + half_dim "
        "(1/m + 1/n + 1/k))): GemmEfficiency.time_s; F.linear forward + backward (dgrad + "
        "wgrad) per shape, r = gemm.backward_over_forward (measured)",
        "rate_flops": gfit.rate_flops,
        "half_dim": gfit.half_dim,
        "launch_s": gfit.launch_s,
        "quality": gfit.quality.to_dict(),
        "quality_by_precision": {p: q.to_dict() for p, q in gfit.quality_by_precision.items()},
        "backward_over_forward_measured": bwd_ratio,
        "backward_over_forward_model": GEMM_BACKWARD_OVER_FORWARD,
        "forward_only": None
        if fwd_fit is None
        else {
            "rate_flops": fwd_fit.rate_flops,
            "half_dim": fwd_fit.half_dim,
            "launch_s": fwd_fit.launch_s,
            "quality": fwd_fit.quality.to_dict(),
        },
        "peak_definition": definition,
        "skipped_shapes": int(_skipped(cdf, "gemm")),
        **({"tiles": tiles_record} if tiles_record is not None else {}),
    }
    gemm = GemmEfficiency(
        max_efficiency={p: float(rates[p] / peak[p]) for p in peak},
        half_dim=float(gfit.half_dim),  # the smooth curve's: small torch ops (terms/ssm.py)
        launch_s=float(tiled.launch_s if tiled is not None else gfit.launch_s),
        backward_over_forward=float(ratio),
    )
    if tiled is not None and base is not None:  # the catalog's tiles price the shapes
        gemm = dataclasses.replace(
            gemm,
            sm_count=base.gemm.sm_count,
            tiles=base.gemm.tiles,
            k_overhead_bytes=base.gemm.k_overhead_bytes,
        )
    return GemmTerm(
        peak_flops={p: float(v) for p, v in peak.items()},
        gemm=gemm,
        peak_definition=definition,
        measured=measured,
        fits={"gemm": record},
    )


def fit_memory_term(
    cdf: pd.DataFrame,
    *,
    statistic: str,
    machine: dict[str, Any],
    base: HardwareProfile | None,
    launch_s: float,
) -> MemoryTerm:
    """Streaming (DRAM) bandwidth from STREAM arrays beyond the last-level cache, and on a CPU the
    bandwidth of working sets that fit in it."""
    mem = _measured(cdf, "memory", statistic)
    if not len(mem):
        return MemoryTerm(
            bandwidth_bytes_per_s=base.memory_bandwidth_bytes_per_s if base else 1e10,
            efficiency=base.memory_efficiency if base else 1.0,
            defaults={"memory_bandwidth_bytes_per_s": "not measured"},
        )
    device = str(cdf["device"].iloc[0])
    llc = machine.get("device_l2_cache_bytes" if device == "cuda" else "last_level_cache_bytes")
    llc = float(llc) if llc else 32 * 2**20
    dram = mem[mem["bytes"] >= STREAM_CACHE_FACTOR * llc]
    rule = f"footprint >= {STREAM_CACHE_FACTOR:g} x last-level cache ({llc / 2**20:.0f} MiB)"
    if dram["array_bytes"].nunique() < 2:
        sizes = sorted(mem["array_bytes"].unique())[-2:]
        dram = mem[mem["array_bytes"].isin(sizes)]
        rule = "the two largest arrays (none reach 4x the last-level cache)"
    bfit = F.fit_bandwidth(dram["bytes"], dram["t"], launch_s=launch_s)
    all_q = F.fit_quality(
        (launch_s + mem["bytes"] / bfit.bandwidth_bytes_per_s).tolist(), mem["t"].tolist()
    )
    in_cache = mem[mem["bytes"] <= llc]
    cache_bw = float((in_cache["bytes"] / in_cache["t"]).max()) if len(in_cache) else None
    cache_fit = None
    measured: tuple[str, ...] = ()
    if device == "cpu" and in_cache["array_bytes"].nunique() >= 2:
        # Working sets that fit in the last-level cache stream several times faster than DRAM;
        # the cost model uses this rate for kernels whose bytes fit (tiny models on a CPU).
        cache_fit = F.fit_bandwidth(in_cache["bytes"], in_cache["t"], launch_s=launch_s)
        measured += ("memory.cache_bandwidth_bytes_per_s",)
    if base is not None:
        bandwidth = base.memory_bandwidth_bytes_per_s
        efficiency = bfit.bandwidth_bytes_per_s / base.memory_bandwidth_bytes_per_s
        measured += ("memory_efficiency",)
    else:
        bandwidth, efficiency = bfit.bandwidth_bytes_per_s, 1.0
        measured += ("memory_bandwidth_bytes_per_s",)
    record = {
        "form": "t = kernel_launch_s + bytes / bandwidth, bytes = reads + writes of STREAM "
        "copy/add/triad",
        "points": rule,
        "bandwidth_bytes_per_s": bfit.bandwidth_bytes_per_s,
        "quality": bfit.quality.to_dict(),
        "quality_all_sizes": all_q.to_dict(),
        "best_in_cache_bytes_per_s": cache_bw,
        "cache": None
        if cache_fit is None
        else {
            "points": f"footprint <= last-level cache ({llc / 2**20:.0f} MiB)",
            "cache_bytes": llc,
            "bandwidth_bytes_per_s": cache_fit.bandwidth_bytes_per_s,
            "quality": cache_fit.quality.to_dict(),
        },
    }
    return MemoryTerm(
        bandwidth_bytes_per_s=float(bandwidth),
        efficiency=float(efficiency),
        cache_bytes=float(llc) if cache_fit is not None else 0.0,
        cache_bandwidth_bytes_per_s=float(cache_fit.bandwidth_bytes_per_s)
        if cache_fit is not None
        else 0.0,
        measured=measured,
        fits={"memory": record},
    )


def fit_attention_term(
    cdf: pd.DataFrame, *, statistic: str, gemm: GemmTerm, launch_s: float
) -> AttentionTerm:
    """Fused attention efficiency per precision and one backward-over-forward ratio."""
    att = _measured(cdf, "attention", statistic)
    peak, max_eff = gemm.peak_flops, gemm.gemm.max_efficiency
    total = _fwd_plus_bwd(
        att, ["precision", "batch", "heads", "seq_len", "head_dim"], "sdpa_fwd", "sdpa_bwd"
    )
    # One backward ratio for every precision (the profile has one): the one of the fastest
    # precision, the one a search will pick; the others' efficiencies absorb the difference.
    best_rows = (
        total[total["precision"] == max(peak, key=lambda p: max_eff.get(p, 0))]
        if len(total)
        else total
    )
    ratio = (
        float(np.median(best_rows["t_bwd"] / best_rows["t_fwd"]))
        if len(best_rows)
        else ATTENTION_BACKWARD_OVER_FORWARD
    )
    record: dict[str, Any] = {
        "form": "t_fwd+bwd = (1 + r) (kernel_launch_s + F / (peak * eff[p])), F = 4 b a s^2 d / 2 "
        "(causal SDPA forward FLOPs); r = attention.backward_over_forward (measured)",
        "backward_over_forward": ratio,
    }
    efficiency: dict[str, float] = {}
    for p in peak:
        rows = total[total["precision"] == p]
        if len(rows) >= 1:
            afit = F.fit_attention(
                rows["flops"], rows["t"], launch_s=launch_s, multiplier=1.0 + ratio
            )
            efficiency[p] = afit.rate_flops / peak[p]
            record[p] = {
                "rate_flops": afit.rate_flops,
                "efficiency": efficiency[p],
                "quality": afit.quality.to_dict(),
                "backward_over_forward_measured": float(np.median(rows["t_bwd"] / rows["t_fwd"])),
            }
    measured = ("attention_efficiency", "attention.backward_over_forward") if efficiency else ()
    defaults = {}
    for p in [p for p in peak if p not in efficiency]:  # the GEMM efficiency of the precision
        efficiency[p] = max_eff[p] * 0.5
        defaults[f"attention_efficiency.{p}"] = "not measured: half the GEMM max_efficiency"
    return AttentionTerm(
        efficiency={p: float(v) for p, v in efficiency.items()},
        backward_over_forward=float(ratio),
        measured=measured,
        defaults=defaults,
        fits={"attention": record},
    )


# Collectives as the CSV names them -> as `Link.op_factor` names them.
_LINK_OPS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "send_recv": "p2p",
}


def fit_links(
    df: pd.DataFrame, *, statistic: str, machine: dict[str, Any], base: HardwareProfile | None
) -> LinksTerm:
    """The intra-node link (alpha-beta over every op, and each op's bandwidth relative to it);
    the inter-node link is never measured on one node (catalog value, or a copy of intra)."""
    coll = _measured(df, "collective", statistic)
    if len(coll) >= 2:
        intra = _fit_intra_link(coll, machine=machine, base=base)
    elif base is not None:
        intra = LinksTerm(
            intra_node=dataclasses.replace(base.intra_node, op_efficiency={}),
            inter_node=base.inter_node,
            defaults={
                "intra_node": f"not measured (world size 1 only): catalog profile {base.name}"
            },
        )
    else:
        intra = LinksTerm(
            intra_node=Link(bandwidth_bytes_per_s=1e9, latency_s=1e-4, efficiency=1.0),
            inter_node=Link(bandwidth_bytes_per_s=1e9, latency_s=1e-4, efficiency=1.0),
            defaults={
                "intra_node": "not measured (world size 1 only): placeholder 1 GB/s, 100 us"
            },
        )
    if base is not None:
        inter = dataclasses.replace(base.inter_node, op_efficiency={})
        note = f"not measured (one node): catalog profile {base.name}"
    else:
        inter, note = intra.intra_node, "not measured (one node): a copy of intra_node"
    return dataclasses.replace(
        intra,
        intra_node=_rounded(intra.intra_node),
        inter_node=_rounded(inter),
        defaults={**intra.defaults, "inter_node": note},
    )


def _fit_intra_link(
    coll: pd.DataFrame, *, machine: dict[str, Any], base: HardwareProfile | None
) -> LinksTerm:
    groups = coll["group_size"].astype(int)
    ab = F.fit_alpha_beta(coll["op"].tolist(), groups.tolist(), coll["bytes"], coll["t"])
    per_op: dict[str, dict[str, Any]] = {}
    for op in sorted(set(coll["op"])):
        rows = coll[coll["op"] == op]
        if len(rows) >= 2:
            f1 = F.fit_alpha_beta(
                [op] * len(rows), rows["group_size"].astype(int).tolist(), rows["bytes"], rows["t"]
            )
            per_op[str(op)] = {
                "latency_s": f1.latency_s,
                "bandwidth_bytes_per_s": f1.bandwidth_bytes_per_s,
                "quality": f1.quality.to_dict(),
            }
    # Each collective's bandwidth relative to the joint fit (gloo's reduce-scatter is far
    # slower than its all-reduce; NCCL's ops are within a few percent of each other).
    op_eff = {
        _LINK_OPS[op]: v["bandwidth_bytes_per_s"] / ab.bandwidth_bytes_per_s
        for op, v in per_op.items()
        if op in _LINK_OPS
    }
    if base is not None:
        bandwidth = base.intra_node.bandwidth_bytes_per_s
        efficiency = ab.bandwidth_bytes_per_s / bandwidth
        measured: tuple[str, ...] = ("intra_node.latency_s", "intra_node.efficiency")
    else:
        bandwidth, efficiency = ab.bandwidth_bytes_per_s, 1.0
        measured = ("intra_node.latency_s", "intra_node.bandwidth_bytes_per_s")
    if op_eff:
        measured += ("intra_node.op_efficiency",)
    link = _rounded(
        Link(
            bandwidth_bytes_per_s=bandwidth,
            latency_s=ab.latency_s,
            efficiency=efficiency,
            op_efficiency=op_eff,
        )
    )
    record = {
        "form": "t = a_op(n) alpha + b_op(n) S / beta, the ring functions of cost_models.formulas "
        "(all_reduce 2(n-1), 2(n-1)/n; all_gather and reduce_scatter n-1, (n-1)/n; "
        "send_recv 1, 1)",
        "backend": machine.get("backend"),
        "group_sizes": sorted(groups.unique().tolist()),
        "message_bytes": [float(coll["bytes"].min()), float(coll["bytes"].max())],
        "latency_s": ab.latency_s,
        "bandwidth_bytes_per_s": ab.bandwidth_bytes_per_s,
        "quality": ab.quality.to_dict(),
        "quality_as_used": _link_quality_as_used(coll, link).to_dict(),
        "per_op": per_op,
    }
    return LinksTerm(
        intra_node=link, inter_node=link, measured=measured, fits={"intra_node": record}
    )


def _link_quality_as_used(coll: pd.DataFrame, link: Link) -> F.FitQuality:
    """How well the link as the cost model uses it (one latency, each op's bandwidth = the
    achieved bandwidth x its op factor) reproduces every collective measured."""
    predicted = [
        a * link.latency_s + b * s / (link.achieved_bandwidth_bytes_per_s * link.op_factor(o))
        for o, g, s in zip(coll["op"], coll["group_size"].astype(int), coll["bytes"])
        for a, b in [F.collective_coefficients(o, g)]
    ]
    return F.fit_quality(predicted, coll["t"].tolist())


def fit_capacity(
    cdf: pd.DataFrame, *, machine: dict[str, Any], base: HardwareProfile | None, gpus_per_node: int
) -> CapacityTerm:
    """Memory capacity per device and what a process holds before the model."""
    held = (
        cdf[cdf["kind"] == "process_memory"]["bytes"]
        if "bytes" in cdf.columns
        else pd.Series(dtype=float)
    )
    held = held[held.notna()] if len(held) else held
    if str(cdf["device"].iloc[0]) == "cuda":
        capacity = float(
            machine.get("device_memory_bytes") or (base.memory_capacity_bytes if base else 0)
        )
        reserved = (
            base.reserved_memory_bytes if base else (float(held.max()) if len(held) else 0.0)
        )
        defaults = {}
        if base is not None:
            context = f"{float(held.max()) / 2**20:.0f} MiB)" if len(held) else "n/a)"
            defaults["reserved_memory_bytes"] = (
                f"catalog profile {base.name} (CUDA context measured: {context}"
            )
        return CapacityTerm(
            capacity_bytes=capacity,
            reserved_bytes=float(reserved),
            measured=("memory_capacity_bytes",),
            defaults=defaults,
        )
    total = float(machine.get("memory_total_bytes") or 0)
    fits: dict[str, Any] = {
        "memory_capacity": {
            "form": "MemTotal / processes per node (processes share the RAM)",
            "memory_total_bytes": total,
        }
    }
    if len(held):
        fits["reserved_memory"] = {
            "form": "peak VmRSS of a rank after import torch and init_process_group"
        }
    return CapacityTerm(
        capacity_bytes=total / gpus_per_node,
        reserved_bytes=float(held.max()) if len(held) else 0.0,
        measured=("memory_capacity_bytes",) + (("reserved_memory_bytes",) if len(held) else ()),
        fits=fits,
    )


def fit_fp8_term(
    cdf: pd.DataFrame, *, statistic: str, base: HardwareProfile | None, gemm: GemmTerm
) -> GemmTerm:
    """Float8 GEMM ceilings (``torch._scaled_mm``, tensorwise `fp8` and rowwise `fp8_rowwise`
    scales) relative to the fp8 peak: the catalog's datasheet peak, else the fastest measured.
    The shape terms (half_dim, launch) stay those of the bf16/fp32 fit."""
    rows = _measured(cdf, "gemm_fp8", statistic)
    if len(rows) < 3:
        return gemm
    fit = F.fit_gemm(rows["m"], rows["n"], rows["k"], rows["precision"].tolist(), rows["t"])
    rates = fit.rate_flops
    peak = base.peak_flops["fp8"] if base and "fp8" in base.peak_flops else max(rates.values())
    definition = "datasheet fp8 peak of " + base.name if base else "fastest measured fp8 rate"
    return dataclasses.replace(
        gemm,
        peak_flops={**gemm.peak_flops, "fp8": float(peak)},
        gemm=dataclasses.replace(
            gemm.gemm,
            max_efficiency={
                **gemm.gemm.max_efficiency,
                **{p: float(r / peak) for p, r in rates.items()},
            },
        ),
        measured=gemm.measured + tuple(f"gemm.max_efficiency.{p}" for p in sorted(rates)),
        fits={
            **gemm.fits,
            "gemm_fp8": {
                "form": "torch._scaled_mm forward, t = launch + 2mnk / rate * (1 + half_dim "
                "(1/m + 1/n + 1/k)), one rate per scaling; max_efficiency = rate / peak",
                "rate_flops": rates,
                "half_dim": fit.half_dim,
                "peak": float(peak),
                "peak_definition": definition,
                "quality": fit.quality.to_dict(),
            },
        },
    )


def _catalog_precisions(
    gemm: GemmTerm, attention: AttentionTerm, base: HardwareProfile | None
) -> tuple[GemmTerm, AttentionTerm, Term]:
    """Keep the catalog's precisions and GEMM ceilings a GPU did not measure (tf32, fp8 and
    fp8_rowwise when no fp8 GEMM was benchmarked): a calibrated H100 still prices fp8."""
    extra = [p for p in (base.peak_flops if base else ()) if p not in gemm.peak_flops]
    extra_eff = [
        p for p in (base.gemm.max_efficiency if base else ()) if p not in gemm.gemm.max_efficiency
    ]
    if base is None or not (extra or extra_eff):
        return gemm, attention, Term()
    peak = {**gemm.peak_flops, **{p: base.peak_flops[p] for p in extra}}
    max_eff = {**gemm.gemm.max_efficiency, **{p: base.gemm.max_efficiency[p] for p in extra_eff}}
    att = {
        **attention.efficiency,
        **{p: base.attention_efficiency[p] for p in extra if p in base.attention_efficiency},
    }
    return (
        dataclasses.replace(
            gemm,
            peak_flops=peak,
            gemm=dataclasses.replace(gemm.gemm, max_efficiency=max_eff),
        ),
        dataclasses.replace(attention, efficiency=att),
        Term(
            defaults={
                f"precision.{p}": f"not measured: catalog profile {base.name}"
                for p in dict.fromkeys(extra + extra_eff)
            }
        ),
    )


def _sources(machine: dict[str, Any], base: HardwareProfile | None) -> tuple[str, ...]:
    sources = [
        f"[calibration] measured by `autosearch calibrate` on {machine.get('device_name')} "
        f"({machine.get('date')}); fits and fit quality in `calibration`"
    ]
    if base is not None:
        sources += [
            f"[catalog] peaks, nominal bandwidths and unmeasured terms from {base.name}: "
        ] + list(base.sources)
    return tuple(sources)


def _within_schema(data: dict[str, Any], path: str = "") -> dict[str, float]:
    """Clamp, in place, the numbers of a profile dict above their SCHEMA_LIMITS; returns
    {dotted path: value before clamping}."""
    clamped: dict[str, float] = {}
    for key, value in data.items():
        where = f"{path}{key}"
        limit = SCHEMA_LIMITS.get(key) or SCHEMA_LIMITS.get(path.rstrip(".").rsplit(".", 1)[-1])
        if isinstance(value, dict) and key != "calibration":
            clamped.update(_within_schema(value, where + "."))
        elif limit is not None and isinstance(value, float) and value > limit:
            clamped[where] = value
            data[key] = limit
    return clamped


def _rows_used(df: pd.DataFrame, compute_world_size: int) -> pd.DataFrame:
    """The measurements a profile is fitted on: compute of its world size, every collective."""
    return df[(df["world_size"] == compute_world_size) | (df["kind"] == "collective")]


def _rounded(link: Link) -> Link:
    """A link's numbers to 6 significant digits, as calibration has always written them."""
    d = _plain(dataclasses.asdict(link))
    return Link(**d)


def _measured(df: pd.DataFrame, kind: str, statistic: str) -> pd.DataFrame:
    out = df[df["kind"] == kind]
    if "skipped" in out.columns:
        out = out[out["skipped"].isna()]
    col = "time_min_s" if statistic == "min" else "time_s"
    out = out[out[col].notna() & (out[col] > 0)].copy()
    out["t"] = out[col].astype(float)
    return out


def _describe(device: str, machine: dict, gpus_per_node: int, threads: int | None) -> str:
    if device == "cpu":
        return (
            f"{machine.get('host_cpu')} ({machine.get('cpu_cores')} cores), measured as "
            f"{gpus_per_node} process(es) per node with {threads} thread(s) each, gloo between "
            "processes"
        )
    return f"{machine.get('device_name')}, {gpus_per_node} per node, measured with NCCL"


def _fwd_plus_bwd(df: pd.DataFrame, key: list[str], fwd_op: str, bwd_op: str) -> pd.DataFrame:
    """One row per shape with t = forward + backward time (t_fwd, t_bwd kept), flops of the
    forward."""
    if df.empty:
        return df.assign(t_fwd=[], t_bwd=[])
    f = df[df["op"] == fwd_op][key + ["flops", "t"]]
    b = df[df["op"] == bwd_op][key + ["t"]]
    both = f.merge(b, on=key, suffixes=("_fwd", "_bwd"))
    both["t"] = both["t_fwd"] + both["t_bwd"]
    return both


def _bwd_over_fwd(g: pd.DataFrame) -> float | None:
    key = ["precision", "m", "n", "k"]
    f = g[g["op"] == "linear_fwd"].set_index(key)["t"]
    b = g[g["op"] == "linear_bwd"].set_index(key)["t"]
    both = f.index.intersection(b.index)
    return float(np.median(b[both] / f[both])) if len(both) else None


def _skipped(df: pd.DataFrame, kind: str) -> int:
    if "skipped" not in df.columns:
        return 0
    return int(((df["kind"] == kind) & df["skipped"].notna()).sum())


def _plain(obj: Any) -> Any:
    """Numbers and containers YAML can write (no numpy scalars), floats rounded to 6 significant
    digits."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, str):
        return str(obj)  # also str subclasses such as torch.__version__
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        return None if not math.isfinite(x) else float(f"{x:.6g}")
    return obj
