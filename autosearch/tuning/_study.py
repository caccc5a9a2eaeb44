"""The Optuna study: sample strategies, score them with the cost model, persist, resume, share.

How a run works (`tune`):

1. The sampler works against an in-memory copy of the study ("shadow"); Optuna's per-operation
   storage writes (one per parameter, attribute and state change) would otherwise cost more than
   the sampling itself (see `_storage.py` for the figures). The shadow keeps only what a sampler
   reads (parameters, values, the memory constraint), not the cost reports.
2. Each finished trial is written to the persistent storage at once, whole, in one
   `create_new_trial` (parameters, values, constraint, the full CostReport), under the study
   lock together with the check of the trial count. So a run killed at any moment loses only the
   trial in flight, never leaves a half-written or eternally RUNNING trial behind, and several
   workers never finish more trials than asked.
3. A worker reads the study incrementally, by trial number (the storage numbers trials
   atomically, so each is read once, none twice): one bulk read when it starts, then only what
   other workers added. It stops when the study holds `n_trials` finished trials: running the
   same command again resumes, and running it on a finished study does no new work.
4. The exhaustive sampler scores every unit of the space once, in a fixed order: under the
   study lock a worker takes the first unit no trial holds yet, scores it and persists it. So
   any number of workers cover every layout exactly once, and a rerun scores what is missing.

What a trial is (`trial_unit`): with ``"layout"`` (the default for the throughput objective) a
trial samples the layout (tp, pp, micro-batch size, pipeline schedule) and scores every
combination of recompute x sequence parallel x ZeRO x amp of that layout (at most 72 cost-model
calls, ~2 ms, well below the ~10 ms Optuna spends per trial), keeping the best that fits. This
shrinks what the sampler must learn from ~20,000 strategies to a few hundred layouts. With
``"strategy"`` (always for multi-objective studies, which need every point) a trial is one
strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optuna.trial import TrialState

from autosearch.core.errors import SpecError
from autosearch.core.schema import read_progress
from autosearch.tuning._checks import (
    OUTPUT_FILES,
    check_other_study,
    check_output_folder,
    check_storage_url,
    storage_errors,
)
from autosearch.tuning._config import SAMPLERS, TuneConfig, _study_name
from autosearch.tuning._margin import MemoryMargin, memory_margin
from autosearch.tuning._objectives import CONSTRAINT, GiB, Objective, make_objective
from autosearch.tuning._outputs import claim_out_folder, outputs_lock, write_outputs
from autosearch.tuning._params import PlainParams, for_sampler, sampler_params
from autosearch.tuning._reader import (
    ATTR_ERROR,
    ATTR_GROUP,
    ATTR_REPORT,
    ATTR_STRATEGY,
    ATTR_WORKER,
    META_ATTR,
    StudyMeta,
    least_hungry,
    read_candidates,
)
from autosearch.tuning._recipes import recipes as make_recipes
from autosearch.tuning._result import Candidate, NoFeasibleStrategyError, TuneResult
from autosearch.tuning._storage import (
    DEFAULT_FILENAME,
    OpenedStorage,
    StudyOptions,
    describe_storage,
    open_study_storage,
)

if TYPE_CHECKING:  # pragma: no cover
    import optuna

    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from cost_models import CostModel
    from search_spaces import BaseSearchSpace

_FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
SHADOW_RENEW = 1000
ATTR_LOCAL = "autosearch:local"  # a trial of the local search (not a start of the next climb)


def tune(
    config: "TuneConfig | ModelSpec | str | None" = None,
    cluster: "Cluster | str | None" = None,
    /,
    *,
    cost_model: "CostModel | Callable[[ModelSpec, Cluster], CostModel] | None" = None,
    progress: "bool | Callable[[int, int, float | None], None]" = False,
    options: StudyOptions | None = None,
    **settings: Any,
) -> TuneResult:
    """Search the fastest strategy that fits, with Optuna and a cost model.

    ``tune(config)`` runs the job a `TuneConfig` describes, as ``autosearch tune`` does: it
    checks every input before any work, and with `TuneConfig.out` it writes the same folder
    (trials.csv, top_k.csv, best_strategy.yaml, report.md, study.yaml with the config, the files
    for other runtimes). ``tune(model, cluster, **settings)`` builds the TuneConfig from
    keywords (its fields; see `TuneConfig` for each).

    Args:
        config: a TuneConfig; or the model (a ModelSpec or catalog name / YAML path), with
            `cluster` and the other fields as keywords (``model=`` and ``cluster=`` work too).
        cluster: a Cluster or ``GPU:NODESxGPUS`` (only with a model).
        cost_model: a `cost_models.CostModel` for this model and cluster, or a factory
            ``(model, cluster) -> CostModel``; None: the analytic model with the config's
            `runtime`.
        progress: True for the space on stdout and a progress bar on stderr, or a
            ``callable(done, total, best_tokens_per_s)``.
        options: where the study lives (`StudyOptions`: storage, study_name, out), instead of
            those keywords.
        settings: with a model, the TuneConfig fields as keywords. Three also take objects
            that have no file form (the study.yaml of such a run records no ``config``):
            ``space`` a search space (or a dict of pins), ``sampler`` an Optuna sampler (a
            `BruteForceSampler` means exhaustive), ``storage`` an Optuna storage.

    Returns:
        TuneResult with `best_strategy`, `best_report`, `top_k`, `study` and `config`.

    Raises:
        SpecError: a bad setting, an output folder that cannot take the outputs or holds
            another study's, or a stored study made for another search.
        NoFeasibleStrategyError: nothing in the space fits in memory (after writing the outputs);
            the message says how far the least hungry strategy is from fitting.

    Example:
        >>> from autosearch import TuneConfig, tune
        >>> config = TuneConfig(model="llama3-8b", cluster="h100-sxm:8x8", global_batch_size=512,
        ...                     n_trials=30, seed=0)
        >>> tune(config).best_report.fits
        True
    """
    import optuna

    t_start = time.perf_counter()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    progress = read_progress(progress, "progress")
    config, objects = _config_of(config, cluster, options, settings)
    job = prepare(config, cost_model=cost_model, **objects)
    with storage_errors(describe_storage(job.storage)):
        return _run(job, progress=progress, setup_s=time.perf_counter() - t_start)


def _config_of(
    config: Any, cluster: Any, options: StudyOptions | None, settings: dict[str, Any]
) -> tuple[TuneConfig, dict[str, Any]]:
    """(TuneConfig, the objects given for space / sampler / storage) from tune's arguments."""
    import optuna

    from search_spaces import BaseSearchSpace

    kinds = {
        "space": BaseSearchSpace,
        "sampler": optuna.samplers.BaseSampler,
        "storage": optuna.storages.BaseStorage,
    }
    if options is not None:
        settings = _with_options(options, settings)
    objects = {
        k: settings.pop(k) for k, kind in kinds.items() if isinstance(settings.get(k), kind)
    }
    if isinstance(settings.get("space"), dict):  # pins, as `space={"tp": 8}`
        settings["pin"] = settings.pop("space")
    if isinstance(config, TuneConfig):
        if cluster is not None or settings:
            given = ", ".join(["cluster"] * (cluster is not None) + sorted(settings))
            raise SpecError(
                f"tune(config) takes its settings from the TuneConfig, not also {given}; "
                "change the config with config.replace(...)"
            )
        return config, objects
    if config is not None:
        settings["model"] = config
    if cluster is not None:
        settings["cluster"] = cluster
    try:
        return TuneConfig(**settings), objects
    except TypeError as exc:  # an unknown keyword: say which ones exist
        names = ", ".join(f.name for f in dataclasses.fields(TuneConfig))
        raise TypeError(f"{exc}; tune takes model, cluster and {names}") from None


