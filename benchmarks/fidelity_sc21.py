"""Fidelity against published results: SC'21 Table 1 (Narayanan et al. 2021), ten GPT models on
32 to 3,072 A100-SXM4-80GB GPUs.

For every row, the cost model predicts the iteration time of the published configuration (with
the shipped a100-sxm4-80gb profile, one profile for all rows, and the Megatron-LM 2021 runtime
options); the time is converted to TFLOP/s per GPU with the paper's eq. (3), as
benchmarks/reference/README.md explains, and compared with the published figure.

Also measures how many estimates per second one core does.

Run: python benchmarks/fidelity_sc21.py   (writes results/fidelity_sc21.csv)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import pandas as pd

from autosearch import Cluster, ModelSpec, Strategy
from cost_models import AnalyticCostModel, GemmEfficiency, HardwareProfile

HERE = Path(__file__).resolve().parent
TABLE = HERE / "reference" / "sc21_table1.csv"
CATALOG_NAME = {  # SC'21 row id -> catalog model
    "SC21-T1-1.7B": "sc21-gpt-1.7b",
    "SC21-T1-3.6B": "sc21-gpt-3.6b",
    "SC21-T1-7.5B": "sc21-gpt-7.5b",
    "SC21-T1-18.4B": "sc21-gpt-18.4b",
    "SC21-T1-39.1B": "sc21-gpt-39.1b",
    "SC21-T1-76.1B": "sc21-gpt-76.1b",
    "SC21-T1-145.6B": "sc21-gpt-145.6b",
    "SC21-T1-310.1B": "sc21-gpt-310.1b",
    "SC21-T1-529.6B": "sc21-gpt-529.6b",
    "SC21-T1-1008.0B": "sc21-gpt-1008b",
}
PROFILE = "a100-sxm4-80gb"
RUNTIME = "megatron-sc21"


def eq3_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """Narayanan et al. 2021 eq. (3): FLOPs per iteration with full recompute."""
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def row_strategy(row: pd.Series) -> Strategy:
    v = int(row.virtual_stages)
    return Strategy(
        dp=int(row.dp),
        tp=int(row.tp),
        pp=int(row.pp),
        micro_batch_size=int(row.micro_batch_size),
        global_batch_size=int(row.global_batch_size),
        pipeline_schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v,
        recompute=str(row.recompute),
        sequence_parallel=str(row.sequence_parallel).lower() == "true",
        zero_stage=int(row.zero_stage),
        amp=str(row.precision),
    )


def fidelity(profile: "str | HardwareProfile" = PROFILE) -> pd.DataFrame:
    table = pd.read_csv(TABLE)
    profile = HardwareProfile.load(profile)
    rows = []
    for _, row in table.iterrows():
        model = ModelSpec.load(CATALOG_NAME[row.id])
        cluster = Cluster(
            gpu=profile,
            n_nodes=int(row.n_gpus) // int(row.gpus_per_node),
            gpus_per_node=int(row.gpus_per_node),
        )
        strategy = row_strategy(row)
        report = AnalyticCostModel(model, cluster, runtime=RUNTIME).estimate(strategy)
        flops = eq3_flops(
            int(row.global_batch_size),
            model.seq_len,
            model.n_layers,
            model.hidden_size,
            model.vocab_size,
        )
        predicted = flops / (report.step_time_s * int(row.n_gpus)) / 1e12
        published_time = flops / (float(row.published_tflops_per_gpu) * 1e12 * int(row.n_gpus))
        rows.append(
            {
                "id": row.id,
                "model": model.name,
                "n_gpus": int(row.n_gpus),
                "strategy": strategy.short(),
                "published_tflops_per_gpu": float(row.published_tflops_per_gpu),
                "predicted_tflops_per_gpu": predicted,
                "error_pct": (
                    100.0
                    * (predicted - row.published_tflops_per_gpu)
                    / row.published_tflops_per_gpu
                ),
                "published_iteration_s": published_time,
                "predicted_iteration_s": report.step_time_s,
                "predicted_peak_memory_gib": report.peak_memory_bytes / 2**30,
                "fits": report.fits,
                **{k: v for k, v in report.to_dict().items() if k.startswith("time_")},
                "profile": profile.name,
                "runtime": RUNTIME,
            }
        )
    return pd.DataFrame(rows)


def with_gemm(profile: HardwareProfile, max_efficiency: float, half_dim: float) -> HardwareProfile:
    eff = {
        k: max_efficiency if k in ("fp16", "bf16") else v
        for k, v in profile.gemm.max_efficiency.items()
    }
    gemm = GemmEfficiency(max_efficiency=eff, half_dim=half_dim, launch_s=profile.gemm.launch_s)
    return dataclasses.replace(profile, gemm=gemm)


def leave_one_out(profile: "str | HardwareProfile" = PROFILE) -> pd.DataFrame:
    """How much of the agreement comes from choosing the two GEMM constants on this very table.

    The shipped profile's 16-bit GEMM `max_efficiency` and `half_dim` are the only numbers chosen
    against Table 1 (everything else is datasheet or nccl-tests). For each row, pick the pair that
    best fits the other nine (grid search, mean absolute error) and predict the held-out row.
    """
    base = HardwareProfile.load(profile)
    grid = [(e / 100, hd) for e in range(64, 85) for hd in (0, 32, 64, 96, 128, 160, 192, 256)]
    errors = {pair: fidelity(with_gemm(base, *pair)).set_index("id").error_pct for pair in grid}
    rows = []
    for held_out in errors[grid[0]].index:
        best = min(grid, key=lambda pair: errors[pair].drop(held_out).abs().mean())
        rows.append(
            {
                "id": held_out,
                "max_efficiency": best[0],
                "half_dim": best[1],
                "held_out_error_pct": errors[best][held_out],
            }
        )
    return pd.DataFrame(rows)


def estimates_per_second(seconds: float = 2.0) -> float:
    """Throughput of AnalyticCostModel.estimate on one core, over a varied set of strategies."""
    model = ModelSpec.load("llama3-70b")
    cluster = Cluster.parse("h100-sxm:32x8")
    cm = AnalyticCostModel(model, cluster)
    strategies = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            for mb in (1, 2, 4):
                for rc in ("none", "selective", "full"):
                    for zero in (0, 1, 2, 3):
                        strategies.append(
                            Strategy(
                                dp=256 // (tp * pp),
                                tp=tp,
                                pp=pp,
                                micro_batch_size=mb,
                                global_batch_size=1024,
                                recompute=rc,
                                zero_stage=zero,
                            )
                        )
    rates = []
    for validate in (False, True):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            for s in strategies:
                cm.estimate(s, validate=validate)
            n += len(strategies)
        rates.append(n / (time.perf_counter() - start))
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/fidelity_sc21.csv")
    parser.add_argument("--profile", default=PROFILE)
    args = parser.parse_args()
    df = fidelity(args.profile)
    pd.set_option("display.width", 200)
    print(
        df[
            [
                "id",
                "n_gpus",
                "strategy",
                "published_tflops_per_gpu",
                "predicted_tflops_per_gpu",
                "error_pct",
                "predicted_peak_memory_gib",
            ]
        ].to_string(index=False, float_format=lambda x: f"{x:.1f}")
    )
    mape = df.error_pct.abs().mean()
    worst = df.error_pct.abs().max()
    print(
        f"\nmean absolute error {mape:.2f}% (target <= 5%), worst row {worst:.2f}% (target <= 10%)"
    )
    loo = leave_one_out(args.profile)
    print(
        "leave-one-out (GEMM constants refit without the row): mean absolute error"
        f" {loo.held_out_error_pct.abs().mean():.2f}%, worst"
        f" {loo.held_out_error_pct.abs().max():.2f}%"
    )
    df["loo_error_pct"] = loo.held_out_error_pct.values
    rate_raw, rate_validated = estimates_per_second()
    print(
        f"estimates per second on one core: {rate_raw:,.0f} without validation, "
        f"{rate_validated:,.0f} with validation (target >= 20,000)"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    df["mape_pct"] = mape
    df["estimates_per_s"] = rate_raw
    df["estimates_per_s_validated"] = rate_validated
    df.to_csv(args.out, index=False)
    print(f"wrote {args.out}")
    return 0 if mape <= 5 and worst <= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
