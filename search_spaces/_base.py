"""The interface every search space implements (the contract tests in tests/test_search_spaces.py
run against each implementation)."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import optuna

    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy


class BaseSearchSpace(abc.ABC):
    """A finite set of valid strategies for one (model, cluster, global batch).

    Implementations must guarantee that `enumerate()` and `suggest()` only produce strategies that
    pass ``Strategy.validate(model, cluster)``, that `suggest` uses Optuna distributions whose
    choices depend only on the parameter name (so any sampler and any storage works across trials
    and processes), and that ``suggest`` can reach every strategy `enumerate` yields.
    """

    model: "ModelSpec"
    cluster: "Cluster"
    global_batch_size: int

    @abc.abstractmethod
    def enumerate(self) -> Iterator["Strategy"]:
        """Yield every strategy of the space once, in a fixed order."""

    @abc.abstractmethod
    def suggest(self, trial: "optuna.trial.BaseTrial") -> "Strategy":
        """Sample one strategy through `trial` (categorical parameters with fixed choices)."""

    def suggest_group(self, trial: "optuna.trial.BaseTrial") -> tuple["Strategy", ...]:
        """Sample a group of strategies that differ only in dimensions cheap enough to scan
        exhaustively inside one trial. The default group is the single strategy of `suggest`;
        the groups of a space partition it, and `params_of(s, group=True)` names the group of s."""
        return (self.suggest(trial),)

    def group_params(self, *, every: int = 1) -> Iterator[dict[str, Any]]:
        """The trial parameters of every group once (of every `every`-th group), in `enumerate`
        order: what an exhaustive search over groups visits."""
        seen: set[tuple] = set()
        for s in self.enumerate():
            params = self.params_of(s, group=True)
            key = tuple(sorted(params.items()))
            if key not in seen:
                seen.add(key)
                if (len(seen) - 1) % every == 0:
                    yield params

    @abc.abstractmethod
    def params_of(self, strategy: "Strategy", *, group: bool = False) -> dict[str, Any]:
        """The trial parameters that make `suggest` (or, with `group`, `suggest_group`) produce
        `strategy` (for `enqueue_trial`).

        Raises:
            SpecError: the strategy is not in this space.
        """

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of strategies, counted without building them."""

    @property
    def n_groups(self) -> int:
        """Number of groups `suggest_group` can return (the default group is one strategy)."""
        return self.size

    def __len__(self) -> int:
        return self.size

    def __contains__(self, strategy: object) -> bool:
        try:
            self.params_of(strategy)  # type: ignore[arg-type]
        except ValueError:
            return False
        return True

    def signature(self) -> dict[str, Any]:
        """What identifies the space, stored with a study so that a resumed or shared study is
        refused if it was created for a different space."""
        return {
            "kind": type(self).__name__,
            "model": self.model.name,
            "cluster": self.cluster.name,
            "global_batch_size": self.global_batch_size,
            "size": self.size,
        }
