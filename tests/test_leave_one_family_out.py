"""benchmarks/leave_one_family_out.py (issue 34 part 3): every row of the tables it scores has
a family, every constant chosen against a table finds the rows that chose it, and a fold holds
out exactly what its family chose."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lofo():
    name = "leave_one_family_out"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses resolve their module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def rows(lofo):
    return lofo.load_rows()


def test_every_row_has_a_family(rows):
    families = set(rows.family)
    expected = {"Llama 3", "GPT-3", "MPT", "Qwen3 MoE", "DeepSeek-V3", "Mixtral", "Llama 4"}
    assert (
        expected | {"Kimi-K2", "Nemotron 3 (hybrid)", "Nemotron-H (hybrid)", "Nemotron-4"}
        <= families
    )
    # moe, hybrid (21 Nemotron 3 Nano + DGX Cloud's Nemotron-H 56B), modern, mosaicml,
    # nemo_dense (with DGX Cloud v25.05.04's 20 GB200 / H100 rows), and the held-out rows of
    # sharded_dp_runs
    assert len(rows) == 152 + 22 + 43 + 138 + 129 + 7
    assert {"OPT"} <= families


def test_every_constant_finds_the_rows_that_chose_it(lofo, rows):
    """A selector that matches nothing would leave its constant shipped in every fold: the
    counts are those of the tables today (the comments of cost_models/runtimes.yaml)."""
    counts = {c.name: int(c.chose(rows).sum()) for c in lofo.CONSTANTS}
    assert counts == {
        "moe_load_imbalance": 8,  # four forced / dropless pairs
        "moe_layer_host_s": 110,  # every Megatron-Bridge row of the MoE table
        "moe_expert_host_s": 110,
        "moe_a2a_overlap_when_on": 9,
        "nemo-25 kernel_efficiency": 18,  # NeMo 2's dense rows on Blackwell (DGX Cloud)
        "nemo-25 expert_kernel_efficiency": 11,  # its Mixtral and Llama 4 rows there
        "torchtitan kernel_efficiency": 2,
        "torchtitan async_tp_overlap": 14,
        "torchtitan allocator_reserve_fraction": 33,
        "composer-fsdp kernel_efficiency": 77,
    }


def test_a_fold_holds_out_what_its_family_chose(lofo, rows):
    values, how = lofo.fold(rows, "GPT-3")  # no constant was chosen on GPT-3's rows
    assert how == {} and values == lofo.shipped()
    values, how = lofo.fold(rows, "Mixtral")  # NeMo 2's experts' factor, on Llama 4's rows
    assert how == {"nemo-25 expert_kernel_efficiency": "chosen on the other 7 of 11 rows"}
    assert values.values["nemo-25 expert_kernel_efficiency"] == pytest.approx(0.532, abs=0.01)
    values, how = lofo.fold(rows, "Nemotron-4")  # NeMo 2's Blackwell factor, on Llama's rows
    assert how == {"nemo-25 kernel_efficiency": "chosen on the other 6 of 18 rows"}
    assert values.values["nemo-25 kernel_efficiency"] == pytest.approx(0.784, abs=0.01)
    values, how = lofo.fold(rows, "Kimi-K2")  # the host constants saw its Bridge rows
    assert set(how) == {"moe_layer_host_s", "moe_expert_host_s"}
    assert all(h.startswith("chosen on the other") for h in how.values())
    values, how = lofo.fold(rows, "MPT")  # every row that chose Composer's factor is MPT
    # ... so it falls back to the other eager-torch Hopper factor, torchtitan's (shipped here)
    tt = lofo.shipped().values["torchtitan kernel_efficiency"]
    assert values.values["composer-fsdp kernel_efficiency"] == tt
    assert set(how) == {"composer-fsdp kernel_efficiency"}
    assert values.runtimes()["composer-fsdp"].kernel_efficiency == (("hopper", tt),)


def test_a_constant_falls_back_to_the_value_of_the_table_it_was_not_chosen_on(lofo, rows):
    """Both torchtitan's H200 rows are Llama 3: its kernel factor takes Composer's (MPT's),
    while the constants with no other table fall back to their value before they were chosen."""
    values, how = lofo.fold(rows, "Llama 3")
    composer = lofo.shipped().values["composer-fsdp kernel_efficiency"]
    assert values.values["torchtitan kernel_efficiency"] == composer
    assert values.runtimes()["torchtitan"].kernel_efficiency == (("hopper", composer),)
    assert values.values["torchtitan allocator_reserve_fraction"] == 0.07
    assert values.values["torchtitan async_tp_overlap"] == 0.875
    assert "held out" in how["torchtitan kernel_efficiency"]


def test_what_each_held_out_constant_costs_its_family(lofo, rows):
    """With the one constant MPT's fold holds out back at its shipped value, the fold is the
    shipped model again: its MAPE is the shipped MAPE (the same predictions, to rounding)."""
    mine = rows[rows.family == "MPT"]
    values, how = lofo.fold(rows, "MPT")
    cost = lofo.cost_of_each(mine, values, how)
    base = lofo.score(
        lofo.pd.DataFrame([lofo.predict(r, lofo.shipped()) for _, r in mine.iterrows()])
    )
    assert set(cost) == {"composer-fsdp kernel_efficiency"}
    assert cost["composer-fsdp kernel_efficiency"] == pytest.approx(
        base["throughput_mape"], rel=1e-12
    )


def test_every_hybrid_run_is_scored_with_its_run_columns(lofo, rows):
    """fidelity_hybrid reads its rows through fidelity_moe's strategy_of / runtime_of, so
    hybrid_runs.csv carries the same run columns (runtime, recompute, pipeline ...)."""
    hybrid = rows[rows.bench == "hybrid"]
    preds = [lofo.predict(r, lofo.shipped()) for _, r in hybrid.iterrows()]
    assert len(preds) == 22 and all(p["expressible"] for p in preds)
    assert {p["runtime"] for p in preds} >= {"megatron-bridge-26.08", "automodel", "nemo-25.04"}


def test_every_published_hybrid_run_is_predicted_to_fit(lofo, rows):
    """A run that ran fits: the Nemotron 3 Nano H100 runs with their recipe's bf16 gradient
    reduction and its selective recompute of the attention core, the norms and the MoE layer
    (Megatron-Bridge NEMOTRON_3_NANO_PRETRAIN_CONFIG_H100_FP8_CS_V1, hybrid_runs.csv `note`),
    Automodel's with its activation checkpointing."""
    hybrid = rows[rows.bench == "hybrid"]
    preds = [lofo.predict(r, lofo.shipped()) for _, r in hybrid.iterrows()]
    assert all(p["fits"] for p in preds), [p["id"] for p in preds if not p["fits"]]
    h100 = hybrid[hybrid.id.str.contains("NEMOTRON3NANO-H100")]
    assert len(h100) == 4
    assert set(h100.grad_reduce_in_fp32.astype(str).str.lower()) == {"false"}
    assert set(h100.recompute_granularity) == {"selective"}
    assert set(h100.recompute_modules) == {"layernorm+moe"}
    automodel = hybrid[hybrid.id.str.startswith("AUTOMODEL-NEMOTRON")]
    assert set(automodel.recompute_granularity) == {"full"}
