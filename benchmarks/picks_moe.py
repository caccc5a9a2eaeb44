"""What `tune` picks for mixture-of-experts models (issue 19 item 8): DeepSeek-V3 (671B) and
Qwen3-235B-A22B on 256 and 1,024 H100s at sequence 4,096, under megatron-core and torchtitan
(and NeMo Automodel, whose DeepSeek-V3 layout is one of the published ones), next to the
published configurations of the same model on the same GPUs (benchmarks/reference/moe_runs.csv)
scored by the same cost model. Each case also lists every published run of the model on that
many H100s at sequence 4,096 (`PUBLISHED`), scored as benchmarks/fidelity_moe.py scores it (its
own batch, precision, recipe and runtime): its published and predicted tokens/s per GPU.

Run: python benchmarks/picks_moe.py   (writes results/picks_moe.json)
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd

from autosearch import Cluster, ModelSpec, Strategy, tune
from cost_models import AnalyticCostModel

HERE = Path(__file__).resolve().parent

# (model, cluster, global batch, the published configuration on H100 with its source row)
CASES = [
    (
        "deepseek-v3",
        "h100-sxm:32x8",
        512,
        # NeMo Automodel DeepSeek-V3 on 256 H100s (AUTOMODEL-DEEPSEEKV3671B-H100-256): FSDP2
        # over 64, pp4 interleaved x8, ep64, activation checkpointing
        "dp=64,tp=1,pp=4,ep=64,micro_batch_size=1,global_batch_size=512,recompute=full,"
        "pipeline_schedule=interleaved_1f1b,virtual_stages=8,zero_stage=3",
    ),
    (
        "deepseek-v3",
        "h100-sxm:128x8",
        8192,
        # Megatron-Bridge 25.09 DeepSeek-V3 on 1,024 H100s (MB2509-DEEPSEEKV3DROPLESS-H100-1024),
        # with its recipe's recompute modules (deepseek_llm_pretrain.py: mla_up_proj, mlp)
        "dp=64,tp=2,pp=8,ep=64,micro_batch_size=1,global_batch_size=8192,sequence_parallel=true,"
        "pipeline_schedule=interleaved_1f1b,virtual_stages=4,zero_stage=1,"
        "recompute_modules=mla_up_proj+mlp",
    ),
    (
        "qwen3-235b-a22b",
        "h100-sxm:32x8",
        2048,
        # Megatron-Bridge Qwen3-235B-A22B on 256 H100s (MB2511-QWEN3235BA22B-H100-256-FP8CS,
        # in bf16 here)
        "dp=16,tp=2,pp=8,ep=32,micro_batch_size=1,global_batch_size=2048,sequence_parallel=true,"
        "pipeline_schedule=interleaved_1f1b,virtual_stages=4,zero_stage=1",
    ),
    (
        "qwen3-235b-a22b",
        "h100-sxm:128x8",
        8192,
        # no published 1,024-GPU H100 run: the 256-GPU layout with dp64
        "dp=64,tp=2,pp=8,ep=32,micro_batch_size=1,global_batch_size=8192,sequence_parallel=true,"
        "pipeline_schedule=interleaved_1f1b,virtual_stages=4,zero_stage=1",
    ),
]
RUNTIMES = ("megatron-core", "torchtitan", "automodel")
# The published runs of each case's model on its H100s at sequence 4,096 (moe_runs.csv ids)
PUBLISHED = {
    ("deepseek-v3", "h100-sxm:32x8"): ["AUTOMODEL-DEEPSEEKV3671B-H100-256"],
    ("deepseek-v3", "h100-sxm:128x8"): [
        "MB2509-DEEPSEEKV3DROPLESS-H100-1024-FP8",
        "AUTOMODEL-DEEPSEEKV3671B-H100-1024",
        "DGXC250504-DSV3-H100-1024-BF16",
    ],
    ("qwen3-235b-a22b", "h100-sxm:32x8"): [
        "MB2509-QWEN3235BA22BTOKENDROP-H100-256-FP8",
        "MB2511-QWEN3235BA22B-H100-256-FP8CS",
        "MB260401-QWEN3235BA22B-H100-256-FP8",
        "MZOO-QWEN3-235BCROSSNODEEP-H100-256",
        "MZOO-QWEN3-235BCROSSNODEEP1F1BOVERLAP-H100-256",
        "MZOO-QWEN3-235BINTRANODEEPFSDP-H100-256",
        "MZOO-QWEN3-235BINTRANODEEPTP4-H100-256",
        "MZOO-QWEN3-235BINTRANODEEPA2A-H100-256",
    ],
    ("qwen3-235b-a22b", "h100-sxm:128x8"): [],  # none published
}


def published_runs(fidelity, rows: pd.DataFrame, ids: list[str]) -> list[dict]:
    """Each published run as the fidelity benchmark scores it."""
    out = []
    for rid in ids:
        p = fidelity.predict(rows.loc[rid])
        if not p["expressible"]:
            out.append({"id": rid, "expressible": False, "why": p["error"][:200]})
            continue
        out.append(
            {
                "id": rid,
                "strategy": p["strategy"],
                "runtime": p["runtime"],
                "published_tokens_per_s_per_gpu": round(p["published_tokens_per_s_per_gpu"]),
                "predicted_tokens_per_s_per_gpu": round(p["predicted_tokens_per_s_per_gpu"]),
                "error": round(p["throughput_error"], 3),
                "predicted_memory_gib": round(p["predicted_memory_gib"], 1),
                "fits": bool(p["fits"]),
            }
        )
    return out


def main() -> None:
    spec = importlib.util.spec_from_file_location("fidelity_moe", HERE / "fidelity_moe.py")
    fidelity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fidelity)
    rows = pd.read_csv(fidelity.TABLE).set_index("id", drop=False)
    out = []
    for name, cluster, gbs, published in CASES:
        model = ModelSpec.load(name, seq_len=4096)
        runs = published_runs(fidelity, rows, PUBLISHED[(name, cluster)])
        for runtime in RUNTIMES:
            # time_budget 0: the local search runs to its end, so the pick does not depend on
            # how fast this machine is
            result = tune(
                model, cluster, global_batch_size=gbs, runtime=runtime, seed=0, time_budget=0
            )
            best = result.best_report
            pub = Strategy.parse(published)
            try:
                ref = AnalyticCostModel(model, Cluster.parse(cluster), runtime=runtime)
                pub_report = ref.estimate(pub)
                pub_tokens, pub_fits = round(pub_report.tokens_per_s), pub_report.fits
                pub_memory = round(pub_report.peak_memory_bytes / 2**30, 1)
            except ValueError as exc:
                pub_tokens, pub_fits, pub_memory = None, str(exc)[:200], None
            out.append(
                {
                    "case": f"{name} {cluster} gbs{gbs} seq4096",
                    "runtime": runtime,
                    "pick": result.best_strategy.short(),
                    "tokens_per_s_per_gpu": round(best.tokens_per_s / best_world(cluster)),
                    "mfu": round(best.mfu, 3),
                    "memory_gib": round(best.peak_memory_bytes / 2**30, 1),
                    "published": pub.short(),
                    "published_predicted_tokens_per_s_per_gpu": None
                    if pub_tokens is None
                    else round(pub_tokens / best_world(cluster)),
                    "published_predicted_fits": pub_fits,
                    "published_predicted_memory_gib": pub_memory,
                    **{k: round(v, 2) for k, v in best.time._asdict().items()},
                    "published_runs": runs,
                }
            )
            print(json.dumps(out[-1]), flush=True)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results/picks_moe.json")
    path.write_text(json.dumps(out, indent=1))


def best_world(cluster: str) -> int:
    return Cluster.parse(cluster).world_size


if __name__ == "__main__":
    main()
