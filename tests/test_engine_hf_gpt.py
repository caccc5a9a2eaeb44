"""Hugging Face GPT-2 and GPT-NeoX under the Engine (autosearch/models/hf/gpt.py), on CPU.

Single process: the wrapper computes what transformers computes (GPT-2's Conv1D as nn.Linear,
its fused q/k/v permuted per head), converts back to transformers bitwise, gives every tp rank
whole heads, converts its linears to float8, initialises on the meta device as transformers does,
and a GPT-2 from a config.json trains by the path users take, with the parameter count the cost
model reads from the same file.

Multi-process (gloo, `slow`): tiny random models of both families (tests/engine_workers.py:
GPT-2 with its default tied embeddings, GPT-NeoX with partial rotary and parallel residual) train
3 AdamW steps under each layout and must give the single-process losses, with the tolerances of
the other HF family tests (tests/test_engine_hf.py, test_engine_parity_parallel.py): bitwise where
every rank runs the same ops on the same micro-batches (pp without tied weights, float8 under pp),
2e-5 over the first two steps and 1e-3 over three where fp32 sums are reordered (dp, zero, tp,
cp, compile, tied weights summed over two pipeline stages).
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import engine_workers as W  # noqa: E402

from autosearch import Engine, ModelSpec, SpecError  # noqa: E402
from autosearch.models.hf.gpt import HFGPTCausalLM, interleave_qkv, is_gpt_model  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
EXACT, FP32 = W.EXACT, W.FP32
GPT2, NEOX = "hf_gpt2_tied", "hf_gpt_neox"  # GPT-2 ties its embeddings by default, NeoX does not
needs_torchao = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torchao") is None,
    reason="fp8 needs torchao (pip install 'autosearch[fp8]')",
)


def _wrapped(kind: str) -> tuple[object, HFGPTCausalLM, torch.Tensor]:
    """(transformers model, a wrapped copy of it, a batch of tokens)."""
    import copy

    hf = W.make_model(kind).eval()
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    return hf, HFGPTCausalLM(copy.deepcopy(hf)).eval(), x


# ---- single process ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [GPT2, NEOX])
def test_the_wrapper_computes_what_transformers_computes_and_converts_back(kind):
    """Transposing a Conv1D weight into an nn.Linear and permuting rows are exact, so the logits
    agree up to the matmul kernel's summation order (observed: bitwise on this CPU) and the
    state dict goes back to transformers' layout bitwise."""
    hf, model, x = _wrapped(kind)
    ref = hf(x).logits
    assert torch.allclose(model(x), ref, rtol=0, atol=1e-5)
    back = model.hf_model()
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.allclose(back.eval()(x).logits, ref, rtol=0, atol=1e-5)
    assert model.tied_embeddings == (kind == GPT2)
    if kind == GPT2:  # every Conv1D became an nn.Linear (what tp plans and torchao take)
        assert not any(type(m).__name__ == "Conv1D" for m in model.modules())


@pytest.mark.parametrize("tp", [2, 4])
def test_column_shards_of_the_fused_projection_hold_whole_heads(tp):
    """ColwiseParallel gives tp rank r the r-th contiguous block of a weight's rows. After the
    per-head permutation, GPT-2's block r holds exactly the q, k and v rows of heads
    r*H/tp .. (r+1)*H/tp - 1, in the (head, q|k|v, head_dim) order the attention reads; NeoX's
    query_key_value is in that order already."""
    n_heads, head_dim, hidden = 4, 16, 64
    w = torch.arange(3 * hidden * hidden, dtype=torch.float64).reshape(3 * hidden, hidden)
    q, k, v = w.split(hidden)  # GPT-2's [q | k | v] rows (Conv1D weight transposed)
    fused = interleave_qkv(w, n_heads)
    per_rank = n_heads // tp
    for r, block in enumerate(fused.chunk(tp)):
        heads = range(r * per_rank, (r + 1) * per_rank)
        rows = [part[h * head_dim : (h + 1) * head_dim] for h in heads for part in (q, k, v)]
        assert torch.equal(block, torch.cat(rows))
    assert torch.equal(interleave_qkv(fused, n_heads, inverse=True), w)


