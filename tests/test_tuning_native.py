"""The stored study is Optuna-native: plain parameter names, importances that agree with
optuna-dashboard, one tie rule, no twins among the picks."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
from report_tables import read_csv, table

from autosearch import Strategy, tune
from autosearch.core.hardware import Cluster
from autosearch.core.model_spec import ModelSpec
from autosearch.tuning import load_study, read_candidates
from autosearch.tuning._objectives import Throughput
from autosearch.tuning._outputs import dashboard_importances
from autosearch.tuning._params import SAMPLER_ATTR, PlainParams, for_sampler, plain_value
from autosearch.tuning._ranking import REL_TIE
from cost_models import AnalyticCostModel
from search_spaces import SearchSpace

SMALL = dict(model="llama3-8b", cluster="h100-sxm:2x8", global_batch_size=64)
# The dimensions that vary in SMALL's default space: the Engine's on an H100 (llama3-8b's 8K
# sequence opens cp; fp8 is opt-in; ep and etp are a MoE model's).
SMALL_DIMS = {
    "cp",
    "compile",
    "async_tp",
    "dp",
    "tp",
    "pp",
    "micro_batch_size",
    "pipeline",
    "recompute",
    "sequence_parallel",
    "zero_stage",
    "amp",
}


# ---- plain parameter names ----------------------------------------------------------------------
@pytest.mark.parametrize("unit", ["layout", "strategy"])
def test_stored_trials_carry_the_strategy_under_plain_names(tmp_path, unit):
    out = tmp_path / "run"
    tune(**SMALL, n_trials=30, seed=0, out=out, trial_unit=unit)
    tune(**SMALL, n_trials=45, seed=1, out=out, trial_unit=unit)  # resumed: same distributions
    study = load_study(out).study
    trials = study.get_trials(deepcopy=False)
    space = SearchSpace(SMALL["model"], SMALL["cluster"], global_batch_size=64)
    plain = PlainParams(space)
    assert set(plain.distributions) == SMALL_DIMS and len(trials) == 45
    for t in trials:
        s = Strategy.from_dict(t.user_attrs["strategy"])
        assert t.params == {name: plain_value(s, name) for name in SMALL_DIMS}
        assert t.params["pipeline"] == "1f1b" or s.pp > 1
        # one distribution per name, the same in every trial: the union the space can take
        assert t.distributions == plain.distributions
        # the sampler's own (keyed) names travel with the trial and rebuild the shadow
        keyed = t.system_attrs[SAMPLER_ATTR]["params"]
        assert keyed == space.params_of(s, group=unit == "layout")
        assert for_sampler(t).params == keyed and not any("[" in k for k in t.params)
    assert plain.distributions["tp"].choices == (1, 2, 4, 8)
    assert plain.distributions["amp"].choices == ("bf16", "fp16", "fp32")
    frame = study.trials_dataframe()
    assert {f"params_{d}" for d in SMALL_DIMS} <= set(frame.columns)


def test_plain_choices_of_the_tree_equal_those_of_the_enumeration():
    space = SearchSpace(
        "llama3-8b", "h100-sxm:1x8", global_batch_size=32, config="megatron", amp="bf16"
    )
    choices = space.plain_choices()
    seen: dict[str, set] = {name: set() for name in choices}
    for s in space.enumerate():
        for name in choices:
            seen[name].add(plain_value(s, name))
    assert {k: set(v) for k, v in choices.items()} == seen
    assert all(len(v) == len(set(v)) for v in choices.values())  # no value twice


# ---- importances as optuna-dashboard computes them ---------------------------------------------
@pytest.mark.filterwarnings("ignore:PedAnovaImportanceEvaluator computes")
@pytest.mark.parametrize("objective", ["throughput", "throughput-memory"])
def test_report_importances_equal_get_param_importances_on_the_stored_study(tmp_path, objective):
    out = tmp_path / "run"
    tune(**SMALL, n_trials=60, seed=0, out=out, objective=objective)
    study = load_study(out).study
    expected = []
    for i, direction in enumerate(study.directions):
        sign = -1.0 if direction == optuna.study.StudyDirection.MAXIMIZE else 1.0
        expected.append(
            optuna.importance.get_param_importances(
                study,
                evaluator=optuna.importance.PedAnovaImportanceEvaluator(),
                target=lambda t, i=i, sign=sign: sign * t.values[i],
            )
        )
    assert set(expected[0]) == SMALL_DIMS
    report = (out / "report.md").read_text()
    rows = table(report, "## What matters")
    assert {r[0] for r in rows} == set(expected[0])
    for name, *printed in rows:
        for col, imp in zip(printed, expected):
            # printed with 4 decimals: equal to within half a unit of the last digit
            assert float(col) == pytest.approx(imp[name], abs=5e-5 + 1e-12)
    assert "importances.png" in report and (out / "importances.png").stat().st_size > 1000
    # the same figures from the snapshot the outputs were written from, to the last bit
    mine = dashboard_importances(study.get_trials(), list(study.directions))
    for a, b in zip(mine, expected):
        assert set(a) == set(b) and all(a[k] == pytest.approx(b[k], rel=1e-12) for k in a)


def test_report_importances_equal_optuna_dashboards_own_function(tmp_path):
    dash = pytest.importorskip(
        "optuna_dashboard._importance",
        reason="optuna-dashboard is not installed (pip install -e '.[dashboard]')",
    )
    from optuna_dashboard._inmemory_cache import InMemoryCache

    out = tmp_path / "run"
    tune(**SMALL, n_trials=40, seed=0, out=out)
    loaded = load_study(out)
    storage = loaded.storage.storage
    study_id = storage.get_study_id_from_name(loaded.study.study_name)
    trials = storage.get_all_trials(study_id)
    shown = dash.get_param_importance_from_trials_cache(
        InMemoryCache(), storage, study_id, 0, trials
    )
    by_name = {row["name"]: row["importance"] for row in shown}
    assert set(by_name) == SMALL_DIMS
    assert all(row["distribution"] == "CategoricalDistribution" for row in shown)
    printed = {r[0]: float(r[1]) for r in table((out / "report.md").read_text(), "## What matt")}
    assert printed == pytest.approx(by_name, abs=5e-5 + 1e-12)


# ---- ties and twins ----------------------------------------------------------------------------
def _trial(number_value: float, strategy: Strategy, report: dict) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(
        value=number_value,
        user_attrs={"strategy": strategy.to_dict(), "report": report},
    )


def test_ties_go_to_less_memory_then_bf16_then_fewer_axes_then_the_earlier_trial():
    cm = AnalyticCostModel(ModelSpec.load("llama3-8b"), Cluster.parse("h100-sxm:2x8"))
    # ZeRO-3: with the torch preset's allocator reserve (issue 18) ZeRO-2 needs 80.8 of 80 GiB
    base = Strategy(dp=16, micro_batch_size=1, global_batch_size=64, zero_stage=3)
    report = cm.estimate(base).to_dict(flat=False)
    assert report["fits"]

    def with_memory(gib):
        return {**report, "peak_memory_bytes": gib * 2**30}

    fp16 = dataclasses.replace(base, amp="fp16")
    two_axes = Strategy(dp=8, tp=2, micro_batch_size=1, global_batch_size=64)
    hungry = dataclasses.replace(base, zero_stage=1)
    slower = dataclasses.replace(base, recompute="full")
    v = 1e5
    trials = [
        _trial(v, hungry, with_memory(40)),  # 0: a tie, more memory
        _trial(v, fp16, with_memory(30)),  # 1: a tie, fp16
        _trial(v, two_axes, with_memory(30)),  # 2: a tie, bf16, two parallel axes
        _trial(v * (1 + REL_TIE / 10), base, with_memory(30)),  # 3: the tie's winner
        _trial(v, base, with_memory(30)),  # 4: its twin, a later trial
        _trial(v * (1 - 1e-9), slower, with_memory(10)),  # 5: slower (not a tie), less memory
    ]
    for i, t in enumerate(trials):
        t.number = i
    ranked = read_candidates(trials, top_k=None)
    assert [c.strategy for c in ranked] == [base, two_axes, fp16, hungry, slower]
    assert ranked[0].trial_number == 3  # twins: listed once
    # The same rule picks inside a layout trial (bf16 over fp16, whatever the order).
    r = cm.estimate(base)
    r16 = cm.estimate(fp16)
    assert r.tokens_per_s == pytest.approx(r16.tokens_per_s, rel=REL_TIE)
    objective = Throughput()
    assert objective.better(r, r16, base, fp16) and not objective.better(r16, r, fp16, base)


def test_top_k_csv_lists_each_strategy_once_in_the_rule_order(tmp_path):
    out = tmp_path / "run"
    # 48 strategies drawn 120 times with replacement: twins are certain
    pins = {
        "tp": 8,
        "pp": 1,
        "micro_batch_size": [1, 2],
        "zero_stage": [0, 1],
        "amp": ["bf16", "fp16"],
        "recompute": ["none", "selective", "full"],
        "cp": 1,
        "compile": False,
        "async_tp": False,
    }
    space = SearchSpace(SMALL["model"], SMALL["cluster"], global_batch_size=64, **pins)
    assert space.size < 60
    result = tune(
        **SMALL,
        space=pins,
        sampler="random",
        trial_unit="strategy",
        n_trials=120,
        seed=0,
        top_k=6,
        out=out,
        use_recipes=False,
    )
    trials = read_csv(out / "trials.csv")
    assert len({r["strategy"] for r in trials}) < len(trials)  # twins were scored
    top = read_csv(out / "top_k.csv")
    assert len(top) == 6 and len({r["strategy"] for r in top}) == 6
    # the rule, applied by hand to trials.csv: first trial of each strategy, value, then memory,
    # amp, axes, trial
    first: dict[str, dict] = {}
    for r in trials:
        if r["feasible"] == "True":
            first.setdefault(r["strategy"], r)
    amp_rank = {"bf16": 0, "fp16": 1, "fp32": 2}
    by_hand = sorted(
        first.values(),
        key=lambda r: (
            -round(float(r["objective_tokens_per_s"]), 3),
            float(r["peak_memory_bytes"]),
            amp_rank[r["amp"]],
            sum(int(r[d]) > 1 for d in ("dp", "tp", "pp", "cp")),
            int(r["trial"]),
        ),
    )
    assert [(r["strategy"], r["trial"]) for r in by_hand[:6]] == [
        (r["strategy"], r["trial"]) for r in top
    ]
    assert result.best_strategy.short() == top[0]["strategy"]
    report = (out / "report.md").read_text()
    assert [row[1] for row in table(report, "## Top 6")] == [r["strategy"] for r in top]
    assert f"`{top[0]['strategy']}`" in report[report.index("## Best") :]
