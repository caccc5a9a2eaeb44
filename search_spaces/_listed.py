"""ListedSpace: an explicit list of strategies (re-scoring candidates, tests, shortlists)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.core.hardware import Cluster
from autosearch.core.model_spec import ModelSpec
from autosearch.core.strategy import Strategy
from search_spaces._base import BaseSearchSpace

if TYPE_CHECKING:  # pragma: no cover
    import optuna


class ListedSpace(BaseSearchSpace):
    """A space of the given strategies, sampled through one categorical parameter ``strategy``
    whose choices are their short labels.

    Args:
        model: a ModelSpec or catalog name.
        cluster: a Cluster or its text form.
        strategies: the strategies (duplicates are dropped; all must share one global batch).

    Raises:
        SpecError: the list is empty, a strategy is invalid for the model and cluster, or the
            global batch sizes differ.

    Example:
        >>> from autosearch import Strategy
        >>> from search_spaces import ListedSpace
        >>> shortlist = [Strategy(dp=8, global_batch_size=64), Strategy(tp=8,
        ...              global_batch_size=64)]
        >>> space = ListedSpace("llama3-8b", "h100-sxm:1x8", shortlist)
        >>> space.size
        2
    """

    def __init__(
        self, model: "ModelSpec | str", cluster: "Cluster | str", strategies: Iterable[Strategy]
    ):
        self.model = ModelSpec.load(model)
        self.cluster = Cluster.parse(cluster)
        unique = list(dict.fromkeys(strategies))
        if not unique:
            raise SpecError("a ListedSpace needs at least one strategy")
        problems = [
            f"{s.short()}: {p}" for s in unique for p in s.problems(self.model, self.cluster)
        ]
        if problems:
            raise SpecError(problems, context="invalid strategies in the list")
        batches = sorted({s.global_batch_size for s in unique})
        if len(batches) > 1:
            raise SpecError(
                f"all strategies of a ListedSpace must share one global_batch_size; got {batches}"
            )
        self.global_batch_size = batches[0]
        self.strategies = tuple(unique)
        self._labels = tuple(s.short() for s in unique)
        if len(set(self._labels)) != len(
            self._labels
        ):  # short() omits canonical fields; fall back to indices
            self._labels = tuple(f"{i}:{label}" for i, label in enumerate(self._labels))

    @property
    def size(self) -> int:
        return len(self.strategies)

    def enumerate(self) -> Iterator[Strategy]:
        return iter(self.strategies)

    def suggest(self, trial: "optuna.trial.BaseTrial") -> Strategy:
        if len(self.strategies) == 1:
            return self.strategies[0]
        label = trial.suggest_categorical("strategy", self._labels)
        return self.strategies[self._labels.index(label)]

    def params_of(self, strategy: Strategy, *, group: bool = False) -> dict[str, Any]:
        try:
            i = self.strategies.index(strategy)
        except ValueError:
            raise SpecError(
                f"strategy {strategy.short()} is not in this list of {self.size}"
            ) from None
        return {} if len(self.strategies) == 1 else {"strategy": self._labels[i]}
