"""Mixture-of-experts, MLA and today's dense variants in ModelSpec: parameter counts against the
published figures and against the models transformers builds, FLOPs, checks on bad input, the
cost model's refusal, and the catalog's new entries."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from autosearch import ModelSpec, SpecError
from autosearch.core.hf_config import LongSequenceWarning
from autosearch.core.model_spec import unbuilt, unpriced

DATA = Path(__file__).parent / "data" / "hf_configs"
B = 1e9

# Published sizes, in billions, with the unit of their last digit: a count is within one unit
# (published figures are rounded or truncated to that digit) plus what the model leaves out,
# stated per row. "active" follows each publisher: Mistral, Qwen and Meta count the input
# embedding in the activated parameters (n_active_params), DeepSeek and OpenAI do not (the
# embedding is a lookup): for those the test subtracts vocab_size * hidden_size.
PUBLISHED = {
    # name: (total, unit, active, active unit, active counts the input embedding, extra, source)
    "mixtral-8x7b": (46.7, 0.1, 12.9, 0.1, True, 0, "Mistral AI, Mixtral of experts"),
    "mixtral-8x22b": (141, 1, 39, 1, True, 0, "Mistral AI, Cheaper, Better, Faster, Stronger"),
    "qwen2-57b-a14b": (57, 1, 14, 1, True, 0, "Qwen2 tech report, Table 1"),
    "qwen3-30b-a3b": (30.5, 0.1, 3.3, 0.1, True, 0, "Qwen/Qwen3-30B-A3B model card"),
    "qwen3-235b-a22b": (235, 1, 22, 1, True, 0, "Qwen/Qwen3-235B-A22B model card"),
    # hybrids: Gated DeltaNet / gated attention, and Mamba-2 / attention with shared experts
    "qwen3-next-80b-a3b": (80, 1, 3, 1, True, 0, "Qwen/Qwen3-Next-80B-A3B-Instruct model card"),
    "granite-4.0-h-small": (32, 1, 9, 1, True, 0, "ibm-granite/granite-4.0-h-small model card"),
    "deepseek-v2": (236, 1, 21, 1, False, 0, "DeepSeek-V2 tech report, sec. 1"),
    # 671B and 36.6B activated exclude the 14B multi-token prediction module (DeepSeek-V3
    # README_WEIGHTS.md: "37B", of which 36.6B with the 0.9B output head, no input embedding)
    "deepseek-v3": (671, 1, 36.6, 0.1, False, 0, "DeepSeek-V3 tech report; README_WEIGHTS.md"),
    # Meta's totals are of the multimodal model; the vision encoder (under 2%) is not a part of
    # the text ModelSpec: 2% of the total is allowed for it
    "llama4-scout": (109, 1, 17, 1, True, 0.02 * 109, "Meta Llama 4 model card"),
    "llama4-maverick": (400, 1, 17, 1, True, 0.02 * 400, "Meta Llama 4 model card"),
    # attention and expert biases, router biases and attention sinks are not modelled:
    # 36 layers x (8,000 + 128 x 8,640 + 128 + 64) = 0.040B
    "gpt-oss-120b": (116.83, 0.01, 5.13, 0.01, False, 0.041, "OpenAI gpt-oss model card"),
    "qwen2.5-7b": (7.61, 0.01, None, 0, True, 0, "Qwen/Qwen2.5-7B model card"),
    "qwen2.5-72b": (72.7, 0.1, None, 0, True, 0, "Qwen/Qwen2.5-72B model card"),
    "qwen3-8b": (8.2, 0.1, None, 0, True, 0, "Qwen/Qwen3-8B model card"),
    "qwen3-32b": (32.8, 0.1, None, 0, True, 0, "Qwen/Qwen3-32B model card"),
    "mistral-7b-v0.1": (7.24, 0.01, None, 0, True, 0, "Jiang et al. 2023"),
    "mistral-nemo-12b": (12, 1, None, 0, True, 0, "Mistral AI, Mistral NeMo"),
    "phi3-mini": (3.8, 0.1, None, 0, True, 0, "Phi-3 tech report"),
    "phi4": (14, 1, None, 0, True, 0, "Phi-4 tech report"),
    # Gemma 3 report, Table 1: 1,416M embedding + 25,600M non-embedding, rounded to 100M
    "gemma3-27b": (27.016, 0.1, None, 0, True, 0, "Gemma 3 tech report, Table 1"),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_catalog_counts_match_the_published_ones(name):
    total, unit, active, active_unit, with_embedding, extra, _source = PUBLISHED[name]
    m = ModelSpec.load(name)
    assert abs(m.n_params / B - total) <= unit + extra
    if active is not None:
        ours = m.n_active_params - (0 if with_embedding else m.vocab_size * m.hidden_size)
        assert abs(ours / B - active) <= active_unit + extra
    else:
        assert m.n_active_params == m.n_params  # dense


@pytest.mark.parametrize(
    "name, published",
    [  # Gemma 2 report, Table 1: embedding + non-embedding parameters, exactly
        ("gemma2-9b", 917_504_000 + 8_324_201_984),
        ("gemma2-27b", 1_179_648_000 + 26_047_480_320),
    ],
)
def test_gemma2_counts_are_exact_but_for_the_post_norms(name, published):
    """A ModelSpec block has two norms; Gemma 2's has four (post-attention and post-MLP RMSNorm
    weights, h each): the difference is exactly 2 h per layer."""
    m = ModelSpec.load(name)
    assert m.n_params + 2 * m.hidden_size * m.n_layers == published


# ---- the models transformers builds ---------------------------------------------------------

_SHAPE = dict(
    num_hidden_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=100,
    max_position_embeddings=32,
)
# family: (config class, model class, extra config, what a ModelSpec leaves out, as a function
# of the spec: the exact difference, stated once in hf_config's docstring)
_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4), lambda m: 0),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
        ),
        # q/k/v biases per layer, the shared-expert gate (h) per MoE layer
        lambda m: (
            m.n_layers * (m.attention_hidden_size + 2 * m.kv_hidden_size)
            + m.n_moe_layers * m.hidden_size
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32),
        lambda m: m.n_layers * 2 * m.head_dim,  # q_norm and k_norm
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
        ),
        lambda m: 0,
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
        ),
        lambda m: 0,
    ),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=128,
            interleave_moe_layer_step=2,
            head_dim=16,
        ),
        lambda m: 0,
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(head_dim=32, sliding_window=8),
        lambda m: m.n_layers * 2 * m.hidden_size,  # post-attention and post-MLP norms
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(head_dim=32, sliding_window=8),
        lambda m: m.n_layers * (2 * m.hidden_size + 2 * m.head_dim),  # post-norms, q/k norms
    ),
    "nemotron": (
        "NemotronConfig",
        "NemotronForCausalLM",
        dict(head_dim=16),
        lambda m: (2 * m.n_layers + 1) * m.hidden_size,  # LayerNorm1P biases
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
        lambda m: 0,
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8),
        # attention biases and sinks, router biases, expert biases (gate_up and down)
        lambda m: (
            m.n_layers
            * (
                m.attention_hidden_size
                + 2 * m.kv_hidden_size
                + m.hidden_size
                + m.n_heads
                + m.moe.n_experts * (1 + 2 * m.moe.ffn_hidden_size + m.hidden_size)
            )
        ),
    ),
}


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_counts_match_the_models_transformers_builds(family):
    """Built on the meta device from the same config: the count is exact up to the parameters
    a ModelSpec leaves out (stated per family)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config_cls, model_cls, extra, left_out = _FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_SHAPE, **extra})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = getattr(transformers, model_cls)(config)
    spec = ModelSpec.from_hf_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert built - spec.n_params == left_out(spec)


