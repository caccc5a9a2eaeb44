"""ModelSpec.from_hf_config on published Hugging Face configs (tests/data/hf_configs, sources in
its README). Parameter counts are compared with the published sizes: exact families (Llama,
Mistral) within 0.5% (the published figures are rounded to 3 digits), Qwen2 within 0.5% (its
q/k/v biases, which a ModelSpec does not count, are 0.01%), GPT-NeoX within 1% (a ModelSpec
counts learned positions where Pythia has rotary ones).

Keys a config leaves out take transformers' defaults (autosearch/core/hf_config_keys.yaml, written
from transformers without importing it at run time): checked here against transformers' own
config objects and, for Gemma 3 27B, the model transformers builds. Unknown keys warn with the
closest known key, and a near miss of a key the reader needs is an error."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autosearch import ModelSpec, SpecError
from autosearch.core.hf_config import LongSequenceWarning, UnknownConfigKeyWarning

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
        ("qwen3-30b-a3b.json", 30.5, 3.3, True),  # model card: 30.5B total, 3.3B activated
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
        (  # a near miss of a key the reader needs is an error, not transformers' default
            {"model_type": "llama", "num_hiden_layers": 2, "hidden_size": 64},
            "lacks 'num_hidden_layers' but gives 'num_hiden_layers': did you mean "
            "'num_hidden_layers'",
        ),
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
        (
            {"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tk": 4},
            "did you mean 'num_experts_per_tok'",
        ),
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
@pytest.mark.filterwarnings("ignore::autosearch.core.hf_config.UnknownConfigKeyWarning")
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


# ---- Gemma 3 27B: a multimodal config whose text_config leaves out what transformers fills in ---
GEMMA3 = DATA / "gemma-3-27b.json"
# What a ModelSpec leaves out of Gemma 3 (hf_config's docstring): per layer the q and k norms
# (head_dim each) and the pre- and post-feedforward norms (h each); 62 x 11,008 = 682,496
# parameters, 0.0025% of the model.
GEMMA3_LEFT_OUT = 62 * (2 * 128 + 2 * 5376)


def test_gemma3_27b_reads_with_transformers_defaults():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeyWarning)  # every key known
        spec = ModelSpec.from_hf_config(GEMMA3, seq_len=4096)
    assert (spec.name, spec.vocab_size, spec.n_layers, spec.hidden_size) == (
        "gemma-3-27b",
        262_208,  # Gemma3TextConfig's default: the file gives none
        62,
        5376,
    )
    assert (spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.ffn_hidden_size) == (
        32,
        16,
        128,
        21504,
    )
    assert (spec.ffn_activation, spec.tied_embeddings) == ("geglu", True)
    # 5 sliding layers of 1,024 tokens to each global one (transformers' default pattern, 6)
    assert (spec.sliding_window, spec.sliding_window_pattern, spec.sliding_layers) == (
        1024,
        6,
        52,
    )
    # Gemma 3 report, Table 1: 25,600 M non-embedding parameters (to 1 M, 4e-5 of it; the
    # report's 1,416 M of embedding parameters hold the 1152 x 5376 vision projection too);
    # the ModelSpec leaves out GEMMA3_LEFT_OUT (2.7e-5): 1e-4 holds both.
    non_embedding = spec.n_params - spec.vocab_size * spec.hidden_size
    assert non_embedding == pytest.approx(25_600e6, rel=1e-4)
    with pytest.warns(LongSequenceWarning, match="131,072 tokens"):  # its default positions
        assert ModelSpec.from_hf_config(GEMMA3).seq_len == 131_072


def test_gemma3_27b_count_matches_the_model_transformers_builds():
    """Exact, but for the norms a ModelSpec leaves out (GEMMA3_LEFT_OUT)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    raw = json.loads(GEMMA3.read_text())
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config.text_config)
    built = sum(p.numel() for p in model.parameters())
    assert type(model).__name__ == "Gemma3ForCausalLM" and built == 27_009_346_304
    assert ModelSpec.from_hf_config(GEMMA3, seq_len=4096).n_params == built - GEMMA3_LEFT_OUT


