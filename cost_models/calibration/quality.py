"""Does a calibration deserve trust? It checks its own measurements before a search relies on them.

A profile written by `autosearch calibrate` carries the verdict in `calibration.quality`:
`{ok, problems, warnings, checks}`. A *problem* means the profile must not be trusted (the CLI
exits with status 3 and writes it as `<name>.untrusted.yaml`); a *warning* is printed and kept.
`quality_problems(profile)` is what a search asks before using a profile.

The checks and their thresholds (each message names its check first: `spread:`, `repeats:`,
`load:`, `fit:`, `plausibility:`, `precision:`):

- repeats: every timed point needs at least `MIN_REPEATS` calls (a spread needs several).
- spread: the coefficient of variation (standard deviation / mean) of the timed calls of each
  point. A median of n calls (3-30 here) of a point with variation c is uncertain by about
  1.25 c / sqrt(n): c = 0.15 gives 3-11%, as large as the cost model's own error on this
  machine's runs (~9%). Problem: median CV over the points above `MAX_MEDIAN_CV`, or more than
  `MAX_NOISY_FRACTION` of the points above `NOISY_CV`. On the shared 2-core development VM with
  other jobs keeping 1.0-1.8 of its 2 cores busy, quick calibrations had median CVs of 0.32-0.74;
  no quiet-machine figure yet (the committed calibration predates the spread record).
- load: the CPU time other processes took on the cores the calibration ran on, from /proc/stat
  busy time minus this process tree's own CPU time (getrusage), per world size. A compute
  benchmark that shares its cores runs as much slower as others take: problem above
  `MAX_OTHER_LOAD` of the cores (25% is beyond the ~10% error the cost model has on this
  machine's own runs), warning above `WARN_OTHER_LOAD`. The load average at the start is a warning
  only: it is a decaying average of the minute before.
- fit: R^2 of log time and the worst relative residual of every fit (GEMM, memory, attention
  per precision, each collective). Problem below `MIN_R2` or beyond `MAX_WORST_RESIDUAL` (a
  point predicted 3x off); warning below `WARN_R2` or beyond `WARN_WORST_RESIDUAL`. The quiet
  calibration in results/calibration/ has R^2 >= 0.91 and a worst point 118% off (gloo's
  reduce-scatter) in its fits.
- plausibility: rates against what the device can do. CPU: GEMM FLOP/s per core below the ISA's
  FLOPs per cycle (AVX-512 64 fp32 FLOP/cycle with two FMA units, AVX2+FMA 32, AVX 16, SSE 8;
  16-bit: twice fp32 with avx512_bf16/avx512_fp16, 1024 with AMX) times the clock (the cpufreq
  maximum, else 1.5 x the nominal MHz for turbo, else 6 GHz), and the best precision at least
  `MIN_CPU_FRACTION` of it; DRAM bandwidth positive and below `MAX_CPU_DRAM_PER_CORE` per core.
  GPU with a catalog profile: GEMM, memory and link efficiencies at most `MAX_DATASHEET_FRACTION`
  of the datasheet, and the best GEMM at least `MIN_GPU_GEMM_EFFICIENCY` of it. Both: fused
  attention no faster than the peak, and the GEMM shape term `half_dim` at most `MAX_HALF_DIM`
  (beyond the largest dimension measured, no GEMM reached half its fitted rate).
- precision: each 16-bit precision's GEMM rate relative to fp32. Without native 16-bit matmul
  (avx512_bf16 / amx for bf16, avx512_fp16 / amx_fp16 for fp16), 16-bit runs 10-50x slower on a
  CPU (9.5x and 15x in the committed example-amd-epyc-2c profile): recorded in
  `checks.precision_slowdown` and warned about (the profile's `gemm.max_efficiency` prices it so,
  and a search does not pick it); 16-bit measured faster than fp32 by more than
  `MAX_UNNATIVE_SPEEDUP` without native support is impossible: a problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from cost_models.calibration.machine import UNDER_LOAD_SHARE

MIN_REPEATS = 3
NOISY_CV = 0.5
MAX_MEDIAN_CV = 0.15
MAX_NOISY_FRACTION = 0.25
WARN_MEDIAN_CV = 0.08
MAX_OTHER_LOAD = 0.25
WARN_OTHER_LOAD = UNDER_LOAD_SHARE  # 0.10: what validation calls load too
WARN_LOAD_AVERAGE = 0.5
MIN_R2 = 0.9
WARN_R2 = 0.97
MAX_WORST_RESIDUAL = 2.0
WARN_WORST_RESIDUAL = 0.5
MIN_CPU_FRACTION = 0.02
MAX_CPU_DRAM_PER_CORE = 100e9
MAX_CPU_CACHE_PER_CORE = 1e12
MAX_DATASHEET_FRACTION = 1.0
MAX_HALF_DIM = 1e4
MIN_GPU_GEMM_EFFICIENCY = 0.1
MAX_UNNATIVE_SPEEDUP = 1.25
WARN_SLOWDOWN = 2.0
DEFAULT_MAX_CLOCK_HZ = 6e9
# AMX: one 16x16x32 tile multiply-accumulate (8,192 MACs) per 16 cycles = 1,024 FLOP/cycle/core
# in bf16 or fp16 (Intel Architecture Instruction Set Extensions Programming Reference, AMX).
AMX_FLOPS_PER_CYCLE = 1024.0
TURBO_HEADROOM = 1.5


@dataclass(frozen=True)
class Quality:
    """The verdict on one calibrated profile.

    ok: no problems (warnings allowed).
    problems: why the profile must not be trusted, one message per failed check.
    warnings: what a user should know but does not invalidate the profile.
    checks: the numbers each check looked at (for the record).
    """

    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": list(self.problems),
            "warnings": list(self.warnings),
            "checks": self.checks,
        }


def quality_problems(profile: Any) -> list[str]:
    """Why `profile` (a HardwareProfile) must not be trusted; empty if it may be.

    A profile written by `autosearch calibrate` before calibrations checked themselves (it has a
    calibration record but no `quality`) gets one problem saying so. A datasheet profile (the
    catalog's, with no calibration record) measured nothing and has nothing to check: [].
    """
    cal = getattr(profile, "calibration", None) or {}
    if not cal:
        return []
    quality = cal.get("quality")
    name = getattr(profile, "name", "?")
    if not isinstance(quality, dict):
        return [
            f"quality: calibrated profile {name!r} has no quality record (written before "
            "calibrations checked themselves); refit it with `autosearch calibrate --from-csv "
            "<its CSV> --out <profile>.yaml`, or calibrate again"
        ]
    problems = [str(p) for p in quality.get("problems") or []]
    if not quality.get("ok", False) and not problems:
        problems = [f"quality: calibrated profile {name!r} is marked not ok with no reason"]
    return problems


def assess_quality(
    *,
    rows: pd.DataFrame,
    fits: dict[str, Any],
    machine: dict[str, Any],
    device: str,
    threads_per_process: int | None,
    catalog: Any = None,
    clamped: dict[str, float] | None = None,
) -> Quality:
    """Run every check on the measurements a profile was fitted on.

    Args:
        rows: the measurement rows used (one per point; `time_s`, `reps`, `time_cv`, and the
            `load_*` columns of the world size that measured them where recorded).
        fits: the profile's `calibration.fits` (forms, parameters and fit quality).
        machine: the machine description (`describe_machine`: ISA flags, clock, load average).
        device: "cpu" or "cuda".
        threads_per_process: threads of one measuring process (cores it used, on CPU).
        catalog: the datasheet HardwareProfile matching a GPU, or None.
        clamped: profile fields whose fitted value was beyond what a profile may hold, with
            that value (they were written at the limit).
    """
    problems: list[str] = []
    warnings: list[str] = []
    checks: dict[str, Any] = {}
    for check in (_repeats_and_spread, _load, _fits):
        p, w, c = check(rows=rows, fits=fits, machine=machine)
        problems += p
        warnings += w
        checks.update(c)
    if device == "cpu":
        p, w, c = _cpu_plausibility(fits, machine, threads_per_process or 1)
    else:
        p, w, c = _gpu_plausibility(fits, catalog)
    problems += p
    warnings += w
    checks.update(c)
    problems += _beyond_peak(fits)
    problems += [
        f"plausibility: {field} = {value:.4g} is beyond what a profile may hold; written at the "
        "limit, the fit is not physical"
        for field, value in (clamped or {}).items()
    ]
    p, w, c = _precisions(fits, machine, device)
    return Quality(tuple(problems + p), tuple(warnings + w), _plain({**checks, **c}))


# ---------------------------------------------------------------------------------------------
# The checks: each returns (problems, warnings, the numbers it looked at)
# ---------------------------------------------------------------------------------------------

Check = tuple[list[str], list[str], dict[str, Any]]


def _timed(rows: pd.DataFrame) -> pd.DataFrame:
    out = rows[rows["time_s"].notna()] if "time_s" in rows.columns else rows.iloc[:0]
    if "skipped" in out.columns:
        out = out[out["skipped"].isna()]
    return out


def _repeats_and_spread(*, rows: pd.DataFrame, **_: Any) -> Check:
    timed = _timed(rows)
    problems: list[str] = []
    warnings: list[str] = []
    if "reps" in timed.columns:
        few = timed[timed["reps"].astype(float) < MIN_REPEATS]
        if len(few):
            problems.append(
                f"repeats: {len(few)} of {len(timed)} points were timed fewer than {MIN_REPEATS} "
                "times, too few for a spread; calibrate again with the default time budget"
            )
    if "time_cv" not in timed.columns or timed["time_cv"].isna().all():
        warnings.append(
            "spread: the spread of the timed calls was not recorded (measured before calibrations "
            "recorded it); not checked"
        )
        return problems, warnings, {}
    cv = timed["time_cv"].astype(float)
    cv = cv[cv.notna()]
    median = float(cv.median())
    noisy = float((cv > NOISY_CV).mean())
    by_kind = {str(k): float(g["time_cv"].median()) for k, g in timed.groupby("kind")}
    worst_kind = max(by_kind, key=lambda k: by_kind[k])
    detail = (
        f"median coefficient of variation {median:.2f} over {len(cv)} points "
        f"(worst kind {worst_kind}: {by_kind[worst_kind]:.2f}), {noisy:.0%} of points above "
        f"{NOISY_CV:g}"
    )
    if median > MAX_MEDIAN_CV or noisy > MAX_NOISY_FRACTION:
        problems.append(
            f"spread: the timings scatter too much: {detail} (limits {MAX_MEDIAN_CV:g} and "
            f"{MAX_NOISY_FRACTION:.0%}); calibrate again on a quiet machine"
        )
    elif median > WARN_MEDIAN_CV:
        warnings.append(f"spread: {detail}")
    checks = {
        "spread": {
            "median_cv": median,
            "fraction_above_noisy_cv": noisy,
            "median_cv_by_kind": by_kind,
        }
    }
    return problems, warnings, checks


def _load(*, rows: pd.DataFrame, machine: dict[str, Any], **_: Any) -> Check:
    problems: list[str] = []
    warnings: list[str] = []
    checks: dict[str, Any] = {}
    cores = float(machine.get("cpu_cores") or 1)
    start = machine.get("load_average_at_start")
    if start and float(start[0]) > WARN_LOAD_AVERAGE * cores:
        warnings.append(
            f"load: the load average was {float(start[0]):.2f} on {cores:.0f} core(s) when the "
            "calibration started"
        )
    if "load_other_cores" not in rows.columns or rows["load_other_cores"].isna().all():
        end = machine.get("load_average_at_end")
        warnings.append(
            "load: the CPU time other processes took during the measurements was not recorded "
            f"(measured before calibrations recorded it); load average {start} at the start, "
            f"{end} at the end (the end includes the calibration's own processes)"
        )
        return problems, warnings, checks
    per_ws = (
        rows.groupby("world_size")[["load_other_cores", "load_steal_cores", "load_cores"]]
        .first()
        .dropna(subset=["load_other_cores"])
    )
    checks["load"] = {int(ws): {k: float(v) for k, v in r.items()} for ws, r in per_ws.iterrows()}
    for ws, r in per_ws.iterrows():
        n = float(r["load_cores"]) or cores
        for what, value in (
            ("other processes kept", r["load_other_cores"]),
            ("the hypervisor stole", r["load_steal_cores"]),
        ):
            share = float(value) / n
            text = (
                f"load: {what} {float(value):.2f} of {n:.0f} core(s) busy ({share:.0%}) while "
                f"world size {int(ws)} was measured"
            )
            if share > MAX_OTHER_LOAD:
                problems.append(
                    f"{text} (limit {MAX_OTHER_LOAD:.0%}): the measured rates are too low; "
                    "calibrate again when the machine is quiet"
                )
            elif share > WARN_OTHER_LOAD:
                warnings.append(text)
    return problems, warnings, checks


def _fits(*, fits: dict[str, Any], **_: Any) -> Check:
    """R^2 and worst residual of each fit: GEMM, memory, attention per precision, and each
    collective's own alpha-beta fit. Two fits only warn: the cache bandwidth (used only for
    working sets that fit in the cache) and the links as the cost model uses them (one latency for
    every op: gloo's send/recv latency is half its reduce-scatter's, a limit of the model's form,
    not of the measurements)."""
    fitted: dict[str, dict | None] = {
        "gemm": (fits.get("gemm") or {}).get("quality"),
        "memory": (fits.get("memory") or {}).get("quality"),
    }
    for p, rec in (fits.get("attention") or {}).items():
        if isinstance(rec, dict) and "quality" in rec:
            fitted[f"attention {p}"] = rec["quality"]
    link = fits.get("intra_node") or {}
    for op, rec in (link.get("per_op") or {}).items():
        fitted[f"intra_node {op}"] = rec.get("quality")
    warn_only = {
        "memory cache": ((fits.get("memory") or {}).get("cache") or {}).get("quality"),
        "intra_node as the model uses it": link.get("quality_as_used"),
    }
    problems: list[str] = []
    warnings: list[str] = []
    every = {k: q for k, q in {**fitted, **warn_only}.items() if q}
    for name, q in every.items():
        if q.get("n_points", 0) < 3:
            continue
        r2, worst = float(q["r2_log"]), float(q["worst_rel_residual"])
        text = (
            f"fit: {name}: R^2(log) {r2:.3f}, worst point {worst:.0%} off ({q['n_points']} points)"
        )
        if name in fitted and (r2 < MIN_R2 or worst > MAX_WORST_RESIDUAL):
            problems.append(
                f"{text}; limits R^2 >= {MIN_R2:g}, worst <= {MAX_WORST_RESIDUAL:.0%}: the "
                "measurements do not follow the model's form (noise, or a disturbed run)"
            )
        elif r2 < WARN_R2 or worst > WARN_WORST_RESIDUAL:
            warnings.append(text)
    return problems, warnings, {"fits": every}


def cpu_flops_per_cycle(flags: set[str], precision: str) -> float:
    """Peak FLOPs per cycle and core of a CPU's vector units for a matmul in `precision`
    (2 FMA pipes x lanes x 2; Intel/AMD optimisation manuals)."""
    if "avx512f" in flags:
        fp32 = 64.0
    elif "avx2" in flags and "fma" in flags:
        fp32 = 32.0
    elif "avx" in flags:
        fp32 = 16.0
    else:
        fp32 = 8.0
    if precision == "bf16":
        if "amx_bf16" in flags:
            return AMX_FLOPS_PER_CYCLE
        return 2 * fp32 if "avx512_bf16" in flags else fp32
    if precision == "fp16":
        if "amx_fp16" in flags:
            return AMX_FLOPS_PER_CYCLE
        return 2 * fp32 if "avx512_fp16" in flags else fp32
    return fp32


def native_16bit(flags: set[str], precision: str) -> bool:
    if precision == "bf16":
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    if precision == "fp16":
        return bool(flags & {"avx512_fp16", "amx_fp16"})
    return True


def cpu_flags(machine: dict[str, Any]) -> tuple[set[str], str]:
    """The recorded ISA flags, else what torch's CPU capability (AVX2, AVX512) implies."""
    if machine.get("cpu_flags") is not None:
        return set(machine["cpu_flags"]), "cpu flags"
    cap = str(machine.get("cpu_capability") or "").upper()
    if cap.startswith("AVX512"):
        return {"avx", "fma", "avx2", "avx512f"}, f"torch CPU capability {cap}"
    if cap.startswith("AVX2"):
        return {"avx", "fma", "avx2"}, f"torch CPU capability {cap}"
    return set(), "unknown ISA (assumed SSE)"


