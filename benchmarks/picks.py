"""What `tune` recommends, with the reason from the time breakdown: GPT-3 175B on 384, 768 and
1,536 A100-80GB at global batch 1,536 (SC'21's largest-batch regime), Llama 3 8B / 70B on H100,
and Llama 3.1 405B on 1,024 and 16,384 H100s at Llama 3's 16M-token batch, each searched
exhaustively under the default runtime (the Engine's), next to what was published at that
scale (`PUBLISHED`).

Run: python benchmarks/picks.py [OUT]   (writes results/picks.json; the figures of an earlier
commit can be produced by running this file from a checkout of that commit)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from autosearch import tune

CASES = [
    ("gpt3-175b", "a100-sxm4-80gb:48x8", 1536),
    ("gpt3-175b", "a100-sxm4-80gb:96x8", 1536),
    ("gpt3-175b", "a100-sxm4-80gb:192x8", 1536),
    ("llama3-8b", "h100-sxm:8x8", 512),
    ("llama3-70b", "h100-sxm:32x8", 512),
    ("llama3.1-405b", "h100-sxm:128x8", 2048),
    ("llama3.1-405b", "h100-sxm:2048x8", 2048),
]
# What ran at these scales, with its source (none of these is ZeRO-3 / FSDP without tp or pp).
PUBLISHED = {
    "gpt3-175b": "Megatron-LM on A100 (SC'21, benchmarks/reference/sc21_table1.csv): 145.6B on"
    " 1,536 GPUs as tp8 x pp8 x dp24, interleaved, 148 TFLOP/s per GPU; NeMo's GPT-3 175B on"
    " 128-2,048 H100s (nemo_dense_runs.csv): tp4 x pp8, vp 6-12, distributed optimizer",
    "llama3.1-405b": "NeMo / Megatron-Bridge on 1,024 H100s (nemo_dense_runs.csv): tp8 x pp8 x"
    " cp2 x dp8, vp 8, distributed optimizer, 292-328 tokens/s per GPU in fp8; Llama 3 (Dubey et"
    " al. 2024, Table 4): tp8 x pp16 x dp64 on 8,192 and tp8 x pp16 x dp128 on 16,384 H100s at"
    " 16M tokens per batch, 430 and 400 TFLOP/s per GPU (bf16), FSDP-style sharding of the"
    " optimizer state and gradients within the dp group",
}


def main() -> None:
    out = []
    for model, cluster, gbs in CASES:
        result = tune(
            model, cluster, global_batch_size=gbs, n_trials=100_000, sampler="exhaustive", seed=0
        )
        report, t = result.best_report, result.best_report.time
        out.append(
            {
                "case": f"{model} {cluster} gbs{gbs}",
                "best": result.best_strategy.short(),
                "tokens_per_s": round(report.tokens_per_s),
                "mfu": round(report.mfu, 3),
                "memory_gib": round(report.peak_memory_bytes / 2**30, 1),
                **{k: round(v, 2) for k, v in t._asdict().items()},
                "published": PUBLISHED.get(model, ""),
            }
        )
        print(json.dumps(out[-1]), flush=True)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results/picks.json")
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
