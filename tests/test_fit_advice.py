"""Issue 30: answers a planner can act on when a strategy does not fit.

`autosearch estimate` exits 1 for a strategy that does not fit and names the least change that
makes it fit (every suggestion is estimated again here and fits); `autosearch tune` says when
nothing fits from a floor on memory without scanning the space, and names the smallest cluster
on which the least memory-hungry strategy fits (one node fewer does not). The numbers compared
are the cost model's own, so they agree to float rounding: the printed GiB to the 0.05 GiB of
one decimal place.
"""

import dataclasses
import json

import pytest
import yaml

from autosearch import Cluster, ModelSpec, Strategy, TuneConfig
from autosearch.cli import main
from autosearch.tuning import NoFeasibleStrategyError
from autosearch.tuning._advice import (
    FitAdvice,
    fit_advice,
    least_memory,
    memory_floor_bytes,
    memory_moves,
    nearby_fixes,
    no_fit_message,
    smallest_cluster,
    strategy_text,
)
from autosearch.tuning._estimate import EstimateConfig
from autosearch.tuning._margin import MemoryMargin, memory_margin
from autosearch.tuning._study import tune
from cost_models import AnalyticCostModel
from search_spaces import SearchSpace, SpaceConfig

GiB = float(1 << 30)
MARGIN = 0.1  # a round margin, so the tests do not move with cost_models/memory_bands.yaml
# 405B on one node: nothing fits (issue 30 item 4)
BIG = dict(model="llama3.1-405b", cluster="h100-sxm:1x8", global_batch_size=32)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _estimate(model, cluster, strategy, *, runtime=None):
    cm = AnalyticCostModel(ModelSpec.load(model), Cluster.parse(cluster), runtime=runtime)
    r = cm.estimate(Strategy.parse(strategy) if isinstance(strategy, str) else strategy)
    return cm, r.with_margin(MARGIN * r.memory_capacity_bytes)


# ---- estimate: the exit status and the least change -------------------------------------------
def test_estimate_exits_1_when_it_does_not_fit_and_0_when_it_does(capsys):
    base = ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8"]
    base += ["--global-batch-size", "64", "--memory-margin", str(MARGIN)]
    code, out, err = run(capsys, *base, "--strategy", "dp=8")
    assert code == 1 and err == "" and "DOES NOT FIT" in out
    assert "does not fit: 228.2 GiB of 72.0 GiB usable; fits with" in out
    code, out, _ = run(capsys, *base, "--strategy", "dp=8,zero_stage=3,recompute=full")
    assert code == 0 and "does not fit" not in out
    code, out, _ = run(capsys, *base, "--strategy", "dp=8", "--json")
    data = json.loads(out)
    assert code == 1 and data["report"]["fits"] is False and data["fits_with"]
    code, out, _ = run(capsys, *base, "--strategy", "dp=8,zero_stage=3,recompute=full", "--json")
    assert code == 0 and "fits_with" not in json.loads(out)


@pytest.mark.parametrize(
    "model,cluster,strategy",
    [
        ("llama3-8b", "h100-sxm:1x8", "dp=8,global_batch_size=64"),
        ("llama3-70b", "h100-sxm:8x8", "dp=64,global_batch_size=512"),
        ("llama3-70b", "h100-sxm:8x8", "dp=8,tp=8,micro_batch_size=4,global_batch_size=512"),
    ],
)
def test_every_suggestion_fits_when_estimated_again(capsys, model, cluster, strategy):
    argv = ["estimate", "--model", model, "--cluster", cluster, "--strategy", strategy]
    argv += ["--memory-margin", str(MARGIN), "--json"]
    code, out, _ = run(capsys, *argv)
    data = json.loads(out)
    assert code == 1 and 1 <= len(data["fits_with"]) <= 3
    speeds = [f["tokens_per_s"] for f in data["fits_with"]]
    assert speeds == sorted(speeds, reverse=True)  # the fastest first
    asked = data["report"]["tokens_per_s"]
    for fix in data["fits_with"]:
        again = ["estimate", "--model", model, "--cluster", cluster, "--strategy"]
        code, text, _ = run(capsys, *again, fix["strategy"], "--memory-margin", str(MARGIN))
        assert code == 0 and "  fits" in text, fix
        _, r = _estimate(model, cluster, fix["strategy"])
        assert r.fits and r.peak_memory_bytes == pytest.approx(fix["peak_memory_bytes"])
        assert fix["tokens_per_s_vs_asked"] == pytest.approx(fix["tokens_per_s"] / asked - 1)
        # the changes are what differs from the asked strategy, and nothing else
        changed = Strategy.parse(strategy).replace(**fix["changes"])
        assert changed == Strategy.parse(fix["strategy"])


