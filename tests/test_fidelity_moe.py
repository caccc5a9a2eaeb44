"""Golden figures: the cost model against the published MoE runs on H100
(benchmarks/fidelity_moe.py; sources in benchmarks/reference/README.md).

One H100 group meets issue 19's targets (throughput MAPE <= 10%, no row beyond 25%, every run
predicted to fit): NeMo Automodel is held to them. The others are held to their
current figure plus a small margin, so that a change that makes them worse fails here, and the
targets replace these bounds as groups reach them. The figures are those of
results/fidelity_moe.csv, rounded up.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import pandas as pd
import pytest

from autosearch import Cluster
from autosearch.core.errors import SpecError
from cost_models import AnalyticCostModel
from cost_models.formulas import microbatches_in_flight
from cost_models.terms import experts

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
TARGETS = (0.10, 0.25, True)  # issue 19 item 7
BOUNDS = {
    # 10.4%, worst +43.3% (the A2A pp32 x vp3 row: one layer per chunk, 512 micro-batches;
    # expressible since chunks may be empty, its layout 'E|t|...|t|L'), -25.8% (Megatron-FSDP
    # dp128: its exposed ZeRO-3 traffic); the two cross-node EP rows +18% since their launch
    # script's forced balance is read (they were -1% / +1% scored as dropless); Qwen3-Next's
    # hybrid attention is not expressible. Was 7.6% over 12 rows, worst -29.7%. 10.5%, worst
    # +44.5%, with the GEMM tile model (issue 34): the A2A row's attention GEMMs cost 1% less
    # in tiles and waves than on the smooth curve (its compute 13.62 -> 13.49 s). 9.3%, worst
    # -31.4% (Megatron-FSDP dp128, -25.8% before), with the MoE host time exposed after the
    # dispatcher's sync instead of a floor (experts.rank_s; the A2A row +43% -> +12%).
    # 8.8%, worst -31.4%, with cuDNN attention by shape (issue 34): the two 16k-token rows (cp 1)
    # faster, their attention at the H200 table's 0.68 / 0.58 of peak (forward / backward)
    # where the flat 0.50 read them closer; the cp rows keep the flat efficiency.
    # 9.4%, worst -31.4%, over 14 rows with Qwen3-Next expressible (+17.6%: its launch
    # script's forced balance and its MTP module read; the Gated DeltaNet scans unmeasured)
    "MoE Model Zoo H100": (14, 0.10, 0.32, True),
    # 25.0%, worst +179% (MB2511 Qwen3-30B at 5,275 tokens/s, where 25.09 ran the same
    # layout at 10,494); 9.9%, worst +33.4%, without the two rows flagged AMBIGUOUS. Was 26.1%
    # before the DeepSeek-V3 rows trained MTP with their recipe's layout (+16/+14% -> +6/+9%).
    # 17.1%, worst +95.5% (the same MB2511 row), with the MoE host time exposed after the
    # dispatcher's sync instead of a floor (it was 19.8%, worst +118.9%)
    "Megatron-Bridge H100": (15, 0.18, 0.96, True),
    # 18.1%, worst +38.1% (DeepSeek-V3 on 1,024 H100s): the rows ran NeMo 25.04's token drop
    # (balanced) and its DeepSeek-V3 recipe fp32 gradients with the shared-expert overlap
    # (fidelity_moe.py ASSUMED["DGX Cloud 25.04 recipes"]); the Llama 4 rows -3% and +1%. Was
    # 8.7% when the DeepSeek-V3 rows were scored as dropless with bf16 gradients. 17.4%, worst
    # +36.2%, with their MTP module and NeMo 25.04's first / last stage split. 16.7%, worst
    # +31.6%, with the MoE host time exposed after the dispatcher's sync (17.5%, +36.6% before).
    # 18.2%, worst +31.6%, with the Llama 4 rows' TE TP comm overlap (their recipe's
    # tp_comm_overlap=True: -5.0% / -3.1% -> +3.9% / +7.7%) and the FP8 row's per-layer CUDA
    # graphs (launch.sh CUDA_GRAPH true: no MoE host time, +7.7% -> +12.7%)
    "DGX Cloud H100": (4, 0.19, 0.32, True),
    # 7.6%, worst -17.1%, all fit: the automodel preset's bf16 states, one local batch per
    # pipeline schedule
    "NeMo Automodel H100": (4, *TARGETS),
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
    """The module lists the rows and their recipes state are the table's recompute columns,
    which become the Strategy's (benchmarks/fidelity_moe.py ASSUMED["recompute"])."""
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
        "MB260401-DEEPSEEKV3-B200-256-MXFP8": ("none", "mla_up_proj+mlp"),  # v0.4.2 preset
        "MB260401-DEEPSEEKV3-GB200-256-MXFP8": ("none", "mla_up_proj"),
    }
    for rid, want in expect.items():
        assert _recompute(rows.loc[rid]) == want, rid
        s = bench.strategy_of(rows.loc[rid])
        assert (s.recompute, s.recompute_modules) == want, rid


