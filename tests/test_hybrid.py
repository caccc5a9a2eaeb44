"""Hybrid models (Mamba-2, attention and MLP layers: Nemotron-H, Nemotron 3) priced by the
analytic cost model (`cost_models.terms.ssm`): each block differs from the base block
(attention + dense MLP) in its mixer, its MLP or both, and adds what its parts add.

Checked here: a Mamba-2 mixer's parameters and FLOPs from its shape, the search rules (tp splits
the Mamba heads and groups; cp follows Megatron's head rule over Mamba layers and is refused with
the reason over Gated DeltaNet layers), estimates of Nemotron-H 8B that are sane against a dense
model of the same size, every part's terms reading the strategy fields they declare, the SSD
scan priced from its kernels, gated attention, and the Engine still refusing to build Mamba
blocks."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from autosearch.core._ssm import GatedDeltaNetSpec, MambaSpec
from autosearch.core.model_spec import unbuilt, unpriced
from autosearch.core.runtime import RUNTIMES
from cost_models import AnalyticCostModel
from cost_models.terms import ssm

DATA = Path(__file__).parent / "data" / "hf_configs"
CLUSTER = Cluster.parse("h100-sxm:4x8")
# a runtime that trains hybrid blocks with the fused kernels (cost_models/runtimes.yaml: mamba,
# gdn); the Engine (torch) trains them with its plain-PyTorch scans
# (tests/test_torch_scan_costs.py); torchtitan and DeepSpeed refuse them
# (test_runtimes_that_do_not_train_hybrids_say_so)
RUNTIME = "megatron-core"
BASE = "global_batch_size=768,micro_batch_size=1,zero_stage=1,amp=bf16"


def _load(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(DATA / f"{name}.json", seq_len=8192, name=name)


def test_a_mamba_mixer_counts_as_megatron_and_transformers_build_it():
    """Nemotron-H 8B's mixer (h 4096, 128 heads of 64, d_state 128, 8 groups): in_proj to z,
    x, B, C, dt (2 * 8192 + 2 * 8 * 128 + 128 = 18,560 outputs), out_proj, the conv1d over x, B
    and C (10,240 channels, 4 taps and a bias), dt_bias, A_log, D and the gated norm."""
    mamba = MambaSpec(n_heads=128, head_dim=64, d_state=128, n_groups=8)
    assert mamba.in_proj_width == 18_560 and mamba.conv_dim == 10_240
    assert mamba.matmul_params(4096) == 4096 * 18_560 + 8192 * 4096
    assert mamba.other_params(4096) == 10_240 * 5 + 3 * 128 + 8192
    # Megatron-LM's MFU count: 7 * d_in * d_state per token for the scan
    assert mamba.scan_flops_per_token == 7 * 8192 * 128


def test_blocks_of_one_symbol_sum_per_kind():
    """`M`, `-` and `*` alone each count their own sublayer and norm: the 8B's 24 Mamba, 24 MLP
    and 4 attention layers; FLOPs as Megatron-LM counts a hybrid (GEMMs, the attention core over
    the attention layers only, the scan)."""
    m = _load("nemotron-h-8b")
    h, v = m.hidden_size, m.vocab_size
    mamba, mlp = m.mamba.params(h) + h, 2 * h * m.ffn_hidden_size + h  # type: ignore[union-attr]
    attention = m.attention_matmul_params + h
    assert m.n_params == 24 * mamba + 24 * mlp + 4 * attention + 2 * v * h + h
    gemms = 24 * m.mamba.matmul_params(h) + 24 * 2 * h * m.ffn_hidden_size  # type: ignore[union-attr]
    gemms += 4 * m.attention_matmul_params
    core = 4 * 2 * 2 * m.attention_hidden_size * m.seq_len
    scan = 24 * 7 * m.mamba.d_inner * m.mamba.d_state  # type: ignore[union-attr]
    assert m.flops_per_token(training=False) == 2 * gemms + 2 * v * h + core + scan


def test_hybrids_are_priced_and_the_reference_model_builds_their_blocks():
    """Every kind of block builds (autosearch/models/ssm.py); Nemotron 3 Nano's squared-ReLU
    experts under an aux-loss-free router do not."""
    for name in ("nemotron-h-8b", "nemotron-3-nano-30b-a3b"):
        assert unpriced(_load(name)) == []
    assert unbuilt(_load("nemotron-h-8b")) == []
    assert unbuilt(_load("nemotron-3-nano-30b-a3b")) == [
        "mixture-of-experts layers of relu2 experts (SwiGLU only)",
        "moe.load_balancing aux_loss_free (the expert bias updates)",
    ]


def test_nemotron_h_8b_estimate_is_sane():
    """Nemotron-H 8B at 8,192 tokens on 32 H100s: a plausible MFU, and against Llama 3 8B (a
    dense model of about its size, 32 attention layers) a shorter step (4 attention layers of
    the 8B's 28 blocks), parameters in memory in proportion to the counts, and a memory that
    falls with tp."""
    m, llama = _load("nemotron-h-8b"), ModelSpec.load("llama3-8b").scaled(seq_len=8192)
    s = Strategy.parse(f"dp=16,tp=2,sequence_parallel=true,{BASE}")
    r = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME).estimate(s)
    dense = AnalyticCostModel(llama, CLUSTER, runtime=RUNTIME).estimate(s)
    assert 0.25 < r.mfu < 0.65
    assert r.step_time_s < dense.step_time_s
    per_param = r.memory.params_bytes / m.n_params
    assert per_param == pytest.approx(dense.memory.params_bytes / llama.n_params, rel=1e-3)
    tp4 = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME).estimate(
        Strategy.parse(f"dp=8,tp=4,sequence_parallel=true,{BASE}")
    )
    assert tp4.peak_memory_bytes < r.peak_memory_bytes


@pytest.mark.parametrize(
    "strategy",
    [
        f"dp=8,tp=2,pp=2,sequence_parallel=true,{BASE}",
        f"dp=4,tp=2,pp=4,{BASE}",
        f"dp=32,recompute=full,{BASE}",
        f"dp=16,tp=2,recompute=selective,{BASE}",
    ],
)
def test_hybrid_estimates_under_pipeline_and_recompute(strategy):
    for name in ("nemotron-h-8b", "nemotron-3-nano-30b-a3b"):
        cm = AnalyticCostModel(_load(name), CLUSTER, runtime=RUNTIME)
        s = Strategy.parse(strategy)
        r = cm.estimate(s)
        assert r.step_time_s > 0 and r.memory.activations_bytes > 0
        cm.balanced_split(s)  # weighs each block by its parts


def test_megatron_core_runs_mamba_pipelines_even_and_not_interleaved():
    """megatron-core 0.16's MambaStack asserts no virtual pipeline stages and places its layers
    evenly (or by the first / last stage's count): an interleaved or uneven plan for a Mamba
    hybrid is refused by name, and the default space does not search them (its pick exports)."""
    from autosearch import tune

    m = _load("nemotron-h-8b")
    cm = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME)
    for bad, what in (
        ("pipeline_schedule=interleaved_1f1b,virtual_stages=2", "interleaved_1f1b with Mamba-2"),
        ("pipeline_split=6/8/8/6", "pipeline_split with Mamba-2 layers"),
    ):
        with pytest.raises(SpecError, match=what):
            cm.estimate(Strategy.parse(f"dp=4,tp=2,pp=4,{bad},{BASE}"))
    dense = AnalyticCostModel(_load("llama3-8b"), CLUSTER, runtime=RUNTIME)
    dense.estimate(Strategy.parse(f"dp=4,tp=2,pp=4,pipeline_split=7/9/9/7,{BASE}"))
    result = tune(m, CLUSTER, global_batch_size=768, runtime=RUNTIME, pin={"pp": 4}, n_trials=30)
    best = result.best_strategy
    assert best.pp == 4 and best.virtual_stages == 1 and best.pipeline_split is None


def test_tp_must_divide_the_mamba_heads_and_groups():
    m = dataclasses.replace(
        _load("nemotron-h-8b"),
        mamba=MambaSpec(n_heads=128, head_dim=64, d_state=128, n_groups=2),
    )
    with pytest.raises(SpecError, match="does not divide the Mamba-2 mixer's 128 heads and 2"):
        Strategy.parse(f"dp=8,tp=4,{BASE}").validate(m, CLUSTER)
    Strategy.parse(f"dp=16,tp=2,{BASE}").validate(m, CLUSTER)


def test_context_parallel_over_mamba_layers_follows_megatrons_head_rule():
    """Megatron-Core's Mamba context parallel (ssm/mamba_context_parallel.py) gives each cp
    rank whole heads of the tp rank's, and whole groups or a share of one group's heads."""
    m = _load("nemotron-h-8b")  # 128 heads, 8 groups
    Strategy.parse(f"dp=8,tp=2,cp=2,{BASE}").validate(m, CLUSTER)
    with pytest.raises(SpecError, match="cp=3 does not divide the Mamba-2 mixer's 128 heads"):
        Strategy.parse(f"dp=8,cp=3,{BASE}").validate(m, CLUSTER)
    odd = dataclasses.replace(m, mamba=MambaSpec(n_heads=96, head_dim=64, n_groups=4))
    Strategy.parse(f"dp=4,cp=8,{BASE}").validate(odd, CLUSTER)  # two cp ranks per group
    with pytest.raises(SpecError, match="cp=6 and the Mamba-2 mixer's 4 groups / tp=1 = 4"):
        Strategy.parse(f"dp=4,cp=6,{BASE}").validate(odd, CLUSTER)


def test_context_parallel_over_mamba_layers_is_priced_as_its_all_to_alls():
    """Under cp a Mamba-2 layer trades the attention's ring exchange for the all-to-alls of
    z, x, B, C, dt and the output (`ssm.mamba_cp_fwd_s`): more exposed traffic than cp=1,
    less memory per GPU; a runtime without Megatron-Core's Mamba context parallel refuses it
    by name."""
    m = _load("nemotron-h-8b")
    cm = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME)
    one = cm.estimate(Strategy.parse(f"dp=16,tp=2,sequence_parallel=true,{BASE}"))
    two = Strategy.parse(f"dp=8,tp=2,cp=2,sequence_parallel=true,{BASE}")
    r = cm.estimate(two)
    assert r.time.tp_comm_s > one.time.tp_comm_s
    assert r.peak_memory_bytes < one.peak_memory_bytes
    assert ssm.mamba_cp_fwd_s(two, cm._context) > 0
    with pytest.raises(SpecError, match="cannot run cp=2 with Mamba-2 layers"):
        AnalyticCostModel(m, CLUSTER, runtime="automodel").estimate(two)


def test_a_mamba_spec_says_what_is_wrong():
    with pytest.raises(SpecError, match="mamba.n_heads 12 must be a multiple of mamba.n_groups 8"):
        MambaSpec(n_heads=12, head_dim=64).check()
    with pytest.raises(SpecError, match="no layer_pattern saying which layers are Mamba-2"):
        dataclasses.replace(ModelSpec.load("llama3-8b"), mamba=MambaSpec(n_heads=8, head_dim=64))


@pytest.mark.parametrize("term", [ssm.mamba_part, ssm.no_mixer_part, ssm.no_mlp_part])
def test_part_terms_read_what_they_declare(term):
    from test_terms import CASES, fields_each_reads, undeclared_and_unread

    cm = AnalyticCostModel(_load("nemotron-h-8b"), CLUSTER, runtime=RUNTIME)
    read = fields_each_reads(lambda s, x: term(x, cm._context), CASES)
    undeclared, _ = undeclared_and_unread(term.READS, read)
    assert not undeclared


@pytest.mark.parametrize("name", ["nemotron-h-8b", "nemotron-h-56b", "nemotron-3-nano-30b-a3b"])
def test_catalog_hybrids_are_their_published_configs(name):
    assert ModelSpec.load(name) == _load(name)


def test_a_hybrid_round_trips_through_its_file_form():
    m = ModelSpec.load("nemotron-3-nano-30b-a3b")
    data = m.to_dict()
    assert data["mamba"]["n_groups"] == 8 and data["layer_pattern"].startswith("MEMEM*E")
    assert ModelSpec.from_dict(data) == m
    assert "mamba" not in ModelSpec.load("llama3-8b").to_dict()  # files as before the field


# ---- Gated DeltaNet (Qwen3-Next's linear attention) --------------------------------------------
def test_a_gated_deltanet_mixer_counts_as_transformers_builds_it():
    """Qwen3-Next 80B-A3B's linear-attention layer (h 2048, 16 key heads and 32 value heads of
    128, conv 4): the parameters of transformers' Qwen3NextGatedDeltaNet on the meta device."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(
        hidden_size=2048,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_hidden_layers=4,
    )
    with torch.device("meta"):
        layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    gdn = GatedDeltaNetSpec(n_k_heads=16, n_v_heads=32)
    assert gdn.params(2048) == sum(p.numel() for p in layer.parameters())


