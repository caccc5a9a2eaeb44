"""Grouped GEMMs of the experts: the Engine's kernel (`autosearch.models.moe.grouped_mm`) against a
loop of matmuls, the cost model's term (`cost_models.terms.experts.grouped_gemm_s`), and the
GPU benchmarks' MoE model, which must build before a GPU lease is spent on it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autosearch.core.hardware import HardwareProfile
from cost_models.terms.experts import GROUPED_TILE_ROWS, grouped_gemm_s

ROOT = Path(__file__).resolve().parent.parent


def test_a_group_below_a_tile_costs_a_tile_and_above_it_its_own_shape():
    gemm = HardwareProfile.load("h100-sxm").gemm
    peak = 989e12

    def t(m: float, tile: float = GROUPED_TILE_ROWS) -> float:
        return grouped_gemm_s(gemm, 8, m, 4096, 2048, peak, "bf16", tile)

    assert t(32) == t(64) == t(GROUPED_TILE_ROWS)
    assert t(512) == grouped_gemm_s(gemm, 8, 512, 4096, 2048, peak, "bf16")  # no tile
    assert t(32, tile=0) < t(32)  # without the tile: the dense shape model
    # 8 groups: one launch, 8 times the work of one group
    one = grouped_gemm_s(gemm, 1, 512, 4096, 2048, peak, "bf16") - gemm.launch_s
    assert t(512) - gemm.launch_s == pytest.approx(8 * one, rel=1e-12)


torch = pytest.importorskip("torch")


def _loop(x, w, counts):
    rows = x.split(counts.tolist())
    return torch.cat([r @ w[e] for e, r in enumerate(rows)])


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_equals_a_loop_of_matmuls_with_empty_groups(transposed):
    from autosearch.models.moe import grouped_mm

    torch.manual_seed(0)
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(4, 24, 16).transpose(1, 2) if transposed else torch.randn(4, 16, 24)
    w.requires_grad_()
    counts = torch.tensor([5, 0, 7, 8])
    y = grouped_mm(x, w, counts)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    ref = _loop(x, w, counts)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    # fp32 on CPU: the same products summed in the same order, exact
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, rx, rtol=0, atol=0)
    torch.testing.assert_close(gw, rw, rtol=0, atol=0)
    assert grouped_mm(x[:0], w, torch.zeros(4, dtype=torch.long)).shape == (0, 24)


def test_grouped_mm_runs_in_the_autocast_dtype():
    from autosearch.models.moe import grouped_mm

    x, w, counts = torch.randn(12, 16), torch.randn(3, 16, 8), torch.tensor([4, 4, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm(x, w, counts)
    assert y.dtype == torch.bfloat16
    # bf16 operands (8-bit mantissa, 2^-8 relative per rounding): products of 16 terms
    torch.testing.assert_close(y.float(), _loop(x, w, counts), rtol=2e-2, atol=5e-2)


def test_the_gpu_checks_models_build_in_the_reference_transformer():
    """benchmarks/gpu_check.py's models must build here, or a GPU lease is spent on an error
    (Qwen3-30B's 32 heads of 128 are wider than its hidden size, which the transformer does not
    build: the check runs it with 16)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    from autosearch.models.transformer import Transformer

    for make in (gpu_check.gpu_model, gpu_check.large_model, gpu_check.moe_model):
        spec = make()
        with torch.device("meta"):
            model = Transformer(spec)
        n = sum(p.numel() for p in model.parameters())
        assert n == pytest.approx(spec.n_params, rel=0.01), spec.name


