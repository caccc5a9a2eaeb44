"""The Engine on transformers' mixture-of-experts families with their own wrapper: Qwen2-MoE,
DeepSeek-V2/V3 (MLA), gpt-oss and Llama 4 text (autosearch/models/hf/{qwen2_moe, deepseek,
gpt_oss, llama4}.py), on CPU with gloo.

Single process (default run): `wrap_known` wraps each family under transformers' parameter
names, computes transformers' logits (and load-balancing loss), converts back to transformers,
initialises on the meta device, reports the ModelSpec the planner reads from the same config
(`autosearch.core.hf_config`), whose parameter count is the torch model's less what that reader
documents it leaves out, and refuses what the Engine cannot run with the reason.

Multi-process: tiny random models (tests/moe_family_workers.py: 2 layers, hidden 64, 4 or 8
experts) train 3 AdamW steps under each layout and must give the single-process losses with the
tolerances of the other Engine tests (tests/test_engine_moe.py, tests/test_engine_hf.py): bitwise
under pp (the same ops on the same micro-batches; Qwen2-MoE's aux-loss sums carried over the
stages), else 2e-5 over the first two steps and 1e-3 over three (fp32 sums reordered). Qwen2-MoE
trains with transformers' load-balancing loss over the whole micro-batch, so it runs one sequence
per micro-batch (as Mixtral in test_engine_moe.py). The default run launches 2 processes once, one
layout per family (`DEFAULT`); the families x dimensions matrix (`DIMS`, `WORLD4`) is marked
`extended` (``pytest -m extended tests/test_engine_hf_moe_families.py``). Observed on this CPU
(transformers 5.25, torch 2.13): see docs/engine.md's table.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import moe_family_workers as F  # noqa: E402

from autosearch import ModelSpec, Strategy  # noqa: E402
from autosearch.engine.build import plan_for, strategy_problems, wrap_known  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
B1 = "micro_batch_size=1,global_batch_size=8,amp=fp32"  # transformers' aux loss: one sequence
EXACT, FP32 = 0.0, (2e-5, 1e-3)
FAMILIES = [f for f in F.FAMILIES if f != "llama4_text_untuned"]
WRAPPERS = {
    "qwen2_moe": "Qwen2MoeCausalLM",
    "deepseek_v3": "DeepseekCausalLM",
    "deepseek_v2": "DeepseekCausalLM",
    "gpt_oss": "GptOssCausalLM",
    "llama4_text": "Llama4CausalLM",
}
# layout name -> strategy (the batch is the family's)
DIMS = {
    "dp2": "dp=2",
    "zero1": "dp=2,zero_stage=1",
    "zero2": "dp=2,zero_stage=2",
    "zero3": "dp=2,zero_stage=3",
    "tp2": "tp=2",
    "tp2_sp": "tp=2,sequence_parallel=true",
    "pp2": "pp=2,pipeline_schedule=1f1b",
    "cp2": "cp=2",
    "ep2": "dp=2,ep=2",
    "ep2_zero3": "dp=2,ep=2,zero_stage=3",
    "tp2_sp_ep2": "tp=2,ep=2,sequence_parallel=true",  # ep over the tp ranks
    "cp2_ep2": "cp=2,ep=2",
    "etp2": "tp=2,etp=2",
    "recompute_full": "dp=2,recompute=full",
    "recompute_selective": "tp=2,recompute=selective",
    "recompute_selective_op": "tp=2,sequence_parallel=true,recompute=selective_op",
}
WORLD4 = {
    "dp2_tp2_sp_ep2_zero3": "dp=2,tp=2,ep=2,sequence_parallel=true,zero_stage=3",
    "pp2_tp2_sp": "pp=2,tp=2,sequence_parallel=true",
}
# Llama 4 without attention temperature tuning, under the layouts Llama 4 with it refuses
UNTUNED = {"llama4_text_untuned/cp2": "cp2", "llama4_text_untuned/cp2_ep2": "cp2_ep2"}
# (family, layout) -> what the refusal says; every other case must run
ETP_FUSED = "hold the gate and up rows in one matrix"
CP_TUNING = "attention temperature tuning at 32 tokens"
REFUSED = {
    ("qwen2_moe", "etp2"): ETP_FUSED,
    ("deepseek_v3", "etp2"): ETP_FUSED,
    ("deepseek_v2", "etp2"): ETP_FUSED,
    ("gpt_oss", "etp2"): "add a bias after the down projection",
    ("llama4_text", "etp2"): "hold the gate and up columns in one matrix",
    ("llama4_text", "cp2"): CP_TUNING,
    ("llama4_text", "cp2_ep2"): CP_TUNING,
}
# the default run: one launch, each family once, on the layout that exercises most of its code
DEFAULT = {
    "qwen2_moe": "tp2_sp_ep2",  # gated shared expert and aux loss over tp ranks' tokens
    "deepseek_v3": "tp2_sp_ep2",  # MLA heads over tp, group-limited router, ep over tp
    "deepseek_v2": "cp2_ep2",  # complex rotary at global positions, ep over the cp ranks
    "gpt_oss": "tp2_sp",  # sinks sharded with the heads, biased experts
    "llama4_text": "tp2_sp_ep2",
}


def _batch(family: str) -> str:
    return B1 if family == "qwen2_moe" else B


def _cases(table: dict[str, str], families=FAMILIES) -> list[dict]:
    return [
        dict(name=f"{f}/{d}", family=f, strategy=f"{table[d]},{_batch(f)}")
        for f in families
        for d in table
    ]


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)  # as the workers
    return {f: F.train_losses(_batch(f), f) for f in F.FAMILIES}


@pytest.fixture(scope="module")
def default_run():
    cases = [
        dict(name=f"{f}/{d}", family=f, strategy=f"{DIMS[d]},{_batch(f)}")
        for f, d in DEFAULT.items()
    ]
    return F.launch(2, "moe_families", cases, timeout_s=420)


@pytest.fixture(scope="module")
def matrix():
    untuned = [
        dict(name=name, family=name.split("/")[0], strategy=f"{DIMS[dim]},{B}")
        for name, dim in UNTUNED.items()
    ]
    return F.launch(2, "moe_families", _cases(DIMS) + untuned, timeout_s=600)


@pytest.fixture(scope="module")
def world4():
    families = ("qwen2_moe", "deepseek_v3", "gpt_oss")
    return F.launch(4, "moe_families", _cases(WORLD4, families), timeout_s=600)


def _check(results, references, name, dim):
    family = name.split("/")[0]
    got = results[0][name]
    assert all(r[name] == got for r in results), f"{name}: ranks report different outcomes"
    if (family, dim) in REFUSED:
        assert isinstance(got, str) and REFUSED[family, dim] in got, (name, got)
        return
    assert not isinstance(got, str), f"{name}: refused: {got}"
    ref = references[family]
    assert got[-1] < got[0] - 0.05, f"{name}: the loss did not fall ({got})"
    gap = max(abs(a - b) for a, b in zip(got, ref))
    print(f"{name}: max loss difference {gap:.2e}")
    if dim.startswith("pp2") and "tp" not in dim:
        assert got == ref, f"{name}: expected the single-process losses bitwise: {got} vs {ref}"
        return
    early = max(abs(a - b) for a, b in zip(got[:2], ref[:2]))
    assert early <= FP32[0] and gap <= FP32[1], f"{name}: {got} vs single-process {ref}"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_matches_one_process_in_one_layout(default_run, references, family):
    _check(default_run, references, f"{family}/{DEFAULT[family]}", DEFAULT[family])


@pytest.mark.extended
@pytest.mark.parametrize("name", [c["name"] for c in _cases(DIMS)] + list(UNTUNED))
def test_families_by_dimensions_match_one_process(matrix, references, name):
    _check(matrix, references, name, name.split("/")[1])


@pytest.mark.extended
@pytest.mark.parametrize(
    "name", [c["name"] for c in _cases(WORLD4, ("qwen2_moe", "deepseek_v3", "gpt_oss"))]
)
def test_families_at_world_size_4_match_one_process(world4, references, name):
    _check(world4, references, name, name.split("/")[1])


# ---- single process ----------------------------------------------------------------------------
def _pair(family: str, *, aux: bool = False):
    """(transformers model, a wrapped copy, tokens)."""
    hf = F.make_model(family).train()
    if aux:
        hf.config.output_router_logits = True
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    return hf, wrap_known(copy.deepcopy(hf)).train(), x


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_wraps_each_family_under_transformers_names(family):
    """The family's wrapper, transformers' state dict keys, transformers' logits (observed:
    bitwise, the same ops in the same order), and back to transformers bitwise."""
    aux = family in ("qwen2_moe", "gpt_oss")  # their load-balancing loss, when configured
    hf, model, x = _pair(family, aux=aux)
    assert type(model).__name__ == WRAPPERS[family]
    assert set(model.state_dict()) == set(hf.state_dict())
    ref = hf(input_ids=x, labels=x)
    torch.testing.assert_close(model(x), ref.logits, rtol=0, atol=1e-6)
    if aux:
        assert float(model.aux_loss) == pytest.approx(float(ref.aux_loss.detach()), rel=1e-6)
    back = model.hf_model()
    assert type(back) is type(hf)
    want = hf.state_dict()
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)
    torch.testing.assert_close(back.train()(input_ids=x).logits, ref.logits, rtol=0, atol=1e-6)


def _left_out(config) -> int:
    """The parameters autosearch.core.hf_config documents that a ModelSpec leaves out (module
    docstring: Qwen2's q/k/v biases and Qwen2-MoE's shared-expert gate; gpt-oss's attention
    and expert biases, router bias and sinks)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    if config.model_type == "qwen2_moe":
        return layers * ((heads + 2 * kv) * d + h)
    if config.model_type == "gpt_oss":
        attention = (heads + 2 * kv) * d + h + heads  # q/k/v/o biases, sinks
        experts = config.num_local_experts * (2 * config.intermediate_size + h + 1)
        return layers * (attention + experts)
    return 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_spec_is_the_planners_and_counts_the_models_parameters(family):
    """The wrapper's ModelSpec (Engine.cost, tune) is the one the planner reads from the same
    config, and counts every parameter of the torch model but those it documents it leaves
    out (exactly for DeepSeek-V2/V3 and Llama 4)."""
    hf = F.make_model(family)
    model = wrap_known(copy.deepcopy(hf))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = ModelSpec.from_hf_config(hf.config)
    assert model.spec == planner
    torch_count = sum(p.numel() for p in model.parameters())
    assert torch_count == sum(p.numel() for p in hf.parameters())
    assert planner.n_params + _left_out(hf.config) == torch_count
    assert planner.moe is not None and planner.n_moe_layers == model.n_moe_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_a_meta_device_build_initialises_as_transformers(family):
    """Built on the meta device then `init_weights` (Engine(meta_init=True)): every weight
    finite, transformers' zeros where it puts zeros (gpt-oss's expert biases, DeepSeek-V3's
    e_score_correction_bias), experts normal(0, initializer_range)."""
    with torch.device("meta"):
        model = wrap_known(F.make_model(family))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    state = model.state_dict()
    assert all(torch.isfinite(t).all() for t in state.values())
    for key, tensor in state.items():
        if key.endswith(("proj_bias", "e_score_correction_bias")):
            assert not tensor.any(), key
        if key.endswith("experts.down_proj"):
            std = model.config.initializer_range
            assert float(tensor.std()) == pytest.approx(std, rel=0.2), key
    logits = model(torch.zeros(1, 32, dtype=torch.long))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_what_a_family_cannot_run_is_refused_with_the_reason(family):
    """Checked by `strategy_problems` on every rank before anything is built."""
    model = wrap_known(F.make_model(family))
    problems = strategy_problems(Strategy.parse("tp=2,etp=2"), plan_for(model, None), model)
    assert any(REFUSED[family, "etp2"] in p for p in problems), problems
    for layout in ("ep2", "tp2_sp_ep2", "cp2", "pp2"):
        strategy = Strategy.parse(f"{DIMS[layout]},{B}")
        problems = strategy_problems(strategy, plan_for(model, None), model)
        if (family, layout) in REFUSED:
            assert any(REFUSED[family, layout] in p for p in problems), problems
        else:
            assert problems == [], problems


def test_engine_tune_trains_the_best_candidate_the_family_takes():
    """The cost model does not know a family's own refusals (Llama 4's temperature-tuned
    attention under cp): Engine.tune asks the model (its plan's check) and, where it refuses
    the search's pick, trains the next candidate it takes; where it refuses them all, it says
    which and how to pin the dimension away."""
    from types import SimpleNamespace

    from autosearch import Engine
    from autosearch.autotune import _first_taken
    from autosearch.core.errors import SpecError

    engine = Engine(lambda: F.make_model("llama4_text"))
    check = engine._model_check()
    cp2, dp2 = Strategy.parse("cp=2"), Strategy.parse("dp=2")
    assert any("temperature" in p for p in check(cp2)) and check(dp2) == []
    lines: list[str] = []
    result = SimpleNamespace(top_k=[SimpleNamespace(strategy=s, report=None) for s in (cp2, dp2)])
    assert _first_taken(cp2, result, check, lines.append)[0] == dp2
    assert "refuses" in lines[0] and "dp2" in lines[0]
    result.top_k = result.top_k[:1]
    with pytest.raises(SpecError, match="pin the dimension it refuses away"):
        _first_taken(cp2, result, check, lines.append)