def _gdn_hybrid() -> ModelSpec:
    """Qwen3-Next's layout with dense MLPs: three Gated DeltaNet layers, then attention."""
    return dataclasses.replace(
        ModelSpec.load("llama3-8b").scaled(n_layers=32, seq_len=8192),
        layer_pattern="G-G-G-*-" * 8,
        gdn=GatedDeltaNetSpec(n_k_heads=16, n_v_heads=32),
        name="gdn-hybrid",
    )


def test_a_gated_deltanet_hybrid_is_priced_and_its_rules_hold():
    m = _gdn_hybrid()
    assert m.n_params != ModelSpec.load("llama3-8b").n_params
    s = Strategy.parse(f"dp=16,tp=2,sequence_parallel=true,{BASE}")
    r = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME).estimate(s)
    dense = AnalyticCostModel(
        ModelSpec.load("llama3-8b").scaled(seq_len=8192), CLUSTER, runtime=RUNTIME
    )
    assert 0.25 < r.mfu < 0.65 and r.step_time_s < dense.estimate(s).step_time_s
    with pytest.raises(SpecError, match="Gated DeltaNet mixer's 4 key heads"):
        Strategy.parse(f"dp=4,tp=8,{BASE}").validate(
            dataclasses.replace(m, gdn=GatedDeltaNetSpec(n_k_heads=4, n_v_heads=8)), CLUSTER
        )
    with pytest.raises(SpecError, match="cp=2 with Gated DeltaNet layers is not priced"):
        Strategy.parse(f"dp=16,cp=2,{BASE}").validate(m, CLUSTER)