def test_a_single_change_comes_before_pairs():
    """llama3-8b dp=8 on one node: one change fits (dp=1,tp=8: the same devices as tp), so no
    pair is offered; llama3-70b dp=64 on 8 nodes: no single change fits (each is estimated
    here), so the suggestions are pairs."""
    cm, _ = _estimate("llama3-8b", "h100-sxm:1x8", "dp=8,global_batch_size=64")
    fixes = nearby_fixes(cm, Strategy.parse("dp=8,global_batch_size=64"), margin_fraction=MARGIN)
    assert fixes and all(
        set(f.changes) - {"dp"} in ({"tp"}, {"pp"}, {"cp"})
        or len(set(f.changes) - {"dp", "pipeline_split"}) == 1
        for f in fixes
    )
    asked = Strategy.parse("dp=64,global_batch_size=512")
    cm, _ = _estimate("llama3-70b", "h100-sxm:8x8", asked)
    for move in memory_moves(asked):
        try:
            r = cm.estimate(asked.replace(**move))
        except ValueError:  # a rule of the model or the cluster
            continue
        assert not r.with_margin(MARGIN * r.memory_capacity_bytes).fits, move
    fixes = nearby_fixes(cm, asked, margin_fraction=MARGIN)
    assert fixes and all(len(f.changes) >= 2 for f in fixes)
    assert fixes[0].label() == "recompute=full,zero_stage=3"


def test_the_printed_line_names_the_change_its_memory_and_speed(capsys):
    argv = ["estimate", "--model", "llama3-70b", "--cluster", "h100-sxm:8x8"]
    argv += ["--strategy", "dp=64,global_batch_size=512", "--memory-margin", str(MARGIN)]
    code, out, _ = run(capsys, *argv)
    line = next(x for x in out.splitlines() if x.startswith("does not fit"))
    assert line.startswith("does not fit: 1,651.0 GiB of 72.0 GiB usable; fits with ")
    assert "recompute=full,zero_stage=3 (" in line and "tokens/s" in line and "vs asked)" in line
    pastes = [x for x in out.splitlines() if x.startswith('  --strategy "')]
    assert pastes and pastes[0] == (
        '  --strategy "dp=64,tp=1,pp=1,global_batch_size=512,recompute=full,zero_stage=3"'
    )


def test_when_nothing_nearby_fits_it_names_the_smallest_cluster(capsys):
    argv = ["estimate", "--model", "llama3.1-405b", "--cluster", "h100-sxm:1x8"]
    argv += ["--strategy", "dp=8,global_batch_size=32", "--memory-margin", str(MARGIN)]
    code, out, _ = run(capsys, *argv, "--json")
    data = json.loads(out)
    assert code == 1 and data["fits_with"] == []
    found = data["smallest_cluster"]
    cm, r = _estimate("llama3.1-405b", found["cluster"], found["strategy"])
    assert r.fits and r.peak_memory_bytes == pytest.approx(found["peak_memory_bytes"])
    code, out, _ = run(capsys, *argv)
    assert code == 1 and f"--cluster {found['cluster']} --strategy" in out


