"""Learning from real runs: refit the cost model's correction terms from predicted vs measured
step times (scipy least squares), and say honestly how much it helped on runs it did not see.

The correction model scales each group of predicted breakdown terms and adds a fixed overhead:

    measured ~= intercept_s + sum_g factor_g * sum_{t in g} time_t + time_other_s

with the groups of `TERM_GROUPS` (columns as `CostReport.to_dict()` names them). Residuals are
relative, (corrected - measured) / measured, so that a 10 ms run weighs as much as a 10 s one,
and a weak prior pulls each log(factor) towards 0 (factor 1: trust the calibrated profile) so
that a handful of runs cannot produce wild factors for a term they barely exercise.

Example:
    >>> import pandas as pd
    >>> df = pd.DataFrame({"strategy": list("abcdefgh"),
    ...     "time_compute_s": [1, 2, 3, 4, 1, 2, 3, 4.],
    ...     "time_dp_comm_exposed_s": [0, 0, 1, 1, 0.5, 0.5, 0, 0]})
    >>> df["predicted_step_time_s"] = df.time_compute_s + df.time_dp_comm_exposed_s
    >>> df["measured_step_time_s"] = (1.5 * df.time_compute_s + 0.8 * df.time_dp_comm_exposed_s
    ...                               + 0.1)
    >>> r = refit_corrections(df, holdout=0.25, seed=0)
    >>> r.errors["holdout_after"]["mape"] < r.errors["holdout_before"]["mape"]
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from autosearch.core.errors import SpecError

TERM_GROUPS: dict[str, tuple[str, ...]] = {
    # compute-bound work and what scales with it (the bubble is idle time of the same length)
    "compute": ("time_compute_s", "time_recompute_s", "time_bubble_s"),
    # collectives and point-to-point sends over the link the runs used
    "communication": ("time_tp_comm_s", "time_pp_comm_s", "time_dp_comm_exposed_s"),
    # the memory-bound optimizer step
    "optimizer": ("time_optimizer_s",),
}
FIXED_TERMS = ("time_other_s",)  # added as predicted, not scaled


@dataclass(frozen=True)
class RefitResult:
    """Fitted corrections and the errors before / after, on the fitted runs and on held-out runs.

    factors: multiplier of each term group (1.0 = the profile was right; groups with no signal in
        the training runs stay at 1.0 and are listed in `unfitted`).
    intercept_s: fixed time per step the predictions lacked (>= 0).
    errors: {"train_before", "train_after", "holdout_before", "holdout_after"} -> {"mape", "worst",
        "n"}: mean and worst |predicted / measured - 1| (fractions, not percent).
    """

    factors: dict[str, float]
    intercept_s: float
    errors: dict[str, dict[str, float]]
    groups: dict[str, tuple[str, ...]]
    train_index: tuple = ()
    holdout_index: tuple = ()
    unfitted: tuple[str, ...] = ()
    prior_weight: float = 0.1

    def predict(self, df: pd.DataFrame) -> np.ndarray:
        """Corrected step time of each row (needs the breakdown columns)."""
        return _corrected(df, self.groups, self.factors, self.intercept_s)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train_index"] = [str(i) for i in self.train_index]
        d["holdout_index"] = [str(i) for i in self.holdout_index]
        d["groups"] = {k: list(v) for k, v in self.groups.items()}
        d["unfitted"] = list(self.unfitted)
        return d

    def apply(self, profile):
        """The profile with the corrections folded into its terms, and the fit recorded.

        compute -> gemm.max_efficiency and attention efficiencies divided, launch terms multiplied
        (the elementwise part of compute also depends on memory bandwidth, which the optimizer
        factor sets: the folded profile reproduces `predict` up to that part);
        communication -> intra_node efficiency divided and latency multiplied (the runs are on one
        node; inter_node is left as is); optimizer -> memory efficiency divided; the intercept ->
        the profile's step_overhead_s (a fixed cost per optimizer step, added to `other_s`).
        """
        from autosearch.core.hardware import HardwareProfile

        c, comm, opt = (
            self.factors.get(k, 1.0) for k in ("compute", "communication", "optimizer")
        )
        data = profile.to_dict()
        data["gemm"]["max_efficiency"] = {
            p: v / c for p, v in data["gemm"]["max_efficiency"].items()
        }
        data["gemm"]["launch_s"] *= c
        data["kernel_launch_s"] *= c
        data["attention"]["flash_efficiency"] = {
            p: v / c for p, v in data["attention"]["flash_efficiency"].items()
        }
        data["intra_node"]["efficiency"] /= comm
        data["intra_node"]["latency_s"] *= comm
        data["memory"]["efficiency"] /= opt
        data["step_overhead_s"] = max(
            0.0, float(data.get("step_overhead_s", 0.0)) + self.intercept_s
        )
        data["measured"] = list(dict.fromkeys(list(data["measured"]) + ["corrections"]))
        data["calibration"] = {
            **data.get("calibration", {}),
            "corrections": {**self.to_dict(), "step_overhead_s": self.intercept_s},
        }
        return HardwareProfile.from_dict(data, what=f"corrected profile {profile.name!r}")


def refit_corrections(
    runs: pd.DataFrame,
    *,
    groups: dict[str, Sequence[str]] | None = None,
    holdout: float | Sequence[bool] | str = 0.25,
    group_column: str | None = "strategy",
    prior_weight: float = 0.1,
    intercept: bool = True,
    seed: int = 0,
) -> RefitResult:
    """Fit correction factors on part of `runs` and report the error on the rest.

    Args:
        runs: one row per measured run, with `predicted_step_time_s`, `measured_step_time_s` and
            the predicted breakdown columns (`time_compute_s`, ... as `CostReport.to_dict()`
            writes them; missing ones count as 0). Failed runs (measured time missing or <= 0)
            are ignored.
        groups: term groups to scale (default `TERM_GROUPS`).
        holdout: fraction of runs held out at random (at least one when there are 4 or more runs),
            or a boolean mask, or the name of a boolean column (True = held out).
        group_column: with a random holdout, rows sharing this column's value (e.g. the same
            strategy at two world sizes) fall on the same side, so the held-out error is not
            flattered by a near-duplicate in the training set. Ignored if the column is absent.
        prior_weight: strength of the pull of log(factor) towards 0, in units of relative residual.
        intercept: fit a fixed per-step overhead (>= 0).
        seed: of the random holdout.
    """
    term_groups = {k: tuple(v) for k, v in (groups or TERM_GROUPS).items()}
    need = {"predicted_step_time_s", "measured_step_time_s"}
    if not need <= set(runs.columns):
        raise SpecError(f"runs need the columns {sorted(need)}; got {sorted(runs.columns)}")
    df = runs[pd.to_numeric(runs["measured_step_time_s"], errors="coerce").fillna(0) > 0].copy()
    if len(df) < 2:
        raise SpecError(f"need at least 2 successful runs to refit, got {len(df)}")
    mask = _holdout_mask(df, holdout, group_column, seed)
    train, test = df[~mask], df[mask]
    sums = _group_sums(train, term_groups)
    active = [g for g in term_groups if np.any(sums[g] > 0)]
    n_params = len(active) + int(intercept)
    if len(train) < max(2, n_params):
        raise SpecError(
            f"{len(train)} training runs for {n_params} parameters; run more strategies or hold "
            "out fewer"
        )

    y = train["measured_step_time_s"].to_numpy(float)
    fixed = _fixed(train)
    scale = float(np.median(y))

    def unpack(x):
        factors = {g: float(np.exp(x[i])) for i, g in enumerate(active)}
        return factors, (float(x[-1]) * scale if intercept else 0.0)

    def resid(x):
        factors, icpt = unpack(x)
        pred = icpt + fixed + sum(factors[g] * sums[g] for g in active)
        prior = np.sqrt(prior_weight) * np.asarray(x[: len(active)])
        return np.concatenate([(pred - y) / y, prior])

    x0 = np.zeros(n_params)
    if (
        intercept
    ):  # strictly inside the bound: least_squares' trf does not leave a start on a bound
        x0[-1] = 0.01
    lower = [-np.inf] * len(active) + ([0.0] if intercept else [])
    upper = [np.inf] * n_params
    sol = least_squares(resid, x0, bounds=(lower, upper))
    factors, icpt = unpack(sol.x)
    factors = {g: factors.get(g, 1.0) for g in term_groups}
    errors = {
        "train_before": _errors(train["predicted_step_time_s"], train["measured_step_time_s"]),
        "train_after": _errors(
            _corrected(train, term_groups, factors, icpt), train["measured_step_time_s"]
        ),
        "holdout_before": _errors(test["predicted_step_time_s"], test["measured_step_time_s"]),
        "holdout_after": _errors(
            _corrected(test, term_groups, factors, icpt), test["measured_step_time_s"]
        ),
    }
    return RefitResult(
        factors,
        icpt,
        errors,
        term_groups,
        tuple(train.index),
        tuple(test.index),
        tuple(g for g in term_groups if g not in active),
        prior_weight,
    )


def _holdout_mask(df: pd.DataFrame, holdout, group_column: str | None, seed: int) -> np.ndarray:
    if isinstance(holdout, str):
        if holdout not in df.columns:
            raise SpecError(
                f"holdout column {holdout!r} is not in the runs ({', '.join(df.columns)})"
            )
        return df[holdout].astype(bool).to_numpy()
    if not isinstance(holdout, (int, float)):
        mask = np.asarray(holdout, dtype=bool)
        if len(mask) != len(df):
            raise SpecError(f"holdout mask has {len(mask)} entries for {len(df)} successful runs")
        return mask
    if not 0 <= holdout < 1:
        raise SpecError(f"holdout fraction must be in [0, 1), got {holdout}")
    keys = (
        df[group_column].astype(str).to_numpy()
        if group_column and group_column in df.columns
        else np.arange(len(df)).astype(str)
    )
    unique = np.unique(keys)
    n_out = int(round(holdout * len(unique)))
    if holdout > 0 and len(df) >= 4:
        n_out = max(1, n_out)
    n_out = min(n_out, len(unique) - 1)
    chosen = (
        np.random.default_rng(seed).choice(unique, size=n_out, replace=False)
        if n_out > 0
        else np.array([], dtype=unique.dtype)
    )
    return np.isin(keys, chosen)


def _group_sums(df: pd.DataFrame, groups: dict[str, tuple[str, ...]]) -> dict[str, np.ndarray]:
    return {g: _column_sum(df, cols) for g, cols in groups.items()}


def _fixed(df: pd.DataFrame) -> np.ndarray:
    return _column_sum(df, FIXED_TERMS)


def _column_sum(df: pd.DataFrame, columns: Sequence[str]) -> np.ndarray:
    """Row-wise sum of `columns` (a missing column counts as 0)."""
    total = np.zeros(len(df))
    for c in columns:
        if c in df.columns:
            total = total + df[c].to_numpy(float)
    return total


def _corrected(
    df: pd.DataFrame, groups, factors: dict[str, float], intercept_s: float
) -> np.ndarray:
    sums = _group_sums(df, groups)
    return intercept_s + _fixed(df) + sum(factors.get(g, 1.0) * sums[g] for g in groups)


def _errors(predicted, measured) -> dict[str, float]:
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if len(m) == 0:
        return {"mape": float("nan"), "worst": float("nan"), "n": 0}
    rel = np.abs(p / m - 1.0)
    return {"mape": float(rel.mean()), "worst": float(rel.max()), "n": int(len(m))}
