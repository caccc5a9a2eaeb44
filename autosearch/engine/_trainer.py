"""The Trainer: the prepared state of an Engine and the methods that change it (torchtitan's
``Trainer``).

`Engine.prepare` builds the parallelized model parts, optimizers, schedulers, loss scaler and
pipeline schedule and hands them to a `Trainer`; from then on only the Trainer's methods change
them, with the step counter, the data position and the history of `fit`.

One batch (`run_batch`): without pipeline parallelism the batch is split into micro-batches by
hand, with gradient synchronisation once per step (DDP ``no_sync``, FSDP2
``set_requires_gradient_sync``) except under ZeRO-2/3; with it, the `torch.distributed.pipelining`
schedule runs the micro-batches. Each batch returns local sums (loss x samples, samples, metric
sums) that `reduce` adds over the ranks.

The loop (`fit`): a sequence of optimizer steps over epochs of the distributed loader. Every
`save_steps` steps (and every `save_freq` epochs) it saves a checkpoint ``<save_dir>/step<N>``
holding the model, the optimizer and the train state (`state_dict`): the global step, the data
position (epoch, batches done in it), the learning-rate schedulers, the fp16 loss scaler and each
rank's RNG states. ``fit(..., resume=True)`` loads the newest complete checkpoint of `save_dir`
and continues from its data position, so the losses are those of a run that was never stopped
(same world size; under another strategy the model, optimizer, schedule and data position carry
over, the RNG streams do not).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.engine import checkpoint
from autosearch.engine._options import FitConfig, call, latest_checkpoint, step_dir
from autosearch.engine.data import split_batch
from autosearch.engine.distributed import is_rank0
from autosearch.engine.optim import clip_grad_norm
from autosearch.engine.progress import TrainLogger

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from autosearch.core.strategy import Strategy
    from autosearch.engine.data import DistributedLoader
    from autosearch.engine.metrics import Metric
    from autosearch.engine.parallel_dims import ParallelDims
    from autosearch.engine.pipeline import TiedWeights

HISTORY_KEYS = ("loss", "step_time_s", "tokens_per_s", "lr", "grad_norm", "mfu")


class Trainer:
    """The parallelized model of one rank, its optimizers and counters, and what changes them.

    ``history`` (the logs of the last `fit`) exists once `fit` has started.

    Args:
        strategy, dims, mesh, device: the strategy, its degrees, the DeviceMesh over (pp, dp, tp)
            (None in a single process) and this rank's device.
        parts: ``(pipeline stage or None, module)`` per model part this rank holds.
        loss_fn: ``loss(outputs, labels) -> scalar``.
        optimizers, schedulers: one per part (none without an optimizer).
        scaler: the fp16 loss scaler, or None.
        schedule, pipeline_loss: the pipeline schedule and the loss it calls (pp > 1 only).
        metrics: what `reduce` computes besides the loss.
        grad_clip_norm: clip gradients to this global norm (None: neither clip nor measure).
        loss_parallel: compute the loss on tp-sharded logits (``loss_parallel()``).
        tied: the copies of weights tied across pipeline stages, whose gradients are summed
            before each optimizer step (pp > 1 only).
    """

    history: dict[str, list]

    def __init__(
        self,
        *,
        strategy: "Strategy",
        dims: "ParallelDims",
        mesh: "DeviceMesh | None",
        device: torch.device,
        parts: "list[tuple[int | None, nn.Module]]",
        loss_fn: Callable,
        optimizers: list[torch.optim.Optimizer],
        schedulers: list,
        scaler: Any,
        schedule: Any,
        pipeline_loss: "_PipelineLoss | None",
        metrics: "list[Metric]",
        grad_clip_norm: float | None,
        loss_parallel: bool,
        tied: "TiedWeights | None" = None,
    ):
        self.strategy, self.dims, self.mesh, self.device = strategy, dims, mesh, device
        self.stages = [stage for stage, _ in parts]
        self.model_parts = [module for _, module in parts]
        self.loss_fn, self.scaler = loss_fn, scaler
        self.optimizers, self.schedulers = optimizers, schedulers
        self.schedule, self.pipeline_loss = schedule, pipeline_loss
        self.metrics, self.grad_clip_norm, self.loss_parallel = (
            metrics,
            grad_clip_norm,
            loss_parallel,
        )
        self.tied = tied
        self.global_step = 0
        self.data_position = (0, 0)  # (epoch, batches done in it) after the last step
        self.last_grad_norm: float | None = None
        self.last_tokens = 0

    def set_mode(self, mode: str) -> None:
        for part in self.model_parts:
            part.train(mode == "train")

    # ---- one batch ---------------------------------------------------------------------------
    def run_batch(self, data: Any, mode: str) -> "tuple[torch.Tensor, torch.Tensor | None]":
        """Local sums [loss * samples, samples, *metric sums] and outputs of one batch."""
        inputs, labels = split_batch(data)
        inputs = inputs.to(self.device)
        labels = labels.to(self.device) if labels is not None else None
        if mode == "train" and labels is None:
            raise SpecError("training needs labels: batches must be (inputs, labels)")
        if mode == "train" and not self.optimizers:
            raise SpecError(
                "training needs an optimizer: "
                "Engine(model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4))"
            )
        tokens = inputs.numel() * self.dims.dp * self.dims.cp  # cp ranks hold 1/cp of each
        self.last_tokens = tokens if not inputs.is_floating_point() else 0
        if self.schedule is not None:
            return self._pipeline_batch(inputs, labels, mode)
        part = self.model_parts[0]
        want_outputs = mode == "predict" or bool(self.metrics)
        mbs = self.strategy.micro_batch_size
        xs = inputs.split(mbs)
        ys = labels.split(mbs) if labels is not None else [None] * len(xs)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        metric_sums = self._zero_metric_sums()
        outputs = []
        if mode == "train":
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self._scale_aux_losses()
        grad = torch.enable_grad() if mode == "train" else torch.no_grad()
        with grad:
            for i, (x, y) in enumerate(zip(xs, ys)):
                with self._grad_sync(part, last=i == len(xs) - 1), self._loss_context():
                    out = part(x)
                    if y is not None:
                        loss = self.loss_fn(out, y)
                        if mode == "train":
                            weight = x.shape[0] / mbs  # 1.0 unless the last batch is partial
                            scaled = loss * weight if weight != 1 else loss
                            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                        loss_sum += _full(loss.detach()).double() * x.shape[0]
                if want_outputs:
                    out = _full(out.detach())
                    if y is not None:
                        metric_sums = metric_sums + self._metric_sums(out, y)
                    if mode == "predict":
                        outputs.append(self._whole_sequence(out))
        if mode == "train":
            n_micro = inputs.shape[0] / mbs
            if n_micro != 1:  # mean over micro-batches, after backward as pipelining's scale_grads
                for p in part.parameters():
                    if p.grad is not None:
                        p.grad.div_(int(n_micro) if n_micro == int(n_micro) else n_micro)
            self._optimizer_step()
        n = inputs.shape[0] if labels is not None else 0
        return self._sums(loss_sum, n, metric_sums), (torch.cat(outputs) if outputs else None)

    def _pipeline_batch(
        self, inputs: torch.Tensor, labels: torch.Tensor | None, mode: str
    ) -> "tuple[torch.Tensor, torch.Tensor | None]":
        s = self.strategy
        n_chunks = s.pp * s.virtual_stages
        if inputs.shape[0] != s.grad_accum_steps * s.micro_batch_size:
            raise SpecError(
                f"with pp={s.pp} each dp rank needs {s.grad_accum_steps} x "
                f"{s.micro_batch_size} samples "
                f"per batch, got {inputs.shape[0]}; build the loader with engine.dataloader()"
            )
        first, last = 0 in self.stages, n_chunks - 1 in self.stages
        args = (inputs,) if first else ()
        loss_fn = self.pipeline_loss
        assert loss_fn is not None  # built with the schedule
        loss_fn.records.clear()
        loss_fn.enabled = labels is not None
        target = labels if labels is not None else torch.zeros(inputs.shape[0], device=self.device)
        if mode == "train":
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self._scale_aux_losses()
            with self._loss_context():
                out = self.schedule.step(*args, target=target if last else None)
            self._optimizer_step()
        else:
            with torch.no_grad(), self._loss_context():
                out = self.schedule.eval(*args, target=target if last else None)
        metric_sums = self._zero_metric_sums()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        n = 0
        if last:
            out = _full(out.detach()) if out is not None else None
            if labels is not None:
                # The last m records: on its first step the stage also calls the loss while
                # inferring shapes.
                records = loss_fn.records[-s.grad_accum_steps :]
                loss_sum = sum(
                    (_full(r).double() * s.micro_batch_size for r in records), start=loss_sum
                )
                n = inputs.shape[0]
                if self.metrics and out is not None:
                    metric_sums = self._metric_sums(out, labels)
        else:
            out = None
        if mode == "predict" and out is not None:
            out = self._whole_sequence(out)
        return self._sums(loss_sum, n, metric_sums), (out if mode == "predict" else None)

    def _whole_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs over whole sequences: under context parallel, gathered from the cp ranks."""
        if self.dims.cp == 1:
            return out
        from autosearch.distributed.context_parallel import ContextParallel

        assert self.mesh is not None  # cp > 1 runs on several processes
        return ContextParallel.of(self.mesh["cp"]).gather_sequence(out)

    def _sums(self, loss_sum: torch.Tensor, n: int, metric_sums: torch.Tensor) -> torch.Tensor:
        count = torch.tensor(float(n), dtype=torch.float64, device=self.device)
        return torch.cat([torch.stack([loss_sum.reshape(()), count]), metric_sums.to(self.device)])

    def _loss_context(self) -> contextlib.AbstractContextManager:
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _scale_aux_losses(self) -> None:
        """Scale the MoE auxiliary losses' gradient as the loss: by the fp16 loss scaler's
        scale, which changes only after a step (`autosearch.models.moe.AuxLoss`)."""
        from autosearch.models.moe import set_aux_loss_scale

        set_aux_loss_scale(self.scaler.get_scale() if self.scaler is not None else 1.0)

    def _grad_sync(self, part: nn.Module, *, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients once per step (DDP no_sync; FSDP2 sync flag), except for ZeRO-2/3."""
        mode = self.dims.mode
        if mode.wrapper == "ddp":
            return contextlib.nullcontext() if last else part.no_sync()  # type: ignore[operator]
        if mode.wrapper == "fsdp" and not mode.reduce_every_microbatch:
            part.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    def _optimizer_step(self) -> None:
        """Sum tied copies' gradients (pp), unscale (fp16), clip by the global gradient norm,
        step every optimizer and scheduler."""
        self.last_grad_norm = None
        if self.tied is not None:
            self.tied.sync_grads()
        if self.strategy.ep > 1 or self.strategy.etp > 1 or self.dims.tp > 1:
            from autosearch.models.moe import reduce_moe_grads

            # DDP (or no wrapper) leaves the experts; tp ranks routed different tokens
            reduce_moe_grads(self.model_parts, experts=self.dims.mode.wrapper != "fsdp")
        if self.grad_clip_norm is not None:
            if self.scaler is not None:
                for opt in self.optimizers:
                    self.scaler.unscale_(opt)
            pp_group = (
                self.mesh.get_group("pp") if self.mesh is not None and self.dims.pp > 1 else None
            )
            self.last_grad_norm = clip_grad_norm(
                self.model_parts,
                self.grad_clip_norm,
                pp_group=pp_group,
                skip=self.tied.duplicates() if self.tied is not None else frozenset(),
            )
        if self.scaler is not None:
            for opt in self.optimizers:
                self.scaler.step(opt)
            self.scaler.update()
        else:
            for opt in self.optimizers:
                opt.step()
        for scheduler in self.schedulers:
            scheduler.step()
        self.global_step += 1

    # ---- metrics and reduction ---------------------------------------------------------------
    def _zero_metric_sums(self) -> torch.Tensor:
        return torch.zeros(sum(m.width for m in self.metrics), dtype=torch.float64)

    def _metric_sums(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.metrics:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(
            [m.batch_sums(outputs, labels).double().cpu().reshape(m.width) for m in self.metrics]
        )

    def reduce(self, sums: torch.Tensor) -> dict[str, float]:
        """Sum over every rank (one all-reduce); tp peers hold copies, so divide by tp."""
        import torch.distributed as dist

        if self.mesh is not None:
            dist.all_reduce(sums)
            sums = sums / self.dims.tp
        sums = sums.cpu()
        out = {"loss": float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")}
        offset = 2
        for metric in self.metrics:
            width = metric.width
            out[metric.name] = metric.compute(sums[offset : offset + width])
            offset += width
        return out

    # ---- loops over a loader -------------------------------------------------------------------
    def evaluate(
        self, loader: "DistributedLoader", callbacks: Sequence | None = None
    ) -> dict[str, float]:
        """Loss and metrics over one epoch of `loader`, reduced over all ranks."""
        self.set_mode("eval")
        total = None
        for step, batch in enumerate(loader.epoch(0)):
            sums, _ = self.run_batch(batch, "eval")
            total = sums if total is None else total + sums
            call(callbacks, "on_batch_end", step, {})
        if total is None:
            raise SpecError(
                "evaluate got no batch: the dataset is smaller than one global batch; lower"
                " batch_size"
            )
        return self.reduce(total)

    def predict(
        self, loader: "DistributedLoader", callbacks: Sequence | None = None
    ) -> list[torch.Tensor]:
        """Outputs of this rank's samples, one tensor per batch (none off the last stage)."""
        self.set_mode("predict")
        outputs = []
        for step, batch in enumerate(loader.epoch(0)):
            _, out = self.run_batch(batch, "predict")
            if out is not None:
                outputs.append(out.cpu())
            call(callbacks, "on_batch_end", step, {})
        return outputs

    def fit(
        self,
        loader: "DistributedLoader",
        config: FitConfig,
        *,
        valid: "DistributedLoader | None" = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> dict[str, list]:
        """Train over `loader` as `config` says (`Engine.fit`); returns ``self.history``.

        `valid` is evaluated every ``config.valid_freq`` epochs; MFU is logged when
        `flops_per_token` and `peak_flops` (of the whole run) are known.
        """
        path = self._resume(config)
        start_epoch, skip = self.data_position if path is not None else (0, 0)
        history: dict[str, list] = {k: [] for k in (*HISTORY_KEYS[:4], "epoch_loss")}
        self.history = history
        steps = loader.steps()
        log = TrainLogger(
            enabled=is_rank0(),
            verbose=config.verbose,
            log_freq=config.log_freq,
            total_steps=steps * config.epochs if steps else None,
            log_dir=config.log_dir,
            tensorboard=config.tensorboard,
            flops_per_token=flops_per_token,
            peak_flops=peak_flops,
            first_step=self.global_step,
        )
        if start_epoch or skip:
            log.message(
                f"resumed from {path} at step {self.global_step} "
                f"(epoch {start_epoch + 1}, batch {skip})"
            )
        call(config.callbacks, "on_train_begin", {})
        try:
            for epoch in range(start_epoch, config.epochs):
                call(config.callbacks, "on_epoch_begin", epoch)
                self.set_mode("train")
                first = skip if epoch == start_epoch else 0
                epoch_sums = self._train_epoch(loader, epoch, first, config, log)
                epoch_logs = self._end_epoch(epoch, epoch_sums, config, valid, log)
                call(config.callbacks, "on_epoch_end", epoch, epoch_logs)
            if config.save_dir is not None:
                self.save(os.path.join(config.save_dir, "final"))
        finally:
            log.close()
        call(config.callbacks, "on_train_end", {k: v[-1] for k, v in history.items() if v})
        return history

    def _resume(self, config: FitConfig) -> str | None:
        """Load the checkpoint `config.resume` names (the newest of save_dir for True)."""
        if not config.resume:
            return None
        if isinstance(config.resume, str):
            path: str | None = config.resume
        else:
            assert config.save_dir is not None  # FitConfig refuses resume=True without it
            path = latest_checkpoint(config.save_dir)
        if path is not None:
            self.load(path)
        return path

    def _train_epoch(
        self,
        loader: "DistributedLoader",
        epoch: int,
        first: int,
        config: FitConfig,
        log: TrainLogger,
    ) -> torch.Tensor | None:
        """The steps of one epoch from batch `first`; returns the epoch's local sums."""
        steps = loader.steps()
        epoch_sums = None
        for step, batch in enumerate(loader.epoch(epoch, skip=first), start=first):
            # this step's learning rate (the schedulers step after it)
            lr = self.optimizers[0].param_groups[0]["lr"] if self.optimizers else None
            start = time.perf_counter()
            sums, _ = self.run_batch(batch, "train")
            logs: dict[str, Any] = dict(self.reduce(sums.clone()))
            step_time = time.perf_counter() - start
            epoch_sums = sums if epoch_sums is None else epoch_sums + sums
            tokens_per_s = self.last_tokens / step_time
            logs.update(step_time_s=step_time, tokens_per_s=tokens_per_s, lr=lr)
            if self.last_grad_norm is not None:
                logs["grad_norm"] = self.last_grad_norm
            mfu = log.mfu(tokens_per_s)
            if mfu is not None:
                logs["mfu"] = mfu
            for key in HISTORY_KEYS:
                if key in logs:
                    self.history.setdefault(key, []).append(logs[key])
            self.data_position = (epoch, step + 1)
            log.step(
                self.global_step, epoch, logs, batch=step + 1, epochs=config.epochs, batches=steps
            )
            if config.save_steps and self.global_step % config.save_steps == 0:
                assert config.save_dir is not None  # FitConfig refuses save_steps without it
                self.save(step_dir(config.save_dir, self.global_step))
            call(config.callbacks, "on_batch_end", step, logs)
        self.data_position = (epoch + 1, 0)
        return epoch_sums

    def _end_epoch(
        self,
        epoch: int,
        epoch_sums: torch.Tensor | None,
        config: FitConfig,
        valid: "DistributedLoader | None",
        log: TrainLogger,
    ) -> dict[str, float]:
        """The epoch's logs, evaluation and checkpoint."""
        nan = float("nan")
        epoch_logs = self.reduce(epoch_sums) if epoch_sums is not None else {"loss": nan}
        self.history["epoch_loss"].append(epoch_logs["loss"])
        for metric in self.metrics:
            self.history.setdefault(metric.name, []).append(epoch_logs.get(metric.name, nan))
        if valid is not None and (epoch + 1) % config.valid_freq == 0:
            val = self.evaluate(valid)
            for key, value in val.items():
                self.history.setdefault(f"val_{key}", []).append(value)
                epoch_logs[f"val_{key}"] = value
            log.scalars(self.global_step, val, "val")
            self.set_mode("train")
        extra = "".join(f" {k} {v:.4f}" for k, v in epoch_logs.items() if k != "loss")
        log.message(
            f"epoch {epoch + 1}/{config.epochs} done: loss {epoch_logs['loss']:.4f}{extra}"
        )
        if config.save_dir is not None and (epoch + 1) % config.save_freq == 0:
            self.save(os.path.join(config.save_dir, f"epoch{epoch + 1}"))
        return epoch_logs

    # ---- checkpoints and the train state -------------------------------------------------------
    def checkpoint_optimizers(self) -> list:
        """The optimizers whose state goes into checkpoints. Under ZeRO-1 each rank's
        ZeroRedundancyOptimizer holds a plain optimizer over its own share of the parameters
        (``.optim``): its state, named by parameter, is that rank's part of the full state."""
        if self.dims.mode.zero_redundancy_optimizer:
            return [opt.optim for opt in self.optimizers]  # type: ignore[attr-defined]
        return self.optimizers

    def save(self, path: str, *, training: bool = True) -> None:
        """`Engine.save` (documented there)."""
        optimizers = self.checkpoint_optimizers() if training else None
        state = self.state_dict() if training else None
        checkpoint.save(path, self.model_parts, optimizers, training=training, train_state=state)

    def load(self, path: str, *, strict: bool = True, load_optimizer: bool = True) -> list[str]:
        """`Engine.load` (documented there)."""
        missing = checkpoint.load(
            path,
            self.model_parts,
            self.checkpoint_optimizers(),
            strict=strict,
            load_optimizer=load_optimizer,
        )
        state = None
        if load_optimizer and os.path.isdir(path):
            state = checkpoint.read_train_state(path)
        if state is not None:
            self.load_state_dict(state)
        return missing

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs beyond model and optimizer, for this rank (``weights_only``
        loadable)."""
        epoch, batches = self.data_position
        state: dict[str, Any] = {
            "global_step": self.global_step,
            "epoch": epoch,
            "batches_done": batches,
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a saved train state back: step, data position, schedulers, scaler, RNG (the RNG
        only on the rank that saved it)."""
        self.global_step = int(state["global_step"])
        self.data_position = (int(state["epoch"]), int(state["batches_done"]))
        saved = state.get("schedulers") or []
        if len(saved) == len(self.schedulers):
            for scheduler, sd in zip(self.schedulers, saved):
                scheduler.load_state_dict(sd)
        else:  # another pipeline layout (another number of optimizers): replay the schedule
            for scheduler in self.schedulers:
                for _ in range(self.global_step):
                    scheduler.step()
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("same_rank"):
            torch.set_rng_state(state["torch_rng"])
            random.setstate(_as_tuple(state["python_rng"]))
            if torch.cuda.is_available() and "cuda_rng" in state:
                torch.cuda.set_rng_state_all(state["cuda_rng"])


class _PipelineLoss:
    """The loss the pipeline schedule calls on the last stage, once per micro-batch: records the
    unscaled loss, returns it scaled for fp16, and returns 0 when predicting without labels."""

    def __init__(self, loss_fn: Callable, scaler: Any):
        self.loss_fn, self.scaler = loss_fn, scaler
        self.records: list[torch.Tensor] = []
        self.enabled = True

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return output.float().sum() * 0.0
        loss = self.loss_fn(output, target)
        self.records.append(loss.detach())
        return self.scaler.scale(loss) if self.scaler is not None else loss


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (loss_parallel outputs), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