# ---- the reader against transformers' own config classes ---------------------------------------
# Where the reader and transformers differ on purpose: Nemotron's kv_channels (Megatron's head
# size) is read as head_dim, which transformers' NemotronConfig ignores (it derives hidden /
# heads); the published config gives both equal, so they differ only once hidden_size or the
# heads are left out.
KNOWN_DIFFERENCES = {("nemotron-4b.json", key) for key in ("hidden_size", "num_attention_heads")}


def _variants():
    """Each published config, and each with one key of its (text) model left out."""
    for path in sorted(DATA.glob("*.json")):
        raw = json.loads(path.read_text())
        model = raw.get("text_config", raw)
        yield path.name, None, raw
        for key in model:
            if key != "model_type" and (path.name, key) not in KNOWN_DIFFERENCES:
                variant = copy.deepcopy(raw)
                variant.get("text_config", variant).pop(key)
                yield path.name, key, variant


@pytest.mark.filterwarnings("error::autosearch.core.hf_config.UnknownConfigKeyWarning")
def test_reader_takes_the_defaults_transformers_takes():
    """A config read by the reader equals the same config read once transformers' config class
    has filled in every key (``to_dict``): same defaults, aliases and derived values; and every
    key transformers writes is known."""
    transformers = pytest.importorskip("transformers", minversion="5")
    transformers.logging.set_verbosity_error()  # its own remarks on rope settings

    def read(config):
        try:
            return ModelSpec.from_hf_config(config, name="m", seq_len=4096)
        except SpecError:  # both refuse a key without a default (DeepseekV2Config's top-k)
            return "refused"

    differ, read_both = [], 0
    for name, left_out, raw in _variants():
        rest = {k: v for k, v in raw.items() if k != "model_type"}
        filled = transformers.AutoConfig.for_model(raw["model_type"], **rest).to_dict()
        ours = read(raw)
        if ours != read(filled):
            differ.append((name, left_out))
        read_both += ours != "refused"
    assert differ == [] and read_both > 500


def test_keys_table_is_the_installed_transformers():
    """hf_config_keys.yaml is what tools/hf_config_keys.py writes from the transformers it was
    written from (another version may declare other keys: run the tool)."""
    transformers = pytest.importorskip("transformers")
    import yaml

    root = Path(__file__).resolve().parents[1]
    table = yaml.safe_load((root / "autosearch" / "core" / "hf_config_keys.yaml").read_text())
    if table["transformers"] != transformers.__version__:
        pytest.skip(f"written from transformers {table['transformers']}")
    tool = [sys.executable, str(root / "tools" / "hf_config_keys.py"), "--check"]
    assert subprocess.run(tool, capture_output=True).returncode == 0


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.json")))
def test_published_configs_raise_no_unknown_key_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeyWarning)
        ModelSpec.from_hf_config(DATA / name, seq_len=4096)


