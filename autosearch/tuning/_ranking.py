"""The one order of strategies, ties included: the best strategy, ``top_k.csv``, report.md, the
strategy a layout trial keeps and the candidates `validate` runs all follow it.

Rule: the higher objective value first (tokens per second, or its pessimistic end for
``throughput-pessimistic``). Values equal to 12 significant digits (relative difference at most
`REL_TIE`: sums taken in another order differ by ~1e-15, far below anything the cost model can
tell apart) are a tie, broken by, in turn:

1. lower predicted peak memory per device (more headroom for the same speed);
2. bf16, then fp16, then fp32 (`AMP_ORDER`: bf16 needs no loss scaling);
3. fewer parallel axes (of dp, tp, pp, cp, those above 1: fewer collectives and process
   groups to set up and debug);
4. the earlier trial.

Two trials that scored the same Strategy (the same layout scored by two workers, or again by a
resumed run) are one candidate: the earlier trial stands for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autosearch.core import dimensions

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.report import CostReport
    from autosearch.core.strategy import Strategy

REL_TIE = 1e-12
AMP_ORDER = ("bf16", "fp16", "fp32")


def same_value(a: float, b: float) -> bool:
    """Whether two objective values are a tie (relative difference at most `REL_TIE`)."""
    return abs(a - b) <= REL_TIE * max(abs(a), abs(b))


def n_parallel_axes(strategy: "Strategy") -> int:
    """How many of the mesh degrees (dp, tp, pp, cp: `dimensions.MESH_AXES`) are above 1."""
    return len(dimensions.parallel_axes(strategy))


def tie_key(
    strategy: "Strategy | None", report: "CostReport", trial_number: int | None = None
) -> tuple:
    """What breaks a tie, smallest first: peak memory, amp, parallel axes, trial number."""
    amp, axes = 0, 0
    if strategy is not None:
        amp = AMP_ORDER.index(strategy.amp) if strategy.amp in AMP_ORDER else len(AMP_ORDER)
        axes = n_parallel_axes(strategy)
    return (report.peak_memory_bytes, amp, axes, -1 if trial_number is None else trial_number)
