"""Error bands (autosearch/core/bands.py): split-conformal intervals by kind of run."""

from __future__ import annotations

import math
import random

import pytest

from autosearch import estimate
from autosearch.core import CostReport
from autosearch.core.bands import MIN_RUNS, ErrorBands, conformal_band, key_of


def test_conformal_band_covers_new_runs_at_the_stated_rate():
    """Split conformal (Lei et al. 2018): an interval from n calibration ratios covers a new
    exchangeable ratio with probability >= 90%. Checked by simulation: 2,000 draws of 30
    calibration runs and one new run each; the observed rate must be within 3 standard errors
    (sqrt(0.9 * 0.1 / 2000) = 0.7%) of at least 90%."""
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        ratios = [math.exp(rng.gauss(0.1, 0.15)) for _ in range(30)]
        low, high = conformal_band(ratios)
        hits += low <= math.exp(rng.gauss(0.1, 0.15)) <= high
    assert hits / 2000 >= 0.90 - 3 * 0.0067


def test_few_runs_fall_back_to_a_coarser_kind_and_none_is_an_extrapolation():
    kind = {
        "runtime": "r",
        "hardware": "h",
        "axes": "dp",
        "zero": "3",
        "recompute": "none",
        "precision": "bf16",
        "scale": "<=8",
    }
    bands = ErrorBands(
        {
            key_of(kind, 0): (0.5, 2.0, 2),  # too few runs
            key_of(kind, 3): (0.9, 1.2, MIN_RUNS),
        }
    )
    band = bands.band(kind)
    assert (band.low, band.high, band.runs) == (0.9, 1.2, MIN_RUNS)
    assert band.kind == "runtime=r, hardware=h"
    other = bands.band({**kind, "runtime": "x"})
    assert other.extrapolation and "extrapolation" in other.describe(1.0)


def test_estimates_carry_their_band_and_it_survives_a_round_trip():
    report = estimate(
        "gpt3-175b",
        "a100-sxm4-80gb:48x8",
        "dp=12,tp=8,pp=4,recompute=full,global_batch_size=1536,amp=fp16",
        runtime="megatron-sc21",
    )
    band = report.band
    assert band is not None and band.runs >= 10 and band.low < 1.0 < band.high * 1.5
    again = CostReport.from_dict(report.to_dict(flat=False))
    assert again.band == band
    flat = report.to_dict()
    assert flat["step_time_band_low_s"] == pytest.approx(report.step_time_s * band.low)
    # the Engine's runtime has no published H100 run: marked, not hidden
    assert estimate("llama3-8b", "h100-sxm:2x8", "dp=16").band.extrapolation
