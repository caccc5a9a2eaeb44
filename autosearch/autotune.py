"""`Engine.tune`: the search, composed with the training Engine from above.

`autosearch.Engine` is the training Engine (`autosearch.engine.Engine`: fit, evaluate, predict,
save, load, cost, dataloader, prepare, run) with `tune`, which searches the strategy for the
machine the engine runs on (or a cluster it names), optionally checks the best candidates in
real runs, and trains with the winner. The search is `autosearch.tune`, run from the same
`TuneConfig` as ``autosearch tune`` and ``autosearch sweep``, so every door gives the same pick
for the same case. This module sits above the engine, the search and validation and composes
them, as torchtitan keeps its trainer below its launcher: nothing in `autosearch.engine` imports
the search or validation, and nothing below imports this module.

Under torchrun, rank 0 describes the machine, calibrates it if needed, searches and validates; the
other ranks wait, at most ``wait_timeout_s``, for the chosen strategy, so every rank ends with
the same one or with the same error.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.engine._engine import Engine as TrainingEngine
from autosearch.tuning._config import TuneConfig

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster, HardwareProfile
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.report import CostReport
    from autosearch.core.strategy import Strategy
    from autosearch.tuning._result import TuneResult
    from autosearch.validation import ValidationResult

CALIBRATION_DIR_ENV = "AUTOSEARCH_CALIBRATION_DIR"
DEFAULT_CALIBRATION_DIR = os.path.join("results", "calibration")


class Engine(TrainingEngine):
    """The training Engine (`autosearch.engine.Engine`) with `tune`: PaddlePaddle's
    auto-parallel Engine API in full. ``from autosearch import Engine`` gives this class."""

    def tune(
        self,
        train_data=None,
        config: TuneConfig | None = None,
        *,
        validate_top_k: int = 0,
        steps: int = 10,
        warmup: int = 3,
        timeout_s: float = 600.0,
        factory: str | None = None,
        calibration_dir: str | None = None,
        wait_timeout_s: float | None = None,
        verbose: int = 1,
        **settings: Any,
    ):
        """Find the fastest strategy for this model and train with it (sets ``strategy_``).

        The search is `autosearch.tune`, from a `TuneConfig` as ``autosearch tune`` and
        ``autosearch sweep`` run it: the same budget, seed and local search, so the same case
        gives the same pick through every door.

        Args:
            train_data: the training dataset; its samples' length must match the ModelSpec's
                seq_len.
            config: the search as a TuneConfig (its model must be this engine's ModelSpec); or
                give its fields as keywords (`settings`).
            validate_top_k: run the best k candidates for `warmup + steps` real steps on this
                machine (`autosearch.validation`) and keep the fastest measured one.
            factory: for validation of a model other than the reference transformer,
                ``"module:function"`` building it from its ModelSpec.
            calibration_dir: where this machine's calibrated profile is kept (searched with
                when no cluster is given).
            wait_timeout_s: under torchrun, how long ranks > 0 wait for rank 0's search.
            settings: without `config`, TuneConfig fields as keywords: ``cluster`` (default the
                engine's, else this machine: its calibrated profile, calibrated quickly first
                if there is none or if it fails its quality checks), ``global_batch_size`` (or
                ``batch_size``; default the current strategy's), ``out`` (default
                results/<study>), n_trials, time_budget, objective, space, seed, ... (`space`,
                `sampler` and `storage` may also be objects, as `autosearch.tune` takes them).

        Returns:
            The TuneResult on rank 0 (None on other ranks). Every rank ends with the same learned
            attributes: ``strategy_`` (what `fit` trains with) and ``best_strategy_`` (the same),
            ``best_report_`` (its predicted CostReport), ``tuned_cluster_`` (the cluster and
            hardware profile searched); on rank 0 also ``tune_result_`` and ``validation_`` (the
            real runs, if any). The constructor's ``strategy`` and ``cluster`` are not changed.

        Example:
            >>> engine = Engine(lambda: Transformer(spec), optimizer=...)      # doctest: +SKIP
            >>> engine.tune(data, batch_size=16, validate_top_k=2)             # doctest: +SKIP
            >>> engine.fit(data)                                               # doctest: +SKIP
        """
        from autosearch.engine import distributed as D
        from autosearch.engine.build import is_module

        if self._prepared and is_module(self.model):
            raise SpecError(
                "the engine was prepared with a model instance, which cannot be rebuilt for the"
                " tuned strategy; pass a zero-argument model factory to Engine"
            )
        if config is not None and not isinstance(config, TuneConfig):
            raise SpecError(
                f"config must be a TuneConfig, got {type(config).__name__}; or give its fields "
                "as keywords (engine.tune(data, cluster=..., global_batch_size=...))"
            )
        if config is not None and settings:
            raise SpecError(
                f"Engine.tune(config) takes its settings from the TuneConfig, not also "
                f"{', '.join(sorted(settings))}; change the config with config.replace(...)"
            )
        batch_size = settings.pop("batch_size", None)
        if batch_size is not None and "global_batch_size" in settings:
            raise SpecError("give batch_size or global_batch_size, not both (they are one)")
        batch_size = settings.pop("global_batch_size", batch_size)
        cluster = settings.pop("cluster", None)
        log = print if (verbose and D.is_rank0()) else (lambda _msg: None)
        request = TuneRequest(
            config=config,
            cluster=self.cluster if cluster is None else cluster,
            batch_size=batch_size,
            settings=settings,
            validate_top_k=validate_top_k,
            steps=steps,
            warmup=warmup,
            timeout_s=timeout_s,
            factory=factory,
            calibration_dir=calibration_dir,
            wait_timeout_s=wait_timeout_s,
        )
        outcome = tune_engine(
            request,
            model_spec=self._model_spec(),
            model=self.model,
            model_check=self._model_check(),
            strategy=getattr(self, "best_strategy_", None) or self.strategy,
            world_size=D.launched_world_size(),
            train_data=train_data,
            log=log,
        )
        self.strategy_ = self.best_strategy_ = outcome.strategy
        self.best_report_ = outcome.report
        self.tuned_cluster_ = outcome.cluster
        self.tune_result_ = outcome.result
        self.validation_ = outcome.validation
        self._prepared = False
        return outcome.result


@dataclass(frozen=True, kw_only=True)
class TuneOutcome:
    """What `tune_engine` found; the Engine keeps it in its learned attributes.

    Attributes:
        strategy: the strategy to train with (the best measured one when candidates were run,
            else the best predicted one); the same on every rank.
        report: the cost model's report of `strategy`, on the cluster searched.
        cluster: the cluster searched (its profile says which hardware numbers were used).
        result: the TuneResult of the search (rank 0 only; None on the other ranks).
        validation: the real runs of the top candidates, if any (rank 0 only).
    """

    strategy: "Strategy"
    report: "CostReport | None"
    cluster: "Cluster"
    result: "TuneResult | None" = None
    validation: "ValidationResult | None" = None


@dataclass(frozen=True, kw_only=True)
class TuneRequest:
    """What `Engine.tune` asks for, besides the engine's own model and strategy.

    Attributes:
        config: the whole search as a `TuneConfig` (its model must be the engine's); or None,
            and the search is built from `cluster`, `batch_size` and `settings`.
        cluster: the cluster to search for (a Cluster or its text); None: this machine.
        batch_size: the global batch to search for; None: the current strategy's.
        settings: `autosearch.TuneConfig` fields (n_trials, out, objective, space, seed, ...;
            `tune`'s keyword form, so `space` and `sampler` may also be objects).
        validate_top_k, steps, warmup, timeout_s, factory: the real runs of the best
            candidates (`autosearch.validation.validate`); none when `validate_top_k` is 0.
        calibration_dir: where this machine's calibrated profile is kept.
        wait_timeout_s: how long ranks > 0 wait for rank 0 (default: enough for a quick
            calibration, the search and every validation run at its timeout).
    """

    config: TuneConfig | None = None
    cluster: Any = None
    batch_size: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    validate_top_k: int = 0
    steps: int = 10
    warmup: int = 3
    timeout_s: float = 600.0
    factory: str | None = None
    calibration_dir: str | None = None
    wait_timeout_s: float | None = None

    def __post_init__(self) -> None:
        """The numbers of the real runs, checked as ``autosearch validate`` checks its flags,
        before any search (a negative timeout would run a candidate and record a timeout)."""
        from autosearch.core.schema import read_integer, read_positive

        seconds = read_positive("seconds", "600")
        object.__setattr__(
            self, "validate_top_k", read_integer(self.validate_top_k, "validate_top_k", 0, 1024)
        )
        object.__setattr__(self, "steps", read_integer(self.steps, "steps", 1, 1_000_000))
        object.__setattr__(self, "warmup", read_integer(self.warmup, "warmup", 0, 1_000_000))
        object.__setattr__(self, "timeout_s", seconds(self.timeout_s, "timeout_s"))
        if self.wait_timeout_s is not None:
            object.__setattr__(
                self, "wait_timeout_s", seconds(self.wait_timeout_s, "wait_timeout_s")
            )


def tune_engine(
    request: TuneRequest,
    *,
    model_spec: "ModelSpec",
    model: Any,
    model_check: "Callable[[Strategy], list[str]] | None" = None,
    strategy: Any,
    world_size: int,
    train_data: Any = None,
    log: Callable[[str], None] = print,
) -> TuneOutcome:
    """What `Engine.tune` does, from plain values.

    Args:
        request: the search and the real runs asked for.
        model_spec: the model's shape, which the search prices.
        model: the Engine's model argument (an nn.Module or a zero-argument factory): validation
            rebuilds the reference transformer without a factory; anything else needs a factory.
        strategy: the current strategy (a Strategy, YAML path, ``"dp=2"`` string, dict, or None):
            its global batch is the default batch size.
        world_size: processes of this run (torchrun's WORLD_SIZE, 1 without torchrun).
        train_data: the training data (its sequence length is checked against the ModelSpec).
        model_check: why the model refuses a strategy (its plan's check: a family's own
            refusals, e.g. Llama 4 under cp), or None: the pick is the best candidate it takes.
        log: where progress lines go.
    """
    from autosearch.engine import distributed as D

    D.init_distributed()
    search = dict(
        request=request,
        model_spec=model_spec,
        model=model,
        model_check=model_check,
        strategy=strategy,
        world_size=world_size,
        train_data=train_data,
        log=log,
    )
    if world_size == 1:
        return _search(**search)
    wait_timeout_s = request.wait_timeout_s
    if wait_timeout_s is None:
        wait_timeout_s = 900.0 + request.validate_top_k * (request.timeout_s + 60.0)
    return _search_on_rank0(search, rank=D.rank(), wait_timeout_s=wait_timeout_s, log=log)


def _search_on_rank0(
    search: dict[str, Any], *, rank: int, wait_timeout_s: float, log: Callable[[str], None]
) -> TuneOutcome:
    """Rank 0 searches; the others receive its answer (or its error) over a gloo group whose
    timeout bounds their wait, whatever backend the training uses."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_timeout_s))
    box: list[Any] = [None]
    outcome = None
    if rank == 0:
        log(
            f"tune: rank 0 searches; the other {search['world_size'] - 1} rank(s) wait for it "
            f"(at most {wait_timeout_s:.0f} s: Engine.tune(wait_timeout_s=...))"
        )
        try:
            outcome = _search(**search)
            box[0] = {"strategy": outcome.strategy, "report": outcome.report}
            box[0]["cluster"] = outcome.cluster
        except BaseException as exc:
            box[0] = {"error": str(exc), "spec_error": isinstance(exc, SpecError)}
            dist.broadcast_object_list(box, src=0, group=group)
            raise
        dist.broadcast_object_list(box, src=0, group=group)
        return outcome
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except RuntimeError as exc:  # gloo: "Timed out waiting ... for recv operation"
        raise TimeoutError(
            f"tune: rank {rank} waited {wait_timeout_s:.0f} s for rank 0 to calibrate, search "
            "and validate, and got no answer. Rank 0 may still be calibrating a new machine or "
            "running candidates: pass cluster=... (or calibrate once with `autosearch "
            "calibrate`), fewer validate_top_k, or a longer Engine.tune(wait_timeout_s=...)"
        ) from exc
    answer = box[0]
    if "error" in answer:
        if answer["spec_error"]:
            raise SpecError(answer["error"])
        raise RuntimeError(f"tune failed on rank 0: {answer['error']}")
    return TuneOutcome(
        strategy=answer["strategy"], report=answer["report"], cluster=answer["cluster"]
    )


# ---- the search (rank 0) -------------------------------------------------------------------
def _search(
    *,
    request: TuneRequest,
    model_spec: "ModelSpec",
    model: Any,
    model_check: "Callable[[Strategy], list[str]] | None" = None,
    strategy: Any,
    world_size: int,
    train_data: Any,
    log: Callable[[str], None],
) -> TuneOutcome:
    spec = model_spec
    check_sequence_length(train_data, spec.seq_len)
    config = request.config
    batch_size: int | None = request.batch_size
    if config is not None:
        _check_config_model(config, spec)
        batch_size = config.global_batch_size
        from autosearch.core.hardware import Cluster

        cluster = Cluster.parse(
            config.cluster, strict=True, nnodes=config.nnodes, gpus_per_node=config.gpus_per_node
        )
        config = config.replace(cluster=cluster, nnodes=None, gpus_per_node=None)
        request = dataclasses.replace(request, cluster=cluster)
    if batch_size is None:
        current = as_strategy(strategy)
        if current is None:
            raise SpecError(
                "tune needs batch_size, the global batch (sequences per optimizer step): "
                "engine.tune(train_data, batch_size=512)"
            )
        batch_size = current.global_batch_size
    cluster = _cluster_to_search(request, world_size, log)
    result = _run_search(spec, cluster, batch_size, config, request.settings, log)
    best, report = result.best_strategy, result.best_report
    validation = None
    if request.validate_top_k:
        validation = _validate(request, spec, model, cluster, result, log)
        if validation.best is not None:
            best, report = validation.best.strategy, validation.best.report
    assert best is not None  # tune raises NoFeasibleStrategyError when nothing fits
    if model_check is not None and model_check(best):
        best, report = _first_taken(best, result, model_check, log)
    return TuneOutcome(
        strategy=best, report=report, cluster=cluster, result=result, validation=validation
    )


def _first_taken(
    best: "Strategy",
    result: "TuneResult",
    model_check: "Callable[[Strategy], list[str]]",
    log: Callable[[str], None],
) -> tuple["Strategy", Any]:
    """The best candidate the model takes, where it refuses the search's pick (a family's own
    refusals, which the cost model does not know: Llama 4 under cp, etp on fused experts)."""
    refused = {best.short(): model_check(best)}
    for candidate in result.top_k:
        problems = model_check(candidate.strategy)
        if not problems:
            log(
                f"tune: the model refuses {best.short()} ({'; '.join(refused[best.short()])});"
                f" training with the next candidate it takes, {candidate.strategy.short()}"
            )
            return candidate.strategy, candidate.report
        refused[candidate.strategy.short()] = problems
    raise SpecError(
        [f"{name}: {'; '.join(problems)}" for name, problems in refused.items()],
        context="the model refuses every candidate the search kept; pin the dimension it "
        "refuses away (Engine.tune(..., pin={'cp': 1}) or TuneConfig(pin=...))",
    )


def _cluster_to_search(request: TuneRequest, world: int, log: Callable[[str], None]) -> "Cluster":
    """The cluster asked for (its profile trusted), else this machine's, calibrated if need be."""
    from autosearch.core.hardware import Cluster

    if request.cluster is None:
        cluster = local_cluster(world, calibration_dir=request.calibration_dir, log=log)
    else:
        cluster = Cluster.parse(request.cluster)
        problems = profile_problems(cluster.profile)
        if problems:
            raise SpecError(
                problems,
                context=f"tune will not search with the profile {_where(cluster.profile)}",
            )
    log(f"tune: hardware profile {_where(cluster.profile)}")
    if cluster.world_size != world and request.validate_top_k:
        raise SpecError(
            f"validate_top_k runs candidates on this machine, but the cluster has "
            f"{cluster.world_size} devices and this run {world} process(es); validate on the "
            "target cluster, or tune without it"
        )
    if cluster.world_size != world:
        log(
            f"tune: searching for {cluster.name} ({cluster.world_size} devices); this run has "
            f"{world} process(es), so the engine cannot train with the result here: save "
            "best_strategy_ and launch on that cluster"
        )
    return cluster


def _run_search(
    spec, cluster, batch_size: int, config: TuneConfig | None, settings: dict[str, Any], log
) -> "TuneResult":
    """`autosearch.tune` for the engine's model: the same job, checks and output folder as
    ``autosearch tune`` (default folder results/<study name>), from the engine's TuneConfig
    or from its keywords."""
    from autosearch.tuning import default_study_name
    from autosearch.tuning._config import OBJECTIVE_ALIASES
    from autosearch.tuning._study import tune

    settings = dict(config.to_dict() if config is not None else settings)
    objective = settings.get("objective") or "throughput"
    name = settings.pop("study_name", None) or default_study_name(
        spec.name, cluster.name, batch_size, OBJECTIVE_ALIASES.get(objective, objective)
    )
    out = settings.pop("out", None) or os.path.join("results", name)
    if config is not None:
        result = tune(config.replace(model=spec, cluster=cluster, study_name=name, out=out))
    else:
        result = tune(
            spec,
            cluster,
            global_batch_size=batch_size,
            study_name=name,
            out=out,
            progress=False,
            **settings,
        )
    best, report = result.best_strategy, result.best_report
    if best is None or report is None:  # tune raises NoFeasibleStrategyError first; say it anyway
        raise SpecError(f"no strategy of {spec.name} fits {cluster.name}; nothing to train with")
    log(
        f"tune: best predicted {best.short()} ({report.tokens_per_s:,.0f} tokens/s); "
        f"study and best_strategy.yaml in {out}"
    )
    return result


def _check_config_model(config: TuneConfig, spec: "ModelSpec") -> None:
    """A TuneConfig given to Engine.tune must describe the engine's model (the search prices
    the config's; the engine trains its own)."""
    from autosearch.tuning._study import _load_model

    planned = _load_model(config.model, seq_len=config.seq_len, lora=config.lora())
    if planned != spec:
        raise SpecError(
            f"the TuneConfig's model ({planned.name}, seq {planned.seq_len}) is not the "
            f"engine's ({spec.name}, seq {spec.seq_len}); give TuneConfig(model=<the engine's "
            "ModelSpec>, ...), or tune with keywords (engine.tune(data, cluster=..., "
            "global_batch_size=...)) to search for the engine's model"
        )


def _validate(request: TuneRequest, spec, model, cluster, result, log) -> "ValidationResult":
    """The best candidates run for a few real steps on this machine (a measured best is
    written beside the study as best_measured_strategy.yaml)."""
    from autosearch.validation import distinct_kinds, validate

    assert result.out_dir is not None
    out = result.out_dir
    validation = validate(
        spec,
        distinct_kinds(result.top_k, request.validate_top_k),
        cluster=cluster,
        steps=request.steps,
        warmup=request.warmup,
        timeout_s=request.timeout_s,
        out=os.path.join(out, "validation"),
        factory=request.factory or reference_factory(model),
        study=result.study,
    )
    if validation.best is not None:
        best = validation.best.strategy
        best.to_yaml(
            os.path.join(out, "best_measured_strategy.yaml"),
            comment="fastest measured of the top candidates (Engine.tune)",
        )
        measured = (validation.best_row or {}).get("measured_tokens_per_s", float("nan"))
        log(f"tune: best measured {best.short()} ({measured:,.0f} tokens/s)")
    else:
        log(
            "tune: no candidate ran successfully; keeping the best predicted strategy "
            f"(see {os.path.join(out, 'validation', 'validation.csv')})"
        )
    return validation


def as_strategy(value: Any) -> "Strategy | None":
    """A Strategy from what Engine(strategy=...) accepts, or None."""
    from autosearch.core.strategy import Strategy

    if value is None or isinstance(value, Strategy):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Strategy.parse(os.fspath(value))
    if isinstance(value, dict):
        return Strategy.from_dict(value)
    raise SpecError(
        "strategy must be a Strategy, a YAML path, a 'dp=2,tp=2' string or a dict; "
        f"got {type(value).__name__}"
    )


# ---- the hardware profile --------------------------------------------------------------------
def profile_problems(profile: "HardwareProfile") -> list[str]:
    """Why a measured profile must not be searched with (empty: trusted), from the calibration's
    own quality checks; datasheet profiles (no calibration record) measured nothing: []."""
    from cost_models.calibration import quality_problems

    return list(quality_problems(profile))


def _where(profile: "HardwareProfile") -> str:
    return f"{profile.name} ({profile.path})" if profile.path else f"{profile.name} (catalog)"


def local_cluster(
    world_size: int,
    *,
    calibration_dir: str | None = None,
    calibrate_if_missing: bool = True,
    log: Callable[[str], None] = print,
) -> "Cluster":
    """The machine this process runs on, as a Cluster of `world_size` devices.

    Uses the calibrated profile ``<calibration_dir>/<device>-local.yaml`` (default folder
    results/calibration, or $AUTOSEARCH_CALIBRATION_DIR) when the machine it records is this one
    (CPU model, cores and ISA flags; GPU name and count: `cost_models.calibration.machine`) and
    it passes its quality checks. Otherwise it says why (whose profile it is, or what failed) and
    runs a quick calibration of this machine into that file (another machine's files are first
    moved to ``other-machines/<that machine>/`` beside it), or, with
    ``calibrate_if_missing=False``, falls back to the shipped profile of a known GPU. A profile
    that fails its checks, even after calibrating again, is never used: SpecError.
    """
    import torch

    from autosearch.core.hardware import Cluster, HardwareProfile
    from cost_models.calibration.machine import Machine, recorded_machine, this_cpu

    device = "cuda" if torch.cuda.is_available() else "cpu"
    count = torch.cuda.device_count() if device == "cuda" else (os.cpu_count() or 1)
    if device == "cuda" and world_size > count:
        raise SpecError(
            f"{world_size} processes but this machine has {count} GPUs; launch at most "
            f"{count} per node"
        )
    here = (
        Machine(device="cuda", name=torch.cuda.get_device_name(0), count=count)
        if device == "cuda"
        else this_cpu()
    )
    count = here.count or 1
    folder = calibration_dir or os.environ.get(CALIBRATION_DIR_ENV) or DEFAULT_CALIBRATION_DIR
    path = os.path.join(folder, f"{device}-local.yaml")
    why = f"no calibrated profile at {path}"
    other: "Machine | None" = None
    if os.path.exists(path):
        profile = HardwareProfile.load(path)
        measured_on = recorded_machine(profile.calibration, profile.device_type)
        differences = (
            ["it records no machine (not written by `autosearch calibrate`)"]
            if measured_on is None
            else measured_on.differences(here)
        )
        problems = [] if differences else profile_problems(profile)
        whose = measured_on.describe() if measured_on else "an unknown machine"
        if differences:
            other = measured_on
            why = (
                f"the profile at {path} was measured on {whose}, not on this machine "
                f"({'; '.join(differences)})"
            )
        elif problems:
            why = f"the profile at {path} is not trusted ({'; '.join(problems)})"
        else:
            log(
                f"tune: this machine: {here.describe()}, {world_size} process(es); its "
                f"calibrated profile {path} (measured on {whose}, "
                f"{profile.calibration.get('machine', {}).get('date', 'date not recorded')})"
            )
            return Cluster(gpu=path, n_nodes=1, gpus_per_node=world_size)
    if calibrate_if_missing:
        from autosearch.calibration import calibrate

        log(
            f"tune: this machine: {here.describe()}; {why}: calibrating it quickly "
            "(`autosearch calibrate` without --quick measures it properly)"
        )
        if other is not None:
            kept = _set_aside(path, os.path.join(folder, "other-machines", other.slug()))
            log(f"tune: the other machine's profile moved to {kept}")
        sizes = sorted({1, world_size} | ({2} if device == "cpu" and count >= 2 else set()))
        # A calibration that fails its checks may write under another name (<out>.untrusted).
        calibration = calibrate(device=device, world_sizes=sizes, quick=True, out=path, log=log)
        problems = profile_problems(calibration.profile)
        if problems:
            raise SpecError(
                problems,
                context=f"the quick calibration of this machine ({calibration.profile_path}) "
                "failed its checks, so tune will not search with it; calibrate on a quiet "
                f"machine (`autosearch calibrate --out {path}`) or pass cluster=...",
            )
        return Cluster(gpu=calibration.profile_path, n_nodes=1, gpus_per_node=world_size)
    from cost_models.calibration.profile import catalog_profile_for

    base = catalog_profile_for(here.name) if device == "cuda" else None
    if base is None:
        raise SpecError(
            f"{why}; this machine is {here.describe()}: run `autosearch calibrate --out {path}` "
            "on it, or pass cluster=..."
        )
    log(f"tune: this machine: {here.describe()}; {why}, using the datasheet profile {base.name}")
    return Cluster(gpu=base.path or base.name, n_nodes=1, gpus_per_node=world_size)


def _set_aside(path: str, folder: str) -> str:
    """Move a calibration of another machine (its profile, the variants it lists and its
    measurements CSV) into `folder`, names unchanged, so that calibrating this machine into
    `path` loses nothing measured; returns where the profile went."""
    import shutil

    from autosearch.core._io import read_yaml_mapping

    record = read_yaml_mapping(path, what="calibrated profile").get("calibration") or {}
    names = [os.path.basename(path)]
    names += [str(v) for v in (record.get("variants") or {}).values()]
    names += [str((record.get("machine") or {}).get("measurements_csv") or "")]
    os.makedirs(folder, exist_ok=True)
    here = os.path.dirname(path)
    for name in dict.fromkeys(n for n in names if n and os.sep not in n):
        if os.path.exists(os.path.join(here, name)):
            shutil.move(os.path.join(here, name), os.path.join(folder, name))
    return os.path.join(folder, os.path.basename(path))


def check_sequence_length(data: Any, seq_len: int) -> None:
    """The search prices sequences of the ModelSpec's length: refuse data whose samples differ."""
    if data is None:
        return
    try:
        sample = data[0] if hasattr(data, "__getitem__") else next(iter(data))
    except Exception:  # noqa: BLE001 - an exotic dataset: nothing to check against
        return
    inputs = sample[0] if isinstance(sample, (tuple, list)) else sample
    shape = getattr(inputs, "shape", None)
    if shape is not None and len(shape) >= 1 and shape[-1] != seq_len:
        raise SpecError(
            f"samples of train_data have length {shape[-1]} but the model's ModelSpec says "
            f"seq_len={seq_len}; the search prices the ModelSpec: make them agree "
            "(Engine(..., model_spec=...))"
        )


def reference_factory(model: Any) -> str | None:
    """Validation runs rebuild the model in new processes: the reference transformer needs no
    factory (None); another model must be importable as "module:function" (spec -> module)."""
    from autosearch.models.transformer import Transformer

    if isinstance(model, Transformer):
        return None
    if callable(model) and not hasattr(model, "parameters"):
        import torch

        with torch.device("meta"):
            if isinstance(model(), Transformer):
                return None
    raise SpecError(
        "validate_top_k rebuilds the model in new processes; for a model other than "
        "autosearch.models.transformer.Transformer pass factory='package.module:function' "
        "(ModelSpec -> nn.Module)"
    )
