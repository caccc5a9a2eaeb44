"""Golden figures: the cost model against the published MoE runs on H100
(benchmarks/fidelity_moe.py; sources in benchmarks/reference/README.md).

No H100 group meets issue 19's targets yet (throughput MAPE <= 10%, no row beyond 25%, every run
predicted to fit): each is held to its current figure plus a small margin, so that a change
that makes it worse fails here, and the targets replace these bounds as groups reach them. The
figures are those of results/fidelity_moe.csv, rounded up.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pandas as pd
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def groups():
    spec = importlib.util.spec_from_file_location(
        "fidelity_moe", ROOT / "benchmarks" / "fidelity_moe.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = pd.read_csv(bench.TABLE)
    rows = rows[rows.gpu == "h100-sxm"]
    table = pd.DataFrame([bench.predict(r) for _, r in rows.iterrows()])
    return bench.summarize(table)


# group: (rows expressible, throughput MAPE bound, worst-row bound)
BOUNDS = {
    # 15.1%, worst +38.4% (LC16K dropless); 2 rows not expressible (pp32 x vp3 > 94 layers,
    # Qwen3-Next's hybrid attention)
    "MoE Model Zoo H100": (12, 0.16, 0.39),
    # 28.4%, worst +179% (MB2511 Qwen3-30B at 5,275 tokens/s, where 25.09 and 26.02.01 ran
    # the same layout at 10,494 and 9,058)
    "Megatron-Bridge H100": (15, 0.29, 1.80),
    "DGX Cloud H100": (4, 0.23, 0.38),  # 22.2%, worst +37.6% (Llama 4 Maverick FP8)
    "NeMo Automodel H100": (4, 0.18, 0.27),  # 17.5%, worst -26.3%
}


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_group_is_held_to_its_bound(groups, name):
    rows, mape, worst = BOUNDS[name]
    g = groups[name]
    assert g["expressible"] == rows
    assert g["throughput_mape"] <= mape, g
    assert abs(g["worst_error"]) <= worst, g
