"""Search spaces: one contract suite that every implementation passes, then SearchSpace's rules,
pins and YAML files."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import optuna
import pytest

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from search_spaces import BaseSearchSpace, ListedSpace, SearchSpace, SpaceConfig, shipped_spaces

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spaces() -> dict[str, BaseSearchSpace]:
    return {
        "tiny-llama 2x4": SearchSpace("tiny-llama", "h100-sxm:2x4", global_batch_size=16),
        "llama3-8b 8x8 megatron": SearchSpace(
            "llama3-8b", "h100-sxm:8x8", global_batch_size=256, config="megatron"
        ),
        "gpt3-1.3b 4x8 pinned": SearchSpace(
            "gpt3-1.3b",
            "a100-sxm4-80gb:4x8",
            global_batch_size=256,
            tp=[2, 4],
            recompute="selective",
            zero_stage=[0, 1],
        ),
        "listed": ListedSpace(
            "tiny-gpt",
            "h100-sxm:1x8",
            [
                Strategy(dp=8, global_batch_size=32),
                Strategy(dp=2, tp=4, global_batch_size=32, sequence_parallel=True),
                Strategy(dp=2, pp=4, micro_batch_size=2, global_batch_size=32),
                Strategy(dp=8, global_batch_size=32, zero_stage=3),
            ],
        ),
    }


SPACES = _spaces()


# ---- contract suite: every implementation -------------------------------------------------------
@pytest.fixture(params=sorted(SPACES), ids=str)
def space(request) -> BaseSearchSpace:
    return SPACES[request.param]


def test_every_enumerated_strategy_is_valid_and_unique(space):
    strategies = list(space.enumerate())
    assert len(strategies) == space.size == len(space) > 0
    assert len(set(strategies)) == len(strategies)
    for s in strategies:
        s.validate(space.model, space.cluster)
        assert s.global_batch_size == space.global_batch_size


def test_suggest_only_yields_valid_members(space):
    members = set(space.enumerate())
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(150):
        trial = study.ask()
        s = space.suggest(trial)
        assert s.problems(space.model, space.cluster) == []
        assert s in members
        study.tell(trial, 0.0)


def test_suggest_group_yields_valid_members_and_groups_partition_the_space(space):
    members = set(space.enumerate())
    seen_groups = {}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(60):
        trial = study.ask()
        group = space.suggest_group(trial)
        assert group and len(set(group)) == len(group)
        for s in group:
            assert s in members and s.problems(space.model, space.cluster) == []
            assert space.params_of(s, group=True) == space.params_of(group[0], group=True)
        seen_groups[tuple(sorted(space.params_of(group[0], group=True).items()))] = len(group)
        study.tell(trial, 0.0)
    groups: dict[tuple, int] = {}
    for s in members:
        key = tuple(sorted(space.params_of(s, group=True).items()))
        groups[key] = groups.get(key, 0) + 1
    assert len(groups) == space.n_groups
    for key, n in seen_groups.items():
        assert groups[key] == n


def test_params_of_round_trips_through_enqueue(space):
    strategies = list(space.enumerate())[:: max(1, space.size // 40)]
    study = optuna.create_study()
    for s in strategies:
        study.enqueue_trial(space.params_of(s))
        trial = study.ask()
        assert space.suggest(trial) == s
        study.tell(trial, 0.0)
    assert strategies[0] in space
    assert (
        Strategy(dp=space.cluster.world_size, global_batch_size=space.global_batch_size + 1)
        not in space
    )


def test_the_same_parameter_name_always_has_the_same_choices(space):
    """Optuna requires it of a distribution; the search must work across trials and processes."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=2))
    choices: dict[str, tuple] = {}
    for _ in range(200):
        trial = study.ask()
        space.suggest(trial)
        for name, dist in trial.distributions.items():
            assert choices.setdefault(name, dist.choices) == dist.choices
        study.tell(trial, 0.0)