def test_gdn_part_reads_what_it_declares():
    from test_terms import CASES, fields_each_reads, undeclared_and_unread

    cm = AnalyticCostModel(_gdn_hybrid(), CLUSTER, runtime=RUNTIME)
    read = fields_each_reads(lambda s, x: ssm.gdn_part(x, cm._context), CASES)
    undeclared, _ = undeclared_and_unread(ssm.gdn_part.READS, read)
    assert not undeclared


def test_runtimes_that_do_not_train_hybrids_say_so():
    """torchtitan and DeepSpeed have no Mamba-2 layer (autosearch/core/runtime.py
    MODEL_FEATURES): a hybrid priced under them is refused naming the runtimes that train it
    (the Engine's `torch` among them), not priced as if it ran."""
    for runtime in ("torchtitan", "deepspeed"):
        with pytest.raises(
            SpecError,
            match=r"not train Mamba-2 mixers.*runtimes that do: megatron-core, torch, "
            r"automodel \(--runtime megatron-core\)",
        ):
            AnalyticCostModel(_load("nemotron-h-8b"), CLUSTER, runtime=runtime)
    AnalyticCostModel(_load("nemotron-h-8b"), CLUSTER, runtime="torch")  # the Engine trains it


# ---- gated attention (Qwen3-Next, Qwen3.5) ------------------------------------------------------
def test_the_attention_output_gate_is_priced_as_its_projection():
    """The gate is an h x (heads x head_dim) projection beside Q's (Qwen3NextAttention.q_proj
    twice the query width): its weights per attention layer, 2 FLOPs per weight per token
    forward (3x in training), a longer step and more saved activations; without it the
    model prices as before (tools/fingerprint.py holds every catalog model bit for bit)."""
    m = _gdn_hybrid()
    gated = dataclasses.replace(m, attention_output_gate=True)
    attention = m.pattern.count("*")
    extra = attention * m.hidden_size * m.attention_hidden_size
    assert gated.n_params - m.n_params == extra
    assert gated.flops_per_token() - m.flops_per_token() == pytest.approx(3 * 2 * extra)
    s = Strategy.parse(f"dp=16,tp=2,sequence_parallel=true,{BASE}")
    plain = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME).estimate(s)
    with_gate = AnalyticCostModel(gated, CLUSTER, runtime=RUNTIME).estimate(s)
    assert with_gate.step_time_s > plain.step_time_s
    assert with_gate.memory.activations_bytes > plain.memory.activations_bytes
    assert with_gate.memory.params_bytes > plain.memory.params_bytes
    assert ModelSpec.from_dict(gated.to_dict()) == gated
    assert "attention_output_gate" not in m.to_dict()  # files as before the field
    assert (
        unbuilt(gated) == []
    )  # the reference transformer builds it (tests/test_gated_attention.py)
    with pytest.raises(SpecError, match="attention_output_gate with mla is not modelled"):
        dataclasses.replace(ModelSpec.load("deepseek-v2"), attention_output_gate=True)


