"""Qwen3-Next's gated attention (`ModelSpec.attention_output_gate`) in the reference transformer.

transformers' ``Qwen3NextAttention`` (5.25): ``q_proj`` gives, per head, the query and then a
gate of the same width; the attention output is multiplied by ``sigmoid(gate)`` before
``o_proj``. The reference transformer's ``wq`` has that layout, so tensor parallel's column
split by heads gives each rank its heads' gates, and the gate is elementwise per token, so under
context parallel each rank gates its own tokens.

Single process: the parameter count is the planner's, and with the gate rows zero (sigmoid 0 =
1/2) the block computes half the ungated attention. Multi-process (gloo, world 2, fp32, 3 AdamW
steps as tests/test_engine_hybrid.py): tp, tp + sp, cp and pp against one process, with that
file's tolerances (bitwise for pp; TP for tp, where fp32 sums are reordered over the ranks'
heads; 2e-5 / 1e-3 for cp, whose ring attention reorders the softmax sums).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import engine_workers as W  # noqa: E402

from autosearch.models.transformer import Attention, Transformer  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
EXACT, FP32, TP = W.EXACT, W.FP32, W.TP
CASES = {  # name: (strategy, model, tolerance)
    "gated_llama/tp2": (f"tp=2,{B}", "gated_llama", TP),
    "gated_llama/tp2_sp_selective": (
        f"tp=2,sequence_parallel=true,recompute=selective,{B}",
        "gated_llama",
        TP,
    ),
    "gated_llama/cp2": (f"cp=2,{B}", "gated_llama", FP32),
    "gated_gdn/tp2_sp": (f"tp=2,sequence_parallel=true,{B}", "gated_gdn", TP),
    "gated_gdn/pp2": (f"pp=2,pipeline_schedule=1f1b,{B}", "gated_gdn", EXACT),
}


def test_the_gate_has_the_planners_parameters_and_gates_each_head():
    spec = W.MODELS["gated_llama"]
    model = Transformer(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    hybrid = Transformer(W.MODELS["gated_gdn"])
    assert sum(p.numel() for p in hybrid.parameters()) == hybrid.spec.n_params
    assert [b.attention.wq.out_features for b in hybrid.layers.values() if b.attention] == [128]
    torch.manual_seed(0)
    gated = Attention(spec, 0.0)
    plain = Attention(W.MODELS["llama"], 0.0)
    d, heads = spec.head_dim, spec.n_heads
    with torch.no_grad():
        rows = gated.wq.weight.view(heads, 2, d, -1)
        rows[:, 1] = 0.0  # every head's gate rows: sigmoid(0) = 1/2
        plain.wq.weight.copy_(rows[:, 0].reshape(heads * d, -1))
        for name in ("wk", "wv", "wo"):
            getattr(plain, name).load_state_dict(getattr(gated, name).state_dict())
    x = torch.randn(2, 16, spec.hidden_size)
    rope = model.rope
    # the output projection is linear and bias-free: half its input gives half its output
    torch.testing.assert_close(gated(x, rope), 0.5 * plain(x, rope), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def world2():
    return W.launch_each(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_gated_attention_under_each_dimension_matches_one_process(world2, name):
    _, kind, tol = CASES[name]
    torch.set_num_threads(1)  # as the workers
    W.assert_matches_one_process(name, world2[name], W.reference_losses(B, kind), tol)


def test_the_catalog_qwen3_next_shrunk_builds_with_the_planners_count_and_trains():
    """`qwen3-next-80b-a3b` (GDN and gated-attention blocks with SwiGLU MoE and a shared expert)
    shrunk to the test shape builds in the reference transformer (no longer refused by
    `unbuilt`), with the planner's parameter count, and its loss falls in 3 AdamW steps."""
    from autosearch import ModelSpec

    spec = ModelSpec.load("qwen3-next-80b-a3b").scaled(
        n_layers=4,
        hidden_size=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=128,
        seq_len=32,
        layer_pattern="GEGE*E-",
        gdn=dict(n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=8, chunk_size=8),
        moe=dict(
            n_experts=4, top_k=2, ffn_hidden_size=32, n_shared_experts=1, shared_ffn_hidden_size=32
        ),
    )
    torch.manual_seed(0)
    model = Transformer(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 128, (4, 33))
    losses = []
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
