"""Fidelity on this machine: the cost model's predictions against real runs of the Engine.

1. Calibrate this machine (`autosearch calibrate`, world sizes 1 and 2), unless --profile is given.
2. Run a small GPT for a few steps under each of the strategies below, at world sizes 1 and 2,
   through `autosearch.validation` (torchrun, gloo, the same code `autosearch validate` runs).
3. Compare predicted and measured step time and peak memory per run: per-run error, mean absolute
   percentage error, worst error, Spearman rank correlation, and the regret of the cost model's
   pick (the strategy it predicts fastest) against the best measured one, per world size.
4. Refit the profile's correction terms on half of the runs and report the error on the other
   half (`cost_models.calibration.refit`): what the next search on this machine gains.

Targets (issue 5): step time mean error <= 10%, Spearman >= 0.9, memory error <= 15%, regret <= 5%.

Run: python benchmarks/fidelity_local.py [--profile results/calibration/cpu-local.yaml] [--steps 8]
Writes results/fidelity_local.csv (one row per run) and results/fidelity_local_summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
from scipy.stats import spearmanr

from autosearch import Cluster, ModelSpec, Strategy
from cost_models import AnalyticCostModel

MODEL = ModelSpec.load("tiny-gpt")  # 4 layers, hidden 256, 4 heads, seq 128, vocab 1000
GBS = 16


def sixteen_bit() -> list[Strategy]:
    """16-bit runs: in any search space, and a test of calibration on CPUs where they are slow."""
    return [
        Strategy(global_batch_size=GBS, micro_batch_size=8, amp="bf16"),
        Strategy(dp=2, global_batch_size=GBS, micro_batch_size=8, amp="bf16"),
    ]


def strategies() -> list[Strategy]:
    """Twelve-plus strategies over every mechanism the Engine applies, at world sizes 1 and 2
    (fp32:
    16-bit matmuls are emulated, hence very slow, on CPUs without AVX-512 BF16)."""
    s = lambda **kw: Strategy(global_batch_size=GBS, amp="fp32", **kw)  # noqa: E731
    return [
        # world size 1
        s(micro_batch_size=16),
        s(micro_batch_size=8),
        s(micro_batch_size=4),
        s(micro_batch_size=2),
        s(micro_batch_size=8, recompute="full"),
        s(micro_batch_size=8, recompute="selective"),
        # world size 2
        s(dp=2, micro_batch_size=8),
        s(dp=2, micro_batch_size=2),
        s(dp=2, micro_batch_size=8, zero_stage=1),
        s(dp=2, micro_batch_size=8, zero_stage=2),
        s(dp=2, micro_batch_size=8, zero_stage=3),
        s(tp=2, micro_batch_size=16),
        s(tp=2, micro_batch_size=16, sequence_parallel=True),
        s(pp=2, micro_batch_size=4, pipeline_schedule="1f1b"),
        s(pp=2, micro_batch_size=4, pipeline_schedule="gpipe"),
        s(pp=2, micro_batch_size=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2),
        s(dp=2, micro_batch_size=8, recompute="full"),
    ]


def predict(profile: str, runs: pd.DataFrame) -> pd.DataFrame:
    """Predictions with `profile` for every run (its world size decides the processes per node)."""
    rows = []
    for _, run in runs.iterrows():
        # rows written before a field existed keep its default
        fields = [k for k in Strategy.__dataclass_fields__ if k in run and not _missing(run[k])]
        s = Strategy.from_dict({k: run[k] for k in fields})
        cluster = Cluster(gpu=profile, n_nodes=1, gpus_per_node=s.world_size)
        r = AnalyticCostModel(MODEL, cluster).estimate(s)
        rows.append(
            {
                "predicted_step_time_s": r.step_time_s,
                # tensors only, as measured (the reserve for torch itself is `other`)
                "predicted_peak_memory_bytes": r.peak_memory_bytes - r.memory.other_bytes,
                **{k: v for k, v in r.to_dict().items() if k.startswith("time_")},
                "profile_used": cluster.profile.name,
            }
        )
    return pd.DataFrame(rows, index=runs.index)


def errors(pred: pd.Series, meas: pd.Series) -> pd.Series:
    return 100.0 * (pred / meas - 1.0)


def regret(df: pd.DataFrame, predicted: str) -> dict[int, float]:
    """Per world size: measured step time of the predicted-fastest over the measured best."""
    out = {}
    for ws, g in df.groupby("world_size"):
        pick = g.loc[g[predicted].idxmin()]
        out[int(ws)] = float(pick.measured_step_time_s / g.measured_step_time_s.min() - 1.0)
    return out


def noise_ceiling(df: pd.DataFrame, warmup: int) -> dict:
    """How well any predictor could rank these runs: Spearman and mean difference between the
    medians of the first and second half of each run's measured steps (same run, same code)."""
    halves = []
    for _, run in df.iterrows():
        steps = [float(x) for x in str(run.measured_step_times_s).split(";")][warmup:]
        k = len(steps) // 2
        halves.append((pd.Series(steps[:k]).median(), pd.Series(steps[k:]).median()))
    a, b = zip(*halves)
    a, b = pd.Series(a), pd.Series(b)
    return {
        "spearman_half_vs_half": float(spearmanr(a, b).statistic),
        "mean_abs_diff_half_vs_half_pct": float((100 * (a / b - 1)).abs().mean()),
    }


