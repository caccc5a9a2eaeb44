"""A model is a sequence of layers (`autosearch.core.layers`, `ModelSpec.layers`), and the cost
model prices each kind of layer once (`cost_models.terms.layers`).

Writing a model's layers as Megatron's hybrid pattern must describe the same model as its fields:
the same blocks, parameters and FLOPs, and bit-identical estimates (the pattern is another
spelling, not another model). A pattern can also place experts where `moe`'s fields cannot (any
set of layers), and the cost model refuses blocks it does not price yet with the reason.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core.errors import SpecError
from autosearch.core.layers import Layer, parse_pattern
from autosearch.core.model_spec import unpriced
from cost_models import AnalyticCostModel
from cost_models.terms.layers import kinds

ROOT = Path(__file__).resolve().parents[1]


def test_pattern_symbols_parse_into_blocks():
    assert parse_pattern("*-*E") == (("attention", "dense"), ("attention", "moe"))
    # Nemotron-H: Mamba layers without an MLP, MLP layers without a mixer
    assert parse_pattern("M-M*-") == (
        ("mamba", "dense"),
        ("mamba", "none"),
        ("attention", "dense"),
    )
    assert parse_pattern("**") == (("attention", "none"), ("attention", "none"))
    assert parse_pattern("-E") == (("none", "dense"), ("none", "moe"))
    with pytest.raises(SpecError, match=r"symbol 'x' at position 2 .*: \* attention, M Mamba-2"):
        parse_pattern("*-x")
    with pytest.raises(SpecError, match="must be a string"):
        parse_pattern("")


@pytest.mark.parametrize("name", ["llama3-8b", "gemma2-9b", "deepseek-v3", "llama4-maverick"])
def test_fields_and_their_pattern_are_one_model(name):
    """The pattern a catalog model's fields give, written back as its layer_pattern, builds the
    same model: blocks, parameters, FLOPs."""
    model = ModelSpec.load(name)
    written = dataclasses.replace(model, layer_pattern=model.pattern)
    assert written.layers == model.layers
    assert (written.n_params, written.n_active_params) == (model.n_params, model.n_active_params)
    assert written.flops_per_token() == model.flops_per_token()


def test_catalog_layers_say_what_the_fields_say():
    dsv3 = ModelSpec.load("deepseek-v3")
    assert dsv3.pattern == "*-" * 3 + "*E" * 58
    maverick = ModelSpec.load("llama4-maverick")  # MoE every 2nd layer (interleave step 2)
    assert maverick.pattern == "*-*E" * 24
    gemma = ModelSpec.load("gemma2-9b")  # sliding every other layer, global every 2nd
    assert [layer.keys for layer in gemma.layers[:2]] == [4096, gemma.seq_len]
    assert gemma.layers[0] == Layer("attention", "dense", 4096)


@pytest.mark.parametrize(
    "name, cluster, strategy",
    [
        ("llama3-8b", "h100-sxm:1x8", "dp=2,tp=2,pp=2,global_batch_size=64,micro_batch_size=1"),
        (
            "deepseek-v3",
            "h100-sxm:32x8",
            "dp=8,tp=2,pp=16,ep=8,global_batch_size=1024,micro_batch_size=1,zero_stage=1",
        ),
        ("qwen3-30b-a3b", "h100-sxm:2x8", "dp=8,ep=8,pp=2,global_batch_size=256,zero_stage=3"),
    ],
)
def test_a_pattern_prices_bit_identically_to_its_fields(name, cluster, strategy):
    model = ModelSpec.load(name)
    written = dataclasses.replace(model, layer_pattern=model.pattern)
    s, c = Strategy.parse(strategy), Cluster.parse(cluster)
    assert AnalyticCostModel(written, c).estimate(s) == AnalyticCostModel(model, c).estimate(s)


def test_a_pattern_places_experts_where_fields_cannot():
    """Experts on layers 1 and 2 of 4 (no first_dense_layers / layer_step says that): the MoE
    blocks counted from the pattern, priced as such (more parameters than the dense model,
    fewer than all-MoE)."""
    base = ModelSpec.load("qwen3-30b-a3b").scaled(n_layers=4)
    some = dataclasses.replace(base, layer_pattern="*-*E*E*-")
    assert some.moe_layers == (False, True, True, False)
    dense = dataclasses.replace(base, moe=None)
    assert dense.n_params < some.n_params < base.n_params
    s, c = Strategy.parse("dp=8,global_batch_size=64"), Cluster.parse("h100-sxm:1x8")
    times = [AnalyticCostModel(m, c).estimate(s).step_time_s for m in (dense, some, base)]
    assert times[0] < times[1] < times[2]


def test_pattern_disagreeing_with_the_fields_is_refused_with_the_fix():
    llama = ModelSpec.load("llama3-8b")
    with pytest.raises(SpecError, match="has 2 blocks .* but n_layers is 32"):
        dataclasses.replace(llama, layer_pattern="*-*-")
    with pytest.raises(SpecError, match="E.* but the model has no moe block"):
        dataclasses.replace(llama, layer_pattern="*E" * 32)
    qwen = ModelSpec.load("qwen3-30b-a3b")
    with pytest.raises(SpecError, match="has a moe block but its layer_pattern no E"):
        dataclasses.replace(qwen, layer_pattern="*-" * qwen.n_layers)
    dsv3 = ModelSpec.load("deepseek-v3")  # first_dense_layers 3 against a pattern's 1
    with pytest.raises(SpecError, match="place the MoE layers elsewhere than layer_pattern"):
        dataclasses.replace(dsv3, layer_pattern="*-" + "*E" * 60)


def test_every_kind_of_block_is_priced():
    """Mamba-2 and Gated DeltaNet mixers and blocks with a mixer or an MLP alone are priced
    (`cost_models.terms.ssm`); `model_spec.unpriced` is empty for them."""
    llama = ModelSpec.load("llama3-8b")
    hybrid = dataclasses.replace(
        llama,
        layer_pattern="G-" * 14 + "M" * 14 + "*" + "-" * 4,  # 14 + 14 + 1 + 3 blocks
        gdn={"n_k_heads": 16, "n_v_heads": 32},
        mamba={"n_heads": 64, "head_dim": 64},
        name="hybrid",
    )
    assert unpriced(hybrid) == []
    cluster = Cluster.parse("h100-sxm:1x8")  # under the runtime that trains both mixers
    report = AnalyticCostModel(hybrid, cluster, runtime="megatron-core").estimate(
        Strategy.parse("dp=8,global_batch_size=64")
    )
    assert report.step_time_s > 0


@pytest.mark.parametrize("symbol, field", [("M", "mamba"), ("G", "gdn")])
def test_state_space_layers_need_their_mixer_described(symbol, field):
    llama = ModelSpec.load("llama3-8b")
    with pytest.raises(SpecError, match=f"no {field} block; describe them under {field}"):
        dataclasses.replace(llama, layer_pattern=f"{symbol}-" * 28 + "*-" * 4)


def test_a_yaml_file_takes_the_pattern(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(
        "n_layers: 3\nhidden_size: 64\nn_heads: 4\nvocab_size: 1000\nseq_len: 32\n"
        "ffn_activation: swiglu\nmoe: {n_experts: 4, top_k: 2}\nlayer_pattern: '*E*-*E'\n"
    )
    model = ModelSpec.load(str(path))
    assert model.moe_layers == (True, False, True)
    assert model.to_dict()["layer_pattern"] == "*E*-*E"
    assert "layer_pattern" not in ModelSpec.load("llama3-8b").to_dict()  # files as before


def test_kinds_of_block_beyond_the_base():
    assert kinds(ModelSpec.load("llama3-70b")) == ()
    assert kinds(ModelSpec.load("deepseek-v3")) == (("mlp", "moe"),)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("term", ["pipeline", "data_parallel", "memory", "compute"])
def test_generic_terms_import_no_kind_of_block(term):
    """The pipeline, data-parallel, memory and compute terms know kinds of block only through
    `cost_models.terms.layers`: none imports the experts' term."""
    imported = _imports(ROOT / "cost_models" / "terms" / f"{term}.py")
    assert not any("experts" in name for name in imported), imported


