"""The GEMM tile model against measured per-shape tables: what chose the profiles' `gemm.tiles`
and `gemm.k_overhead_bytes`, and how much better it reads the tables than the smooth curve.

Data: cost_models/data/xla_matmul_perf.csv, a subset of XLA's default matmul performance
tables (H100 `sm_90`: bf16 and fp32 (TF32 kernels); B200 `sm_100`: bf16, fp32 and fp8
e4m3 x e4m3), batch b x m x n x k from 256 to 4,096 (Apache-2.0; the file's header names the
source). For each architecture, the bf16 rows fit, in log time (scipy least squares):

- the tile model (`autosearch.core.gemm_tiles`): a launch time, a large-shape rate, the K
  overhead in bytes, and the efficiency of each tile class relative to the best
  (128x256 / 256x128, 128x128, 64x128 / 128x64, 64x64);
- the smooth curve of the profiles without tiles: launch + 2mnk / rate (1 + d/m + d/n + d/k),
  d free.

The other precisions are then read with the bf16 tile shapes and K bytes, only their rate and
launch refit: how far the shapes carry across dtypes. Reports the mean absolute error of each
model per architecture and precision, and the efficiency each predicts for a few training
shapes (a 2,880-wide layer against a 3,072-wide one), and an independent check of the shipped
Hopper tiles on the GEMMs `autosearch calibrate --quick` measured on an H200.

Run: python benchmarks/gemm_tiles.py   (writes results/gemm_tiles.csv)
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from autosearch.core.gemm_tiles import OPERAND_BYTES, tiled_time_s

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "cost_models" / "data" / "xla_matmul_perf.csv"
SM_COUNT = {"sm_90": 132, "sm_100": 148}  # H100 SXM5, B200 (the profiles' gemm.sm_count)
PEAK = {  # dense peaks of the parts XLA measured (h100-sxm.yaml, b200-sxm.yaml)
    "sm_90": {"bf16": 989.4e12, "fp32": 494.7e12},
    "sm_100": {"bf16": 2250e12, "fp32": 1100e12, "fp8": 4500e12},
}
COLUMN = {"bf16": "bf16_flops_per_s", "fp32": "fp32_flops_per_s", "fp8": "fp8_flops_per_s"}
KEY = {"bf16": "bf16", "fp32": "tf32", "fp8": "fp8"}  # precision keys of the profiles
TILE_CLASSES = (((128, 256), (256, 128)), ((128, 128),), ((64, 128), (128, 64)), ((64, 64),))
SHAPES = [  # (m, n, k): tokens x layer width x hidden, of models in the catalog
    (8192, 2880, 2880),  # gpt-oss: hidden 2,880
    (8192, 3072, 3072),
    (8192, 1280, 8192),  # Llama 3 70B qkv at tp 8
    (8192, 3584, 8192),  # Llama 3 70B fc1 at tp 8
    (8192, 8192, 8192),
]


def tiles_of(effs) -> tuple[tuple[int, int, float], ...]:
    best = max(effs)
    return tuple((tm, tn, float(e / best)) for cls, e in zip(TILE_CLASSES, effs) for tm, tn in cls)


def tile_time(p, rows, sms, tiles, k_bytes, operand_bytes) -> np.ndarray:
    launch, rate = p[0] * 1e-6, p[1] * 1e12
    k0 = k_bytes / operand_bytes
    return np.array(
        [launch + tiled_time_s(b, m, n, k, rate, sms, tiles, k0) for b, m, n, k in rows]
    )


def smooth_time(p, rows) -> np.ndarray:
    launch, rate, d = p[0] * 1e-6, p[1] * 1e12, p[2]
    return np.array(
        [
            launch + 2 * b * m * n * k / rate * (1 + d / (b * m) + d / n + d / k)
            for b, m, n, k in rows
        ]
    )


def tile_residuals(p, *, rows, measured, sms, tiles, k_bytes, operand_bytes) -> np.ndarray:
    return np.log(tile_time(p, rows, sms, tiles, k_bytes, operand_bytes) / measured)


def smooth_residuals(p, *, rows, measured) -> np.ndarray:
    return np.log(smooth_time(p, rows) / measured)


def fit_tiles(rows, measured, sms):
    """Launch (us), rate (TFLOP/s), K overhead (bytes) and the tile classes' efficiencies."""

    def residuals(p):
        return np.log(tile_time(p, rows, sms, tiles_of(p[3:]), p[2], 2) / measured)

    return least_squares(
        residuals,
        [5, 700, 300, 0.9, 0.85, 0.6, 0.5],
        bounds=([0, 10, 0, 0.05, 0.05, 0.05, 0.05], [50, 1e4, 1e4, 1, 1, 1, 1]),
    )