def summarize(df: pd.DataFrame, predicted: str = "predicted_step_time_s") -> dict:
    err = errors(df[predicted], df.measured_step_time_s).abs()
    mem = errors(df.predicted_peak_memory_bytes, df.measured_peak_memory_bytes).abs()
    rho_all = spearmanr(df[predicted], df.measured_step_time_s).statistic
    rho_ws = {
        int(ws): float(spearmanr(g[predicted], g.measured_step_time_s).statistic)
        for ws, g in df.groupby("world_size")
        if len(g) > 2
    }
    reg = regret(df, predicted)
    return {
        "runs": int(len(df)),
        "step_time_mape_pct": float(err.mean()),
        "step_time_worst_pct": float(err.max()),
        "spearman": float(rho_all),
        "spearman_by_world_size": rho_ws,
        "memory_mape_pct": float(mem.mean()),
        "memory_worst_pct": float(mem.max()),
        "regret_by_world_size": reg,
        "regret_worst": max(reg.values()),
    }


def _missing(value) -> bool:
    return isinstance(value, float) and value != value  # NaN in a CSV cell


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="use this profile instead of calibrating first")
    parser.add_argument("--quick-calibration", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="results/fidelity_local.csv")
    parser.add_argument("--runs-dir", default="results/fidelity_local_runs")
    parser.add_argument(
        "--skip-16bit", action="store_true", help="skip the (slow on AVX2 CPUs) bf16 runs"
    )
    parser.add_argument(
        "--from-runs", help="re-predict the measured runs of an earlier CSV instead of running"
    )
    args = parser.parse_args()

    t0 = time.time()
    profile = args.profile
    if (
        args.from_runs
    ):  # measured runs of an earlier invocation, predicted again (e.g. after a model change)
        if profile is None:
            parser.error("--from-runs needs --profile")
        table = pd.read_csv(args.from_runs)
        return report(args, profile, table, t0)
    if profile is None:
        from autosearch.calibration import calibrate

        profile = "results/calibration/cpu-local.yaml"
        print(f"calibrating this machine into {profile} ...", flush=True)
        calibrate(device="cpu", world_sizes=[1, 2], quick=args.quick_calibration, out=profile)

    from autosearch.validation import validate

    result = validate(
        MODEL,
        strategies(),
        steps=args.steps,
        warmup=args.warmup,
        timeout_s=600,
        out=args.runs_dir,
        threads=None,
    )
    table = result.table
    if not args.skip_16bit:  # slow on CPUs without bf16 units: fewer steps
        slow = validate(
            MODEL, sixteen_bit(), steps=3, warmup=1, timeout_s=900, out=args.runs_dir + "_16bit"
        )
        table = pd.concat([table, slow.table], ignore_index=True)
    return report(args, profile, table, t0)


