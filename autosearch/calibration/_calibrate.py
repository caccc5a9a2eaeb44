"""`calibrate()`: measure this machine and write its hardware profile (`autosearch calibrate`).

Example:
    >>> from autosearch.calibration import calibrate
    >>> result = calibrate(device="cpu", world_sizes=[1, 2], quick=True,
    ...                    out="results/calibration/cpu-quick.yaml")       # doctest: +SKIP
    >>> from autosearch import Cluster
    >>> Cluster(gpu=result.profile_path, gpus_per_node=2).world_size       # doctest: +SKIP
    2
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from autosearch.calibration.runner import (
    cpu_cores,
    describe_machine,
    make_plan,
    resolve_device,
    run_microbenchmarks,
    with_compute_world_size,
)
from autosearch.core._io import read_yaml_mapping
from autosearch.core.errors import SpecError
from autosearch.core.hardware import PROFILE_MARKER, HardwareProfile
from cost_models.calibration.machine import load_average, read_load, recorded_machine
from cost_models.calibration.profile import build_profile


@dataclass(frozen=True)
class CalibrationResult:
    """What one calibration wrote.

    profile: the main profile (on CPU: the largest world size, i.e. processes per node).
    profile_path: its YAML file (`<out>.untrusted.yaml` when the checks failed and the
        calibration was not told to accept that).
    variants: on CPU, {processes per node: YAML path} for every other world size measured (a
        process's threads, hence its compute rates, depend on how many share the cores).
    measurements_path: the raw measurements CSV.
    trusted: every profile written passed the quality checks (`calibration.quality`).
    problems, warnings: of every profile written, each prefixed with the profile's name when
        several were written.
    """

    profile: HardwareProfile
    profile_path: str
    measurements_path: str
    measurements: pd.DataFrame = field(repr=False)
    variants: dict[int, str] = field(default_factory=dict)
    trusted: bool = True
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


UNTRUSTED_SUFFIX = ".untrusted"


def default_world_sizes(device: str) -> list[int]:
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        return sorted({1, n} | {2**i for i in range(1, n.bit_length()) if 2**i <= n})
    return [1, 2] if cpu_cores() >= 2 else [1]


def calibrate(
    *,
    device: str = "auto",
    world_sizes: list[int] | None = None,
    quick: bool = False,
    out: str,
    name: str | None = None,
    statistic: str = "median",
    timeout_s: float | None = None,
    from_csv: str | None = None,
    accept_untrusted: bool = False,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> CalibrationResult:
    """Run the microbenchmarks, fit them, check them, and write `out` (YAML) and the raw CSV
    next to it.

    Every profile carries the verdict of its checks in `calibration.quality` (see
    `cost_models.calibration.quality`). When a check fails, the files are written with
    `.untrusted` before their extension (`cpu.untrusted.yaml`, `cpu.untrusted.csv`), so that
    nothing measured is lost and no search picks them up by the trusted name, and the result
    says `trusted=False`; `accept_untrusted=True` writes them under the names asked for (the
    problems stay in the profile).

    Args:
        device: "auto" (CUDA if torch sees a GPU, else CPU), "cuda" or "cpu".
        world_sizes: process counts to measure (collectives need >= 2); default 1 and 2 on CPU,
            1 and the GPU count (with the powers of two between) on a GPU.
        quick: small grids and message sizes (seconds, for tests and first runs).
        out: path of the profile YAML. The CSV goes to `<out without .yaml>.csv`.
        name: profile name (default: the file name without extension).
        statistic: "median" or "min" of the timed calls of each point.
        timeout_s: limit per world size (default 10 minutes with `quick`, an hour without); a
            worker past it is stopped and the calibration fails with that message.
        from_csv: fit the measurements of an earlier calibration (its CSV; the machine description
            is read from the profile YAML next to it) instead of measuring again.
        accept_untrusted: write a profile that failed its checks under the trusted name.
        force: run world sizes above `MAX_PROCESSES_PER_CORE` processes per CPU core.
    """
    if statistic not in ("median", "min"):
        raise SpecError(f"statistic must be median or min, got {statistic!r}")
    if not str(out).endswith((".yaml", ".yml")):
        raise SpecError(f"--out must be a .yaml file, got {out!r}")
    name = name or os.path.splitext(os.path.basename(out))[0]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    stem = os.path.splitext(os.path.abspath(out))[0]
    if from_csv is not None:
        df, machine = _earlier_measurements(from_csv)
        device = str(df["device"].iloc[0])
        world_sizes = sorted(int(w) for w in df["world_size"].dropna().unique())
        log(
            f"calibrate: fitting the measurements of {from_csv} ({len(df)} rows, "
            f"world sizes {world_sizes})"
        )
    else:
        device = resolve_device(device)
        world_sizes = with_compute_world_size(
            device, sorted(set(world_sizes or default_world_sizes(device))), log
        )
        _check_world_sizes(device, world_sizes, log, force=force)
        machine = describe_machine(device)
        log(
            f"calibrate: {machine['device_name']} ({device}), world sizes {world_sizes}"
            f"{', quick' if quick else ''}; load average {machine['load_average_at_start']}"
        )
        load = read_load()
        machine["other_busy_cores_at_start"] = load.other_cores
        log(f"calibrate: before measuring, {load.describe()}")
        if load.loaded:
            log(
                f"calibrate: WARNING {load.describe()}: the benchmarks share the cores, so the "
                "rates they measure will be too low; if the load lasts, the load check refuses "
                "the profile (calibrate on a quiet machine)"
            )
        timeout_s = timeout_s if timeout_s is not None else (600.0 if quick else 3600.0)
        df = run_microbenchmarks(
            make_plan(device, quick=quick), world_sizes, timeout_s=timeout_s, log=log
        )
        machine["load_average_at_end"] = load_average()
        machine["world_sizes"] = world_sizes
        machine["quick"] = quick

    targets = _targets(device, world_sizes, machine, name)
    try:
        profiles = {
            ws: build_profile(
                df,
                name=pname,
                machine={**machine, "measurements_csv": None},
                compute_world_size=compute_ws,
                gpus_per_node=gpn,
                statistic=statistic,
            )[0]
            for ws, (pname, compute_ws, gpn) in targets.items()
        }
    except Exception as exc:
        kept = stem + UNTRUSTED_SUFFIX + ".csv"
        _write_csv(df, from_csv, kept, log)  # lose nothing measured
        if isinstance(exc, ValueError):  # too few points of a kind: say so, not a traceback
            raise SpecError(
                f"the measurements cannot be fitted into a profile: {exc}; they are kept in "
                f"{from_csv or kept} (world sizes measured: {world_sizes})"
            ) from exc
        raise
    problems, warnings = _verdict(profiles)
    trusted = not problems
    marker = "" if trusted or accept_untrusted else UNTRUSTED_SUFFIX
    csv_path = stem + marker + ".csv"
    _write_csv(df, from_csv, csv_path, log)
    main_ws = max(targets)
    paths = {ws: stem + ("" if ws == main_ws else f"-np{ws}") + marker + ".yaml" for ws in targets}
    variants = {ws: p for ws, p in paths.items() if ws != main_ws}
    for ws, prof in profiles.items():
        prof.calibration["machine"]["measurements_csv"] = os.path.basename(csv_path)
        if not trusted and accept_untrusted:
            prof.calibration["quality"]["accepted_untrusted"] = True
        if ws == main_ws and variants:
            prof.calibration["variants"] = {
                int(w): os.path.basename(p) for w, p in variants.items()
            }
        write_profile(prof, paths[ws])
        log(f"calibrate: wrote {paths[ws]}")
    _log_verdict(problems, warnings, trusted, accept_untrusted, paths[main_ws], log)
    # Read back (not through the load cache: the file may be new).
    path = paths[main_ws]
    profile = HardwareProfile.from_dict(
        read_yaml_mapping(path, what="calibrated profile"),
        what=f"calibrated profile {path!r}",
        path=path,
    )
    return CalibrationResult(
        profile, path, csv_path, df, variants, trusted, tuple(problems), tuple(warnings)
    )


def _targets(
    device: str, world_sizes: list[int], machine: dict, name: str
) -> dict[int, tuple[str, int, int]]:
    """{world size: (profile name, compute world size, devices per node)} of the profiles to
    write: on a GPU one (compute measured on one GPU, links over all); on a CPU one per world
    size, the largest under `name`."""
    if device == "cuda":
        return {max(world_sizes): (name, 1, int(machine.get("device_count", 1)))}
    top = max(world_sizes)
    return {ws: (name if ws == top else f"{name}-np{ws}", ws, ws) for ws in world_sizes}


def _verdict(profiles: dict[int, HardwareProfile]) -> tuple[list[str], list[str]]:
    """Every profile's problems and warnings, each once, prefixed with its profile's name unless
    every profile has it."""
    problems: list[str] = []
    warnings: list[str] = []
    for prof in profiles.values():
        q = prof.calibration["quality"]
        for key, dst in (("problems", problems), ("warnings", warnings)):
            for msg in q[key]:
                everywhere = all(msg in p.calibration["quality"][key] for p in profiles.values())
                text = msg if everywhere else f"{prof.name}: {msg}"
                if text not in dst:
                    dst.append(text)
    return problems, warnings


def _log_verdict(problems, warnings, trusted, accepted, path, log) -> None:
    for msg in warnings:
        log(f"calibrate: WARNING {msg}")
    for msg in problems:
        log(f"calibrate: PROBLEM {msg}")
    if trusted:
        log("calibrate: quality checks passed" + (" (with warnings)" if warnings else ""))
    elif accepted:
        log(
            f"calibrate: UNTRUSTED: {len(problems)} problem(s), written as {path} because "
            "untrusted profiles were accepted; a search that checks quality will refuse it"
        )
    else:
        log(
            f"calibrate: UNTRUSTED: {len(problems)} problem(s); the profile was written as {path} "
            "so that no search uses it (pass --accept-untrusted to write it under the asked name)"
        )


def _write_csv(df: pd.DataFrame, from_csv: str | None, path: str, log) -> None:
    if os.path.abspath(from_csv or "") != path:
        df.to_csv(path, index=False)
        log(f"calibrate: wrote {path}")


def _earlier_measurements(csv_path: str) -> tuple[pd.DataFrame, dict]:
    """The measurements CSV of an earlier run and the machine it was measured on (from the
    profile YAML written with it)."""
    if not os.path.exists(csv_path):
        raise SpecError(f"--from-csv {csv_path!r} does not exist")
    df = pd.read_csv(csv_path)
    if "device" not in df.columns or "world_size" not in df.columns:
        raise SpecError(
            f"{csv_path!r} is not a calibration measurements CSV (no device / world_size columns)"
        )
    yaml_path = os.path.splitext(csv_path)[0] + ".yaml"
    if not os.path.exists(yaml_path):
        raise SpecError(
            f"--from-csv needs the profile written with it ({yaml_path}) for the machine "
            "description"
        )
    machine = dict(
        (read_yaml_mapping(yaml_path, what="calibrated profile").get("calibration") or {}).get(
            "machine"
        )
        or {}
    )
    return df, machine


# On CPU, more processes than this many per core are refused unless forced (as `validate` does):
# a typo such as --world-sizes 100000 would start a burst of processes that swamps the machine.
MAX_PROCESSES_PER_CORE = 4


def _check_world_sizes(
    device: str, world_sizes: list[int], log: Callable[[str], None], *, force: bool = False
) -> None:
    if not world_sizes or any(w < 1 for w in world_sizes):
        raise SpecError(f"world sizes must be integers >= 1, got {world_sizes}")
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        if max(world_sizes) > n:
            raise SpecError(
                f"world size {max(world_sizes)} needs {max(world_sizes)} GPUs, this machine has "
                f"{n}; pass --world-sizes with values <= {n}"
            )
    elif max(world_sizes) > MAX_PROCESSES_PER_CORE * cpu_cores() and not force:
        raise SpecError(
            f"--world-sizes {max(world_sizes)}: {max(world_sizes):,} processes on "
            f"{cpu_cores()} cores is more than {MAX_PROCESSES_PER_CORE} per core; give world "
            f"sizes <= {MAX_PROCESSES_PER_CORE * cpu_cores()}, or pass --force to run them anyway"
        )
    elif max(world_sizes) > cpu_cores():
        log(
            f"calibrate: warning: {max(world_sizes)} processes on {cpu_cores()} cores "
            "oversubscribe the CPU; the measurements will show it"
        )


def write_profile(profile: HardwareProfile, path: str) -> None:
    """The profile YAML with a header saying how it was made and which fields are defaults."""
    cal = profile.calibration
    defaults = cal.get("defaults", {})
    machine = cal.get("machine", {})
    quality = cal.get("quality") or {}
    measured_on = recorded_machine(cal, profile.device_type)
    lines = [
        f"{PROFILE_MARKER} on {machine.get('date')}.",
        f"# Machine: {measured_on.describe() if measured_on else 'not recorded'}",
        f"# Device: {profile.description}",
        f"# torch {machine.get('torch')}, python {machine.get('python')}, backend "
        f"{machine.get('backend')}; load average {machine.get('load_average_at_start')} -> "
        f"{machine.get('load_average_at_end')}",
        f"# Measured: {', '.join(profile.measured)}",
        "# Defaults (not measured): "
        + ("; ".join(f"{k}: {v}" for k, v in defaults.items()) or "none"),
        f"# Peak: {cal.get('peak_definition')}",
        f"# Raw measurements: {machine.get('measurements_csv')}; fit forms and quality under "
        "`calibration.fits`.",
        "# Quality: "
        + ("TRUSTED" if quality.get("ok") else "UNTRUSTED")
        + "".join(f"\n#   problem: {p}" for p in quality.get("problems", []))
        + "".join(f"\n#   warning: {w}" for w in quality.get("warnings", [])),
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n" + profile.to_yaml())