# ---- SearchSpace: exactly the rules of Strategy.problems ----------------------------------------
def test_enumerate_is_exactly_the_valid_strategies_of_a_brute_force_grid():
    model, cluster, gbs = ModelSpec.load("tiny-llama"), Cluster.parse("h100-sxm:2x4"), 16
    space = SearchSpace(model, cluster, global_batch_size=gbs)
    divs = [1, 2, 4, 8]
    amps = [a for a in ("fp32", "fp16", "bf16") if a in cluster.profile.peak_flops]
    expected = set()
    # Layout first (the rules on recompute, ZeRO and amp cannot make an invalid layout valid), then
    # every recompute x ZeRO x amp of each valid layout, each checked again.
    for dp, tp, pp, mb, sched, v, sp in itertools.product(
        divs,
        divs,
        divs,
        [1, 2, 4, 8, 16],
        ["gpipe", "1f1b", "interleaved_1f1b"],
        [1, 2, 3, 4],
        [False, True],
    ):
        layout = Strategy(
            dp=dp,
            tp=tp,
            pp=pp,
            micro_batch_size=mb,
            global_batch_size=gbs,
            pipeline_schedule=sched,
            virtual_stages=v,
            sequence_parallel=sp,
        )
        if layout.problems(model, cluster) or tp > cluster.gpus_per_node:
            continue
        if pp == 1 and sched != "1f1b":  # no pipeline: the space keeps one canonical schedule
            continue
        # the Engine's default space on a CUDA GPU: op-level recompute, compile and async TP too
        recomputes = ["none", "selective", "selective_op", "full"]
        for rc, zero, amp, comp, atp in itertools.product(
            recomputes, [0, 1, 2, 3], amps, [False, True], [False, True]
        ):
            s = layout.replace(recompute=rc, zero_stage=zero, amp=amp, compile=comp, async_tp=atp)
            if not s.problems(model, cluster):
                expected.add(s)
    assert set(space.enumerate()) == expected


def test_rules_tp_divides_heads_and_stays_in_a_node():
    space = SearchSpace("gpt3-125m", "a100-sxm4-80gb:2x8", global_batch_size=64)  # 12 heads
    assert set(space.tps) == {1, 2, 4}
    assert all(s.sequence_parallel is False for s in space.enumerate() if s.tp == 1)
    wide = SearchSpace("tiny-gpt", "h100-sxm:4x2", global_batch_size=16, tp_within_node=False)
    assert 4 in wide.tps


def test_pins_narrow_every_dimension():
    space = SearchSpace(
        "llama3-8b",
        "h100-sxm:8x8",
        global_batch_size=256,
        tp=8,
        pp=[1, 2],
        micro_batch_size=1,
        recompute="full",
        sequence_parallel=True,
        zero_stage=[1],
        amp="bf16",
        pipeline_schedule=["1f1b"],
    )
    strategies = list(space.enumerate())
    assert strategies
    assert {
        (s.tp, s.micro_batch_size, s.recompute, s.sequence_parallel, s.zero_stage, s.amp)
        for s in strategies
    } == {(8, 1, "full", True, 1, "bf16")}
    assert {s.pp for s in strategies} == {1, 2}
    assert {s.pipeline_schedule for s in strategies} == {"1f1b"}


