"""Memory of the runtime as it allocates (issue 9, item 4): the loss, the pipeline's kept
outputs and op-level SAC, each a runtime property read in torchtitan's / torch's code
(docs/runtimes.md [2.2], [2.7], [2.9], [2.10]).

Each test changes one runtime figure (or the strategy option that selects it) and checks that
the activation memory moves by exactly the bytes that figure stands for: the model is linear in
each of them, so the tolerance is float rounding (rel 1e-9), not a fitted margin.
"""

from __future__ import annotations

import dataclasses

import pytest

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core import RUNTIMES
from cost_models import AnalyticCostModel

LLAMA8B = ModelSpec.load("llama3-8b")
CLUSTER = Cluster.parse("h100-sxm:2x8")
REL = 1e-9  # float rounding only: every figure below enters the memory linearly
TITAN = RUNTIMES["torchtitan"]


def activations(runtime, strategy, model=LLAMA8B, cluster=CLUSTER) -> float:
    report = AnalyticCostModel(model, cluster, runtime=runtime).estimate(strategy)
    return report.memory.activations_bytes


def fsdp(**kw) -> Strategy:
    """Llama 3 8B as torchtitan's Table 1 runs it: FSDP, local batch 2, op-level SAC."""
    fields = dict(
        dp=16,
        micro_batch_size=2,
        global_batch_size=32,
        zero_stage=3,
        recompute="selective_op",
    )
    return Strategy(**{**fields, **kw})


def logits_of(strategy: Strategy, model=LLAMA8B) -> float:
    """Logits of one micro-batch on one rank (the vocabulary split over tp)."""
    tokens = strategy.micro_batch_size * model.seq_len / strategy.cp
    return tokens * model.vocab_size / strategy.tp


@pytest.mark.parametrize("compile_", [False, True])
def test_the_loss_keeps_the_runtime_bytes_per_logit(compile_):
    """Eager and compiled figures each move the memory by logits x their change, and only the
    one the strategy selects does."""
    s = fsdp(compile=compile_)
    base = activations(TITAN, s)
    field = "compiled_loss_bytes_per_logit" if compile_ else "loss_bytes_per_logit"
    other = "loss_bytes_per_logit" if compile_ else "compiled_loss_bytes_per_logit"
    more = dataclasses.replace(TITAN, **{field: getattr(TITAN, field) + 4})
    assert activations(more, s) - base == pytest.approx(4 * logits_of(s), rel=REL)
    unchanged = dataclasses.replace(TITAN, **{other: getattr(TITAN, other) + 4})
    assert activations(unchanged, s) == pytest.approx(base, rel=REL)


def test_loss_parallel_figure_applies_only_when_tp_splits_the_vocabulary():
    sp = dict(sequence_parallel=True, recompute="full")
    with_tp = fsdp(dp=2, tp=8, micro_batch_size=1, global_batch_size=2, **sp)
    without = fsdp(recompute="full")
    more = dataclasses.replace(
        TITAN, loss_parallel_bytes_per_logit=TITAN.loss_parallel_bytes_per_logit + 8
    )
    delta = activations(more, with_tp) - activations(TITAN, with_tp)
    assert delta == pytest.approx(8 * logits_of(with_tp), rel=REL)
    assert activations(more, without) == pytest.approx(activations(TITAN, without), rel=REL)
    # torchtitan's eager vocabulary-parallel loss keeps 16 B/logit, the whole-vocabulary one 12
    # (DTensor loss.py handlers vs aten cross_entropy; docs/runtimes.md [2.9])
    whole = dataclasses.replace(TITAN, loss_parallel_bytes_per_logit=0.0)
    delta = activations(TITAN, with_tp) - activations(whole, with_tp)
    assert delta == pytest.approx((16 - 12) * logits_of(with_tp), rel=REL)


def test_dated_preset_keeps_the_eager_loss_under_compile():
    """The Dec 2024 code compiled the blocks, not the loss: with compile the two torchtitan
    presets differ, for a run without a pipeline, by the loss alone (12 vs 4 B/logit)."""
    s = fsdp(compile=True)
    delta = activations(RUNTIMES["torchtitan-2412"], s) - activations(TITAN, s)
    assert delta == pytest.approx((12 - 4) * logits_of(s), rel=REL)
    eager = fsdp()
    assert activations(RUNTIMES["torchtitan-2412"], eager) == pytest.approx(
        activations(TITAN, eager), rel=REL
    )


def _last_stage_bound() -> tuple[ModelSpec, Cluster]:
    """A small model with Llama 3's vocabulary over 2 stages: the last stage (logits) is the
    pipeline's peak, so what it keeps shows in the estimate."""
    model = dataclasses.replace(LLAMA8B, name="tiny-llama-vocab", n_layers=4, seq_len=2048)
    return model, Cluster.parse("h100-sxm:1x8")


@pytest.mark.parametrize("m", [4, 8])
def test_pipeline_last_stage_keeps_every_microbatch_output(m):
    model, cluster = _last_stage_bound()
    s = Strategy(dp=4, pp=2, micro_batch_size=1, global_batch_size=4 * m, zero_stage=1)
    keep = dataclasses.replace(TITAN, pp_kept_output_bytes_per_logit=4.0)
    none = dataclasses.replace(TITAN, pp_kept_output_bytes_per_logit=0.0)
    delta = activations(keep, s, model, cluster) - activations(none, s, model, cluster)
    assert delta == pytest.approx(m * 4.0 * logits_of(s, model), rel=REL)


def test_no_pipeline_keeps_no_outputs():
    s = fsdp()
    keep = dataclasses.replace(TITAN, pp_kept_output_bytes_per_logit=4.0)
    assert activations(keep, s) == pytest.approx(activations(TITAN, s), rel=REL)