def test_gpt2_from_a_config_file_trains_by_the_users_path_with_the_cost_models_count(
    tmp_path, capsys
):
    """The config.json that `autosearch estimate --model` reads builds the GPT-2 the Engine
    trains: the ModelSpec's parameter count is the module's, the Engine's cost() reads the same
    spec, the loss falls, and `save_pretrained` writes a model transformers loads back with the
    trained weights."""
    from autosearch.cli import main

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, embd_pdrop=0.0
    )
    path = tmp_path / "gpt2-config.json"
    path.write_text(json.dumps(config.to_dict()))
    argv = [
        "estimate",
        "--model",
        str(path),
        "--cluster",
        "h100-sxm:1x8",
        "--strategy",
        "dp=8,global_batch_size=16",
    ]
    assert main(argv) == 0
    assert "step time" in capsys.readouterr().out
    spec = ModelSpec.load(str(path))

    def factory():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config.from_json_file(path))

    unique = {id(p): p.numel() for p in factory().parameters()}  # tied wte/lm_head once
    assert spec.n_params == sum(unique.values())
    engine = Engine(
        factory,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        strategy=B,
        cluster="h100-sxm:1x1",
        seed=0,
    )
    assert engine._model_spec().n_params == spec.n_params
    history = engine.fit(W.dataset(GPT2, 32), epochs=1, verbose=0)
    losses = history["loss"]
    assert losses[-1] < losses[0] - 0.05, losses
    step_time_s, peak_bytes = engine.cost()
    assert step_time_s > 0 and peak_bytes > 0
    engine.save_pretrained(str(tmp_path / "hf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    data = W.dataset(GPT2, 2, seed=3)
    (ours,) = engine.predict(data, batch_size=2)
    x = torch.stack([data[i][0] for i in range(2)])
    assert torch.allclose(loaded.eval()(x).logits, ours, rtol=0, atol=1e-5)


def test_published_gpt2_config_counts_the_parameters_transformers_builds():
    """GPT-2 124M (tests/data/hf_configs/gpt2.json): the ModelSpec counts every parameter of
    GPT2LMHeadModel (built on the meta device). GPT-NeoX differs by exactly its learned
    positions, seq_len * hidden, which a GPT-style ModelSpec counts and NeoX (rotary) does not
    have (autosearch/core/hf_config.py documents it)."""
    path = W.ROOT / "tests" / "data" / "hf_configs" / "gpt2.json"
    config = transformers.GPT2Config.from_json_file(path)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    assert ModelSpec.load(str(path)).n_params == sum(p.numel() for p in model.parameters())
    neox = W.make_model(NEOX)
    spec = HFGPTCausalLM(neox).spec
    assert spec.n_params - sum(p.numel() for p in neox.parameters()) == 32 * 64


@pytest.mark.parametrize("kind", [GPT2, NEOX])
def test_meta_init_initialises_as_transformers_does(kind):
    """Built on the meta device, `init_weights` gives transformers' init: N(0, 0.02) weights
    (GPT-2's output projections N(0, 0.02 / sqrt(2 n_layer))), zero biases, LayerNorm (1, 0);
    a sample std of n draws is within 5/sqrt(2n) of the true one (relative), 5 sigma."""
    with torch.device("meta"):
        model = HFGPTCausalLM(W.hf_model(kind))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    scaled = 0.02 / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif "ln" in name or "layernorm" in name or "layer_norm" in name:
            assert torch.all(p == 1), name
        else:
            gpt2_out = kind == GPT2 and name.endswith("c_proj.weight")
            std = scaled if gpt2_out else 0.02
            assert abs(p.std().item() / std - 1) < 5 / math.sqrt(2 * p.numel()), name
    x = torch.zeros(1, 32, dtype=torch.long)
    assert torch.isfinite(model(x)).all()


@pytest.mark.parametrize("kind", [GPT2, NEOX])
def test_recompute_and_fp8_reach_every_block(kind):
    """Selective recompute checkpoints each block's attention core; full and op-level wrap each
    block; torchao converts every block linear (GPT-2's ex-Conv1D included) to float8 and leaves
    the embeddings and lm_head."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from autosearch.engine.parallelize import apply_ac

    for recompute, where in (("selective", "core"), ("full", None), ("selective_op", None)):
        model = HFGPTCausalLM(W.make_model(kind))
        apply_ac(model, model.parallel_plan(), recompute)
        wrapped = [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]
        assert len(wrapped) == 4, (recompute, wrapped)
        assert all(n.endswith(where) for n in wrapped) if where else True
    if __import__("importlib").util.find_spec("torchao") is None:
        return
    from torchao.float8.float8_linear import Float8Linear

    from autosearch.engine.parallelize import apply_fp8

    model = HFGPTCausalLM(W.make_model(kind))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    apply_fp8(model, model.parallel_plan(), "tensorwise")
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == linears - {"lm_head"} and len(converted) == 4 * 4


def test_what_the_gpt_families_refuse_says_why():
    """Sequences past GPT-2's learned positions, and GPT-2 with cross-attention, are refused
    with the reason; GPT-2's other heads are not causal LMs and stay unwrapped."""
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = HFGPTCausalLM(transformers.GPT2LMHeadModel(config))
    with pytest.raises(SpecError, match="n_positions=16"):
        model(torch.zeros(1, 32, dtype=torch.long))
    cross = transformers.GPT2Config(**{**config.to_dict(), "add_cross_attention": True})
    with pytest.raises(SpecError, match="cross-attention"):
        HFGPTCausalLM(transformers.GPT2LMHeadModel(cross))
    assert not is_gpt_model(transformers.GPT2DoubleHeadsModel(config))


# ---- multi-process equivalence -----------------------------------------------------------------
# name: (strategy, model, tolerance, what the single-process reference adds to B)
WORLD2 = {
    f"{fam}/{name}": (strategy, kind, tol, extra)
    for fam, kind in (("gpt2", GPT2), ("neox", NEOX))
    for name, (strategy, tol, extra) in {
        "dp2": (f"dp=2,{B}", FP32, ""),
        "zero1": (f"dp=2,zero_stage=1,{B}", FP32, ""),
        "zero2": (f"dp=2,zero_stage=2,{B}", FP32, ""),
        "zero3": (f"dp=2,zero_stage=3,{B}", FP32, ""),
        "tp2_sp": (f"tp=2,sequence_parallel=true,{B}", FP32, ""),
        "tp2_selective": (f"tp=2,recompute=selective,{B}", FP32, ""),
        "tp2_sp_selective_op": (
            f"tp=2,sequence_parallel=true,recompute=selective_op,{B}",
            FP32,
            "",
        ),
        # GPT-2's tied wte / lm_head sit on the first and the last stage: gradients summed
        "pp2_1f1b": (f"pp=2,pipeline_schedule=1f1b,{B}", FP32 if kind == GPT2 else EXACT, ""),
        "pp2_fp8": (f"pp=2,fp8=tensorwise,{B}", FP32 if kind == GPT2 else EXACT, "fp8=tensorwise"),
        "cp2": (f"cp=2,{B}", FP32, ""),
        "tp2_sp_compile": (f"tp=2,sequence_parallel=true,compile=true,{B}", FP32, ""),
    }.items()
}
# compile with in-layer recompute: refused for the Llama families when transformers' hub
# kernels are installed (their layers carry its wrapper), run for these two
WORLD2["gpt2/dp2_compile_selective_op"] = (
    f"dp=2,compile=true,recompute=selective_op,{B}",
    GPT2,
    FP32,
    "",
)
WORLD4 = {
    # tied weights under pp x tp: the stages' copies are summed shard by shard
    "gpt2/pp2_tp2_sp": (f"pp=2,tp=2,sequence_parallel=true,{B}", GPT2, FP32, ""),
    "llama_tied/pp2_tp2": (f"pp=2,tp=2,{B}", "hf_llama_tied", FP32, ""),
    "neox/pp2_tp2_sp": (f"pp=2,tp=2,sequence_parallel=true,{B}", NEOX, FP32, ""),
    "neox/cp2_tp2_sp": (f"cp=2,tp=2,sequence_parallel=true,{B}", NEOX, FP32, ""),
}
TABLES = {**WORLD2, **WORLD4}


def _cases(table):
    return [dict(name=name, strategy=v[0], model=v[1]) for name, v in table.items()]


@pytest.fixture(scope="module")
def references():
    keys = {(v[1], v[3]) for v in TABLES.values()}
    return {
        (model, extra): W.reference_losses(f"{B},{extra}" if extra else B, model)
        for model, extra in sorted(keys)
    }


@pytest.fixture(scope="module")
def world2():
    return W.launch(2, "equivalence", _cases(WORLD2), timeout_s=900)


@pytest.fixture(scope="module")
def world4():
    return W.launch(4, "equivalence", _cases(WORLD4), timeout_s=600)


def _check(results, references, name):
    _, model, tol, extra = TABLES[name]
    ref = references[(model, extra)]
    got = results[0][name]
    assert all(r[name] == got for r in results), f"{name}: ranks report different losses"
    W.assert_matches_one_process(name, got, ref, tol)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_matches_single_process(world2, references, name):
    _check(world2, references, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_matches_single_process(world4, references, name):
    _check(world4, references, name)