def test_paddle_alias_mp_and_yaml_file(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("mp: [2, 4]\nrecompute: no\namp: bf16\nzero_stage: [0, 1]\n")
    space = SearchSpace.from_yaml(path, "llama3-8b", "h100-sxm:2x8", global_batch_size=64)
    assert set(space.tps) == {2, 4}
    assert {s.recompute for s in space.enumerate()} == {"none"}
    assert space.config == SpaceConfig.from_yaml(path)


def test_shipped_spaces_load_and_megatron_is_narrower():
    assert {"default", "megatron"} <= set(shipped_spaces())
    full = SearchSpace("llama3-70b", "h100-sxm:32x8", global_batch_size=512)
    narrow = SearchSpace("llama3-70b", "h100-sxm:32x8", global_batch_size=512, config="megatron")
    assert 0 < narrow.size < full.size
    assert set(narrow.enumerate()) <= set(full.enumerate())


def test_user_errors_say_what_and_how():
    with pytest.raises(SpecError, match="unknown key.*'tensor_parallel'.*valid keys"):
        SearchSpace("llama3-8b", "h100-sxm:1x8", global_batch_size=64, tensor_parallel=2)
    with pytest.raises(SpecError, match="recompute value 'sometimes'"):
        SearchSpace("llama3-8b", "h100-sxm:1x8", global_batch_size=64, recompute="sometimes")
    with pytest.raises(SpecError, match="search space is empty.*global batch"):
        SearchSpace("llama3-8b", "h100-sxm:1x8", global_batch_size=3, tp=1, cp=1)
    with pytest.raises(SpecError, match="no tensor-parallel degree"):
        SearchSpace("gpt3-125m", "h100-sxm:1x8", global_batch_size=64, tp=8)
    with pytest.raises(SpecError, match="neither a YAML file nor a shipped space"):
        SearchSpace("llama3-8b", "h100-sxm:1x8", global_batch_size=64, config="no-such-space")
    with pytest.raises(SpecError, match="invalid strategies"):
        ListedSpace("llama3-8b", "h100-sxm:1x8", [Strategy(dp=3, global_batch_size=3)])


def test_importing_the_search_and_cost_model_does_not_import_torch():
    code = (
        "import sys, autosearch, cost_models, search_spaces, autosearch.tuning,"
        " autosearch.export\nfrom autosearch import tune, TuneConfig, TuneResult\n"
        "from search_spaces import SearchSpace\n"
        "SearchSpace('llama3-8b', 'h100-sxm:1x8', global_batch_size=64)\nimport"
        " autosearch.commands.tune, autosearch.commands.sweep, autosearch.commands.export\nassert"
        " 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_dimensions_of_todays_stacks_widen_the_space():
    """cp, fp8, compile, async TP and uneven pipelines are off in the default space of a runtime
    that runs none of them and widen the space when allowed, where the hardware and layout
    allow them."""
    base = SearchSpace(
        "llama3.1-405b", "h100-sxm:8x8", global_batch_size=64, runtime="megatron-sc21"
    )
    assert {s.cp for s in base.enumerate()} == {1} and all(
        s.fp8 == "none" for s in base.enumerate()
    )
    wide = SearchSpace(
        "llama3.1-405b",
        "h100-sxm:8x8",
        global_batch_size=64,
        cp=[1, 2],
        fp8=["none", "tensorwise"],
        compile="all",
        async_tp="all",
        uneven_pipeline=True,
    )
    strategies = list(wide.enumerate())
    assert len(strategies) == wide.size > base.size
    assert {s.cp for s in strategies} == {1, 2}
    assert {s.pp for s in strategies} >= {8}  # 126 layers over 8 stages: only with uneven splits
    assert 8 not in {s.pp for s in base.enumerate()}
    assert all(not s.async_tp for s in strategies if s.tp == 1)
    model, cluster = wide.model, wide.cluster
    for s in strategies[:: max(1, len(strategies) // 500)]:
        assert s.problems(model, cluster) == [], s.short()
        assert wide.params_of(s, group=True) is not None
    # no fp8 units on an A100: the axis collapses to "none"
    a100 = SearchSpace("llama3-8b", "a100-sxm4-80gb:1x8", global_batch_size=16, fp8="all")
    assert {s.fp8 for s in a100.enumerate()} == {"none"}


# ---- the default space of a runtime -------------------------------------------------------------
def _opened(runtime, model="llama3-70b", cluster="h100-sxm:32x8", **kw):
    config, notes = SpaceConfig.default().resolved(
        runtime=runtime, model=ModelSpec.load(model), cluster=Cluster.parse(cluster), **kw
    )
    return config, {n.name: n for n in notes}


def test_the_default_space_opens_what_the_runtime_supports_and_says_why():
    """Every dimension a runtime may lack is read from the runtime's `supports`: torchtitan
    (cp, compile, async TP, op-level recompute, uneven splits) opens them, Megatron-LM 2021
    (none) keeps them closed, and each says why in one line."""
    from autosearch.core.runtime import RUNTIMES

    tt, why = _opened("torchtitan")
    assert tt.cp is None  # every degree the rules allow: llama3-70b trains at 8,192 tokens
    assert tt.recompute == ("none", "selective", "selective_op", "full")
    assert tt.compile == (False, True) and tt.async_tp == (False, True)
    assert tt.uneven_pipeline is True and tt.fp8 == ("none",)
    assert "8,192 >= 8,192" in why["cp"].why
    assert "changes" in why["fp8"].why or "numerics" in why["fp8"].why
    old, why = _opened("megatron-sc21")
    assert old.cp == (1,) and old.compile == (False,) and old.async_tp == (False,)
    assert old.recompute == ("none", "selective", "full") and old.uneven_pipeline is False
    assert "does not run cp=2" in why["cp"].why
    # the torch preset: whatever it lists today, the space follows it
    torch, _ = _opened("torch")
    supports = RUNTIMES["torch"].supports
    assert (torch.compile == (False, True)) == ("compile" in supports)
    assert (torch.cp is None) == ("cp" in supports)
    assert torch.uneven_pipeline == ("uneven_pp" in supports)


def test_context_parallel_opens_only_for_long_sequences_and_fp8_only_when_asked():
    short, why = _opened("torchtitan", model="llama2-70b")  # 4,096 tokens
    assert short.cp == (1,) and "4,096 < 8,192" in why["cp"].why
    h100, why = _opened("torchtitan", fp8=True)
    assert h100.fp8 == ("none", "tensorwise", "rowwise") and "--fp8" in why["fp8"].why
    # a runtime that runs fp8 on an A100 still gets no fp8 strategy: the rules drop it
    a100 = SearchSpace(
        "llama3-8b",
        "a100-sxm4-80gb:1x8",
        global_batch_size=16,
        config=_opened("torchtitan", model="llama3-8b", cluster="a100-sxm4-80gb:1x8", fp8=True)[0],
    )
    assert {s.fp8 for s in a100.enumerate()} == {"none"}


def test_supported_is_refused_where_no_runtime_can_lack_the_dimension():
    with pytest.raises(SpecError, match="'supported' is only for"):
        SpaceConfig(pp="supported")  # tp may be lacked: LoRA under tp (lora_tp)
    assert SpaceConfig(compile="Supported").compile == "supported"


def test_a_space_that_asks_what_the_runtime_cannot_run_is_refused_with_a_runtime_that_can():
    from search_spaces._config import runtime_problems

    space = SearchSpace(
        "llama3-70b", "h100-sxm:32x8", global_batch_size=512, cp=[1, 2], compile="all"
    )
    choices, cluster = space.plain_choices(), space.cluster
    problems = runtime_problems(
        choices, uneven_pipeline=False, runtime="megatron-sc21", cluster=cluster
    )
    # the torch preset's default space opens op-level recompute and async TP on H100 too
    assert [p.split(" ")[0] for p in problems] == ["cp", "recompute", "compile", "async_tp"]
    assert problems[0].startswith("cp [2]: runtime 'megatron-sc21' does not run cp=2")
    assert "use --runtime" in problems[0] and "keep cp to [1]" in problems[0]
    assert problems[2].startswith("compile [true]")
    assert (
        runtime_problems(
            space.plain_choices(),
            uneven_pipeline=True,
            runtime="torchtitan",
            cluster=space.cluster,
        )
        == []
    )
