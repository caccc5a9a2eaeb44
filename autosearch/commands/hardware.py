"""`autosearch hardware`: the hardware profiles."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hardware", help="list the hardware profiles")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autosearch.core.hardware import HardwareProfile, profile_names

    print(
        f"{'name':<16} {'bf16 TFLOP/s':>12} {'memory':>9} {'HBM TB/s':>8} {'intra GB/s':>10} "
        f"{'inter GB/s':>10} {'per node':>8}"
    )
    for name in profile_names():
        p = HardwareProfile.load(name)
        bf16 = p.peak_flops.get("bf16", p.peak_flops.get("fp32", 0.0))
        print(
            f"{name:<16} {bf16 / 1e12:12.1f} {p.memory_capacity_bytes / 2**30:7.1f}Gi "
            f"{p.memory_bandwidth_bytes_per_s / 1e12:8.2f} "
            f"{p.intra_node.bandwidth_bytes_per_s / 1e9:10.0f} "
            f"{p.inter_node.bandwidth_bytes_per_s / 1e9:10.0f} {p.gpus_per_node:>8}"
        )
    return 0