@dataclass(frozen=True, kw_only=True)
class TuneJob:
    """A tuning job with every input read and checked, and nothing written yet (`prepare`).

    Attributes:
        config: the TuneConfig as run (`record` is its study.yaml form).
        model, cluster, space, objective, cost_model: what the search runs on.
        unit: ``layout`` or ``strategy``; n_units: how many the space holds.
        sampler_name, sampler: the sampler's name, and the sampler the in-memory study uses.
        target: finished trials (exhaustive: units covered) the sampler's trials fill the
            study to (a plan's `total`, when it has one, also counts the climbs').
        plan: what the plan rule chose (the budget rule, or --n-trials), when no sampler was
            given.
        opened: why each dimension a runtime may lack is searched or not (`SpaceConfig.resolved`;
            empty for a space object given whole).
        margin: the device memory held back (`memory_margin`): a strategy fits only within
            the rest.
        study_name, out, storage: where the study and its outputs go.
        record: the config block of study.yaml: the settings with names resolved and paths made
            absolute (None when objects without a file form were given).
    """

    config: TuneConfig
    model: "ModelSpec"
    cluster: "Cluster"
    space: "BaseSearchSpace"
    objective: Objective
    cost_model: "CostModel"
    unit: str
    n_units: int
    sampler_name: str
    sampler: "optuna.samplers.BaseSampler"
    target: int
    plan: "SearchPlan | None"
    opened: tuple
    margin: MemoryMargin
    study_name: str
    out: str | None
    storage: Any
    record: dict[str, Any] | None


def prepare(
    config: TuneConfig,
    *,
    cost_model: Any = None,
    space: "BaseSearchSpace | None" = None,
    sampler: "optuna.samplers.BaseSampler | None" = None,
    storage: Any = None,
) -> TuneJob:
    """Read and check every input of `config` (and of the objects given for it), write nothing.

    The budget rule (`plan_search`) runs here when neither n_trials nor a sampler is given.
    """
    from autosearch.core.hardware import Cluster

    no_file_form = any(x is not None for x in (cost_model, space, sampler, storage))
    model = _load_model(config.model, seq_len=config.seq_len, lora=config.lora())
    cluster = Cluster.parse(
        config.cluster, strict=True, nnodes=config.nnodes, gpus_per_node=config.gpus_per_node
    )
    gbs = config.global_batch_size
    if space is not None and (config.space is not None or config.pin):
        raise SpecError("give the search space once: a space object, or space and pin")
    cm = _resolve_cost_model(cost_model, model, cluster, config.runtime)
    runtime = getattr(cm, "runtime", config.runtime)
    space, opened = _resolve_space(space, model, cluster, gbs, config, runtime)
    margin = memory_margin(runtime, cluster, override=config.memory_margin)
    obj = make_objective(
        config.objective, cluster=cluster, price_per_gpu_hour=config.price_per_gpu_hour
    )
    unit = config.trial_unit or ("strategy" if obj.is_multi else "layout")
    if unit == "layout" and obj.is_multi:
        raise SpecError(
            f"trial_unit=layout keeps one strategy per layout, which would hide most of the "
            f"Pareto front of {obj.name}; use trial_unit=strategy"
        )
    n_units = space.n_groups if unit == "layout" else space.size
    name = config.study_name or default_study_name(model, cluster.name, gbs, obj.name)
    out = config.out
    if config.storage is not None and storage is not None:
        raise SpecError("give the storage once: a storage object, or storage")
    storage = storage if storage is not None else config.storage
    if isinstance(storage, str):
        check_storage_url(storage)
    if out is not None and storage is None:
        storage = os.path.join(out, DEFAULT_FILENAME)
    if out is not None:  # before any work, so nothing is computed and then lost
        check_output_folder(out, files=OUTPUT_FILES)
        check_other_study(out, name)
        claim_out_folder(out, study_name=name, storage=describe_storage(storage))
    n_trials, plan = config.n_trials, None
    sampler_arg: Any = sampler if sampler is not None else config.sampler
    if sampler_arg is None:
        plan = plan_search(
            space,
            unit=unit,
            multi=obj.is_multi,
            budget_s=config.time_budget,
            n_trials=config.n_trials,
        )
        n_trials = plan.n_trials
        sampler_arg = "exhaustive" if plan.exhaustive else ("nsga2" if obj.is_multi else "tpe")
    sampler_name, shadow_sampler = _resolve_sampler(
        sampler_arg, n_trials, n_units, obj, config.seed
    )
    if n_trials is None:
        n_trials = n_units if sampler_name == "exhaustive" else DEFAULT_TRIALS
    target = min(n_trials, n_units) if sampler_name == "exhaustive" else n_trials
    record = None
    if not no_file_form:
        record = _record(config, model=model, cluster=cluster, study_name=name, out=out)
    return TuneJob(
        config=config,
        model=model,
        cluster=cluster,
        space=space,
        objective=obj,
        cost_model=cm,
        unit=unit,
        n_units=n_units,
        sampler_name=sampler_name,
        sampler=shadow_sampler,
        target=target,
        plan=plan,
        opened=opened,
        margin=margin,
        study_name=name,
        out=out,
        storage=storage,
        record=record,
    )


def _record(config: TuneConfig, *, model, cluster, study_name: str, out: str | None) -> dict:
    """The config block of study.yaml: `config` with the names this run resolved and its
    paths absolute, so that ``autosearch tune --config OUT/study.yaml`` runs it again from any
    folder (a model or cluster read from a file is written out whole)."""
    space, storage = config.space, config.storage
    if space is not None and os.path.exists(space):
        space = os.path.abspath(space)
    if storage is not None and "://" not in storage:
        storage = os.path.abspath(storage)
    ran = config.replace(
        model=model,
        cluster=cluster,
        nnodes=None,
        gpus_per_node=None,
        study_name=study_name,
        out=os.path.abspath(out) if out is not None else None,
        space=space,
        storage=storage,
    )
    return ran.to_dict()


def _run(job: TuneJob, *, progress, setup_s: float) -> TuneResult:
    """Open the study, run the trials, write the outputs (the body of `tune`)."""
    import optuna

    if progress is True:
        print(f"searching {_describe(job.space)}", flush=True)
    timings: dict[str, float] = {"setup_s": setup_s}
    opened = open_study_storage(job.storage, shared_ok=job.config.storage_shared_ok)
    meta = StudyMeta(
        signature=job.space.signature(),
        objective=job.objective.name,
        trial_unit=job.unit,
        runtime=_runtime_name(job.cost_model),
        model=job.model.name,
        cluster=job.cluster.name,
        global_batch_size=job.config.global_batch_size,
        # what `autosearch validate --study` needs to rebuild the model and the cluster
        model_spec=job.model.to_dict(),
        cluster_spec=job.cluster.to_dict(),
        cost_model=getattr(job.cost_model, "version", type(job.cost_model).__qualname__),
    )
    shadow = optuna.create_study(directions=list(job.objective.directions), sampler=job.sampler)
    runner = _Runner(
        space=job.space,
        cost_model=job.cost_model,
        objective=job.objective,
        unit=job.unit,
        shadow=shadow,
        opened=opened,
        study_name=job.study_name,
        meta=meta,
        exhaustive=job.sampler_name == "exhaustive",
        margin=job.margin,
    )
    t0 = time.perf_counter()
    runner.start()
    if job.config.use_recipes and runner.n_finished == 0 and job.sampler_name != "exhaustive":
        for s in make_recipes(job.space, job.cost_model):
            params = job.space.params_of(s, group=job.unit == "layout")
            shadow.enqueue_trial(params, skip_if_exists=True)
    bar = _ProgressBar(job.target) if progress is True else (progress or None)
    plan = job.plan
    if plan is not None and plan.budget_s:  # priced work, not a clock (`work_price`)
        runner.budget_s = plan.budget_s
    runner.trial_cap = plan.total if plan is not None else 0
    try:
        n_new = runner.run(job.target, progress=bar)
        if plan is not None and plan.local:
            local_bar = bar if isinstance(bar, _ProgressBar) else None  # its total is unknown
            if local_bar is not None:
                local_bar.phase(
                    f"local search (up to {plan.total:,} trials in all)"
                    if plan.total
                    else f"local search (budget {plan.budget_s:g} s)"
                )
            n_new += runner.local_search(progress=local_bar)
        if plan is not None and runner.n_finished < plan.total:  # the climbs ended first
            n_new += runner.run(plan.total, progress=bar)
    finally:
        if isinstance(bar, _ProgressBar):
            bar.close()
    timings["search_s"] = time.perf_counter() - t0
    runner.plan = _coverage_line(
        job.sampler_name, job.target, job.plan, runner, job.unit, job.n_units
    )
    runner.price_per_gpu_hour = job.config.price_per_gpu_hour
    config = TuneConfig.from_dict(job.record) if job.record is not None else job.config
    if job.out is None:
        result = _collect(runner, job, n_new=n_new, timings=timings, config=config)
    else:
        result = _write(job, runner, meta, n_new=n_new, timings=timings, config=config)
    nothing_fits = not result.pareto if job.objective.is_multi else result.best_strategy is None
    if nothing_fits:
        raise NoFeasibleStrategyError(_no_fit_message(runner, result), result=result)
    return result