def test_reading_needs_neither_transformers_nor_torch(monkeypatch):
    """Without transformers (its import fails) every config reads the same, Gemma 3's too; and
    reading one imports neither (the cost model's side never imports torch)."""

    def read_all():
        return {p.name: ModelSpec.from_hf_config(p, seq_len=4096) for p in DATA.glob("*.json")}

    specs = read_all()
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ImportError):
        import transformers  # noqa: F401
    assert read_all() == specs and specs["gemma-3-27b.json"].vocab_size == 262_208
    code = (
        "import sys; from autosearch import ModelSpec; "
        f"ModelSpec.load({str(GEMMA3)!r}, seq_len=4096); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- a model's folder --------------------------------------------------------------------------
def test_a_models_folder_reads_as_its_config_json(tmp_path, monkeypatch):
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    shutil.copy(DATA / "qwen3-8b.json", folder / "config.json")
    spec = ModelSpec.load(str(folder), seq_len=4096)
    assert spec.name == "Qwen3-8B"  # the folder's name
    assert spec == ModelSpec.from_hf_config(DATA / "qwen3-8b.json", name="Qwen3-8B", seq_len=4096)
    assert ModelSpec.load(f"{folder}/", seq_len=4096) == spec  # a trailing slash
    with pytest.raises(SpecError, match="holds no config.json"):
        ModelSpec.load(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # a folder named like a catalog model: the catalog, unless a path
    assert ModelSpec.load("Qwen3-8B") == ModelSpec.load("qwen3-8b")
    assert ModelSpec.load("./Qwen3-8B", seq_len=4096).name == "Qwen3-8B"


def test_the_cli_reads_a_folder_and_says_what_is_missing(tmp_path):
    from autosearch.commands._common import load_model

    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    with pytest.raises(SpecError, match=r"model folder .*Qwen3-8B' holds no config\.json"):
        load_model(str(folder))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match=r"Qwen3-8B/config\.json' is not valid JSON"):
        load_model(str(folder))
    shutil.copy(DATA / "qwen3-8b.json", folder / "config.json")
    assert load_model(str(folder), seq_len=4096).name == "Qwen3-8B"


# ---- keys a family does not know ---------------------------------------------------------------
def _renamed(name: str, key: str, typo: str) -> dict:
    config = json.loads((DATA / name).read_text())
    config[typo] = config.pop(key)
    return config


def test_a_misspelt_optional_key_warns_and_reads_as_transformers_would():
    """Qwen3-30B-A3B with ``num_key_value_head``: the key is ignored, with a warning naming the
    right one, and the heads are Qwen3MoeConfig's default, 4 (one per query head, as this
    reader read it before it took transformers' defaults, gave 31.24 B parameters)."""
    typo = _renamed("qwen3-30b-a3b.json", "num_key_value_heads", "num_key_value_head")
    with pytest.warns(UnknownConfigKeyWarning, match="did you mean 'num_key_value_heads'") as w:
        spec = ModelSpec.from_hf_config(typo, seq_len=4096)
    assert len(w) == 1 and "num_key_value_head is not a key of model_type 'qwen3_moe'" in str(
        w[0].message
    )
    right = ModelSpec.from_hf_config(DATA / "qwen3-30b-a3b.json", seq_len=4096)
    assert (spec.n_kv_heads, spec.n_params) == (4, right.n_params) == (4, 30_532_110_336)
    # LlamaConfig's default is one key/value head per query head: 8.03 B becomes 8.84 B
    llama = _renamed("llama3-8b.json", "num_key_value_heads", "num_key_value_head")
    with pytest.warns(UnknownConfigKeyWarning, match="did you mean 'num_key_value_heads'"):
        assert ModelSpec.from_hf_config(llama, seq_len=4096).n_kv_heads == 32


def test_an_unknown_key_beside_the_right_one_changes_nothing():
    config = json.loads((DATA / "qwen3-30b-a3b.json").read_text())
    right = ModelSpec.from_hf_config(config, name="m", seq_len=4096)
    for extra, hint in (
        ("num_key_value_head", "did you mean 'num_key_value_heads'?"),
        ("flux_capacitor", "no known key is close to it"),
    ):
        with pytest.warns(UnknownConfigKeyWarning, match=hint):
            spec = ModelSpec.from_hf_config({**config, extra: 1}, name="m", seq_len=4096)
        assert spec == right


def test_the_cli_says_an_unknown_key_in_one_line(tmp_path, capsys):
    from autosearch.commands._common import load_model

    config = json.loads((DATA / "qwen3-8b.json").read_text())
    config["num_key_value_head"] = config.pop("num_key_value_heads")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model(str(tmp_path / "config.json"), seq_len=4096).n_layers == 36
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ")  # one line, no file and line number
    assert "num_key_value_head is not a key" in err[0]
    assert "did you mean 'num_key_value_heads'?" in err[0]
    config["num_hiden_layers"] = config.pop("num_hidden_layers")  # the warnings come first
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match="did you mean 'num_hidden_layers'"):
        load_model(str(tmp_path / "config.json"))
    assert len(capsys.readouterr().err.splitlines()) == 2