def _recompute(row: pd.Series) -> tuple[str, str]:
    """(recompute, recompute_modules) the row's run set: columns of moe_runs.csv."""
    return row.recompute_granularity, row.recompute_modules


def _bench():
    spec = importlib.util.spec_from_file_location(
        "fidelity_moe", ROOT / "benchmarks" / "fidelity_moe.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bridge_group_without_its_ambiguous_rows(groups):
    """The rows flagged AMBIGUOUS in moe_runs.csv's notes are reported apart, not dropped:
    the group's figures count them, `without_ambiguous` does not: 8.0%, worst +18.1%, within
    issue 19's 10% since the MoE host time is exposed after the dispatcher's sync instead of a
    floor (11.6%, worst -28.1% before: MB260201 Qwen3-30B pp2 ep8 mb1 under the floor)."""
    g = groups["Megatron-Bridge H100"]
    assert sorted(g["ambiguous_rows"]) == [
        "MB2511-QWEN330BA3B-H100-16-FP8CS",
        "MB2602-QWEN330BA3B-H100-16-FP8",
    ]
    clear = g["without_ambiguous"]
    assert clear["rows"] == g["expressible"] - 2
    assert clear["throughput_mape"] <= TARGETS[0] and abs(clear["worst_error"]) <= 0.19


def test_automodel_rows_run_the_automodel_preset_one_local_batch_per_schedule():
    """Automodel rows are scored under the automodel preset (bf16 states, DeepEP); a row with
    pp > 1 as one local batch (global batch / grad_accum), each of which Automodel runs as a
    whole pipeline schedule (ASSUMED["Automodel gradient accumulation"])."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    row = rows.loc["AUTOMODEL-DEEPSEEKV3671B-H100-1024"]  # gbs 8192, grad_accum 4, pp 4
    assert bench.strategy_of(row).global_batch_size == 8192 // 4
    no_pp = rows.loc["AUTOMODEL-QWEN3MOE30B-H100-8"]  # pp 1: micro-batches of one schedule
    assert bench.strategy_of(no_pp).global_batch_size == 512
    runtime = bench.runtime_of(row)
    assert runtime.name.startswith("automodel") and runtime.param_bytes == 2
    assert runtime.moe_dispatcher == "deepep"


def test_bridge_2509_deepseek_h100_ran_deepep_with_the_a2a_overlap():
    """scripts/performance/run_script.py @fa0315ae2 turns on DeepEP and the EP A2A overlap for
    DeepSeek-V3 on H100 (ASSUMED["Bridge 25.09 DeepSeek-V3 H100"])."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    runtime = bench.runtime_of(rows.loc["MB2509-DEEPSEEKV3DROPLESS-H100-1024-FP8"])
    assert runtime.moe_dispatcher == "deepep"
    assert runtime.moe_a2a_overlap == bench.RUNTIMES["megatron-core"].moe_a2a_overlap_when_on


def test_bridge_full_iteration_graph_presets_have_no_host_time():
    """Megatron-Bridge 26.06+ Blackwell MXFP8 presets capture the whole iteration in one CUDA
    graph with the EP A2A overlap (recipes at v0.5.0 / v0.5.1 / v0.6.0,
    ASSUMED["Bridge full-iteration CUDA graphs"]): those rows have no per-layer host time;
    the same layout in 26.04 (partial graphs) keeps the preset's."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    graphed = bench.runtime_of(rows.loc["MB2606-QWEN330BA3B-GB200-8-MXFP8"])
    assert graphed.moe_layer_host_s == graphed.moe_expert_host_s == 0.0
    assert graphed.moe_a2a_overlap == bench.RUNTIMES["megatron-core"].moe_a2a_overlap_when_on
    before = bench.runtime_of(rows.loc["MB2604-QWEN330BA3B-GB200-8-MXFP8"])
    assert before.moe_layer_host_s == bench.RUNTIMES["nemo"].moe_layer_host_s > 0
    # 26.06's DeepSeek-V3 B300 preset kept partial graphs (pp8 mb2, transformer_engine scope)
    assert bench.runtime_of(rows.loc["MB2606-DEEPSEEKV3-B300-256-MXFP8"]).moe_layer_host_s > 0
    # the GB300 DeepSeek-V3 MXFP8 preset of these releases recomputes nothing
    assert _recompute(rows.loc["MB2608-DEEPSEEKV3-GB300-256-MXFP8"]) == ("none", "none")
    assert rows.loc["MB260601-QWEN330BA3B-GB300-8-MXFP8"].runtime == "megatron-bridge-26.06.01"


def test_full_iteration_graph_rows_meet_the_targets():
    """The 20 Bridge rows that ran full-iteration CUDA graphs (26.06, 26.06.01, 26.08 on
    GB200, GB300, B300): MAPE within issue 19's 10% (5.8% at this commit), worst -10.8%
    (Qwen3-235B GB300), bounded at 12%. With the GEMM tile model (issue 34): 5.5%, worst
    -13.7% (DeepSeek-V3 GB300, -10.6% before), bounded at 14%: on 148 SMs its output
    projection (4,096 x 7,168 tiles of 128 x 256) runs 7 waves for 6.05, and XLA's sm_100 fp8
    table prices its short-K MLA GEMMs (kv_b K = 512, q_b K = 1,536) at 0.28-0.45 of the fp8
    peak against 0.47-0.56 on the smooth curve. With cuDNN attention by shape: 6.1%, worst
    -15.7% (the same DeepSeek-V3 GB300 rows, -13.7 -> -15.7%: MLA's backward measured at
    0.46-0.52 of the GB300's peak where the flat efficiency was 0.55), bounded at 16%."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE)
    rows = rows[rows.cuda_graph == "full_iteration"]
    table = pd.DataFrame([bench.predict(r) for _, r in rows.iterrows()])
    ok = table[table.expressible]
    assert len(ok) == 20
    err = ok.throughput_error.abs()
    assert err.mean() <= TARGETS[0] and err.max() <= 0.16 and ok.fits.all(), ok


def test_dgx_cloud_rows_ran_their_nemo_2504_recipes():
    """NeMo 25.04 at the commit the DGX Cloud recipes pin (ASSUMED["DGX Cloud 25.04 recipes"]):
    both models with token drop (balanced); Llama 4 in performance mode (bf16 gradients: the
    nemo preset), DeepSeek-V3 without it (fp32 gradients) with the shared-expert overlap and
    its launch.sh recompute modules (mla_up_proj on H100, core_attn on GB200)."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    llama = bench.runtime_of(rows.loc["DGXC2505-LLAMA4MAV-H100-512-BF16"])
    assert llama.moe_load_imbalance == 1.0 and llama.grad_reduce_bytes == 2
    dsv3 = rows.loc["DGXC250504-DSV3-H100-1024-BF16"]
    runtime = bench.runtime_of(dsv3)
    assert runtime.moe_load_imbalance == 1.0 and runtime.grad_reduce_bytes == 4
    assert runtime.moe_shared_expert_overlap
    assert _recompute(dsv3) == ("none", "mla_up_proj")
    assert _recompute(rows.loc["DGXC250504-DSV3-GB200-256-BF16"]) == ("selective", "none")


def test_nemo_2_token_drop_rows_read_their_graphs_and_tp_overlap_from_their_recipes():
    """ASSUMED["per-layer CUDA graphs"], ["TP comm overlap"], ["NeMo Framework Mixtral"]: the
    rows whose scripts turned on Megatron-Core's per-layer CUDA graphs over drop-and-pad MoE
    layers have no MoE host time; DGX Cloud's Llama 4 H100 rows overlap TP communication (TE
    userbuffers), DeepSeek-V3's and Mixtral's do not; Llama 4 Scout's 25.07 run dropped tokens."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    graphed = [
        "NEMOFW2502-MIXTRAL8X7B-B200-64",
        "NEMOFW2504-MIXTRAL8X7B-GB200-64",
        "NEMOFW2507-LLAMA4SCOUTLLM-GB200-64",
        "DGXC2505-LLAMA4MAV-H100-512-FP8",
    ]
    for name in graphed:
        rt = bench.runtime_of(rows.loc[name])
        assert rt.moe_load_imbalance == 1.0, name
        assert (rt.moe_layer_host_s, rt.moe_expert_host_s) == (0.0, 0.0), name
    for name in ("NEMOFW2502-MIXTRAL8X22B-B200-256", "DGXC2505-LLAMA4MAV-H100-512-BF16"):
        assert bench.runtime_of(rows.loc[name]).moe_layer_host_s > 0, name
    assert rows.cuda_graph[rows.cuda_graph == "layer"].index.tolist() == [
        n for n in rows.index if n in graphed
    ]
    maverick_h100 = rows.index.str.contains("LLAMA4MAV-H100")
    assert all(bench.strategy_of(r).async_tp for _, r in rows[maverick_h100].iterrows())
    others = rows[~maverick_h100]
    assert not any(bench.strategy_of(r).async_tp for _, r in others.iterrows())


