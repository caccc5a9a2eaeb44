"""Reading a tuner study back: its metadata (`StudyMeta`), its candidates, the study itself.

The one reader of tuner studies: `tune` uses it for its own results, and `autosearch validate
--study` and `Engine.tune` use it to pick candidates. Keys of the stored records are written
and read here only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.tuning._result import Candidate, scored

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    from optuna.trial import FrozenTrial

    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.report import CostReport
    from autosearch.tuning._storage import OpenedStorage

META_ATTR = "autosearch"  # study user attribute holding the StudyMeta
ATTR_STRATEGY, ATTR_REPORT, ATTR_WORKER, ATTR_GROUP, ATTR_ERROR = (
    "strategy",
    "report",
    "worker",
    "group_size",
    "error",
)
CONSTRAINT = "memory_excess_gib"


@dataclass(frozen=True, kw_only=True)
class StudyMeta:
    """What a tuner study searches, stored with it (one study attribute, written once).

    Attributes:
        signature: the search space's identity (`BaseSearchSpace.signature()`).
        objective: ``throughput``, ``throughput-memory`` or ``throughput-cost``.
        trial_unit: ``layout`` or ``strategy``.
        runtime: the cost model's runtime name (or its class name for another cost model).
        model, cluster: their names; global_batch_size: sequences per step.
        model_spec, cluster_spec: the full specs (`to_dict()`), enough to rebuild both.
        cost_model: the version of the cost model that scored the trials (`CostModel.version`):
            a study is resumed only by the same one.
    """

    signature: dict[str, Any] = field(default_factory=dict)
    objective: str = "throughput"
    trial_unit: str = "layout"
    runtime: str | None = None
    model: str | None = None
    cluster: str | None = None
    global_batch_size: int | None = None
    model_spec: dict[str, Any] | None = None
    cluster_spec: dict[str, Any] | None = None
    cost_model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StudyMeta:
        """From a stored record (keys this version does not know are ignored)."""
        data = data or {}
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def differences(self, other: StudyMeta) -> list[str]:
        """What differs from `other`, one line per field."""
        return [
            f"{f.name}: stored {getattr(self, f.name)!r}, now {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def load_model(self) -> "ModelSpec":
        """The model this study searched for."""
        from autosearch.core.model_spec import ModelSpec

        if self.model_spec:
            return ModelSpec.from_dict(self.model_spec)
        if self.model:
            return ModelSpec.load(self.model)
        raise SpecError("the study does not record its model; pass --model")

    def load_cluster(self) -> "Cluster":
        """The cluster this study searched for."""
        from autosearch.core.hardware import Cluster

        if self.cluster_spec:
            return Cluster.from_dict(self.cluster_spec)
        if self.cluster:
            return Cluster.parse(self.cluster)
        raise SpecError("the study does not record its cluster; pass --cluster")


@dataclass(frozen=True)
class LoadedStudy:
    """A tuner study opened for reading: the Optuna study, its metadata, its storage."""

    study: "optuna.Study"
    meta: StudyMeta
    storage: "OpenedStorage"

    def candidates(self, *, top_k: int) -> list[Candidate]:
        return read_candidates(self.study.get_trials(deepcopy=False), top_k=top_k)


def report_from_dict(data: dict[str, Any]) -> "CostReport":
    """Rebuild a CostReport from `CostReport.to_dict(flat=False)`."""
    from autosearch.core.report import CostReport

    return CostReport.from_dict(data)


def candidate_of(trial: "FrozenTrial") -> Candidate | None:
    """The strategy a finished trial kept, with its report (None if it holds none)."""
    from autosearch.core.strategy import Strategy

    attrs = trial.user_attrs
    if ATTR_STRATEGY not in attrs or ATTR_REPORT not in attrs:
        return None
    return Candidate(
        Strategy.from_dict(attrs[ATTR_STRATEGY]),
        report_from_dict(attrs[ATTR_REPORT]),
        trial.number,
        tuple(trial.values or ()),
    )


def _feasible(trial: "FrozenTrial") -> bool:
    excess = trial.constraints.get(CONSTRAINT)
    if excess is None:
        excess = trial.user_attrs.get(ATTR_REPORT, {}).get("memory_excess_bytes", 0.0)
    return excess <= 0


def read_candidates(trials: "list[FrozenTrial]", *, top_k: int | None) -> list[Candidate]:
    """The `top_k` (None: all) best distinct strategies that fit, best first.

    Order (`_ranking.py`, the one rule of the project): the first objective value (tokens per
    second, or its pessimistic end), higher first; a tie (equal to 12 significant digits) goes to
    less peak memory, then bf16 before fp16 before fp32, then fewer parallel axes, then the
    earlier trial. A Strategy scored by several trials (two workers, a resumed run) is listed
    once, under its earliest trial. Only the trials that can enter the list are parsed, so this
    stays fast on studies of 10^5 trials.
    """
    from optuna.trial import TrialState

    from autosearch.tuning._ranking import same_value, tie_key

    done = [
        t
        for t in trials
        if t.state == TrialState.COMPLETE and t.values and ATTR_STRATEGY in t.user_attrs
    ]
    done = [t for t in done if _feasible(t)]
    done.sort(key=lambda t: (-t.values[0], t.number))
    picked: dict[Any, Candidate] = {}
    i = 0
    while i < len(done) and (top_k is None or len(picked) < top_k):
        j = i + 1
        while j < len(done) and same_value(done[j].values[0], done[i].values[0]):
            j += 1
        tied = scored(c for c in (candidate_of(t) for t in done[i:j]) if c is not None)
        tied.sort(key=lambda cr: tie_key(cr[0].strategy, cr[1], cr[0].trial_number))
        for c, r in tied:
            if r.fits and c.strategy not in picked:
                picked[c.strategy] = c
        i = j
    ranked = list(picked.values())
    return ranked if top_k is None else ranked[:top_k]


def least_hungry(trials: "list[FrozenTrial]") -> Candidate | None:
    """The completed trial closest to fitting in memory (None if there is none)."""
    from optuna.trial import TrialState

    done = [t for t in trials if t.state == TrialState.COMPLETE and ATTR_REPORT in t.user_attrs]
    if not done:
        return None
    best = min(done, key=lambda t: (t.user_attrs[ATTR_REPORT]["peak_memory_bytes"], t.number))
    return candidate_of(best)


def load_study(where: str | os.PathLike, storage: str | None = None) -> LoadedStudy:
    """A tuner study from its output folder, or from a study name and a storage.

    Args:
        where: the folder `tune` wrote (holding ``study.journal`` or ``study.db``), or, with
            `storage`, the study's name.
        storage: an Optuna storage URL or file; None: `where` is an output folder.

    Raises:
        SpecError: no such folder, study or storage; the message says what to pass instead.
    """
    import optuna

    from autosearch.tuning._storage import DEFAULT_FILENAME, open_study_storage

    where = os.fspath(where)
    name = None
    if storage is None:
        if not os.path.isdir(where):
            raise SpecError(
                f"--study {where!r} is not a folder; give the tuner's --out folder, or a study "
                "name together with --storage"
            )
        found = [
            os.path.join(where, f)
            for f in (DEFAULT_FILENAME, "study.db")
            if os.path.exists(os.path.join(where, f))
        ]
        if not found:
            raise SpecError(
                f"{where!r} holds no study ({DEFAULT_FILENAME}); was it written by "
                "`autosearch tune --out`?"
            )
        storage = found[0]
    else:
        name = where
    opened = open_study_storage(storage)
    if opened is None:  # only a storage of None opens as none, and `where` named one
        raise SpecError(f"{where!r} names no storage; give a study folder or a storage URL")
    names = [s.study_name for s in opened.storage.get_all_studies()]
    if name is None:
        if len(names) != 1:
            raise SpecError(
                f"{opened.description} holds {len(names)} studies ({', '.join(names)}); pass "
                "--storage and the study name"
            )
        name = names[0]
    elif name not in names:
        raise SpecError(
            f"no study {name!r} in {opened.description}; it holds: {', '.join(names) or 'none'}"
        )
    study = optuna.load_study(study_name=name, storage=opened.storage)
    return LoadedStudy(study, StudyMeta.from_dict(study.user_attrs.get(META_ATTR)), opened)