def test_strategy_text_reads_back():
    for text in (
        "dp=8,global_batch_size=64",
        "dp=2,tp=2,pp=2,micro_batch_size=2,global_batch_size=64,recompute=full,"
        "sequence_parallel=true,zero_stage=1,pipeline_split=3/5",
        "dp=4,pp=2,global_batch_size=64,pipeline_schedule=interleaved_1f1b,virtual_stages=2,"
        "compile=true,amp=fp16",
    ):
        s = Strategy.parse(text)
        assert Strategy.parse(strategy_text(s)) == s


# ---- the floor and the least memory-hungry strategy --------------------------------------------
# (model, cluster, global batch, runtime, lora, how close the lean narrowing comes to the least
# peak of the whole space): every strategy of the default space is estimated. The lean space
# assumes ZeRO-3 holds the least; for tiny-gpt (2.5 GB, most of it the device's reserve) the
# least is a pipeline without ZeRO, and ZeRO-3's two gathered layers cost 0.37 MB more
# (1.5e-4 of its peak): 1e-3 covers it. The others are the least exactly (float sums: 1e-12).
CONTRACT = [
    ("llama3-8b", "h100-sxm:1x8", 16, "megatron-core", None, 1e-12),
    ("llama3-8b", "a100-sxm4-40gb:1x4", 8, "deepspeed", None, 1e-12),
    ("llama3-8b", "h100-sxm:1x8", 4, None, None, 1e-12),
    ("llama3-8b", "h100-sxm:1x8", 16, None, {"rank": 16}, 1e-12),
    ("tiny-gpt", "h100-sxm:1x8", 16, None, None, 1e-3),
    ("mixtral-8x7b", "h100-sxm:1x4", 4, "megatron-core", None, 1e-12),
]


@pytest.mark.parametrize("model,cluster,gbs,runtime,lora,rel", CONTRACT)
def test_the_floor_is_below_every_strategy_and_lean_finds_the_least(
    model, cluster, gbs, runtime, lora, rel
):
    """The floor never refuses a strategy that fits: it is at most the peak of every strategy
    of the space (no tolerance: a floor), and the lean narrowing finds the least peak of the
    whole space (to `rel`)."""
    m, c = ModelSpec.load(model, lora=lora), Cluster.parse(cluster)
    config, _ = SpaceConfig.default().resolved(runtime=runtime, model=m, cluster=c)
    cm = AnalyticCostModel(m, c, runtime=runtime)
    floor = memory_floor_bytes(m, c, cm.runtime)
    least = min(
        cm.estimate(s, validate=False).peak_memory_bytes
        for s in SearchSpace(m, c, global_batch_size=gbs, config=config).enumerate()
    )
    assert floor <= least
    lean = least_memory(m, c, gbs, config=config, cost_model=cm, margin_fraction=MARGIN)
    assert lean is not None and lean[1].peak_memory_bytes == pytest.approx(least, rel=rel)


def test_the_smallest_cluster_is_the_smallest():
    """llama3.1-405b at global batch 32: the least memory-hungry strategy fits on 16 nodes of 8
    H100s and not on 15 (nor on fewer: the floor is above the usable memory up to 11 nodes,
    and the lean space of 12-15 nodes holds none that fits); the strategy named is the fastest
    of the lean space that fits there, and it fits when estimated again."""
    m, c = ModelSpec.load("llama3.1-405b"), Cluster.parse("h100-sxm:1x8")
    config, _ = SpaceConfig.default().resolved(runtime=None, model=m, cluster=c)
    fit = smallest_cluster(m, c, 32, config=config, runtime=None, margin_fraction=MARGIN)
    assert fit is not None and fit.cluster.name == "h100-sxm:16x8"
    _, r = _estimate(m, fit.cluster, fit.strategy)
    assert r.fits and r.peak_memory_bytes == pytest.approx(fit.report.peak_memory_bytes)
    usable = (1 - MARGIN) * c.profile.memory_capacity_bytes
    for n in range(1, 16):
        fewer = dataclasses.replace(c, n_nodes=n)
        lean = least_memory(
            m,
            fewer,
            32,
            config=config,
            cost_model=AnalyticCostModel(m, fewer),
            margin_fraction=MARGIN,
        )
        assert memory_floor_bytes(m, fewer) > usable or lean is None or not lean[1].fits, n