def test_bridge_2604_01_deepseek_b200_ran_deepep_with_the_a2a_overlap():
    """The 26.04.01 preset for DeepSeek-V3 on B200 (tag v0.4.2, FP8_MX_V2: pp8 vp2 ep32 over
    4 nodes) sets moe_flex_dispatcher_backend deepep and moe_a2a_overlap True
    (ASSUMED["Bridge 26.04.01 DeepSeek-V3 B200"]): -55% as the alltoall dispatcher, -7% so."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    runtime = bench.runtime_of(rows.loc["MB260401-DEEPSEEKV3-B200-256-MXFP8"])
    assert runtime.moe_dispatcher == "deepep"
    assert runtime.moe_a2a_overlap == bench.RUNTIMES["megatron-core"].moe_a2a_overlap_when_on


def test_deepseek_v3_rows_train_mtp_and_split_as_their_recipes():
    """ASSUMED["multi-token prediction"] and ["pipeline layout"]: Megatron-Bridge's DeepSeek-V3
    layout map puts one decoder layer with the MTP module and the loss in the last of 16
    chunks; the 25.09 'Et|(tt|)*30mL' runs 32 chunks (vp from the layout), its last chunk
    empty (the MTP module and the loss); NeMo 25.04 puts 64/pp - 1 layers first
    and 64/pp - 2 last."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    b200 = rows.loc["MB2602-DEEPSEEKV3-B200-256-MXFP8"]  # pp16
    s = bench.strategy_of(b200)
    assert s.pipeline_split == (4,) * 15 + (1,) and b200.mtp_layers == 1
    assert bench.model_of(b200).mtp_layers == 1
    s = bench.strategy_of(rows.loc["MB2509-DEEPSEEKV3TOKENDROP-B200-256-FP8"])
    assert s.virtual_stages == 2 and s.pipeline_split[:2] == (1, 2)
    assert s.pipeline_split[-1] == 0 and s.pipeline_split[-17] == 2  # rank 15: 2 + MTP, loss
    assert [sum(s.pipeline_split[r::16]) for r in (0, 1, 15)] == [3, 4, 2]
    dgxc = bench.strategy_of(rows.loc["DGXC250504-DSV3-H100-1024-BF16"])
    assert dgxc.pipeline_split == (3,) + (4,) * 14 + (2,)
    assert rows.loc["MB2511-DEEPSEEKV3WOMTP-GB300-256-BF16"].mtp_layers == 0
    assert rows.loc["AUTOMODEL-DEEPSEEKV3671B-H100-256"].mtp_layers == 0
    assert _recompute(rows.loc["MB2509-DEEPSEEKV3TOKENDROP-GB200-256-FP8"]) == (
        "none",
        "mla_up_proj+mlp+moe_act",
    )