@pytest.mark.filterwarnings("ignore::autosearch.core.hf_config.UnknownConfigKeyWarning")
@pytest.mark.parametrize(
    "name, key, typo, container",
    [
        ("qwen3-8b.json", "num_hidden_layers", "num_hiden_layers", ""),
        ("mixtral-8x7b-v0.1.json", "num_local_experts", "num_local_expert", ""),
        ("gpt2.json", "n_embd", "n_emb", ""),
        ("gemma-3-27b.json", "hidden_size", "hiden_size", "text_config."),
    ],
)
def test_a_misspelt_key_the_reader_needs_is_an_error(name, key, typo, container):
    """Not transformers' default in its place: the error names both keys."""
    config = json.loads((DATA / name).read_text())
    model = config.get("text_config", config)
    model[typo] = model.pop(key)
    with pytest.raises(SpecError, match=f"gives '{container}{typo}': did you mean '{key}'"):
        ModelSpec.from_hf_config(config, seq_len=4096)


# ---- one line for summaries --------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, line",
    [
        (
            "qwen3-30b-a3b.json",
            "qwen3-30b-a3b: 30.5 B parameters (3.4 B active), 48 layers, 128 experts top-8, "
            "seq 4,096",
        ),
        ("llama3-8b.json", "llama3-8b: 8.0 B parameters, 32 layers, seq 4,096"),
        (
            "deepseek-v3.json",
            "deepseek-v3: 671.0 B parameters (37.6 B active), 61 layers, 256 experts top-8 + 1 "
            "shared, seq 4,096",
        ),
        # learned positions for 1,024 tokens: GPT-2's 124 M (n_positions)
        ("gpt2.json", "gpt2: 124.4 M parameters, 12 layers, seq 1,024"),
    ],
)
def test_describe_gives_the_model_in_one_line(name, line):
    seq_len = int(line.rsplit(" ", 1)[1].replace(",", ""))
    assert ModelSpec.from_hf_config(DATA / name, seq_len=seq_len).describe() == line


# ---- hybrid models: Nemotron-H (Mamba-2, attention and MLP layers) and Nemotron 3 (MoE) --------
HYBRIDS = {  # file: (n_params transformers builds, n_active_params, blocks, pattern start)
    "nemotron-h-8b.json": (8_100_852_736, 8_100_852_736, 28, "M-M-M-M*-M"),
    "nemotron-h-56b.json": (56_324_350_464, 56_324_350_464, 64, "M-M-M-M*-M"),
    "nemotron-3-nano-30b-a3b.json": (31_577_937_344, 3_580_073_408, 29, "MEMEM*EMEM"),
}


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_nemotron_h_counts_match_the_model_transformers_builds(name):
    """Every parameter of NemotronHForCausalLM built on the meta device from the same config:
    Mamba-2 mixers (in / out projections, conv1d, dt_bias, A_log, D, gated norm), attention
    and MLP layers alone, MoE MLPs with their router and shared expert."""
    total, active, blocks, start = HYBRIDS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown key
        spec = ModelSpec.from_hf_config(DATA / name, seq_len=8192)
    assert (spec.n_params, spec.n_active_params) == (total, active)
    assert (spec.n_layers, spec.pattern[:10]) == (blocks, start)
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.NemotronHConfig.from_json_file(str(DATA / name))
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(config)
    assert spec.n_params == sum(p.numel() for p in model.parameters())


def test_nemotron_h_layer_list_reads_as_its_pattern():
    """``layers_block_type`` (transformers 5's form) gives the pattern
    ``hybrid_override_pattern`` gives."""
    raw = json.loads((DATA / "nemotron-h-8b.json").read_text())
    names = {"M": "mamba", "*": "attention", "-": "mlp"}
    listed = dict(raw, layers_block_type=[names[c] for c in raw.pop("hybrid_override_pattern")])
    assert ModelSpec.from_hf_config(listed, seq_len=8192) == ModelSpec.from_hf_config(
        DATA / "nemotron-h-8b.json", seq_len=8192
    )


