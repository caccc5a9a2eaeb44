"""Golden figures: the cost model against the published MoE runs on H100
(benchmarks/fidelity_moe.py; sources in benchmarks/reference/README.md).

No H100 group meets all of issue 19's targets yet (throughput MAPE <= 10%, no row beyond 25%,
every run predicted to fit; the Megatron groups fit, and the model zoo's MAPE is under 10%):
each is held to its current figure plus a small margin, so that a change that makes it worse
fails here, and the targets replace these bounds as groups reach them. The
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


# group: (rows expressible, throughput MAPE bound, worst-row bound, every row predicted to fit)
BOUNDS = {
    # 8.1%, worst -35.6% (Megatron-FSDP dp128: its exposed ZeRO-3 traffic); 2 rows not
    # expressible (pp32 x vp3 > 94 layers, Qwen3-Next's hybrid attention)
    "MoE Model Zoo H100": (12, 0.09, 0.36, True),
    # 27.9%, worst +179% (MB2511 Qwen3-30B at 5,275 tokens/s, where 25.09 and 26.02.01 ran
    # the same layout at 10,494 and 9,058); 11.2% without the three Qwen3-30B pp2 rows of the
    # 25.09 / 25.11 / 26.02 releases
    "Megatron-Bridge H100": (15, 0.28, 1.80, True),
    "DGX Cloud H100": (4, 0.22, 0.37, True),  # 21.3%, worst +36.7% (Llama 4 Maverick FP8)
    # 15.6%, worst -26.3%; FSDP2 (torchtitan preset) memory above 80 GB on all four rows
    "NeMo Automodel H100": (4, 0.16, 0.27, False),
}


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_group_is_held_to_its_bound(groups, name):
    rows, mape, worst, fits = BOUNDS[name]
    g = groups[name]
    assert g["expressible"] == rows
    assert g["throughput_mape"] <= mape, g
    assert abs(g["worst_error"]) <= worst, g
    if fits:  # every published run of the group predicted to fit (issue 19 item 7)
        assert g["all_fit"], g


def test_recipes_recompute_modules_are_read_from_the_rows():
    """The module lists the rows and their recipes state become the Strategy's
    recompute_modules (benchmarks/fidelity_moe.py ASSUMED["recompute"])."""
    spec = importlib.util.spec_from_file_location(
        "fidelity_moe", ROOT / "benchmarks" / "fidelity_moe.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    expect = {
        "MZOO-QWEN3-235BCROSSNODEEP-H100-256": ("none", "layernorm+moe_act"),
        "MZOO-QWEN3-235B-LC16K-DROPLESS-H100-256": ("none", "layernorm+moe"),
        "MB2509-DEEPSEEKV3DROPLESS-H100-1024-FP8": ("none", "mla_up_proj+mlp"),
        "MZOO-QWEN3-235BINTRANODEEPFSDP-H100-256": ("full", "none"),
        "MB2606-QWEN330BA3B-H100-16-FP8": ("none", "none"),
    }
    for rid, want in expect.items():
        assert bench.recompute_of(rows.loc[rid]) == want, rid
