"""Fidelity on published mixture-of-experts training runs (benchmarks/reference/moe_runs.csv:
Megatron-Bridge performance summaries, the Megatron-MoE model zoo, DGX Cloud recipes, NeMo
Automodel; DeepSeek-V3, Qwen3-30B-A3B / 235B-A22B, Llama 4, Kimi-K2 ...).

Every row becomes a ModelSpec, a Cluster and a Strategy, scored by the analytic cost model under
the row's release preset (its `runtime` column: cost_models/runtimes.yaml) with the shipped
hardware profiles: one set of constants for all rows, none chosen per row and none in this
file. What a row's run set (its routing, dispatcher, all-to-all overlap, CUDA graphs, gradient
precision, recompute modules, pipeline layout, MTP) is a column of the table, applied as the
library applies it (`RuntimeOptions.as_run`, `Strategy`); `ASSUMED` below says where each
column's values come from and what a row leaves out, and is written to the summary.

Reports, per source group: throughput MAPE (tokens/s per GPU, or step time), worst row, and
whether every published run is predicted to fit. Targets (issue 19): throughput MAPE <= 10% per
group, no row beyond 25%, every published run predicted to fit.

Run: python benchmarks/fidelity_moe.py [--gpus h100-sxm,...]   (writes results/fidelity_moe.csv
and results/fidelity_moe_summary.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pandas as pd

from autosearch import Cluster
from autosearch.core import (
    RUNTIMES,
    HardwareProfile,
    ModelSpec,
    RuntimeOptions,
    SpecError,
    Strategy,
)
from cost_models import AnalyticCostModel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TABLE = HERE / "reference" / "moe_runs.csv"
GiB = float(1 << 30)
TARGET_MAPE, TARGET_WORST = 0.10, 0.25
# The profiles the rows' GPUs map to; Blackwell rows are scored where a profile exists.
GPUS = {
    "h100-sxm": "h100-sxm",
    "b200": "b200-sxm",
    "b300": "b300-sxm",
    "gb200": "gb200-nvl72",
    "gb300": "gb300-nvl72",
}
# The catalog model each row's architecture is (its n_layers and seq_len are the row's).
MODELS = {
    "Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen3-235B-A22B": "qwen3-235b-a22b",
    "DeepSeek-V3 671B": "deepseek-v3",
    "Mixtral-8x7B": "mixtral-8x7b",
    "Mixtral-8x22B": "mixtral-8x22b",
    "Llama-4-Maverick-17B-128E (text)": "llama4-maverick",
    "Llama-4-Scout-17B-16E (text)": "llama4-scout",
    "Qwen3-Next-80B-A3B": "qwen3-next-80b-a3b",
}

ASSUMED = {
    "etp": "blank -> 1 (the Megatron-Bridge Qwen3 and DeepSeek-V3 recipes the rows quote set"
    " expert_tensor_parallel_size 1)",
    "sequence parallel": "tp > 1 -> on (Megatron-Core requires it with expert parallelism)",
    "megatron optimizer": "DDP + distributed optimizer -> zero_stage 1; Megatron-FSDP and"
    " Automodel's FSDP2 -> zero_stage 3",
    "fp8": "any FP8 recipe (delayed, current, blockwise, MXFP8) -> tensorwise fp8 linears",
    "recompute": "none / not stated -> none; Megatron's recompute module lists -> the Strategy's"
    " recompute_modules (model zoo 'norm, act' -> layernorm+moe_act, 'selective: layernorm,"
    " moe' -> layernorm+moe, 'norm, act, shared_expert' -> layernorm+moe_act+shared_experts;"
    " fine-grained activation offloading is not modelled, its module recompute is);"
    " 'full' and Automodel's activation_checkpointing -> full",
    "DeepSeek-V3 / Kimi-K2 recipes": "Megatron-Bridge DeepSeek-V3 rows: selective granularity"
    " with recompute_modules [mla_up_proj, mlp] on H100 and [mla_up_proj] on Blackwell"
    " (scripts/performance/configs/deepseek/deepseek_llm_pretrain.py @013284246); Kimi-K2"
    " [mla_up_proj] (kimi recipe); DGX Cloud DeepSeek-V3 (dgxc-benchmarking"
    " deepseek_v3/pretraining/launch.sh @1f6d9f4, v25.05.04: --recompute_modules RM, RM"
    " 'mla_up_proj' on h100 and 'core_attn' on gb200) -> mla_up_proj on H100, the attention core"
    " (selective) on GB200",
    "gradient reduction": "Megatron-Bridge Qwen3 and DeepSeek-V3 recipes set"
    " grad_reduce_in_fp32 False (set_qwen3_common_configs, set_deepseek_v3_common_configs)"
    " -> grad_reduce_in_fp32 false (bf16 gradients, as the nemo preset); DGX Cloud: see its"
    " entry; the NeMo Framework performance summary rows (25.02, 25.04, 25.07) ran NeMo 2's"
    " scripts/performance/llm, which set recipe.trainer.plugins.grad_reduce_in_fp32 = False"
    " ('# bf16 grad dtype', pretrain_mixtral_8x22b.py of early NeMo 2) -> their release"
    " presets nemo-25.02 / -25.04 / -25.07 as they are (bf16 gradients)",
    "DGX Cloud 25.04 recipes": "the DGX Cloud rows ran NeMo 25.04 (v2.3.0)"
    " scripts/performance/llm: pretrain_llama4_e128.py builds pretrain_recipe(performance_mode"
    "=True), whose pretrain_performance_optimizations (recipes/llama4_e128.py) add"
    " MegatronTokenDropCallback and set grad_reduce_in_fp32 False -> token drop (capacity"
    " factor 1.0, padded to capacity: balanced) and the nemo preset (bf16 gradients);"
    " pretrain_deepseek_v3.py builds pretrain_recipe() without performance_mode (bf16_mixed:"
    " fp32 gradient reduction -> the megatron-core preset) and adds MegatronTokenDropCallback"
    " (USE_TOKEN_DROP = True) -> balanced; its DeepSeekConfig sets moe_shared_expert_overlap"
    " True (gpt/model/deepseek.py) -> the shared experts overlap the dispatch. All at the NeMo"
    " commit the recipes pin (setup.sh NEMO_COMMIT 7a8f1cc7, llmb-nemo-r2.3.0)",
    "Bridge H100 recipes": "Megatron-Bridge 26.x H100 presets as the Python presets set them"
    " (scripts/performance/configs/qwen/qwen3_workload_base_configs.py, H100 V1/V2):"
    " Qwen3-235B moe_a2a_overlap True with the alltoall dispatcher -> A2A overlap (as the 25.11"
    " recipe states); Qwen3-30B ep16 pp1 moe_flex_dispatcher_backend hybridep, moe_a2a_overlap"
    " False -> DeepEP-style dispatcher; the 26.02 release's own preset (tag v0.3.0) for the"
    " Qwen3-30B pp2 row: pp2 vp12, moe_flex_dispatcher_backend deepep, moe_a2a_overlap True"
    " -> both. The 25.09 Qwen3 rows: run_script.py @fa0315ae2 applies token drop and TP comm"
    " overlap and names no dispatcher: preset defaults",
    "Bridge 26.02 Qwen3-235B B300": "the release's preset (tag v0.3.0,"
    " qwen3_workload_base_configs.py QWEN3_235B_A22B_PRETRAIN_CONFIG_B300_FP8_CS_V2: pp8 vp4"
    " ep8, no CUDA graphs): moe_a2a_overlap True -> the A2A overlap (26.02.01's tag is not"
    " known: its row keeps the preset's)",
    "Bridge 25.09 DeepSeek-V3 H100": "scripts/performance/run_script.py @fa0315ae2 (the"
    " script the 25.09 rows ran): on h100 enable_deepep (moe_token_dispatcher_type flex,"
    " moe_enable_deepep), moe_router_force_load_balancing, overlap_moe_expert_parallel_comm"
    " and delay_wgrad_compute on, moe_shared_expert_overlap off -> DeepEP dispatcher with the"
    " EP A2A overlap",
    "Bridge full-iteration CUDA graphs": "the Blackwell MXFP8 presets of Megatron-Bridge 26.06"
    " (tag v0.5.0, scripts/performance/configs/{qwen,deepseek}/*_workload_base_configs.py:"
    " Qwen3-30B GB200/GB300/B300, Qwen3-235B V2 GB200/GB300, DeepSeek-V3 GB200/GB300), 26.06.01"
    " (v0.5.1: also Qwen3-30B and 235B on B200/B300, DeepSeek-V3 B300) and 26.08 (v0.6.0,"
    " src/megatron/bridge/perf_recipes/*/*: _enable_hybridep_full_iteration_mxfp8,"
    " _enable_deepseek_full_iteration_mxfp8) set cuda_graph_impl full_iteration and"
    " moe_a2a_overlap True (overlap_moe_expert_parallel_comm) -> no host time per MoE layer"
    " (moe_layer_host_s 0: the host launches one graph per iteration) and the A2A overlap; the"
    " DeepSeek-V3 GB300 MXFP8 preset of these releases sets recompute_modules [] -> none."
    " Earlier releases' Blackwell presets capture only attn / moe_router / moe_preprocess"
    " (cuda_graph_impl transformer_engine): the preset's host time stays",
    "Bridge 26.04.01 DeepSeek-V3 B200": "the release's preset (tag v0.4.2,"
    " deepseek_workload_base_configs.py DEEPSEEK_V3_PRETRAIN_CONFIG_B200_FP8_MX_V2: pp8 vp2"
    " ep32): moe_flex_dispatcher_backend deepep, moe_a2a_overlap True, recompute_modules"
    " [mla_up_proj, mlp] -> DeepEP with the A2A overlap, those modules",
    "Automodel gradient accumulation": "Automodel runs each of its grad_accum local batches"
    " as a whole pipeline schedule (recipes/llm/benchmark.py: the ga_steps loop calls"
    " _forward_backward_step, i.e. schedule.step, once per local batch): a row with pp > 1 is"
    " scored as one local batch (global batch / grad_accum), whose tokens/s and peak memory"
    " the step repeats",
    "Automodel DeepSeek-V3 1,024 GPUs": "recompute not stated -> full, as the 256-GPU row's"
    " benchmark config (deepseek_v3_te_deepep.yaml, activation_checkpointing: true)",
    "routing": "forced balance, fake balanced gate, token-drop (capacity factor 1 in the"
    " Bridge tokendrop recipes) -> balanced (moe_load_imbalance 1); the Model Zoo's 4k H100"
    " Qwen3-235B rows -> forced balance (moe_runs.csv: --moe-router-force-load-balancing in"
    " every command of examples/qwen3/run_235b.sh @31c5686, committed with their table);"
    " 'dropless, real routing' and not stated -> the runtime's moe_load_imbalance",
    "dispatcher": "DeepEP where the row or its recipe says so (Model Zoo, Bridge: see the"
    " recipe entries) -> moe_dispatcher deepep; else the preset's (megatron-core alltoall,"
    " automodel deepep)",
    "ambiguous rows": "a row whose published figure contradicts its neighbours (same layout,"
    " another release) with no stated cause is flagged AMBIGUOUS in moe_runs.csv's note: scored"
    " and counted, and its group reported also without it (`without_ambiguous`)",
    "NeMo Framework Mixtral": "NeMo 25.02 / 25.04 performance mode"
    " (recipes/mixtral_8x7b.py, mixtral_8x22b.py, mixtral_8x22b_64k.py at v2.2.0 / v2.3.0:"
    " pretrain_performance_optimizations adds MegatronTokenDropCallback, capacity factor 1.0,"
    " padded) -> balanced (balanced_routing true), as the DGX Cloud rows; Llama 4 Scout on"
    " GB200 (25.07, NeMo v2.4.0: scripts/performance/llm/pretrain_llama4_e16.py builds"
    " pretrain_recipe(performance_mode=True), whose recipes/llama4_e16.py"
    " pretrain_performance_optimizations adds MegatronTokenDropCallback) -> balanced too",
    "per-layer CUDA graphs": "Megatron-Core's enable_cuda_graph (CudaGraphManager replays the"
    " whole TransformerLayer, megatron-core 0.12 transformer_layer.py __call__; the drop-and-pad"
    " MoE layer has static shapes and no device-to-host sync, token_dispatcher.py preprocess)"
    " -> cuda_graph layer (no host time of a MoE layer): Mixtral 8x7B on B200 in 25.02 (NeMo"
    " v2.2.0 scripts/llm/performance/pretrain_mixtral_8x7b.py: enable_cuda_graph = gpu in"
    " ['b200']), on GB200 in 25.04 (v2.3.0 recommended_model_configs/model_configs_gb200.csv:"
    " cuda_graphs 1), Llama 4 Scout on GB200 in 25.07 (v2.4.0 model_configs_gb200.csv:"
    " cuda_graphs 1), DGX Cloud's Llama 4 Maverick H100 FP8 (dgxc-benchmarking llama4/launch.sh"
    " @1f6d9f4: CUDA_GRAPH true for fp8 on h100). Mixtral 8x22B (model_configs_b200.csv"
    " cuda_graphs 0 at v2.3.0; no switch in v2.2.0's script), Maverick on GB200 (launch.sh"
    " CUDA_GRAPH false) and DeepSeek-V3 (recommended configs cuda_graphs 0) -> none",
    "TP comm overlap": "TE userbuffers' overlap (tp_comm_overlap column -> Strategy async_tp):"
    " DGX Cloud's Llama 4 Maverick recipe sets MegatronCommOverlapCallback(tp_comm_overlap=True)"
    " (NeMo 7a8f1cc7 recipes/llama4_e128.py pretrain_performance_optimizations; tp 4 with"
    " sequence parallel on H100) -> on; DeepSeek-V3 (scripts/performance/llm/"
    "pretrain_deepseek_v3.py: tp_comm_overlap=False) and Mixtral (the recipes' callback leaves"
    " it None, which MegatronCommOverlapCallback._get_model_comm_overlap_cfgs keeps False) ->"
    " off; every other row -> off (the preset's tp_overlap)",
    "a2a overlap": "rows that turn on Megatron's EP A2A overlap (moe_a2a_overlap True,"
    " '1f1b overlap') -> the preset's moe_a2a_overlap_when_on",
    "micro batch": "blank (Model Zoo long-context rows) -> 1",
    "Kimi-K2": "DeepSeek-V3's layout with 384 experts, 64 heads, 1 dense layer, vocab 163840"
    " (moonshotai/Kimi-K2-Instruct config.json)",
    "Automodel runtime": "PyTorch FSDP2 + TE + DeepEP -> the automodel preset (torchtitan's"
    " torch stack with TE kernels, DeepEP, and bf16 parameters and Adam moments as its"
    " benchmark configs build the model)",
    "multi-token prediction": "DeepSeek-V3 rows train one MTP module where their recipe"
    " does: Megatron-Bridge's deepseek_v3 recipe (mtp_num_layers=1 at every tag from v0.1.0rc4"
    " to v0.6.0; no performance preset changes it) except the rows labelled 'w/o MTP'; NeMo"
    " 25.04's pretrain_recipe(use_mtp=True) (recipes/deepseek_v3.py @7a8f1cc7) for DGX Cloud;"
    " other sources (Automodel, Kimi-K2: kimi_provider mtp_num_layers None) -> none",
    "pipeline layout": "DeepSeek-V3 rows split their 61 layers as their recipe does"
    " (Strategy.pipeline_split, layers per chunk): Megatron-Bridge's"
    " set_deepseek_v3_pipeline_model_parallel_layout map (recipes/deepseek/deepseek_v3.py, the"
    " same from v0.1.0rc4 to v0.6.0): 16 chunks (pp16; pp8 vp2; pp4 vp4; pp2 vp8, also the"
    " GB300 preset's 'Et*4|(t*4|)*14tmL') [E+4][4]x14[1+mtp+loss], pp8 [E+8][8]x6[5+mtp+loss],"
    " pp4 [E+16][16][16][13+mtp+loss]; the 25.09 rows' deepseek_v3_llm_pretrain.yaml @fa0315ae2"
    " and the 25.11 H100 preset set 'Et|(tt|)*30mL' (32 chunks: [E+1][2]x30[mtp+loss]),"
    " whose vp Megatron-Core takes from the layout (32 / pp: the B200 row's pp16 runs vp2, the"
    " GB200 pp4 vp8; the table prints vp 1 and 4); empty chunks as they are"
    " (Strategy.pipeline_split takes 0). Megatron-MoE Model Zoo"
    " Qwen3-235B-A22B rows: --account-for-embedding-in-pipeline-split and"
    " --account-for-loss-in-pipeline-split (model_configs/benchmarking/Qwen3-235B-A22B.yaml,"
    " every version b06a6d8 to 798dfb5): the 94 layers + 2 split evenly (pp8 vp4:"
    " [E+2][3]x30[2+L]; pp32 vp3: [E][1]x94[L]). DGX Cloud (NeMo 25.04"
    " pretrain_deepseek_v3.py @7a8f1cc7): num_layers_in_first_pipeline_stage 64/pp - 1,"
    " last 64/pp - 2. Other rows: the even split",
    "Bridge 25.09 DeepSeek-V3 Blackwell recompute": "run_script.py @fa0315ae2 sets"
    " recompute_modules [mla_up_proj, mlp, moe_act] on gb200 and none on b200, where the"
    " recipe leaves Megatron-Core's default ([core_attn], selective granularity) -> the"
    " attention core on B200",
    "model FLOPs": "rows published as model TFLOP/s without a step time are converted to"
    " tokens/s with Megatron-LM's num_floating_point_operations (causal-halved attention):"
    " ModelSpec.flops_per_token less half its attention term and less the routers",
}


def group_of(row: pd.Series) -> str:
    gpu = {"h100-sxm": "H100"}.get(row.gpu, row.gpu.upper())
    source = row.source.split(" ")[0]
    name = {
        "NVIDIA-NeMo/Megatron-Bridge": "Megatron-Bridge",
        "yanring/Megatron-MoE-ModelZoo": "MoE Model Zoo",
        "NVIDIA/dgxc-benchmarking": "DGX Cloud",
        "NVIDIA-NeMo/Automodel": "NeMo Automodel",
    }.get(source, "NVIDIA other")
    return f"{name} {gpu}"


def model_of(row: pd.Series) -> ModelSpec:
    name = str(row.model).split(" [")[0]
    if name.startswith("Kimi-K2"):  # ASSUMED["Kimi-K2"]
        base = ModelSpec.load("deepseek-v3")
        model = dataclasses.replace(
            base,
            name="kimi-k2",
            n_heads=64,
            n_kv_heads=64,
            vocab_size=163840,
            moe=dataclasses.replace(base.moe, n_experts=384, first_dense_layers=1),
        )
    elif name in MODELS:
        model = ModelSpec.load(MODELS[name])
    else:
        raise SpecError(f"{row.model}: architecture not transcribed in the table")
    layers = int(row.n_layers) if not pd.isna(row.n_layers) else model.n_layers
    mtp = _int(row.mtp_layers, 0)  # ASSUMED["multi-token prediction"]
    return model.scaled(n_layers=layers, seq_len=int(row.seq_len), mtp_layers=mtp)


def _int(value, default: int) -> int:
    return default if pd.isna(value) or str(value).strip() == "" else int(float(value))


def _flag(value) -> bool | None:
    """A true / false column; None where blank (the preset's own)."""
    return None if pd.isna(value) or str(value).strip() == "" else str(value).lower() == "true"


def strategy_of(row: pd.Series) -> Strategy:
    """The row's Strategy from its columns: the published layout (n_gpus, tp, pp, cp, ep, etp,
    micro and global batch) and what the run set (`zero_stage`, `virtual_stages`,
    `pipeline_split`, `recompute_granularity`, `recompute_modules`,
    `schedule_global_batch_size`, `tp_comm_overlap`: benchmarks/reference/README.md)."""
    n, tp, pp, cp = int(row.n_gpus), _int(row.tp, 1), _int(row.pp, 1), _int(row.cp, 1)
    v = _int(row.virtual_stages, 1)
    split = str(row.pipeline_split).split() if not pd.isna(row.pipeline_split) else []
    precision = str(row.precision).lower()
    return Strategy(
        dp=n // (tp * pp * cp),
        tp=tp,
        pp=pp,
        cp=cp,
        ep=_int(row.ep, 1),
        etp=_int(row.etp, 1),
        micro_batch_size=_int(row.micro_batch_size, 1),
        global_batch_size=_int(row.schedule_global_batch_size, int(row.global_batch_size)),
        pipeline_schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v,
        pipeline_split=tuple(int(x) for x in split) or None,
        recompute=str(row.recompute_granularity),
        recompute_modules=str(row.recompute_modules),
        sequence_parallel=tp > 1,  # ASSUMED["sequence parallel"]
        # TE userbuffers' TP communication overlap where the run's recipe turns it on
        # (`tp_comm_overlap`; ASSUMED["TP comm overlap"]): the runtime's async_tp_overlap
        async_tp=tp > 1 and _flag(row.get("tp_comm_overlap")) is True,
        zero_stage=_int(row.zero_stage, 1),
        amp="bf16",
        fp8="none" if precision.startswith("bf16") else "tensorwise",  # ASSUMED["fp8"]
    )


# NeMo 2's performance-summary releases and the key under which a fold of
# benchmarks/leave_one_family_out.py varies their Blackwell kernel efficiency
NEMO2_RELEASES = ("nemo-25.02", "nemo-25.04", "nemo-25.07")
NEMO2_BLACKWELL = "nemo-25 kernel_efficiency"
NEMO2_EXPERTS = "nemo-25 expert_kernel_efficiency"


def runtime_of(row: pd.Series, fields: dict | None = None) -> RuntimeOptions:
    """The row's release preset (its `runtime` column) as the run configured it (its
    `grad_reduce_in_fp32`, `moe_dispatcher`, `moe_a2a_overlap`, `moe_shared_expert_overlap`,
    `cuda_graph` (`full_iteration`, `layer`), `balanced_routing`, `offload_modules` columns:
    `RuntimeOptions.as_run`).
    `fields` replaces preset fields of the Megatron-Core presets first (what
    `leave_one_group_out` and `choose_load_imbalance` vary); its `NEMO2_BLACKWELL` and
    `NEMO2_EXPERTS` entries the Blackwell `kernel_efficiency` and `expert_kernel_efficiency`
    of the NeMo 2 releases."""
    rt = RUNTIMES[str(row.runtime)]
    fields = dict(fields or {})
    nemo = {
        "kernel_efficiency": fields.pop(NEMO2_BLACKWELL, None),
        "expert_kernel_efficiency": fields.pop(NEMO2_EXPERTS, None),
    }
    if fields and rt.framework == "megatron-core":
        rt = dataclasses.replace(rt, **fields)
    if rt.name in NEMO2_RELEASES:
        rt = dataclasses.replace(
            rt, **{k: (("blackwell", v),) for k, v in nemo.items() if v is not None}
        )
    return rt.as_run(
        grad_reduce_in_fp32=_flag(row.grad_reduce_in_fp32),
        moe_dispatcher=None if pd.isna(row.moe_dispatcher) else str(row.moe_dispatcher),
        moe_a2a_overlap=_flag(row.moe_a2a_overlap),
        moe_shared_expert_overlap=_flag(row.moe_shared_expert_overlap),
        full_iteration_cuda_graph=str(row.cuda_graph) == "full_iteration",
        layer_cuda_graph=str(row.cuda_graph) == "layer",
        balanced_routing=_flag(row.balanced_routing),
        offload_modules=None if pd.isna(row.get("offload_modules")) else str(row.offload_modules),
    )


def megatron_flops_per_token(model: ModelSpec) -> float:
    """Megatron-LM's num_floating_point_operations per token: 6 x matmul FLOPs with the
    attention's scores and values causal-halved (`ASSUMED["model FLOPs"]`), in the attention
    blocks and the MTP modules only (Megatron counts Gated DeltaNet's delta rule per token,
    `training.py` `linear_self_attn_term`, as `flops_per_token` does), and without the
    routers, which Megatron does not count (h x n_experts per MoE block)."""
    if model.mla is not None:
        per_key = model.n_heads * (model.mla.qk_head_dim + model.mla.v_head_dim)
    else:
        per_key = 2 * model.attention_hidden_size
    routers = 0.0
    if model.moe is not None:
        blocks = model.n_moe_layers + model.mtp_layers * model.moe_layers[-1]
        routers = 6.0 * model.hidden_size * model.moe.n_experts * blocks
    return model.flops_per_token() - 3.0 * per_key * model.attended_keys - routers


def published_tokens_per_s_per_gpu(row: pd.Series, model: ModelSpec) -> float:
    if row.metric == "tokens_per_s_per_gpu":
        return float(row.published)
    gbs_tokens = int(row.global_batch_size) * int(row.seq_len)
    if not pd.isna(row.published_step_time_s) and float(row.published_step_time_s) > 0:
        return gbs_tokens / float(row.published_step_time_s) / int(row.n_gpus)
    return float(row.published) * 1e12 / megatron_flops_per_token(model)


def predict(row: pd.Series, *, fields: dict | None = None) -> dict:
    out = {"id": row.id, "group": group_of(row), "gpu": row.gpu, "model": row.model}
    try:
        model = model_of(row)
        profile = GPUS[row.gpu]
        HardwareProfile.load(profile)  # a profile of this GPU exists
        n = int(row.n_gpus)
        cluster = Cluster(gpu=profile, n_nodes=max(1, n // 8), gpus_per_node=min(8, n))
        strategy = strategy_of(row)
        published = published_tokens_per_s_per_gpu(row, model)
        runtime = runtime_of(row, fields)
        cost_model = AnalyticCostModel(model, cluster, runtime=runtime)
        report = cost_model.estimate(strategy)
    except (SpecError, KeyError, ValueError) as exc:
        return {**out, "expressible": False, "error": str(exc)[:300]}
    tokens = report.tokens_per_s / cluster.world_size
    moe = _moe_seconds(cost_model, strategy)
    return {
        **out,
        "expressible": True,
        "runtime": runtime.name,
        "dispatcher": runtime.moe_dispatcher,
        "imbalance": runtime.moe_load_imbalance,
        "strategy": strategy.short(),
        "published_tokens_per_s_per_gpu": published,
        "predicted_tokens_per_s_per_gpu": tokens,
        "throughput_error": tokens / published - 1,
        "predicted_memory_gib": report.peak_memory_bytes / GiB,
        "fits": report.fits,
        "predicted_mfu": report.mfu,
        "ambiguous": "AMBIGUOUS" in str(row.note),
        **{f"time_{k}": v for k, v in report.time._asdict().items()},
        **moe,
        **{f"memory_{k}_gib": v / GiB for k, v in report.memory._asdict().items()},
    }


def _moe_seconds(cost_model: AnalyticCostModel, s: Strategy) -> dict:
    """What the MoE layers of the slowest pipeline rank add to a step (inside the report's
    compute and tp_comm terms): the experts' compute over a dense MLP's, the exposed
    all-to-all, and the runtime's host time (`moe_layer_host_s` per layer, `moe_expert_host_s`
    per local expert: added to the layer's GPU work, `experts.rank_s`; the column keeps its
    old name, host_floor). Read from the cost model's per-layer terms
    (`experts.layer`), for the diagnosis of a row, not a second estimate."""
    moe = cost_model.kind_terms[("mlp", "moe")]  # experts.MoELayers
    e = moe.expert_layer(s)  # the cached experts.layer(s, ctx)
    n = s.grad_accum_steps * max(moe.counts(s))
    return {
        "time_moe_experts_s": n * (e.fwd_s + e.bwd_s),
        "time_moe_a2a_s": n * 2.0 * e.comm_fwd_s,
        "time_moe_host_floor_s": n * e.host_s,
        "routed_rows_per_expert": e.rows / (cost_model.model.moe.n_experts / s.ep),
    }


def summarize(table: pd.DataFrame) -> dict:
    groups = {}
    for name, g in table.groupby("group"):
        ok = g[g.expressible]
        if ok.empty:
            groups[name] = {"rows": len(g), "expressible": 0}
            continue
        err = ok.throughput_error.abs()
        clear = ok[~ok.ambiguous.astype(bool)]  # rows whose source is not flagged AMBIGUOUS
        clear_err = clear.throughput_error.abs()
        groups[name] = {
            "rows": len(g),
            "expressible": int(ok.shape[0]),
            "throughput_mape": float(err.mean()),
            "worst_row": ok.id[err.idxmax()],
            "worst_error": float(ok.throughput_error[err.idxmax()]),
            "signed_mean_error": float(ok.throughput_error.mean()),
            "rows_beyond_25pct": int((err > TARGET_WORST).sum()),
            "all_fit": bool(ok.fits.all()),
            "meets_targets": bool(
                err.mean() <= TARGET_MAPE and err.max() <= TARGET_WORST and ok.fits.all()
            ),
            "ambiguous_rows": list(ok.id[ok.ambiguous.astype(bool)]),
            "without_ambiguous": {
                "rows": int(clear.shape[0]),
                "throughput_mape": float(clear_err.mean()) if len(clear) else None,
                "worst_error": float(clear.throughput_error[clear_err.idxmax()])
                if len(clear)
                else None,
                "rows_beyond_25pct": int((clear_err > TARGET_WORST).sum()),
            },
        }
    return groups


# The constants chosen against the table (fields of the Megatron-Core presets,
# cost_models/runtimes.yaml), each with the value it falls back to when left out.
CHOSEN = {
    "moe_load_imbalance": 1.0,  # the Model Zoo's forced / dropless pairs (choose_load_imbalance)
    "moe_layer_host_s": 0.0,  # with moe_expert_host_s: the Bridge's rows of every MoE family
    "moe_expert_host_s": 0.0,
    "moe_a2a_overlap_when_on": 0.0,  # the rows that turn Megatron's EP A2A overlap on
}


# The Model Zoo's long-context Qwen3-235B runs, each twice: forced load balance and dropless
# with real routing, the same layout otherwise (best_practice/qwen3/readme.md)
IMBALANCE_PAIRS = tuple(
    (f"MZOO-QWEN3-235B-LC{n}K-FORCEDBALANCE-H100-256", f"MZOO-QWEN3-235B-LC{n}K-DROPLESS-H100-256")
    for n in (16, 32, 64, 128)
)


def choose_load_imbalance(rows: pd.DataFrame) -> dict:
    """The `moe_load_imbalance` of megatron-core (and nemo) that makes the model's forced /
    dropless throughput ratio match the published one on `IMBALANCE_PAIRS` (scipy's bounded
    scalar minimiser, least squares on the log of the ratios' ratio). A ratio of one layout's
    two runs cancels what the two share (attention, tp, pp, dp terms and their errors), so
    only the routing's cost is fitted; the shipped preset's value is this one, rounded."""
    from scipy.optimize import minimize_scalar

    pairs = [(rows[rows.id == f].iloc[0], rows[rows.id == d].iloc[0]) for f, d in IMBALANCE_PAIRS]

    def ratios(imbalance: float) -> list[tuple[float, float]]:
        fields = {"moe_load_imbalance": imbalance}
        out = []
        for forced, dropless in pairs:
            a, b = predict(forced, fields=fields), predict(dropless, fields=fields)
            published = a["published_tokens_per_s_per_gpu"] / b["published_tokens_per_s_per_gpu"]
            out.append(
                (
                    published,
                    a["predicted_tokens_per_s_per_gpu"] / b["predicted_tokens_per_s_per_gpu"],
                )
            )
        return out

    def loss(imbalance: float) -> float:
        return sum(math.log(m / p) ** 2 for p, m in ratios(imbalance))

    best = minimize_scalar(loss, bounds=(1.0, 3.0), method="bounded", options={"xatol": 1e-3})
    shipped = RUNTIMES["megatron-core"].moe_load_imbalance
    return {
        "chosen": float(best.x),
        "shipped": shipped,
        "pairs": [f.removesuffix("-FORCEDBALANCE-H100-256") for f, _ in IMBALANCE_PAIRS],
        "published_ratios": [p for p, _ in ratios(shipped)],
        "model_ratios_at_shipped": [m for _, m in ratios(shipped)],
    }


def leave_one_group_out(rows: pd.DataFrame) -> dict:
    """Each H100 group predicted with each constant chosen against the table left out (at its
    fallback, `CHOSEN`), one at a time and all together: how much of a group's fit the
    constant carries."""
    out: dict = {}
    for left_out in (*CHOSEN, "all"):
        names = tuple(CHOSEN) if left_out == "all" else (left_out,)
        without = {n: CHOSEN[n] for n in names}
        for name in ("MoE Model Zoo H100", "Megatron-Bridge H100", "DGX Cloud H100"):
            subset = rows[rows.apply(group_of, axis=1) == name]
            table = pd.DataFrame([predict(r, fields=without) for _, r in subset.iterrows()])
            g = summarize(table).get(name)
            if g and g.get("expressible"):
                out.setdefault(left_out, {})[name] = {
                    k: g[k] for k in ("throughput_mape", "worst_error", "worst_row")
                }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "results" / "fidelity_moe.csv"))
    parser.add_argument("--gpus", default=",".join(GPUS), help="GPUs to score (table names)")
    args = parser.parse_args()
    rows = pd.read_csv(TABLE)
    rows = rows[rows.gpu.isin(args.gpus.split(","))]
    table = pd.DataFrame([predict(r) for _, r in rows.iterrows()])
    groups = summarize(table)
    pd.set_option("display.width", 220)
    cols = [
        "id",
        "strategy",
        "published_tokens_per_s_per_gpu",
        "predicted_tokens_per_s_per_gpu",
        "throughput_error",
        "predicted_memory_gib",
        "fits",
    ]
    print(table[table.expressible][cols].to_string(index=False, float_format="{:,.3g}".format))
    # the predicted step of each row, term by term (seconds; the MoE columns are parts of
    # compute and tp_comm, `_moe_seconds`)
    parts = ["compute", "recompute", "tp_comm", "moe_a2a", "moe_host_floor", "bubble"]
    parts += ["pp_comm", "dp_comm_exposed", "optimizer"]
    breakdown = table[table.expressible][["id", *(f"time_{p}_s" for p in parts)]]
    print(breakdown.rename(columns=lambda c: c.removeprefix("time_")).to_string(index=False))
    skipped = table[~table.expressible]
    for _, r in skipped.iterrows():
        print(f"not expressible: {r.id}: {r.error}")
    print()
    for name, g in groups.items():
        if not g.get("expressible"):
            print(f"{name:28s} rows {g['rows']:3d}  none expressible")
            continue
        print(
            f"{name:28s} rows {g['expressible']:3d}/{g['rows']:3d}  MAPE "
            f"{g['throughput_mape']:6.1%} (signed {g['signed_mean_error']:+.1%}, worst "
            f"{g['worst_error']:+.1%} {g['worst_row']}, beyond 25%: "
            f"{g['rows_beyond_25pct']})  all fit: {g['all_fit']}"
        )
        clear = g["without_ambiguous"]
        if g["ambiguous_rows"] and clear["rows"]:
            print(
                f"{'':28s} without the {len(g['ambiguous_rows'])} rows flagged AMBIGUOUS: MAPE"
                f" {clear['throughput_mape']:6.1%}, worst {clear['worst_error']:+.1%}, beyond"
                f" 25%: {clear['rows_beyond_25pct']}"
            )
    logo = leave_one_group_out(rows)
    imbalance = choose_load_imbalance(pd.read_csv(TABLE))
    print(
        f"moe_load_imbalance: the forced / dropless pairs choose {imbalance['chosen']:.3f}"
        f" (shipped {imbalance['shipped']}): published ratios "
        + ", ".join(f"{p:.3f}" for p in imbalance["published_ratios"])
        + "; the model's "
        + ", ".join(f"{m:.3f}" for m in imbalance["model_ratios_at_shipped"])
    )
    for left_out, by_group in logo.items():
        for name, g in by_group.items():
            print(
                f"{name} without {left_out}: MAPE {g['throughput_mape']:.1%},"
                f" worst {g['worst_error']:+.1%}"
            )
    table.to_csv(args.out, index=False)
    summary = {
        "groups": groups,
        "leave_one_group_out": logo,
        "load_imbalance_choice": imbalance,
        "assumed": ASSUMED,
        "constants": {
            "megatron-core moe_load_imbalance": RUNTIMES["megatron-core"].moe_load_imbalance,
            "torchtitan moe_load_imbalance": RUNTIMES["torchtitan"].moe_load_imbalance,
            "megatron-core moe_a2a_overlap_when_on": RUNTIMES[
                "megatron-core"
            ].moe_a2a_overlap_when_on,
            "megatron-core moe_layer_host_s": RUNTIMES["megatron-core"].moe_layer_host_s,
            "megatron-core moe_expert_host_s": RUNTIMES["megatron-core"].moe_expert_host_s,
        },
        "targets": {"throughput_mape": TARGET_MAPE, "worst_row": TARGET_WORST},
        "not_expressible": {r.id: r.error for _, r in skipped.iterrows()},
    }
    Path(args.out).with_name("fidelity_moe_summary.json").write_text(
        json.dumps(summary, indent=1, default=lambda x: None if math.isnan(x) else x)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
