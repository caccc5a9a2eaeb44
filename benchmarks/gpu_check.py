"""One GPU check: everything a first GPU run should show, in one script, within 9 minutes.

Stages (each in its own process with its own timeout; a stage that fails or times out is
recorded and the next one runs):

1. env          torch, CUDA, the GPUs, the profile the catalog gives them (by exact name).
2. train        a small Llama-style model (~0.5 B parameters; GQA, SwiGLU, RMSNorm) trained by
                the Engine through `autosearch validate` under 13 strategies on one GPU (micro-
                batch sizes, every recompute kind, fp16, fp32, torch.compile, float8 tensorwise
                and rowwise under compile), and dp / tp / pp / ZeRO-3 over 2 and 4 GPUs when
                present. First after env: the measurements matter most.
3. calibrate    `autosearch calibrate --quick` over every GPU (fp8 GEMMs included where the GPU
                has them), written as a profile.
4. cuda_tests   `pytest -m cuda` (tests/test_cuda.py): the Engine on cuda:0, gloo on CPU, more
                processes than GPUs, calibration without world size 1, validation on CUDA.
5. engine_tests the single-process Engine tests (test_engine.py, test_engine_parity.py) on cuda:0.
6. summary      measured against predicted step time and peak tensor memory, for the catalog
                profile of this GPU and for the one calibrated in stage 3: MAPE, Spearman of the
                ranking, the regret of the predicted pick, memory error.

`--dry-run` runs every stage on CPU with tiny shapes (gloo, a 2-layer model) and writes the same
files; it is how the script is tested without a GPU.

Run: python benchmarks/gpu_check.py [--dry-run] [--out results/gpu]
Writes OUT/stages.json, OUT/env.json, OUT/logs/<stage>.log, OUT/calibration/, OUT/train/
(validation.csv and each run's log), OUT/measured_vs_predicted.csv, OUT/summary.json and
OUT/summary.md. Needs nothing beyond the README's GPU install (torch's CUDA build and the
project's extras); run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Seconds per stage on a GPU: 9 minutes in all, with room for the process starts.
TIMEOUTS = {"env": 20, "cuda_tests": 75, "calibrate": 70, "train": 300, "engine_tests": 75}
DRY_TIMEOUTS = {"env": 60, "cuda_tests": 120, "calibrate": 300, "train": 600, "engine_tests": 300}


def gpu_model():
    """A small Llama-style model: 8 layers, hidden 2048, 16 heads (8 kv), SwiGLU 5632, 32k vocab,
    2048 tokens: ~0.49 B parameters, ~0.1 s a step of 16 sequences on an H100-class GPU."""
    from autosearch import ModelSpec

    return ModelSpec.load("llama3-8b").scaled(
        name="llama-0.5b-check",
        n_layers=8,
        hidden_size=2048,
        n_heads=16,
        n_kv_heads=8,
        ffn_hidden_size=5632,
        vocab_size=32000,
        seq_len=2048,
    )


def dry_model():
    from autosearch import ModelSpec

    return ModelSpec.load("tiny-gpt").scaled(name="tiny-check", n_layers=2, seq_len=64)


def large_model():
    """Llama 3 8B's layer and vocabulary at 4 layers and 4,096 tokens: ~1.9 B parameters (half
    of them the 128k embedding and output), the GEMM sizes of the models people train."""
    from autosearch import ModelSpec

    return ModelSpec.load("llama3-8b").scaled(name="llama3-8b-4l-check", n_layers=4, seq_len=4096)


def moe_model():
    """Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts of width 768, top 8; 16 heads of 128
    (its 32 heads hold 4,096 wide, which the reference transformer does not build), 4 KV) at 4
    layers, 4,096 tokens and a 32k vocabulary: ~2.5 B parameters (2.4 B of them experts), 256
    rows per expert at one sequence, the regime where grouped GEMMs run below their ceiling."""
    from autosearch import ModelSpec

    return ModelSpec.load("qwen3-30b-a3b").scaled(
        name="qwen3-moe-4l-check", n_layers=4, n_heads=16, vocab_size=32000, seq_len=4096
    )


def one_gpu_strategies(**extra) -> list:
    """Strategies of 8 bf16 sequences on one GPU: micro-batches, recompute kinds, compile, and
    `extra` (name -> Strategy fields) after them."""
    from autosearch import Strategy

    runs = [
        dict(micro_batch_size=1),
        dict(micro_batch_size=2),
        dict(micro_batch_size=4),
        dict(micro_batch_size=4, recompute="full"),
        dict(micro_batch_size=2, recompute="selective_op"),
        dict(micro_batch_size=2, compile=True),
        *extra.values(),
    ]
    return [Strategy(global_batch_size=8, amp="bf16", **fields) for fields in runs]


def moe_strategies() -> list:
    """7 strategies: the one-GPU set and ZeRO-3 (at dp 1 no FSDP2 wrapper applies: the same
    run as none, which the cost model must say too)."""
    return one_gpu_strategies(zero3=dict(micro_batch_size=2, zero_stage=3))


def large_strategies() -> list:
    """8 strategies: the one-GPU set, float8 under compile, op-level SAC under compile."""
    return one_gpu_strategies(
        fp8=dict(micro_batch_size=2, compile=True, fp8="tensorwise"),
        sac=dict(micro_batch_size=4, compile=True, recompute="selective_op"),
    )


def strategies(n_devices: int, *, dry: bool) -> list:
    """At least 8 strategies on one device, and parallel ones over 2 and 4 when present."""
    from autosearch import Strategy

    gbs = 8 if dry else 16
    one = lambda **kw: Strategy(global_batch_size=gbs, **kw)  # noqa: E731
    amp = "fp32" if dry else "bf16"  # 16-bit matmuls are emulated (slow) on many CPUs
    out = [
        one(micro_batch_size=4, amp=amp),
        one(micro_batch_size=2, amp=amp),
        one(micro_batch_size=8, amp=amp),
        one(micro_batch_size=1, amp=amp),
        one(micro_batch_size=4, amp=amp, recompute="full"),
        one(micro_batch_size=4, amp=amp, recompute="full", recompute_num_layers=1),
        one(micro_batch_size=4, amp=amp, recompute="selective"),
        one(micro_batch_size=4, amp=amp, recompute="selective_op"),
        one(micro_batch_size=4, amp="fp16" if not dry else "bf16"),
        one(micro_batch_size=4, amp="fp32" if not dry else "bf16", recompute="full"),
        one(micro_batch_size=4, amp=amp, compile=True),
    ]
    if not dry:  # float8 needs fp8 units (Hopper and later) and torchao; paired with compile,
        # as torchtitan runs it (eager float8 casts are separate kernels)
        out += [
            one(micro_batch_size=4, amp=amp, fp8="tensorwise", compile=True),
            one(micro_batch_size=4, amp=amp, fp8="rowwise", compile=True),
        ]
    if n_devices >= 2:
        out += [
            one(dp=2, micro_batch_size=4, amp=amp),
            one(dp=2, micro_batch_size=4, amp=amp, zero_stage=3),
            one(tp=2, micro_batch_size=4, amp=amp, sequence_parallel=True),
            one(pp=2, micro_batch_size=2, amp=amp, pipeline_schedule="1f1b"),
        ]
    if n_devices >= 4 and not dry:
        out += [one(dp=2, tp=2, micro_batch_size=4, amp=amp, zero_stage=3)]
    return out


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


def run_stage(name: str, cmd: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """One stage in its own process group (all its children end with it), with a timeout."""
    from autosearch.core.processes import ProcessGroup, ProcessTimeout

    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.monotonic()
    status, code = "ok", None
    print(f"[gpu_check] {name} (at most {timeout_s:.0f} s): {' '.join(cmd[:6])} ...", flush=True)
    try:
        with ProcessGroup([cmd], envs=env, cwd=ROOT, logs=[log], timeout_s=timeout_s) as group:
            (ended,) = group.wait()
            code = ended.returncode
            status = "ok" if code == 0 else "failed"
    except ProcessTimeout:
        status = "timeout"
    seconds = round(time.monotonic() - start, 1)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    print(f"[gpu_check] {name}: {status} in {seconds} s {tail[0][:120] if tail else ''}")
    return {"stage": name, "status": status, "exit_code": code, "seconds": seconds,
            "log": str(log.relative_to(out)), "command": [_rel(c) for c in cmd]}  # fmt: skip


def env_stage(out: Path) -> None:
    """Stage 1, in its own process: what this machine is (env.json)."""
    import torch

    from autosearch.core.hardware import profile_for_device
    from autosearch.validation._validate import available_devices, torch_build

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_build": torch_build(),
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "available_devices": available_devices(),
        "cpu": platform.processor() or _cpu_model(),
    }
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        catalog = profile_for_device(names[0])
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpus=names,
            capability=list(torch.cuda.get_device_capability(0)),
            memory_bytes=props.total_memory,
            catalog_profile=catalog.name if catalog else None,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False)
        info["nvidia_smi"] = smi.stdout.splitlines()[:20]
    (out / "env.json").write_text(json.dumps(info, indent=1, default=str))
    print(json.dumps(info, indent=1, default=str))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return "unknown"


def train_stage(
    out: Path, *, dry: bool, profile: str, large: bool = False, moe: bool = False
) -> None:
    """Stage 4, in its own process: the strategies through `autosearch validate`."""
    import torch

    from autosearch.validation import validate

    n = torch.cuda.device_count() if torch.cuda.is_available() and not dry else (2 if dry else 1)
    if dry:
        model, cands = dry_model(), strategies(n, dry=dry)
        if moe:
            from autosearch import ModelSpec
            from autosearch.core.model_spec import MoESpec

            moe_spec = MoESpec(n_experts=4, top_k=2, ffn_hidden_size=128)  # SwiGLU experts
            model = ModelSpec.load("tiny-llama").scaled(
                name="tiny-moe-check", n_layers=2, seq_len=64, moe=moe_spec
            )
    elif moe:
        model, cands = moe_model(), moe_strategies()
    elif large:
        model, cands = large_model(), large_strategies()
    else:
        model, cands = gpu_model(), strategies(n, dry=dry)
    result = validate(
        model,
        cands,
        cluster=f"{profile}:1x{max(1, n)}",
        steps=3 if dry else 5,
        warmup=1 if dry else 2,
        timeout_s=120,  # a compiled run compiles fwd + bwd of a block first
        out=out / "train",
        force=dry,
    )
    (out / "train" / "model.json").write_text(json.dumps(model.to_dict(), indent=1))
    print(result.table[["strategy", "status"]].to_string())


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


def summarize(out: Path, profiles: dict[str, str]) -> dict[str, Any]:
    """Measured against predicted for each profile (name -> profile name or path)."""
    import pandas as pd
    from scipy.stats import spearmanr

    from autosearch import ModelSpec, Strategy
    from autosearch.core.hardware import Cluster
    from cost_models import AnalyticCostModel

    csv = out / "train" / "validation.csv"
    if not csv.exists():
        return {"error": f"{csv} missing: the train stage wrote nothing"}
    table = pd.read_csv(csv)
    model = ModelSpec.from_dict(json.loads((out / "train" / "model.json").read_text()))
    rows = []
    for _, r in table.iterrows():
        row = {k: r.get(k) for k in ("strategy", "world_size", "status", "reason")}
        row.update(
            {
                k: r.get(k)
                for k in (
                    "measured_step_time_s",
                    "measured_peak_memory_bytes",
                    "peak_memory_method",
                )
            }
        )
        fields = [k for k in Strategy.__dataclass_fields__ if k in r and not _missing(r[k])]
        s = Strategy.from_dict({k: r[k] for k in fields})
        for label, prof in profiles.items():
            try:
                cluster = Cluster(gpu=prof, n_nodes=1, gpus_per_node=s.world_size)
                rep = AnalyticCostModel(model, cluster).estimate(s)
            except Exception as exc:  # noqa: BLE001 - a profile that cannot price it: say why
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            tensor = rep.peak_memory_bytes - rep.memory.other_bytes
            row[f"{label}_step_time_s"] = rep.step_time_s
            row[f"{label}_tensor_memory_bytes"] = tensor
            if r.get("status") == "ok":
                row[f"{label}_step_error_pct"] = 100 * (
                    rep.step_time_s / r.measured_step_time_s - 1
                )
                row[f"{label}_memory_error_pct"] = 100 * (
                    tensor / r.measured_peak_memory_bytes - 1
                )
        rows.append(row)
    df = pd.DataFrame(rows)
    df.to_csv(out / "measured_vs_predicted.csv", index=False)
    ok = df[df.status == "ok"]
    summary: dict[str, Any] = {
        "runs": len(df),
        "ok": len(ok),
        "statuses": df.status.value_counts().to_dict(),
        "by_profile": {},
    }
    for label, prof in profiles.items():
        col = f"{label}_step_time_s"
        if col not in ok or ok[col].isna().all():
            continue
        sub = ok[ok[col].notna()]
        step_err = sub[f"{label}_step_error_pct"].abs()
        mem_err = sub[f"{label}_memory_error_pct"]
        rho = spearmanr(sub[col], sub.measured_step_time_s).statistic if len(sub) > 2 else None
        fastest = sub.measured_step_time_s.min()
        pick = sub.loc[sub[col].idxmin()]
        summary["by_profile"][label] = {
            "profile": _rel(prof),
            "trusted": _trusted(prof),
            "runs": int(len(sub)),
            "step_time_mape_pct": round(float(step_err.mean()), 1),
            "step_time_worst_pct": round(float(step_err.max()), 1),
            "spearman": None if rho is None or math.isnan(rho) else round(float(rho), 3),
            "pick": pick.strategy,
            "pick_regret_pct": round(float(100 * (pick.measured_step_time_s / fastest - 1)), 1),
            "memory_error_mean_abs_pct": round(float(mem_err.abs().mean()), 1),
            "memory_error_mean_pct": round(float(mem_err.mean()), 1),
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(_markdown(summary, df, profiles))
    return summary


def _rel(path: str) -> str:
    """A path inside the repository as a relative one (committed results name no machine)."""
    full = os.path.abspath(path)
    return os.path.relpath(full, ROOT) if full.startswith(str(ROOT) + os.sep) else path


def _trusted(profile: str) -> bool | None:
    """A calibrated profile's verdict (`calibration.quality.ok`); None for a datasheet one."""
    from autosearch.core.hardware import HardwareProfile

    quality = (HardwareProfile.load(profile).calibration or {}).get("quality")
    return None if quality is None else bool(quality.get("ok"))


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _markdown(summary: dict[str, Any], df, profiles: dict[str, str]) -> str:
    lines = [
        "# GPU check: measured against predicted",
        "",
        f"{summary['ok']} of {summary['runs']} runs ok ({summary['statuses']}).",
        "",
        "| profile | trusted | runs | step MAPE | worst | Spearman | pick | regret | memory error "
        "(mean, mean of abs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s in summary["by_profile"].items():
        lines.append(
            f"| {label} ({Path(s['profile']).name}) | {s['trusted']} | {s['runs']} | "
            f"{s['step_time_mape_pct']}% | "
            f"{s['step_time_worst_pct']}% | {s['spearman']} | {s['pick']} | "
            f"{s['pick_regret_pct']}% | {s['memory_error_mean_pct']}%, "
            f"{s['memory_error_mean_abs_pct']}% |"
        )
    lines += ["", "| strategy | status | measured step | measured tensor peak | " + " | ".join(
        f"{p} step / memory error" for p in profiles) + " |"]  # fmt: skip
    lines.append("|---|---|---|---|" + "---|" * len(profiles))
    for _, r in df.iterrows():
        cells = [str(r.strategy), str(r.status)]
        if r.status == "ok":
            cells += [f"{r.measured_step_time_s * 1e3:.1f} ms",
                      f"{r.measured_peak_memory_bytes / 2**20:,.0f} MiB"]  # fmt: skip
            for p in profiles:
                se, me = r.get(f"{p}_step_error_pct"), r.get(f"{p}_memory_error_pct")
                cells.append("-" if _missing(se) else f"{se:+.0f}% / {me:+.0f}%")
        else:
            cells += [str(r.reason)[:90].replace("|", "/"), ""] + [""] * len(profiles)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every stage on CPU, tiny shapes")
    p.add_argument("--out", help="output folder (default results/gpu, or results/gpu/dry-run)")
    p.add_argument("--skip", default="", help="stages to skip, comma-separated")
    p.add_argument(
        "--large", action="store_true", help="train Llama 3 8B's layers (4 of them) instead"
    )
    p.add_argument(
        "--moe", action="store_true", help="train Qwen3-30B-A3B's MoE layers (4 of them) instead"
    )
    p.add_argument(
        "--rescore",
        action="store_true",
        help="no run: price OUT's measured runs again with the cost model as it is",
    )
    p.add_argument("--_stage", help=argparse.SUPPRESS)  # run one stage in this process
    p.add_argument("--_profile", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out or ("results/gpu/dry-run" if args.dry_run else "results/gpu")).resolve()
    if args._stage == "env":
        env_stage(out)
        return 0
    if args._stage == "train":
        train_stage(out, dry=args.dry_run, profile=args._profile, large=args.large, moe=args.moe)
        return 0

    if args.rescore:
        env = json.loads((out / "env.json").read_text())
        profiles = {"catalog": env["catalog_profile"]} if env.get("catalog_profile") else {}
        if (out / "calibration" / "gpu.yaml").exists():
            profiles["calibrated"] = str(out / "calibration" / "gpu.yaml")
        print(json.dumps(summarize(out, profiles), indent=1))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    dry, skip = args.dry_run, set(filter(None, args.skip.split(",")))
    timeouts = DRY_TIMEOUTS if dry else TIMEOUTS
    py, me = sys.executable, [sys.executable, str(Path(__file__).resolve())]
    flags = (
        ["--out", str(out)]
        + (["--dry-run"] if dry else [])
        + (["--large"] if args.large else [])
        + (["--moe"] if args.moe else [])
    )
    stages: list[dict[str, Any]] = []

    def stage(name: str, cmd: list[str]) -> dict[str, Any]:
        if name in skip:
            result = {"stage": name, "status": "skipped"}
        else:
            result = run_stage(name, cmd, out, timeouts[name])
        stages.append(result)
        (out / "stages.json").write_text(json.dumps(stages, indent=1))
        return result

    stage("env", me + flags + ["--_stage", "env"])
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    n_gpus = 0 if dry else len(env.get("gpus") or [])
    if not dry and not n_gpus:
        print("[gpu_check] no CUDA GPU visible: run with --dry-run on CPU", file=sys.stderr)
    catalog = env.get("catalog_profile") or ("h100-sxm" if not dry else None)
    fallback = str(ROOT / "results/calibration/example-amd-epyc-2c.yaml")
    stage("train", me + flags + ["--_stage", "train", "--_profile", catalog or fallback])
    calibrated = out / "calibration" / ("cpu.yaml" if dry else "gpu.yaml")
    calibrated.parent.mkdir(parents=True, exist_ok=True)
    world_sizes = "1" if dry else ",".join(str(w) for w in sorted({1, max(1, n_gpus)}))
    stage(
        "calibrate",
        [py, "-m", "autosearch", "calibrate", "--device", "cpu" if dry else "cuda", "--quick"]
        + ["--world-sizes", world_sizes, "--accept-untrusted", "--out", str(calibrated)],
    )
    cuda_tests = [py, "-m", "pytest", "-q", "-rs", "tests/test_cuda.py"]
    if dry:  # the CPU side of the same findings, and the cuda tests collected and skipped
        cuda_tests += ["tests/test_gpu_readiness.py"]
    stage("cuda_tests", cuda_tests + ([] if dry else ["-m", "cuda"]))
    engine_tests = [py, "-m", "pytest", "-q", "-rfE", "tests/test_engine.py"]
    if not dry:  # every single-process Engine test, on cuda:0 (compile, fp8, recompute kinds)
        engine_tests += ["tests/test_engine_parity.py", "-m", "not slow"]
    stage("engine_tests", engine_tests + (["-k", "single_process"] if dry else []))

    profiles = {"calibrated": str(calibrated)} if calibrated.exists() else {}
    if catalog:
        profiles = {"catalog": catalog, **profiles}
    if dry:
        profiles = {"cpu_local": fallback, **profiles}
    start = time.monotonic()
    try:
        summary = summarize(out, profiles)
        status = "ok" if "error" not in summary else "failed"
    except Exception as exc:  # noqa: BLE001 - the stages' files stay; say what went wrong
        summary, status = {"error": f"{type(exc).__name__}: {exc}"}, "failed"
    stages.append(
        {"stage": "summary", "status": status, "seconds": round(time.monotonic() - start, 1)}
    )
    (out / "stages.json").write_text(json.dumps(stages, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"[gpu_check] wrote {out}")
    return 0 if all(s["status"] in ("ok", "skipped") for s in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
