"""The search: an Optuna study over a search space, scored by the cost model, persisted and shared.

The public names live at the package root (``from autosearch import TuneConfig, tune``); this
package holds one module per concern: the job's schema (`_config.py`), the checks before any
work, objectives, recipes, files (locks, atomic writes), the journal file, storage, the study
reader, the study loop, outputs.
"""

from autosearch.tuning._config import SAMPLERS, TRIAL_UNITS
from autosearch.tuning._files import FileLock, atomic_write
from autosearch.tuning._objectives import (
    OBJECTIVES,
    Objective,
    make_objective,
    usd_per_million_tokens,
)
from autosearch.tuning._outputs import dashboard_importances
from autosearch.tuning._reader import (
    LoadedStudy,
    StudyMeta,
    load_study,
    read_candidates,
    report_from_dict,
)
from autosearch.tuning._result import Candidate, NoFeasibleStrategyError
from autosearch.tuning._storage import (
    OpenedStorage,
    StudyOptions,
    open_storage,
    open_study_storage,
)
from autosearch.tuning._study import check_study_name, default_study_name

__all__ = [
    "Candidate",
    "FileLock",
    "LoadedStudy",
    "NoFeasibleStrategyError",
    "OBJECTIVES",
    "Objective",
    "OpenedStorage",
    "SAMPLERS",
    "StudyMeta",
    "StudyOptions",
    "TRIAL_UNITS",
    "atomic_write",
    "check_study_name",
    "dashboard_importances",
    "default_study_name",
    "load_study",
    "make_objective",
    "open_storage",
    "open_study_storage",
    "read_candidates",
    "report_from_dict",
    "usd_per_million_tokens",
]
