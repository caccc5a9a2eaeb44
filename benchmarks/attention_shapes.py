"""Fused attention by shape against measured tables: what chose the profiles' `attention.shapes`,
and how much better it reads the tables than one flat efficiency.

Data: cost_models/data/cudnn_sdpa_training.csv, cudnn-frontend's SDPA training benchmarks
(cuDNN's fused attention, bf16, forward and backward) on H200 (cuDNN 9.19), GB200 and GB300
(cuDNN 9.22) over the attention shapes of Llama 3.1, DeepSeek-V3 / Kimi-K2 (MLA, 192 / 128
heads), gpt-oss (64-wide heads, windows of 128 and 1,024), Qwen3.5 (256) and two video models,
sequences 2,048-75,600, causal and not (MIT; the file's header names the source).

For each GPU and pass, the non-deterministic rows fit, in log time (scipy least squares), the
model of `autosearch.core.attention_kernels`: a plateau, the keys per query at half of it
without a mask and under a causal mask, and a relative efficiency for each head size other
than 128. Which profiles take which GPU's constants: H200 -> every Hopper profile (H100, H200,
H800: the same SMs and peak, the kernels compute-bound), GB200 -> B200 and GB200, GB300 -> B300
and GB300 (Blackwell Ultra doubles the exponent units, which the softmax uses: its plateau is
higher). Reports the mean and worst absolute error in time of the fit, of the profiles' shipped
constants, and of the flat efficiency the profiles had before (`attention.kernels.cudnn`, the
backward at 2.5x the forward's time), and what each predicts for a few training shapes.

Run: python benchmarks/attention_shapes.py   (writes results/attention_shapes.csv)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from autosearch.core.attention_kernels import REFERENCE_HEAD_DIM, PassShape
from autosearch.core.hardware import HardwareProfile

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "cost_models" / "data" / "cudnn_sdpa_training.csv"
OUT = ROOT / "results" / "attention_shapes.csv"
PROFILE = {"h200": "h200-sxm", "gb200": "gb200-nvl72", "gb300": "gb300-nvl72"}
BWD_OVER_FWD = 2.5  # the backward's FLOPs: dQ, dK, dV and the recomputed scores (the table's)
FLAT_BEFORE = {"h200": 0.50, "gb200": 0.50, "gb300": 0.55}  # kernels.cudnn before the shapes
SHAPES = [  # (name, keys per query, causal, d_qk): layers a training run prices
    ("Llama 3 at 4k", 2048, True, 128),
    ("Llama 3 at 8k", 4096, True, 128),
    ("DeepSeek-V3 at 4k", 2048, True, 192),
    ("gpt-oss window 128", 128, True, 64),
]


def read_table() -> pd.DataFrame:
    d = pd.read_csv(TABLE, comment="#")
    d = d[d.deterministic == 0].copy()
    d["keys"] = np.where(
        d.window > 0, d.window, np.where(d.causal == 1, d.kv_seqlen / 2.0, d.kv_seqlen)
    )
    flops = 2.0 * d.batch * d.heads * d.q_seqlen * d["keys"] * (d.d_qk + d.d_v)
    d["flops"] = np.where(d["pass"] == "bwd", BWD_OVER_FWD * flops, flops)
    d["seconds"] = d.time_ms * 1e-3
    return d


def shape_of(p: np.ndarray, dims: list[int]) -> PassShape:
    return PassShape(p[0], p[1], p[2], tuple(zip(dims, p[3:])))


def predicted_s(shape: PassShape, rows: pd.DataFrame, peak: float) -> np.ndarray:
    eff = [
        shape.efficiency(k, bool(c), int(d))
        for k, c, d in zip(rows["keys"], rows.causal, rows.d_qk)
    ]
    return rows.flops.to_numpy() / (peak * np.array(eff))


def fit(rows: pd.DataFrame, peak: float) -> tuple[PassShape, list[int]]:
    dims = sorted(set(rows.d_qk) - {REFERENCE_HEAD_DIM})

    def residuals(p: np.ndarray) -> np.ndarray:
        return np.log(predicted_s(shape_of(p, dims), rows, peak) / rows.seconds.to_numpy())

    start = [0.6, 300.0, 500.0] + [1.0] * len(dims)
    low = [0.05, 1.0, 1.0] + [0.05] * len(dims)
    high = [1.0, 1e5, 1e5] + [3.0] * len(dims)
    p = least_squares(residuals, start, bounds=(low, high)).x
    return shape_of(p, dims), dims


def main() -> None:
    table = read_table()
    out = []
    for gpu, rows_gpu in table.groupby("gpu"):
        prof = HardwareProfile.load(PROFILE[gpu])
        peak = prof.peak_flops["bf16"]
        shipped = prof.attention_shapes.get("cudnn")
        for pas, rows in rows_gpu.groupby("pass"):
            shape, _ = fit(rows, peak)
            measured = rows.seconds.to_numpy()
            flat = FLAT_BEFORE[gpu]
            flat_s = rows.flops.to_numpy() / (peak * flat)
            models = {"fit": predicted_s(shape, rows, peak), "flat": flat_s}
            if shipped is not None:
                models["shipped"] = predicted_s(getattr(shipped, pas), rows, peak)
            errs = {k: np.abs(v / measured - 1.0) for k, v in models.items()}
            line = f"{gpu:6s} {pas}  n={len(rows):3d}  fit: peak {shape.peak:.3f} keys_half "
            line += f"{shape.keys_half:5.0f} causal {shape.causal_keys_half:5.0f} head_dim "
            line += "{" + ", ".join(f"{d}: {e:.2f}" for d, e in shape.head_dim) + "}"
            print(line)
            for k, e in errs.items():
                mean, worst = 100 * e.mean(), 100 * e.max()
                print(f"        {k:8s} mean |err| {mean:5.1f}%  worst {worst:5.1f}%")
            frame = rows[["gpu", "config", "causal", "window", "q_seqlen", "d_qk", "d_v", "pass"]]
            frame = frame.assign(
                measured_ms=rows.time_ms,
                **{f"{k}_ms": v * 1e3 for k, v in models.items()},
            )
            out.append(frame)
        if shipped is not None:
            print(f"        shipped efficiency ({PROFILE[gpu]}), forward / backward:")
            for name, keys, causal, dq in SHAPES:
                f, b = shipped.efficiencies(keys, causal, dq)
                print(f"          {name:20s} {f:.3f} / {b:.3f}   (flat {FLAT_BEFORE[gpu]:.2f})")
    OUT.parent.mkdir(exist_ok=True)
    pd.concat(out).to_csv(OUT, index=False)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