# ---- Hugging Face configs -------------------------------------------------------------------


def _read(file: str, **kw) -> ModelSpec:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LongSequenceWarning)
        return ModelSpec.from_hf_config(DATA / file, **kw)


def test_deepseek_v3_config_reads_experts_and_mla():
    m = _read("deepseek-v3.json")
    assert m.moe is not None and m.mla is not None
    assert (m.moe.n_experts, m.moe.top_k, m.moe.ffn_hidden_size) == (256, 8, 2048)
    assert (m.moe.n_shared_experts, m.moe.first_dense_layers) == (1, 3)
    assert (m.moe.router, m.moe.load_balancing) == ("sigmoid", "aux_loss_free")
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_head_dim) == (1536, 512, 192)
    assert m.moe_layers[:4] == (False, False, False, True) and m.n_moe_layers == 58
    assert m.n_params == ModelSpec.load("deepseek-v3").n_params  # the catalog's entry


def test_llama4_text_config_is_read_under_text_config():
    m = _read("llama-4-maverick.json")
    assert m.moe is not None and m.moe.layer_step == 2 and m.n_moe_layers == 24
    assert m.moe_layers[:4] == (False, True, False, True)  # layers 1, 3, ... hold experts
    assert m.ffn_hidden_size == 16384 and m.moe.ffn_hidden_size == 8192  # dense vs expert
    assert m.n_params == ModelSpec.load("llama4-maverick").n_params


