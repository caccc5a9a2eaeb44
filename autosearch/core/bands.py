"""How sure a prediction is: an error band from the published and measured runs of its kind.

Every run the fidelity benchmarks check (SC'21 Table 1, the second development set of today's
stacks, the local runs on this machine) leaves a ratio q = actual step time / predicted step
time. Runs are grouped by their *kind*: the runtime, the hardware (and whether its profile was
measured), the parallel axes in use, the ZeRO stage, the recompute kind, the precision and the
scale. For a kind with enough runs the band is the split-conformal 90% interval of q over those
runs (Vovk et al. 2005; Lei et al. 2018: with n exchangeable runs the interval between the
floor(0.05 (n+1))-th and ceil(0.95 (n+1))-th smallest ratios covers a new run of that kind with
probability >= 90%). A kind with too few runs falls back to a coarser kind (fewer fields), and a
strategy with no run of its runtime and hardware is marked an extrapolation.

`benchmarks/error_bands.py` recomputes the bands from the benchmarks and writes them to
`cost_models/error_bands.yaml`; `AnalyticCostModel.estimate` attaches the band to each report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from autosearch.core import dimensions
from autosearch.core.data import read_data
from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.strategy import Strategy

COVERAGE = 0.90
MIN_RUNS = 8  # fewer runs than this at a level: fall back to a coarser kind
# From the finest kind to the coarsest; each level keeps these fields of the kind.
LEVELS = (
    ("runtime", "hardware", "axes", "zero", "recompute", "precision", "scale"),
    ("runtime", "hardware", "axes", "recompute"),
    ("runtime", "hardware", "axes"),
    ("runtime", "hardware"),
)


class Band(NamedTuple):
    """The step time's band: actual / predicted lies in [low, high] for 90% of runs of its kind.

    Attributes:
        low, high: bounds of actual / predicted step time.
        runs: how many runs of the kind support it (0: no evidence, an extrapolation).
        kind: the kind the runs share (``runtime=torchtitan, hardware=h100-...``).
    """

    low: float
    high: float
    runs: int
    kind: str

    @property
    def extrapolation(self) -> bool:
        return self.runs == 0

    def describe(self, step_time_s: float) -> str:
        if self.extrapolation:
            return f"no published or measured run of this kind ({self.kind}): an extrapolation"
        return (
            f"90% band {step_time_s * self.low:.3g}-{step_time_s * self.high:.3g} s, from "
            f"{self.runs} runs of this kind ({self.kind})"
        )


NO_EVIDENCE = Band(math.nan, math.nan, 0, "")


# The strategy fields a kind reads: the parallel degrees (its axes), the ZeRO stage, the
# recompute kind and the precision (the cost model keys its band cache by them).
KIND_READS: tuple[str, ...] = dimensions.DEGREES + ("zero_stage", "recompute", "fp8", "amp")


def kind_of(strategy: Strategy, cluster: Cluster, runtime: str) -> dict[str, str]:
    """The fields that group runs whose prediction errors are alike (`runtime`: the framework,
    `RuntimeOptions.framework`, so that every dated version of it counts)."""
    profile = cluster.profile
    hardware = profile.name.split(":")[0]
    if profile.device_type == "cpu":
        hardware = "cpu"
    if profile.measured:
        hardware += " (measured)"
    axes = "+".join(dimensions.parallel_axes(strategy)) or "single"
    devices = cluster.world_size
    scale = (
        "<=8"
        if devices <= 8
        else "<=64"
        if devices <= 64
        else "<=512"
        if devices <= 512
        else ">512"
    )
    return {
        "runtime": runtime,
        "hardware": hardware,
        "axes": axes,
        "zero": "3" if strategy.zero_stage == 3 else "0-2",
        "recompute": strategy.recompute,
        "precision": "fp8" if strategy.fp8 != "none" else strategy.amp,
        "scale": scale,
    }


def key_of(kind: dict[str, str], level: int) -> str:
    return ", ".join(f"{name}={kind[name]}" for name in LEVELS[level])


def conformal_band(ratios: list[float], coverage: float = COVERAGE) -> tuple[float, float]:
    """Split-conformal interval of the ratios (two tails of (1 - coverage) / 2 each)."""
    q = sorted(ratios)
    n = len(q)
    tail = (1 - coverage) / 2
    lo = max(1, math.floor(tail * (n + 1)))
    hi = min(n, math.ceil((1 - tail) * (n + 1)))
    return q[lo - 1], q[hi - 1]


@dataclass(frozen=True)
class ErrorBands:
    """Bands by kind key, at every level (written by benchmarks/error_bands.py)."""

    bands: dict[str, tuple[float, float, int]]
    sources: tuple[str, ...] = ()

    @property
    def worst_high(self) -> float:
        """The largest upper bound of any kind (what an extrapolation is taken at when ranking
        pessimistically); 1 with no bands."""
        return max((high for _, high, _ in self.bands.values()), default=1.0)

    def band(self, kind: dict[str, str]) -> Band:
        for level in range(len(LEVELS)):
            key = key_of(kind, level)
            hit = self.bands.get(key)
            if hit is not None and hit[2] >= MIN_RUNS:
                return Band(hit[0], hit[1], hit[2], key)
        for level in range(len(LEVELS)):  # few runs is still better than none
            key = key_of(kind, level)
            hit = self.bands.get(key)
            if hit is not None:
                return Band(hit[0], hit[1], hit[2], key)
        return NO_EVIDENCE._replace(kind=key_of(kind, len(LEVELS) - 1))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ErrorBands:
        try:
            bands = {
                str(k): (float(v["low"]), float(v["high"]), int(v["runs"]))
                for k, v in (data.get("bands") or {}).items()
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(
                f"error bands file is malformed ({exc!r}); rerun benchmarks/error_bands.py"
            ) from None
        return cls(bands, tuple(data.get("sources") or ()))


_LOADED: list[ErrorBands] = []


def error_bands() -> ErrorBands:
    """The shipped bands (`cost_models/error_bands.yaml`), read once."""
    if not _LOADED:
        shipped = read_data("error_bands.yaml", what="error bands", optional=True)
        _LOADED.append(ErrorBands.from_dict(shipped) if shipped else ErrorBands({}))
    return _LOADED[0]