def test_qwen3_next_is_priced_with_experts_over_ep():
    m = ModelSpec.load("qwen3-next-80b-a3b")
    s = Strategy.parse(f"dp=32,ep=8,recompute=full,{BASE}".replace("768", "256"))
    s.validate(m, CLUSTER)
    r = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME).estimate(s)
    assert r.step_time_s > 0 and 0.05 < r.mfu < 0.65


def test_the_default_space_knows_the_hybrids_rules():
    """tp divides the Mamba-2 groups (Granite 4.0-H Small: 1 group, so tp 1; Megatron-Core's
    MambaMixer asserts ngroups % tp == 0) and Qwen3-Next's 2 kv heads, cp stays 1 (the default
    space does not open it; its head rule is test_context_parallel_over_mamba_layers_...), and
    ep opens over the experts of a hybrid MoE."""
    from search_spaces import SearchSpace

    seen = {}
    for name in ("granite-4.0-h-small", "qwen3-next-80b-a3b"):
        space = SearchSpace(name, "h100-sxm:1x8", global_batch_size=64)
        strategies = list(itertools.islice(space.enumerate(), 50_000))
        seen[name] = {(s.tp, s.cp) for s in strategies}, {s.ep for s in strategies}
    assert {tp for tp, _ in seen["granite-4.0-h-small"][0]} == {1}
    assert {tp for tp, _ in seen["qwen3-next-80b-a3b"][0]} == {1, 2}
    assert all(cp == 1 for pairs, _ in seen.values() for _, cp in pairs)
    assert all({2, 8} <= eps for _, eps in seen.values())


