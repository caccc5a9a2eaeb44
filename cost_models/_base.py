"""The cost-model interface: anything that turns a Strategy into a CostReport."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.report import CostReport
    from autosearch.core.strategy import Strategy


class CostModel(abc.ABC):
    """Scores strategies for one (model, cluster). Implementations must be pure: the same strategy
    always gives the same report, and estimating changes nothing."""

    @abc.abstractmethod
    def estimate(self, strategy: "Strategy", *, validate: bool = True) -> "CostReport":
        """Predict step time and memory of `strategy`; with `validate`, reject invalid ones."""

    @property
    def version(self) -> str:
        """What a study records of the model that scored it: a study scored by another version
        is not resumed (its trials would mix two models' predictions). Override it with a
        digest of what the predictions depend on; by default the class's name."""
        return type(self).__qualname__
