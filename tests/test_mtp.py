"""Multi-token prediction (DeepSeek-V3 tech report, sec. 2.2): the model field read from Hugging
Face configs, its parameters and FLOPs, how the cost model prices it on the last pipeline rank
under the runtimes that train it, and the exports."""

from __future__ import annotations

from pathlib import Path

import pytest

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from autosearch.core import RUNTIMES
from autosearch.core.dimensions import RECOMPUTE_MODULE_SETS
from autosearch.export import export
from cost_models import AnalyticCostModel
from cost_models.terms import experts, memory, pipeline

DATA = Path(__file__).parent / "data" / "hf_configs"
B = 1e9


def toy(mtp: int = 1, **changes) -> ModelSpec:
    """A small dense Llama-style model with `mtp` prediction modules."""
    fields = dict(
        name="toy", n_layers=4, hidden_size=256, n_heads=4, ffn_activation="swiglu",
        vocab_size=1000, seq_len=128, mtp_layers=mtp,
    )  # fmt: skip
    return ModelSpec(**{**fields, **changes})


def test_deepseek_v3_trains_one_module_as_its_config_says():
    hf = ModelSpec.from_hf_config(DATA / "deepseek-v3.json", seq_len=4096)
    assert hf.mtp_layers == 1  # num_nextn_predict_layers
    v3 = ModelSpec.load("deepseek-v3")
    assert v3.mtp_layers == 1
    assert ModelSpec.load("deepseek-v2").mtp_layers == 0
    assert ModelSpec.from_hf_config(DATA / "mixtral-8x7b-v0.1.json").mtp_layers == 0


def test_mtp_parameters_match_the_published_count():
    """DeepSeek-V3 README_WEIGHTS.md: "11.5B unique parameters (excluding the shared 0.9B
    Embedding and 0.9B output Head)". Ours is the MoE block (11.51B), its norms and the
    2h -> h projection (0.10B), which the published figure appears to leave out: allowed on
    top of one unit of its last digit. The main model's 671B is unchanged."""
    v3 = ModelSpec.load("deepseek-v3")
    h = v3.hidden_size
    assert abs(v3.mtp_layer_params / B - 11.5) <= 0.1 + 2 * h * h / B
    assert v3.mtp_layer_params == v3.moe_layer_params + 3 * h + 2 * h * h
    assert v3.n_params == v3.scaled(mtp_layers=0).n_params  # 671B, MTP not counted


@pytest.mark.parametrize("bad", [-1, 1.5, True, "one", 65])
def test_bad_depths_are_refused_with_what_to_do(bad):
    with pytest.raises(SpecError, match="mtp_layers") as err:
        toy(mtp=bad)
    assert "0 for none" in str(err.value) or "limit" in str(err.value)


def test_flops_count_one_more_block_projection_and_head():
    """Per token, training: 6 x (a block's matmul weights + 2h^2 + V h) + 3 x 2 s (2 h) for
    the block's attention (full, not causal-halved, as the main layers)."""
    m, base = toy(), toy(mtp=0)
    h, s, V = m.hidden_size, m.seq_len, m.vocab_size
    block = m.layer_matmul_params + 2 * h * h + V * h
    assert m.flops_per_token() - base.flops_per_token() == 6 * block + 3 * 2 * s * 2 * h
    v3 = ModelSpec.load("deepseek-v3")  # a MoE last layer: its active experts only
    extra = v3.flops_per_token() - v3.scaled(mtp_layers=0).flops_per_token()
    active = v3.attention_matmul_params + v3._expert_params(v3.moe.top_k)
    per_key = v3.n_heads * (v3.mla.qk_head_dim + v3.mla.v_head_dim)
    hv = v3.hidden_size
    assert extra == 6 * (active + 2 * hv * hv + v3.vocab_size * hv) + 6 * per_key * v3.seq_len


def test_the_last_rank_runs_the_modules_as_layers_with_their_heads():
    """The compute the module adds to a step at pp 1: one layer's forward and backward and
    (1 + 2h/V) heads' worth of logits work, per micro-batch (`pipeline.heads`)."""
    cluster = Cluster.parse("h100-sxm:1x8")
    s = Strategy(dp=8, micro_batch_size=1, global_batch_size=16)
    with_mtp = AnalyticCostModel(toy(), cluster, runtime="megatron-core")
    without = AnalyticCostModel(toy(mtp=0), cluster, runtime="megatron-core")
    assert pipeline.rank_layers(s, with_mtp._context) == (5,)
    layer = without._layer(s)
    m = s.grad_accum_steps
    extra = m * (layer.fwd_s + layer.bwd_s + (1 + 2 * 256 / 1000) * layer.logits_s)
    got = with_mtp.estimate(s).time.compute_s - without.estimate(s).time.compute_s
    assert got == pytest.approx(extra, rel=1e-12)
    assert with_mtp.estimate(s).peak_memory_bytes > without.estimate(s).peak_memory_bytes
    assert with_mtp.estimate(s).model_flops_per_step > without.estimate(s).model_flops_per_step