def cpu_clock_ceiling_hz(machine: dict[str, Any]) -> tuple[float, str]:
    if machine.get("cpu_max_mhz"):
        return float(machine["cpu_max_mhz"]) * 1e6, "cpufreq maximum"
    if machine.get("cpu_mhz"):
        mhz = float(machine["cpu_mhz"])
        return mhz * 1e6 * TURBO_HEADROOM, f"{mhz:.0f} MHz x {TURBO_HEADROOM:g} turbo headroom"
    return DEFAULT_MAX_CLOCK_HZ, "clock unknown: 6 GHz"


def _cpu_plausibility(fits: dict[str, Any], machine: dict[str, Any], threads: int) -> Check:
    problems: list[str] = []
    warnings: list[str] = []
    flags, isa_source = cpu_flags(machine)
    clock, clock_source = cpu_clock_ceiling_hz(machine)
    rates = (fits.get("gemm") or {}).get("rate_flops") or {}
    ceilings = {p: cpu_flops_per_cycle(flags, p) * clock for p in rates}
    per_core = {p: float(r) / threads for p, r in rates.items()}
    for p, rate in per_core.items():
        if rate > ceilings[p]:
            problems.append(
                f"plausibility: GEMM {p} {rate / 1e9:.3g} GFLOP/s per core is above what this CPU "
                f"can do ({ceilings[p] / 1e9:.0f}: {cpu_flops_per_cycle(flags, p):g} FLOP/cycle "
                f"from {isa_source}, {clock / 1e9:.2f} GHz from {clock_source}): the timing is "
                "broken"
            )
    if per_core:
        best = max(per_core, key=lambda p: per_core[p])
        floor = MIN_CPU_FRACTION * cpu_flops_per_cycle(flags, "fp32") * clock
        if per_core[best] < floor:
            problems.append(
                f"plausibility: the best GEMM rate, {best} {per_core[best] / 1e9:.2f} GFLOP/s per "
                f"core, is below {MIN_CPU_FRACTION:.0%} of what this CPU's vector units allow "
                f"({floor / 1e9:.1f} GFLOP/s): the machine was busy or the BLAS is broken"
            )
    dram = (fits.get("memory") or {}).get("bandwidth_bytes_per_s")
    if dram is not None:
        ceiling = MAX_CPU_DRAM_PER_CORE * threads
        if not 0 < float(dram) <= ceiling:
            problems.append(
                f"plausibility: DRAM bandwidth {float(dram) / 1e9:.1f} GB/s per process is "
                f"outside "
                f"(0, {ceiling / 1e9:.0f}] GB/s ({MAX_CPU_DRAM_PER_CORE / 1e9:.0f} GB/s per core)"
            )
    cache = ((fits.get("memory") or {}).get("cache") or {}).get("bandwidth_bytes_per_s")
    if cache is not None and not 0 < float(cache) <= MAX_CPU_CACHE_PER_CORE * threads:
        problems.append(
            f"plausibility: cache bandwidth {float(cache) / 1e9:.0f} GB/s per process is above "
            f"{MAX_CPU_CACHE_PER_CORE / 1e9:.0f} GB/s per core"
        )
    checks = {
        "plausibility": {
            "isa": sorted(flags),
            "isa_source": isa_source,
            "clock_ceiling_hz": clock,
            "clock_source": clock_source,
            "threads_per_process": threads,
            "gemm_flops_per_core": per_core,
            "gemm_ceiling_flops_per_core": ceilings,
        }
    }
    return problems, warnings, checks


