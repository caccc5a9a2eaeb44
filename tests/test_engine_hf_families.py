"""Hugging Face dense families under the Engine (autosearch/models/hf/dense.py, gemma.py, phi3.py):
Qwen3, Gemma, Gemma 2, Gemma 3 (text), Phi-3 and Nemotron, on CPU.

Single process (default run): the wrapper computes what transformers' eager attention computes
(sliding windows of 8 tokens on sequences of 32, soft-capping) and converts back to transformers
bitwise (Phi-3's re-laid fused rows included); its ModelSpec is the planner's
(`autosearch.core.hf_config`, the reader `autosearch tune --model config.json` uses) for published
configs, and counts the module's parameters up to exactly what that reader documents it leaves
out; Phi-3's column shards hold matching heads and halves; meta-device init is transformers';
what a family cannot run is refused with the reason; a config.json trains by the user's path and
saves a model transformers loads back.

Multi-process (gloo): tiny random models of each family (tests/engine_workers.py
`HF_DENSE_FAMILIES`, 2 layers of width 64) train 3 AdamW steps and must give the single-process
losses, with the tolerances of the other HF family tests (tests/test_engine_hf.py): bitwise for pp
without tied weights (the same ops on the same micro-batches), 2e-5 over the first two steps and
1e-3 over three where fp32 sums are reordered (dp, zero, tp, cp, tied weights summed over two
pipeline stages). The default run launches one world of 2 processes covering each family once or
twice (`slow`); the families x dimensions matrix is `extended` (``pytest -m extended``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import engine_workers as W  # noqa: E402

from autosearch import Engine, ModelSpec, SpecError  # noqa: E402
from autosearch.core.strategy import Strategy  # noqa: E402
from autosearch.engine.build import wrap_known  # noqa: E402
from autosearch.models.hf.dense import HFDenseCausalLM  # noqa: E402
from autosearch.models.hf.phi3 import group_qkv, interleave_gate_up  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
EXACT, FP32 = W.EXACT, W.FP32
# The Gemmas tie lm_head to the embedding by default; the others do not.
KINDS = {
    "qwen3": "hf_qwen3",
    "gemma": "hf_gemma_tied",
    "gemma2": "hf_gemma2_tied",
    "gemma3": "hf_gemma3_tied",
    "phi3": "hf_phi3",
    "nemotron": "hf_nemotron",
}


def _published(name: str):
    """(transformers config, path) of a published config in tests/data/hf_configs; Gemma 3's
    multimodal file gives its text model's config, the causal LM the Engine trains."""
    path = W.ROOT / "tests" / "data" / "hf_configs" / f"{name}.json"
    raw = json.loads(path.read_text())
    if raw["model_type"] == "gemma3":
        return transformers.Gemma3TextConfig(**raw["text_config"]), path
    return transformers.AutoConfig.from_pretrained(str(path)), path


def _left_out(config) -> int:
    """The parameters a ModelSpec does not count, as autosearch/core/hf_config.py lists them:
    Qwen3's and Gemma 3's per-head q/k norms, Gemma 2/3's two extra norms per layer (the norm
    after attention replaces none: Gemma has four per layer, a ModelSpec two), Nemotron's
    LayerNorm biases."""
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    per_layer = {
        "qwen3": 2 * head_dim,
        "gemma2": 2 * h,
        "gemma3_text": 2 * h + 2 * head_dim,
        "nemotron": 2 * h,
    }.get(config.model_type, 0)
    final = h if config.model_type == "nemotron" else 0
    return layers * per_layer + final


# ---- single process ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(KINDS))
def test_the_wrapper_computes_what_transformers_computes_and_converts_back(family):
    """Logits within 1e-5 of transformers' eager attention (observed <= 5e-7: SDPA vs matmul
    sums; Gemma 2 bitwise), parameter names exactly transformers', and the state dict back in
    transformers' layout bitwise (Phi-3's fused rows permuted back)."""
    import copy

    hf = W.make_model(KINDS[family])
    hf.set_attn_implementation("eager")
    hf.eval()
    model = wrap_known(copy.deepcopy(hf)).eval()
    assert isinstance(model, HFDenseCausalLM)
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in hf.named_parameters()}
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = hf(x).logits
    assert torch.allclose(model(x), ref, rtol=0, atol=1e-5)
    back = model.hf_model()
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    back.set_attn_implementation("eager")
    assert torch.allclose(back.eval()(x).logits, ref, rtol=0, atol=1e-5)
    assert model.tied_embeddings == family.startswith("gemma")


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-8b",
        "gemma-2-9b",
        "gemma-3-27b",
        "phi-3-mini-4k-instruct",
        "phi-4",
        "nemotron-4b",
    ],
)
def test_published_configs_give_the_planners_spec_and_its_parameter_count(name):
    """The ModelSpec the Engine reads (`HFDenseCausalLM.spec`, for cost and tune) is the one the
    planner reads from the same config.json (`ModelSpec.load`, as `autosearch tune --model`
    does), and the module built on the meta device has exactly its parameters plus what the
    reader documents it leaves out (`_left_out`: zero for Gemma and Phi-3)."""
    config, path = _published(name)
    planned = ModelSpec.load(str(path), seq_len=4096)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        model = HFDenseCausalLM(model_class(config), seq_len=4096)
    assert dataclasses.replace(model.spec, name=planned.name) == planned
    n_torch = sum(p.numel() for p in model.parameters())
    assert n_torch == planned.n_params + _left_out(config), (n_torch, planned.n_params)