@pytest.mark.parametrize(
    "name, window, pattern, sliding",
    [
        ("gemma-2-9b.json", 4096, 2, 21),  # even layers slide: 21 of 42
        ("gpt-oss-120b.json", 128, 2, 18),  # from layer_types
        ("mistral-7b-v0.1.json", 4096, None, 32),  # every layer
        ("phi-3-mini-4k-instruct.json", 2047, None, 32),
        ("qwen2.5-7b-instruct.json", None, None, 0),  # use_sliding_window false
    ],
)
def test_sliding_windows_and_which_layers(name, window, pattern, sliding):
    m = _read(name)
    assert (m.sliding_window, m.sliding_window_pattern, m.sliding_layers) == (
        window,
        pattern,
        sliding,
    )


def test_gemma2_config_gives_geglu_tied_head_dim_and_softcaps():
    m = _read("gemma-2-27b.json")
    assert (m.ffn_activation, m.tied_embeddings, m.head_dim) == ("geglu", True, 128)
    assert (m.attn_logit_softcapping, m.final_logit_softcapping) == (50.0, 30.0)
    assert m.n_params == ModelSpec.load("gemma2-27b").n_params


def test_nemotron_is_squared_relu_with_two_matrices():
    m = _read("nemotron-4b.json")
    assert (m.ffn_activation, m.n_ffn_matrices, m.ffn_gated) == ("relu2", 2, False)
    assert m.layer_matmul_params == m.attention_matmul_params + 2 * m.hidden_size * 9216


def test_config_files_match_their_catalog_entries():
    for file, name in [
        ("qwen3-32b.json", "qwen3-32b"),
        ("qwen3-8b.json", "qwen3-8b"),
        ("phi-4.json", "phi4"),
        ("qwen2-57b-a14b.json", "qwen2-57b-a14b"),
        ("mixtral-8x7b-v0.1.json", "mixtral-8x7b"),
        ("gpt-oss-120b.json", "gpt-oss-120b"),
    ]:
        catalog = ModelSpec.load(name)
        assert _read(file, seq_len=catalog.seq_len, name=name) == catalog, file


def test_long_context_configs_warn_and_say_how_to_set_the_length(tmp_path):
    with pytest.warns(LongSequenceWarning, match=r"131,072 tokens.*--seq-len"):
        m = ModelSpec.from_hf_config(DATA / "qwen2-7b.json")
    assert m.seq_len == 131072
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when the length is given
        assert ModelSpec.load(str(DATA / "qwen2-7b.json"), seq_len=4096).seq_len == 4096
        assert ModelSpec.from_hf_config(DATA / "llama3-8b.json").seq_len == 8192  # <= 32k
    assert ModelSpec.load("llama3-8b", seq_len=2048).seq_len == 2048  # the catalog too


