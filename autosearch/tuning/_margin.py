"""How much device memory a search holds back: a strategy fits only with a margin.

The cost model's peak memory has a measured error: the published torchtitan runs reserved up to
14% more than predicted, the Engine's runs on this machine up to 18% more
(`benchmarks/memory_bands.py`, cost_models/memory_bands.yaml). A strategy predicted at 99% of
the device is then one mis-predicted gigabyte away from running out of memory, so the search
counts a strategy as fitting only when its predicted peak times the band's upper end `high`
stays within the capacity, i.e. it holds back 1 - 1/high of the capacity:

1. ``--memory-margin`` (TuneConfig.memory_margin), when given;
2. else the band of the kind of run: the runtime's framework on the cluster's device type;
3. else (no measured run of that kind) the widest band measured on the same device type, else
   the widest of any kind: a guess made from the nearest evidence, and said to be one;
4. else (no bands file) `DEFAULT_MARGIN`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.runtime import RuntimeOptions

# With no bands file at all: a tenth of the device, the order of the torchtitan band.
DEFAULT_MARGIN = 0.10


@dataclass(frozen=True)
class MemoryMargin:
    """The fraction of device memory a search holds back, and where it comes from."""

    fraction: float
    why: str

    def bytes_of(self, capacity_bytes: float) -> float:
        return self.fraction * capacity_bytes


_LOADED: list[list[dict[str, Any]]] = []


def memory_bands() -> list[dict[str, Any]]:
    """The kinds of cost_models/memory_bands.yaml (runtime, device, runs, high), read once."""
    if not _LOADED:
        from autosearch.core.data import read_data

        shipped = read_data("memory_bands.yaml", what="memory bands", optional=True)
        _LOADED.append(list(shipped.get("kinds") or []))
    return _LOADED[0]


def memory_margin(
    runtime: "RuntimeOptions | str | None", cluster: "Cluster", *, override: float | None = None
) -> MemoryMargin:
    """The margin for runs of `runtime` on `cluster` (`override`: the user's fraction)."""
    from autosearch.core.runtime import RuntimeOptions

    if override is not None:
        return MemoryMargin(override, f"--memory-margin {override:g}")
    framework = RuntimeOptions.get(runtime).framework
    device = cluster.profile.device_type
    kinds = memory_bands()
    if not kinds:
        return MemoryMargin(DEFAULT_MARGIN, "default (no memory bands file)")
    same = [k for k in kinds if k["runtime"] == framework and k["device"] == device]
    if same:
        k = same[0]
        return MemoryMargin(
            _fraction(k["high"]),
            f"{k['runs']} measured {framework} runs on {device} peaked at up to "
            f"{k['high']:.3f} x the prediction",
        )
    near = [k for k in kinds if k["device"] == device] or kinds
    k = max(near, key=lambda k: k["high"])
    return MemoryMargin(
        _fraction(k["high"]),
        f"no measured {framework} run on {device}: the widest band measured "
        f"({k['runs']} {k['runtime']} runs on {k['device']}, up to {k['high']:.3f} x the "
        "prediction)",
    )


def _fraction(high: float) -> float:
    return max(0.0, 1.0 - 1.0 / float(high))