def test_a_cluster_where_it_fits_already_is_the_answer():
    m, c = ModelSpec.load("llama3-8b"), Cluster.parse("h100-sxm:1x8")
    config, _ = SpaceConfig.default().resolved(runtime=None, model=m, cluster=c)
    fit = smallest_cluster(m, c, 16, config=config, runtime=None, margin_fraction=MARGIN)
    assert fit is not None and fit.cluster == c


# ---- tune: nothing fits -----------------------------------------------------------------------
# offload to host memory kept off: the floor and the smallest cluster of the space without it
# (with it: tests/test_offload.py)
NO_OFFLOAD = {"offload_optimizer": False, "offload_params": False, "offload_activations": "none"}


def test_tune_says_nothing_fits_with_the_smallest_cluster():
    with pytest.raises(NoFeasibleStrategyError) as exc:
        tune(TuneConfig(**BIG, memory_margin=MARGIN, pin=NO_OFFLOAD))
    text = str(exc.value)
    assert "no strategy fits in memory" in text and "Any strategy needs at least" in text
    assert "needs 16 nodes (on h100-sxm:15x8 it does not fit): on h100-sxm:16x8 (128" in text
    # the least memory-hungry strategy already uses ZeRO-3 and full recompute: not advised
    assert "zero_stage 3" not in text and "recompute full" not in text
    assert "-z3-" in text and "-rc-full-" in text


def test_a_space_without_zero3_is_told_to_widen():
    with pytest.raises(NoFeasibleStrategyError) as exc:
        tune(TuneConfig(**BIG, memory_margin=MARGIN, pin={"zero_stage": [0, 1]}))
    assert "widen the space (zero_stage 3)" in str(exc.value)


def _space(**kw):
    m, c = ModelSpec.load(kw["model"]), Cluster.parse(kw["cluster"])
    return SearchSpace(m, c, global_batch_size=kw["global_batch_size"])


def test_when_the_floor_proves_it_no_strategy_of_the_space_is_scanned(monkeypatch):
    space = _space(**BIG)
    cm = AnalyticCostModel(space.model, space.cluster)

    def scanned():
        raise AssertionError("the floor proves that nothing fits: no scan")

    monkeypatch.setattr(space, "enumerate", scanned)
    text = no_fit_message(space, cm, MemoryMargin(MARGIN, "test"), n_trials=3, least_hungry=None)
    assert text.startswith("no strategy fits in memory")


def test_a_space_where_something_fits_asks_for_more_trials():
    space = _space(model="llama3-8b", cluster="h100-sxm:1x8", global_batch_size=16)
    cm = AnalyticCostModel(space.model, space.cluster)
    text = no_fit_message(space, cm, MemoryMargin(MARGIN, "test"), n_trials=3, least_hungry=None)
    assert "run more trials" in text and "no strategy fits" not in text


def test_below_the_floor_a_scan_decides():
    """Above the floor but nothing fits (a margin that leaves less than the least peak of the
    space): the scan of every strategy says it, naming how many it scanned."""
    space = _space(model="llama3-8b", cluster="h100-sxm:1x8", global_batch_size=4)
    cm = AnalyticCostModel(space.model, space.cluster)
    least = min(cm.estimate(s, validate=False).peak_memory_bytes for s in space.enumerate())
    floor = memory_floor_bytes(space.model, space.cluster)
    capacity = space.cluster.profile.memory_capacity_bytes
    fraction = 1 - (floor + least) / 2 / capacity  # usable between the floor and the least
    text = no_fit_message(space, cm, MemoryMargin(fraction, "test"), n_trials=3, least_hungry=None)
    assert text.startswith("no strategy fits") and f"of all {space.size:,} in the space" in text
    assert "Any strategy needs at least" not in text  # the floor did not prove it


