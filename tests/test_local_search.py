"""The local search after the sampled trials (issue 18 item 3): its neighbourhood, that it climbs
to the exhaustive optimum where the sampled trials stop short, and that its trials are trials of
the study (stored, resumed, never scored twice)."""

from __future__ import annotations

import math

import optuna
import pytest

from autosearch import TuneConfig, tune
from autosearch.core.errors import SpecError
from autosearch.tuning._local import LayoutIndex, primes_of
from autosearch.tuning._objectives import CONSTRAINT
from autosearch.tuning._study import ATTR_LOCAL, SearchPlan, _Runner, plan_search, prepare
from search_spaces import SearchSpace

# A space of today's stacks: 5,652 layouts, far beyond the exhaustive budget.
BIG = dict(
    model="llama3-70b",
    cluster="h100-sxm:8x8",
    global_batch_size=128,
    runtime="torchtitan",
    pin={"amp": "bf16"},
)


def test_primes():
    assert primes_of(1536) == (2, 3) and primes_of(64) == (2,) and primes_of(7) == (7,)


def test_every_neighbour_is_a_layout_of_the_space_one_move_away():
    space = SearchSpace(
        "llama3-70b", "h100-sxm:8x8", global_batch_size=128, runtime="torchtitan", amp="bf16"
    )
    layouts = list(space.layouts())
    index = LayoutIndex(layouts, space.cluster.world_size)
    degrees = ("dp", "tp", "pp", "cp")
    for layout in layouts[:: max(1, len(layouts) // 60)]:
        around = index.neighbours(layout)
        assert around and layout not in around
        assert len({index.key(o) for o in around}) == len(around)  # each once
        for other in around:
            assert index.key(other) in index.by_key  # in the space
            changed = [d for d in degrees if getattr(other, d) != getattr(layout, d)]
            # a factor 2 traded between two degrees, or none (micro-batch or schedule moves)
            assert len(changed) in (0, 2), (layout, other)
            if changed:
                a, b = changed
                ratio = getattr(other, a) / getattr(layout, a)
                assert ratio in (2, 0.5) and getattr(other, b) / getattr(layout, b) == 1 / ratio


def _sampled_then_climbed(seed: int, n_trials: int):
    """A study of `n_trials` TPE trials, then the local search from its best layouts: (value
    before the climb, value after, layouts the climb scored, the runner)."""
    job = prepare(TuneConfig(**BIG, seed=seed, n_trials=n_trials, sampler="tpe"))
    runner = _Runner(
        space=job.space,
        cost_model=job.cost_model,
        objective=job.objective,
        unit=job.unit,
        shadow=optuna.create_study(direction="maximize", sampler=job.sampler),
        opened=None,
        study_name="t",
        meta=None,  # type: ignore[arg-type]
        exhaustive=False,
        margin=job.margin,
    )
    runner.start = lambda: None  # type: ignore[method-assign]
    runner.run(n_trials, progress=None)
    before = max(t.value for t in runner.all_trials() if t.constraints[CONSTRAINT] <= 0)
    new = runner.local_search()
    after = max(t.value for t in runner.all_trials() if t.constraints[CONSTRAINT] <= 0)
    return before, after, new, runner


def _optimum():
    """The exhaustive optimum of BIG's space under its margin (every layout's best)."""
    job = prepare(TuneConfig(**BIG, n_trials=1, sampler="random"))
    best = 0.0
    for s in job.space.enumerate():
        r = job.cost_model.estimate(s, validate=False)
        if r.peak_memory_bytes <= r.memory_capacity_bytes * (1 - job.margin.fraction):
            best = max(best, r.tokens_per_s)
    return best


@pytest.mark.slow
def test_the_climb_reaches_the_exhaustive_optimum_that_a_short_sampled_search_misses():
    """20 TPE trials stop short of the optimum; the climbs from their best layouts reach it,
    scoring a small part of the 5,652 layouts, each a trial of the study."""
    best = _optimum()
    before, after, new, runner = _sampled_then_climbed(seed=0, n_trials=20)
    assert before < best  # the sampled trials alone miss it
    assert after == pytest.approx(best, rel=1e-12)
    assert 0 < new == runner.local_layouts < runner.space.n_groups / 5
    assert len(runner.all_trials()) == 20 + new


def test_the_climb_scores_no_layout_twice_and_stops_at_a_local_optimum():
    _, after, new, runner = _sampled_then_climbed(seed=1, n_trials=8)
    keys = [tuple(sorted(t.params.items())) for t in runner.all_trials()]
    assert len(set(keys[8:])) == len(keys[8:])  # the climb's trials are distinct layouts
    assert not set(keys[8:]) & set(keys[:8])
    again = runner.local_search()  # from the same best layouts: every neighbour is scored
    assert again == 0


def test_the_default_plan_samples_then_climbs_and_says_so(tmp_path):
    """With no n_trials and no sampler, a space over the budget gets the sampled trials and the
    climb; the study in its storage holds both, and running it again adds nothing (no time
    budget: on a loaded machine a 10 s budget may stop the climb, and the second run goes on)."""
    config = TuneConfig(**BIG, seed=0, out=str(tmp_path / "out"), time_budget=0)
    result = tune(config)
    assert "sampled: 100 trials and a local search" in result.plan
    assert "the local search scored" in result.plan
    assert result.n_trials > 100 and result.n_units_covered == result.n_trials - _repeats(result)
    again = tune(config)
    assert again.n_new_trials == 0 and again.n_trials == result.n_trials
    assert again.best_report.tokens_per_s == result.best_report.tokens_per_s


def test_a_budget_spent_in_the_climb_keeps_what_it_scored(tmp_path):
    """The budget spent in the climb (a run resumed from the sampled trials with a budget of one
    millisecond, counted in the priced work of this run: one layout costs more): the local
    search stops after its first layout and says so; the sampled trials' best is kept."""
    small = dict(BIG, seed=0, out=str(tmp_path / "a"))
    sampled = tune(TuneConfig(**small, n_trials=100, sampler="tpe"))  # 100 TPE trials, no climb
    stopped = tune(TuneConfig(**small, time_budget=0.001))
    assert stopped.n_trials == 101 and "the local search scored 1 of them" in stopped.plan
    assert "the local search stopped at the 0.001 s time budget" in stopped.plan
    assert stopped.best_report.tokens_per_s >= sampled.best_report.tokens_per_s


def test_a_spent_budget_is_resumed_to_the_whole_climb(tmp_path):
    """Run again without a budget, a study stopped in its climb goes on to the whole climb:
    the same trials and the same best as one run without a budget."""
    small = dict(BIG, seed=0, out=str(tmp_path / "a"))
    tune(TuneConfig(**small, time_budget=0.001))
    resumed = tune(TuneConfig(**small, time_budget=0))
    whole = tune(TuneConfig(**dict(small, out=str(tmp_path / "b")), time_budget=0))
    assert "stopped" not in resumed.plan and resumed.n_new_trials > 0
    assert resumed.n_trials == whole.n_trials
    assert resumed.best_report.tokens_per_s == whole.best_report.tokens_per_s


def test_n_trials_is_the_whole_count_with_the_climb_in_it(tmp_path):
    """--n-trials N (no sampler) is the same search as the default plan, with a count for a
    budget: N/4 TPE trials, then the climbs until the study holds N. On BIG at 200 trials
    (seed 0) that is the optimum found by the climb, where the same 200 trials all sampled by
    TPE stop 5.7% short (measured; --sampler tpe still runs them). A second run asking for more
    goes on to the new count."""
    small = dict(BIG, seed=0, out=str(tmp_path / "a"))
    climbed = tune(TuneConfig(**small, n_trials=200))
    sampled = tune(TuneConfig(**dict(small, out=str(tmp_path / "b")), n_trials=200, sampler="tpe"))
    assert climbed.n_trials == sampled.n_trials == 200
    assert (
        "sampled: 50 trials and a local search" in climbed.plan
        and "200 trials in all" in climbed.plan
    )
    local = [t for t in climbed.study.trials if t.user_attrs.get(ATTR_LOCAL)]
    assert len(local) == 150 and climbed.n_units_covered == 200 - _repeats(climbed)
    assert climbed.best_report.tokens_per_s > sampled.best_report.tokens_per_s * 1.05
    more = tune(TuneConfig(**small, n_trials=260))
    assert more.n_new_trials == 60 and more.n_trials == 260
    assert more.best_report.tokens_per_s >= climbed.best_report.tokens_per_s


def test_a_count_that_covers_the_space_scores_every_layout():
    space = prepare(TuneConfig(**BIG, n_trials=1, sampler="random")).space
    plan = plan_search(space, unit="layout", multi=False, n_trials=space.n_groups)
    assert plan.exhaustive and plan.n_trials == space.n_groups and not plan.local
    plan = plan_search(space, unit="strategy", multi=False, n_trials=50)
    assert not plan.local and plan.n_trials == 50 and "no local search" in plan.reason


@pytest.mark.parametrize("bad", ["-1", "soon", "inf"])
def test_a_time_budget_is_seconds(bad):
    with pytest.raises(SpecError, match="seconds"):
        TuneConfig(**BIG, time_budget=bad)


def _repeats(result) -> int:
    """Trials of a layout another trial already holds (TPE proposes its best ones again)."""
    keys = [tuple(sorted(t.params.items())) for t in result.study.trials]
    return len(keys) - len(set(keys))


def test_a_plan_within_the_budget_is_exhaustive_and_does_not_climb():
    plan = SearchPlan(exhaustive=True, n_trials=10, estimate_s=1.0, reason="x")
    assert not plan.local
    assert math.isfinite(plan.estimate_s)


def test_climbs_start_in_every_basin_the_sampled_trials_found():
    """The 3 best layouts, then the best of other pipeline degrees: a ZeRO-3 layout without a
    pipeline and a deep pipeline are both climbed from, whichever the sampled trials rank first."""
    from autosearch.tuning._local import climb_starts

    def key(pp, mb):
        return (("dp", 64 // pp), ("tp", 1), ("pp", pp), ("micro_batch_size", mb))

    values = {key(1, 1): 10.0, key(1, 2): 9.9, key(1, 4): 9.8, key(1, 8): 9.7, key(8, 1): 9.0}
    values |= {key(2, 1): 8.0, key(4, 1): 7.0, key(16, 1): 6.0}
    starts = climb_starts(values)
    assert starts[:3] == [key(1, 1), key(1, 2), key(1, 4)]
    assert starts[3:] == [key(8, 1), key(2, 1), key(4, 1)]  # the best of 3 other pipelines


def test_a_degree_also_moves_to_its_next_value_in_the_space():
    """GPT-3's 96 layers on 384 GPUs: pp 12 -> 8 with dp x1.5 is one move (no prime of 384 takes
    12 to 8), the move that joined the climb to the optimum of that case."""
    space = SearchSpace("gpt3-175b", "a100-sxm4-80gb:48x8", global_batch_size=1536)
    layouts = list(space.layouts())
    index = LayoutIndex(layouts, space.cluster.world_size)
    start = next(
        lay
        for lay in layouts
        if (lay.dp, lay.tp, lay.pp, lay.micro_batch_size) == (8, 4, 12, 1)
        and lay.pipeline_schedule == "1f1b"
    )
    moved = {(o.dp, o.tp, o.pp) for o in index.neighbours(start)}
    assert (12, 4, 8) in moved and (16, 4, 6) in moved and (8, 8, 6) in moved
