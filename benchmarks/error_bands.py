"""Error bands by kind of run, from every run the fidelity benchmarks check.

Evidence: SC'21 Table 1 (10 published runs, Megatron-LM 2021 on A100), the second development set
(287 published runs: torchtitan, Megatron-Core, NeMo, MosaicML Composer on H100, H200,
A100), the published MoE runs (benchmarks/fidelity_moe.py, `moe_evidence`), sharded data
parallelism at 384-2,240 ranks (benchmarks/fidelity_scale.py, `scale_evidence`) and the local runs
on this machine (results/fidelity_local.csv, measured with the Engine). Each run gives
q = actual step time / predicted step time; runs are grouped by kind at every level of
`autosearch.core.bands.LEVELS` and each group's split-conformal 90% interval is written to
cost_models/error_bands.yaml, which `AnalyticCostModel.estimate` reads.

Run: python benchmarks/error_bands.py   (after the fidelity benchmarks; prints each level's
coverage on the runs, and the bands with the most runs)
"""

from __future__ import annotations

import importlib.util
import math
from collections import defaultdict
from pathlib import Path

import pandas as pd
import yaml

from autosearch import Cluster
from autosearch.core import RuntimeOptions, Strategy
from autosearch.core.bands import LEVELS, conformal_band, key_of, kind_of

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = ROOT / "cost_models" / "error_bands.yaml"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def evidence() -> list[tuple[dict[str, str], float, str]]:
    """(kind, actual / predicted step time, source) of every run."""
    out = []
    sc21 = _load("fidelity_sc21")
    table = pd.read_csv(sc21.TABLE)
    for (_, row), (_, fid) in zip(table.iterrows(), sc21.fidelity().iterrows()):
        cluster = Cluster.parse(f"{sc21.PROFILE}:{int(row.n_gpus) // 8}x8")
        ratio = fid.predicted_tflops_per_gpu / fid.published_tflops_per_gpu
        out.append((kind_of(sc21.row_strategy(row), cluster, sc21.RUNTIME), ratio, "sc21"))
    modern = _load("fidelity_modern")
    rows = modern.load_rows()
    for _, row in rows.iterrows():
        pred = modern.predict(row)
        if not pred["expressible"]:
            continue
        runtime = modern.runtime_of(row)
        gpus = int(row.n_gpus)
        cluster = Cluster(
            gpu=modern.GPUS[row.gpu], n_nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus)
        )
        ratio = pred["predicted_tokens_per_s_per_gpu"] / pred["published_tokens_per_s_per_gpu"]
        framework = RuntimeOptions.get(runtime).framework
        out.append(
            (kind_of(modern.strategy_of(row, runtime), cluster, framework), ratio, "modern")
        )
    local = pd.read_csv(ROOT / "results" / "fidelity_local.csv")
    profile = ROOT / "results" / "calibration" / "example-amd-epyc-2c.yaml"
    for _, run in local.iterrows():
        if not (run.measured_step_time_s > 0):
            continue
        fields = {
            k: run[k]
            for k in Strategy.__dataclass_fields__
            if k in run and not (isinstance(run[k], float) and math.isnan(run[k]))
        }
        s = Strategy.from_dict(fields)
        cluster = Cluster(gpu=str(profile), n_nodes=1, gpus_per_node=s.world_size)
        ratio = run.measured_step_time_s / run.predicted_step_time_s
        out.append((kind_of(s, cluster, "torch"), ratio, "local"))
    return out + moe_evidence() + scale_evidence()


def scale_evidence() -> list[tuple[dict[str, str], float, str]]:
    """(kind, actual / predicted step time, "scale") of the sharded-data-parallel runs at
    hundreds to thousands of ranks that benchmarks/fidelity_scale.py scores (SC'21 Table 2's
    ZeRO-3, OPT-175B's FSDP)."""
    scale = _load("fidelity_scale")
    out = []
    for _, row in scale.load_rows().iterrows():
        pred = scale.predict(row)
        cluster = Cluster(gpu=row.gpu, n_nodes=int(row.n_gpus) // 8, gpus_per_node=8)
        ratio = pred["predicted_tflops_per_gpu"] / pred["published_tflops_per_gpu"]
        framework = RuntimeOptions.get(pred["runtime"]).framework
        out.append((kind_of(scale.strategy_of(row), cluster, framework), ratio, "scale"))
    return out


def moe_evidence() -> list[tuple[dict[str, str], float, str]]:
    """(kind, actual / predicted step time, "moe") of every published MoE run the MoE fidelity
    benchmark can express (benchmarks/fidelity_moe.py): their kinds carry ep (and etp) among
    the parallel axes."""
    moe = _load("fidelity_moe")
    out = []
    for _, row in pd.read_csv(moe.TABLE).iterrows():
        pred = moe.predict(row)
        if not pred["expressible"]:
            continue
        gpus = int(row.n_gpus)
        cluster = Cluster(
            gpu=moe.GPUS[row.gpu], n_nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus)
        )
        ratio = pred["predicted_tokens_per_s_per_gpu"] / pred["published_tokens_per_s_per_gpu"]
        framework = RuntimeOptions.get(pred["runtime"]).framework
        out.append((kind_of(moe.strategy_of(row), cluster, framework), ratio, "moe"))
    return out


def main() -> None:
    runs = evidence()
    groups: dict[str, list[float]] = defaultdict(list)
    for kind, ratio, _ in runs:
        for level in range(len(LEVELS)):
            groups[key_of(kind, level)].append(ratio)
    bands = {}
    for key, ratios in sorted(groups.items()):
        low, high = conformal_band(ratios)
        bands[key] = {"low": round(low, 4), "high": round(high, 4), "runs": len(ratios)}
    sources = sorted({source for _, _, source in runs})
    doc = {
        "coverage": 0.9,
        "sources": [f"{s}: {sum(1 for *_, src in runs if src == s)} runs" for s in sources],
        "bands": bands,
    }
    header = (
        "# Error bands of the analytic cost model by kind of run: actual / predicted step time\n"
        "# lies in [low, high] for 90% of runs of the kind (split-conformal). Written by\n"
        "# benchmarks/error_bands.py from the fidelity benchmarks; do not edit by hand.\n"
    )
    OUT.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    from autosearch.core.bands import ErrorBands

    shipped = ErrorBands.from_dict(doc)
    covered = sum(
        1 for kind, ratio, _ in runs if (b := shipped.band(kind)).runs and b.low <= ratio <= b.high
    )
    print(
        f"{len(runs)} runs ({', '.join(doc['sources'])}); {len(bands)} kinds over "
        f"{len(LEVELS)} levels; the band each run gets covers it for {covered / len(runs):.1%}"
    )
    widest = sorted(bands.items(), key=lambda kv: -kv[1]["runs"])[:8]
    for key, b in widest:
        print(f"  {b['runs']:4d} runs  {b['low']:.2f}-{b['high']:.2f}  {key}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