def test_hf_layouts_a_modelspec_cannot_describe_are_refused():
    base = dict(_SHAPE, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2)
    base["moe_intermediate_size"] = 32
    with pytest.raises(SpecError, match="mlp_only_layers"):
        ModelSpec.from_hf_config({**base, "mlp_only_layers": [0]})
    with pytest.raises(SpecError, match="use_sliding_window"):
        ModelSpec.from_hf_config({**base, "use_sliding_window": True})
    gemma = dict(_SHAPE, model_type="gemma3_text", head_dim=16, sliding_window=8)
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    with pytest.raises(SpecError, match="not every-p-th-layer-global"):
        ModelSpec.from_hf_config({**gemma, "layer_types": types})
    with pytest.raises(SpecError, match="top_k = 8 is above moe.n_experts = 4"):
        ModelSpec.from_hf_config({**base, "num_experts_per_tok": 8})
    with pytest.raises(SpecError, match="'dbrx' .* not a supported mixture-of-experts family"):
        ModelSpec.from_hf_config({"model_type": "dbrx", "num_experts": 16})


# ---- checks on bad input --------------------------------------------------------------------

_DENSE = dict(n_layers=4, hidden_size=64, n_heads=4, vocab_size=100, seq_len=32)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"moe": {"n_experts": 4, "top_k": 8}}, "top_k = 8 is above moe.n_experts = 4"),
        ({"moe": {"n_experts": 0, "top_k": 1}}, "drop the moe block"),
        ({"moe": {"n_experts": 4, "top_k": 1, "first_dense_layers": 4}}, "leaves no MoE layer"),
        ({"moe": {"n_experts": 4, "top_k": 1, "layer_step": 9}}, "puts no MoE layer"),
        ({"moe": {"n_experts": 4, "top_k": 1, "capacity_factor": 0}}, "null for dropless"),
        ({"moe": {"n_experts": 4, "top_k": 1, "router": "relu"}}, "moe.router must be one of"),
        ({"moe": {"n_experts": 4}}, "moe lacks top_k"),
        ({"moe": {"n_experts": 4, "top_k": 1, "experts": 2}}, "unknown key.*experts"),
        ({"moe": [4, 2]}, "moe must be a mapping"),
        ({"mla": {"kv_lora_rank": 16}}, "mla lacks qk_nope_head_dim"),
        ({"head_dim": 0}, "head_dim must be >= 1"),
        ({"sliding_window_pattern": 2}, "needs a sliding_window"),
        ({"sliding_window": 8, "sliding_window_pattern": 1}, "drop sliding_window instead"),
        ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a number > 0"),
        ({"ffn_activation": "reglu"}, "ffn_activation must be one of"),
        ({"hidden_size": 66}, "or give head_dim"),
    ],
)
def test_bad_fields_say_what_to_do(extra, message):
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_dict({**_DENSE, **extra})


def test_yaml_round_trip_with_nested_moe_and_mla(tmp_path):
    path = tmp_path / "mini-moe.yaml"
    path.write_text(
        "n_layers: 4\nhidden_size: 64\nn_heads: 4\nffn_hidden_size: 128\nffn_activation: swiglu\n"
        "vocab_size: 100\nseq_len: 32\nmoe: {n_experts: 8, top_k: 2, ffn_hidden_size: 32,\n"
        "  n_shared_experts: 1, first_dense_layers: 1, router: sigmoid}\n"
        "mla: {kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8}\n"
    )
    m = ModelSpec.load(path)
    assert m.moe is not None and m.moe.shared_ffn_hidden_size == 32  # defaults to expert width
    assert m.moe_layers == (False, True, True, True)
    assert ModelSpec.from_dict(m.to_dict()) == m