def _gpu_plausibility(fits: dict[str, Any], catalog: Any) -> Check:
    problems: list[str] = []
    rates = (fits.get("gemm") or {}).get("rate_flops") or {}
    if catalog is None:
        return (
            [],
            [
                "plausibility: no datasheet profile matches this GPU; its rates were not checked "
                "against a peak"
            ],
            {},
        )
    eff = {
        p: float(r) / catalog.peak_flops[p] for p, r in rates.items() if p in catalog.peak_flops
    }
    for p, e in eff.items():
        if e > MAX_DATASHEET_FRACTION:
            problems.append(
                f"plausibility: GEMM {p} reaches {e:.0%} of the {catalog.name} datasheet peak: "
                "above the peak, the timing is broken"
            )
    if eff and max(eff.values()) < MIN_GPU_GEMM_EFFICIENCY:
        problems.append(
            f"plausibility: the best GEMM reaches {max(eff.values()):.0%} of the {catalog.name} "
            f"datasheet peak (at least {MIN_GPU_GEMM_EFFICIENCY:.0%} expected): the GPU was "
            "shared, throttled, or not the one named"
        )
    mem = (fits.get("memory") or {}).get("bandwidth_bytes_per_s")
    if mem is not None:
        m = float(mem) / catalog.memory_bandwidth_bytes_per_s
        if m > MAX_DATASHEET_FRACTION:
            problems.append(
                f"plausibility: memory bandwidth is {m:.0%} of the {catalog.name} datasheet value"
            )
    link = (fits.get("intra_node") or {}).get("bandwidth_bytes_per_s")
    if link is not None:
        lk = float(link) / catalog.intra_node.bandwidth_bytes_per_s
        if lk > MAX_DATASHEET_FRACTION:
            problems.append(
                f"plausibility: intra-node bandwidth is {lk:.0%} of the {catalog.name} datasheet "
                "value"
            )
    return problems, [], {"plausibility": {"datasheet": catalog.name, "gemm_efficiency": eff}}


