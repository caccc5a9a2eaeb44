"""Refitting correction terms from measured runs: the error drops on the fitted runs and on runs
held out of the fit, and the result folds back into a loadable profile."""

import numpy as np
import pandas as pd
import pytest

from autosearch.core.errors import SpecError
from cost_models import HardwareProfile
from cost_models.calibration import refit_corrections


def synthetic_runs(n=24, seed=0, noise=0.03):
    """Runs whose truth is: compute 1.4x slower, communication 0.7x, optimizer 1.2x, plus 20 ms per
    step. Strategy names repeat over two world sizes, as a validation sweep writes them."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        compute = rng.uniform(0.05, 0.5)
        comm = rng.uniform(0.0, 0.2) if i % 3 else 0.0
        bubble = rng.uniform(0, 0.1) if i % 4 == 0 else 0.0
        opt = rng.uniform(0.005, 0.03)
        measured = (0.02 + 1.4 * (compute + bubble) + 0.7 * comm + 1.2 * opt) * np.exp(
            rng.normal(0, noise)
        )
        rows.append(
            {
                "strategy": f"s{i // 2}",
                "world_size": 1 + i % 2,
                "dp": 1 + i % 2,
                "tp": 1,
                "pp": 1,
                "time_compute_s": compute,
                "time_recompute_s": 0.0,
                "time_tp_comm_s": 0.0,
                "time_pp_comm_s": 0.0,
                "time_dp_comm_exposed_s": comm,
                "time_bubble_s": bubble,
                "time_optimizer_s": opt,
                "time_other_s": 0.0,
                "predicted_step_time_s": compute + comm + bubble + opt,
                "measured_step_time_s": measured,
            }
        )
    return pd.DataFrame(rows)


def test_refit_reduces_error_and_reports_held_out_error():
    runs = synthetic_runs()
    r = refit_corrections(runs, holdout=0.25, seed=0)
    e = r.errors
    assert e["holdout_after"]["n"] >= 2 and e["train_after"]["n"] + e["holdout_after"]["n"] == len(
        runs
    )
    assert e["train_after"]["mape"] < 0.5 * e["train_before"]["mape"]
    assert e["holdout_after"]["mape"] < 0.5 * e["holdout_before"]["mape"]
    # The truth is recovered within what 3% noise and the weak prior allow.
    assert r.factors["compute"] == pytest.approx(1.4, rel=0.1)
    assert r.factors["optimizer"] == pytest.approx(1.2, rel=0.5)  # a small term: weakly identified
    assert r.intercept_s == pytest.approx(0.02, abs=0.02)
    # Held-out runs share no strategy with the fitted ones.
    held = set(runs.loc[list(r.holdout_index), "strategy"])
    assert held and not held & set(runs.loc[list(r.train_index), "strategy"])
    assert np.allclose(
        r.predict(runs.loc[list(r.holdout_index)]),
        r.predict(runs).take([runs.index.get_loc(i) for i in r.holdout_index]),
    )


def test_refit_with_explicit_holdout_and_unexercised_terms():
    runs = synthetic_runs(n=12, seed=1)
    runs["time_dp_comm_exposed_s"] = (
        0.0  # no communication in these runs: nothing to learn about it
    )
    runs["predicted_step_time_s"] = runs[
        ["time_compute_s", "time_bubble_s", "time_optimizer_s"]
    ].sum(axis=1)
    runs["held"] = [i >= 9 for i in range(12)]
    r = refit_corrections(runs, holdout="held")
    assert r.factors["communication"] == 1.0 and "communication" in r.unfitted
    assert r.errors["holdout_before"]["n"] == 3
    assert r.errors["holdout_after"]["mape"] < r.errors["holdout_before"]["mape"]


def test_failed_runs_are_ignored_and_bad_input_is_explained():
    runs = synthetic_runs(n=10)
    runs.loc[0, "measured_step_time_s"] = np.nan  # an OOM: no measurement
    r = refit_corrections(runs, holdout=0.2)
    assert r.errors["train_after"]["n"] + r.errors["holdout_after"]["n"] == 9
    with pytest.raises(SpecError, match="columns"):
        refit_corrections(runs.drop(columns=["measured_step_time_s"]))
    with pytest.raises(SpecError, match="training runs"):
        refit_corrections(runs.head(3), holdout=0.5)


def test_corrections_fold_into_a_loadable_profile(tmp_path):
    runs = synthetic_runs()
    r = refit_corrections(runs, seed=0)
    base = HardwareProfile.load("a100-sxm4-80gb")
    corrected = r.apply(base)
    c = r.factors["compute"]
    assert corrected.gemm.max_efficiency["bf16"] == pytest.approx(
        base.gemm.max_efficiency["bf16"] / c
    )
    assert corrected.intra_node.efficiency == pytest.approx(
        base.intra_node.efficiency / r.factors["communication"]
    )
    assert "corrections" in corrected.measured
    assert corrected.calibration["corrections"]["step_overhead_s"] == pytest.approx(r.intercept_s)
    path = tmp_path / "corrected.yaml"
    corrected.to_yaml(path)
    again = HardwareProfile.load(str(path))
    assert again.gemm.max_efficiency == corrected.gemm.max_efficiency
