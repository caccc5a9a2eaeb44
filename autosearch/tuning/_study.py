"""The Optuna study: sample strategies, score them with the cost model, persist, resume, share.

How a run works (`tune`):

1. The sampler works against an in-memory copy of the study ("shadow"); Optuna's per-operation
   storage writes (one per parameter, attribute and state change) would otherwise cost more than
   the sampling itself (see `_storage.py` for the figures).
2. Each finished trial is written to the persistent storage at once, whole, in one
   `create_new_trial` (parameters, values, constraint, the full CostReport). So a run killed at
   any moment loses only the trial in flight, and never leaves a half-written or eternally
   RUNNING trial behind.
3. A run first loads every finished trial of the persistent study into its shadow, and stops when
   the study holds `n_trials` finished trials: running the same command again resumes, and running
   it on a finished study does no new work. Several processes on one storage each persist their
   own trials (the storage numbers them, so none is duplicated or lost) and regularly pull the
   others' trials into their sampler.

What a trial is (`trial_unit`): with ``"layout"`` (the default for the throughput objective) a
trial samples the layout (tp, pp, micro-batch size, pipeline schedule) and scores every
combination of recompute x sequence parallel x ZeRO x amp of that layout (at most 72 cost-model
calls, ~2 ms, well below the ~10 ms Optuna spends per trial), keeping the best that fits. This
shrinks what the sampler must learn from ~20,000 strategies to a few hundred layouts. With
``"strategy"`` (always for multi-objective studies, which need every point) a trial is one strategy.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from optuna.trial import TrialState

from autosearch.core.errors import SpecError
from autosearch.tuning._objectives import CONSTRAINT, GiB, Objective, make_objective
from autosearch.tuning._recipes import recipes as make_recipes
from autosearch.tuning._result import Candidate, NoFeasibleStrategyError, TuneResult
from autosearch.tuning._storage import DEFAULT_FILENAME, describe_storage, open_storage

if TYPE_CHECKING:  # pragma: no cover

    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from search_spaces import BaseSearchSpace

SAMPLERS = ("tpe", "nsga2", "random", "exhaustive")
TRIAL_UNITS = ("layout", "strategy")
SYNC_INTERVAL_S = {"journal": 0.0, "memory": math.inf, "rdb": 2.0}
_FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
_COMPLETE = (TrialState.COMPLETE,)
_ATTR_STRATEGY, _ATTR_REPORT, _ATTR_WORKER, _ATTR_GROUP = (
    "strategy",
    "report",
    "worker",
    "group_size",
)
_ATTR_META = "autosearch"  # study attribute: what the study searches


def tune(
    model: "ModelSpec | str",
    cluster: "Cluster | str",
    *,
    global_batch_size: int,
    space: "BaseSearchSpace | str | os.PathLike | dict | None" = None,
    objective: str = "throughput",
    n_trials: int | None = 200,
    sampler: str | None = None,
    storage: Any = None,
    study_name: str | None = None,
    seed: int | None = None,
    top_k: int = 5,
    runtime: str = "torch",
    price_per_gpu_hour: float | None = None,
    trial_unit: str | None = None,
    use_recipes: bool = True,
    out: "str | os.PathLike | None" = None,
    progress: "bool | Callable[[int, int, float | None], None]" = False,
) -> TuneResult:
    """Search the fastest strategy that fits, with Optuna and the analytic cost model.

    Args:
        model: a ModelSpec or catalog name / YAML path.
        cluster: a Cluster or ``GPU:NODESxGPUS``.
        global_batch_size: sequences per optimizer step.
        space: a search space object, a space YAML (path or shipped name such as ``megatron``), a
            dict of pins (``{"tp": 8}``), or None for ``search_spaces/default.yaml``.
        objective: ``throughput`` (default), ``throughput-memory`` or ``throughput-cost``
            (needs `price_per_gpu_hour`).
        n_trials: finished trials the study should hold in the end (a resumed study runs only the
            rest); None with the exhaustive sampler means every layout or strategy.
        sampler: ``tpe`` (constrained TPE), ``nsga2`` (constrained NSGA-II), ``random`` or
            ``exhaustive`` (Optuna's brute force). None: exhaustive when `n_trials` covers every
            layout (or strategy) of the space, else tpe for one objective and nsga2 for two.
        storage: None (in memory, or ``<out>/study.journal`` when `out` is given), an Optuna storage,
            an RDB URL (``sqlite:///x.db``, ``postgresql://...``) or a ``.journal`` / ``.db`` path.
        study_name: defaults to ``<model>_<gpu>-<nodes>x<gpus>_gbs<batch>_<objective>``.
        seed: sampler seed (give parallel workers different seeds, or none).
        top_k: how many distinct strategies to keep in `top_k` and ``top_k.csv``.
        runtime: cost-model runtime, ``torch`` or ``megatron-sc21``.
        price_per_gpu_hour: dollars per device-hour, for cost per token.
        trial_unit: ``layout`` or ``strategy`` (see the module docstring); default ``layout`` for
            the throughput objective, ``strategy`` otherwise.
        use_recipes: enqueue the usual recipes (tp in a node, pp as memory needs, FSDP) first.
        out: folder for trials.csv, top_k.csv, best_strategy.yaml and report.md (None: no files).
        progress: True for a progress bar on stderr, or a callable(done, total, best_tokens_per_s).

    Returns:
        TuneResult with `best_strategy`, `best_report`, `top_k` and `study`.

    Raises:
        SpecError: bad arguments, or a stored study that belongs to another space or objective.
        NoFeasibleStrategyError: nothing in the space fits in memory (after writing the outputs);
            the message says how far the least hungry strategy is from fitting.

    Example:
        >>> from autosearch import tune
        >>> result = tune("llama3-8b", "h100-sxm:8x8", global_batch_size=512, n_trials=30, seed=0)
        >>> result.best_report.fits
        True
    """
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from cost_models.analytic import AnalyticCostModel

    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    model, cluster = ModelSpec.load(model), Cluster.parse(cluster)
    space = _resolve_space(space, model, cluster, global_batch_size)
    obj = make_objective(objective, cluster=cluster, price_per_gpu_hour=price_per_gpu_hour)
    unit = trial_unit or ("strategy" if obj.is_multi else "layout")
    if unit not in TRIAL_UNITS:
        raise SpecError(f"unknown trial_unit {trial_unit!r}; choose layout or strategy")
    n_units = space.n_groups if unit == "layout" else space.size
    if sampler is None:  # a budget that covers the whole space enumerates it; else TPE / NSGA-II
        small = n_trials is not None and n_units <= n_trials and not obj.is_multi
        sampler_name = "exhaustive" if small else ("nsga2" if obj.is_multi else "tpe")
    else:
        sampler_name = sampler
    if sampler_name not in SAMPLERS:
        raise SpecError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if unit == "layout" and obj.is_multi:
        raise SpecError(
            f"trial_unit=layout keeps one strategy per layout, which would hide most of the "
            f"Pareto front of {obj.name}; use trial_unit=strategy"
        )
    if n_trials is None and sampler_name != "exhaustive":
        raise SpecError(
            "n_trials=None (run until the space is exhausted) needs sampler=exhaustive"
        )
    if n_trials is not None and (
        isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1
    ):
        raise SpecError(f"n_trials must be a positive integer, got {n_trials!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise SpecError(f"top_k must be a positive integer, got {top_k!r}")
    cost_model = AnalyticCostModel(model, cluster, runtime=runtime)
    study_name = study_name or default_study_name(
        model.name, cluster.name, global_batch_size, obj.name
    )
    if out is not None and storage is None:
        storage = os.path.join(os.fspath(out), DEFAULT_FILENAME)

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    persistent_storage = open_storage(storage)
    shadow = optuna.create_study(
        directions=list(obj.directions), sampler=_make_sampler(sampler_name, seed=seed)
    )
    meta = {
        "signature": space.signature(),
        "objective": obj.name,
        "trial_unit": unit,
        "runtime": cost_model.runtime.name,
        "model": model.name,
        "cluster": cluster.name,
        "global_batch_size": global_batch_size,
        # what `autosearch validate --study` needs to rebuild the model and the cluster
        "model_spec": model.to_dict(),
        "cluster_spec": cluster.to_dict(),
    }
    if persistent_storage is None:
        persistent = shadow
        persistent.set_user_attr(_ATTR_META, meta)
    else:
        persistent = optuna.create_study(
            storage=persistent_storage,
            study_name=study_name,
            directions=list(obj.directions),
            load_if_exists=True,
        )
        _check_or_set_meta(persistent, meta, study_name, storage)
    runner = _Runner(
        space=space,
        cost_model=cost_model,
        objective=obj,
        unit=unit,
        shadow=shadow,
        persistent=persistent,
        storage_kind=_storage_kind(persistent_storage),
    )
    timings["setup_s"] = time.perf_counter() - t_start

    t0 = time.perf_counter()
    runner.sync()
    target = n_trials if n_trials is not None else n_units
    if sampler_name == "exhaustive":
        target = min(target, n_units)
    if use_recipes and runner.n_finished == 0:
        for s in make_recipes(space, cost_model):
            shadow.enqueue_trial(space.params_of(s, group=unit == "layout"), skip_if_exists=True)
    bar = _ProgressBar(target) if progress is True else (progress or None)
    n_new = runner.run(target, progress=bar)
    if isinstance(bar, _ProgressBar):
        bar.close()
    timings["search_s"] = time.perf_counter() - t0

    if out is None:
        result = _collect(runner, top_k=top_k, n_new=n_new, out=out, timings=timings)
    else:
        from autosearch.tuning._outputs import outputs_lock, write_outputs

        # Workers sharing a folder take turns: each reads the study and writes every file under the
        # lock, so the last writer always holds the freshest state.
        t0 = time.perf_counter()
        with outputs_lock(os.fspath(out)):
            result = _collect(runner, top_k=top_k, n_new=n_new, out=out, timings=timings)
            write_outputs(
                result,
                runner.records(),
                out_dir=os.fspath(out),
                meta={
                    **meta,
                    "study_name": study_name,
                    "storage": describe_storage(storage),
                    "sampler": sampler_name,
                    "seed": seed,
                    "n_trials_target": target,
                    "space": _describe(space),
                },
            )
        timings["outputs_s"] = time.perf_counter() - t0
    nothing_fits = not result.pareto if obj.is_multi else result.best_strategy is None
    if nothing_fits:
        raise NoFeasibleStrategyError(_no_fit_message(runner, result), result=result)
    return result


# ---------------------------------------------------------------------------------------------------
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
        persistent,
        storage_kind: str,
    ):
        self.space, self.cost_model, self.objective, self.unit = space, cost_model, objective, unit
        self.shadow, self.persistent = shadow, persistent
        self.in_memory = persistent is shadow
        self.worker = uuid.uuid4().hex[:12]
        self.sync_interval_s = SYNC_INTERVAL_S[storage_kind]
        self._seen: set[int] = set()  # persistent trial ids already in the shadow
        self._finished = 0  # finished trials in the persistent study (as of the last sync)
        self._last_sync = -math.inf

    @property
    def n_finished(self) -> int:
        return self._finished

    def sync(self) -> None:
        """Pull finished trials of other workers (and of earlier runs) into the shadow."""
        if self.in_memory:
            self._finished = len(self.shadow.get_trials(deepcopy=False, states=_FINISHED))
            return
        trials = self.persistent.get_trials(deepcopy=False, states=_FINISHED)
        new = [t for t in trials if t._trial_id not in self._seen]
        for t in new:
            self._seen.add(t._trial_id)
        foreign = [t for t in new if t.user_attrs.get(_ATTR_WORKER) != self.worker]
        if foreign:
            self.shadow.add_trials(foreign)
        self._finished = len(trials)
        self._last_sync = time.monotonic()

    def run(self, target: int, *, progress) -> int:
        """Run trials until the persistent study holds `target` finished ones (or the sampler has
        nothing left, as BruteForceSampler does when it has seen every combination)."""
        self.sync()
        if self._finished >= target:
            return 0
        state = {"new": 0, "best": self._best_value()}

        def after_trial(study, frozen) -> None:
            if (
                frozen.state == TrialState.COMPLETE
                and frozen.constraints.get(CONSTRAINT, 0.0) <= 0
            ):
                best = state["best"]
                state["best"] = frozen.values[0] if best is None else max(best, frozen.values[0])
            self._persist(frozen)
            state["new"] += 1
            if time.monotonic() - self._last_sync >= self.sync_interval_s:
                self.sync()
            if progress is not None:
                progress(min(self._finished, target), target, state["best"])
            if self._finished >= target:
                study.stop()

        def objective(trial):
            values, constraint = self._evaluate(trial)
            trial.set_constraint(CONSTRAINT, constraint)
            return values if len(values) > 1 else values[0]

        # A ValueError from the cost model (e.g. a precision the hardware has no peak for) fails
        # that trial, is recorded with its message, and the study goes on.
        self.shadow.optimize(
            objective,
            n_trials=target - self._finished,
            callbacks=[after_trial],
            catch=(ValueError,),
            gc_after_trial=False,
            show_progress_bar=False,
        )
        return state["new"]

    def _evaluate(self, trial) -> tuple[tuple[float, ...], float]:
        group = (
            self.space.suggest_group(trial)
            if self.unit == "layout"
            else (self.space.suggest(trial),)
        )
        best_s, best_r = None, None
        for s in group:
            r = self.cost_model.estimate(s, validate=False)
            if self.objective.better(r, best_r):
                best_s, best_r = s, r
        trial.set_user_attr(_ATTR_STRATEGY, best_s.to_dict())
        trial.set_user_attr(_ATTR_REPORT, best_r.to_dict(flat=False))
        trial.set_user_attr(_ATTR_WORKER, self.worker)
        trial.set_user_attr(_ATTR_GROUP, len(group))
        return self.objective.values(best_r), best_r.memory_excess_bytes / GiB

    def _persist(self, frozen) -> None:
        if self.in_memory:
            self._finished += 1
            return
        storage, study_id = self.persistent._storage, self.persistent._study_id
        trial_id = storage.create_new_trial(study_id, template_trial=frozen)
        self._seen.add(trial_id)
        self._finished += 1

    def _best_value(self) -> float | None:
        values = [
            t.values[0]
            for t in self.shadow.get_trials(deepcopy=False, states=_COMPLETE)
            if t.constraints.get(CONSTRAINT, 0.0) <= 0
        ]
        return max(values) if values else None

    def records(self) -> list[dict[str, Any]]:
        """Every finished trial of the persistent study, as flat dicts for the CSV."""
        from autosearch.tuning._outputs import trial_row

        trials = self.persistent.get_trials(deepcopy=False, states=_FINISHED)
        return [trial_row(t, self.objective) for t in sorted(trials, key=lambda t: t.number)]


def _collect(runner: _Runner, *, top_k: int, n_new: int, out, timings) -> TuneResult:
    from autosearch.core.strategy import Strategy

    trials = runner.persistent.get_trials(deepcopy=False, states=_COMPLETE)
    cands: dict[Strategy, Candidate] = {}
    for t in sorted(trials, key=lambda t: t.number):
        if _ATTR_STRATEGY not in t.user_attrs:
            continue
        s = Strategy.from_dict(t.user_attrs[_ATTR_STRATEGY])
        if s not in cands:
            cands[s] = Candidate(
                s, report_from_dict(t.user_attrs[_ATTR_REPORT]), t.number, tuple(t.values)
            )
    feasible = [c for c in cands.values() if c.report.fits]
    feasible.sort(
        key=lambda c: (-c.report.tokens_per_s, c.report.peak_memory_bytes, c.trial_number)
    )
    pareto: tuple[Candidate, ...] = ()
    if runner.objective.is_multi:
        pareto = tuple(
            sorted(_pareto(feasible, runner.objective), key=lambda c: -c.report.tokens_per_s)
        )
    least = None
    if not feasible and cands:
        least = min(cands.values(), key=lambda c: c.report.peak_memory_bytes)
    best = feasible[0] if feasible else None
    message = (
        f"best {best.strategy.short()}: {best.report.tokens_per_s:,.0f} tokens/s, MFU {best.report.mfu:.1%}, "
        f"{best.report.peak_memory_bytes / GiB:.1f} of {best.report.memory_capacity_bytes / GiB:.1f} GiB"
        if best
        else "no strategy fits"
    )
    return TuneResult(
        best_strategy=best.strategy if best else None,
        best_report=best.report if best else None,
        top_k=tuple(feasible[:top_k]),
        study=runner.persistent,
        space=runner.space,
        objective=runner.objective.name,
        n_trials=runner.n_finished,
        n_new_trials=n_new,
        pareto=pareto,
        least_hungry=least,
        out_dir=os.fspath(out) if out is not None else None,
        message=message,
        timings=timings,
    )


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
    """How far the least hungry strategy of the whole space is from fitting (exhaustive scan of
    peak memory when the space is small enough, else the least hungry strategy tried)."""
    space, cm = runner.space, runner.cost_model
    cluster = space.cluster
    where = "tried"
    least_s, least_r = (
        (result.least_hungry.strategy, result.least_hungry.report)
        if result.least_hungry
        else (None, None)
    )
    n_fit = 0
    if space.size <= 2_000_000:
        where = f"of all {space.size:,} in the space"
        for s in space.enumerate():
            r = cm.estimate(s, validate=False)
            n_fit += r.fits
            if least_r is None or r.peak_memory_bytes < least_r.peak_memory_bytes:
                least_s, least_r = s, r
    if n_fit:
        return (
            f"none of the {result.n_trials} trials found a strategy that fits, but {n_fit:,} strategies of the "
            f"space fit; run more trials (--n-trials) or the exhaustive sampler"
        )
    if least_r is None:
        return "no trial finished; nothing to report"
    return (
        f"no strategy fits in memory: {space.model.name} ({space.model.n_params / 1e9:.1f} B parameters) on "
        f"{cluster.name} at global batch {space.global_batch_size}. The least memory-hungry strategy {where}, "
        f"{least_s.short()}, needs {least_r.peak_memory_bytes / GiB:.1f} GiB per device: "
        f"{least_r.memory_excess_bytes / GiB:.1f} GiB over the {least_r.memory_capacity_bytes / GiB:.1f} GiB "
        f"of a {cluster.profile.name} (x{least_r.peak_memory_bytes / least_r.memory_capacity_bytes:.2f}). "
        f"Use more nodes, GPUs with more memory, or widen the space (zero_stage 3, recompute full, larger pp)"
    )


def report_from_dict(data: dict[str, Any]):
    """Rebuild a CostReport from `CostReport.to_dict(flat=False)`."""
    from autosearch.core.report import CostReport

    return CostReport.from_dict(data)


def default_study_name(model: str, cluster: str, global_batch_size: int, objective: str) -> str:
    """``llama3-70b_h100-sxm-32x8_gbs512_throughput`` (safe as a folder name)."""
    raw = f"{model}_{cluster}_gbs{global_batch_size}_{objective}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw.replace(":", "-"))


def _resolve_space(space, model, cluster, global_batch_size) -> "BaseSearchSpace":
    from search_spaces import BaseSearchSpace, SearchSpace

    if isinstance(space, BaseSearchSpace):
        if (
            space.model != model
            or space.cluster != cluster
            or space.global_batch_size != global_batch_size
        ):
            raise SpecError(
                f"the search space was built for {space.model.name} on {space.cluster.name} at global batch "
                f"{space.global_batch_size}, not {model.name} on {cluster.name} at {global_batch_size}"
            )
        return space
    if isinstance(space, dict):
        return SearchSpace(model, cluster, global_batch_size=global_batch_size, **space)
    return SearchSpace(model, cluster, global_batch_size=global_batch_size, config=space)


def _make_sampler(name: str, *, seed: int | None):
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.BruteForceSampler(seed=seed)


def _storage_kind(storage) -> str:
    if storage is None:
        return "memory"
    import optuna

    return "journal" if isinstance(storage, optuna.storages.JournalStorage) else "rdb"


def _check_or_set_meta(study, meta: dict[str, Any], study_name: str, storage) -> None:
    """Record what the study searches (one attribute, written in one operation, so a concurrent
    worker never sees half of it) and refuse to continue a study made for another search."""
    stored = study.user_attrs.get(_ATTR_META)
    if stored is None:
        study.set_user_attr(_ATTR_META, meta)
        stored = study.user_attrs.get(_ATTR_META, meta)  # another worker may have written first
    diffs = [
        f"{k}: stored {stored.get(k)!r}, now {v!r}" for k, v in meta.items() if stored.get(k) != v
    ]
    if diffs:
        raise SpecError(
            diffs,
            context=(
                f"study {study_name!r} in {describe_storage(storage)} was created for a different search; "
                "use another --study-name or --out folder, or the same arguments as the first run"
            ),
        )


def _describe(space) -> str:
    describe = getattr(space, "describe", None)
    return describe() if describe else f"{space.size} strategies"


class _ProgressBar:
    """A one-line progress bar on stderr, redrawn at most 10 times per second."""

    def __init__(self, total: int, *, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.start = time.perf_counter()
        self._last = 0.0

    def __call__(self, done: int, total: int, best: float | None) -> None:
        now = time.perf_counter()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        width = 30
        filled = int(width * done / max(total, 1))
        best_txt = f"best {best:,.0f} tok/s" if best is not None else "nothing fits yet"
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} trials  {best_txt}  "
            f"{now - self.start:.1f} s "
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