def report(args, profile: str, table: pd.DataFrame, t0: float) -> int:
    runs = table[table.status == "ok"].copy()
    failed = table[table.status != "ok"]
    for _, f in failed.iterrows():
        print(f"FAILED {f.strategy}: {f.status} {f.reason}")
    runs = runs.drop(
        columns=[
            c
            for c in runs.columns
            if c.startswith(("predicted_", "time_", "refit_"))
            or c in ("profile_used", "step_time_error_pct", "memory_error_pct")
        ]
    )
    runs = runs.join(predict(profile, runs))
    runs["step_time_error_pct"] = errors(runs.predicted_step_time_s, runs.measured_step_time_s)
    runs["memory_error_pct"] = errors(
        runs.predicted_peak_memory_bytes, runs.measured_peak_memory_bytes
    )
    fp32 = runs[runs.amp == "fp32"]
    summary = {
        "profile": profile,
        "model": MODEL.name,
        "global_batch_size": GBS,
        "calibrated": summarize(runs),
        "calibrated_fp32_only": summarize(fp32),
        "noise_ceiling_fp32": noise_ceiling(fp32, args.warmup),
    }

    # Learning from the runs: fit corrections on half of them, judge on the other half.
    from cost_models.calibration.refit import refit_corrections

    refit = refit_corrections(runs, holdout=0.5, group_column="strategy", seed=0)
    runs["refit_predicted_step_time_s"] = refit.predict(runs)
    runs["refit_used_for_fit"] = runs.index.isin(refit.train_index)
    summary["refit"] = {
        "factors": refit.factors,
        "intercept_s": refit.intercept_s,
        "errors": refit.errors,
    }
    held = runs[~runs.refit_used_for_fit]
    summary["refit_held_out"] = (
        summarize(held, "refit_predicted_step_time_s") if len(held) > 2 else None
    )
    summary["wall_s"] = time.time() - t0

    cols = [
        "strategy",
        "world_size",
        "predicted_step_time_s",
        "measured_step_time_s",
        "step_time_error_pct",
        "predicted_peak_memory_bytes",
        "measured_peak_memory_bytes",
        "memory_error_pct",
        "refit_predicted_step_time_s",
        "refit_used_for_fit",
        "measured_peak_rss_bytes",
        "threads",
        "torch_version",
        "profile_used",
    ]
    rest = [c for c in runs.columns if c not in cols]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    runs[cols + rest].to_csv(args.out, index=False)
    Path(args.out).with_name("fidelity_local_summary.json").write_text(
        json.dumps(summary, indent=2, default=float)
    )

    pd.set_option("display.width", 200)
    show = runs[
        [
            "strategy",
            "world_size",
            "predicted_step_time_s",
            "measured_step_time_s",
            "step_time_error_pct",
            "predicted_peak_memory_bytes",
            "measured_peak_memory_bytes",
            "memory_error_pct",
        ]
    ].copy()
    for c in ("predicted_peak_memory_bytes", "measured_peak_memory_bytes"):
        show[c] = show[c] / 2**20
    show = show.rename(
        columns={
            "predicted_peak_memory_bytes": "pred_MiB",
            "measured_peak_memory_bytes": "meas_MiB",
        }
    )
    print(show.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    c = summary["calibrated"]
    print(
        f"\ncalibrated profile: step time MAPE {c['step_time_mape_pct']:.1f}% (target <= 10),"
        f" worst {c['step_time_worst_pct']:.1f}%; Spearman {c['spearman']:.3f} (target >= 0.9);"
        f" memory MAPE {c['memory_mape_pct']:.1f}% (target <= 15), worst"
        f" {c['memory_worst_pct']:.1f}%; regret"
        f" { {k: round(v * 100, 1) for k, v in c['regret_by_world_size'].items()} }% (target <= 5)"
    )
    c = summary["calibrated_fp32_only"]
    n = summary["noise_ceiling_fp32"]
    print(
        f"fp32 runs only: step time MAPE {c['step_time_mape_pct']:.1f}%, Spearman"
        f" {c['spearman']:.3f}, regret"
        f" { {k: round(v * 100, 1) for k, v in c['regret_by_world_size'].items()} }%; noise"
        " ceiling (first vs second half of each run's steps): Spearman"
        f" {n['spearman_half_vs_half']:.3f}, mean difference"
        f" {n['mean_abs_diff_half_vs_half_pct']:.1f}%"
    )
    e = refit.errors
    print(
        "refit on half the runs: factors"
        f" {', '.join(f'{k} {v:.2f}' for k, v in refit.factors.items())}, overhead"
        f" {refit.intercept_s * 1e3:.1f} ms; held-out MAPE"
        f" {e['holdout_before']['mape'] * 100:.1f}% -> {e['holdout_after']['mape'] * 100:.1f}%"
    )
    print(f"wrote {args.out} ({summary['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
