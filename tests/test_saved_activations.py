"""Memory where it is spent (issue 34, part 4): one layer's activations in the cost model against
a census of what autograd saves for backward in the Engine's reference transformer (torch on CPU,
`torch.autograd.graph.saved_tensors_hooks`), per token, priced with a CPU profile (the kernels
the census runs), in the two regimes of the `torch` preset: fp32 parameters under autocast (an
fp32 residual stream: zero 0/1, or dp 1) and bf16 parameters as FSDP2's MixedPrecisionPolicy
gathers them (zero 2/3 at dp > 1).

The census counts each saved storage once, at two micro-batch sizes; the difference is what
grows with the tokens (weights and their casts cancel). The model's figures are
`memory.layer_activations` for the same shape. The tolerance, 1%, covers the per-row
statistics (the norms' rstd, attention's log-sum-exp: 0.1% here) the formula leaves out.
"""

from __future__ import annotations

import pytest
import torch

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.models.transformer import Transformer
from cost_models import AnalyticCostModel
from cost_models.terms import memory

SPEC = ModelSpec.load("llama3-8b").scaled(
    n_layers=2,
    hidden_size=256,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden_size=704,
    vocab_size=512,
    seq_len=96,
)
CLUSTER = Cluster.parse("results/calibration/example-amd-epyc-2c.yaml:4x2")  # a CPU, 8 ranks


def _saved_bytes(param_dtype: torch.dtype, micro_batch: int) -> int:
    """Bytes autograd keeps for backward of one layer's forward under bf16 autocast."""
    torch.manual_seed(0)
    model = Transformer(SPEC).to(param_dtype)
    layer = model.layers["0"]
    tokens = torch.randint(0, SPEC.vocab_size, (micro_batch, SPEC.seq_len))
    x = model.tok_embeddings(tokens).detach().requires_grad_(True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x, model.rope)
    return sum(storages.values())


def _per_token_census(param_dtype: torch.dtype) -> float:
    grown = _saved_bytes(param_dtype, 4) - _saved_bytes(param_dtype, 2)
    return grown / (2 * SPEC.seq_len)


def _per_token_model(strategy: Strategy) -> float:
    cm = AnalyticCostModel(SPEC, CLUSTER, runtime="torch")
    bytes_mb2 = memory.layer_activations(strategy, cm._context).none_bytes
    bytes_mb4 = memory.layer_activations(
        strategy.replace(micro_batch_size=4, global_batch_size=2 * strategy.global_batch_size),
        cm._context,
    ).none_bytes
    return (bytes_mb4 - bytes_mb2) / (2 * SPEC.seq_len)


@pytest.mark.parametrize(
    ("param_dtype", "strategy"),
    [
        # fp32 parameters under autocast: the fp32 stream (AUTOCAST_SAVED_BYTES, measured on
        # the H200 in results/gpu/h200)
        (torch.float32, Strategy(micro_batch_size=2, global_batch_size=2, amp="bf16")),
        # FSDP2's mixed-precision policy: bf16 parameters, the norms' fp32 upcasts
        # (MIXED_PRECISION_NORM_BYTES)
        (
            torch.bfloat16,
            Strategy(dp=8, micro_batch_size=2, global_batch_size=16, amp="bf16", zero_stage=3),
        ),
    ],
    ids=["fp32-stream", "fsdp2-mixed-precision"],
)
def test_one_layers_activations_are_what_autograd_saves(param_dtype, strategy):
    assert _per_token_model(strategy) == pytest.approx(_per_token_census(param_dtype), rel=0.01)


def test_the_mixed_precision_norms_are_priced_only_where_they_are_kept():
    cm = AnalyticCostModel(SPEC, CLUSTER, runtime="torch")
    mp = Strategy(dp=8, micro_batch_size=2, global_batch_size=16, amp="bf16", zero_stage=3)
    tokens = 2 * SPEC.seq_len
    extra = tokens * SPEC.hidden_size * memory.MIXED_PRECISION_NORM_BYTES
    assert memory.mixed_precision_norm_bytes(mp, cm._context, tokens, "none") == extra
    for s, recompute in [
        (mp, "full"),  # only the layer input is kept
        (mp.replace(compile=True), "none"),  # Inductor fuses the norm
        (mp.replace(zero_stage=1), "none"),  # fp32 stream: AUTOCAST_SAVED_BYTES has them
    ]:
        assert memory.mixed_precision_norm_bytes(s, cm._context, tokens, recompute) == 0.0
    # GPT style: nn.LayerNorm keeps its 16-bit input
    gpt = AnalyticCostModel(ModelSpec.load("tiny-gpt"), CLUSTER, runtime="torch")
    assert memory.mixed_precision_norm_bytes(mp, gpt._context, tokens, "none") == 0.0
    # runtimes with bf16 parameters of their own are measured with their own presets
    titan = AnalyticCostModel(SPEC, CLUSTER, runtime="torchtitan")
    assert memory.mixed_precision_norm_bytes(mp, titan._context, tokens, "none") == 0.0
    # on CUDA torch's fused RMSNorm keeps the 16-bit input: what the formula counts
    gpu = AnalyticCostModel(SPEC, Cluster.parse("h100-sxm:1x8"), runtime="torch")
    assert memory.mixed_precision_norm_bytes(mp, gpu._context, tokens, "none") == 0.0