@pytest.mark.parametrize("experts", [0, 8])
def test_granite_hybrid_counts_match_the_model_transformers_builds(experts):
    """IBM Granite 4.0-H's layout (GraniteMoeHybridConfig), small: Mamba-2 and attention
    layers, each with the shared SwiGLU MLP and, with experts, routed experts beside it."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=96,
        shared_intermediate_size=192,
        num_local_experts=experts,
        num_experts_per_tok=2,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        mamba_n_heads=16,
        mamba_n_groups=2,
        mamba_d_state=32,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        model = transformers.GraniteMoeHybridForCausalLM(config)
    spec = ModelSpec.from_hf_config(config)
    assert spec.pattern == ("MEME*EME" if experts else "M-M-*-M-")
    assert spec.n_params == sum(p.numel() for p in model.parameters())


# ---- Qwen3-Next and Qwen3.5: Gated DeltaNet and gated attention layers -------------------------
def _left_out(spec) -> int:
    """What a ModelSpec leaves out of these families (hf_config's docstring): each attention
    layer's q and k norms (head_dim weights each) and each MoE layer's shared-expert gate (h)."""
    attention = spec.pattern.count("*")
    return attention * 2 * spec.head_dim + spec.n_moe_layers * spec.hidden_size


def test_qwen3_next_counts_match_the_model_transformers_builds():
    """Qwen3-Next-80B-A3B's published config: 36 Gated DeltaNet and 12 gated attention layers
    (q_proj twice the query width: the output gate), 512 experts top-10 and a shared expert on
    every layer. Exact against Qwen3NextForCausalLM on the meta device, but for the q/k norms
    and shared-expert gates a ModelSpec leaves out; active: less 502 routed experts a layer."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown key
        spec = ModelSpec.from_hf_config(DATA / "qwen3-next-80b-a3b.json", seq_len=4096)
    assert spec.pattern == "GEGEGE*E" * 12 and spec.attention_output_gate
    assert (spec.n_params, spec.n_active_params) == (79_674_286_848, 3_874_824_960)
    assert ModelSpec.load("qwen3-next-80b-a3b") == spec.scaled(name="qwen3-next-80b-a3b")
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.Qwen3NextConfig.from_json_file(str(DATA / "qwen3-next-80b-a3b.json"))
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert spec.n_params + _left_out(spec) == total == 79_674_391_296
    idle = 48 * (512 - 10) * 3 * 2048 * 512  # routed experts a token does not reach
    assert spec.n_active_params + _left_out(spec) == total - idle


_SMALL_QWEN_NEXT = dict(
    vocab_size=1000,
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    max_position_embeddings=64,
)
_EXPERTS = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
)


