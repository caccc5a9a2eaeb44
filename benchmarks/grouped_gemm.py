"""Grouped GEMMs of mixture-of-experts layers: measured against the cost model's term.

A MoE layer runs its local experts as grouped GEMMs (Megatron-Core ``--moe-grouped-gemm``,
torchtitan and the Engine: ``torch._grouped_mm``), each expert at its own token count: a few
hundred rows per expert at today's expert counts, where a GEMM runs far below its ceiling. The
cost model prices one as one launch plus each group at the profile's efficiency for its shape
(`cost_models.terms.experts.grouped_gemm_s`). This measures the kernel at the expert shapes of
the catalog's MoE models (hidden size h, expert width f) over per-expert token counts m and
local expert counts L, forward and backward, and sets the prediction next to it:

- up:   [L*m, h] x [L, h, 2f]  (gate and up projections fused, as the runtimes run them)
- down: [L*m, f] x [L, f, h]
- loop: the same forward as L separate matmuls (the Engine before it used the grouped kernel)

On a GPU: bf16, CUDA events, the catalog profile of the device and the ``torch`` preset's
kernel efficiency on it. ``--dry-run`` runs a few small fp32 shapes on CPU against the local
calibrated profile: how the script is tested without a GPU.

Run: python benchmarks/grouped_gemm.py [--dry-run] [--out results/gpu/h200]
Writes OUT/grouped_gemm.csv and OUT/grouped_gemm.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Expert shapes (hidden size, expert width) of the catalog's MoE models.
MODELS = (
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "deepseek-v3",
    "gpt-oss-120b",
    "llama4-maverick",
    "mixtral-8x7b",
)
TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # rows per expert
LOCAL = (4, 16)  # experts on one rank (e.g. 128 experts over ep 8 or 32)
MAX_ROWS = 65536  # L x m cap: keeps the sweep under a minute on a GPU


def shapes(dry: bool) -> list[dict]:
    if dry:
        return [
            dict(model="tiny", h=h, f=f, L=L, m=m)
            for h, f in ((64, 32), (128, 96))
            for L in (2, 4)
            for m in (8, 32, 128)
        ]
    from autosearch import ModelSpec

    out = []
    for name in MODELS:
        spec = ModelSpec.load(name)
        assert spec.moe is not None
        h, f = spec.hidden_size, spec.moe.ffn_hidden_size
        out += [
            dict(model=name, h=h, f=f, L=L, m=m)
            for L in LOCAL
            for m in TOKENS
            if L * m <= MAX_ROWS
        ]
    return out


def timer(device: str):
    """A function timing `fn` (seconds per call, median of `reps` after `warmup`)."""
    import torch

    def cuda_time(fn, reps: int = 10, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return sorted(times)[len(times) // 2]

    def cpu_time(fn, reps: int = 5, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    return cuda_time if device == "cuda" else cpu_time


PROJECTIONS = ("up", "down")


def gemm_shape(row, proj: str) -> tuple[int, int]:
    """(k, n) of a projection: up h -> 2f (gate and up fused), down f -> h."""
    return (row["h"], 2 * row["f"]) if proj == "up" else (row["f"], row["h"])


def measure(row: dict, device: str, dtype, time_fn) -> dict:
    """Forward, backward (dX and dW) and the loop's forward of one grouped GEMM, per
    projection."""
    out = {}
    for proj in PROJECTIONS:
        k, n = gemm_shape(row, proj)
        fwd, bwd, loop = _time_one(row["L"], row["m"], k, n, device, dtype, time_fn)
        out.update({f"{proj}_fwd_s": fwd, f"{proj}_bwd_s": bwd, f"{proj}_loop_fwd_s": loop})
    return out


def _time_one(L: int, m: int, k: int, n: int, device: str, dtype, time_fn):
    import torch

    offs = torch.arange(1, L + 1, device=device, dtype=torch.int32) * m
    x = torch.randn(L * m, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(L, k, n, device=device, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        fwd = time_fn(lambda: torch._grouped_mm(x, w, offs=offs))
        loop = time_fn(lambda: [x[e * m : (e + 1) * m] @ w[e] for e in range(L)])
    y = torch._grouped_mm(x, w, offs=offs)
    g = torch.randn_like(y)
    bwd = time_fn(lambda: torch.autograd.grad(y, (x, w), g, retain_graph=True))
    return fwd, bwd, loop


def predict(row: dict, profiles: dict) -> dict:
    """The cost model's forward and backward of the same grouped GEMMs, per profile."""
    from cost_models.terms.experts import GROUPED_TILE_ROWS, grouped_gemm_s

    out = {}
    for label, (prof, key) in profiles.items():
        gemm, peak = prof.gemm, prof.peak_flops[key]
        for proj in PROJECTIONS:
            k, n = gemm_shape(row, proj)
            tile = GROUPED_TILE_ROWS if prof.device_type != "cpu" else 0.0
            fwd = grouped_gemm_s(gemm, row["L"], row["m"], n, k, peak, key, tile)
            out[f"{label}_{proj}_fwd_s"] = fwd
            out[f"{label}_{proj}_bwd_s"] = gemm.backward_over_forward * fwd
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="small fp32 shapes on CPU")
    p.add_argument("--out", help="output folder (default results/gpu/grouped-gemm)")
    p.add_argument(
        "--rescore",
        metavar="DIR",
        help="no measurement: price DIR/grouped_gemm.csv again with the cost model as it is",
    )
    args = p.parse_args(argv)

    import pandas as pd

    from autosearch.core.runtime import RUNTIMES

    if args.rescore:
        return rescore(Path(args.rescore))

    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    if not args.dry_run and dry:
        print("grouped_gemm: no CUDA GPU visible: run with --dry-run on CPU", file=sys.stderr)
        return 2
    out = Path(args.out or ("results/gpu/dry-run" if dry else "results/gpu/grouped-gemm"))
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if dry else "cuda"
    dtype, key = (torch.float32, "fp32") if dry else (torch.bfloat16, "bf16")
    gpu = "cpu" if dry else torch.cuda.get_device_name(0)
    prof = profile_of(gpu)
    if prof is None:
        print(f"grouped_gemm: no catalog profile for {gpu!r}", file=sys.stderr)
        return 2
    profiles = {"profile": (prof, key), "torch": (RUNTIMES["torch"].on(prof), key)}
    time_fn = timer(device)
    rows = []
    start = time.monotonic()
    for row in shapes(dry):
        torch.manual_seed(0)
        try:
            row.update(measure(row, device, dtype, time_fn))
        except Exception as exc:  # noqa: BLE001 - record what the kernel refused, go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        row.update(predict(row, profiles))
        rows.append(row)
        if "error" not in row:
            flops = 2 * row["L"] * row["m"] * row["h"] * 2 * row["f"]
            print(
                f"{row['model']:16s} L={row['L']:2d} m={row['m']:5d}  up fwd "
                f"{row['up_fwd_s'] * 1e6:8.1f} us ({flops / row['up_fwd_s'] / 1e12:6.1f} "
                f"TFLOP/s), predicted {row['profile_up_fwd_s'] * 1e6:8.1f} us; loop "
                f"{row['up_loop_fwd_s'] * 1e6:8.1f} us",
                flush=True,
            )
    df = pd.DataFrame(rows)
    df.to_csv(out / "grouped_gemm.csv", index=False)
    summary = summarize(df, list(profiles), gpu=gpu, precision=key, peak=prof.peak_flops[key])
    summary["seconds"] = round(time.monotonic() - start, 1)
    (out / "grouped_gemm.json").write_text(json.dumps(summary, indent=1))
    (out / "grouped_gemm.md").write_text(markdown(summary))
    print(json.dumps(summary, indent=1))
    return 0