def test_model_zoo_rows_force_balance_and_count_embedding_and_loss_as_layers():
    """The Model Zoo's H100 Qwen3-235B rows ran its launch script (--moe-router-force-load-
    balancing in every command, examples/qwen3/run_235b.sh @31c5686) and model config
    (--account-for-embedding-in-pipeline-split / -loss-: 94 + 2 layers over the chunks)."""
    bench = _bench()
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    cross = rows.loc["MZOO-QWEN3-235BCROSSNODEEP-H100-256"]
    assert bench.runtime_of(cross).moe_load_imbalance == 1.0
    dropless = rows.loc["MZOO-QWEN3-235B-LC16K-DROPLESS-H100-256"]
    assert bench.runtime_of(dropless).moe_load_imbalance > 1.0
    split = bench.strategy_of(cross).pipeline_split  # pp8 vp4: [E+2][3]x30[2+L]
    assert split == (2,) + (3,) * 30 + (2,) and sum(split) == 94
    a2a = bench.strategy_of(rows.loc["MZOO-QWEN3-235BINTRANODEEPA2A-H100-256"])  # pp32 vp3
    assert a2a.pipeline_split == (0,) + (1,) * 94 + (0,)  # [E][1]x94[L]


def test_the_shipped_load_imbalance_is_the_one_the_forced_dropless_pairs_choose():
    """megatron-core's moe_load_imbalance was chosen against the Model Zoo's four forced /
    dropless pairs (choose_load_imbalance): a change to the model that moves the choice by more
    than the shipped value's rounding (0.01) plus 0.02 must choose it again, on purpose. The
    model's ratios at the shipped value are within 2.5% of the published ones (observed 1.1%
    at most with one flat attention efficiency, 2.1% with cuDNN's by shape: the 16k pair's
    attention is a smaller share of its step)."""
    bench = _bench()
    choice = bench.choose_load_imbalance(pd.read_csv(bench.TABLE))
    assert choice["chosen"] == pytest.approx(choice["shipped"], abs=0.03)
    for published, model in zip(choice["published_ratios"], choice["model_ratios_at_shipped"]):
        assert published > 1.05 and model == pytest.approx(published, rel=0.025)


