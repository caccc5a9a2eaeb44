"""`autosearch calibrate`: measure this machine into a hardware profile YAML."""

from __future__ import annotations

import argparse
import sys

from autosearch.commands._common import fmt_s
from autosearch.core.errors import SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine (GEMM, memory, attention, collectives) into a hardware profile",
        description="Run microbenchmarks on the device present (CUDA + NCCL, or CPU + gloo), fit "
        "them into the terms of a hardware profile, and write it (usable as --cluster "
        "FILE:1xN). The raw measurements go to a CSV next to it. The measurements are checked "
        "(spread, machine load, "
        "fit quality, physical plausibility); a profile that fails is written as "
        "<out>.untrusted.yaml and the command exits with status 3.",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="device to measure (default: cuda if torch sees one, else cpu)",
    )
    p.add_argument(
        "--world-sizes",
        type=_world_sizes,
        default=None,
        metavar="N,N,...",
        help="process counts to measure, e.g. 1,2 (collectives need 2 or more; "
        "default 1,2 on CPU, 1 and the GPU count on GPU)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small grids and messages (seconds instead of minutes)",
    )
    p.add_argument(
        "--statistic",
        default="median",
        choices=("median", "min"),
        help="statistic of the timed calls of each point (default median)",
    )
    p.add_argument("--name", default=None, help="profile name (default: the --out file name)")
    p.add_argument(
        "--from-csv",
        metavar="CSV",
        help="fit the measurements of an earlier calibration instead of "
        "measuring again (the profile YAML written with it must sit next to it)",
    )
    p.add_argument(
        "--accept-untrusted",
        action="store_true",
        help="write a profile that failed its quality checks under the --out name and exit 0 "
        "(the problems stay in the profile; by default it is written as <out>.untrusted.yaml "
        "and the command exits with status 3)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="on CPU, run world sizes of more than 4 processes per core (refused by default)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="profile YAML to write, e.g. results/calibration/cpu-local.yaml",
    )
    p.set_defaults(func=run)


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (example: 1,2)"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be integers >= 1, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    """Exit status 0 with a trusted profile, 3 when the quality checks failed (the profile is
    written as <out>.untrusted.yaml; 0 with --accept-untrusted), 2 for a user error."""
    from cost_models.calibration.calibrate import calibrate

    try:
        result = calibrate(
            device=args.device,
            world_sizes=args.world_sizes,
            quick=args.quick,
            out=args.out,
            name=args.name,
            statistic=args.statistic,
            from_csv=args.from_csv,
            accept_untrusted=args.accept_untrusted,
            force=args.force,
        )
    except RuntimeError as exc:  # a worker failed: its traceback tail is in the message
        raise SpecError(str(exc)) from None
    print(summary(result.profile))
    for ws, path in sorted(result.variants.items()):
        print(f"variant for {ws} process(es) per node: {path}")
    print(verdict(result))
    if not result.trusted and not args.accept_untrusted:
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
