"""ModelSpec.from_hf_config on published Hugging Face configs (tests/data/hf_configs, sources in
its README). Parameter counts are compared with the published sizes: exact families (Llama,
Mistral) within 0.5% (the published figures are rounded to 3 digits), Qwen2 within 0.5% (its
q/k/v biases, which a ModelSpec does not count, are 0.01%), GPT-NeoX within 1% (a ModelSpec
counts learned positions where Pythia has rotary ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autosearch import ModelSpec, SpecError

DATA = Path(__file__).parent / "data" / "hf_configs"

PUBLISHED = {  # file: (n_params, relative tolerance, style, n_kv_heads, tied)
    "llama3-8b.json": (8.03e9, 0.005, "swiglu", 8, False),
    "mistral-7b-v0.1.json": (7.24e9, 0.005, "swiglu", 8, False),
    "qwen2-7b.json": (7.62e9, 0.005, "swiglu", 4, False),
    "gpt2.json": (124.44e6, 0.005, "gelu", 12, True),
    "pythia-1b.json": (1.01e9, 0.01, "gelu", 8, False),
    # model cards, to the digits they give (the tolerance is one unit of the last digit)
    "qwen2.5-7b-instruct.json": (7.61e9, 0.01 / 7.61, "swiglu", 4, False),
    "qwen3-8b.json": (8.2e9, 0.1 / 8.2, "swiglu", 8, False),
    "qwen3-32b.json": (32.8e9, 0.1 / 32.8, "swiglu", 8, False),
    "phi-3-mini-4k-instruct.json": (3.8e9, 0.1 / 3.8, "swiglu", 32, False),
    "phi-4.json": (14e9, 1 / 14, "swiglu", 10, False),
    # Gemma 2 report, Table 1 (embedding + non-embedding): exact but for the post-norms (0.003%)
    "gemma-2-9b.json": (9_241_705_984, 1e-4, "geglu", 8, True),
    "gemma-2-27b.json": (27_227_128_320, 1e-4, "geglu", 16, True),
}


@pytest.mark.filterwarnings("ignore::autosearch.core.hf_config.LongSequenceWarning")
@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_with_their_size(name):
    n_params, tol, style, kv, tied = PUBLISHED[name]
    spec = ModelSpec.from_hf_config(DATA / name)
    assert spec.n_params == pytest.approx(n_params, rel=tol)
    assert (spec.ffn_activation, spec.n_kv_heads, spec.tied_embeddings) == (style, kv, tied)
    assert (
        ModelSpec.load(str(DATA / name)) == spec
    )  # a config.json path works where a model name does


def test_llama3_8b_fields_and_seq_len_override():
    spec = ModelSpec.from_hf_config(DATA / "llama3-8b.json", name="l3", seq_len=4096)
    assert (
        spec.name,
        spec.n_layers,
        spec.hidden_size,
        spec.n_heads,
        spec.ffn_hidden_size,
        spec.vocab_size,
        spec.seq_len,
    ) == ("l3", 32, 4096, 32, 14336, 128256, 4096)
    assert (
        spec.n_params == ModelSpec.load("llama3-8b").n_params
    )  # the catalog's hand-written entry


@pytest.mark.parametrize(
    "name, total, active, with_embedding",
    [  # model cards: Qwen1.5-MoE-A2.7B 14.3B / 2.7B; DeepSeek-V2-Lite 15.7B / 2.4B (DeepSeek
        # counts activated parameters without the input embedding); Mixtral 46.7B / 12.9B
        ("qwen1.5-moe-a2.7b.json", 14.3, 2.7, True),
        ("deepseek-v2-lite.json", 15.7, 2.4, False),
        ("mixtral-8x7b-v0.1.json", 46.7, 12.9, True),
    ],
)
def test_mixture_of_experts_configs_read_with_their_sizes(name, total, active, with_embedding):
    """Within 0.1B, the unit of the published figures."""
    spec = ModelSpec.from_hf_config(DATA / name, seq_len=4096)
    assert spec.moe is not None
    embedding = 0 if with_embedding else spec.vocab_size * spec.hidden_size
    assert abs(spec.n_params / 1e9 - total) <= 0.1
    assert abs((spec.n_active_params - embedding) / 1e9 - active) <= 0.1


@pytest.mark.parametrize(
    "config, expect",
    [
        ({"model_type": "t5"}, "model_type 't5' .*is not a supported family"),
        ({"model_type": "llama", "hidden_size": 64}, "lacks 'num_hidden_layers'"),
        (
            {
                "model_type": "gpt2",
                "n_layer": 2,
                "n_embd": 64,
                "n_head": 4,
                "vocab_size": 10,
                "n_positions": 8,
                "head_dim": 32,
            },
            "head_dim 32 x 4 heads != hidden_size 64",
        ),
        ({"model_type": "qwen2_moe", "num_experts": 60}, "lacks 'num_hidden_layers'"),
        (
            {
                "model_type": "gemma2",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 8,
                "vocab_size": 10,
                "max_position_embeddings": 8,
                "hidden_activation": "relu",
            },
            "hidden_act 'relu' is not the geglu MLP of gemma2",
        ),
    ],
)
def test_bad_configs_say_what_is_wrong(config, expect):
    with pytest.raises(SpecError, match=expect):
        ModelSpec.from_hf_config(config)


def test_unreadable_files(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        ModelSpec.from_hf_config(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        ModelSpec.from_hf_config(tmp_path)  # the folder holding config.json
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(SpecError, match="JSON object"):
        ModelSpec.from_hf_config(bad)


def test_counts_match_transformers_models():
    """The ModelSpec counts exactly the parameters transformers builds for Llama and Mistral."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    shape = dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=100,
        max_position_embeddings=16,
    )
    for config_cls, model_cls in (
        ("LlamaConfig", "LlamaForCausalLM"),
        ("MistralConfig", "MistralForCausalLM"),
    ):
        config = getattr(transformers, config_cls)(**shape)
        with torch.device("meta"):
            model = getattr(transformers, model_cls)(config)
        assert ModelSpec.from_hf_config(config).n_params == sum(
            p.numel() for p in model.parameters()
        )