# ---- the SSD scan as its kernels run it ---------------------------------------------------------
def test_the_ssd_scan_is_priced_from_its_kernels():
    """mamba_ssm's chunked scan (MambaSpec.ssd_kernels): the forward kernels' FLOPs are the four
    steps of Dao & Gu 2024 sec. 6 (`ssd_flops_per_token`); the backward recomputes the states
    and adds the gradients' products (about twice and a half the forward FLOPs); with Nemotron
    3 Nano's d_state 128 and chunks of 128 the fp32 chunk states keep its FLOPs per byte
    streamed under a quarter of an H100's ridge point (989e12 FLOP/s over 3.35e12 B/s: 295
    FLOPs a byte, its datasheet), so the scan is memory-bound and costs more than twice its
    FLOPs at the fused-attention rate alone."""
    mamba = ModelSpec.load("nemotron-3-nano-30b-a3b").mamba
    forward, backward = mamba.ssd_kernels(2)
    assert sum(k.flops_per_token for k in forward) == mamba.ssd_flops_per_token()
    ratio = sum(k.flops_per_token for k in backward) / mamba.ssd_flops_per_token()
    assert 2.0 < ratio < 3.0
    chunk_state = next(k for k in forward if k.name == "chunk_state")
    states = mamba.d_inner * mamba.d_state / mamba.chunk_size * 4  # fp32, per token
    assert chunk_state.bytes_per_token > states
    for kernels in (forward, backward):
        flops = sum(k.flops_per_token for k in kernels)
        nbytes = sum(k.bytes_per_token for k in kernels)
        assert flops / nbytes < 295 / 4
    m = _load("nemotron-3-nano-30b-a3b")
    s = Strategy.parse(f"dp=32,ep=8,{BASE}")
    ctx = AnalyticCostModel(m, CLUSTER, runtime=RUNTIME)._context
    x = ssm.layer_shape(s, ctx)
    rate = x.peak * ssm.attention_efficiency(ctx, x.precision)
    flops_only = x.T * mamba.ssd_flops_per_token() / rate
    assert ssm._ssd_s(ctx, x, forward) > 2 * flops_only


@pytest.mark.parametrize(
    "cluster", ["b200-sxm:1x8", "b300-sxm:1x8", "gb200-nvl72:2x4", "gb300-nvl72:2x4"]
)
def test_the_ssd_scan_is_memory_bound_on_blackwell_at_any_tensor_core_rate(cluster):
    """Whether Triton lowers mamba_ssm's ``tl.dot`` to Blackwell's tcgen05 MMAs or to an
    Ampere-style path does not move the scan's price: at Nemotron 3 Nano's shapes (d_state 128,
    chunks of 128, the fp32 chunk states) every one of its eighteen kernels takes longer to
    stream its bytes at the profile's bandwidth than to run its FLOPs at a quarter of the dense
    bf16 peak (the rate the Blackwell profiles assume for FlashAttention-2's sm80 code path), so
    each roofline is its bytes' (`ssm._ssd_s`). Its tensor-core rate is no lever on the Nemotron 3
    Blackwell rows; its bandwidth would be."""
    m = _load("nemotron-3-nano-30b-a3b")
    mamba = m.mamba
    assert mamba is not None
    s = Strategy.parse("dp=8,ep=8,global_batch_size=512,micro_batch_size=2,zero_stage=1,amp=bf16")
    ctx = AnalyticCostModel(m, Cluster.parse(cluster), runtime=RUNTIME)._context
    assert ctx.profile.architecture == "blackwell"
    x = ssm.layer_shape(s, ctx)
    quarter = 0.25 * x.peak
    forward, backward = mamba.ssd_kernels(2)
    for kernel in forward + backward:
        flops_s = x.T * kernel.flops_per_token / quarter
        bytes_s = ssm.stream_s(ctx, x.T * kernel.bytes_per_token)
        assert flops_s < bytes_s, kernel.name