def _beyond_peak(fits: dict[str, Any]) -> list[str]:
    """Rates above the profile's peak (the best GEMM on a CPU, the datasheet on a GPU) and a GEMM
    shape term beyond every shape measured: the fits of a disturbed run."""
    problems = []
    for p, rec in (fits.get("attention") or {}).items():
        if isinstance(rec, dict) and float(rec.get("efficiency") or 0) > 1.0:
            problems.append(
                f"plausibility: fused attention in {p} runs {float(rec['efficiency']):.3g}x the "
                "peak (the best GEMM rate on a CPU, the datasheet on a GPU): faster than the "
                "peak is impossible, the GEMM measurements were disturbed"
            )
    half_dim = (fits.get("gemm") or {}).get("half_dim")
    if half_dim is not None and float(half_dim) > MAX_HALF_DIM:
        problems.append(
            f"plausibility: the GEMM shape term half_dim = {float(half_dim):.3g} is beyond every "
            f"shape measured (limit {MAX_HALF_DIM:g}): no GEMM reached half its fitted peak, the "
            "fit extrapolated"
        )
    return problems


def _precisions(fits: dict[str, Any], machine: dict[str, Any], device: str) -> Check:
    rates = (fits.get("gemm") or {}).get("rate_flops") or {}
    if "fp32" not in rates:
        return [], [], {}
    problems: list[str] = []
    warnings: list[str] = []
    flags, _ = cpu_flags(machine) if device == "cpu" else (set(), "")
    slowdown = {
        p: float(rates["fp32"]) / float(r) for p, r in rates.items() if p in ("bf16", "fp16")
    }
    for p, s in slowdown.items():
        native = device != "cpu" or native_16bit(flags, p)
        if device == "cpu" and not native and s < 1.0 / MAX_UNNATIVE_SPEEDUP:
            problems.append(
                f"precision: {p} GEMMs measured {1 / s:.1f}x faster than fp32 on a CPU without "
                f"native {p} matmul instructions: impossible, the fp32 measurements were disturbed"
            )
        elif s > WARN_SLOWDOWN:
            warnings.append(
                f"precision: {p} GEMMs run {s:.1f}x slower than fp32 on this "
                f"{'CPU' if device == 'cpu' else 'device'}"
                + (f" (no native {p} matmul instructions)" if not native else "")
                + f"; the profile prices {p} at gemm.max_efficiency {1 / s:.3g} of fp32's, so a "
                "search will not pick it here"
            )
    return problems, warnings, {"precision_slowdown": slowdown}


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(f"{float(obj):.4g}") if np.isfinite(obj) else None
    return obj
