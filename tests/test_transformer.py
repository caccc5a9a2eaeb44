"""The reference transformer: shapes, parameter counts against ModelSpec, causality, plans,
splits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from autosearch import ModelSpec, Strategy  # noqa: E402
from autosearch.distributed.plan import ParallelPlan  # noqa: E402
from autosearch.engine.parallelize import apply_ac  # noqa: E402
from autosearch.engine.pipeline import split_pipeline, stage_indices  # noqa: E402
from autosearch.models.transformer import Transformer  # noqa: E402

# Catalog models shrunk for a CPU, keeping their style (GPT / Llama, tied, GQA ratio).
SHRUNK = {
    "gpt3-125m": dict(
        n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=4, vocab_size=256, seq_len=16
    ),
    "tiny-gpt": dict(n_layers=2, hidden_size=64, vocab_size=256, seq_len=16),
    "llama3-8b": dict(
        n_layers=2,
        hidden_size=64,
        n_heads=8,
        n_kv_heads=2,
        ffn_hidden_size=160,
        vocab_size=256,
        seq_len=16,
    ),
    "llama2-70b": dict(
        n_layers=2,
        hidden_size=64,
        n_heads=8,
        n_kv_heads=1,
        ffn_hidden_size=160,
        vocab_size=256,
        seq_len=16,
    ),
}


@pytest.mark.parametrize("name", list(SHRUNK))
def test_shrunk_catalog_models_run_and_match_the_spec_parameter_count(name):
    spec = ModelSpec.load(name).scaled(**SHRUNK[name])
    model = Transformer(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    logits = model(torch.randint(0, spec.vocab_size, (2, spec.seq_len)))
    assert logits.shape == (2, spec.seq_len, spec.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["tiny-gpt", "llama3-8b"])
def test_attention_is_causal(name):
    spec = ModelSpec.load(name).scaled(**SHRUNK[name])
    model = Transformer(spec).eval()
    x = torch.randint(0, spec.vocab_size, (1, spec.seq_len))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % spec.vocab_size
    assert torch.equal(model(x)[0, :-1], model(y)[0, :-1])


def test_tp_plan_names_every_block_matrix():
    spec = ModelSpec.load("llama3-8b").scaled(**SHRUNK["llama3-8b"])
    plan = Transformer.tp_plan(sequence_parallel=True, loss_parallel=False)
    matrices = {
        n.split(".", 2)[2]
        for n, m in Transformer(spec).named_modules()
        if isinstance(m, torch.nn.Linear) and n.startswith("layers.")
    }
    assert {f"layers.*.{m}" for m in matrices} <= set(plan)


def test_plan_split_points():
    even = ParallelPlan()
    assert even.chunk_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert "do not split" in even.chunk_bounds(6, 4)
    custom = ParallelPlan(split_points=(1, 3))
    assert custom.chunk_bounds(6, 3) == [(0, 1), (1, 3), (3, 6)]
    assert "make 3 pipeline chunks" in custom.chunk_bounds(6, 2)
    assert "increasing" in ParallelPlan(split_points=(3, 3)).chunk_bounds(6, 3)


def test_pipeline_split_keeps_parameter_names():
    spec = ModelSpec.load("tiny-gpt").scaled(
        n_layers=4, hidden_size=64, vocab_size=256, seq_len=16
    )
    model = Transformer(spec)
    plan = model.parallel_plan()
    strategy = Strategy(
        pp=2,
        virtual_stages=2,
        pipeline_schedule="interleaved_1f1b",
        micro_batch_size=1,
        global_batch_size=4,
    )
    assert stage_indices(1, 2, 2) == [1, 3]
    names = []
    for rank in range(2):
        for stage, part in split_pipeline(model, plan, strategy, pp_rank=rank):
            keys = list(part.state_dict())
            assert (stage == 0) == any(k.startswith("tok_embeddings") for k in keys)
            assert (stage == 3) == any(k.startswith("output") for k in keys)
            names += keys
    assert sorted(names) == sorted(model.state_dict())  # every name once, as in the full model


def test_pipeline_stages_chain_to_the_full_model():
    spec = ModelSpec.load("llama3-8b").scaled(**{**SHRUNK["llama3-8b"], "n_layers": 4})
    model = Transformer(spec)
    strategy = Strategy(pp=2, micro_batch_size=1, global_batch_size=2)
    parts = [
        p
        for r in range(2)
        for _, p in split_pipeline(model, model.parallel_plan(), strategy, pp_rank=r)
    ]
    x = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    assert torch.equal(parts[1](parts[0](x)), model(x))


def test_recompute_wraps_blocks_or_attention_core():
    spec = ModelSpec.load("tiny-gpt").scaled(**SHRUNK["tiny-gpt"])
    full, selective = Transformer(spec), Transformer(spec)
    apply_ac(full, full.parallel_plan(), "full")
    apply_ac(selective, selective.parallel_plan(), "selective")
    assert all(type(b).__name__ == "CheckpointWrapper" for b in full.layers.values())
    assert all(
        type(b.attention.core).__name__ == "CheckpointWrapper" for b in selective.layers.values()
    )
    x = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    torch.manual_seed(0)
    reference = Transformer(spec)
    for wrapped in (full, selective):
        wrapped.load_state_dict(reference.state_dict())
        assert torch.equal(wrapped(x), reference(x))


# ---- attention with masks: sliding windows, soft-capping (autosearch/models/attention.py) -----
def _loop_attention(q, k, v, *, window, softcap):
    """Each query's attention written out key by key: what the masked path must equal."""
    import math

    import torch

    b, h, s, d = q.shape
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    out = torch.zeros_like(q)
    for i in range(s):
        keys = [j for j in range(i + 1) if window is None or i - j < window]
        scores = torch.stack([(q[:, :, i] * k[:, :, j]).sum(-1) for j in keys], -1) / math.sqrt(d)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        weights = scores.softmax(-1)
        out[:, :, i] = sum(weights[..., n, None] * v[:, :, j] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("window, softcap", [(4, None), (None, 5.0), (3, 2.0), (64, None)])
def test_masked_attention_is_each_querys_attention(window, softcap):
    import torch

    from autosearch.models.transformer import CoreAttention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 10, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, 2, 10, 8, dtype=torch.float64),
        torch.randn(2, 2, 10, 8, dtype=torch.float64),
    )
    got = CoreAttention(window=window, softcap=softcap)(q, k, v)
    want = _loop_attention(q, k, v, window=window, softcap=softcap)
    assert torch.allclose(got, want, atol=1e-12)


