"""`Engine.tune`: search the strategy for the machine the engine runs on, optionally check the best
candidates in real runs, and hand the winner to the engine.

Under torchrun, rank 0 describes the machine, calibrates it if needed, searches and validates; the
other ranks wait at a barrier and receive the chosen strategy, so every rank ends with the same one.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.engine._engine import Engine
    from autosearch.core.hardware import Cluster

CALIBRATION_DIR_ENV = "AUTOSEARCH_CALIBRATION_DIR"
DEFAULT_CALIBRATION_DIR = os.path.join("results", "calibration")


def local_cluster(world_size: int, *, calibration_dir: str | None = None, calibrate_if_missing: bool = True,
                  log: Callable[[str], None] = print) -> "Cluster":
    """The machine this process runs on, as a Cluster of `world_size` devices.

    Uses the calibrated profile ``<calibration_dir>/<device>-local.yaml`` when it exists (default
    folder results/calibration, or $AUTOSEARCH_CALIBRATION_DIR); otherwise runs a quick calibration
    into that file first (and says so), or, with ``calibrate_if_missing=False``, falls back to the
    shipped profile of a known GPU.
    """
    import torch

    from autosearch.core.hardware import Cluster

    device = "cuda" if torch.cuda.is_available() else "cpu"
    count = torch.cuda.device_count() if device == "cuda" else (os.cpu_count() or 1)
    if device == "cuda" and world_size > count:
        raise SpecError(f"{world_size} processes but this machine has {count} GPUs; launch at most {count} per node")
    folder = calibration_dir or os.environ.get(CALIBRATION_DIR_ENV) or DEFAULT_CALIBRATION_DIR
    path = os.path.join(folder, f"{device}-local.yaml")
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    if os.path.exists(path):
        log(f"tune: this machine: {name} ({device}, {count} {'GPUs' if device == 'cuda' else 'cores'}), "
            f"{world_size} process(es); calibrated profile {path}")
    elif calibrate_if_missing:
        from cost_models.calibration import calibrate

        log(f"tune: this machine: {name} ({device}); no calibrated profile at {path}: calibrating it quickly "
            "(`autosearch calibrate` without --quick measures it properly)")
        sizes = sorted({1, world_size} | ({2} if device == "cpu" and count >= 2 else set()))
        calibrate(device=device, world_sizes=sizes, quick=True, out=path, log=log)
    else:
        from cost_models.calibration.profile import catalog_profile_for

        base = catalog_profile_for(name) if device == "cuda" else None
        if base is None:
            raise SpecError(f"no calibrated profile at {path} for this {device}; run `autosearch calibrate "
                            f"--out {path}` or pass cluster=...")
        log(f"tune: this machine: {name}; no calibrated profile, using the datasheet profile {base.name}")
        return Cluster(gpu=base, n_nodes=1, gpus_per_node=world_size)
    return Cluster(gpu=path, n_nodes=1, gpus_per_node=world_size)


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
        raise SpecError(f"samples of train_data have length {shape[-1]} but the model's ModelSpec says seq_len={seq_len}; "
                        "the search prices the ModelSpec: make them agree (Engine(..., model_spec=...))")


def tune_engine(engine: "Engine", train_data: Any = None, *, batch_size: int | None, cluster=None,
                n_trials: int = 200, validate_top_k: int = 0, steps: int = 10, warmup: int = 3,
                timeout_s: float = 600.0, factory: str | None = None, out: str | None = None,
                calibration_dir: str | None = None, log: Callable[[str], None] = print, **tune_kwargs: Any):
    """What `Engine.tune` does; returns (TuneResult or None on ranks > 0, ValidationResult or None)."""
    import torch.distributed as dist

    from autosearch.engine import distributed as D
    from autosearch.core.strategy import Strategy

    world = D.launched_world_size()
    D.init_distributed()
    rank = D.rank()
    chosen: list[Any] = [None]
    result = validation = None
    error = None
    if rank == 0:
        try:
            result, validation, strategy = _search(engine, train_data, batch_size=batch_size, cluster=cluster,
                                                   world=world, n_trials=n_trials, validate_top_k=validate_top_k,
                                                   steps=steps, warmup=warmup, timeout_s=timeout_s, factory=factory,
                                                   out=out, calibration_dir=calibration_dir, log=log, **tune_kwargs)
            chosen[0] = strategy.to_dict()
        except SpecError as exc:
            error = str(exc)
            chosen[0] = {"error": error}
    if world > 1 and dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    if "error" in chosen[0]:
        raise SpecError(chosen[0]["error"] if rank else error)
    return result, validation, Strategy.from_dict(chosen[0])


def _search(engine: "Engine", train_data: Any, *, batch_size, cluster, world, n_trials, validate_top_k, steps,
            warmup, timeout_s, factory, out, calibration_dir, log, **tune_kwargs):
    from autosearch.tuner import tune
    from autosearch.tuning import default_study_name
    from autosearch.core.hardware import Cluster

    spec = engine._model_spec()
    check_sequence_length(train_data, spec.seq_len)
    if batch_size is None:
        if engine.strategy is None:
            raise SpecError("tune needs batch_size, the global batch (sequences per optimizer step): "
                            "engine.tune(train_data, batch_size=512)")
        batch_size = engine._resolve_strategy().global_batch_size
    if cluster is None and engine.cluster is not None:
        cluster = engine.cluster
    if cluster is None:
        cluster = local_cluster(world, calibration_dir=calibration_dir, log=log)
    else:
        cluster = Cluster.parse(cluster)
    if cluster.world_size != world and validate_top_k:
        raise SpecError(f"validate_top_k runs candidates on this machine, but the cluster has {cluster.world_size} "
                        f"devices and this run {world} process(es); validate on the target cluster, or tune without it")
    if cluster.world_size != world:
        log(f"tune: searching for {cluster.name} ({cluster.world_size} devices); this run has {world} process(es), "
            "so the engine cannot train with the result here: save best_strategy_ and launch on that cluster")
    name = tune_kwargs.pop("study_name", None) or default_study_name(spec.name, cluster.name, batch_size, "throughput")
    out = out or os.path.join("results", name)
    result = tune(spec, cluster, global_batch_size=batch_size, n_trials=n_trials, out=out, study_name=name,
                  progress=False, **tune_kwargs)
    strategy = result.best_strategy
    log(f"tune: best predicted {strategy.short()} ({result.best_report.tokens_per_s:,.0f} tokens/s); "
        f"study and best_strategy.yaml in {out}")
    validation = None
    if validate_top_k:
        from autosearch.validation import validate
        from autosearch.validation._validate import Candidate

        factory = factory or _reference_factory(engine)
        cands = [Candidate(c.strategy, c.report, c.trial_number) for c in result.top_k[:validate_top_k]]
        validation = validate(spec, cands, cluster=cluster, steps=steps, warmup=warmup, timeout_s=timeout_s,
                              out=os.path.join(out, "validation"), factory=factory, study=result.study)
        if validation.best is not None:
            strategy = validation.best.strategy
            strategy.to_yaml(os.path.join(out, "best_measured_strategy.yaml"),
                             comment="fastest measured of the top candidates (Engine.tune)")
            log(f"tune: best measured {strategy.short()} "
                f"({validation.best_row['measured_tokens_per_s']:,.0f} tokens/s)")
        else:
            log("tune: no candidate ran successfully; keeping the best predicted strategy "
                f"(see {os.path.join(out, 'validation', 'validation.csv')})")
    return result, validation, strategy


def _reference_factory(engine: "Engine") -> str | None:
    """Validation runs rebuild the model in new processes: the reference transformer needs nothing;
    another model must be importable as "module:function" (spec -> module)."""
    from autosearch.transformer import Transformer

    model = engine._built_model if getattr(engine, "_built_model", None) is not None else engine.model
    if isinstance(model, Transformer):
        return None
    if callable(model):
        import torch

        with torch.device("meta"):
            if isinstance(model(), Transformer):
                return None
    raise SpecError("validate_top_k rebuilds the model in new processes; for a model other than "
                    "autosearch.transformer.Transformer pass factory='package.module:function' (ModelSpec -> nn.Module)")