# ---- the settings of estimate, from one schema -------------------------------------------------
def test_estimate_settings_share_tune_s_help_and_checks():
    ours = {f.name: f.metadata["setting"] for f in dataclasses.fields(EstimateConfig)}
    theirs = {f.name: f.metadata["setting"] for f in dataclasses.fields(TuneConfig)}
    for name in (
        "model",
        "cluster",
        "nnodes",
        "gpus_per_node",
        "seq_len",
        "lora_rank",
        "lora_targets",
        "runtime",
        "memory_margin",
    ):
        assert ours[name] is theirs[name], name


def test_estimate_reads_a_config_file_and_flags_override_it(capsys, tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": "llama3-8b",
                "cluster": "h100-sxm:1x8",
                "strategy": "dp=8,zero_stage=3,recompute=full",
                "global-batch-size": 64,
                "memory_margin": MARGIN,
                "json": True,
            }
        )
    )
    code, out, _ = run(capsys, "estimate", "--config", str(path))
    argv = ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--json"]
    argv += ["--strategy", "dp=8,zero_stage=3,recompute=full", "--global-batch-size", "64"]
    code2, out2, _ = run(capsys, *argv, "--memory-margin", str(MARGIN))
    assert code == code2 == 0 and json.loads(out) == json.loads(out2)
    code, out, _ = run(capsys, "estimate", "--config", str(path), "--strategy", "dp=8")
    assert code == 1 and json.loads(out)["strategy"]["zero_stage"] == 0
    path.write_text("model: llama3-8b\ncluster: h100-sxm:1x8\nstrateg: dp=8\n")
    code, _, err = run(capsys, "estimate", "--config", str(path))
    assert code == 2 and "unknown key 'strateg'" in err and "did you mean 'strategy'" in err
    code, _, err = run(capsys, "estimate", "--cluster", "h100-sxm:1x8")
    assert code == 2 and "estimate needs --model, --strategy" in err


def test_fit_advice_to_dict_has_the_same_suggestions_as_the_text():
    cm, r = _estimate("llama3-8b", "h100-sxm:1x8", "dp=8,global_batch_size=64")
    advice = fit_advice(cm, Strategy.parse("dp=8,global_batch_size=64"), r, margin_fraction=MARGIN)
    assert isinstance(advice, FitAdvice)
    text, data = advice.describe(), advice.to_dict()
    assert [f'  --strategy "{f["strategy"]}"' for f in data["fits_with"]] == [
        line for line in text.splitlines() if line.startswith("  --strategy")
    ]
    assert data["smallest_cluster"] is None  # not looked for: a nearby change fits
    assert memory_margin(None, cm.cluster, override=MARGIN).fraction == MARGIN


def test_when_more_nodes_cannot_help_the_search_for_a_cluster_stops():
    """llama3-8b on sequences of 131,072 tokens with tp, pp and cp pinned to 1: only dp grows
    with the nodes, and the global batch of 8 bounds it by 8, so two nodes already hold no
    layout; the doubling stops there (None) instead of going on to the largest cluster."""
    m, c = ModelSpec.load("llama3-8b", seq_len=131072), Cluster.parse("h100-sxm:1x8")
    config, _ = SpaceConfig.default().resolved(runtime=None, model=m, cluster=c)
    config = config.narrowed(tp=1, pp=1, cp=1)
    assert not least_memory(
        m, c, 8, config=config, cost_model=AnalyticCostModel(m, c), margin_fraction=MARGIN
    )[1].fits
    assert smallest_cluster(m, c, 8, config=config, runtime=None, margin_fraction=MARGIN) is None
