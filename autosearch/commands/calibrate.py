"""`autosearch calibrate`: measure this machine into a hardware profile YAML."""

from __future__ import annotations

import argparse
import sys

from autosearch.calibration._config import CalibrateConfig
from autosearch.commands._common import check_text, fmt_s
from autosearch.commands._schema import add_flags, read_args
from autosearch.core.errors import SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine (GEMM, memory, attention, collectives) into a hardware profile",
        description="Run microbenchmarks on the device present (CUDA + NCCL, or CPU + gloo), fit "
        "them into the terms of a hardware profile, and write it (usable as --cluster "
        "FILE:1xN). The raw measurements go to a CSV next to it, and the profile records the "
        "machine it measured (CPU model, cores, ISA flags; GPU name and count). The load is "
        "read before measuring (a loaded machine is warned about). The measurements are "
        "checked (spread, machine load, fit quality, physical plausibility); a profile that "
        "fails is written as <out>.untrusted.yaml and the command exits with status 3.",
    )
    add_flags(p, CalibrateConfig)
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read the settings from a YAML file (keys as the flags; flags given here override "
        "it)",
    )
    p.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> CalibrateConfig:
    """The CalibrateConfig of a command line: the --config file's settings, overridden by the
    flags given; --out is required, here or in the file."""
    from autosearch.core._io import read_yaml_mapping

    data = None
    if args.config is not None:
        data = read_yaml_mapping(check_text(args.config, "--config"), what="config")
    values, _ = read_args(args, [CalibrateConfig], data=data, what=f"--config {args.config!r}")
    if "out" not in values:
        raise SpecError(
            "calibrate needs --out (the profile YAML to write, e.g. "
            "results/calibration/cpu-local.yaml): give the flag, or the key in a --config file"
        )
    return CalibrateConfig(**values)


def run(args: argparse.Namespace) -> int:
    """Exit status 0 with a trusted profile, 3 when the quality checks failed (the profile is
    written as <out>.untrusted.yaml; 0 with --accept-untrusted), 2 for a user error."""
    from autosearch.calibration._calibrate import calibrate

    config = config_from(args)
    try:
        result = calibrate(**config.to_kwargs())
    except RuntimeError as exc:  # a worker failed: its traceback tail is in the message
        raise SpecError(str(exc)) from None
    print(summary(result.profile))
    for ws, path in sorted(result.variants.items()):
        print(f"variant for {ws} process(es) per node: {path}")
    print(verdict(result))
    if not result.trusted and not config.accept_untrusted:
        print(
            f"calibrate: REFUSED: the measurements failed {len(result.problems)} check(s); "
            f"written as {result.profile_path} so that no search uses it. Calibrate again on a "
            "quiet machine, or pass --accept-untrusted to keep it under the --out name.",
            file=sys.stderr,
        )
        return 3
    print(f"use it:    --cluster {result.profile_path}:1x{result.profile.gpus_per_node}")
    return 0


def verdict(result) -> str:
    """The quality checks' verdict, loud: a banner, then every problem and warning."""
    if result.trusted:
        head = "quality   TRUSTED" + (
            f" ({len(result.warnings)} warning(s))" if result.warnings else ": every check passed"
        )
    else:
        bar = "!" * 79
        head = f"{bar}\nquality   UNTRUSTED: {len(result.problems)} problem(s)\n{bar}"
    lines = [head] + [f"  PROBLEM {p}" for p in result.problems]
    if result.warnings:
        lines.append(f"  ({len(result.warnings)} warning(s): the WARNING lines above)")
    return "\n".join(lines)


def summary(profile) -> str:
    """The profile's key numbers and the quality of each fit."""
    cal, fits = profile.calibration, profile.calibration.get("fits", {})
    lines = [
        f"profile   {profile.name}: {profile.description}",
        "peak      "
        + ", ".join(f"{p} {v / 1e12:.3g} TFLOP/s" for p, v in profile.peak_flops.items())
        + f"  ({cal.get('peak_definition')})",
    ]

    def q(d):
        qq = d.get("quality", {})
        worst = qq.get("worst_rel_residual", 0) * 100
        return f"R2(log) {qq.get('r2_log')}, worst {worst:.0f}%, n {qq.get('n_points')}"

    if profile.cache_bytes:
        lines.append(
            f"cache     {profile.cache_bandwidth_bytes_per_s / 1e9:.3g} GB/s for working sets up "
            f"to {profile.cache_bytes / 2**20:.0f} MiB"
        )
    if "gemm" in fits:
        g = profile.gemm
        lines.append(
            "gemm      max_efficiency "
            + ", ".join(f"{p} {v:.3g}" for p, v in g.max_efficiency.items())
            + f"; half_dim {g.half_dim:.3g}; launch {fmt_s(g.launch_s)}   [{q(fits['gemm'])}]"
        )
    if "memory" in fits:
        lines.append(
            f"memory    {profile.achieved_memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s achieved   "
            f"[{q(fits['memory'])}]"
        )
    att = fits.get("attention", {})
    for p, v in profile.attention_efficiency.items():
        if p in att:
            lines.append(f"attention {p} efficiency {v:.3g}   [{q(att[p])}]")
    if "intra_node" in fits:
        link = profile.intra_node
        lines.append(
            f"intra     latency {fmt_s(link.latency_s)}, "
            f"{link.achieved_bandwidth_bytes_per_s / 1e9:.3g} GB/s achieved   "
            f"[{q(fits['intra_node'])}]"
        )
    lines.append(f"launch    {fmt_s(profile.kernel_launch_s)} per op")
    lines.append(f"measured  {', '.join(profile.measured)}")
    defaults = cal.get("defaults", {})
    if defaults:
        lines.append("defaults  " + "; ".join(f"{k}: {v}" for k, v in defaults.items()))
    return "\n".join(lines)
