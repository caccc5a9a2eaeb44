"""What a study optimizes: one small class per objective, all scoring a CostReport.

Every objective treats the device memory as a hard limit through an Optuna constraint
(``memory_excess_gib`` <= 0 is feasible), which TPE and NSGA-II both honour (Optuna's
constrained TPE and constrained-domination NSGA-II): a strategy that does not fit ranks below
every strategy that fits, and among those that do not fit, the less hungry ranks higher.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from autosearch.core.errors import SpecError
from autosearch.tuning._config import OBJECTIVE_ALIASES, OBJECTIVES
from autosearch.tuning._ranking import same_value, tie_key

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.report import CostReport
    from autosearch.core.strategy import Strategy

Direction = Literal["maximize", "minimize"]
GiB = float(1 << 30)
CONSTRAINT = "memory_excess_gib"


class Objective(abc.ABC):
    """Turns a CostReport into the values of an Optuna trial."""

    name: str
    directions: tuple[Direction, ...]
    value_names: tuple[str, ...]

    @abc.abstractmethod
    def values(self, report: "CostReport") -> tuple[float, ...]:
        """The objective values of one report, in the order of `directions`."""

    @property
    def is_multi(self) -> bool:
        return len(self.directions) > 1

    def better(
        self,
        a: "CostReport",
        b: "CostReport | None",
        a_strategy: "Strategy | None" = None,
        b_strategy: "Strategy | None" = None,
    ) -> bool:
        """Single-objective order used inside a trial group: feasible first, then the first
        objective value with the project's tie rule (`_ranking.py`: less memory, bf16, fewer
        parallel axes); among infeasible strategies the least hungry wins."""
        if b is None:
            return True
        if a.fits != b.fits:
            return a.fits
        if not a.fits:
            return a.peak_memory_bytes < b.peak_memory_bytes
        va, vb = self.values(a)[0], self.values(b)[0]
        if not same_value(va, vb):
            return va > vb
        return tie_key(a_strategy, a) < tie_key(b_strategy, b)


@dataclass(frozen=True)
class Throughput(Objective):
    """Maximize training tokens per second under the memory limit (the default)."""

    name: str = "throughput"
    directions: tuple[Direction, ...] = ("maximize",)
    value_names: tuple[str, ...] = ("tokens_per_s",)

    def values(self, report: "CostReport") -> tuple[float, ...]:
        return (report.tokens_per_s,)


@dataclass(frozen=True)
class ThroughputPessimistic(Objective):
    """Maximize the pessimistic end of the throughput band: tokens per second if the run is as
    slow as 95% of the published and measured runs of its kind allow (the band's upper step
    time, autosearch/core/bands.py). A strategy of a kind without evidence (an extrapolation)
    is taken at the worst band any kind has. Where the model is on firm ground this ranks as
    `throughput`; it stops the search from walking into the regimes where the model is most
    optimistic."""

    name: str = "throughput-pessimistic"
    directions: tuple[Direction, ...] = ("maximize",)
    value_names: tuple[str, ...] = ("pessimistic_tokens_per_s",)

    def values(self, report: "CostReport") -> tuple[float, ...]:
        return (pessimistic_tokens_per_s(report),)


def pessimistic_tokens_per_s(report: "CostReport") -> float:
    """Throughput at the slow end of the report's band (the worst known band if it has none)."""
    from autosearch.core.bands import error_bands

    band = report.band
    if band is not None and not band.extrapolation:
        return report.tokens_per_s / band.high
    return report.tokens_per_s / error_bands().worst_high


@dataclass(frozen=True)
class ThroughputMemory(Objective):
    """Maximize tokens per second and minimize peak memory per device (Pareto front)."""

    name: str = "throughput-memory"
    directions: tuple[Direction, ...] = ("maximize", "minimize")
    value_names: tuple[str, ...] = ("tokens_per_s", "peak_memory_gib")

    def values(self, report: "CostReport") -> tuple[float, ...]:
        return (report.tokens_per_s, report.peak_memory_bytes / GiB)


@dataclass(frozen=True)
class ThroughputCost(Objective):
    """Maximize tokens per second and minimize dollars per million tokens.

    On one cluster the cost per token is price x devices / throughput, so the two objectives agree
    and the front is a single point; the trade-off appears across cluster sizes, which is what
    `autosearch sweep --price-per-gpu-hour` tabulates (one row per node count).
    """

    price_per_gpu_hour: float = 0.0
    world_size: int = 1
    name: str = "throughput-cost"
    directions: tuple[Direction, ...] = ("maximize", "minimize")
    value_names: tuple[str, ...] = ("tokens_per_s", "usd_per_million_tokens")

    def values(self, report: "CostReport") -> tuple[float, ...]:
        return (
            report.tokens_per_s,
            usd_per_million_tokens(report, self.price_per_gpu_hour, self.world_size),
        )


def usd_per_million_tokens(
    report: "CostReport", price_per_gpu_hour: float, world_size: int
) -> float:
    """price x devices x hours per million tokens."""
    return price_per_gpu_hour * world_size / 3600.0 / report.tokens_per_s * 1e6


def make_objective(
    name: str, *, cluster: "Cluster", price_per_gpu_hour: float | None = None
) -> Objective:
    """The objective called `name` (one of OBJECTIVES; ``memory`` and ``cost`` are accepted)."""
    key = OBJECTIVE_ALIASES.get(name, name)
    if key == "throughput":
        return Throughput()
    if key == "throughput-pessimistic":
        return ThroughputPessimistic()
    if key == "throughput-memory":
        return ThroughputMemory()
    if key == "throughput-cost":
        if price_per_gpu_hour is None or price_per_gpu_hour <= 0:
            raise SpecError(
                "objective throughput-cost needs a price per GPU-hour > 0 "
                "(--price-per-gpu-hour 2.5, or price_per_gpu_hour=2.5)"
            )
        return ThroughputCost(
            price_per_gpu_hour=float(price_per_gpu_hour), world_size=cluster.world_size
        )
    raise SpecError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
