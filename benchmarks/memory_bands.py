"""Memory bands by kind of run: how far a run's measured peak memory lies above the prediction.

Evidence: the published torchtitan runs with their memory (results/fidelity_modern.csv, max
reserved memory, `benchmarks/fidelity_modern.py`), the Engine's runs on this machine
(results/fidelity_local.csv, live tensor memory, `benchmarks/fidelity_local.py`) and on GPUs
(results/gpu/*/measured_vs_predicted.csv, `torch.cuda.max_memory_allocated` against the
predicted tensor memory, `benchmarks/gpu_check.py`). Each run gives
q = measured / predicted peak memory; runs are grouped by kind (the runtime's framework and the
device type) and each group's q at the upper end of the same split-conformal 90% interval the
step-time bands use (`autosearch.core.bands.conformal_band`) is written to
cost_models/memory_bands.yaml. `autosearch tune` holds back 1 - 1/q of device memory for a
kind (`autosearch.tuning.memory_margin`): a strategy fits when its predicted peak times q is at
most the capacity.

Run: python benchmarks/memory_bands.py   (after the fidelity benchmarks)
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pandas as pd
import yaml

from autosearch.core import RuntimeOptions
from autosearch.core.bands import COVERAGE, conformal_band

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "cost_models" / "memory_bands.yaml"
MODERN = ROOT / "results" / "fidelity_modern.csv"
LOCAL = ROOT / "results" / "fidelity_local.csv"
GPU_RUNS = [  # a GPU machine each (not the CPU dry run of the script)
    p
    for p in sorted((ROOT / "results" / "gpu").glob("*/measured_vs_predicted.csv"))
    if p.parent.name != "dry-run"
]


def evidence() -> list[tuple[tuple[str, str], float, str]]:
    """((framework, device type), measured / predicted peak memory, run id) of every run."""
    out = []
    modern = pd.read_csv(MODERN)
    for _, row in modern[modern.published_memory_gib.notna()].iterrows():
        framework = RuntimeOptions.get(row.runtime).framework
        ratio = row.published_memory_gib / row.predicted_memory_gib
        out.append(((framework, "cuda"), ratio, row.id))
    local = pd.read_csv(LOCAL)
    for _, row in local[local.status == "ok"].iterrows():
        ratio = row.measured_peak_memory_bytes / row.predicted_peak_memory_bytes
        out.append((("torch", str(row.device)), ratio, f"local {row.strategy}"))
    for path in GPU_RUNS:  # the GPU check's runs, against the catalog profile of their GPU
        gpu = pd.read_csv(path)
        for _, row in gpu[gpu.status == "ok"].iterrows():
            ratio = row.measured_peak_memory_bytes / row.catalog_tensor_memory_bytes
            out.append((("torch", "cuda"), ratio, f"{path.parent.name} {row.strategy}"))
    return out


def main() -> None:
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for kind, ratio, _ in evidence():
        groups[kind].append(ratio)
    kinds = []
    for (framework, device), ratios in sorted(groups.items()):
        _, high = conformal_band(ratios)
        kinds.append(
            {
                "runtime": framework,
                "device": device,
                "runs": len(ratios),
                "high": round(high, 4),
                "worst": round(max(ratios), 4),
                "mean": round(sum(ratios) / len(ratios), 4),
            }
        )
        print(
            f"{framework:12s} {device:5s} {len(ratios):3d} runs: measured / predicted peak "
            f"memory mean {sum(ratios) / len(ratios):.3f}, worst {max(ratios):.3f}, band high "
            f"{high:.3f} -> margin {1 - 1 / high:.1%} of capacity"
        )
    header = (
        "# Memory bands of the analytic cost model by kind of run (the runtime's framework\n"
        "# and the device type): measured / predicted peak memory lies at or below `high` for\n"
        "# 95% of runs of the kind (the upper end of the split-conformal 90% interval).\n"
        "# `autosearch tune` holds back 1 - 1/high of device memory\n"
        "# (autosearch/tuning/_margin.py). Written by benchmarks/memory_bands.py from\n"
        "# results/fidelity_modern.csv and fidelity_local.csv; do not edit by hand.\n"
    )
    doc = {"coverage": COVERAGE, "kinds": kinds}
    OUT.write_text(header + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