@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_a_moe_layers_host_time_adds_to_its_gpu_work_at_any_micro_batch(micro_batch_size):
    """Every MoE layer's forward synchronises the host with the device before its experts
    (TEGroupedMLP's tokens_per_expert.tolist(), the dispatchers' sync points), so the host
    cannot run ahead and its time adds to the GPU's (`experts.rank_s`): on Nemotron 3 Nano,
    each micro-batch of the step takes exactly its 23 MoE layers' host time more than without
    it, at one sequence a micro-batch and at four, whose GPU work is four times as long (a
    floor, the larger of the two, let the host time vanish as the micro-batch grew: the
    Blackwell Ultra recipes' micro-batch of 4 hid it where the runs did not)."""
    nano = _load("nemotron-3-nano-30b-a3b")
    s = Strategy.parse(f"dp=32,ep=8,{BASE}").replace(micro_batch_size=micro_batch_size)
    rt = RUNTIMES[RUNTIME]
    without = dataclasses.replace(rt, moe_layer_host_s=0.0, moe_expert_host_s=0.0)
    host = rt.moe_layer_host_s + rt.moe_expert_host_s * 128 / 8
    assert host > 0
    step = AnalyticCostModel(nano, CLUSTER, runtime=rt).estimate(s).step_time_s
    bare = AnalyticCostModel(nano, CLUSTER, runtime=without).estimate(s).step_time_s
    n_moe = sum(nano.moe_layers)
    assert n_moe == 23
    assert step - bare == pytest.approx(s.grad_accum_steps * n_moe * host, rel=1e-9)


# ---- attention and Mamba-2 in parallel (Falcon-H1) ---------------------------------------------
def _parallel(pattern: str = "P-" * 44, *, mamba: bool = True) -> ModelSpec:
    """Falcon-H1 7B's shape (transformers' FalconH1Config table: 44 layers, h 3072, 12 heads of
    128 and 2 key/value heads, 24 Mamba heads of 128, d_state 256), one group of B and C."""
    mixer = dict(n_heads=24, head_dim=128, d_state=256, n_groups=1, gated_norm=False)
    return ModelSpec.from_dict(
        dict(
            name="parallel-hybrid",
            n_layers=pattern.count("-"),
            hidden_size=3072,
            n_heads=12,
            n_kv_heads=2,
            head_dim=128,
            ffn_hidden_size=12288,
            ffn_activation="swiglu",
            vocab_size=130048,
            seq_len=8192,
            layer_pattern=pattern,
            mamba=mixer if mamba else None,
        )
    )


# a runtime that declares the parallel layer: no preset does yet (the Engine does not build it,
# Megatron-Core's pattern has no symbol for it)
PARALLEL_RUNTIME = dataclasses.replace(
    RUNTIMES["megatron-core"],
    supports=RUNTIMES["megatron-core"].supports + ("parallel_hybrid",),
)


def test_a_parallel_block_counts_both_mixers_under_one_norm():
    """A ``P-`` block: one norm, the attention's and the Mamba-2 mixer's parameters, the MLP;
    FLOPs: both mixers' GEMMs, the attention core and the scan (Megatron-LM's counts of each)."""
    m = _parallel()
    attention_only = _parallel("*-" * 44, mamba=False)
    mamba = m.mamba
    assert m.n_params - attention_only.n_params == 44 * mamba.params(m.hidden_size)
    assert mamba.params(3072) == 3072 * (2 * 3072 + 2 * 256 + 24) + 3072 * 3072 + 3584 * 5 + 72
    extra = 44 * (2 * mamba.matmul_params(3072) + mamba.scan_flops_per_token)
    assert m.flops_per_token(training=False) == attention_only.flops_per_token(training=False) + (
        extra
    )
    assert unpriced(m) == [] and any("in parallel (P)" in what for what in unbuilt(m))


def test_no_runtime_preset_trains_a_parallel_block_and_says_so():
    for runtime in ("torch", "torchtitan", "megatron-core", "automodel"):
        with pytest.raises(SpecError, match=r"attention and Mamba-2 in parallel.*no runtime"):
            AnalyticCostModel(_parallel(), CLUSTER, runtime=runtime)


@pytest.mark.parametrize(
    "strategy",
    [
        f"dp=32,{BASE}",
        f"dp=16,pp=2,{BASE}",
        f"dp=32,recompute=full,{BASE}",
        f"dp=16,cp=2,{BASE}",
    ],
)
def test_a_parallel_block_is_its_attention_block_plus_a_mamba_branch(strategy):
    """What the ``P`` part adds to an attention block is a Mamba-2 sublayer less what the branch
    shares with the attention (its norm, residual, launches and saved input: ssm's docstring):
    a little less than what an ``M`` layer adds to a block without a mixer, and more than
    nothing; memory likewise (equal under full recompute: the chunk states of the layer in
    flight)."""
    s = Strategy.parse(strategy)

    def estimate(pattern, mamba=True):
        model = _parallel(pattern, mamba=mamba)
        return AnalyticCostModel(model, CLUSTER, runtime=PARALLEL_RUNTIME).estimate(s)

    parallel, attention = estimate("P-" * 44), estimate("*-" * 44, mamba=False)
    mamba, none = estimate("M-" * 44), estimate("-" * 44, mamba=False)
    added, alone = (
        parallel.step_time_s - attention.step_time_s,
        mamba.step_time_s - none.step_time_s,
    )
    assert 0.8 * alone < added < alone
    if s.cp == 1:  # under cp the attention's ring exchange and the branch's all-to-alls add up
        assert added == pytest.approx(alone, rel=0.1)
    kept = parallel.memory.activations_bytes - attention.memory.activations_bytes
    assert 0 < kept <= mamba.memory.activations_bytes - none.memory.activations_bytes