def h200_check() -> list[dict]:
    """An independent check: the shipped h200-sxm tiles (fitted on XLA's H100 table) on the
    GEMMs `autosearch calibrate --quick` measured on an H200 (results/gpu/h200/calibration, 8
    forward shapes per precision, 256-4,096 x 1,024-8,192 x 1,024-8,192), only a rate and a
    launch free; next to the smooth curve with d free and with the profiles' d = 128."""
    from autosearch.core import HardwareProfile

    gemm = HardwareProfile.load("h200-sxm").gemm
    d = pd.read_csv(ROOT / "results" / "gpu" / "h200" / "calibration" / "gpu.csv")
    out = []
    for prec in ("bf16", "fp16"):
        x = d[(d.kind == "gemm") & (d.op == "linear_fwd") & (d.precision == prec)]
        rows = [(1, int(r.m), int(r.n), int(r.k)) for r in x.itertuples()]
        meas = x.time_min_s.to_numpy()
        res_t = functools.partial(
            tile_residuals,
            rows=rows,
            measured=meas,
            sms=gemm.sm_count,
            tiles=gemm.tiles,
            k_bytes=gemm.k_overhead_bytes,
            operand_bytes=2,
        )
        res_s = functools.partial(smooth_residuals, rows=rows, measured=meas)

        def res_128(p, res_s=res_s):
            return res_s([p[0], p[1], 128.0])

        errs = []
        for res, start, bounds in (
            (res_t, [5, 700], ([0, 1], [50, 1e4])),
            (res_s, [5, 700, 128], ([0, 1, 0], [50, 1e4, 1e4])),
            (res_128, [5, 700], ([0, 1], [50, 1e4])),
        ):
            fit = least_squares(res, start, bounds=bounds)
            errs.append(np.abs(np.exp(res(fit.x)) - 1))
        print(
            f"h200 calibration grid, {prec} ({len(rows)} shapes): tile model MAPE "
            f"{errs[0].mean():.1%} (worst {errs[0].max():.1%}) | smooth curve, d free "
            f"{errs[1].mean():.1%} (worst {errs[1].max():.1%}) | smooth curve, d 128 "
            f"{errs[2].mean():.1%} (worst {errs[2].max():.1%})"
        )
        out.append(
            {
                "arch": "h200-calibration",
                "precision": prec,
                "shapes": len(rows),
                "tile_mape": errs[0].mean(),
                "tile_worst": errs[0].max(),
                "smooth_mape": errs[1].mean(),
                "smooth_worst": errs[1].max(),
                "smooth128_mape": errs[2].mean(),
            }
        )
    return out


def main() -> None:
    df = pd.read_csv(TABLE, comment="#")
    out = []
    for arch, sms in SM_COUNT.items():
        d = df[df.arch == arch]
        rows = list(zip(d.b, d.m, d.n, d.k))
        flops = np.array([2.0 * b * m * n * k for b, m, n, k in rows])
        measured = flops / d[COLUMN["bf16"]].to_numpy()

        fit = fit_tiles(rows, measured, sms)
        tiles, k_bytes = tiles_of(fit.x[3:]), float(fit.x[2])
        print(f"{arch}: {sms} SMs; K overhead {k_bytes:.0f} bytes; tiles (relative):")
        print("    tiles: {" + ", ".join(f"{r}x{c}: {e:.2f}" for r, c, e in tiles) + "}")
        for prec in ("bf16", "fp32", "fp8"):
            col = COLUMN[prec]
            sel = d[col].notna().to_numpy()
            if not sel.any():
                continue
            prow = [r for r, s in zip(rows, sel) if s]
            meas = flops[sel] / d[col].to_numpy()[sel]
            ob = OPERAND_BYTES[KEY[prec]]

            res_t = functools.partial(
                tile_residuals,
                rows=prow,
                measured=meas,
                sms=sms,
                tiles=tiles,
                k_bytes=k_bytes,
                operand_bytes=ob,
            )
            res_s = functools.partial(smooth_residuals, rows=prow, measured=meas)
            ft = least_squares(res_t, [5, 500], bounds=([0, 1], [50, 1e4]))
            fs = least_squares(res_s, [5, 500, 128], bounds=([0, 1, 0], [50, 1e4, 1e4]))
            et = np.abs(np.exp(res_t(ft.x)) - 1)
            es = np.abs(np.exp(res_s(fs.x)) - 1)
            peak = PEAK[arch][prec]
            print(
                f"  {prec:5s} {len(prow):3d} shapes  tile model MAPE {et.mean():5.1%} "
                f"(worst {et.max():5.1%}), ceiling {ft.x[1] * 1e12 / peak:.2f} of peak | "
                f"smooth curve MAPE {es.mean():5.1%} (worst {es.max():5.1%}), d {fs.x[2]:.0f}"
            )
            row = {
                "arch": arch,
                "precision": prec,
                "shapes": len(prow),
                "tile_mape": et.mean(),
                "tile_worst": et.max(),
                "smooth_mape": es.mean(),
                "smooth_worst": es.max(),
                "k_overhead_bytes": k_bytes,
                "tiles": " ".join(f"{r}x{c}:{e:.3f}" for r, c, e in tiles),
            }
            for m, n, k in SHAPES:
                f = 2.0 * m * n * k
                t_tile = tile_time(ft.x, [(1, m, n, k)], sms, tiles, k_bytes, ob)[0]
                t_smooth = smooth_time(fs.x, [(1, m, n, k)])[0]
                row[f"tile_eff_{m}x{n}x{k}"] = f / t_tile / peak
                row[f"smooth_eff_{m}x{n}x{k}"] = f / t_smooth / peak
            out.append(row)
        r0 = next(r for r in out if r["arch"] == arch and r["precision"] == "bf16")
        print("  bf16 efficiency of training shapes (tile model / smooth curve):")
        for m, n, k in SHAPES:
            print(
                f"    {m}x{n}x{k}: {r0[f'tile_eff_{m}x{n}x{k}']:.3f} / "
                f"{r0[f'smooth_eff_{m}x{n}x{k}']:.3f}"
            )
    out.extend(h200_check())
    dest = ROOT / "results" / "gemm_tiles.csv"
    pd.DataFrame(out).to_csv(dest, index=False, float_format="%.4g")
    print(f"wrote {dest.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