def profile_of(gpu: str):
    """The catalog profile of a GPU (by the driver's name), or this machine's calibrated one."""
    from autosearch.core.hardware import HardwareProfile, profile_for_device

    if gpu == "cpu":
        return HardwareProfile.load(str(ROOT / "results/calibration/example-amd-epyc-2c.yaml"))
    return profile_for_device(gpu)


def rescore(folder: Path) -> int:
    """Prices the measured shapes of `folder` again (the cost model changed, not the GPU)."""
    import pandas as pd

    from autosearch.core.runtime import RUNTIMES

    old = json.loads((folder / "grouped_gemm.json").read_text())
    prof, key = profile_of(old["gpu"]), old["precision"]
    assert prof is not None, f"no catalog profile for {old['gpu']!r}"
    profiles = {"profile": (prof, key), "torch": (RUNTIMES["torch"].on(prof), key)}
    df = pd.read_csv(folder / "grouped_gemm.csv")
    df = pd.DataFrame([{**r, **predict(r, profiles)} for r in df.to_dict("records")])
    df.to_csv(folder / "grouped_gemm.csv", index=False)
    summary = summarize(
        df, list(profiles), gpu=old["gpu"], precision=key, peak=prof.peak_flops[key]
    )
    summary["seconds"] = old.get("seconds")
    (folder / "grouped_gemm.json").write_text(json.dumps(summary, indent=1))
    (folder / "grouped_gemm.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


def summarize(df, labels: list[str], *, gpu: str, precision: str, peak: float) -> dict:
    """Predicted over measured, by per-expert token count: the mean error and MAPE over shapes,
    both projections, forward and backward, per profile."""
    ok = df[df["error"].isna()] if "error" in df else df
    long = []  # one row per (shape, projection, direction)
    for _, r in ok.iterrows():
        for proj in PROJECTIONS:
            k, n = gemm_shape(r, proj)
            for d in ("fwd", "bwd"):
                e = {"m": r.m, "proj": proj, "dir": d, "s": r[f"{proj}_{d}_s"]}
                flops = 2 * r.L * r.m * k * n * (2 if d == "bwd" else 1)  # bwd: dX and dW
                e["efficiency"] = flops / e["s"] / peak
                e["loop_over_grouped"] = r[f"{proj}_loop_fwd_s"] / r[f"{proj}_fwd_s"]
                e.update({lab: r[f"{lab}_{proj}_{d}_s"] / e["s"] - 1 for lab in labels})
                long.append(e)
    import pandas as pd

    t = pd.DataFrame(long)
    fwd = t[t.dir == "fwd"]
    by_m = {}
    for m, g in t.groupby("m"):
        f = fwd[fwd.m == m]
        entry = {
            "fwd_efficiency": round(float(f.efficiency.mean()), 3),
            "bwd_efficiency": round(float(g[g.dir == "bwd"].efficiency.mean()), 3),
            "loop_over_grouped": round(float(f.loop_over_grouped.mean()), 2),
        }
        rows = ok[ok.m == m]
        for lab in labels:
            entry[f"{lab}_mean_error_pct"] = round(100 * float(g[lab].mean()), 1)
            entry[f"{lab}_mape_pct"] = round(100 * float(g[lab].abs().mean()), 1)
            entry[f"{lab}_step_error_pct"] = round(100 * float(_step_error(rows, lab).mean()), 1)
        by_m[int(m)] = entry
    bwd_over_fwd = (
        t[t.dir == "bwd"].s.to_numpy() / fwd.s.to_numpy() if len(t) else float("nan")
    )  # rows alternate fwd, bwd in the same order
    return {
        "gpu": gpu,
        "precision": precision,
        "shapes": int(len(df)),
        "measured": int(len(ok)),
        "backward_over_forward_measured": round(float(pd.Series(bwd_over_fwd).mean()), 2),
        **{f"{lab}_mape_pct": round(100 * float(t[lab].abs().mean()), 1) for lab in labels},
        **{
            f"{lab}_step_mape_pct": round(100 * float(_step_error(ok, lab).abs().mean()), 1)
            for lab in labels
        },
        "by_tokens_per_expert": by_m,
    }


def _step_error(rows, label: str):
    """Predicted over measured time of a shape's whole expert MLP, both projections forward
    and backward (what a training step spends on it), minus 1."""
    cols = [f"{p}_{d}_s" for p in PROJECTIONS for d in ("fwd", "bwd")]
    predicted = sum(rows[f"{label}_{c}"] for c in cols)
    return predicted / sum(rows[c] for c in cols) - 1


def markdown(s: dict) -> str:
    labels = [k[: -len("_step_mape_pct")] for k in s if k.endswith("_step_mape_pct")]
    lines = [
        f"# Grouped GEMMs on {s['gpu']} ({s['precision']}): measured against the cost model",
        "",
        f"{s['measured']} of {s['shapes']} shapes measured. Backward over forward, measured: "
        f"{s['backward_over_forward_measured']}. MAPE over shapes, projections, forward and "
        "backward: " + ", ".join(f"{l} {s[l + '_mape_pct']}%" for l in labels) + "; of the "
        "expert MLP's whole time (both projections, forward and backward): "
        + ", ".join(f"{l} {s[l + '_step_mape_pct']}%" for l in labels)
        + ".",
        "",
        "| rows per expert | fwd efficiency | bwd efficiency | loop / grouped (fwd) | "
        + " | ".join(f"{l}: mean error, MAPE; MLP error" for l in labels)
        + " |",
        "|---|---|---|---|" + "---|" * len(labels),
    ]
    for m, e in s["by_tokens_per_expert"].items():
        cells = [str(m), f"{e['fwd_efficiency']:.3f}", f"{e['bwd_efficiency']:.3f}",
                 f"{e['loop_over_grouped']:.2f}"]  # fmt: skip
        cells += [
            f"{e[l + '_mean_error_pct']:+.1f}%, {e[l + '_mape_pct']:.1f}%; "
            f"{e[l + '_step_error_pct']:+.1f}%"
            for l in labels
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
