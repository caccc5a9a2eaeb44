"""The training loop of `Engine.fit`, and the train state that lets a run resume exactly.

A run is a sequence of optimizer steps over epochs of the distributed loader. Every `save_steps`
steps (and every `save_freq` epochs) the loop saves a checkpoint ``<save_dir>/step<N>`` holding
the model, the optimizer and the train state: the global step, the data position (epoch, batches
done in it), the learning-rate schedulers, the fp16 loss scaler and each rank's RNG states.
``fit(..., resume=True)`` loads the newest complete checkpoint of `save_dir` and continues from its
data position, so the losses are those of a run that was never stopped (same world size; under
another strategy the model, optimizer, schedule and data position carry over, the RNG streams
do not).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.engine._engine import Engine

STEP_DIR = re.compile(r"step(\d+)$")


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step{step:08d}")


def latest_checkpoint(save_dir: str) -> str | None:
    """The newest complete ``step<N>`` checkpoint of `save_dir` (with DCP metadata), or None."""
    if not os.path.isdir(save_dir):
        return None
    found = []
    for name in os.listdir(save_dir):
        match = STEP_DIR.match(name)
        path = os.path.join(save_dir, name)
        if match and os.path.exists(os.path.join(path, ".metadata")):
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


# ---- train state -------------------------------------------------------------------------------
def train_state(engine: "Engine") -> dict[str, Any]:
    """What resuming needs beyond model and optimizer, for this rank (weights_only-loadable)."""
    import torch

    epoch, batches = getattr(engine, "data_position_", (0, 0))
    state: dict[str, Any] = {
        "global_step": engine.global_step_,
        "epoch": epoch,
        "batches_done": batches,
        "schedulers": [s.state_dict() for s in engine.schedulers_],
        "scaler": engine.scaler_.state_dict() if engine.scaler_ is not None else None,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def restore_train_state(engine: "Engine", state: dict[str, Any]) -> None:
    """Put a saved train state back: step, data position, schedulers, scaler, RNG (same rank)."""
    import torch

    engine.global_step_ = int(state["global_step"])
    engine.data_position_ = (int(state["epoch"]), int(state["batches_done"]))
    saved = state.get("schedulers") or []
    if len(saved) == len(engine.schedulers_):
        for scheduler, sd in zip(engine.schedulers_, saved):
            scheduler.load_state_dict(sd)
    else:  # another pipeline layout (another number of optimizers): replay the schedule
        for scheduler in engine.schedulers_:
            for _ in range(engine.global_step_):
                scheduler.step()
    if engine.scaler_ is not None and state.get("scaler"):
        engine.scaler_.load_state_dict(state["scaler"])
    if state.get("same_rank"):
        torch.set_rng_state(state["torch_rng"])
        random.setstate(_as_tuple(state["python_rng"]))
        if torch.cuda.is_available() and "cuda_rng" in state:
            torch.cuda.set_rng_state_all(state["cuda_rng"])


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# ---- the loop ---------------------------------------------------------------------------
def _call(callbacks, hook: str, *args) -> None:
    for cb in callbacks or ():
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(*args)


def _mfu_inputs(engine: "Engine") -> tuple[float | None, float | None]:
    """(flops per token, peak FLOP/s of the whole run) if the model spec and cluster are known
    (the engine's cluster, else the one `tune` searched for)."""
    tuned = getattr(engine, "tuned_cluster_", None)  # set by Engine.tune on every rank
    if engine.cluster is None and tuned is None:
        return None, None
    try:
        spec = engine._model_spec()
        cluster = engine._cluster() if engine.cluster is not None else tuned
    except SpecError:
        return None, None
    peak = cluster.profile.peak_flops.get(engine.strategy_.amp)
    if not peak:
        return None, None
    return spec.flops_per_token(training=True), peak * engine.dims_.world_size


def fit(
    engine: "Engine",
    train_data,
    *,
    batch_size: int | None,
    epochs: int,
    steps_per_epoch: int | None,
    valid_data,
    valid_freq: int,
    valid_steps: int | None,
    log_freq: int,
    save_dir: str | None,
    save_freq: int,
    save_steps: int | None,
    resume: "bool | str",
    log_dir: str | None,
    tensorboard: bool,
    collate_fn: Callable | None,
    callbacks: Sequence | None,
    verbose: int,
    shuffle: bool,
) -> dict[str, list]:
    """`Engine.fit` (documented there)."""
    from autosearch.engine.distributed import is_rank0

    if save_steps is not None and (not isinstance(save_steps, int) or save_steps <= 0):
        raise SpecError(f"save_steps must be a positive integer, got {save_steps!r}")
    if (save_steps or resume is True) and save_dir is None:
        raise SpecError(
            "save_steps and resume=True need save_dir=... "
            "(where checkpoints are written and found)"
        )
    loader = engine.dataloader(
        train_data,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collate_fn,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        mode="train",
    )
    start_epoch, skip = 0, 0
    if resume:
        path = resume if isinstance(resume, str) else latest_checkpoint(save_dir)
        if path is not None:
            engine.load(path)
            start_epoch, skip = engine.data_position_
    history: dict[str, list] = {
        "loss": [],
        "step_time_s": [],
        "tokens_per_s": [],
        "lr": [],
        "epoch_loss": [],
    }
    engine.history = history
    steps = loader.steps()
    flops_per_token, peak = _mfu_inputs(engine)
    log = engine.train_logger_ = _make_logger(
        engine,
        is_rank0(),
        verbose,
        log_freq,
        steps,
        epochs,
        log_dir,
        tensorboard,
        flops_per_token,
        peak,
    )
    if start_epoch or skip:
        log.message(
            f"resumed from {path} at step {engine.global_step_} "
            f"(epoch {start_epoch + 1}, batch {skip})"
        )
    _call(callbacks, "on_train_begin", {})
    try:
        for epoch in range(start_epoch, epochs):
            _call(callbacks, "on_epoch_begin", epoch)
            engine.to_mode("train")
            first = skip if epoch == start_epoch else 0
            epoch_sums = None
            for step, batch in enumerate(loader.epoch(epoch, skip=first), start=first):
                lr = (
                    engine.optimizers_[0].param_groups[0]["lr"] if engine.optimizers_ else None
                )  # this step's
                start = time.perf_counter()
                sums, _ = engine._step(batch, "train")
                logs = engine._reduce(sums.clone())
                step_time = time.perf_counter() - start
                epoch_sums = sums if epoch_sums is None else epoch_sums + sums
                tokens_per_s = engine._last_tokens / step_time
                logs.update(step_time_s=step_time, tokens_per_s=tokens_per_s, lr=lr)
                if engine._last_grad_norm is not None:
                    logs["grad_norm"] = engine._last_grad_norm
                mfu = log.mfu(tokens_per_s)
                if mfu is not None:
                    logs["mfu"] = mfu
                for key in ("loss", "step_time_s", "tokens_per_s", "lr", "grad_norm", "mfu"):
                    if key in logs:
                        history.setdefault(key, []).append(logs[key])
                engine.data_position_ = (epoch, step + 1)
                log.step(
                    engine.global_step_, epoch, logs, batch=step + 1, epochs=epochs, batches=steps
                )
                if save_steps and engine.global_step_ % save_steps == 0:
                    engine.save(step_dir(save_dir, engine.global_step_))
                _call(callbacks, "on_batch_end", step, logs)
            engine.data_position_ = (epoch + 1, 0)
            epoch_logs = (
                engine._reduce(epoch_sums) if epoch_sums is not None else {"loss": float("nan")}
            )
            history["epoch_loss"].append(epoch_logs["loss"])
            for metric in engine._metrics:
                history.setdefault(metric.name, []).append(epoch_logs[metric.name])
            if valid_data is not None and (epoch + 1) % valid_freq == 0:
                val = engine.evaluate(
                    valid_data,
                    batch_size=batch_size,
                    steps=valid_steps,
                    collate_fn=collate_fn,
                    verbose=0,
                )
                for key, value in val.items():
                    history.setdefault(f"val_{key}", []).append(value)
                    epoch_logs[f"val_{key}"] = value
                log.scalars(engine.global_step_, val, "val")
                engine.to_mode("train")
            extra = "".join(f" {k} {v:.4f}" for k, v in epoch_logs.items() if k != "loss")
            log.message(f"epoch {epoch + 1}/{epochs} done: loss {epoch_logs['loss']:.4f}{extra}")
            if save_dir is not None and (epoch + 1) % save_freq == 0:
                engine.save(os.path.join(save_dir, f"epoch{epoch + 1}"))
            _call(callbacks, "on_epoch_end", epoch, epoch_logs)
        if save_dir is not None:
            engine.save(os.path.join(save_dir, "final"))
    finally:
        log.close()
    _call(callbacks, "on_train_end", {k: v[-1] for k, v in history.items() if v})
    return history


def _make_logger(
    engine,
    rank0: bool,
    verbose: int,
    log_freq: int,
    steps: int | None,
    epochs: int,
    log_dir: str | None,
    tensorboard: bool,
    flops_per_token,
    peak,
):
    from autosearch.engine.progress import TrainLogger

    return TrainLogger(
        enabled=rank0,
        verbose=verbose,
        log_freq=log_freq,
        total_steps=steps * epochs if steps else None,
        log_dir=log_dir,
        tensorboard=tensorboard,
        flops_per_token=flops_per_token,
        peak_flops=peak,
        first_step=engine.global_step_,
    )
