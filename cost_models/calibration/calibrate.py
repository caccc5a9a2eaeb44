"""`calibrate()`: measure this machine and write its hardware profile (what `autosearch calibrate` runs).

Example:
    >>> from cost_models.calibration import calibrate
    >>> result = calibrate(device="cpu", world_sizes=[1, 2], quick=True,
    ...                    out="results/calibration/cpu-quick.yaml")       # doctest: +SKIP
    >>> from cost_models import Cluster
    >>> Cluster(gpu=result.profile_path, gpus_per_node=2).world_size       # doctest: +SKIP
    2
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from autosearch.core._io import read_yaml_mapping
from autosearch.core.errors import SpecError
from autosearch.core.hardware import PROFILE_MARKER, HardwareProfile
from cost_models.calibration.profile import build_profile
from cost_models.calibration.runner import (
    _loadavg,
    cpu_cores,
    describe_machine,
    make_plan,
    resolve_device,
    run_microbenchmarks,
)


@dataclass(frozen=True)
class CalibrationResult:
    """What one calibration wrote.

    profile: the main profile (on CPU: the largest world size, i.e. processes per node).
    profile_path: its YAML file.
    variants: on CPU, {processes per node: YAML path} for every other world size measured (a
        process's threads, hence its compute rates, depend on how many share the cores).
    measurements_path: the raw measurements CSV.
    """

    profile: HardwareProfile
    profile_path: str
    measurements_path: str
    measurements: pd.DataFrame = field(repr=False)
    variants: dict[int, str] = field(default_factory=dict)


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
    log: Callable[[str], None] = print,
) -> CalibrationResult:
    """Run the microbenchmarks, fit them, and write `out` (YAML) and the raw CSV next to it.

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
    """
    if statistic not in ("median", "min"):
        raise SpecError(f"statistic must be median or min, got {statistic!r}")
    if not str(out).endswith((".yaml", ".yml")):
        raise SpecError(f"--out must be a .yaml file, got {out!r}")
    name = name or os.path.splitext(os.path.basename(out))[0]
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    stem = os.path.splitext(os.path.abspath(out))[0]
    csv_path = stem + ".csv"
    if from_csv is not None:
        df, machine = _earlier_measurements(from_csv)
        device = str(df["device"].iloc[0])
        world_sizes = sorted(int(w) for w in df["world_size"].dropna().unique())
        log(
            f"calibrate: fitting the measurements of {from_csv} ({len(df)} rows, world sizes {world_sizes})"
        )
    else:
        device = resolve_device(device)
        world_sizes = sorted(set(world_sizes or default_world_sizes(device)))
        _check_world_sizes(device, world_sizes, log)
        machine = describe_machine(device)
        log(
            f"calibrate: {machine['device_name']} ({device}), world sizes {world_sizes}"
            f"{', quick' if quick else ''}; load average {machine['load_average_at_start']}"
        )
        timeout_s = timeout_s if timeout_s is not None else (600.0 if quick else 3600.0)
        df = run_microbenchmarks(
            make_plan(device, quick=quick), world_sizes, timeout_s=timeout_s, log=log
        )
        machine["load_average_at_end"] = _loadavg()
        machine["world_sizes"] = world_sizes
        machine["quick"] = quick
    if os.path.abspath(from_csv or "") != csv_path:
        df.to_csv(csv_path, index=False)
    machine["measurements_csv"] = os.path.basename(csv_path)

    if device == "cuda":
        targets = {
            max(world_sizes): (os.path.abspath(out), name, 1, int(machine.get("device_count", 1)))
        }
    else:
        targets = {}
        for ws in world_sizes:
            main = ws == max(world_sizes)
            path = os.path.abspath(out) if main else f"{stem}-np{ws}.yaml"
            targets[ws] = (path, name if main else f"{name}-np{ws}", ws, ws)
    variants = {ws: t[0] for ws, t in targets.items() if t[0] != os.path.abspath(out)}
    profile = None
    for ws, (path, pname, compute_ws, gpn) in targets.items():
        prof, _ = build_profile(
            df,
            name=pname,
            machine=machine,
            compute_world_size=compute_ws,
            gpus_per_node=gpn,
            statistic=statistic,
        )
        if path == os.path.abspath(out) and variants:
            prof.calibration["variants"] = {
                int(w): os.path.basename(p) for w, p in variants.items()
            }
        write_profile(prof, path)
        log(f"calibrate: wrote {path}")
        if path == os.path.abspath(
            out
        ):  # read back (not through the load cache: the file may be new)
            profile = HardwareProfile.from_dict(
                read_yaml_mapping(path, what="calibrated profile"),
                what=f"calibrated profile {path!r}",
                path=path,
            )
    log(f"calibrate: wrote {csv_path}")
    assert profile is not None
    return CalibrationResult(profile, os.path.abspath(out), csv_path, df, variants)


def _earlier_measurements(csv_path: str) -> tuple[pd.DataFrame, dict]:
    """The measurements CSV of an earlier run and the machine it was measured on (from its YAML)."""
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
            f"--from-csv needs the profile written with it ({yaml_path}) for the machine description"
        )
    machine = dict(
        (read_yaml_mapping(yaml_path, what="calibrated profile").get("calibration") or {}).get(
            "machine"
        )
        or {}
    )
    return df, machine


def _check_world_sizes(device: str, world_sizes: list[int], log: Callable[[str], None]) -> None:
    if not world_sizes or any(w < 1 for w in world_sizes):
        raise SpecError(f"world sizes must be integers >= 1, got {world_sizes}")
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        if max(world_sizes) > n:
            raise SpecError(
                f"world size {max(world_sizes)} needs {max(world_sizes)} GPUs, this machine has {n}; "
                f"pass --world-sizes with values <= {n}"
            )
    elif max(world_sizes) > cpu_cores():
        log(
            f"calibrate: warning: {max(world_sizes)} processes on {cpu_cores()} cores oversubscribe the CPU; "
            "the measurements will show it"
        )


def write_profile(profile: HardwareProfile, path: str) -> None:
    """The profile YAML with a header saying how it was made and which fields are defaults."""
    cal = profile.calibration
    defaults = cal.get("defaults", {})
    machine = cal.get("machine", {})
    lines = [
        f"{PROFILE_MARKER} on {machine.get('date')}.",
        f"# Device: {profile.description}",
        f"# torch {machine.get('torch')}, python {machine.get('python')}, backend {machine.get('backend')}; "
        f"load average {machine.get('load_average_at_start')} -> {machine.get('load_average_at_end')}",
        f"# Measured: {', '.join(profile.measured)}",
        "# Defaults (not measured): "
        + ("; ".join(f"{k}: {v}" for k, v in defaults.items()) or "none"),
        f"# Peak: {cal.get('peak_definition')}",
        f"# Raw measurements: {machine.get('measurements_csv')}; fit forms and quality under `calibration.fits`.",
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n" + profile.to_yaml())
