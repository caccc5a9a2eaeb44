"""LoRA under tensor parallelism is a runtime feature (``lora_tp``, declared on the tp dimension
in autosearch/core/dimensions.py): Megatron-Core (NeMo / Megatron-Bridge) splits the adapters
over tp as their base linears; the Engine's peft layers wrap the nn.Linear its tp plan shards,
so the torch preset lacks it. The search never proposes what the runtime lacks, and a pin or a
strategy asking for it is refused naming a runtime that runs it."""

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
