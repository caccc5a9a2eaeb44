"""`autosearch.tune`: the fastest strategy that fits, found by an Optuna study over a search space.

Example:
    >>> from autosearch import tune
    >>> result = tune("llama3-8b", "h100-sxm:8x8", global_batch_size=512, n_trials=30, seed=0)
    >>> result.best_strategy.world_size
    64

See `autosearch/tuning/` for the parts (objectives, recipes, storage, the study loop, outputs).
"""

from autosearch.tuning import (
    OBJECTIVES,
    SAMPLERS,
    Candidate,
    NoFeasibleStrategyError,
    StudyMeta,
    StudyOptions,
    TuneResult,
    load_study,
    open_storage,
    tune,
)

__all__ = [
    "Candidate",
    "NoFeasibleStrategyError",
    "OBJECTIVES",
    "SAMPLERS",
    "StudyMeta",
    "StudyOptions",
    "TuneResult",
    "load_study",
    "open_storage",
    "tune",
]