@pytest.mark.parametrize("tp", [2, 4])
def test_phi3_column_shards_hold_matching_heads_and_halves(tp):
    """ColwiseParallel gives tp rank r the r-th contiguous block of rows. After the wrapper's
    re-layout, block r of qkv_proj holds, for each of its KV / tp key/value heads, that head's
    queries, key and value (GQA: 8 query heads, 4 kv heads); block r of gate_up_proj holds the
    gate and up rows of the same F / tp units, interleaved. Both go back bitwise."""
    n_heads, n_kv, d, width = 8, 4, 2, 8
    w = torch.arange((n_heads + 2 * n_kv) * d * 3, dtype=torch.float64).reshape(-1, 3)
    q, k, v = w.split([n_heads * d, n_kv * d, n_kv * d])
    groups, kv_per_rank = n_heads // n_kv, n_kv // tp
    for r, block in enumerate(group_qkv(w, n_heads, n_kv).chunk(tp)):
        rows = []
        for g in range(r * kv_per_rank, (r + 1) * kv_per_rank):
            rows += [q[g * groups * d : (g + 1) * groups * d], k[g * d : (g + 1) * d]]
            rows.append(v[g * d : (g + 1) * d])
        assert torch.equal(block, torch.cat(rows))
    assert torch.equal(group_qkv(group_qkv(w, n_heads, n_kv), n_heads, n_kv, inverse=True), w)
    gate_up = torch.arange(2 * width * 3, dtype=torch.float64).reshape(-1, 3)
    gate, up = gate_up.chunk(2)
    units = width // tp
    for r, block in enumerate(interleave_gate_up(gate_up).chunk(tp)):
        mine = slice(r * units, (r + 1) * units)
        assert torch.equal(block[0::2], gate[mine]) and torch.equal(block[1::2], up[mine])
    assert torch.equal(interleave_gate_up(interleave_gate_up(gate_up), inverse=True), gate_up)


@pytest.mark.parametrize("family", list(KINDS))
def test_meta_init_initialises_as_transformers_does(family):
    """Built on the meta device, `init_weights` gives transformers' init: every buffer equal to
    a normally built model's (Gemma's embedding scale, Gemma 3's rotary table per layer type),
    N(0, initializer_range) weights, norms as transformers sets them (Gemma's (1 + w) weights
    zero), the pad token's embedding row zero; a sample std of n draws within 5/sqrt(2n) of the
    true one, relative (5 sigma)."""
    import math

    kind = KINDS[family]
    ref = W.hf_model(kind)
    with torch.device("meta"):
        model = HFDenseCausalLM(W.hf_model(kind))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, buf in ref.named_buffers(remove_duplicate=False):
        assert torch.equal(buffers[name], buf), name
    params = dict(model.named_parameters())
    for name, want in ref.named_parameters():
        got = params[name].detach()
        if want.dim() == 1:  # norms (and Nemotron's biases): constants
            assert torch.equal(got, want.detach()), name
        else:
            std = ref.config.initializer_range  # 0.02; Nemotron's 0.0134
            assert abs(got.std().item() / std - 1) < 5 / math.sqrt(2 * got.numel()), name
    pad = model.model.embed_tokens.padding_idx
    if pad is not None:
        assert torch.all(model.model.embed_tokens.weight[pad] == 0)
    assert torch.isfinite(model(torch.zeros(1, 32, dtype=torch.long))).all()