@pytest.mark.parametrize(
    "family, extra, pattern",
    [
        ("Qwen3_5Text", dict(intermediate_size=512), "G-G-G-*-" * 2),
        ("Qwen3_5MoeText", _EXPERTS, "GEGEGE*E" * 2),
        # experts on every 2nd layer but layer 3 (decoder_sparse_step, mlp_only_layers)
        (
            "Qwen3Next",
            dict(_EXPERTS, intermediate_size=512, decoder_sparse_step=2, mlp_only_layers=[3]),
            "G-GEG-*-G-GEG-*E",
        ),
        ("Qwen3Next", dict(_EXPERTS, intermediate_size=512, full_attention_interval=2), None),
    ],
)
def test_qwen_next_families_count_as_transformers_builds(family, extra, pattern):
    """Qwen3.5 (dense: every layer a SwiGLU MLP) and Qwen3.5-MoE (every layer experts) are
    Qwen3-Next's layers; each config's layer placement read as transformers reads it."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = getattr(transformers, f"{family}Config")(**_SMALL_QWEN_NEXT, **extra)
    model_class = getattr(transformers, f"{family.removesuffix('Text')}ForCausalLM")
    with torch.device("meta"):
        model = model_class(config)
    spec = ModelSpec.from_hf_config(config)
    expected = pattern or "".join(
        ("*" if kind == "full_attention" else "G") + "E" for kind in config.layer_types
    )
    assert spec.pattern == expected
    assert spec.n_params + _left_out(spec) == sum(p.numel() for p in model.parameters())


def test_a_qwen3_5_multimodal_config_reads_its_text_model():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    outer = transformers.Qwen3_5Config(text_config=dict(_SMALL_QWEN_NEXT, intermediate_size=512))
    text = transformers.Qwen3_5TextConfig(**_SMALL_QWEN_NEXT, intermediate_size=512)
    assert ModelSpec.from_hf_config(outer, name="q") == ModelSpec.from_hf_config(text, name="q")


def test_no_hybrid_transformers_has_is_refused_by_name_any_more():
    """Jamba, Falcon-H1 and Kimi Linear, once refused by name (`UNREAD_HYBRIDS`), are read."""
    from autosearch.core.hf_config import SUPPORTED, UNREAD_HYBRIDS

    assert not UNREAD_HYBRIDS
    assert {"jamba", "falcon_h1", "kimi_linear"} <= set(SUPPORTED)


# ---- Falcon-H1: attention and Mamba-2 in parallel in each layer ---------------------------------
_SMALL_FALCON_H1 = dict(
    vocab_size=1000,
    hidden_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=384,
    mamba_d_ssm=512,
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=32,
    mamba_chunk_size=64,
    max_position_embeddings=64,
)


@pytest.mark.parametrize(
    "extra",
    [
        {},  # the released layout: no gated norm, d_inner from mamba_d_ssm, untied
        dict(mamba_rms_norm=True, mamba_d_ssm=None, mamba_expand=2, head_dim=48),
        dict(tie_word_embeddings=True, mamba_conv_bias=False),
    ],
)
def test_falcon_h1_counts_match_the_model_transformers_builds(extra):
    """FalconH1ForCausalLM on the meta device from the same config: every layer one norm,
    attention and a Mamba-2 mixer side by side (``P-``), the gated norm only with
    mamba_rms_norm, d_inner from mamba_d_ssm or mamba_expand x hidden, the attention's head_dim
    where the config gives one. Exact: a ModelSpec leaves nothing of it out."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.FalconH1Config(**{**_SMALL_FALCON_H1, **extra})
    with torch.device("meta"):
        model = transformers.FalconH1ForCausalLM(config)
    spec = ModelSpec.from_hf_config(config)
    assert spec.pattern == "P-" * 3 and spec.mamba.d_inner == 512
    assert spec.mamba.gated_norm == bool(extra.get("mamba_rms_norm"))
    assert spec.n_params == sum(p.numel() for p in model.parameters())


def test_falcon_h1_shapes_it_cannot_describe_are_refused():
    config = {"model_type": "falcon_h1", **_SMALL_FALCON_H1}
    with pytest.raises(SpecError, match="mamba_proj_bias True and projectors_bias False differ"):
        ModelSpec.from_hf_config({**config, "mamba_proj_bias": True})
    with pytest.raises(SpecError, match="mamba_n_heads 8 x mamba_d_head 32 = 256 is not"):
        ModelSpec.from_hf_config({**config, "mamba_d_head": 32})