def test_parallel_part_reads_what_it_declares():
    from test_terms import CASES, fields_each_reads, undeclared_and_unread

    cm = AnalyticCostModel(_parallel(), CLUSTER, runtime=PARALLEL_RUNTIME)
    read = fields_each_reads(lambda s, x: ssm.parallel_mamba_part(x, cm._context), CASES)
    undeclared, _ = undeclared_and_unread(ssm.parallel_mamba_part.READS, read)
    assert not undeclared


def test_megatron_export_refuses_a_parallel_block():
    from autosearch.export import export

    out = export(Strategy(dp=1, global_batch_size=1), to="megatron", model=_parallel(),
                 allow_unsupported=True)  # fmt: skip
    refused = dict(out.refused)
    assert "no symbol for attention and Mamba-2 in parallel" in refused["layer_pattern"]


# ---- Mamba-1 (Jamba) --------------------------------------------------------------------------
def _jamba() -> ModelSpec:
    """Jamba v0.1's shape (JambaConfig's defaults: 32 layers, h 4096, attention every 8th,
    experts every 2nd, Mamba-1 d_inner 8192, d_state 16, dt_rank 256)."""
    return ModelSpec.from_hf_config({"model_type": "jamba"}, seq_len=8192, name="jamba")


MAMBA1_RUNTIME = dataclasses.replace(
    RUNTIMES["megatron-core"], supports=RUNTIMES["megatron-core"].supports + ("mamba1",)
)


def test_a_mamba1_mixer_counts_its_projections_and_scan():
    """Jamba v0.1's mixer: in_proj 4096 x 16,384, x_proj 8192 x (256 + 32), dt_proj 256 x
    8192 with its bias, out_proj, the conv1d (4 taps and a bias), A_log 8192 x 16, D and the
    dt / B / C norms; the scan's FLOPs 9 per channel and state channel."""
    from autosearch.core._ssm import Mamba1Spec

    spec = Mamba1Spec(d_inner=8192, d_state=16, dt_rank=256)
    matmuls = 4096 * 16_384 + 8192 * 288 + 256 * 8192 + 8192 * 4096
    assert spec.matmul_params(4096) == matmuls
    assert spec.other_params(4096) == 8192 * 5 + 8192 + 8192 * 16 + 8192 + 288
    assert spec.scan_flops_per_token == 9 * 8192 * 16
    m = _jamba()
    assert any("Mamba-1" in what for what in unbuilt(m)) and unpriced(m) == []


def test_no_runtime_preset_trains_mamba1_and_says_so():
    for runtime in ("torch", "megatron-core", "automodel"):
        with pytest.raises(SpecError, match=r"does not train Mamba-1 mixers.*no runtime"):
            AnalyticCostModel(_jamba(), CLUSTER, runtime=runtime)


def test_the_selective_scan_is_priced_memory_bound():
    """At d_state 16 the fused scan moves its inputs and outputs through HBM and keeps the state
    in SRAM (Gu & Dao 2023, sec. 3.3.2): its time is its bytes at the profile's bandwidth, not
    its FLOPs at the fp32 peak."""
    m = _jamba()
    spec = m.mamba1
    fwd_bytes, _ = spec.scan_bytes_per_token(2)
    peak = CLUSTER.profile.peak_flops["fp32"]
    bandwidth = CLUSTER.profile.stream_bandwidth_bytes_per_s(8192 * fwd_bytes)  # one sequence
    assert fwd_bytes / bandwidth > spec.scan_flops_per_token / peak