def test_the_last_stage_holds_an_embedding_copy_under_pp():
    m, h, V = toy(), 256, 1000
    assert memory.mtp_head_params(m, 1) == 3 * h + 2 * h * h
    assert memory.mtp_head_params(m, 2) == 3 * h + 2 * h * h + V * h
    assert memory.mtp_head_params(toy(tied_embeddings=True), 2) == 3 * h + 2 * h * h
    assert memory.mtp_head_params(toy(mtp=0), 2) == 0


def test_moe_modules_count_on_the_last_rank():
    v3 = ModelSpec.load("deepseek-v3")
    cm = AnalyticCostModel(v3, Cluster.parse("h100-sxm:32x8"), runtime="megatron-core")
    s = Strategy(
        dp=16, pp=16, ep=8, micro_batch_size=1, global_batch_size=256,
        pipeline_split=(4,) * 15 + (1,),
    )  # fmt: skip
    assert pipeline.rank_layers(s, cm._context) == (4,) * 15 + (2,)
    assert experts.rank_moe_layers(s, cm._context) == (1,) + (4,) * 14 + (2,)


def test_runtimes_without_mtp_train_the_model_alone_and_say_so():
    cluster = Cluster.parse("h100-sxm:32x8")
    v3 = ModelSpec.load("deepseek-v3")
    s = Strategy(dp=256, ep=16, micro_batch_size=1, global_batch_size=512, zero_stage=3)
    assert RUNTIMES["megatron-core"].mtp and RUNTIMES["nemo"].mtp
    assert not RUNTIMES["torchtitan"].mtp and not RUNTIMES["megatron-sc21"].mtp
    titan = AnalyticCostModel(v3, cluster, runtime="torchtitan").estimate(s)
    alone = AnalyticCostModel(v3.scaled(mtp_layers=0), cluster, runtime="torchtitan").estimate(s)
    assert titan.step_time_s == alone.step_time_s
    assert titan.peak_memory_bytes == alone.peak_memory_bytes
    assert any("multi-token prediction" in n for n in titan.notes)
    assert not alone.notes


def test_exports_write_or_name_the_modules():
    v3 = ModelSpec.load("deepseek-v3")
    s = Strategy(dp=32, pp=8, ep=8, micro_batch_size=1, global_batch_size=256)
    cluster = Cluster.parse("h100-sxm:32x8")
    flags = export(s, to="megatron", model=v3, cluster=cluster).text
    assert "--mtp-num-layers 1" in flags
    plain = export(s, to="megatron", model=v3.scaled(mtp_layers=0), cluster=cluster)
    assert "--mtp-num-layers" not in plain.text
    with pytest.raises(SpecError, match="mtp_layers"):  # torchtitan 0.2 trains none
        export(s, to="torchtitan", model=v3, cluster=cluster)
    titan = export(s, to="torchtitan", model=v3, cluster=cluster, allow_unsupported=True)
    assert "multi-token prediction" in dict(titan.refused)["mtp_layers"]


def test_the_2509_recompute_set_is_priced_as_its_modules():
    """mla_up_proj+mlp+moe_act repeats what mla_up_proj+mlp and mlp+moe_act repeat, the MLP
    once (Megatron-Bridge 25.09 run_script.py, GB200)."""
    assert "mla_up_proj+mlp+moe_act" in RECOMPUTE_MODULE_SETS
    v3 = ModelSpec.load("deepseek-v3")
    cm = AnalyticCostModel(v3, Cluster.parse("h100-sxm:32x8"), runtime="megatron-core")

    def layer(modules: str):
        s = Strategy(
            dp=32, pp=8, ep=8, micro_batch_size=1, global_batch_size=256,
            recompute_modules=modules,
        )  # fmt: skip
        return experts.layer(s, cm._context), cm.estimate(s)

    (both, r_both), (up, r_up), (act, _) = (
        layer(m) for m in ("mla_up_proj+mlp+moe_act", "mla_up_proj+mlp", "mlp+moe_act")
    )
    assert both.modules_s == pytest.approx(up.modules_s + act.modules_s, rel=1e-12)
    assert both.dense_modules_s == up.dense_modules_s
    assert r_both.memory.activations_bytes < r_up.memory.activations_bytes


def test_the_reference_transformer_refuses_modules_it_does_not_build():
    """The Engine's reference model has no MTP module: it says so instead of training the model
    without one (the ``torch`` runtime prices the model without it, as torchtitan's)."""
    from autosearch.core.model_spec import unbuilt

    assert unbuilt(toy(mtp=0)) == []
    assert unbuilt(toy(mtp=2)) == ["multi-token prediction (mtp_layers 2; 0 trains without it)"]
    pytest.importorskip("torch")
    from autosearch.models.transformer import build

    with pytest.raises(SpecError, match="mtp_layers 2"):
        build(toy(mtp=2))
    build(toy(mtp=0))
