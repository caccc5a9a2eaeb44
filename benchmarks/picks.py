"""What `tune` recommends, with the reason from the time breakdown: GPT-3 175B on 384, 768 and
1,536 A100-80GB at global batch 1,536 (SC'21's largest-batch regime), and Llama 3 8B / 70B on
H100, each searched exhaustively under the default runtime (the Engine's).

Run: python benchmarks/picks.py   (writes results/picks.json; the figures of an earlier commit
can be produced by running this file from a checkout of that commit)
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
]


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
            }
        )
        print(json.dumps(out[-1]), flush=True)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results/picks.json")
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