def test_gemma_and_nemotron_shapes_build_with_the_planners_parameters():
    """GeGLU with heads wider than hidden / heads, windows on every other layer, soft-capped
    scores and logits (Gemma 2); squared ReLU (Nemotron): the reference transformer holds the
    parameters the cost model counts, and its logits are capped."""
    import torch

    from autosearch.models.transformer import Transformer

    base = ModelSpec.load("tiny-llama").scaled(
        n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, vocab_size=128, seq_len=16
    )
    gemma = base.scaled(
        ffn_activation="geglu",
        head_dim=32,
        sliding_window=4,
        sliding_window_pattern=2,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=3.0,
        tied_embeddings=True,
    )
    for spec in (gemma, base.scaled(ffn_activation="relu2")):
        model = Transformer(spec)
        assert sum(p.numel() for p in model.parameters()) == spec.n_params
    model = Transformer(gemma)
    assert [layer.attention.core.window for layer in model.layers.values()] == [4, None]
    logits = model(torch.randint(0, 128, (2, 16)))
    assert logits.abs().max() < 3.0


# Hybrids shrunk for a CPU, keeping their layer patterns' kinds of block: Nemotron-H (Mamba-2
# with and without an MLP, attention, squared-ReLU MLPs), and a Qwen3-Next-like pattern of Gated
# DeltaNet and attention blocks with SwiGLU MoE MLPs and an MLP alone.
MAMBA_SMALL = dict(n_heads=8, head_dim=8, d_state=8, n_groups=2, chunk_size=8)
GDN_SMALL = dict(n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=8, chunk_size=8)
HYBRIDS = {
    "nemotron-h-8b": dict(
        layer_pattern="M-M*-M",
        n_layers=4,
        hidden_size=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_hidden_size=96,
        vocab_size=256,
        seq_len=24,
        mamba=MAMBA_SMALL,
    ),
    "qwen3-next-like": dict(
        layer_pattern="GEG*E-",
        n_layers=4,
        hidden_size=64,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_size=96,
        ffn_activation="swiglu",
        vocab_size=256,
        seq_len=24,
        gdn=GDN_SMALL,
        moe=dict(n_experts=4, top_k=2, ffn_hidden_size=32),
    ),
}


def hybrid(name: str) -> ModelSpec:
    """A hybrid of `HYBRIDS` (the catalog's Nemotron-H 8B, or tiny-llama made a GDN hybrid)."""
    fields = dict(HYBRIDS[name])
    base = ModelSpec.load(name if name in ("nemotron-h-8b",) else "tiny-llama")
    return ModelSpec.from_dict({**base.to_dict(), **fields, "name": name}, what=name)


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_shrunk_hybrids_build_with_the_planners_parameter_count(name):
    spec = hybrid(name)
    model = Transformer(spec)
    kinds = [(layer.mixer, layer.mlp) for layer in spec.layers]
    assert len(set(kinds)) >= 3  # several kinds of block, a part alone among them
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    x = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    logits = model(x)
    assert logits.shape == (2, spec.seq_len, spec.vocab_size) and torch.isfinite(logits).all()
    # causal: a change in the last token changes no earlier logit (the scans and convs included)
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % spec.vocab_size
    model.eval()
    assert torch.allclose(model(x)[:, :-1], model(y)[:, :-1], atol=1e-6)