def test_meta_init_in_one_process_keeps_the_embeddings_tied():
    """``to_empty`` from the meta device gives each name of a tied plain parameter its own
    tensor; the Engine ties them again (`autosearch.engine.build.materialize`), so one process
    trains Gemma's tied embedding and head as one matrix, as tp and FSDP (DTensors) do."""
    engine = Engine(lambda: W.make_model(KINDS["gemma"]), strategy=B, meta_init=True, seed=0)
    engine.prepare()
    (model,) = engine.model_parts_
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.all(model.model.embed_tokens.weight[0] == 0)  # the pad row, zeroed last


def test_what_the_dense_families_refuse_says_why():
    """A bidirectional Gemma (an encoder) is not wrapped; Phi-3 under a tp that does not divide
    its MLP width, and any family under a tp that does not divide its key/value heads, are
    refused before anything is built; Qwen3's use_sliding_window (windows from
    max_window_layers on) is refused by the planner's reader, so by the wrapper."""
    gemma3 = transformers.Gemma3TextConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, vocab_size=64, use_bidirectional_attention=True,
    )  # fmt: skip
    with pytest.raises(SpecError, match="use_bidirectional_attention"):
        HFDenseCausalLM(transformers.Gemma3ForCausalLM(gemma3))
    phi3 = transformers.Phi3Config(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=98, vocab_size=64, pad_token_id=0,
    )  # fmt: skip
    model = HFDenseCausalLM(transformers.Phi3ForCausalLM(phi3))
    plan = model.parallel_plan()
    problems = plan.check(Strategy.parse("tp=4,micro_batch_size=1,global_batch_size=1"))
    assert any("intermediate_size=98" in p for p in problems), problems
    assert not plan.check(Strategy.parse("tp=2,micro_batch_size=1,global_batch_size=1"))
    qwen = HFDenseCausalLM(W.hf_model("hf_qwen3"))  # 2 key/value heads
    problems = qwen.parallel_plan().check(
        Strategy.parse("tp=4,micro_batch_size=1,global_batch_size=1")
    )
    assert any("n_kv_heads=2" in p for p in problems), problems
    windowed = transformers.Qwen3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=64, use_sliding_window=True, max_window_layers=1,
    )  # fmt: skip
    with pytest.raises(SpecError, match="use_sliding_window"):
        HFDenseCausalLM(transformers.Qwen3ForCausalLM(windowed))


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_a_config_file_trains_by_the_users_path_and_saves_for_transformers(tmp_path, family):
    """The config.json the planner reads builds the model the Engine trains (wrapped by
    itself): the Engine's ModelSpec is ModelSpec.load(config.json)'s, cost() prices it, the
    loss falls, and `save_pretrained` writes a model transformers loads back with the trained
    weights (Gemma 2: soft-capping, eager attention; Phi-3: the fused rows back in its order)."""
    config = W.make_model(KINDS[family]).config
    path = tmp_path / f"{family}-config.json"
    path.write_text(config.to_json_string())
    config_class = type(config)
    model_class = transformers.AutoModelForCausalLM._model_mapping[config_class]

    def factory():
        return model_class(config_class.from_json_file(path))

    engine = Engine(
        factory,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        strategy=B,
        cluster="h100-sxm:1x1",
        seed=0,
    )
    planned = ModelSpec.load(str(path))
    assert dataclasses.replace(engine._model_spec(), name=planned.name) == planned
    losses = engine.fit(W.dataset(KINDS[family], 32), epochs=1, verbose=0)["loss"]
    assert losses[-1] < losses[0] - 0.05, losses
    step_time_s, peak_bytes = engine.cost()
    assert step_time_s > 0 and peak_bytes > 0
    engine.save_pretrained(str(tmp_path / "hf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    data = W.dataset(KINDS[family], 2, seed=3)
    (ours,) = engine.predict(data, batch_size=2)
    x = torch.stack([data[i][0] for i in range(2)])
    loaded.set_attn_implementation("eager")
    assert torch.allclose(loaded.eval()(x).logits, ours, rtol=0, atol=1e-5)


# ---- multi-process equivalence -----------------------------------------------------------------
DIMENSIONS = {  # name: (strategy, tolerance; pp: bitwise unless the embeddings are tied)
    "dp2": ("dp=2", FP32),
    "zero1": ("dp=2,zero_stage=1", FP32),
    "zero2": ("dp=2,zero_stage=2", FP32),
    "zero3": ("dp=2,zero_stage=3", FP32),
    "tp2": ("tp=2", FP32),
    "tp2_sp": ("tp=2,sequence_parallel=true", FP32),
    "tp2_sp_selective": ("tp=2,sequence_parallel=true,recompute=selective", FP32),
    "dp2_full": ("dp=2,recompute=full", FP32),
    "pp2": ("pp=2,pipeline_schedule=1f1b", EXACT),
    "cp2": ("cp=2", FP32),
    "cp2_selective": ("cp=2,recompute=selective", FP32),
}


def _case(family: str, dimension: str, *, meta_init: bool = False) -> tuple:
    """(strategy, model, tolerance, built on the meta device and initialised by the Engine)."""
    strategy, tol = DIMENSIONS[dimension]
    kind = KINDS[family]
    if tol == EXACT and kind.endswith("_tied"):  # tied copies summed over the two stages
        tol = FP32
    return f"{strategy},{B}", kind, tol, meta_init


# One world of 2 in the default run: each family once or twice, on what is special to it.
DEFAULT = {
    f"{family}/{dim}": _case(family, dim)
    for family, dim in [
        ("qwen3", "tp2_sp"),  # per-head q/k norms sharded with the heads
        ("gemma", "pp2"),  # tied embedding and head on two stages, scaled embedding
        ("gemma2", "cp2"),  # windows and soft-capping over the cp ranks' chunks
        ("gemma2", "tp2_sp"),  # the extra norms under sequence parallel
        ("gemma3", "tp2_sp_selective"),  # q/k norms on dim 1, rotary per layer type
        ("phi3", "tp2_sp"),  # fused projections split by rank
        ("phi3", "cp2"),  # a window on every layer
        ("nemotron", "zero3"),  # LayerNorm1P, squared-ReLU MLP
    ]
}
MATRIX = {f"{f}/{d}": _case(f, d) for f in KINDS for d in DIMENSIONS}
# Meta-device init on DTensor shards (tp, FSDP) against one process's meta-device init: the
# families whose embedding has a pad row, which transformers zeroes on a copy of a DTensor's row
# (`HFDenseCausalLM.init_weights` zeroes it in the shard).
MATRIX |= {
    f"{f}/meta_init_{d}": _case(f, d, meta_init=True)
    for f in ("gemma", "phi3")
    for d in ("tp2_sp", "zero3")
}
WORLD4 = {
    "gemma2/pp2_tp2_sp": (f"pp=2,tp=2,sequence_parallel=true,{B}", KINDS["gemma2"], FP32, False),
    "phi3/cp2_tp2_sp": (f"cp=2,tp=2,sequence_parallel=true,{B}", KINDS["phi3"], FP32, False),
    "gemma3/dp2_tp2_zero3_sp": (
        f"dp=2,tp=2,zero_stage=3,sequence_parallel=true,{B}",
        KINDS["gemma3"],
        FP32,
        False,
    ),
    "nemotron/pp2_cp2": (f"pp=2,cp=2,{B}", KINDS["nemotron"], FP32, False),
}


def _launch(world: int, table: dict) -> dict:
    cases = [dict(name=n, strategy=v[0], model=v[1], meta_init=v[3]) for n, v in table.items()]
    results = W.launch(world, "equivalence_each", cases, timeout_s=900)
    for name in table:
        assert all(r[name] == results[0][name] for r in results), f"{name}: ranks differ"
    return results[0]


@pytest.fixture(scope="module")
def references():
    """The single-process losses of each family (built as usual, or on the meta device and
    initialised by the Engine), computed once when first asked."""
    cache: dict[tuple[str, bool], list[float]] = {}

    def losses(kind: str, meta_init: bool = False) -> list[float]:
        if (kind, meta_init) not in cache:
            torch.set_num_threads(1)  # as the workers
            run = W.meta_init_losses if meta_init else W.reference_losses
            cache[kind, meta_init] = run(B, kind)
        return cache[kind, meta_init]

    return losses


@pytest.fixture(scope="module")
def default_world():
    return _launch(2, DEFAULT)


@pytest.fixture(scope="module")
def matrix_world():
    return _launch(2, MATRIX)


@pytest.fixture(scope="module")
def world4():
    return _launch(4, WORLD4)


def _check(got, ref: list[float], name: str, tol) -> None:
    W.assert_matches_one_process(name, got, ref, tol)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DEFAULT))
def test_each_family_matches_one_process(default_world, references, name):
    _, kind, tol, meta_init = DEFAULT[name]
    _check(default_world[name], references(kind, meta_init), name, tol)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name", list(MATRIX))
def test_families_by_dimensions_match_one_process(matrix_world, references, name):
    _, kind, tol, meta_init = MATRIX[name]
    _check(matrix_world[name], references(kind, meta_init), name, tol)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name", list(WORLD4))
def test_families_at_world_size_4_match_one_process(world4, references, name):
    _, kind, tol, meta_init = WORLD4[name]
    _check(world4[name], references(kind, meta_init), name, tol)