def _write(job: TuneJob, runner, meta: StudyMeta, *, n_new, timings, config) -> TuneResult:
    """Every output file, from one snapshot of the study. Workers sharing a folder take turns:
    each writes every file under the lock, so the files agree with each other and the last
    writer always holds the freshest state."""
    from autosearch.export import write_exports

    assert job.out is not None
    run_meta = {
        **meta.to_dict(),
        "study_name": job.study_name,
        "storage": _describe_storage(runner.opened),
        "sampler": job.sampler_name,
        "seed": job.config.seed,
        "n_trials_target": (job.plan.total if job.plan is not None else 0) or job.target,
        "n_units": job.n_units,
        "space": _describe(job.space),
        "plan": job.plan.reason if job.plan else None,
        "price_per_gpu_hour": job.config.price_per_gpu_hour,
        "config": job.record,  # `autosearch tune --config OUT/study.yaml` runs it again
    }
    t0 = time.perf_counter()
    with outputs_lock(job.out):
        trials = checked_values(runner.all_trials(), runner, job.config.top_k)
        result = _collect(runner, job, n_new=n_new, timings=timings, config=config, trials=trials)
        write_outputs(result, trials, out_dir=job.out, meta=run_meta)
        if result.best_strategy is not None:  # what each runtime takes, beside best_strategy
            write_exports(job.out, result.best_strategy, model=job.model, cluster=job.cluster)
    timings["outputs_s"] = time.perf_counter() - t0
    return result


