"""One batch through the parallelized model: forward, backward, gradient clipping, optimizer step.

`StepMixin` is the part of `Engine` that runs one batch (`Engine.run` and the loops call it).
Without pipeline parallelism the batch is split into micro-batches by hand, with gradient
synchronisation once per step (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``) except under
ZeRO-2/3; with it, the `torch.distributed.pipelining` schedule runs the micro-batches. Each step
returns local sums (loss x samples, samples, metric sums) that `_reduce` adds over the ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from autosearch.core.errors import SpecError


class StepMixin:
    """Per-batch work of the Engine (needs the attributes `Engine.prepare` sets)."""

    def _step(self, data, mode: str):
        """Local sums [loss * samples, samples, *metric sums] and outputs of one batch."""
        import torch

        from autosearch.engine.data import split_batch

        inputs, labels = split_batch(data)
        inputs = inputs.to(self.device_)
        labels = labels.to(self.device_) if labels is not None else None
        if mode == "train" and labels is None:
            raise SpecError("training needs labels: batches must be (inputs, labels)")
        if mode == "train" and not self.optimizers_:
            raise SpecError(
                "training needs an optimizer: "
                "Engine(model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4))"
            )
        self._last_tokens = inputs.numel() * self.dims_.dp if not inputs.is_floating_point() else 0
        self._last_samples = inputs.shape[0] * self.dims_.dp
        if self.schedule_ is not None:
            return self._pipeline_step(inputs, labels, mode)
        part = self.model_parts_[0]
        want_outputs = mode == "predict" or bool(self._metrics)
        mbs = self.strategy_.micro_batch_size
        xs = inputs.split(mbs)
        ys = labels.split(mbs) if labels is not None else [None] * len(xs)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device_)
        metric_sums = self._zero_metric_sums()
        outputs = []
        if mode == "train":
            for opt in self.optimizers_:
                opt.zero_grad(set_to_none=True)
        grad = torch.enable_grad() if mode == "train" else torch.no_grad()
        with grad:
            for i, (x, y) in enumerate(zip(xs, ys)):
                with self._grad_sync(part, last=i == len(xs) - 1), self._loss_context():
                    out = part(x)
                    if y is not None:
                        loss = self.loss_fn_(out, y)
                        if mode == "train":
                            weight = x.shape[0] / mbs  # 1.0 unless the last batch is partial
                            scaled = loss * weight if weight != 1 else loss
                            (self.scaler_.scale(scaled) if self.scaler_ else scaled).backward()
                        loss_sum += _full(loss.detach()).double() * x.shape[0]
                if want_outputs:
                    out = _full(out.detach())
                    if y is not None:
                        metric_sums = metric_sums + self._metric_sums(out, y)
                    if mode == "predict":
                        outputs.append(out)
        if mode == "train":
            n_micro = inputs.shape[0] / mbs
            if (
                n_micro != 1
            ):  # mean over micro-batches, after backward as pipelining's scale_grads does
                for p in part.parameters():
                    if p.grad is not None:
                        p.grad.div_(int(n_micro) if n_micro == int(n_micro) else n_micro)
            self._optimizer_step()
        n = inputs.shape[0] if labels is not None else 0
        sums = torch.cat(
            [
                torch.stack(
                    [loss_sum, torch.tensor(float(n), dtype=torch.float64, device=self.device_)]
                ),
                metric_sums.to(self.device_),
            ]
        )
        return sums, (torch.cat(outputs) if outputs else None)

    def _pipeline_step(self, inputs, labels, mode: str):
        import torch

        s = self.strategy_
        n_chunks = s.pp * s.virtual_stages
        if inputs.shape[0] != s.grad_accum_steps * s.micro_batch_size:
            raise SpecError(
                f"with pp={s.pp} each dp rank needs {s.grad_accum_steps} x "
                f"{s.micro_batch_size} samples "
                f"per batch, got {inputs.shape[0]}; build the loader with engine.dataloader()"
            )
        first, last = 0 in self.stages_, n_chunks - 1 in self.stages_
        args = (inputs,) if first else ()
        loss_fn = self._pipeline_loss
        loss_fn.records.clear()
        loss_fn.enabled = labels is not None
        target = (
            labels if labels is not None else torch.zeros(inputs.shape[0], device=self.device_)
        )
        if mode == "train":
            for opt in self.optimizers_:
                opt.zero_grad(set_to_none=True)
            with self._loss_context():
                out = self.schedule_.step(*args, target=target if last else None)
            self._optimizer_step()
        else:
            with torch.no_grad(), self._loss_context():
                out = self.schedule_.eval(*args, target=target if last else None)
        metric_sums = self._zero_metric_sums()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device_)
        n = 0
        if last:
            out = _full(out.detach()) if out is not None else None
            if labels is not None:
                # The last m records: on its first step the stage also calls the loss while
                # inferring shapes.
                records = loss_fn.records[-s.grad_accum_steps :]
                loss_sum = sum(_full(r).double() * s.micro_batch_size for r in records)
                n = inputs.shape[0]
                if self._metrics and out is not None:
                    metric_sums = self._metric_sums(out, labels)
        else:
            out = None
        sums = torch.cat(
            [
                torch.stack(
                    [
                        loss_sum.reshape(()),
                        torch.tensor(float(n), dtype=torch.float64, device=self.device_),
                    ]
                ),
                metric_sums.to(self.device_),
            ]
        )
        return sums, (out if mode == "predict" else None)

    def _grad_sync(self, part, *, last: bool):
        """Reduce gradients once per step (DDP no_sync; FSDP2 sync flag), except for ZeRO-2/3."""
        mode = self.dims_.mode
        if mode.wrapper == "ddp":
            return contextlib.nullcontext() if last else part.no_sync()
        if mode.wrapper == "fsdp" and not mode.reduce_every_microbatch:
            part.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _optimizer_step(self) -> None:
        """Unscale (fp16), clip by the global gradient norm, step every optimizer and scheduler."""
        from autosearch.engine.optim import clip_grad_norm

        self._last_grad_norm = None
        if self.grad_clip_norm is not None:
            if self.scaler_ is not None:
                for opt in self.optimizers_:
                    self.scaler_.unscale_(opt)
            pp_group = self.mesh_.get_group("pp") if self.dims_.pp > 1 else None
            self._last_grad_norm = clip_grad_norm(
                self.model_parts_, self.grad_clip_norm, pp_group=pp_group
            )
        if self.scaler_ is not None:
            for opt in self.optimizers_:
                self.scaler_.step(opt)
            self.scaler_.update()
        else:
            for opt in self.optimizers_:
                opt.step()
        for scheduler in self.schedulers_:
            scheduler.step()
        self.global_step_ += 1

    # ---- metrics and reduction ---------------------------------------------------------------
    def _zero_metric_sums(self):
        import torch

        return torch.zeros(sum(m.width for m in self._metrics), dtype=torch.float64)

    def _metric_sums(self, outputs, labels):
        import torch

        if not self._metrics:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(
            [m.batch_sums(outputs, labels).double().cpu().reshape(m.width) for m in self._metrics]
        )

    def _reduce(self, sums) -> dict[str, float]:
        """Sum over every rank (one all-reduce); tp peers hold copies, so divide by tp."""
        import torch.distributed as dist

        if self.mesh_ is not None:
            dist.all_reduce(sums)
            sums = sums / self.dims_.tp
        sums = sums.cpu()
        out = {"loss": float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")}
        offset = 2
        for metric in self._metrics:
            width = metric.width
            out[metric.name] = metric.compute(sums[offset : offset + width])
            offset += width
        return out


class _PipelineLoss:
    """The loss the pipeline schedule calls on the last stage, once per micro-batch: records the
    unscaled loss, returns it scaled for fp16, and returns 0 when predicting without labels."""

    def __init__(self, loss_fn: Callable, scaler):
        self.loss_fn, self.scaler = loss_fn, scaler
        self.records: list = []
        self.enabled = True

    def __call__(self, output, target):
        if not self.enabled:
            return output.float().sum() * 0.0
        loss = self.loss_fn(output, target)
        self.records.append(loss.detach())
        return self.scaler.scale(loss) if self.scaler is not None else loss


def _full(t):
    """A plain tensor from a DTensor (loss_parallel outputs), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
