"""From measurements to a HardwareProfile: the fits of `fit.py`, and the choices where a machine
publishes no number (numpy/scipy/pandas only; no torch).

What "peak" means:
- GPU whose name matches a catalog profile (H100, H200, A100): the datasheet peak of that profile,
  and max_efficiency = the fitted large-shape GEMM rate / peak.
- CPU (or an unknown GPU): no published peak exists for a virtual machine's share of a CPU, so
  peak_flops is *measured*: the highest fitted large-shape GEMM rate over all precisions (on an AVX2
  CPU, fp32), the same number for every precision, since a CPU has one set of vector units.
  max_efficiency[p] = that precision's fitted rate / peak (1.0 for the best precision; bf16 without
  native bf16 instructions is a small fraction). MFU on such a profile is therefore a fraction of
  the best dense matmul rate this machine reaches, not of a datasheet figure.

Likewise, with no nominal bandwidth (CPU memory in a VM, gloo over loopback), the link and memory
bandwidths are the fitted achieved values with efficiency 1.0; on a GPU with a catalog match they
are the datasheet values with efficiency = fitted / datasheet.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from autosearch.core.hardware import PRECISIONS, HardwareProfile, profile_names
from cost_models.calibration import fit as F

# Streaming arrays count as "in DRAM" when the data touched is at least 4x the last-level cache
# (McCalpin, STREAM run rules).
STREAM_CACHE_FACTOR = 4.0
CATALOG_MATCH = (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-sxm4-{mem}gb"))


def catalog_profile_for(
    device_name: str, memory_bytes: float | None = None
) -> HardwareProfile | None:
    """The shipped profile of a GPU by its name (`NVIDIA H100 80GB HBM3` -> h100-sxm), or None."""
    upper = device_name.upper()
    for key, name in CATALOG_MATCH:
        if key in upper:
            if "{mem}" in name:
                name = name.format(mem=80 if (memory_bytes or 0) > 50e9 else 40)
            if name in profile_names():
                return HardwareProfile.load(name)
    return None


def _measured(df: pd.DataFrame, kind: str, statistic: str) -> pd.DataFrame:
    out = df[df["kind"] == kind]
    if "skipped" in out.columns:
        out = out[out["skipped"].isna()]
    col = "time_min_s" if statistic == "min" else "time_s"
    out = out[out[col].notna() & (out[col] > 0)].copy()
    out["t"] = out[col].astype(float)
    return out


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
    """Fit every term that `df` has measurements for and build the profile.

    Args:
        df: the rows of `run_microbenchmarks` (one per measurement point).
        name: the profile name.
        machine: `describe_machine(...)` (device, software, caches, load).
        compute_world_size: which world size's compute rows to fit (on CPU, processes per node
            change the threads each process has; on a GPU the rows of world size 1).
        gpus_per_node: devices per node in the profile (processes per node on CPU).
        statistic: "median" (default) or "min" of the timed calls of each point.

    Returns:
        (profile, fits): the profile and a dict of every fit (also stored in profile.calibration).
    """
    device = str(df["device"].iloc[0])
    base = (
        catalog_profile_for(machine.get("device_name", ""), machine.get("device_memory_bytes"))
        if device == "cuda"
        else None
    )
    cdf = df[df["world_size"] == compute_world_size]
    measured: list[str] = []
    defaults: dict[str, str] = {}
    fits: dict[str, Any] = {}

    # ---- per-call overhead ---------------------------------------------------------------------
    launch_rows = _measured(cdf, "launch", statistic)
    if len(launch_rows):
        kernel_launch_s = float(launch_rows["t"].median())
        measured.append("kernel_launch_s")
        fits["kernel_launch"] = {
            "form": "median time of a 1-element add, back to back",
            "kernel_launch_s": kernel_launch_s,
        }
    else:
        kernel_launch_s = base.kernel_launch_s if base else 1e-5
        defaults["kernel_launch_s"] = "not measured"

    # ---- GEMM ---------------------------------------------------------------------------------
    g = _measured(cdf, "gemm", statistic)
    if len(g) < 3:
        raise ValueError(
            f"too few GEMM measurements for world size {compute_world_size} ({len(g)})"
        )
    # The cost model charges a GEMM's backward as gemm.backward_over_forward x its forward. The
    # profile takes the measured ratio (F.linear's backward is ~3x its forward on CPU, not 2x), and
    # the shape fit runs on forward + backward per shape with that multiplier, so that the total
    # the model charges is what was measured.
    bwd_ratio = _bwd_over_fwd(g)
    gemm_ratio = bwd_ratio if bwd_ratio else F.GEMM_BWD_OVER_FWD
    total = _fwd_plus_bwd(g, ["precision", "m", "n", "k"], "linear_fwd", "linear_bwd")
    if len(total) >= 3:
        gfit = F.fit_gemm(
            total["m"],
            total["n"],
            total["k"],
            total["precision"].tolist(),
            total["t"],
            multiplier=1.0 + gemm_ratio,
        )
    else:
        gfit = F.fit_gemm(
            g["m"],
            g["n"],
            g["k"],
            g["precision"].tolist(),
            g["t"],
            multiplier=np.where(g["op"] == "linear_bwd", gemm_ratio, 1.0),
        )
    fwd = g[g["op"] == "linear_fwd"]
    fwd_fit = (
        F.fit_gemm(fwd["m"], fwd["n"], fwd["k"], fwd["precision"].tolist(), fwd["t"])
        if len(fwd) >= 3
        else None
    )
    if base is not None:
        peak = {p: base.peak_flops[p] for p in gfit.rate_flops if p in base.peak_flops}
        peak_definition = f"datasheet peak of catalog profile {base.name}"
    else:
        best = max(gfit.rate_flops.values())
        peak = {p: best for p in gfit.rate_flops}
        best_p = max(gfit.rate_flops, key=gfit.rate_flops.get)
        peak_definition = (
            f"measured: the fitted large-shape rate of F.linear in {best_p} (the best precision), "
            "the same for every precision; max_efficiency = each precision's rate / this"
        )
    max_eff = {p: gfit.rate_flops[p] / peak[p] for p in peak}
    measured += [
        "peak_flops" if base is None else "",
        "gemm.max_efficiency",
        "gemm.half_dim",
        "gemm.launch_s",
    ]
    if bwd_ratio:
        measured.append("gemm.backward_over_forward")
    fits["gemm"] = {
        "form": "t_fwd+bwd = (1 + r) (launch + 2mnk / (peak * max_eff[p]) * (1 + half_dim (1/m + 1/n + 1/k))): "
        "F.linear forward + backward (dgrad + wgrad) per shape, r = gemm.backward_over_forward (measured)",
        "rate_flops": gfit.rate_flops,
        "half_dim": gfit.half_dim,
        "launch_s": gfit.launch_s,
        "quality": gfit.quality.to_dict(),
        "quality_by_precision": {p: q.to_dict() for p, q in gfit.quality_by_precision.items()},
        "backward_over_forward_measured": bwd_ratio,
        "backward_over_forward_model": F.GEMM_BWD_OVER_FWD,
        "forward_only": None
        if fwd_fit is None
        else {
            "rate_flops": fwd_fit.rate_flops,
            "half_dim": fwd_fit.half_dim,
            "launch_s": fwd_fit.launch_s,
            "quality": fwd_fit.quality.to_dict(),
        },
        "peak_definition": peak_definition,
        "skipped_shapes": int(_skipped(cdf, "gemm")),
    }

    # ---- memory bandwidth -------------------------------------------------------------------
    mem = _measured(cdf, "memory", statistic)
    llc = (
        machine.get("device_l2_cache_bytes")
        if device == "cuda"
        else machine.get("last_level_cache_bytes")
    )
    llc = float(llc) if llc else 32 * 2**20
    if len(mem):
        dram = mem[mem["bytes"] >= STREAM_CACHE_FACTOR * llc]
        rule = f"footprint >= {STREAM_CACHE_FACTOR:g} x last-level cache ({llc / 2**20:.0f} MiB)"
        if dram["array_bytes"].nunique() < 2:
            sizes = sorted(mem["array_bytes"].unique())[-2:]
            dram = mem[mem["array_bytes"].isin(sizes)]
            rule = "the two largest arrays (none reach 4x the last-level cache)"
        bfit = F.fit_bandwidth(dram["bytes"], dram["t"], launch_s=kernel_launch_s)
        all_q = F.fit_quality(
            kernel_launch_s + mem["bytes"] / bfit.bandwidth_bytes_per_s, mem["t"]
        )
        in_cache = mem[mem["bytes"] <= llc]
        cache_bw = float((in_cache["bytes"] / in_cache["t"]).max()) if len(in_cache) else None
        cache_fit = None
        if device == "cpu" and in_cache["array_bytes"].nunique() >= 2:
            # Working sets that fit in the last-level cache stream several times faster than DRAM;
            # the cost model uses this rate for kernels whose bytes fit (tiny models on a CPU).
            cache_fit = F.fit_bandwidth(in_cache["bytes"], in_cache["t"], launch_s=kernel_launch_s)
            measured.append("memory.cache_bandwidth_bytes_per_s")
        if base is not None:
            mem_bw, mem_eff = (
                base.memory_bandwidth_bytes_per_s,
                bfit.bandwidth_bytes_per_s / base.memory_bandwidth_bytes_per_s,
            )
            measured.append("memory_efficiency")
        else:
            mem_bw, mem_eff = bfit.bandwidth_bytes_per_s, 1.0
            measured.append("memory_bandwidth_bytes_per_s")
        fits["memory"] = {
            "form": "t = kernel_launch_s + bytes / bandwidth, bytes = reads + writes of STREAM copy/add/triad",
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
    else:
        cache_fit = None
        mem_bw = base.memory_bandwidth_bytes_per_s if base else 1e10
        mem_eff = base.memory_efficiency if base else 1.0
        defaults["memory_bandwidth_bytes_per_s"] = "not measured"

    # ---- attention ----------------------------------------------------------------------------
    att = _measured(cdf, "attention", statistic)
    attention_eff: dict[str, float] = {}
    att_total = _fwd_plus_bwd(
        att, ["precision", "batch", "heads", "seq_len", "head_dim"], "sdpa_fwd", "sdpa_bwd"
    )
    # One backward ratio for every precision (the profile has one): the one of the fastest
    # precision, the one a search will pick; the others' efficiencies absorb the difference.
    best_rows = (
        att_total[att_total["precision"] == max(peak, key=lambda p: max_eff.get(p, 0))]
        if len(att_total)
        else att_total
    )
    att_ratio = (
        float(np.median(best_rows["t_bwd"] / best_rows["t_fwd"]))
        if len(best_rows)
        else F.ATTENTION_BWD_OVER_FWD
    )
    fits["attention"] = {
        "form": "t_fwd+bwd = (1 + r) (kernel_launch_s + F / (peak * eff[p])), F = 4 b a s^2 d / 2 "
        "(causal SDPA forward FLOPs); r = attention.backward_over_forward (measured)",
        "backward_over_forward": att_ratio,
    }
    for p in peak:
        rows = att_total[att_total["precision"] == p]
        if len(rows) >= 1:
            afit = F.fit_attention(
                rows["flops"], rows["t"], launch_s=kernel_launch_s, multiplier=1.0 + att_ratio
            )
            attention_eff[p] = afit.rate_flops / peak[p]
            fits["attention"][p] = {
                "rate_flops": afit.rate_flops,
                "efficiency": attention_eff[p],
                "quality": afit.quality.to_dict(),
                "backward_over_forward_measured": float(np.median(rows["t_bwd"] / rows["t_fwd"])),
            }
    if attention_eff:
        measured += ["attention_efficiency", "attention.backward_over_forward"]
    missing_att = [p for p in peak if p not in attention_eff]
    for p in missing_att:  # the GEMM efficiency of the precision, said so
        attention_eff[p] = max_eff[p] * 0.5
        defaults[f"attention_efficiency.{p}"] = "not measured: half the GEMM max_efficiency"

    # ---- collectives: the intra-node link ----------------------------------------------------
    coll = _measured(df, "collective", statistic)
    if len(coll) >= 2:
        ab = F.fit_alpha_beta(
            coll["op"].tolist(), coll["group_size"].astype(int).tolist(), coll["bytes"], coll["t"]
        )
        per_op = {}
        for op, rows in coll.groupby("op"):
            if len(rows) >= 2:
                f1 = F.fit_alpha_beta(
                    [op] * len(rows),
                    rows["group_size"].astype(int).tolist(),
                    rows["bytes"],
                    rows["t"],
                )
                per_op[op] = {
                    "latency_s": f1.latency_s,
                    "bandwidth_bytes_per_s": f1.bandwidth_bytes_per_s,
                    "quality": f1.quality.to_dict(),
                }
        # Each collective's bandwidth relative to the joint fit (gloo's reduce-scatter is far slower
        # than its all-reduce; NCCL's ops are within a few percent of each other).
        op_names = {
            "all_reduce": "all_reduce",
            "all_gather": "all_gather",
            "reduce_scatter": "reduce_scatter",
            "send_recv": "p2p",
        }
        op_eff = {
            op_names[op]: v["bandwidth_bytes_per_s"] / ab.bandwidth_bytes_per_s
            for op, v in per_op.items()
            if op in op_names
        }
        if base is not None:
            intra = {
                "bandwidth_bytes_per_s": base.intra_node.bandwidth_bytes_per_s,
                "latency_s": ab.latency_s,
                "efficiency": ab.bandwidth_bytes_per_s / base.intra_node.bandwidth_bytes_per_s,
            }
            measured += ["intra_node.latency_s", "intra_node.efficiency"]
        else:
            intra = {
                "bandwidth_bytes_per_s": ab.bandwidth_bytes_per_s,
                "latency_s": ab.latency_s,
                "efficiency": 1.0,
            }
            measured += ["intra_node.latency_s", "intra_node.bandwidth_bytes_per_s"]
        if op_eff:
            intra["op_efficiency"] = op_eff
            measured.append("intra_node.op_efficiency")
        fits["intra_node"] = {
            "form": "t = a_op(n) alpha + b_op(n) S / beta, ring coefficients of cost_models.formulas "
            "(all_reduce 2(n-1), 2(n-1)/n; all_gather and reduce_scatter n-1, (n-1)/n; send_recv 1, 1)",
            "backend": machine.get("backend"),
            "group_sizes": sorted(coll["group_size"].astype(int).unique().tolist()),
            "message_bytes": [float(coll["bytes"].min()), float(coll["bytes"].max())],
            "latency_s": ab.latency_s,
            "bandwidth_bytes_per_s": ab.bandwidth_bytes_per_s,
            "quality": ab.quality.to_dict(),
            "per_op": per_op,
        }
    else:
        if base is not None:
            intra = {
                "bandwidth_bytes_per_s": base.intra_node.bandwidth_bytes_per_s,
                "latency_s": base.intra_node.latency_s,
                "efficiency": base.intra_node.efficiency,
            }
            defaults["intra_node"] = (
                f"not measured (world size 1 only): catalog profile {base.name}"
            )
        else:
            intra = {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4, "efficiency": 1.0}
            defaults["intra_node"] = "not measured (world size 1 only): placeholder 1 GB/s, 100 us"
    if base is not None:
        inter = {
            "bandwidth_bytes_per_s": base.inter_node.bandwidth_bytes_per_s,
            "latency_s": base.inter_node.latency_s,
            "efficiency": base.inter_node.efficiency,
        }
        defaults["inter_node"] = f"not measured (one node): catalog profile {base.name}"
    else:
        inter = dict(intra)
        defaults["inter_node"] = "not measured (one node): a copy of intra_node"

    # ---- memory capacity and what a process holds before the model ---------------------------
    held = (
        cdf[cdf["kind"] == "process_memory"]["bytes"]
        if "bytes" in cdf.columns
        else pd.Series(dtype=float)
    )
    held = held[held.notna()] if len(held) else held
    if device == "cuda":
        capacity = float(
            machine.get("device_memory_bytes") or (base.memory_capacity_bytes if base else 0)
        )
        measured.append("memory_capacity_bytes")
        reserved = (
            base.reserved_memory_bytes if base else (float(held.max()) if len(held) else 0.0)
        )
        if base is not None:
            defaults["reserved_memory_bytes"] = (
                f"catalog profile {base.name} (CUDA context measured: "
                + (f"{float(held.max()) / 2**20:.0f} MiB)" if len(held) else "n/a)")
            )
    else:
        total = float(machine.get("memory_total_bytes") or 0)
        capacity = total / gpus_per_node
        measured.append("memory_capacity_bytes")
        reserved = float(held.max()) if len(held) else 0.0
        if len(held):
            measured.append("reserved_memory_bytes")
        fits["memory_capacity"] = {
            "form": "MemTotal / processes per node (processes share the RAM)",
            "memory_total_bytes": total,
        }
        if len(held):
            fits["reserved_memory"] = {
                "form": "peak VmRSS of a rank after import torch and init_process_group"
            }

    extra = [p for p in PRECISIONS if base is not None and p in base.peak_flops and p not in peak]
    for (
        p
    ) in extra:  # keep the catalog's other precisions (e.g. tf32) when a GPU did not measure them
        peak[p] = base.peak_flops[p]
        max_eff[p] = base.gemm.max_efficiency[p]
        attention_eff[p] = base.attention_efficiency.get(p, 0.4)
        defaults[f"precision.{p}"] = f"not measured: catalog profile {base.name}"
    measured = [m for m in measured if m]
    sources = [
        f"[calibration] measured by `autosearch calibrate` on {machine.get('device_name')} "
        f"({machine.get('date')}); fits and fit quality in `calibration`"
    ]
    if base is not None:
        sources += [
            f"[catalog] peaks, nominal bandwidths and unmeasured terms from {base.name}: "
        ] + list(base.sources)
    threads = cdf["threads"].dropna()
    calibration = {
        "tool": "autosearch calibrate",
        "statistic": statistic,
        "device": device,
        "compute_world_size": int(compute_world_size),
        "threads_per_process": int(threads.iloc[0]) if len(threads) else None,
        "machine": _plain(machine),
        "peak_definition": peak_definition,
        "defaults": defaults,
        "fits": _plain(fits),
    }
    calibration = _plain(calibration)
    data = {
        "name": name,
        "description": description
        or _describe(device, machine, gpus_per_node, calibration["threads_per_process"]),
        "device_type": device,
        "sources": sources,
        "gpus_per_node": int(gpus_per_node),
        "peak_flops": {p: float(v) for p, v in peak.items()},
        "memory": {
            "capacity_bytes": float(capacity),
            "bandwidth_bytes_per_s": float(mem_bw),
            "efficiency": float(mem_eff),
            "reserved_bytes": float(reserved),
            **(
                {
                    "cache_bytes": float(llc),
                    "cache_bandwidth_bytes_per_s": float(cache_fit.bandwidth_bytes_per_s),
                }
                if cache_fit is not None
                else {}
            ),
        },
        "intra_node": _plain(intra),
        "inter_node": _plain(inter),
        "gemm": {
            "max_efficiency": {p: float(v) for p, v in max_eff.items()},
            "half_dim": float(gfit.half_dim),
            "launch_s": float(gfit.launch_s),
            "backward_over_forward": float(gemm_ratio),
        },
        "attention": {
            "flash_efficiency": {p: float(v) for p, v in attention_eff.items()},
            "backward_over_forward": float(att_ratio),
        },
        "kernel_launch_s": float(kernel_launch_s),
        "measured": measured,
        "calibration": calibration,
    }
    return HardwareProfile.from_dict(data, what=f"calibrated profile {name!r}"), fits


def _describe(device: str, machine: dict, gpus_per_node: int, threads: int | None) -> str:
    if device == "cpu":
        return (
            f"{machine.get('host_cpu')} ({machine.get('cpu_cores')} cores), measured as {gpus_per_node} "
            f"process(es) per node with {threads} thread(s) each, gloo between processes"
        )
    return f"{machine.get('device_name')}, {gpus_per_node} per node, measured with NCCL"


def _fwd_plus_bwd(df: pd.DataFrame, key: list[str], fwd_op: str, bwd_op: str) -> pd.DataFrame:
    """One row per shape with t = forward + backward time (t_fwd, t_bwd kept), flops of the forward."""
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
    """Numbers and containers YAML can write (no numpy scalars), floats rounded to 6 significant digits."""
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
