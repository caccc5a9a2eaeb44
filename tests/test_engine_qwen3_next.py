"""Hugging Face Qwen3-Next under the Engine (autosearch/models/hf/qwen3_next.py) on CPU.

Tiny random transformers models (tests/engine_workers.py ``hf_qwen3_next``: Gated DeltaNet and
gated attention layers with partial rotary and q/k norms, a dense first MLP then MoE layers with
the gated shared expert; ``hf_qwen3_next_dense``: the same with every MLP dense). Single process:
the wrapper computes transformers' logits under transformers' names, `hf_model` gives the
weights back bitwise, and the parameters number the planner's count plus what the ModelSpec
leaves out (autosearch/core/hf_config.py's module doc). Multi-process (gloo, world 2, fp32, 3
AdamW steps, as tests/test_engine_hybrid.py with its tolerances): dp, ZeRO 2/3, pp, selective and
full recompute, ep (+ ZeRO 3), tp and tp + sp x ep with the MoE layers (the Engine's MoE with the
gated shared expert), tp and tp + sp on the dense one, and meta-device init under
ZeRO 3 and tp + sp, against one process. A trained model saved with ``save_pretrained`` loads in
transformers bitwise and predicts what the Engine predicts.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import engine_workers as W  # noqa: E402

from autosearch.core.errors import SpecError  # noqa: E402
from autosearch.core.strategy import Strategy  # noqa: E402
from autosearch.engine.build import wrap_known  # noqa: E402
from autosearch.models.hf.qwen3_next import Qwen3NextCausalLM  # noqa: E402
from autosearch.models.ssm import GatedDeltaNet  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
EXACT, FP32, TP = W.EXACT, W.FP32, W.TP
CASES = {  # name: (strategy, model, tolerance)
    "qwen3_next/dp2": (f"dp=2,{B}", "hf_qwen3_next", FP32),
    "qwen3_next/zero3": (f"dp=2,zero_stage=3,{B}", "hf_qwen3_next", FP32),
    "qwen3_next/pp2": (f"pp=2,pipeline_schedule=1f1b,{B}", "hf_qwen3_next", EXACT),
    "qwen3_next/dp2_selective": (f"dp=2,recompute=selective,{B}", "hf_qwen3_next", FP32),
    "qwen3_next/zero2_full": (f"dp=2,zero_stage=2,recompute=full,{B}", "hf_qwen3_next", FP32),
    "qwen3_next/ep2": (f"dp=2,ep=2,{B}", "hf_qwen3_next", FP32),
    "qwen3_next/ep2_zero3_full": (
        f"dp=2,ep=2,zero_stage=3,recompute=full,{B}",
        "hf_qwen3_next",
        FP32,
    ),
    "qwen3_next/tp2": (f"tp=2,{B}", "hf_qwen3_next", TP),
    "qwen3_next/tp2_sp_ep2": (f"tp=2,sequence_parallel=true,ep=2,{B}", "hf_qwen3_next", TP),
    "qwen3_next_dense/tp2": (f"tp=2,{B}", "hf_qwen3_next_dense", TP),
    "qwen3_next_dense/tp2_sp_selective": (
        f"tp=2,sequence_parallel=true,recompute=selective,{B}",
        "hf_qwen3_next_dense",
        TP,
    ),
}
# Built on the meta device and initialised by the Engine on the shards (transformers' init, the
# Gated DeltaNets' `init_ssm`) against one process's meta-device init
META = {"qwen3_next/meta_init_zero3", "qwen3_next_dense/meta_init_tp2_sp"}
CASES |= {
    "qwen3_next/meta_init_zero3": (f"dp=2,zero_stage=3,{B}", "hf_qwen3_next", FP32),
    "qwen3_next_dense/meta_init_tp2_sp": (
        f"tp=2,sequence_parallel=true,{B}",
        "hf_qwen3_next_dense",
        TP,
    ),
}


@pytest.mark.parametrize("kind", ["hf_qwen3_next", "hf_qwen3_next_dense"])
def test_the_wrapper_computes_what_transformers_computes_under_its_names(kind):
    """Logits to 2e-5 (the Gated DeltaNet mixers are autosearch.models.ssm's, equal to
    transformers' torch path to 2e-5 in tests/test_ssm.py; observed 1.8e-7), transformers'
    parameter names, `hf_model` bitwise. The parameters are the planner's count plus the
    shared-expert gates (h per MoE layer) and the q/k norms (2 head_dim per attention layer),
    which the ModelSpec leaves out."""
    ours, theirs = wrap_known(W.make_model(kind)), W.make_model(kind)
    assert isinstance(ours, Qwen3NextCausalLM)
    mixers = [b.linear_attn for b in ours.model.layers.values() if hasattr(b, "linear_attn")]
    assert len(mixers) == 2 and all(isinstance(m, GatedDeltaNet) for m in mixers)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    config, spec = theirs.config, ours.spec
    assert spec.attention_output_gate and spec.layer_pattern.count("*") == 2
    left_out = spec.layer_pattern.count("E") * config.hidden_size + 2 * 2 * config.head_dim
    assert sum(p.numel() for p in ours.parameters()) == spec.n_params + left_out
    back = ours.hf_model().state_dict()
    assert all(torch.equal(back[k], v) for k, v in theirs.state_dict().items())
    x = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        gap = (ours(x) - theirs(x).logits).abs().max().item()
    assert gap < 2e-5, gap


def test_the_wrapper_refuses_what_it_does_not_run_with_the_reason():
    moe = wrap_known(W.make_model("hf_qwen3_next")).parallel_plan()
    dense = wrap_known(W.make_model("hf_qwen3_next_dense")).parallel_plan()
    assert moe.check is not None and dense.check is not None
    for plan, strategy, says in (
        (moe, "cp=2", "cp=2 with"),
        (dense, "cp=2", "cp=2 with"),
        (moe, "dp=8,ep=8", "ep=8 does not divide the 4 routed experts"),
        (dense, "tp=4", "tp=4 does not divide"),  # 2 Gated DeltaNet key heads
    ):
        problems = plan.check(Strategy.parse(f"{strategy},{B}"))
        assert any(says in p for p in problems), (strategy, problems)
    assert dense.check(Strategy.parse(f"tp=2,sequence_parallel=true,{B}")) == []
    assert moe.check(Strategy.parse(f"dp=2,pp=2,zero_stage=3,{B}")) == []
    assert moe.check(Strategy.parse(f"tp=2,sequence_parallel=true,ep=2,{B}")) == []
    hf = W.make_model("hf_qwen3_next")
    hf.config.output_router_logits = True
    with pytest.raises(SpecError, match="output_router_logits = False"):
        wrap_known(hf)


def test_qwen3_next_trains_and_saves_a_model_transformers_loads_bitwise(tmp_path):
    pytest.importorskip("transformers")
    W.assert_trains_and_saves_bitwise("hf_qwen3_next", B, tmp_path)


@pytest.fixture(scope="module")
def world2():
    return W.launch_each(CASES, meta_init=META)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_qwen3_next_under_each_dimension_matches_one_process(world2, name):
    _, kind, tol = CASES[name]
    got = world2[name]
    torch.set_num_threads(1)  # as the workers
    ref = W.meta_init_losses(B, kind) if name in META else W.reference_losses(B, kind)
    W.assert_matches_one_process(name, got, ref, tol)


# Four processes (`extended`): tp + sp x ep composed with the pipeline and with FSDP2 over dp
WORLD4 = {
    "qwen3_next/pp2_tp2_sp_ep2": (
        f"pp=2,tp=2,sequence_parallel=true,ep=2,pipeline_schedule=1f1b,{B}",
        "hf_qwen3_next",
        TP,
    ),
    "qwen3_next/dp2_tp2_zero3_sp": (
        f"dp=2,tp=2,zero_stage=3,sequence_parallel=true,{B}",
        "hf_qwen3_next",
        TP,
    ),
}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name", list(WORLD4))
def test_qwen3_next_at_world_size_4_matches_one_process(name):
    strategy, kind, tol = WORLD4[name]
    results = W.launch(4, "equivalence_each", [dict(name=name, strategy=strategy, model=kind)])
    got = results[0][name]
    assert not isinstance(got, str), f"{name} failed:\n{got}"
    assert all(r[name] == got for r in results), f"{name}: ranks differ"
    torch.set_num_threads(1)  # as the workers
    ref = W.reference_losses(B, kind)
    gap = max(abs(a - b) for a, b in zip(got, ref))
    print(f"{name}: max loss difference {gap:.2e}")
    early = max(abs(a - b) for a, b in zip(got[:2], ref[:2]))
    assert early <= tol[0] and gap <= tol[1], f"{name}: {got} vs single-process {ref}"