# -------------------------------------------------------------------------------------------------
class _Runner:
    """The ask-score-tell-persist loop of one worker process."""

    def __init__(
        self,
        *,
        space,
        cost_model,
        objective: Objective,
        unit: str,
        shadow,
        opened: OpenedStorage | None,
        study_name: str,
        meta: StudyMeta,
        exhaustive: bool,
        margin: MemoryMargin | None = None,
    ):
        self.space, self.cost_model, self.objective, self.unit = space, cost_model, objective, unit
        self.margin = margin or MemoryMargin(0.0, "none")
        self.shadow, self.opened, self.study_name, self.meta = shadow, opened, study_name, meta
        self.exhaustive = exhaustive
        self.worker = uuid.uuid4().hex[:12]
        self.storage = opened.storage if opened is not None else None
        self.study_id = -1  # the study's id in the storage, set by `start` (with a storage)
        self._next_number = 0  # trial numbers below this have been read
        self._finished = 0  # finished trials in the study, as of the last read
        self._covered: set[tuple] = set()  # units held by a trial (exhaustive mode)
        self._best: float | None = None
        self._units: list[dict[str, Any]] | None = None
        self._unit_cursor = 0
        # Random sampling and the exhaustive order read no history: their shadow is renewed
        # every SHADOW_RENEW trials, so its memory and Optuna's per-ask scan of it stay flat.
        import optuna

        self.history_free = self.storage is not None and (
            exhaustive or isinstance(shadow.sampler, optuna.samplers.RandomSampler)
        )
        self._in_shadow = 0
        self.plan = ""
        self.price_per_gpu_hour: float | None = None
        # the stored trials' parameters (plain names: `_params.py`) and what the trial in
        # flight scored: its group of strategies and the one it kept
        self.plain = PlainParams(space) if self.storage is not None else None
        self._scored: tuple[tuple, Any] = ((), None)
        self._best_of: dict[tuple, tuple[Any, Any]] = {}  # unit -> its best (strategy, report)
        self._group_size: dict[tuple, int] = {}
        self.local_layouts = 0  # layouts the local search scored
        # the default plan's time budget, which stops the local search, and whether it did;
        # the work done so far, priced in seconds (`work_price`: not read off a clock)
        self.budget_s: float | None = None
        self.work_s = 0.0
        self.trial_cap = 0  # --n-trials: the local search stops when the study holds this many
        self.price = work_price(space.model)
        self.stopped = False
        # where the space splits layers unevenly (the runtime can), a layout's best strategy is
        # scored again with the pipeline split that balances its blocks' cost
        # (`AnalyticCostModel.balanced_split`): unequal blocks, the embedding and the logits
        config = getattr(space, "config", None)  # a listed space has none: no refinement
        self._balance = bool(getattr(config, "uneven_pipeline", False)) and hasattr(
            cost_model, "balanced_split"
        )

    @property
    def n_finished(self) -> int:
        return self._finished

    @property
    def n_covered(self) -> int:
        return len(self._covered)

    def lock(self):
        if self.opened is None:
            return contextlib.nullcontext()
        return self.opened.lock(self.study_name)

    # ---- the study in storage --------------------------------------------------------------
    def start(self) -> None:
        """Create or load the study (under the lock: workers started together on a fresh
        storage must not race), check it was made for this search, read what it holds."""
        if self.storage is None:
            self.shadow.set_user_attr(META_ATTR, self.meta.to_dict())
            return
        from optuna.exceptions import DuplicatedStudyError

        storage, where = self.storage, self.opened.description if self.opened else ""
        with self.lock():
            try:
                self.study_id = storage.get_study_id_from_name(self.study_name)
            except KeyError:
                try:
                    self.study_id = storage.create_new_study(
                        list(self.shadow.directions), study_name=self.study_name
                    )
                except DuplicatedStudyError:  # created meanwhile by a worker without our lock
                    self.study_id = storage.get_study_id_from_name(self.study_name)
            directions = storage.get_study_directions(self.study_id)
            if list(directions) != list(self.shadow.directions):
                raise SpecError(
                    f"study {self.study_name!r} in {where} optimizes "
                    f"{[d.name.lower() for d in directions]}, not {self.objective.name}; use "
                    "another --study-name or --out folder"
                )
            stored = storage.get_study_user_attrs(self.study_id).get(META_ATTR)
            if stored is None:
                storage.set_study_user_attr(self.study_id, META_ATTR, self.meta.to_dict())
            else:
                diffs = StudyMeta.from_dict(stored).differences(self.meta)
                if diffs and all(d.startswith("cost_model:") for d in diffs):
                    raise SpecError(
                        f"study {self.study_name!r} in {where} was scored by another version of "
                        "the cost model (autosearch was updated, or the hardware profile "
                        "recalibrated), and resuming it would mix two models' predictions; use "
                        "another --study-name or --out folder, or delete the study to score "
                        "the search again"
                    )
                if diffs:
                    raise SpecError(
                        diffs,
                        context=(
                            f"study {self.study_name!r} in {where} was created "
                            "for a different search; use another --study-name or --out folder, "
                            "or the same arguments as the first run"
                        ),
                    )
            # one bulk read; afterwards only new trial numbers are read
            for t in sorted(
                storage.get_all_trials(self.study_id, deepcopy=False), key=lambda t: t.number
            ):
                self._ingest(t)

    def sync(self) -> None:
        """Read the trials other workers (and this one) added since the last read."""
        if self.storage is None:
            return
        storage, study_id = self.storage, self.study_id
        while True:
            try:
                trial_id = storage.get_trial_id_from_study_id_trial_number(
                    study_id, self._next_number
                )
            except KeyError:
                return
            self._ingest(storage.get_trial(trial_id))

    def _ingest(self, t) -> None:
        """Count one stored trial once (by its number) and show it to the sampler."""
        if t.number < self._next_number:
            return
        self._next_number = t.number + 1
        if t.state not in _FINISHED:
            return
        self._finished += 1
        if self.exhaustive:
            self._covered.add(_key(sampler_params(t)))
        if t.state == TrialState.COMPLETE and t.values and t.constraints.get(CONSTRAINT, 0) <= 0:
            self._best = t.values[0] if self._best is None else max(self._best, t.values[0])
        if t.user_attrs.get(ATTR_WORKER) != self.worker and not self.history_free:
            self.shadow.add_trial(for_sampler(t))

    def all_trials(self) -> list:
        """Every finished trial of the study, by number (one snapshot)."""
        if self.storage is None:
            trials = self.shadow.get_trials(deepcopy=False, states=_FINISHED)
        else:
            trials = self.storage.get_all_trials(self.study_id, deepcopy=False, states=_FINISHED)
        return sorted(trials, key=lambda t: t.number)

    def study(self):
        import optuna

        if self.storage is None:
            return self.shadow
        return optuna.load_study(study_name=self.study_name, storage=self.storage)

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, target: int, *, progress) -> int:
        """Run trials until the study holds `target` finished ones (exhaustive: until `target`
        units are covered, or every unit is). Returns how many this worker persisted."""
        if self.exhaustive:
            return self._run_exhaustive(target, progress=progress)
        new = 0
        while self._finished < target:
            self._renew_shadow_if_due()
            if not self._one_trial(target):
                break
            new += 1
            if progress is not None:
                progress(min(self._finished, target), target, self._best)
        return new

    def _run_exhaustive(self, target: int, *, progress) -> int:
        """Score the units no trial holds yet, in the space's fixed order, `EXHAUSTIVE_BATCH`
        per turn of the study lock: sync, score a unit, persist it, next; the storage is
        flushed to the disk once per turn. No sampler is asked: the unit's parameters are
        known, so a trial is built whole (`optuna.trial.create_trial`) and stored."""
        new = 0
        while True:
            batch = (
                self.opened.batched_writes()
                if self.opened is not None
                else contextlib.nullcontext()
            )
            with self.lock(), batch:
                self.sync()
                for _ in range(EXHAUSTIVE_BATCH):
                    params = self._next_unit() if self.n_covered < target else None
                    if params is None:
                        return new
                    frozen, attrs = self._score_unit(params)
                    if not self._persist(frozen, attrs, target):
                        return new
                    new += 1
                    if progress is not None:
                        progress(min(self.n_covered, target), target, self._best)

    def _spent(self) -> bool:
        """Whether the time budget is spent (and if so, note that the search stopped)."""
        self.stopped = self.budget_s is not None and self.work_s >= self.budget_s
        return self.stopped

    def _renew_shadow_if_due(self) -> None:
        if self.history_free and self._in_shadow >= SHADOW_RENEW:
            import optuna

            self.shadow = optuna.create_study(
                directions=list(self.shadow.directions), sampler=self.shadow.sampler
            )
            self._in_shadow = 0

    def _one_trial(self, target: int) -> bool:
        self._in_shadow += 1
        trial = self.shadow.ask()
        try:
            values, constraint, attrs = self._evaluate(trial)
        except ValueError as exc:  # e.g. a precision the hardware has no peak for: recorded
            frozen = self.shadow.tell(trial, state=TrialState.FAIL)
            attrs = {ATTR_ERROR: str(exc), ATTR_WORKER: self.worker}
        else:
            trial.set_constraint(CONSTRAINT, constraint)
            if self.storage is None:  # the shadow is the study: it keeps the report
                for k, v in attrs.items():
                    trial.set_user_attr(k, v)
            frozen = self.shadow.tell(trial, values if len(values) > 1 else values[0])
        return self._persist(frozen, attrs, target)

    def _score_unit(
        self, params: dict[str, Any], *, mark: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """One unit of the space scored as a finished trial (in memory, it joins the study),
        with the user attributes `mark` added."""
        import optuna

        fixed = optuna.trial.FixedTrial(params, number=self._finished)
        try:
            values, constraint, attrs = self._evaluate(fixed)
            attrs.update(mark or {})
        except ValueError as exc:  # e.g. a precision the hardware has no peak for: recorded
            frozen = optuna.trial.create_trial(
                state=TrialState.FAIL, params=fixed.params, distributions=fixed.distributions
            )
            attrs = {ATTR_ERROR: str(exc), ATTR_WORKER: self.worker, **(mark or {})}
        else:
            frozen = optuna.trial.create_trial(
                values=values,
                params=fixed.params,
                distributions=fixed.distributions,
                user_attrs=attrs if self.storage is None else None,
                constraints={CONSTRAINT: constraint},
            )
        if self.storage is None:  # the shadow is the study
            self.shadow.add_trial(frozen)
        return frozen, attrs

    def local_search(self, *, progress=None) -> int:
        """Climb from the best layouts of the study's sampled trials to local optima
        (`_local.py`), scoring each neighbour no trial holds yet as a trial of the study (marked
        `ATTR_LOCAL`). The climbs go best first: of the climbs not ended, the one standing on
        the fastest layout moves next, so a search stopped at its time budget (`deadline`)
        has spent its time where the optimum most likely is.
        Where a climb steps on a layout another climb stood on, it ends (its path from there is
        known). Steepest ascent from a layout always takes the same path, so the order changes
        neither where the climbs end nor what they score (short of `MAX_STEPS`), only what is
        scored first. The climbs are deterministic from their starts, which come from the
        sampled trials only: on a finished study they retrace their paths and score nothing,
        and a study stopped at its deadline goes on where it stopped. Returns the trials this
        worker persisted."""
        from autosearch.core.strategy import Strategy
        from autosearch.tuning._local import MAX_STEPS, LayoutIndex, climb_starts, layout_key

        index = LayoutIndex(self.space.layouts(), self.space.cluster.world_size)
        value: dict[tuple, float | None] = {}  # a layout's best throughput (None: none fits)
        sampled: dict[tuple, float] = {}
        covered: set[tuple] = set()
        for t in self.all_trials():
            covered.add(_key(sampler_params(t)))
            kept = t.user_attrs.get(ATTR_STRATEGY)
            if t.state == TrialState.COMPLETE and kept is not None:
                fits = t.constraints.get(CONSTRAINT, 0) <= 0
                key = layout_key(Strategy.from_dict(kept))
                value[key] = t.values[0] if fits else None
                if fits and not t.user_attrs.get(ATTR_LOCAL):
                    sampled[key] = t.values[0]
        self.local_layouts = 0
        new, climbed = 0, set()
        # (-throughput, start order, steps taken, layout): the fastest climb first
        heap = [(-sampled[k], i, 0, k) for i, k in enumerate(climb_starts(sampled))]
        heapq.heapify(heap)
        while heap:
            _, i, steps, here = heapq.heappop(heap)
            if here in climbed:
                continue
            climbed.add(here)
            around = index.neighbours(index.by_key[here])
            scored, done = self._score_layouts(around, covered, value)
            new += scored
            if progress is not None:
                progress(self.local_layouts, 0, self._best)
            if not done:  # the budget is spent: what is scored stays in the study
                break
            best = max(
                (index.key(o) for o in around if value.get(index.key(o)) is not None),
                key=lambda k: value[k],  # type: ignore[arg-type, return-value]
                default=None,
            )
            if best is None or steps + 1 >= MAX_STEPS:
                continue
            up, now = value[best], value[here]
            if up is not None and now is not None and up > now:
                heapq.heappush(heap, (-up, i, steps + 1, best))
        return new

    def _score_layouts(self, layouts, covered: set, value: dict) -> tuple[int, bool]:
        """Score every layout of `layouts` that no trial holds yet, as trials of the study, until
        the time budget is spent. Returns (trials persisted, whether every layout was scored)."""
        from autosearch.core.strategy import Strategy
        from autosearch.tuning._local import layout_key

        new = 0
        cap = self.trial_cap or math.inf  # --n-trials: the study's count, climbs included
        opened = self.opened
        batch = opened.batched_writes() if opened is not None else contextlib.nullcontext()
        with self.lock(), batch:
            self.sync()
            for layout in layouts:
                params = self.space.params_of(next(self.space.strategies_of(layout)), group=True)
                if _key(params) in covered:
                    continue
                if self._spent() or self._finished >= cap:
                    return new, False
                covered.add(_key(params))
                frozen, attrs = self._score_unit(params, mark={ATTR_LOCAL: True})
                if not self._persist(frozen, attrs, cap):
                    return new, False
                new += 1
                self.local_layouts += 1
                kept = attrs.get(ATTR_STRATEGY)
                if frozen.state == TrialState.COMPLETE and kept is not None:
                    fits = frozen.constraints.get(CONSTRAINT, 0) <= 0
                    value[layout_key(Strategy.from_dict(kept))] = (
                        frozen.values[0] if fits else None
                    )
        return new, True

    def _balanced(self, strategy) -> Any:
        """`strategy` with the pipeline split that balances its blocks' cost, or None (pp 1, the
        split it has, or a space that keeps pipelines even)."""
        if not self._balance or strategy.pp == 1 or strategy.pipeline_split is not None:
            return None
        split = self.cost_model.balanced_split(strategy)
        return None if split is None else strategy.replace(pipeline_split=split)

    def estimate(self, strategy) -> Any:
        """The cost model's report of `strategy`, with the memory margin held back."""
        r = self.cost_model.estimate(strategy, validate=False)
        return r.with_margin(self.margin.fraction * r.memory_capacity_bytes)

    def _evaluate(self, trial) -> tuple[tuple[float, ...], float, dict[str, Any]]:
        self._scored = ((), None)
        # A sampler proposes a unit again (TPE repeats its best layouts): the same group scores
        # the same, so its best is kept rather than built and scored twice.
        group: tuple = ()
        layout = None
        if self.unit != "layout":
            group = (self.space.suggest(trial),)
        elif hasattr(self.space, "suggest_layout"):
            layout = self.space.suggest_layout(trial)
        else:
            group = self.space.suggest_group(trial)
        unit = _key(trial.params)
        if unit in self._best_of:
            best_s, best_r = self._best_of[unit]
        else:
            if layout is not None:
                group = tuple(self.space.strategies_of(layout))
            self._scored = (group, None)
            best_s, best_r = None, None
            for s in group:
                r = self.estimate(s)
                if self.objective.better(r, best_r, s, best_s):
                    best_s, best_r = s, r
            if best_s is None or best_r is None:  # recorded as a failed trial
                raise ValueError("the trial's group of strategies is empty")
            balanced = self._balanced(best_s)
            if balanced is not None:
                r = self.estimate(balanced)
                if self.objective.better(r, best_r, balanced, best_s):
                    best_s, best_r = balanced, r
            self.work_s += self.price(len(group) + (balanced is not None))
            if not self.exhaustive:  # an exhaustive run scores each unit once
                self._best_of[unit] = (best_s, best_r)
                self._group_size[unit] = len(group)
        self._scored = (group, best_s)
        attrs = {
            ATTR_STRATEGY: best_s.to_dict(),
            ATTR_REPORT: best_r.to_dict(flat=False),
            ATTR_WORKER: self.worker,
            ATTR_GROUP: len(group) if group else self._group_size.get(unit, 0),
        }
        return self.objective.values(best_r), best_r.memory_excess_bytes / GiB, attrs

    def _persist(self, frozen, attrs: dict[str, Any], target: float) -> bool:
        """Store one finished trial whole, unless the study already holds `target` (checked and
        written under the study lock, so workers never overshoot)."""
        if self.storage is None:
            self._finished += 1
            if self.exhaustive:
                self._covered.add(_key(frozen.params))
            if frozen.state == TrialState.COMPLETE and frozen.constraints.get(CONSTRAINT, 0) <= 0:
                v = frozen.values[0]
                self._best = v if self._best is None else max(self._best, v)
            return True
        assert self.plain is not None
        group, kept = self._scored
        plain = self.plain.of(kept) if kept is not None else self.plain.shared_by(group)
        template = self.plain.stored_trial(frozen, plain, attrs)
        with self.lock():
            self.sync()
            done = self.n_covered if self.exhaustive else self._finished
            if done >= target:
                return False  # another worker finished the study meanwhile: drop ours
            self.storage.create_new_trial(self.study_id, template_trial=template)
            self.sync()  # reads our own trial back by its number (not shown to the sampler)
        return True

    def _next_unit(self) -> dict[str, Any] | None:
        """The first unit, in the space's fixed order, that no trial holds yet."""
        if self._units is None:
            self._units = _enumerate_units(self.space, group=self.unit == "layout")
        while self._unit_cursor < len(self._units):
            params = self._units[self._unit_cursor]
            if _key(params) not in self._covered:
                return params
            self._unit_cursor += 1
        return None


# ---- the budget rule ----------------------------------------------------------------------------
EXHAUSTIVE_BUDGET_S = 10.0
EXHAUSTIVE_BATCH = 64  # units scored per turn of the study lock (one fsync each turn)
DEFAULT_TRIALS = 200
# TPE trials before the local search (`_local.py`): the climbs reach the optimum from the basins
# 100 trials find (benchmarks/search_default.py: the misses of 200 trials alone in issue 10 all
# came from the right basin but the wrong layout)
CLIMB_TRIALS = 100
# With --n-trials N, a quarter of N are sampled (at least TPE's 10 random start-up trials, at
# most CLIMB_TRIALS) and the rest climbed. On the two cases of benchmarks/search_quality.py
# where TPE misses (Llama 3 70B on 256 H100s, Llama 3.1 405B on 1,024; 3 seeds), the worst
# regret at 200 trials: half sampled 15.4% / 10.0%, a quarter 0% / 2.7%, a tenth 0% / 2.7%;
# the same 200 all sampled by TPE 17.1% / 17.2%. Checked on other cases with
# benchmarks/search_default.py --n-trials 200.
COUNTED_STARTUP = 10
# Seconds Optuna and the default storage (a journal file) add per finished trial, around the
# cost model (benchmarks/storage_scale.py on the 2-core CI machine, rounded up: it was loaded;
# the exhaustive path flushes once per EXHAUSTIVE_BATCH trials). The budget prices every trial
# at this whatever the storage (in memory ~1 ms, SQLite ~15 ms, a database ~20 ms), so the
# same case plans and stops alike whichever storage holds it.
TRIAL_S = 0.002
# Seconds of one cost-model estimate as a trial spends them (every strategy of a layout in a
# row), dense and mixture-of-experts models: the medians of benchmarks/estimate_rate.py
# (results/estimate_rate.csv, 4 cases each: 44-52 us dense, 76-82 us MoE) on a 2-core Intel
# Xeon (Sapphire Rapids, AVX-512) at load 2.
ESTIMATE_S = {"dense": 47e-6, "moe": 78e-6}


def work_price(model):
    """``price(n) -> seconds``: what scoring one unit of `n` strategies costs the time budget.

    The budget is counted in work, priced with `ESTIMATE_S` and `TRIAL_S`, not read off a
    clock: the plan (exhaustive or sampled) and where the local search stops are then the same
    on every machine, busy or quiet, so `tune`, a sweep running its combinations in parallel
    processes and `Engine.tune` pick the same strategy for the same case, and the same command
    picks the same strategy every time. On a machine as fast as the reference, 10 s of budget
    take about 10 s; on a slower or busier one, longer.
    """
    per_estimate = ESTIMATE_S["moe" if getattr(model, "moe", None) is not None else "dense"]
    return lambda n: n * per_estimate + TRIAL_S


@dataclass(frozen=True)
class SearchPlan:
    """What the budget rule chose: `exhaustive` over every unit, or `n_trials` of a sampler,
    and why (`reason`, one line with the priced estimate)."""

    exhaustive: bool
    n_trials: int
    estimate_s: float
    reason: str
    local: bool = False  # the sampled trials are followed by the local search (`_local.py`)
    budget_s: float = 0.0  # the local search stops when the search's work reaches this (0: never)
    # --n-trials with the local search: the finished trials the study holds in all (the sampled
    # ones, the climbs', and sampled ones again if the climbs end first); 0: no count, the budget
    total: int = 0


def plan_search(
    space,
    *,
    unit: str,
    multi: bool,
    budget_s: float = EXHAUSTIVE_BUDGET_S,
    n_trials: int | None = None,
) -> SearchPlan:
    """Every layout when scoring them all fits the budget, else a sampler with `DEFAULT_TRIALS`.

    The price of scoring every unit is the space's strategies at `ESTIMATE_S` each plus
    `TRIAL_S` per trial (`work_price`): exact counts at a measured price, so the plan is the
    same wherever it runs and whatever storage holds the study. Within `budget_s`
    (`TuneConfig.time_budget`; 0 takes `EXHAUSTIVE_BUDGET_S`) and one objective, the search is
    exhaustive: exact, and no slower than the default number of sampled trials. Beyond it,
    with layouts as units, the sampled trials are followed by the local search, which stops
    when the search's priced work reaches `budget_s`. The exhaustive scan and the sampled
    trials run to their end: the one is exact, the other reproducible from its seed; the climb
    is what grows with the space.

    With `n_trials` (--n-trials, no --sampler) the count replaces the budget, and the search
    is the same one: every unit when the count covers the space; else, with layouts as units,
    a quarter of the count sampled (`COUNTED_STARTUP` to `CLIMB_TRIALS`) and the climbs until
    the study holds `n_trials` (sampled trials again if the climbs end first). TPE alone, the
    count all sampled, missed the optimum by 17% on Llama 3 70B and 405B at 200 trials
    (benchmarks/search_quality.py); `--sampler tpe` still runs it.
    """
    if n_trials is not None:
        return _plan_counted(space, unit=unit, multi=multi, n_trials=n_trials)
    limit = budget_s or EXHAUSTIVE_BUDGET_S
    n_units = space.n_groups if unit == "layout" else space.size
    estimate = space.size * ESTIMATE_S[_kind(space)] + n_units * TRIAL_S
    what = "layouts" if unit == "layout" else "strategies"
    price = (
        f"{space.size:,} strategies at {ESTIMATE_S[_kind(space)] * 1e6:.0f} us each + "
        f"{TRIAL_S * 1e3:.0f} ms per trial"
    )
    if not multi and (estimate <= limit or n_units <= DEFAULT_TRIALS):
        return SearchPlan(
            exhaustive=True,
            n_trials=n_units,
            estimate_s=estimate,
            reason=f"exhaustive: every one of the {n_units:,} {what} (all of them priced at "
            f"{estimate:.1f} s: {price}; budget {limit:g} s)",
        )
    why = (
        "two objectives"
        if multi
        else f"scoring all {n_units:,} {what} is priced at {estimate:.0f} s ({price}), over "
        f"the {limit:g} s budget"
    )
    local = unit == "layout" and not multi
    n_trials = CLIMB_TRIALS if local else DEFAULT_TRIALS
    return SearchPlan(
        exhaustive=False,
        n_trials=n_trials,
        estimate_s=estimate,
        budget_s=budget_s if local else 0.0,
        reason=f"sampled: {n_trials} trials"
        + (" and a local search from the best layouts" if local else "")
        + f" ({why}; --sampler exhaustive scores them all)",
        local=local,
    )


def _plan_counted(space, *, unit: str, multi: bool, n_trials: int) -> SearchPlan:
    """`plan_search` for a count of trials (--n-trials)."""
    n_units = space.n_groups if unit == "layout" else space.size
    what = "layouts" if unit == "layout" else "strategies"
    if not multi and n_units <= n_trials:
        return SearchPlan(
            exhaustive=True,
            n_trials=n_units,
            estimate_s=0.0,
            reason=f"exhaustive: every one of the {n_units:,} {what} (--n-trials {n_trials:,} "
            "covers the space)",
        )
    sampled = min(CLIMB_TRIALS, max(COUNTED_STARTUP, n_trials // 4))
    if multi or unit != "layout" or sampled >= n_trials:
        why = (
            "two objectives"
            if multi
            else "one strategy per trial"
            if unit != "layout"
            else f"no more than TPE's {COUNTED_STARTUP} random start-up trials"
        )
        return SearchPlan(
            exhaustive=False,
            n_trials=n_trials,
            estimate_s=0.0,
            reason=f"sampled: {n_trials:,} trials (--n-trials; {why}: no local search)",
        )
    return SearchPlan(
        exhaustive=False,
        n_trials=sampled,
        estimate_s=0.0,
        reason=f"sampled: {sampled:,} trials and a local search from the best layouts, "
        f"{n_trials:,} trials in all (--n-trials; --sampler tpe samples them all)",
        local=True,
        total=n_trials,
    )


def _kind(space) -> str:
    return "moe" if getattr(space.model, "moe", None) is not None else "dense"


def _coverage_line(sampler_name, target, plan, runner, unit, n_units) -> str:
    """What the search did and how much of the space it covered ({covered} is filled in)."""
    what = "layouts" if unit == "layout" else "strategies"
    head = plan.reason if plan is not None else f"{sampler_name}: {target:,} trials asked"
    local = (
        f", the local search scored {runner.local_layouts:,} of them"
        if plan is not None and plan.local
        else ""
    )
    if runner.stopped:
        local += (
            f"; the local search stopped at the {plan.budget_s:g} s time budget (the same "
            "command again goes on; --time-budget 0 runs the search to its end)"
        )
    return f"{head}; the study holds {{covered:,}} of the {n_units:,} {what}{local}"


def _key(params: dict[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def _enumerate_units(space, *, group: bool) -> list[dict[str, Any]]:
    """Every trial unit of the space once, in the space's enumeration order."""
    if group:
        return list(space.group_params())
    return [space.params_of(s) for s in space.enumerate()]


class RescoredTrialWarning(UserWarning):
    """Trials whose stored objective values their strategies do not score now (a study file
    edited by hand, or scored by another version of the cost model): ranked by what they score
    now."""


REL_RESCORE = 1e-9  # the cost model is deterministic: a stored value is its score, or was changed


def checked_values(trials: list, runner: "_Runner", top_k: int) -> list:
    """`trials` with the stored values that could rank (the top `top_k`, or the Pareto front)
    checked against what their strategies score now: a value that does not match is not
    trusted but rescored (the trial's values and report replaced, in this list only), until
    every candidate that ranks holds its own score; a `RescoredTrialWarning` names them."""
    import copy

    from autosearch.tuning._reader import read_candidates

    multi = runner.objective.is_multi
    trials = list(trials)
    where = {t.number: i for i, t in enumerate(trials)}
    checked: set[int] = set()
    changed: list[str] = []
    while True:
        ranked = read_candidates(trials, top_k=None if multi else top_k)
        shown = _pareto(ranked, runner.objective) if multi else ranked
        todo = [c for c in shown if c.trial_number is not None and c.trial_number not in checked]
        if not todo:
            break
        for c in todo:
            number = c.trial_number
            assert number is not None
            checked.add(number)
            trial = trials[where[number]]
            report = runner.estimate(c.strategy)
            now = runner.objective.values(report)
            stored = tuple(trial.values or ())
            if len(stored) == len(now) and all(
                abs(a - b) <= REL_RESCORE * max(abs(a), abs(b)) for a, b in zip(stored, now)
            ):
                continue
            fixed = copy.deepcopy(trial)
            fixed.values = list(now)
            fixed.set_user_attr(ATTR_REPORT, report.to_dict(flat=False))
            trials[where[number]] = fixed
            shown_values = [", ".join(f"{v:,.6g}" for v in vs) for vs in (stored, now)]
            changed.append(
                f"trial {trial.number} ({c.strategy.short()}): stored {shown_values[0]}, "
                f"scores {shown_values[1]}"
            )
    if changed:
        warnings.warn(
            f"{len(changed)} trial(s) of the study hold objective values their strategies do not "
            f"score now (a study file edited, or scored by another cost model); ranked by what "
            f"they score now: {'; '.join(changed[:5])}" + (" ..." if len(changed) > 5 else ""),
            RescoredTrialWarning,
            stacklevel=2,
        )
    return trials


def _collect(
    runner: _Runner, job: TuneJob, *, n_new: int, timings, config: TuneConfig, trials=None
) -> TuneResult:
    top_k = job.config.top_k
    trials = checked_values(runner.all_trials() if trials is None else trials, runner, top_k)
    ranked = read_candidates(trials, top_k=None if runner.objective.is_multi else top_k)
    pareto: tuple[Candidate, ...] = ()
    if runner.objective.is_multi:
        pareto = tuple(sorted(_pareto(ranked, runner.objective), key=_tokens_per_s, reverse=True))
    best = ranked[0] if ranked else None
    least = least_hungry(trials) if best is None else None
    message = "no strategy fits"
    if best is not None and best.report is not None:
        r = best.report
        message = (
            f"best {best.strategy.short()}: {r.tokens_per_s:,.0f} tokens/s, MFU {r.mfu:.1%}, "
            f"{r.peak_memory_bytes / GiB:.1f} of {r.memory_capacity_bytes / GiB:.1f} GiB"
        )
    covered = len({_key(sampler_params(t)) for t in trials})
    return TuneResult(
        best_strategy=best.strategy if best else None,
        best_report=best.report if best else None,
        top_k=tuple(ranked[:top_k]),
        study=runner.study(),
        space=runner.space,
        objective=runner.objective.name,
        n_trials=len(trials),
        n_new_trials=n_new,
        pareto=pareto,
        least_hungry=least,
        out_dir=job.out,
        message=message,
        timings=timings,
        n_units=job.n_units,
        n_units_covered=covered,
        plan=runner.plan.format(covered=covered),
        search=_search_kind(job, runner),
        price_per_gpu_hour=runner.price_per_gpu_hour,
        config=config,
        opened=job.opened,
        margin=job.margin,
    )


def _search_kind(job: TuneJob, runner: _Runner) -> str:
    """What the search did, in a few words (a sweep's `search` column)."""
    if job.sampler_name == "exhaustive":
        return "exhaustive" if runner.n_covered >= job.n_units else "exhaustive, partial"
    if job.plan is not None and job.plan.local:
        if runner.stopped:
            return f"{job.sampler_name} + local search, stopped at the time budget"
        return f"{job.sampler_name} + local search"
    return job.sampler_name


def _tokens_per_s(c: Candidate) -> float:
    return c.report.tokens_per_s if c.report is not None else 0.0


def _pareto(cands: list[Candidate], objective: Objective) -> list[Candidate]:
    signs = [1.0 if d == "maximize" else -1.0 for d in objective.directions]
    pts = [tuple(s * v for s, v in zip(signs, c.values)) for c in cands]
    front = []
    for i, p in enumerate(pts):
        dominated = any(all(q_ >= p_ for q_, p_ in zip(q, p)) and q != p for q in pts)
        if not dominated:
            front.append(cands[i])
    return front


def _no_fit_message(runner: _Runner, result: TuneResult) -> str:
    """Why nothing fits, how far the least memory-hungry strategy is, and the smallest cluster
    on which it fits (`autosearch.tuning._advice.no_fit_message`)."""
    from autosearch.tuning._advice import no_fit_message

    least = result.least_hungry
    return no_fit_message(
        runner.space,
        runner.cost_model,
        runner.margin,
        n_trials=result.n_trials,
        least_hungry=(least.strategy, least.report) if least and least.report else None,
    )


def default_study_name(
    model: "str | ModelSpec", cluster: str, global_batch_size: int, objective: str
) -> str:
    """``llama3-70b_h100-sxm-32x8_gbs512_throughput`` (safe as a folder name); a ModelSpec with
    LoRA adapters adds them (``llama3-70b-lora-r16-qkvogud_...``), so that a fine-tune and a
    full training run of one model are two studies."""
    if not isinstance(model, str):
        model = model.name + (f"-{model.lora.short()}" if model.lora is not None else "")
    raw = f"{model}_{cluster}_gbs{global_batch_size}_{objective}"
    name = re.sub(r"[^A-Za-z0-9._+=-]+", "-", raw.replace(":", "-")).lstrip("._-+=")
    return name[:200] or "study"


def check_study_name(name: Any) -> str:
    """A study name is a name, never a path: letters, digits and ``._+=-``, at most 200
    characters, starting with a letter or digit (so ``../x`` or ``/etc`` are refused)."""
    return _study_name(name, "study_name")


def _load_model(
    value: "ModelSpec | dict | str", *, seq_len: int | None = None, lora: dict | None = None
) -> "ModelSpec":
    """A ModelSpec from the config's model: a ModelSpec, its fields, a catalog name or a YAML
    file (whose path a message names), at `seq_len` tokens and with `lora` when given."""
    from autosearch.core.model_spec import ModelSpec

    if isinstance(value, dict):
        value = ModelSpec.from_dict(value, what="model (a mapping)")
    try:
        return ModelSpec.load(value, seq_len=seq_len, lora=lora)
    except SpecError as exc:
        if isinstance(value, str) and os.path.isfile(value) and value not in str(exc):
            raise SpecError(f"model file {value!r}: {exc}") from None
        raise


def _resolve_space(space, model, cluster, global_batch_size, config, runtime) -> tuple:
    """(the search space, why each dimension a runtime may lack is open or not): the space file
    (default: default.yaml) with the pins, its ``supported`` values resolved for the runtime on
    the cluster (`SpaceConfig.resolved`); refused when it asks what the runtime cannot run."""
    from autosearch.tuning._advice import offload_needed
    from search_spaces import SearchSpace, SpaceConfig
    from search_spaces._config import runtime_problems

    if space is not None:
        if (
            space.model != model
            or space.cluster != cluster
            or space.global_batch_size != global_batch_size
        ):
            raise SpecError(
                f"the search space was built for {space.model.name} on {space.cluster.name} at "
                f"global batch {space.global_batch_size}, not {model.name} on {cluster.name} at "
                f"{global_batch_size}"
            )
        return space, ()
    base = SpaceConfig.default() if config.space is None else SpaceConfig.from_yaml(config.space)
    base = base.narrowed(**config.pin) if config.pin else base
    resolved, opened = base.resolved(runtime=runtime, model=model, cluster=cluster, fp8=config.fp8)
    if resolved != base.resolved(  # a runtime that offloads: open it where nothing fits
        runtime=runtime, model=model, cluster=cluster, fp8=config.fp8, offload=True
    )[0] and offload_needed(
        model,
        cluster,
        runtime,
        global_batch_size=global_batch_size,
        config=resolved,
        margin_fraction=memory_margin(runtime, cluster, override=config.memory_margin).fraction,
    ):
        resolved, opened = base.resolved(
            runtime=runtime, model=model, cluster=cluster, fp8=config.fp8, offload=True
        )
    built = SearchSpace(model, cluster, global_batch_size=global_batch_size, config=resolved)
    fp8 = next((o for o in opened if o.name == "fp8"), None)
    if config.fp8 and fp8 is not None and fp8.values == ("none",):  # not the GPU: the runtime
        raise SpecError(f"fp8 asks to search float8 matmuls, but {_no_fp8(fp8)}")
    problems = runtime_problems(
        built.plain_choices(),
        uneven_pipeline=resolved.uneven_pipeline,
        runtime=runtime,
        cluster=cluster,
        ep_over_tp=resolved.ep_over_tp,
        model=model,
        etp_below_tp=resolved.etp_below_tp,
    )
    if problems:
        raise SpecError(problems, context="the search space asks what the runtime cannot run")
    return built, opened


def _no_fp8(note) -> str:
    """Why the space's fp8 is [none] whatever the GPU, and what to do (for --fp8). A GPU
    without fp8 units is not refused: its space keeps fp8 none by the rules, and the summary
    says fp8 was searched where the GPU has them (a sweep may mix GPUs)."""
    if note.why.startswith("as pinned"):
        return (
            "the space file or a pin keeps fp8 to [none]; drop that pin, or write fp8: "
            "supported (or the values) in the space file"
        )
    return f"{note.why.split('; ')[-1]}; use a runtime that runs fp8, or drop --fp8"


def _resolve_sampler(sampler, n_trials, n_units, obj: Objective, seed):
    """(name, the sampler the shadow study uses)."""
    import optuna

    if isinstance(sampler, optuna.samplers.BaseSampler):
        if isinstance(sampler, optuna.samplers.BruteForceSampler):
            return "exhaustive", optuna.samplers.RandomSampler(seed=seed)
        return type(sampler).__name__, sampler
    if sampler is None:  # a budget that covers the whole space enumerates it; else TPE / NSGA-II
        small = n_trials is not None and n_units <= n_trials and not obj.is_multi
        name = "exhaustive" if small else ("nsga2" if obj.is_multi else "tpe")
    else:
        name = sampler
    if name not in SAMPLERS:
        raise SpecError(
            f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}, or pass an "
            "optuna.samplers object"
        )
    if name == "tpe":
        return name, optuna.samplers.TPESampler(seed=seed)
    if name == "nsga2":
        return name, optuna.samplers.NSGAIISampler(seed=seed)
    # random, and exhaustive (every unit is enqueued with fixed parameters; nothing is sampled)
    return name, optuna.samplers.RandomSampler(seed=seed)


def _resolve_cost_model(cost_model, model, cluster, runtime) -> "CostModel":
    from cost_models import AnalyticCostModel, CostModel

    if cost_model is None:
        return AnalyticCostModel(model, cluster, runtime=runtime or "torch")
    if runtime is not None:
        raise SpecError(
            "pass either runtime (for the analytic cost model) or cost_model, not both; set the "
            "runtime on the cost model you pass"
        )
    cm = cost_model if isinstance(cost_model, CostModel) else None
    if cm is None and callable(cost_model):
        cm = cost_model(model, cluster)
    if not isinstance(cm, CostModel):
        raise SpecError(
            f"cost_model must be a cost_models.CostModel or a factory (model, cluster) -> "
            f"CostModel, got {type(cost_model).__name__}"
        )
    for name, mine, theirs in (
        ("model", model, getattr(cm, "model", model)),
        ("cluster", cluster, getattr(cm, "cluster", cluster)),
    ):
        if mine != theirs:
            raise SpecError(
                f"the cost model was built for another {name} ({getattr(theirs, 'name', theirs)})"
                f" than the search ({mine.name}); build it for the same one"
            )
    return cm


def _runtime_name(cm) -> str:
    runtime = getattr(cm, "runtime", None)
    return getattr(runtime, "name", None) or type(cm).__name__


def _with_options(options: StudyOptions, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with the fields of `options` (storage, study_name, out) added."""
    if not isinstance(options, StudyOptions):
        raise SpecError(f"options must be a StudyOptions, got {type(options).__name__}")
    given = {k: getattr(options, k) for k in ("storage", "study_name", "out")}
    given = {k: v for k, v in given.items() if v is not None}
    clash = [k for k in given if settings.get(k) is not None]
    if clash:
        raise SpecError(
            f"{', '.join(clash)} given both in options and as keywords; give each once"
        )
    return {**settings, **given}


def _describe_storage(opened: OpenedStorage | None) -> str:
    return "in memory (nothing persisted)" if opened is None else opened.description


def _describe(space) -> str:
    describe = getattr(space, "describe", None)
    return describe() if describe else f"{space.size} strategies"


class _ProgressBar:
    """Progress on stderr: on a terminal, one line redrawn at most 10 times per second; in a
    log (not a terminal), a plain line at most every `LOG_EVERY_S` seconds and at the end of
    each phase, so a log holds no carriage-return frames. `phase` starts the next phase (the
    local search, whose total is not known ahead: ``total`` 0)."""

    LOG_EVERY_S = 5.0

    def __init__(self, total: int, *, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.start = time.perf_counter()
        self._last = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._name = "trials"
        self._line = ""
        self._state: tuple[int, int, float | None] | None = None  # the last figures given
        self._drawn: tuple[int, int, float | None] | None = None  # the last figures shown

    def phase(self, name: str) -> None:
        self._end_line()
        self._name, self._last = name, 0.0

    def __call__(self, done: int, total: int, best: float | None) -> None:
        now = time.perf_counter()
        self._state = (done, total, best)
        final = bool(total) and done >= total
        if now - self._last < (0.1 if self._tty else self.LOG_EVERY_S) and not final:
            return
        self._last = now
        self._draw(now)

    def _draw(self, now: float) -> None:
        assert self._state is not None
        done, total, best = self._state
        best_txt = f"best {best:,.0f} tok/s" if best is not None else "nothing fits yet"
        if total:
            width = 30
            filled = int(width * done / max(total, 1))
            head = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {self._name}"
        else:
            head = f"{self._name}: {done} layouts scored"
        self._line = f"{head}  {best_txt}  {now - self.start:.1f} s"
        self.stream.write(f"\r{self._line} " if self._tty else self._line + "\n")
        self.stream.flush()
        self._drawn = self._state

    def _end_line(self) -> None:
        if self._state is not None and self._drawn != self._state:
            self._draw(time.perf_counter())  # the phase's last figures
        if self._tty and self._line:
            self.stream.write("\n")
            self.stream.flush()
        self._line, self._state, self._drawn = "", None, None

    def close(self) -> None:
        self._end_line()
