"""The two sets of parameter names of a tuner trial: the sampler's and the storage's.

The sampler walks the space's conditional tree (`search_spaces/_parallel.py`): a level's name
carries its choice list (``pp[1,2,4]``, ``micro_batch_size[1,2,4,8]``) so that every name keeps
one distribution, and with ``trial_unit="layout"`` recompute, ZeRO, amp, ... are not sampled at
all (the trial scans them). Those names stay in the in-memory shadow study the sampler reads.

The storage holds the Strategy a trial scored under plain names, one per dimension that varies in
the space (`PLAIN_DIMENSIONS`), so optuna-dashboard, ``optuna`` CLI and
``study.trials_dataframe()`` show ``dp, tp, pp, cp, micro_batch_size, pipeline, recompute,
sequence_parallel, zero_stage, amp, fp8, compile, async_tp``. Each plain name has one
`CategoricalDistribution` per study: every value the space can take for it, in a fixed order
(`plain_choices`), so Optuna's check that a parameter keeps its distribution passes across trials,
workers and resumed runs. ``dp`` is stored although it is implied (world / (tp x pp x cp)): it is
the first dimension people look for; importance evaluators share the credit between dp and the
degrees that imply it. ``pipeline`` is the schedule with its virtual stages
(``interleaved_1f1b_v2``).

The sampler's names and distributions of a stored trial travel in its system attribute
`SAMPLER_ATTR`, from which a resumed or second worker rebuilds its shadow and the exhaustive
coverage; a trial stored before plain names existed has none and is read as it is.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from autosearch.core import dimensions

if TYPE_CHECKING:  # pragma: no cover
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import FrozenTrial

    from autosearch.core.strategy import Strategy
    from search_spaces import BaseSearchSpace

SAMPLER_ATTR = "autosearch:sampler_params"
# The Strategy fields under their plain names, in the order the dashboard lists them (the pipeline
# schedule and its virtual stages are one, `pipeline`; the global batch is the study's): from the
# dimension registry.
PLAIN_DIMENSIONS = dimensions.PLAIN_NAMES


def plain_value(strategy: "Strategy", name: str) -> Any:
    """The value of plain dimension `name` of `strategy` (a categorical choice: bool, int, str or
    None; a pipeline split is written ``15/16/16/15``)."""
    from search_spaces import pipeline_label

    if name == "pipeline":
        return pipeline_label(strategy.pipeline_schedule, strategy.virtual_stages)
    value = getattr(strategy, name)
    if isinstance(value, tuple):
        return "/".join(str(v) for v in value)
    return value


def plain_choices(space: "BaseSearchSpace") -> dict[str, tuple[Any, ...]]:
    """Every value each plain dimension takes in `space`, for the dimensions with more than one.

    A `SearchSpace` lists them from its tree (`SearchSpace.plain_choices`); another space is
    enumerated once (integers in increasing order, other values in the order they appear).
    """
    own = getattr(space, "plain_choices", None)
    if callable(own):
        found: dict[str, tuple[Any, ...]] = dict(own())
    else:
        seen: dict[str, dict[Any, None]] = {name: {} for name in PLAIN_DIMENSIONS}
        for s in space.enumerate():
            for name in PLAIN_DIMENSIONS:
                seen[name].setdefault(plain_value(s, name), None)
        found = {name: _ordered(tuple(values)) for name, values in seen.items()}
    return {name: found[name] for name in PLAIN_DIMENSIONS if len(found.get(name, ())) > 1}


def _ordered(values: tuple[Any, ...]) -> tuple[Any, ...]:
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return tuple(sorted(values))
    return values


class PlainParams:
    """The plain parameters of one study: names, distributions, and a strategy's values.

    Args:
        space: the search space of the study (its `plain_choices` fix the distributions).
    """

    def __init__(self, space: "BaseSearchSpace"):
        from optuna.distributions import CategoricalDistribution

        self.choices = plain_choices(space)
        self.distributions: dict[str, CategoricalDistribution] = {
            name: CategoricalDistribution(values) for name, values in self.choices.items()
        }

    def of(self, strategy: "Strategy") -> dict[str, Any]:
        """`strategy` under the plain names of the study."""
        return {name: plain_value(strategy, name) for name in self.choices}

    def shared_by(self, strategies: "tuple[Strategy, ...]") -> dict[str, Any]:
        """The plain values every strategy of a group shares (a failed layout trial keeps only
        its layout)."""
        if not strategies:
            return {}
        first = self.of(strategies[0])
        return {
            name: value
            for name, value in first.items()
            if all(plain_value(s, name) == value for s in strategies[1:])
        }

    def stored_trial(self, frozen: "FrozenTrial", plain: dict[str, Any], user_attrs: dict):
        """The trial to write to the storage: `frozen` (a shadow trial, under the sampler's
        names) with the plain parameters, and the sampler's in `SAMPLER_ATTR`."""
        import optuna
        from optuna.distributions import distribution_to_json

        sampler = {
            "params": dict(frozen.params),
            "distributions": {
                name: distribution_to_json(d) for name, d in frozen.distributions.items()
            },
        }
        return optuna.trial.create_trial(
            state=frozen.state,
            values=frozen.values,
            params=plain,
            distributions={name: self.distributions[name] for name in plain},
            user_attrs=user_attrs,
            system_attrs={**frozen.system_attrs, SAMPLER_ATTR: sampler},
        )


def sampler_params(trial: "FrozenTrial") -> dict[str, Any]:
    """The sampler's parameters of a stored trial (its own for a trial of the shadow, or of a
    study stored before plain names existed)."""
    stored = trial.system_attrs.get(SAMPLER_ATTR)
    return dict(stored["params"]) if stored else trial.params


def for_sampler(trial: "FrozenTrial"):
    """A stored trial as the sampler needs it: its sampler's parameters, values, state and the
    constraint, without the cost report (which stays in the storage), so the shadow stays small."""
    import optuna

    stored = trial.system_attrs.get(SAMPLER_ATTR)
    if stored:
        params = stored["params"]
        distributions = {
            name: _distribution(text) for name, text in stored["distributions"].items()
        }
    else:
        params, distributions = trial.params, trial.distributions
    return optuna.trial.create_trial(
        state=trial.state,
        values=trial.values,
        params=params,
        distributions=distributions,
        system_attrs={k: v for k, v in trial.system_attrs.items() if k.startswith("constraints")},
    )


@functools.lru_cache(maxsize=4096)
def _distribution(text: str):
    """A distribution from its JSON (trials share a few hundred at most: parsed once each)."""
    from optuna.distributions import json_to_distribution

    return json_to_distribution(text)