def _offload_case(bench):
    """The Model Zoo's Qwen3-235B MXFP8 run on 256 GB200s, which offloads its experts' fc1
    and activation inputs (`offload_modules`: 'activation offloading required'), priced as it
    ran and without the offload."""
    rows = pd.read_csv(bench.TABLE).set_index("id", drop=False)
    row = rows.loc["MZOO-QWEN3-235B-GB200-MXFP8-4K-64N"]
    model, strategy = bench.model_of(row), bench.strategy_of(row)
    cluster = Cluster(gpu=bench.GPUS[row.gpu], n_nodes=32, gpus_per_node=8)
    ran = bench.runtime_of(row)
    without = dataclasses.replace(ran, activation_offload_modules=())
    return model, strategy, cluster, ran, without


def test_fine_grained_offload_frees_the_offloaded_inputs_and_the_run_fits():
    """Megatron-Core's --offload-modules expert_fc1 moe_act sends each MoE layer's expert input
    (its float8 copy: 1 byte x hidden) and the activation's input (gate and up, 2 x 2 bytes x
    the expert width) to the host; the device keeps those of the two layers at work. Without it
    the run would hold 183.6 GiB, 99.2% of the GB200's 189,471 MiB (no headroom for the
    allocator's fragmentation: the recipe offloads); with it 77.3 GiB."""
    bench = _bench()
    model, strategy, cluster, ran, without = _offload_case(bench)
    assert ran.activation_offload_modules == ("expert_fc1", "moe_act")
    on = AnalyticCostModel(model, cluster, runtime=ran).estimate(strategy)
    off = AnalyticCostModel(model, cluster, runtime=without).estimate(strategy)
    assert on.fits and off.peak_memory_bytes / off.memory_capacity_bytes > 0.99
    per_row = model.hidden_size * 1 + 2 * model.moe.ffn_hidden_size * 2
    rows = strategy.micro_batch_size * model.seq_len * model.moe.top_k  # tp 1, etp 1
    cm = AnalyticCostModel(model, cluster, runtime=ran)
    n = max(experts.rank_moe_layers(strategy, cm._context))
    s = strategy
    in_flight = microbatches_in_flight(
        s.pipeline_schedule, s.pp, s.grad_accum_steps, s.virtual_stages
    )
    freed = off.memory.activations_bytes - on.memory.activations_bytes
    assert freed == pytest.approx((in_flight * n - 2) * rows * per_row, rel=1e-9)
    # its copies over NVLink-C2C (225 GB/s per GPU, 0.8 of it) hide behind the layers'
    # compute only in part: the step is longer than without the offload
    assert on.step_time_s > off.step_time_s


def test_an_unpriced_offload_module_is_refused_by_name():
    with pytest.raises(SpecError, match="offload_modules 'core_attn'.*expert_fc1, moe_act"):
        bench = _bench()
        bench.RUNTIMES["megatron-core"].as_run(offload_modules="expert_fc1+core_attn")