def test_compiled_op_sac_saves_what_backward_reads():
    """Eager SAC stores every MUST_SAVE output; compiled, the partitioner drops the one no
    backward formula reads (w2's output): one tokens x h x 2 B tensor per block fewer. The SwiGLU
    is fused and the loss figures equal in both modes here, so that is the only difference."""
    rt = dataclasses.replace(
        TITAN,
        fused_swiglu=True,
        compiled_loss_bytes_per_logit=TITAN.loss_bytes_per_logit,
    )
    eager, compiled = fsdp(), fsdp(compile=True)
    tokens = eager.micro_batch_size * LLAMA8B.seq_len
    per_block = tokens * LLAMA8B.hidden_size * 2
    delta = activations(rt, eager) - activations(rt, compiled)
    assert delta == pytest.approx(LLAMA8B.n_layers * per_block, rel=REL)


def test_engine_runtime_keeps_its_memory():
    """The Engine's preset (`torch`, measured in results/fidelity_local.csv) has no
    vocabulary-parallel or kept-output figure: its memory is what it was."""
    torch_rt = RUNTIMES["torch"]
    assert torch_rt.loss_parallel_bytes_per_logit == 0.0
    assert torch_rt.pp_kept_output_bytes_per_logit == 0.0
    s = fsdp(dp=2, tp=8, micro_batch_size=1, global_batch_size=2, recompute="full")
    # with tp = 8 its loss is still its whole-vocabulary figure, on the vocabulary shard
    more = dataclasses.replace(torch_rt, loss_bytes_per_logit=torch_rt.loss_bytes_per_logit + 4)
    delta = activations(more, s) - activations(torch_rt, s)
    assert delta == pytest.approx(4 * logits_of(s), rel=REL)


def test_context_parallel_backward_holds_the_gathered_kv_and_fp32_gradients():
    """Llama 3 8B at 262,144 tokens over cp = 8 (torchtitan Table 2): the gathered K, V of the
    whole sequence at full head count (repeat_kv), one ring step's bf16 SDPA gradients, fp32
    dQ/dK/dV accumulators and the fp32 dK, dV sent and received (docs/runtimes.md [1.5])."""
    model = dataclasses.replace(LLAMA8B, name="llama3-8b-256k", seq_len=262_144)
    cluster = Cluster.parse("h100-sxm:1x8")
    s = Strategy(cp=8, micro_batch_size=1, global_batch_size=1, zero_stage=3, recompute="full")
    without = dataclasses.replace(TITAN, cp_all_gather_kv=False)
    delta = activations(TITAN, s, model, cluster) - activations(without, s, model, cluster)
    local, h = 32_768, 4096  # tokens per rank; K, V at n_heads x head_dim = h
    gathered = 2 * local * 8 * h * 2
    qkv = local * 3 * h
    expected = gathered + qkv * 2 + qkv * 4 + 2 * 4 * local * 2 * h
    assert expected == pytest.approx(8.86e9, rel=1e-3)  # docs/runtimes.md [1.5]: 8.9 GB
    assert delta == pytest.approx(expected, rel=REL)
    # at n_kv_heads (8 of 32) the whole-sequence K, V would be a quarter as large
    narrow = dataclasses.replace(TITAN, attention_kv_expanded=False)
    assert activations(narrow, s, model, cluster) < activations(TITAN, s, model, cluster)


def test_the_dated_preset_is_torchtitan_but_for_the_fields_it_sets():
    """torchtitan-2412 names `base: torchtitan` in runtimes.yaml: every field it does not set is
    torchtitan's, and its runs count as torchtitan's in the error bands."""
    import yaml

    from autosearch.core.data import data_path

    old = RUNTIMES["torchtitan-2412"]
    own = set(
        yaml.safe_load(data_path("runtimes.yaml").read_text())["runtimes"]["torchtitan-2412"]
    )
    assert own >= {"base", "compiled_loss_bytes_per_logit", "pp_kept_output_bytes_per_logit"}
    for f in dataclasses.fields(old):
        if f.name not in own | {"name"}:
            assert getattr(old, f.name) == getattr(TITAN, f.name), f.name
    assert old.compiled_loss_bytes_per_logit == 12 != TITAN.compiled_loss_bytes_per_logit
    assert (old.framework, TITAN.framework) == ("torchtitan", "torchtitan")


def test_torchtitan_layer_sac_checkpoints_every_nth_block():
    """torchtitan's layer-level selective AC (`selective_ac_option = "2"`: every second block
    fully checkpointed, docs/runtimes.md [2.2]) is `recompute=full` on half of the layers
    (`recompute_num_layers` = 16 of Llama 3 8B's 32): the torchtitan preset runs it, and it costs
    half of full recompute's time. Its memory keeps 16 blocks whole: of the 31 blocks' worth
    full AC saves over none (32 blocks, less the one it holds whole while recomputing), layer
    SAC saves 15."""
    model = AnalyticCostModel(LLAMA8B, CLUSTER, runtime=TITAN)
    none, every_2nd, full = (
        model.estimate(fsdp(recompute=rc, recompute_num_layers=n))
        for rc, n in (("none", None), ("full", 16), ("full", None))
    )
    assert every_2nd.time.recompute_s == pytest.approx(full.time.recompute_s / 2, rel=REL)
    saved = none.memory.activations_bytes - every_2nd.memory.activations_bytes
    saved_full = none.memory.activations_bytes - full.memory.activations_bytes
    assert saved == pytest.approx(saved_full * 15 / 31, rel=REL)