def test_scaled_keeps_the_head_size_rule():
    assert ModelSpec.load("llama3-8b").scaled(hidden_size=2048, n_heads=16).head_dim == 128
    assert ModelSpec.load("tiny-gpt").scaled(hidden_size=128).head_dim == 32  # 128 / 4 heads
    qwen = ModelSpec.load("qwen3-32b").scaled(n_layers=2)
    assert qwen.head_dim == 128 and qwen.attention_hidden_size == 8192  # explicit: kept


# ---- FLOPs ----------------------------------------------------------------------------------


def test_dense_flops_keep_their_formula():
    """Narayanan et al. 2021 eq. (3) without recompute, per token: 72 l h^2 (1 + s/(6h) +
    V/(12 l h)) for GPT shapes (ffn 4h): the generalised count must give the same number."""
    m = ModelSpec.load("gpt3-175b")
    l, h, s, V = m.n_layers, m.hidden_size, m.seq_len, m.vocab_size
    assert m.flops_per_token() == pytest.approx(
        72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12
    )


def test_moe_flops_count_active_experts():
    """6 x (active matmul weights) + 6 x 2 s (d_qk + d_v) heads per layer (Megatron-LM
    num_floating_point_operations, with full rather than causal attention)."""
    m = ModelSpec.load("mixtral-8x7b")
    h, f, s = m.hidden_size, m.ffn_hidden_size, m.seq_len
    per_layer = m.attention_matmul_params + h * 8 + 2 * 3 * h * f  # router + top-2 experts
    expected = 3 * (2 * m.n_layers * per_layer + 2 * m.vocab_size * h + 4 * m.n_layers * s * h)
    assert m.flops_per_token() == expected
    one_expert = m.scaled(moe=None)  # the same model with one dense MLP per layer
    second_expert_and_router = 3 * 2 * m.n_layers * (3 * h * f + 8 * h)
    assert m.flops_per_token() - one_expert.flops_per_token() == second_expert_and_router


def test_mla_and_sliding_window_flops():
    v3 = ModelSpec.load("deepseek-v3").scaled(mtp_layers=0)  # MTP: tests/test_mtp.py
    attn = 2 * v3.n_heads * (192 + 128) * v3.seq_len * v3.n_layers  # scores + values, forward
    without_core = v3.flops_per_token(training=False) - attn
    assert without_core == 2 * (v3.n_active_params - v3.vocab_size * v3.hidden_size) - 2 * (
        v3.n_layers * (2 * v3.hidden_size + v3.mla.norm_params)  # norms are not matmuls
        + v3.hidden_size  # final norm
    )
    mistral = ModelSpec.load("mistral-7b-v0.1")  # window 4,096 of 8,192 on every layer
    full = mistral.scaled(sliding_window=None)
    core = 4 * mistral.attention_hidden_size * mistral.n_layers  # forward, per key
    assert full.flops_per_token(training=False) - mistral.flops_per_token(training=False) == (
        core * (8192 - 4096)
    )


# ---- what the cost model and the reference transformer refuse -------------------------------


def test_the_cost_model_prices_every_catalog_model():
    from autosearch import Cluster
    from cost_models import AnalyticCostModel

    cluster = Cluster.parse("h100-sxm:1x8")
    # MoE (cost_models/terms/experts.py), MLA, head_dim, windows and soft-capping are priced
    for name in ("mixtral-8x7b", "deepseek-v3", "gemma2-9b", "qwen2.5-72b", "llama3-8b"):
        assert unpriced(ModelSpec.load(name)) == []
        AnalyticCostModel(ModelSpec.load(name), cluster)
    assert unpriced(ModelSpec.load("mistral-7b-v0.1").scaled(seq_len=4096)) == []
    geglu = dataclasses.replace(ModelSpec.load("llama3-8b"), ffn_activation="geglu")
    assert unpriced(geglu) == [] and unbuilt(geglu) == []
