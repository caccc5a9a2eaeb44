"""Hybrid models (Mamba-2, attention and MLP layers: Nemotron-H, Nemotron 3) priced by the
analytic cost model (`cost_models.terms.ssm`): each block differs from the base block
(attention + dense MLP) in its mixer, its MLP or both, and adds what its parts add.

Checked here: a Mamba-2 mixer's parameters and FLOPs from its shape, the search rules (tp splits
the Mamba heads and groups; cp is refused with the reason), estimates of Nemotron-H 8B that are
sane against a dense model of the same size, every part's terms reading the strategy fields they
declare, and the Engine still refusing to build Mamba blocks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from autosearch.core._ssm import GatedDeltaNetSpec, MambaSpec
from autosearch.core.model_spec import unbuilt, unpriced
from cost_models import AnalyticCostModel
from cost_models.terms import ssm

DATA = Path(__file__).parent / "data" / "hf_configs"
CLUSTER = Cluster.parse("h100-sxm:4x8")
# the runtime that trains hybrid blocks (cost_models/runtimes.yaml: mamba, gdn); the Engine
# (torch) and torchtitan do not, and refuse them (test_runtimes_that_do_not_train_hybrids_say_so)
RUNTIME = "megatron-core"
BASE = "global_batch_size=768,micro_batch_size=1,zero_stage=1,amp=bf16"


def _load(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(DATA / f"{name}.json", seq_len=8192, name=name)


def test_a_mamba_mixer_counts_as_megatron_and_transformers_build_it():
    """Nemotron-H 8B's mixer (h 4096, 128 heads of 64, d_state 128, 8 groups): in_proj to z,
    x, B, C, dt (2 * 8192 + 2 * 8 * 128 + 128 = 18,560 outputs), out_proj, the conv1d over x, B
    and C (10,240 channels, 4 taps and a bias), dt_bias, A_log, D and the gated norm."""
    mamba = MambaSpec(n_heads=128, head_dim=64, d_state=128, n_groups=8)
    assert mamba.in_proj_width == 18_560 and mamba.conv_dim == 10_240
    assert mamba.matmul_params(4096) == 4096 * 18_560 + 8192 * 4096
    assert mamba.other_params(4096) == 10_240 * 5 + 3 * 128 + 8192
    # Megatron-LM's MFU count: 7 * d_in * d_state per token for the scan
    assert mamba.scan_flops_per_token == 7 * 8192 * 128


def test_blocks_of_one_symbol_sum_per_kind():
    """`M`, `-` and `*` alone each count their own sublayer and norm: the 8B's 24 Mamba, 24 MLP
    and 4 attention layers; FLOPs as Megatron-LM counts a hybrid (GEMMs, the attention core over
    the attention layers only, the scan)."""
    m = _load("nemotron-h-8b")
    h, v = m.hidden_size, m.vocab_size
    mamba, mlp = m.mamba.params(h) + h, 2 * h * m.ffn_hidden_size + h  # type: ignore[union-attr]
    attention = m.attention_matmul_params + h
    assert m.n_params == 24 * mamba + 24 * mlp + 4 * attention + 2 * v * h + h
    gemms = 24 * m.mamba.matmul_params(h) + 24 * 2 * h * m.ffn_hidden_size  # type: ignore[union-attr]
    gemms += 4 * m.attention_matmul_params
    core = 4 * 2 * 2 * m.attention_hidden_size * m.seq_len
    scan = 24 * 7 * m.mamba.d_inner * m.mamba.d_state  # type: ignore[union-attr]
    assert m.flops_per_token(training=False) == 2 * gemms + 2 * v * h + core + scan


def test_hybrids_are_priced_and_the_reference_model_builds_their_blocks():
    """Every kind of block builds (autosearch/models/ssm.py); Nemotron 3 Nano's squared-ReLU
    experts under an aux-loss-free router do not."""
    for name in ("nemotron-h-8b", "nemotron-3-nano-30b-a3b"):
        assert unpriced(_load(name)) == []
    assert unbuilt(_load("nemotron-h-8b")) == []
    assert unbuilt(_load("nemotron-3-nano-30b-a3b")) == [
        "mixture-of-experts layers of relu2 experts (SwiGLU only)",
        "moe.load_balancing aux_loss_free (the expert bias updates)",
    ]


def test_nemotron_h_8b_estimate_is_sane():
    """Nemotron-H 8B at 8,192 tokens on 32 H100s: a plausible MFU, and against Llama 3 8B (a
    dense model of about its size, 32 attention layers) a shorter step (4 attention layers of
    the 8B's 28 blocks), parameters in memory in proportion to the counts, and a memory that
    falls with tp."""
    m, llama = _load("nemotron-h-8b"), ModelSpec.load("llama3-8b").scaled(seq_len=8192)
    s = Strategy.parse(f"dp=16,tp=2,sequence_parallel=true,{BASE}")
    r = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME).estimate(s)
    dense = AnalyticCostModel(llama, CLUSTER, runtime=RUNTIME).estimate(s)
    assert 0.25 < r.mfu < 0.65
    assert r.step_time_s < dense.step_time_s
    per_param = r.memory.params_bytes / m.n_params
    assert per_param == pytest.approx(dense.memory.params_bytes / llama.n_params, rel=1e-3)
    tp4 = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME).estimate(
        Strategy.parse(f"dp=8,tp=4,sequence_parallel=true,{BASE}")
    )
    assert tp4.peak_memory_bytes < r.peak_memory_bytes


@pytest.mark.parametrize(
    "strategy",
    [
        f"dp=8,tp=2,pp=2,sequence_parallel=true,{BASE}",
        f"dp=4,tp=2,pp=4,pipeline_schedule=interleaved_1f1b,virtual_stages=2,{BASE}",
        f"dp=32,recompute=full,{BASE}",
        f"dp=16,tp=2,recompute=selective,{BASE}",
    ],
)
def test_hybrid_estimates_under_pipeline_and_recompute(strategy):
    for name in ("nemotron-h-8b", "nemotron-3-nano-30b-a3b"):
        cm = AnalyticCostModel(_load(name), CLUSTER, runtime=RUNTIME)
        s = Strategy.parse(strategy)
        r = cm.estimate(s)
        assert r.step_time_s > 0 and r.memory.activations_bytes > 0
        cm.balanced_split(s)  # weighs each block by its parts


def test_tp_must_divide_the_mamba_heads_and_groups():
    m = dataclasses.replace(
        _load("nemotron-h-8b"),
        mamba=MambaSpec(n_heads=128, head_dim=64, d_state=128, n_groups=2),
    )
    with pytest.raises(SpecError, match="does not divide the Mamba-2 mixer's 128 heads and 2"):
        Strategy.parse(f"dp=8,tp=4,{BASE}").validate(m, CLUSTER)
    Strategy.parse(f"dp=16,tp=2,{BASE}").validate(m, CLUSTER)


def test_context_parallel_is_refused_for_mamba_layers_with_the_reason():
    with pytest.raises(SpecError, match="cp=2 with Mamba-2 layers is not priced"):
        Strategy.parse(f"dp=16,cp=2,{BASE}").validate(_load("nemotron-h-8b"), CLUSTER)


def test_a_mamba_spec_says_what_is_wrong():
    with pytest.raises(SpecError, match="mamba.n_heads 12 must be a multiple of mamba.n_groups 8"):
        MambaSpec(n_heads=12, head_dim=64).check()
    with pytest.raises(SpecError, match="no layer_pattern saying which layers are Mamba-2"):
        dataclasses.replace(ModelSpec.load("llama3-8b"), mamba=MambaSpec(n_heads=8, head_dim=64))


@pytest.mark.parametrize("term", [ssm.mamba_part, ssm.no_mixer_part, ssm.no_mlp_part])
def test_part_terms_read_what_they_declare(term):
    from test_terms import CASES, fields_each_reads, undeclared_and_unread

    cm = AnalyticCostModel(_load("nemotron-h-8b"), CLUSTER, runtime=RUNTIME)
    read = fields_each_reads(lambda s, x: term(x, cm._context), CASES)
    undeclared, _ = undeclared_and_unread(term.READS, read)
    assert not undeclared


@pytest.mark.parametrize("name", ["nemotron-h-8b", "nemotron-h-56b", "nemotron-3-nano-30b-a3b"])
def test_catalog_hybrids_are_their_published_configs(name):
    assert ModelSpec.load(name) == _load(name)


def test_a_hybrid_round_trips_through_its_file_form():
    m = ModelSpec.load("nemotron-3-nano-30b-a3b")
    data = m.to_dict()
    assert data["mamba"]["n_groups"] == 8 and data["layer_pattern"].startswith("MEMEM*E")
    assert ModelSpec.from_dict(data) == m
    assert "mamba" not in ModelSpec.load("llama3-8b").to_dict()  # files as before the field


# ---- Gated DeltaNet (Qwen3-Next's linear attention) --------------------------------------------
def test_a_gated_deltanet_mixer_counts_as_transformers_builds_it():
    """Qwen3-Next 80B-A3B's linear-attention layer (h 2048, 16 key heads and 32 value heads of
    128, conv 4): the parameters of transformers' Qwen3NextGatedDeltaNet on the meta device."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(
        hidden_size=2048,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_hidden_layers=4,
    )
    with torch.device("meta"):
        layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    gdn = GatedDeltaNetSpec(n_k_heads=16, n_v_heads=32)
    assert gdn.params(2048) == sum(p.numel() for p in layer.parameters())