@pytest.mark.parametrize(
    "strategy",
    [
        f"dp=16,tp=2,ep=8,sequence_parallel=true,{BASE}",
        f"dp=8,tp=2,pp=2,ep=8,{BASE}",
        f"dp=32,ep=8,recompute=full,{BASE}",
    ],
)
def test_jamba_is_priced_under_a_runtime_that_declares_mamba1(strategy):
    """Jamba against the same model with attention in place of its Mamba-1 mixers (28 of 32
    layers): at 8,192 tokens their model FLOPs are within 1% (the Mamba-1 projections, 2.5x
    the attention's, against the attention core), and the step time follows the FLOPs, a
    little slower (the memory-bound scan, conv and norms cost more per FLOP than GEMMs): within
    10%, the tolerance of a structural check, not a calibrated figure."""
    s = Strategy.parse(strategy)
    m = _jamba()
    r = AnalyticCostModel(m, CLUSTER, runtime=MAMBA1_RUNTIME).estimate(s)
    attention = dataclasses.replace(m, layer_pattern=m.pattern.replace("S", "*"), mamba1=None)
    dense = AnalyticCostModel(attention, CLUSTER, runtime=MAMBA1_RUNTIME).estimate(s)
    flops = m.flops_per_token() / attention.flops_per_token()
    assert 0.2 < r.mfu < 0.65
    assert flops < r.step_time_s / dense.step_time_s < 1.1 * flops
    AnalyticCostModel(m, CLUSTER, runtime=MAMBA1_RUNTIME).balanced_split(s)


def test_mamba1_rules_and_part_reads():
    from test_terms import CASES, fields_each_reads, undeclared_and_unread

    m = _jamba()
    with pytest.raises(SpecError, match="cp=2 with Mamba-1 layers is not priced"):
        Strategy.parse(f"dp=16,cp=2,{BASE}").validate(m, CLUSTER)
    cm = AnalyticCostModel(m, CLUSTER, runtime=MAMBA1_RUNTIME)
    read = fields_each_reads(lambda s, x: ssm.mamba1_part(x, cm._context), CASES)
    undeclared, _ = undeclared_and_unread(ssm.mamba1_part.READS, read)
    assert not undeclared


def test_exports_refuse_mamba1():
    from autosearch.export import export

    for to in ("megatron", "torchtitan", "deepspeed"):
        out = export(Strategy(dp=1, global_batch_size=1), to=to, model=_jamba(),
                     allow_unsupported=True)  # fmt: skip
        assert "mamba1" in dict(out.refused), to


# ---- Kimi Delta Attention (Kimi Linear) --------------------------------------------------------
def _kimi() -> ModelSpec:
    """KimiLinearConfig's defaults (Kimi-Linear-48B-A3B's shape) at 8,192 tokens."""
    return ModelSpec.from_hf_config({"model_type": "kimi_linear"}, seq_len=8192, name="kimi")


KDA_RUNTIME = dataclasses.replace(
    RUNTIMES["megatron-core"], supports=RUNTIMES["megatron-core"].supports + ("kda",)
)


def test_a_kda_mixer_counts_its_low_rank_gates():
    """Kimi Delta Attention (h 2304, 32 heads of 128): q, k, v, b and the gate's and decay's
    down-projections from h (3 x 4096 + 32 + 2 x 128 outputs), their up-projections (128 ->
    4096 each), o_proj; the conv1d, dt_bias per channel, A_log per head and the gated norm."""
    gdn = GatedDeltaNetSpec(n_k_heads=32, n_v_heads=32, gate_rank=128)
    assert gdn.in_proj_width == 3 * 4096 + 32 + 256
    assert gdn.matmul_params(2304) == 2304 * (3 * 4096 + 32 + 256) + 2 * 128 * 4096 + 4096 * 2304
    assert gdn.other_params(2304) == 3 * 4096 * 4 + 128 + 4096 + 32
    m = _kimi()
    assert m.gdn == gdn and unpriced(m) == []


def test_kda_is_not_priced_as_gated_deltanet():
    """megatron-core trains Gated DeltaNet, not KDA: Kimi Linear is refused under it (and the
    Megatron export refuses its gdn field) rather than priced as a layer it cannot build."""
    from autosearch.export import export

    with pytest.raises(SpecError, match=r"does not train Kimi Delta Attention.*no runtime"):
        AnalyticCostModel(_kimi(), CLUSTER, runtime=RUNTIME)
    out = export(Strategy(dp=1, global_batch_size=1), to="megatron", model=_kimi(),
                 allow_unsupported=True)  # fmt: skip
    assert "Kimi Delta Attention" in dict(out.refused)["gdn"]


def test_kimi_linear_is_priced_under_a_runtime_that_declares_kda():
    """Priced as Gated DeltaNet layers with their low-rank gate GEMMs, MLA layers and experts
    over ep: against its attention-only twin (MLA everywhere) at 8,192 tokens, a shorter
    step."""
    s = Strategy.parse(f"dp=32,ep=8,{BASE}")
    m = _kimi()
    r = AnalyticCostModel(m, CLUSTER, runtime=KDA_RUNTIME).estimate(s)
    mla = dataclasses.replace(m, layer_pattern=m.pattern.replace("G", "*"), gdn=None)
    dense = AnalyticCostModel(mla, CLUSTER, runtime=KDA_RUNTIME).estimate(s)
    assert r.step_time_s < dense.step_time_s and 0.05 < r.mfu < 0.65