def test_the_grouped_gemm_benchmark_measures_and_rescores_on_cpu(tmp_path):
    """`benchmarks/grouped_gemm.py --dry-run` measures small fp32 shapes on CPU and writes what
    a GPU run writes; `--rescore` prices the measured shapes again without measuring."""
    import json

    import pandas as pd

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import grouped_gemm

    assert grouped_gemm.main(["--dry-run", "--out", str(tmp_path)]) == 0
    table = pd.read_csv(tmp_path / "grouped_gemm.csv")
    assert len(table) == 12 and table.up_fwd_s.gt(0).all() and table.down_bwd_s.gt(0).all()
    summary = json.loads((tmp_path / "grouped_gemm.json").read_text())
    assert summary["measured"] == 12 and set(summary["by_tokens_per_expert"]) == {"8", "32", "128"}
    before = table.profile_up_fwd_s.copy()
    table["profile_up_fwd_s"] = 0.0  # a stale prediction: rescoring recomputes it
    table.to_csv(tmp_path / "grouped_gemm.csv", index=False)
    assert grouped_gemm.main(["--rescore", str(tmp_path)]) == 0
    again = pd.read_csv(tmp_path / "grouped_gemm.csv")
    assert again.profile_up_fwd_s.tolist() == pytest.approx(before.tolist(), rel=1e-12)
    assert again.up_fwd_s.tolist() == table.up_fwd_s.tolist()  # measurements kept as they were


def test_op_level_recompute_runs_every_expert_gemm_again_as_the_cost_model_prices():
    """Op-level selective recompute saves mm outputs (every other one) and the router's top-k
    but no grouped GEMM: the experts' forward GEMMs all run again in backward (as in
    torchtitan, whose save list has none either), which `experts.layer` prices (op_recompute_s
    holds every expert GEMM)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from autosearch import ModelSpec, Strategy
    from autosearch.core.model_spec import MoESpec
    from autosearch.engine import Engine
    from autosearch.engine.data import SyntheticTokens
    from autosearch.models.transformer import build

    spec = ModelSpec.load("tiny-llama").scaled(
        name="tiny-moe", n_layers=2, seq_len=32, moe=MoESpec(n_experts=4, top_k=2)
    )

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[func] += 1
            return func(*args, **(kwargs or {}))

    grouped, topk = {}, {}
    for recompute in ("none", "selective_op"):
        strategy = Strategy.parse(f"micro_batch_size=2,global_batch_size=2,recompute={recompute}")
        engine = Engine(lambda: build(spec), optimizer=torch.optim.SGD, strategy=strategy)
        engine.prepare(mode="train")
        data = SyntheticTokens.for_model(spec, n_samples=2, seed=0)
        batch = next(iter(engine.dataloader(data, batch_size=2, mode="train")))
        with Calls() as calls:
            engine.run(batch, mode="train")
        grouped[recompute] = calls.n[torch.ops.aten._grouped_mm.default]
        topk[recompute] = calls.n[torch.ops.aten.topk.default]
    # 2 MoE layers x 3 expert GEMMs (w1, w3, w2): forward 6, backward 12 (dX, dW each)
    assert grouped["none"] == 18
    assert grouped["selective_op"] == 18 + 6  # every forward expert GEMM, again
    # the routing is saved, not recomputed: backward uses the experts the forward chose
    assert topk["none"] == topk["selective_op"] == 2

    from autosearch.core.hardware import Cluster
    from cost_models.analytic import AnalyticCostModel
    from cost_models.terms import experts

    model = ModelSpec.load("qwen3-30b-a3b")  # 128 experts of 768, top 8, hidden 2048
    cm = AnalyticCostModel(model, Cluster.parse("h100-sxm:1x8"), runtime="torchtitan")
    s = Strategy(dp=8, ep=8, micro_batch_size=1, global_batch_size=64, recompute="selective_op")
    ctx = cm._context
    e = experts.layer(s, ctx)
    # the routed experts' forward GEMMs: 16 local experts of 4,096 x 8 / 16 rows each
    gemm, rows = ctx.profile.gemm, model.seq_len * 8 / 16
    peak = ctx.profile.peak_flops["bf16"]
    expert_fwd = ctx.runtime.moe_load_imbalance * (
        grouped_gemm_s(gemm, 16, rows, 2 * 768, 2048, peak, "bf16", GROUPED_TILE_ROWS)
        + grouped_gemm_s(gemm, 16, rows, 2048, 768, peak, "bf16", GROUPED_TILE_ROWS)
    )
    assert e.op_recompute_s >= expert_fwd
