"""Immutable records of a finished search."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    import optuna

    from autosearch.core.report import CostReport
    from autosearch.core.strategy import Strategy
    from autosearch.tuning._config import TuneConfig
    from search_spaces import BaseSearchSpace


@dataclass(frozen=True)
class Candidate:
    """A strategy, with what the cost model predicted for it and the trial that found it.

    The one candidate record of the project: `tune` returns them (`TuneResult.top_k`), and
    validation runs them (a strategy from a file has no report nor trial number).
    """

    strategy: "Strategy"
    report: "CostReport | None" = None
    trial_number: int | None = None
    values: tuple[float, ...] = ()

    @property
    def feasible(self) -> bool:
        """Whether the prediction fits in device memory (False when there is none)."""
        return self.report is not None and self.report.fits


def scored(cands: "Iterable[Candidate]") -> "list[tuple[Candidate, CostReport]]":
    """(candidate, its report) for each candidate that carries a report (every one of a
    TuneResult's top-k and Pareto front does; a strategy read from a file does not)."""
    return [(c, c.report) for c in cands if c.report is not None]


@dataclass(frozen=True)
class TuneResult:
    """What `tune` found.

    Attributes:
        best_strategy: the fastest strategy that fits (for multi-objective studies, the fastest
            point of the Pareto front); None when nothing fits.
        best_report: its CostReport.
        top_k: the best distinct strategies that fit, best first, as Candidates.
        pareto: the Pareto front of a multi-objective study (empty for a single objective).
        least_hungry: the candidate closest to fitting when nothing fits (else None).
        study: the Optuna study (persistent when a storage was given).
        space: the search space searched.
        n_trials: finished trials in the study; n_new_trials: how many this call ran.
        n_units: layouts (trial unit ``layout``) or strategies in the space; n_units_covered:
            how many of them the study's trials hold.
        plan: one line: what the search did (exhaustive or sampled, and why) and how much of
            the space the study covers.
        search: what the search did, in a few words (``exhaustive``, ``tpe + local search``,
            ``tpe + local search, stopped at the time budget``).
        out_dir: where the outputs were written (None when not asked).
        message: a one-line summary for people.
        price_per_gpu_hour: dollars per device-hour when given (then every report also shows
            dollars per million tokens, `usd_per_million_tokens`).
        config: the settings as run (names resolved, paths absolute: the ``config`` block of
            study.yaml); the settings as given when objects without a file form were passed.
        opened: why each dimension a runtime may lack is searched or not (`search_spaces.
            SpaceConfig.resolved`; empty for a space given whole).
        margin: the device memory held back (`autosearch.tuning.memory_margin`): every report
            fits only within the capacity less the margin.
    """

    best_strategy: "Strategy | None"
    best_report: "CostReport | None"
    top_k: tuple[Candidate, ...]
    study: "optuna.Study"
    space: "BaseSearchSpace"
    objective: str
    n_trials: int
    n_new_trials: int
    pareto: tuple[Candidate, ...] = ()
    least_hungry: Candidate | None = None
    out_dir: str | None = None
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    n_units: int = 0
    n_units_covered: int = 0
    plan: str = ""
    search: str = ""
    price_per_gpu_hour: float | None = None
    config: "TuneConfig | None" = None
    opened: tuple = ()
    margin: Any = None

    def case(self) -> str:
        """The case searched, in one line: the model (size, layers, experts, sequence length),
        the cluster and the batch (the summary's and the report's title)."""
        return case_line(self.space.model, self.space.cluster, self.space.global_batch_size)

    def memory_line(self, report: "CostReport") -> str:
        """``57.9 GiB peak, within the 70.1 GiB usable = 80.0 GiB less a 9.9 GiB margin``."""
        GiB = float(1 << 30)
        peak, cap = report.peak_memory_bytes / GiB, report.memory_capacity_bytes / GiB
        margin = report.memory_margin_bytes / GiB
        if not margin:
            return f"{peak:.2f} GiB peak of {cap:.2f} GiB (no margin held back)"
        share = f" ({self.margin.fraction:.1%}: {self.margin.why})" if self.margin else ""
        return (
            f"{peak:.2f} GiB peak, within {cap - margin:.2f} GiB usable = {cap:.2f} GiB less a "
            f"{margin:.2f} GiB margin{share}"
        )

    def usd_per_million_tokens(self, report: "CostReport") -> float | None:
        """Dollars per million training tokens of `report` on this cluster (None without a
        price): price x devices x hours per million tokens."""
        from autosearch.tuning._objectives import usd_per_million_tokens

        if self.price_per_gpu_hour is None or not report.tokens_per_s:
            return None
        return usd_per_million_tokens(
            report, self.price_per_gpu_hour, self.space.cluster.world_size
        )


def case_line(model, cluster, global_batch_size: int) -> str:
    """``llama3-70b: 70.6 B parameters, 80 layers, seq 8,192; on h100-sxm:16x8 (128 devices),
    global batch 512 (4.19 M tokens per step)``."""
    tokens = global_batch_size * model.seq_len
    per_step = f"{tokens / 1e6:.3g} M" if tokens >= 1e6 else f"{tokens:,}"
    return (
        f"{model.describe()}; on {cluster.name} ({cluster.world_size:,} devices), global batch "
        f"{global_batch_size:,} ({per_step} tokens per step)"
    )


class NoFeasibleStrategyError(SpecError):
    """No strategy of the space fits in device memory; `.result` holds the TuneResult (outputs
    are written before this is raised); the message says how far the least hungry one is."""

    def __init__(self, message: str, *, result: TuneResult | None = None):
        super().__init__(message)
        self.result = result