# ---- pipeline splits balanced by the blocks' cost ---------------------------------------------
def _brute_force_bottleneck(weights, chunks, first, last):
    import itertools

    n, best = len(weights), None
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        bounds = (0, *cuts, n)
        loads = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
        loads[0] += first
        loads[-1] += last
        best = max(loads) if best is None else min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_balanced_split_is_the_best_consecutive_split(seed):
    """Against every split of up to 9 blocks into 2-4 chunks: the same bottleneck (to the
    bisection's 1e-9 relative), every chunk at least one block, every block placed."""
    import random

    from autosearch.core.rules import balanced_split

    rng = random.Random(seed)
    n, chunks = rng.randint(4, 9), rng.randint(2, 4)
    weights = [rng.choice([1.0, 1.0, 2.5, 0.3]) * rng.uniform(0.8, 1.2) for _ in range(n)]
    first, last = rng.uniform(0, 2), rng.uniform(0, 3)
    split = balanced_split(weights, chunks, first=first, last=last)
    assert len(split) == chunks and sum(split) == n and min(split) >= 1
    bounds = [0]
    for size in split:
        bounds.append(bounds[-1] + size)
    loads = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == pytest.approx(_brute_force_bottleneck(weights, chunks, first, last), 1e-9)


def test_unequal_blocks_get_a_split_balanced_by_cost():
    """Llama 4 Maverick's MoE blocks alternate with dense ones and its logits are 202k wide:
    over 8 stages the balanced split moves a block off the last stage, and the cost model
    predicts it faster than the even split; Llama 3.1 405B's even split (the shorter first and
    last stages that torchtitan and Megatron-LM use) is already the balanced one."""
    cluster = Cluster.parse("h100-sxm:16x8")
    maverick = AnalyticCostModel(ModelSpec.load("llama4-maverick"), cluster)
    s = Strategy.parse(
        "dp=2,tp=4,pp=8,cp=2,ep=16,global_batch_size=512,sequence_parallel=true,zero_stage=2,"
        "recompute=selective_op,compile=true"
    )
    split = maverick.balanced_split(s)
    assert split is not None and split[-1] < 6 and sum(split) == 48
    even, balanced = (maverick.estimate(x) for x in (s, s.replace(pipeline_split=split)))
    assert balanced.step_time_s < even.step_time_s
    big = AnalyticCostModel(ModelSpec.load("llama3.1-405b"), Cluster.parse("h100-sxm:64x8"))
    s405 = Strategy.parse(
        "tp=4,pp=32,cp=4,global_batch_size=2048,sequence_parallel=true,zero_stage=2"
    )
    assert big.balanced_split(s405) is None


def test_the_search_scores_the_balanced_split():
    """A DeepSeek-style model (two dense blocks, then MoE ones) pinned to two pipeline stages:
    the pick carries the split that balances its blocks, which the even split does not."""
    from autosearch import TuneConfig, tune

    model = dataclasses.replace(
        ModelSpec.load("qwen3-30b-a3b").scaled(n_layers=8, seq_len=1024),
        layer_pattern="*-*-" + "*E" * 6,
        name="dense-then-moe",
    )
    result = tune(
        TuneConfig(
            model=model,
            cluster="h100-sxm:1x8",
            global_batch_size=64,
            pin={"pp": 2, "tp": 1, "cp": 1},
            sampler="exhaustive",
        )
    )
    best = result.best_strategy
    assert best.pipeline_split is not None and best.pipeline_split[0] > best.pipeline_split[1]
