"""The search: an Optuna study over a search space, scored by the cost model, persisted and shared.

`autosearch.tuner` is the public face (``from autosearch import tune``); this package holds one
module per concern: objectives, recipes, storage, the study loop, outputs.
"""

from autosearch.tuning._objectives import (
    OBJECTIVES,
    Objective,
    make_objective,
    usd_per_million_tokens,
)
from autosearch.tuning._result import Candidate, NoFeasibleStrategyError, TuneResult
from autosearch.tuning._storage import open_storage
from autosearch.tuning._study import (
    SAMPLERS,
    TRIAL_UNITS,
    default_study_name,
    report_from_dict,
    tune,
)

__all__ = [
    "Candidate",
    "NoFeasibleStrategyError",
    "OBJECTIVES",
    "Objective",
    "SAMPLERS",
    "TRIAL_UNITS",
    "TuneResult",
    "default_study_name",
    "make_objective",
    "open_storage",
    "report_from_dict",
    "tune",
    "usd_per_million_tokens",
]
