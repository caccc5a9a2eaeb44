"""Runtime features declared with their dimensions (autosearch/core/dimensions.py) that the
Engine lacks: the search never proposes them under the torch runtime, and a pin or a strategy
asking for one is refused naming a runtime that runs it.

- ``lora_tp`` (on tp): LoRA adapters under tensor parallelism. Megatron-Core (NeMo /
  Megatron-Bridge) splits the adapters over tp as their base linears; the Engine's peft layers
  wrap the nn.Linear its tp plan shards.
- ``etp_below_tp`` (on etp): experts split over 1 < etp < tp ranks. Megatron-Core and the
  Engine take any divisor of tp; torchtitan splits experts over all tp ranks or none."""

from __future__ import annotations

import pytest

from autosearch import Cluster
from autosearch.core import ModelSpec, RuntimeOptions, SpecError, Strategy
from cost_models import AnalyticCostModel
from search_spaces import SearchSpace

LORA = ModelSpec.load("llama3-8b", lora={"rank": 16})
S = "dp=4,tp=2,micro_batch_size=1,global_batch_size=32,sequence_parallel=true"


@pytest.mark.parametrize(
    "runtime, tps",
    [("torch", [1]), ("torchtitan", [1]), ("megatron-core", [1, 2, 4, 8]), ("nemo", [1, 2, 4, 8])],
)
def test_the_default_space_of_a_lora_model_opens_tp_where_the_runtime_runs_it(runtime, tps):
    space = SearchSpace(LORA, "h100-sxm:1x8", global_batch_size=32, runtime=runtime)
    assert sorted({lay.tp for lay in space.layouts()}) == tps
    dense = SearchSpace("llama3-8b", "h100-sxm:1x8", global_batch_size=32, runtime=runtime)
    assert sorted({lay.tp for lay in dense.layouts()}) == [1, 2, 4, 8]  # no LoRA: unchanged


def test_a_lora_strategy_under_tp_is_refused_by_a_runtime_without_lora_tp():
    s = Strategy.parse(S)
    torch_rt = RuntimeOptions.get("torch")
    assert torch_rt.unsupported(s, LORA) == {"lora_tp": "tp=2 with LoRA adapters"}
    assert torch_rt.unsupported(s) == {}  # without the model the use is not known
    assert torch_rt.unsupported(s, ModelSpec.load("llama3-8b")) == {}
    with pytest.raises(SpecError, match="cannot run tp=2 with LoRA adapters"):
        AnalyticCostModel(LORA, Cluster.parse("h100-sxm:1x8"), runtime="torch").estimate(s)
    report = AnalyticCostModel(LORA, Cluster.parse("h100-sxm:1x8"), runtime="megatron-core")
    assert report.estimate(s).step_time_s > 0


def test_a_space_pinning_tp_for_lora_is_refused_naming_a_runtime_that_runs_it():
    from search_spaces._config import runtime_problems

    space = SearchSpace(LORA, "h100-sxm:1x8", global_batch_size=32, runtime="megatron-core")
    problems = runtime_problems(
        space.plain_choices(),
        uneven_pipeline=False,
        runtime="torch",
        cluster=Cluster.parse("h100-sxm:1x8"),
        model=LORA,
    )
    assert len(problems) == 1 and problems[0].startswith("tp [2, 4, 8]: runtime 'torch'")
    assert "use --runtime megatron-core (it runs it), or keep tp to [1]" in problems[0]


def test_torchtitans_space_splits_experts_over_all_tp_ranks_or_none():
    for runtime, below in (("torch", True), ("torchtitan", False), ("megatron-core", True)):
        space = SearchSpace(
            "mixtral-8x7b", "h100-sxm:2x8", global_batch_size=64, runtime=runtime, cp=1
        )
        pairs = {(lay.tp, lay.etp) for lay in space.layouts()}
        assert {(2, 2), (8, 8)} <= pairs  # etp = tp: the Engine runs it
        assert any(1 < etp < tp for tp, etp in pairs) == below, (runtime, sorted(pairs))
    s = Strategy(dp=4, tp=4, ep=2, etp=2, global_batch_size=64)
    mixtral, cluster = ModelSpec.load("mixtral-8x7b"), Cluster.parse("h100-sxm:2x8")
    model = AnalyticCostModel(mixtral, cluster, runtime="torchtitan")
    with pytest.raises(SpecError, match="etp=2 below tp=4"):
        model.estimate(s)
