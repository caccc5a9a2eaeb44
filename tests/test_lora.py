"""LoRA on the model side and in the cost model: LoraSpec's checks, the CLI and TuneConfig
settings, and what the analytic model changes (golden numbers from the definitions of the
terms: Hu et al. 2021 for the adapter shapes, Megatron-Bridge's flop_utils for NeMo's LoRA
FLOPs convention). The dense model is unchanged: tools/fingerprint.py checks it bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autosearch import Cluster, ModelSpec, Strategy, TuneConfig
from autosearch.core import SpecError
from cost_models import AnalyticCostModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = float(1 << 30)
L70 = ModelSpec.load("llama3-70b")


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "autosearch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


# ---- the spec ----
def test_adapter_parameters_are_rank_times_in_plus_out():
    m = ModelSpec.load("llama3-70b", lora={"rank": 16})
    assert m.lora.targets == ("q", "k", "v", "o", "gate", "up", "down")
    h, kv, f = 8192, 1024, 28672
    per_layer = 16 * ((h + h) + 2 * (h + kv) + (h + h) + 3 * (h + f))
    assert m.lora.layer_params(m) == per_layer
    # 80 layers: 207,093,760 adapter parameters on 70,553,706,496 frozen ones (the Engine test
    # checks this count against the modules peft builds, on a small model)
    assert per_layer * 80 == 207_093_760
    assert m.n_params == 70_553_706_496
    # groups and Megatron-Bridge's module names resolve to the same targets
    both = ModelSpec.load("llama3-70b", lora={"rank": 8, "targets": ["attention", "mlp"]})
    assert both.lora.targets == ("q", "k", "v", "o", "gate", "up", "down")
    gpt = ModelSpec.load("gpt3-175b", lora={"rank": 8})
    assert gpt.lora.targets == ("q", "k", "v", "o", "up", "down")  # no gate in a gelu MLP


def test_megatron_fused_adapters_share_one_a_per_fused_matrix():
    # Megatron-Bridge: one adapter on linear_qkv (h -> q + 2 kv) and one on linear_fc1
    # (h -> 2 f), so 4 A matrices per block instead of 7
    names = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    m = ModelSpec.load("llama3-70b", lora={"rank": 32, "targets": names})
    assert m.lora.targets == ("qkv", "o", "gate_up", "down")
    h, kv, f, r = 8192, 1024, 28672, 32
    assert m.lora.layer_params(m) == r * ((h + h + 2 * kv) + 2 * h + (h + 2 * f) + (f + h))
    assert m.lora.adapted == {"q", "k", "v", "o", "gate", "up", "down"}
    assert m.lora.short() == "lora-r32-QKVoGUd"
    gpt = ModelSpec.load("gpt3-175b", lora={"rank": 8, "targets": names})
    assert gpt.lora.targets == ("qkv", "o", "up", "down")  # fc1 has no gate to fuse
    with pytest.raises(SpecError, match="names qkv .* and q .*choose one of the two"):
        ModelSpec.load("llama3-70b", lora={"rank": 8, "targets": ["qkv", "q"]})


@pytest.mark.parametrize(
    "lora, message",
    [
        ({"rank": 0}, "lora.rank must be >= 1"),
        ({"rank": -4}, "lora.rank must be >= 1"),
        ({"rank": 16, "targets": ["q", "query"]}, "unknown target 'query'"),
        ({"rank": 16, "targets": []}, "non-empty list"),
        ({"rank": 2048, "targets": ["k"]}, "larger than the width of k (8192 -> 1024)"),
        ({"rank": 16, "alpha": 0}, "lora.alpha must be a number > 0"),
        ({"targets": ["q"]}, "lora lacks rank"),
        ({"rank": 16, "dropout": 0.1}, "unknown"),
    ],
)
def test_bad_lora_is_refused_with_the_fix(lora, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec.load("llama3-70b", lora=lora)


def test_gate_on_a_gelu_model_and_lora_on_moe_are_refused():
    with pytest.raises(SpecError, match="has no gate"):
        ModelSpec.load("gpt3-175b", lora={"rank": 8, "targets": ["gate"]})
    with pytest.raises(SpecError, match="mixture-of-experts"):
        ModelSpec.load("mixtral-8x7b", lora={"rank": 8})


def test_model_yaml_with_lora_round_trips(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(
        "n_layers: 2\nhidden_size: 256\nn_heads: 4\nvocab_size: 1000\nseq_len: 512\n"
        "ffn_activation: swiglu\nlora: {rank: 8, targets: [q, v]}\n"
    )
    m = ModelSpec.load(str(path))
    assert m.lora.rank == 8 and m.lora.targets == ("q", "v")
    assert ModelSpec.from_dict(m.to_dict()) == m
    import yaml

    assert yaml.safe_load(yaml.safe_dump(m.to_dict()))["lora"]["targets"] == ["q", "v"]


# ---- the cost model ----
def _estimate(model, strategy, cluster="h100-sxm:1x8", runtime="megatron-core"):
    return AnalyticCostModel(model, Cluster.parse(cluster), runtime=runtime).estimate(
        Strategy.parse(strategy)
    )


S = "dp=2,tp=4,micro_batch_size=1,global_batch_size=32,sequence_parallel=true"


def test_frozen_base_keeps_no_gradient_or_optimizer_state():
    lora = ModelSpec.load("llama3-70b", lora={"rank": 16})
    adapters = lora.lora.layer_params(lora) * 80 / 4  # over tp = 4
    psi = L70.n_params / 4  # a rank's base before dp sharding (pp = 1), within the embeddings
    for zero in (0, 1, 3):
        full = _estimate(L70, f"{S},zero_stage={zero}")
        r = _estimate(lora, f"{S},zero_stage={zero}")
        # Megatron-Core: fp32 main_grad and 12 bytes of optimizer per trainable parameter
        assert r.memory.grads_bytes == pytest.approx(adapters * 4 / (2 if zero >= 2 else 1))
        assert r.memory.optimizer_bytes == pytest.approx(adapters * 12 / (2 if zero else 1))
        # the frozen base stays in bf16, sharded by ZeRO-3 as FSDP shards it
        assert r.memory.params_bytes == full.memory.params_bytes
        assert r.memory.params_bytes == pytest.approx(
            psi * 2 / (2 if zero >= 3 else 1), rel=0.01 if zero < 3 else 0.05
        )
        assert r.step_time_s < full.step_time_s
    # the Engine's runtime (torch, which runs LoRA at tp = 1): the base in fp32 (its param
    # dtype), adapters with fp32 grads and Adam moments
    r = _estimate(lora, "dp=8,micro_batch_size=1,global_batch_size=32", runtime="torch")
    assert r.memory.grads_bytes == pytest.approx(adapters * 4 * 4)
    assert r.memory.optimizer_bytes == pytest.approx(adapters * 4 * 8)


def test_data_parallel_traffic_is_the_adapters_but_zero3_still_gathers_the_base():
    lora = ModelSpec.load("llama3-70b", lora={"rank": 16})
    s = "dp=8,micro_batch_size=1,global_batch_size=32,recompute=full"
    ddp_full = _estimate(L70, s)
    ddp = _estimate(lora, s)
    # DDP all-reduces the adapters' gradients only: 0.3% of the model's
    assert ddp.time.dp_comm_exposed_s < 0.01 * ddp_full.time.dp_comm_exposed_s
    z3 = _estimate(lora, s + ",zero_stage=3")
    assert z3.time.dp_comm_exposed_s > 10 * ddp.time.dp_comm_exposed_s  # base gathers


def test_backward_of_frozen_weights_is_input_gradients_only():
    from cost_models.terms import compute

    lora = ModelSpec.load("llama3-70b", lora={"rank": 16})
    s = Strategy.parse(S)
    dense = AnalyticCostModel(L70, Cluster.parse("h100-sxm:1x8"), runtime="megatron-core")
    tuned = AnalyticCostModel(lora, Cluster.parse("h100-sxm:1x8"), runtime="megatron-core")
    x = compute.layer_shape(s, dense._context)
    gemms, _ = compute._block_gemms(dense._context, x)
    adapter_fwd, adapter_bwd = compute._lora_adapters(tuned._context, x)
    a, b = compute.layer(s, dense._context), compute.layer(s, tuned._context)
    ratio = dense.profile.gemm.backward_over_forward
    assert b.fwd_s - a.fwd_s == pytest.approx(adapter_fwd)
    assert a.bwd_s - b.bwd_s == pytest.approx(ratio / 2 * gemms - adapter_bwd)
    assert adapter_bwd > adapter_fwd > 0


def test_mfu_is_reported_in_nemo_lora_convention():
    # Megatron-Bridge flop_utils (LoRA branch): frozen GEMMs x 2/3 of 3x, attention core 3x
    lora = ModelSpec.load("llama3-70b", lora={"rank": 16})
    attention = 3 * 2 * 2 * L70.attention_hidden_size * sum(L70.attention_keys)
    gemms = L70.flops_per_token() - attention
    assert lora.flops_per_token() == pytest.approx(2 / 3 * gemms + attention, rel=1e-12)
    assert lora.flops_per_token(training=False) == L70.flops_per_token(training=False)


def test_untargeted_frozen_linears_keep_no_input():
    q_v = ModelSpec.load("llama3-70b", lora={"rank": 16, "targets": ["q", "v"]})
    every = ModelSpec.load("llama3-70b", lora={"rank": 16})
    s = "dp=1,tp=8,micro_batch_size=1,global_batch_size=32,sequence_parallel=true"
    cm = {
        m: AnalyticCostModel(m, Cluster.parse("h100-sxm:1x8"), runtime="megatron-core")
        for m in (q_v, every)
    }
    act = {m: cm[m]._activations(Strategy.parse(s)).none_bytes for m in cm}
    T, h, f, r = 8192, 8192, 28672, 16  # tokens of one micro-batch, widths, rank
    # q, v adapted: the MLP input (h / sp) and fc2's input (f / tp) are not kept, and five
    # adapters fewer keep x A (T r / tp each)
    freed = T * h * 2 / 8 + T * f * 2 / 8 + 5 * T * r * 2 / 8
    assert act[every] - act[q_v] == pytest.approx(freed)


def test_llama3_70b_lora_fits_one_node_where_full_training_does_not():
    lora = ModelSpec.load("llama3-70b", lora={"rank": 16})
    s = "dp=1,cp=8,micro_batch_size=1,global_batch_size=32,zero_stage=3"  # torch: LoRA at tp 1
    full, tuned = _estimate(L70, s, runtime="torch"), _estimate(lora, s, runtime="torch")
    assert not full.fits and tuned.fits
    assert tuned.peak_memory_bytes < 0.5 * full.peak_memory_bytes


# ---- the settings ----
def test_tune_config_reads_lora_settings_and_refuses_targets_alone():
    c = TuneConfig(
        model="llama3-8b",
        cluster="h100-sxm:1x8",
        global_batch_size=8,
        lora_rank=16,
        lora_targets=["q", "v"],
    )
    assert c.lora() == {"rank": 16, "targets": "q,v"}
    assert TuneConfig.from_dict(c.to_dict()) == c
    with pytest.raises(SpecError, match="needs a rank: add --lora-rank"):
        TuneConfig(
            model="llama3-8b", cluster="h100-sxm:1x8", global_batch_size=8, lora_targets="q"
        )
    with pytest.raises(SpecError, match="unknown target 'x'"):
        TuneConfig(
            model="llama3-8b",
            cluster="h100-sxm:1x8",
            global_batch_size=8,
            lora_rank=4,
            lora_targets="q,x",
        )


def test_estimate_cli_takes_lora_flags(tmp_path):
    base = [
        "estimate",
        "--model",
        "llama3-8b",
        "--cluster",
        "h100-sxm:1x8",
        "--strategy",
        "dp=8,zero_stage=3,recompute=full",  # fits (estimate exits 1 for one that does not)
        "--global-batch-size",
        "8",
    ]
    run = _cli(*base, "--lora-rank", "16", "--lora-targets", "attention", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    plain = _cli(*base, "--json", cwd=tmp_path)
    a, b = json.loads(run.stdout), json.loads(plain.stdout)
    optimizer = [x["report"]["memory"]["optimizer_bytes"] for x in (a, b)]
    assert optimizer[0] < 0.01 * optimizer[1]
    text = _cli(*base, "--lora-rank", "16", cwd=tmp_path)
    assert "lora      rank 16 on q, k, v, o, gate, up, down" in text.stdout
    bad = _cli(*base, "--lora-targets", "q", cwd=tmp_path)
    assert bad.returncode == 2 and "needs a rank: add --lora-rank" in bad.stderr
    bad = _cli(*base, "--lora-rank", "0", cwd=tmp_path)
    assert bad.returncode == 2


def test_tune_with_lora_names_its_study_apart(tmp_path):
    run = _cli(
        "tune",
        "--model",
        "llama3-8b",
        "--cluster",
        "h100-sxm:1x8",
        "--global-batch-size",
        "8",
        "--lora-rank",
        "8",
        "--n-trials",
        "3",
        "--quiet",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    (study,) = os.listdir(tmp_path / "results")
    assert study.startswith("llama3-8b-lora-r8-qkvogud_")
    text = (tmp_path / "results" / study / "study.yaml").read_text()
    assert "lora_rank: 8" in text


def test_sweep_writes_lora_rows_apart(tmp_path):
    import csv

    args = ["sweep", "--models", "llama3-8b", "--clusters", "h100-sxm:1x8"]
    args += ["--global-batch-sizes", "8", "--n-trials", "3", "--out", "s.csv", "--quiet"]
    assert _cli(*args, cwd=tmp_path).returncode == 0
    run = _cli(*args, "--lora-rank", "8", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    with open(tmp_path / "s.csv", newline="") as f:
        models = [r["model"] for r in csv.DictReader(f)]
    assert models == ["llama3-8b", "llama3-8b-lora-r8-qkvogud"]


def test_the_engine_s_search_keeps_tp_1_under_lora_other_runtimes_do_not():
    from autosearch import tune

    config = TuneConfig(
        model="llama3-8b",
        cluster="h100-sxm:1x8",
        global_batch_size=8,
        lora_rank=8,
        n_trials=3,
        seed=0,
    )
    assert tune(config).space.tps == (1,)  # the Engine refuses tp with LoRA
    assert tune(config.replace(runtime="megatron-core")).space.tps != (1,)
    with pytest.raises(SpecError, match="does not run tp=2 with LoRA adapters.*megatron-core"):
        tune(config.replace(pin={"tp": 2}))  # the runtime feature lora_tp: refused, not kept