# ---- Jamba: Mamba-1, attention and MoE layers ---------------------------------------------------
_SMALL_JAMBA = dict(
    vocab_size=1000,
    hidden_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    num_experts=4,
    num_experts_per_tok=2,
    attn_layer_period=4,
    attn_layer_offset=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    max_position_embeddings=64,
)


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({}, "S-SE*-SES-SE*-SE"),
        (
            dict(
                mamba_dt_rank=12, mamba_d_state=8, mamba_proj_bias=True, tie_word_embeddings=True
            ),
            "S-SE*-SES-SE*-SE",
        ),
        (dict(num_experts=1), "S-S-*-S-" * 2),  # one expert: a dense MLP (JambaMLP)
    ],
)
def test_jamba_counts_match_the_model_transformers_builds(extra, pattern):
    """JambaForCausalLM on the meta device from the same config: Mamba-1 mixers (in_proj,
    conv1d, x_proj, dt_proj, A_log, D, out_proj and the dt / B / C norms), attention every
    attn_layer_period-th layer, experts every expert_layer_period-th; exact."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.JambaConfig(**{**_SMALL_JAMBA, **extra})
    with torch.device("meta"):
        model = transformers.JambaForCausalLM(config)
    spec = ModelSpec.from_hf_config(config)
    assert spec.pattern == pattern and spec.mamba1.d_inner == 256
    assert spec.n_params == sum(p.numel() for p in model.parameters())


def test_jamba_v0_1_has_its_published_size():
    """JambaConfig's defaults are Jamba v0.1's shape (AI21's model card: 52B parameters, 12B
    active): 51.6 B and 12.1 B."""
    spec = ModelSpec.from_hf_config({"model_type": "jamba"}, seq_len=4096)
    assert (spec.n_params, spec.n_active_params) == (51_570_323_328, 12_110_311_296)
    assert spec.mamba1.dt_rank == 256  # "auto": ceil(4096 / 16)


# ---- Kimi Linear: Kimi Delta Attention and MLA layers, MoE --------------------------------------
_SMALL_KIMI = dict(
    vocab_size=1000,
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_head_dim=16,
    linear_num_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# the checkpoint's form: the linear attention's shape and layers (1-indexed) in one mapping
_KDA_CONFIG = dict(
    head_dim=32,
    num_heads=2,
    short_conv_kernel_size=3,
    full_attn_layers=[3, 6],
    kda_layers=[1, 2, 4, 5],
)


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({}, "G-GEGEGE*EGE"),  # MLA every 4th layer from the 5th, the first MLP dense
        (
            dict(
                q_lora_rank=24, n_shared_experts=1, mlp_layer_types=["dense"] * 2 + ["sparse"] * 4
            ),
            "G-G-GEGE*EGE",
        ),
        (dict(linear_attn_config=_KDA_CONFIG), "G-GE*EGEGE*E"),
    ],
)
def test_kimi_linear_counts_match_the_model_transformers_builds(extra, pattern):
    """KimiLinearForCausalLM on the meta device from the same config (and from its dict, as a
    checkpoint's config.json gives it): Kimi Delta Attention (q, k, v, the conv1d, b_proj, the
    low-rank gate and decay, dt_bias per channel, A_log per head, the gated norm, o_proj), MLA,
    the dense and MoE MLPs with the shared expert n_shared_experts times as wide; exact."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.KimiLinearConfig(**{**_SMALL_KIMI, **extra})
    with torch.device("meta"):
        model = transformers.KimiLinearForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown key
        spec = ModelSpec.from_hf_config(config)
        raw = ModelSpec.from_hf_config({"model_type": "kimi_linear", **_SMALL_KIMI, **extra})
    assert spec.pattern == raw.pattern == pattern
    assert spec.gdn.gate_rank == spec.gdn.head_v_dim and spec.mla is not None
    assert spec.n_params == raw.n_params == sum(p.numel() for p in model.parameters())


def test_kimi_linear_48b_a3b_defaults_have_its_published_size():
    """KimiLinearConfig's defaults (transformers documents them against
    moonshotai/Kimi-Linear-48B-A3B-Instruct; the MLA layers where its __post_init__ puts them
    without a checkpoint's list): 49.1 B parameters and 3.5 B active with the embeddings,
    Moonshot's "48B total, 3B activated"."""
    spec = ModelSpec.from_hf_config({"model_type": "kimi_linear"}, seq_len=4096)
    assert (spec.n_params, spec.n_active_params) == (49_133_074_464, 3_494_852_640)


def test_the_granite_4_h_small_catalog_entry_counts_as_transformers_builds():
    """The catalog's Granite 4.0-H Small (IBM: 32B total, 9B active): 32.2 B and 8.8 B, equal
    to GraniteMoeHybridForCausalLM built from the same shape on the meta device."""
    spec = ModelSpec.load("granite-4.0-h-small")
    assert (spec.n_params, spec.n_active_params) == (32_207_337_984, 8_803_121_664)
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    kinds = {"M": "mamba", "*": "attention"}
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        intermediate_size=spec.moe.ffn_hidden_size,
        shared_intermediate_size=spec.moe.shared_ffn_hidden_size,
        num_local_experts=spec.moe.n_experts,
        num_experts_per_tok=spec.moe.top_k,
        layer_types=[kinds[c] for c in spec.pattern if c in kinds],
        mamba_n_heads=spec.mamba.n_heads,
        mamba_d_head=spec.mamba.head_dim,
        mamba_n_groups=spec.mamba.n_groups,
        mamba_d_state=spec.mamba.d_state,
        mamba_chunk_size=spec.mamba.chunk_size,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        model = transformers.GraniteMoeHybridForCausalLM(config)
    assert spec.n_params == sum(p.numel() for p in model.parameters())