def _gdn_hybrid() -> ModelSpec:
    """Qwen3-Next's layout with dense MLPs: three Gated DeltaNet layers, then attention."""
    return dataclasses.replace(
        ModelSpec.load("llama3-8b").scaled(n_layers=32, seq_len=8192),
        layer_pattern="G-G-G-*-" * 8,
        gdn=GatedDeltaNetSpec(n_k_heads=16, n_v_heads=32),
        name="gdn-hybrid",
    )


def test_a_gated_deltanet_hybrid_is_priced_and_its_rules_hold():
    m = _gdn_hybrid()
    assert m.n_params != ModelSpec.load("llama3-8b").n_params
    s = Strategy.parse(f"dp=16,tp=2,sequence_parallel=true,{BASE}")
    r = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME).estimate(s)
    dense = AnalyticCostModel(
        ModelSpec.load("llama3-8b").scaled(seq_len=8192), CLUSTER, runtime=RUNTIME
    )
    assert 0.25 < r.mfu < 0.65 and r.step_time_s < dense.estimate(s).step_time_s
    with pytest.raises(SpecError, match="Gated DeltaNet mixer's 4 key heads"):
        Strategy.parse(f"dp=4,tp=8,{BASE}").validate(
            dataclasses.replace(m, gdn=GatedDeltaNetSpec(n_k_heads=4, n_v_heads=8)), CLUSTER
        )
    with pytest.raises(SpecError, match="cp=2 with Gated DeltaNet layers is not priced"):
        Strategy.parse(f"dp=16,cp=2,{BASE}").validate(m, CLUSTER)


def test_gdn_part_reads_what_it_declares():
    from test_terms import CASES, fields_each_reads, undeclared_and_unread

    cm = AnalyticCostModel(_gdn_hybrid(), CLUSTER, runtime=RUNTIME)
    read = fields_each_reads(lambda s, x: ssm.gdn_part(x, cm._context), CASES)
    undeclared, _ = undeclared_and_unread(ssm.gdn_part.READS, read)
    assert not undeclared


def test_runtimes_that_do_not_train_hybrids_say_so():
    """torchtitan and DeepSpeed have no Mamba-2 layer, and the Engine's (torch) plain-PyTorch
    scans are not what the ssm terms price (autosearch/core/runtime.py MODEL_FEATURES): a hybrid
    priced under them is refused naming the runtime that trains it, not priced as if it ran."""
    for runtime in ("torch", "torchtitan", "deepspeed"):
        with pytest.raises(SpecError, match=r"not train Mamba-2 mixers.*--runtime megatron-core"):
            AnalyticCostModel(_load("nemotron-h-8b"), CLUSTER, runtime=runtime)
