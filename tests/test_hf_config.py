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
}


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


def test_mixture_of_experts_is_refused_clearly():
    with pytest.raises(SpecError, match="mixture-of-experts.*num_local_experts=8"):
        ModelSpec.from_hf_config(DATA / "mixtral-8x7b-v0.1.json")


@pytest.mark.parametrize(
    "config, expect",
    [
        ({"model_type": "t5"}, "model_type 't5' is not supported"),
        ({"model_type": "llama", "hidden_size": 64}, "lacks 'num_hidden_layers'"),
        (
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 8,
                "vocab_size": 10,
                "max_position_embeddings": 8,
                "head_dim": 32,
            },
            "head_dim 32 x 4 heads != hidden_size 64",
        ),
        ({"model_type": "qwen2_moe", "num_experts": 60}, "mixture-of-experts"),
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
