"""The Engine: train, evaluate and predict a PyTorch model under any Strategy.

Modelled on PaddlePaddle's auto-parallel ``Engine`` (fit / evaluate / predict / save / load /
cost, and the fine-grained dataloader + prepare + run), built on torch.distributed. Importing this
module does not import torch; the first method that needs it does.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from autosearch.engine.data import DistributedLoader
    from autosearch.core.strategy import Strategy

MODES = ("train", "eval", "predict")


def token_cross_entropy(outputs: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
    """Mean cross-entropy of logits (..., classes) against labels (...), in fp32 (the default loss)."""
    import torch.nn.functional as F

    return F.cross_entropy(outputs.flatten(0, -2).float(), labels.flatten())


class Engine:
    """Train, evaluate and predict a model under a parallel Strategy.

    Args:
        model: an ``nn.Module``, or a zero-argument factory that builds one. Pass a factory when
            the Engine may have to build the model more than once (after `tune` picks another
            strategy); an instance is parallelized in place and can be prepared only once.
            The reference `autosearch.transformer.Transformer` carries its ModelSpec and plan.
        loss: ``loss(outputs, labels) -> scalar`` averaged over the batch; defaults to token
            cross-entropy.
        optimizer: an optimizer built on the model's parameters (its class, defaults and
            per-group settings are rebuilt over the parallelized parameters), or a callable
            ``params -> Optimizer``. Needed by `fit` and train-mode `run` only.
        metrics: a `Metric` or a list of them (e.g. `autosearch.engine.Accuracy()`).
        strategy: a `Strategy`, a YAML path, a ``"dp=2,tp=2"`` string, or None for plain data
            parallelism over every process in fp32.
        cluster: a `Cluster` or its string (``"h100-sxm:1x8"``) for `cost` and `tune`.
        plan: a `ParallelPlan` for a user model (else ``model.parallel_plan()`` if it has one).
        model_spec: the ModelSpec `cost` and `tune` use for a model that carries none.
        loss_parallel: keep the logits sharded over tp and compute the loss with
            ``torch.distributed.tensor.parallel.loss_parallel`` (default loss only).
        seed: if set, ``torch.manual_seed(seed)`` before a factory builds the model.

    Example (under ``torchrun --nproc_per_node=2``; see examples/train_gpt.py)::

        import torch
        from autosearch import Engine, ModelSpec
        from autosearch.engine import SyntheticTokens
        from autosearch.transformer import Transformer

        spec = ModelSpec.load("tiny-gpt")
        engine = Engine(lambda: Transformer(spec), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                        strategy="dp=2,micro_batch_size=4,global_batch_size=8,amp=fp32")
        history = engine.fit(SyntheticTokens.for_model(spec, 64), epochs=1)
    """

    def __init__(self, model, loss=None, optimizer=None, metrics=None, strategy=None, cluster=None, *,
                 plan=None, model_spec=None, loss_parallel: bool = False, seed: int | None = None):
        self.model = model
        self.loss = loss
        self.optimizer = optimizer
        self.metrics = metrics
        self.strategy = strategy
        self.cluster = cluster
        self.plan = plan
        self.model_spec = model_spec
        self.loss_parallel = loss_parallel
        self.seed = seed
        self.history: dict[str, list] | None = None
        self._mode: str | None = None
        self._prepared = False
        self.strategy_: Strategy | None = None

    # ---- introspection (Paddle: main_program, dist_context) ---------------------------------
    @property
    def mode(self) -> str | None:
        return self._mode

    @property
    def main_program(self) -> "nn.Module | list[nn.Module]":
        """The parallelized module this rank runs (a list with several pipeline stages)."""
        self._require_prepared()
        return self.model_parts_[0] if len(self.model_parts_) == 1 else list(self.model_parts_)

    @property
    def mesh(self):
        """The DeviceMesh over (pp, dp, tp), or None in a single process."""
        self._require_prepared()
        return self.mesh_

    def _require_prepared(self) -> None:
        if not self._prepared:
            raise SpecError("the engine is not prepared yet; call prepare(mode=...), fit, evaluate or predict first")

    # ---- strategy, model, plan ------------------------------------------------------------
    def _resolve_strategy(self, batch_size: int | None = None) -> "Strategy":
        if self.strategy_ is not None:
            return self.strategy_
        from autosearch.engine.distributed import launched_world_size
        from autosearch.core.strategy import Strategy

        s = self.strategy
        if s is None:
            world = launched_world_size()
            gbs = batch_size or world
            s = Strategy(dp=world, micro_batch_size=max(1, gbs // world), global_batch_size=gbs, amp="fp32")
        elif isinstance(s, (str, os.PathLike)):
            s = Strategy.parse(os.fspath(s))
        elif isinstance(s, dict):
            s = Strategy.from_dict(s)
        elif not isinstance(s, Strategy):
            raise SpecError(f"strategy must be a Strategy, a YAML path, a 'dp=2,tp=2' string or a dict; "
                            f"got {type(s).__name__}")
        self.strategy_ = s
        return s

    def _model_spec(self):
        from autosearch.core.model_spec import ModelSpec

        if self.model_spec is not None:
            return ModelSpec.load(self.model_spec)
        spec = getattr(self.model, "spec", None)
        if spec is None and self._prepared:
            spec = getattr(self._built_model, "spec", None)
        if spec is None and callable(self.model) and not _is_module(self.model):
            import torch

            with torch.device("meta"):  # build on the meta device: shapes only, no memory
                spec = getattr(self.model(), "spec", None)
        if not isinstance(spec, ModelSpec):
            raise SpecError("this needs the model's shape and the model carries no ModelSpec; pass "
                            "Engine(..., model_spec=ModelSpec.load('tiny-gpt')) or a YAML path with "
                            "n_layers, hidden_size, n_heads, vocab_size and seq_len")
        return spec

    def _build_model(self) -> "nn.Module":
        import torch

        if _is_module(self.model):
            if getattr(self, "_instance_used", False):
                raise SpecError("the model instance was already parallelized for another strategy; pass a "
                                "zero-argument factory (e.g. lambda: Transformer(spec)) so the engine can rebuild it")
            self._instance_used = True
            return self.model
        if not callable(self.model):
            raise SpecError(f"model must be an nn.Module or a zero-argument factory, got {type(self.model).__name__}")
        if self.seed is not None:
            torch.manual_seed(self.seed)
        model = self.model()
        if not _is_module(model):
            raise SpecError(f"the model factory returned {type(model).__name__}, not an nn.Module")
        return model

    def _plan_for(self, model):
        from autosearch.engine.plan import ParallelPlan

        if self.plan is not None:
            return self.plan
        if callable(getattr(model, "parallel_plan", None)):
            return model.parallel_plan()
        return ParallelPlan()

    def _problems(self, strategy: "Strategy", plan, model) -> list[str]:
        from torch import nn

        from autosearch.engine.parallelize import blocks_of

        if plan.check is not None:
            problems = list(plan.check(strategy))
        else:
            problems = _model_free_problems(strategy)
        if strategy.tp > 1 and plan.tp_plan is None:
            problems.append(f"tp={strategy.tp} needs a tensor-parallel plan and this model has none; pass "
                            "Engine(..., plan=ParallelPlan(tp_plan=...)) or use tp=1 (dp, zero, recompute, amp work)")
        if strategy.pp > 1:
            container = blocks_of(model, plan)
            if not isinstance(container, nn.ModuleDict):
                problems.append(f"pp={strategy.pp} needs the model's blocks in an nn.ModuleDict named by "
                                f"ParallelPlan.blocks ({plan.blocks!r} here) and a forward that skips None modules; "
                                "pass a ParallelPlan or use pp=1")
            elif plan.check is None or plan.split_points is not None:  # else the model's check covers it
                bounds = plan.chunk_bounds(len(container), strategy.pp * strategy.virtual_stages)
                if isinstance(bounds, str):
                    problems.append(f"the pipeline split is impossible: {bounds}")
        if strategy.recompute == "selective" and (plan.attention_core is None or blocks_of(model, plan) is None):
            problems.append("recompute=selective needs ParallelPlan(attention_core=...) naming the attention core of "
                            "each block; use recompute=full or give the plan")
        return problems

    # ---- prepare -----------------------------------------------------------------------------
    def to_mode(self, mode: str) -> "Engine":
        """Switch between ``train``, ``eval`` and ``predict`` (dropout on in train only)."""
        if mode not in MODES:
            raise SpecError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        self._mode = mode
        if self._prepared:
            for part in self.model_parts_:
                part.train(mode == "train")
        return self

    def prepare(self, *, mode: str | None = None) -> "Engine":
        """Check the strategy, build and parallelize the model, its optimizer and pipeline schedule.

        Every rank runs the same checks before its first collective, so an invalid strategy
        raises one SpecError on every rank and nothing hangs. Called by the other methods.
        """
        if mode is not None:
            self.to_mode(mode)
        if self._prepared:
            return self
        import torch
        import torch.distributed as dist

        from autosearch.engine import distributed as D
        from autosearch.engine.optim import OptimizerRecipe, build_optimizers, make_grad_scaler
        from autosearch.engine.parallel_dims import ParallelDims
        from autosearch.engine.parallelize import parallelize
        from autosearch.engine.pipeline import build_schedule

        strategy = self._resolve_strategy()
        world = D.launched_world_size()
        dims = ParallelDims.from_strategy(strategy, world)
        model = self._build_model()
        plan = self._plan_for(model)
        problems = self._problems(strategy, plan, model)
        if problems:
            raise SpecError(problems, context=f"strategy {strategy.short()} cannot run this model")
        D.init_distributed()
        device = D.device()
        mesh = dims.build_mesh(device.type)
        model.to(device)
        if world > 1:  # every rank starts from rank 0's weights, whatever the seeds were
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor.data, src=0)
        names = {id(p): n for n, p in model.named_parameters()}
        parts = parallelize(model, strategy, dims, mesh, plan, device=device, loss_parallel=self._loss_parallel(dims))
        self._built_model = model
        self.dims_, self.mesh_, self.plan_, self.device_ = dims, mesh, plan, device
        self.stages_ = [stage for stage, _ in parts]
        self.model_parts_ = [module for _, module in parts]
        self.loss_fn_ = self.loss or token_cross_entropy
        self.scaler_ = make_grad_scaler(strategy.amp, device.type, distributed=world > 1)
        self.schedule_ = None
        if dims.pp > 1:
            self._pipeline_loss = _PipelineLoss(self.loss_fn_, self.scaler_)
            self.schedule_ = build_schedule(parts, strategy, mesh, device, self._pipeline_loss)
        self.optimizers_ = []
        if self.optimizer is not None:
            self.optimizers_ = build_optimizers(self.model_parts_, OptimizerRecipe(self.optimizer, names), dims, mesh)
        self._metrics = _as_list(self.metrics)
        self._prepared = True
        self.to_mode(self._mode or "train")
        return self

    def _loss_parallel(self, dims) -> bool:
        return bool(self.loss_parallel and dims.tp > 1)

    def _loss_context(self):
        if self._loss_parallel(self.dims_):
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    # ---- data --------------------------------------------------------------------------------
    def dataloader(self, dataset, *, batch_size: int | None = None, shuffle: bool = False,
                   drop_last: bool | None = None, collate_fn: Callable | None = None, num_workers: int = 0,
                   epochs: int = 1, steps_per_epoch: int | None = None, mode: str | None = None
                   ) -> "DistributedLoader":
        """A loader of this rank's share of each global batch (prepares the engine first).

        Args:
            dataset: a map-style or iterable dataset of ``(inputs, labels)`` samples.
            batch_size: the global batch (all dp ranks together); defaults to the strategy's
                ``global_batch_size``. Each dp rank gets ``batch_size / dp`` samples, split into
                micro-batches of ``micro_batch_size``; tp and pp peers get the same samples.
            drop_last: drop a last partial batch; default True in train mode and under
                pipeline parallelism (a partial batch cannot fill the pipeline's micro-batches),
                False otherwise (the distributed sampler then pads the last batch by repeating samples).
            epochs, steps_per_epoch: how long iterating the returned loader lasts.
            mode: ``train``, ``eval`` or ``predict`` (switches the engine's mode).
        """
        from autosearch.engine.data import build_loader

        if mode is not None:
            self.to_mode(mode)
        mode = self._mode or "train"
        strategy = self._resolve_strategy(batch_size)
        batch_size = batch_size or strategy.global_batch_size
        self.prepare()  # validates the strategy first, so its own message comes before batch messages
        self._check_batch(batch_size, mode)
        if drop_last is None:
            drop_last = mode == "train" or self.dims_.pp > 1
        dp_rank = self.mesh_.get_local_rank("dp") if self.mesh_ is not None else 0
        return build_loader(dataset, batch_size=batch_size, dp=strategy.dp, dp_rank=dp_rank, shuffle=shuffle,
                            drop_last=drop_last, collate_fn=collate_fn, num_workers=num_workers, epochs=epochs,
                            steps_per_epoch=steps_per_epoch, seed=self.seed or 0)

    def _check_batch(self, batch_size: int, mode: str) -> None:
        s = self._resolve_strategy()
        if batch_size % s.dp:
            raise SpecError(f"batch_size={batch_size} does not split over dp={s.dp} ranks; use a multiple of {s.dp}")
        local = batch_size // s.dp
        if s.pp > 1 and batch_size != s.global_batch_size:
            raise SpecError(f"with pp={s.pp} the batch must be the strategy's global_batch_size={s.global_batch_size} "
                            f"(the pipeline schedule runs {s.grad_accum_steps} micro-batches of {s.micro_batch_size}); "
                            f"got batch_size={batch_size}")
        if mode == "train" and local % s.micro_batch_size:
            raise SpecError(f"batch_size={batch_size} gives {local} samples per dp rank, not a multiple of "
                            f"micro_batch_size={s.micro_batch_size}; use a multiple of {s.dp * s.micro_batch_size}")

    # ---- one step ----------------------------------------------------------------------------
    def run(self, data, *, mode: str | None = None) -> dict[str, Any]:
        """Run one batch from `dataloader`: an optimizer step in train mode.

        Returns ``{"loss": float, <metric>: float}`` in train and eval mode (averaged over the
        global batch, identical on every rank) and ``{"outputs": tensor or None}`` in predict
        mode (this rank's samples; None on ranks without the last pipeline stage).
        """
        if mode is not None:
            self.to_mode(mode)
        self.prepare()
        sums, outputs = self._step(data, self._mode)
        if self._mode == "predict":
            return {"outputs": outputs}
        return self._reduce(sums)

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
            raise SpecError("training needs an optimizer: Engine(model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4))")
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
            if n_micro != 1:  # mean over micro-batches, after backward as pipelining's scale_grads does
                for p in part.parameters():
                    if p.grad is not None:
                        p.grad.div_(int(n_micro) if n_micro == int(n_micro) else n_micro)
            self._optimizer_step()
        n = inputs.shape[0] if labels is not None else 0
        sums = torch.cat([torch.stack([loss_sum, torch.tensor(float(n), dtype=torch.float64, device=self.device_)]),
                          metric_sums.to(self.device_)])
        return sums, (torch.cat(outputs) if outputs else None)

    def _pipeline_step(self, inputs, labels, mode: str):
        import torch

        s = self.strategy_
        n_chunks = s.pp * s.virtual_stages
        if inputs.shape[0] != s.grad_accum_steps * s.micro_batch_size:
            raise SpecError(f"with pp={s.pp} each dp rank needs {s.grad_accum_steps} x {s.micro_batch_size} samples "
                            f"per batch, got {inputs.shape[0]}; build the loader with engine.dataloader()")
        first, last = 0 in self.stages_, n_chunks - 1 in self.stages_
        args = (inputs,) if first else ()
        loss_fn = self._pipeline_loss
        loss_fn.records.clear()
        loss_fn.enabled = labels is not None
        target = labels if labels is not None else torch.zeros(inputs.shape[0], device=self.device_)
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
                # The last m records: on its first step the stage also calls the loss while inferring shapes.
                records = loss_fn.records[-s.grad_accum_steps:]
                loss_sum = sum(_full(r).double() * s.micro_batch_size for r in records)
                n = inputs.shape[0]
                if self._metrics and out is not None:
                    metric_sums = self._metric_sums(out, labels)
        else:
            out = None
        sums = torch.cat([torch.stack([loss_sum.reshape(()),
                                       torch.tensor(float(n), dtype=torch.float64, device=self.device_)]),
                          metric_sums.to(self.device_)])
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
        if self.scaler_ is not None:
            for opt in self.optimizers_:
                self.scaler_.step(opt)
            self.scaler_.update()
        else:
            for opt in self.optimizers_:
                opt.step()

    # ---- metrics and reduction ---------------------------------------------------------------
    def _zero_metric_sums(self):
        import torch

        return torch.zeros(sum(m.width for m in self._metrics), dtype=torch.float64)

    def _metric_sums(self, outputs, labels):
        import torch

        if not self._metrics:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([m.batch_sums(outputs, labels).double().cpu().reshape(m.width) for m in self._metrics])

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
            out[metric.name] = metric.compute(sums[offset: offset + width])
            offset += width
        return out

    # ---- high level ----------------------------------------------------------------------------
    def fit(self, train_data, *, batch_size: int | None = None, epochs: int = 1, steps_per_epoch: int | None = None,
            valid_data=None, valid_freq: int = 1, valid_steps: int | None = None, log_freq: int = 10,
            save_dir: str | None = None, save_freq: int = 1, collate_fn: Callable | None = None,
            callbacks: Sequence | None = None, verbose: int = 2, shuffle: bool = False) -> dict[str, list]:
        """Train for `epochs` epochs; returns (and stores in ``self.history``) per-step and per-epoch logs.

        Args:
            train_data: dataset of ``(inputs, labels)``.
            batch_size: global batch per optimizer step (default: the strategy's).
            epochs, steps_per_epoch: length of training (steps_per_epoch caps each epoch).
            valid_data, valid_freq, valid_steps: evaluate every `valid_freq` epochs (`valid_steps` batches).
            log_freq: print a progress line every `log_freq` steps (rank 0, `verbose` >= 2).
            save_dir, save_freq: save a checkpoint every `save_freq` epochs and at the end.
            collate_fn: merges samples into a batch.
            callbacks: objects with any of on_train_begin(logs), on_epoch_begin(epoch),
                on_batch_end(step, logs), on_epoch_end(epoch, logs), on_train_end(logs).
            verbose: 0 silent, 1 one line per epoch, 2 also every `log_freq` steps.

        Returns:
            ``{"loss", "step_time_s", "tokens_per_s", "lr": one entry per step, "epoch_loss": one per
            epoch, "val_loss" and "val_<metric>": one per evaluation, <metric>: one per epoch}``.
        """
        from autosearch.engine.distributed import is_rank0

        loader = self.dataloader(train_data, batch_size=batch_size, shuffle=shuffle, collate_fn=collate_fn,
                                 epochs=epochs, steps_per_epoch=steps_per_epoch, mode="train")
        history: dict[str, list] = {"loss": [], "step_time_s": [], "tokens_per_s": [], "lr": [], "epoch_loss": []}
        self.history = history
        say = is_rank0() and verbose > 0
        steps = loader.steps()
        _call(callbacks, "on_train_begin", {})
        for epoch in range(epochs):
            _call(callbacks, "on_epoch_begin", epoch)
            self.to_mode("train")
            epoch_sums = None
            for step, batch in enumerate(loader.epoch(epoch)):
                start = time.perf_counter()
                sums, _ = self._step(batch, "train")
                logs = self._reduce(sums.clone())
                step_time = time.perf_counter() - start
                epoch_sums = sums if epoch_sums is None else epoch_sums + sums
                logs.update(step_time_s=step_time, tokens_per_s=self._last_tokens / step_time,
                            lr=self.optimizers_[0].param_groups[0]["lr"])
                for key in ("loss", "step_time_s", "tokens_per_s", "lr"):
                    history[key].append(logs[key])
                _call(callbacks, "on_batch_end", step, logs)
                if say and verbose >= 2 and (step + 1) % log_freq == 0:
                    total = f"/{steps}" if steps else ""
                    print(f"epoch {epoch + 1}/{epochs} step {step + 1}{total} loss {logs['loss']:.4f} "
                          f"| {logs['tokens_per_s']:,.0f} tokens/s | {step_time * 1e3:.0f} ms/step", flush=True)
            epoch_logs = self._reduce(epoch_sums) if epoch_sums is not None else {"loss": float("nan")}
            history["epoch_loss"].append(epoch_logs["loss"])
            for metric in self._metrics:
                history.setdefault(metric.name, []).append(epoch_logs[metric.name])
            if valid_data is not None and (epoch + 1) % valid_freq == 0:
                val = self.evaluate(valid_data, batch_size=batch_size, steps=valid_steps, collate_fn=collate_fn,
                                    verbose=0)
                for key, value in val.items():
                    history.setdefault(f"val_{key}", []).append(value)
                    epoch_logs[f"val_{key}"] = value
                self.to_mode("train")
            if say:
                extra = "".join(f" {k} {v:.4f}" for k, v in epoch_logs.items() if k != "loss")
                print(f"epoch {epoch + 1}/{epochs} done: loss {epoch_logs['loss']:.4f}{extra}", flush=True)
            if save_dir is not None and (epoch + 1) % save_freq == 0:
                self.save(os.path.join(save_dir, f"epoch{epoch + 1}"))
            _call(callbacks, "on_epoch_end", epoch, epoch_logs)
        if save_dir is not None:
            self.save(os.path.join(save_dir, "final"))
        _call(callbacks, "on_train_end", {k: v[-1] for k, v in history.items() if v})
        return history

    def evaluate(self, valid_data, *, batch_size: int | None = None, steps: int | None = None, log_freq: int = 10,
                 collate_fn: Callable | None = None, callbacks: Sequence | None = None, verbose: int = 2
                 ) -> dict[str, float]:
        """Loss and metrics over `valid_data` (or its first `steps` batches), reduced over all ranks."""
        loader = self.dataloader(valid_data, batch_size=batch_size, collate_fn=collate_fn, steps_per_epoch=steps,
                                 mode="eval")
        total = None
        for step, batch in enumerate(loader.epoch(0)):
            sums, _ = self._step(batch, "eval")
            total = sums if total is None else total + sums
            _call(callbacks, "on_batch_end", step, {})
        if total is None:
            raise SpecError("evaluate got no batch: the dataset is smaller than one global batch; lower batch_size")
        logs = self._reduce(total)
        from autosearch.engine.distributed import is_rank0

        if verbose and is_rank0():
            print("eval: " + " ".join(f"{k} {v:.4f}" for k, v in logs.items()), flush=True)
        _call(callbacks, "on_eval_end", logs)
        return logs

    def predict(self, test_data, *, batch_size: int | None = None, steps: int | None = None,
                collate_fn: Callable | None = None, callbacks: Sequence | None = None, verbose: int = 2
                ) -> list:
        """Outputs for this rank's samples, one tensor per batch.

        Each dp rank returns the outputs of the samples the distributed sampler gave it (sample
        j of each batch goes to dp rank j % dp); ranks that do not hold the last pipeline stage
        return an empty list.
        """
        loader = self.dataloader(test_data, batch_size=batch_size, collate_fn=collate_fn, steps_per_epoch=steps,
                                 mode="predict")
        outputs = []
        for step, batch in enumerate(loader.epoch(0)):
            _, out = self._step(batch, "predict")
            if out is not None:
                outputs.append(out.cpu())
            _call(callbacks, "on_batch_end", step, {})
        return outputs

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, path: str, training: bool = True) -> None:
        """Save a DCP checkpoint directory (model + optimizer), or with ``training=False`` a plain
        inference state dict file (``torch.load``-able, full tensors, original parameter names)."""
        from autosearch.engine import checkpoint

        self.prepare()
        checkpoint.save(path, self.model_parts_, self._checkpoint_optimizers() if training else None,
                        training=training)

    def load(self, path: str, strict: bool = True, load_optimizer: bool = True) -> list[str]:
        """Load a checkpoint saved by `save` under any strategy; returns what was not loaded."""
        from autosearch.engine import checkpoint

        self.prepare()
        return checkpoint.load(path, self.model_parts_, self._checkpoint_optimizers(), strict=strict,
                               load_optimizer=load_optimizer)

    def _checkpoint_optimizers(self) -> list:
        """The optimizers whose state goes into checkpoints. Under ZeRO-1 each rank's
        ZeroRedundancyOptimizer holds a plain optimizer over its own share of the parameters
        (``.optim``): its state, named by parameter, is that rank's part of the full state."""
        if self.dims_.mode.zero_redundancy_optimizer:
            return [opt.optim for opt in self.optimizers_]
        return self.optimizers_

    # ---- cost model and search ---------------------------------------------------------------
    def _cluster(self):
        from autosearch.core.hardware import Cluster

        if self.cluster is None:
            raise SpecError("this needs a cluster to model: pass Engine(..., cluster='h100-sxm:1x8') "
                            "(a profile name from `autosearch hardware`, nodes x devices per node)")
        return Cluster.parse(self.cluster)

    def cost(self, mode: str = "train") -> tuple[float, float]:
        """Predicted (step_time_s, peak_memory_bytes) of the current strategy on `cluster`,
        from the analytic cost model; ``self.cost_report_`` keeps the full breakdown."""
        from cost_models.analytic import AnalyticCostModel

        if mode != "train":
            raise SpecError(f"the analytic cost model predicts training steps; cost(mode={mode!r}) is not modelled")
        report = AnalyticCostModel(self._model_spec(), self._cluster()).estimate(self._resolve_strategy())
        self.cost_report_ = report
        return report.step_time_s, report.peak_memory_bytes

    def tune(self, train_data=None, *, batch_size: int | None = None, cluster=None, n_trials: int = 200,
             validate_top_k: int = 0, steps: int = 10, warmup: int = 3, timeout_s: float = 600.0,
             factory: str | None = None, out: str | None = None, calibration_dir: str | None = None,
             wait_timeout_s: float | None = None, verbose: int = 1, **tune_kwargs):
        """Find the fastest strategy for this model and train with it (sets ``strategy_``).

        Args:
            train_data: the training dataset; its samples' length must match the ModelSpec's seq_len.
            batch_size: the global batch (sequences per optimizer step) to search for; default the
                current strategy's.
            cluster: the cluster to search for; default the engine's, else this machine: its
                calibrated profile (results/calibration/<device>-local.yaml), calibrated quickly
                first if there is none or if it fails its quality checks.
            n_trials: finished trials of the Optuna study (see `autosearch.tune`).
            validate_top_k: run the best k candidates for `warmup + steps` real steps on this
                machine (`autosearch.validation`) and keep the fastest measured one.
            factory: for validation of a model other than the reference transformer,
                ``"module:function"`` building it from its ModelSpec.
            out: folder of the study, best_strategy.yaml and validation (default results/<study>).
            wait_timeout_s: under torchrun, how long ranks > 0 wait for rank 0's search.
            tune_kwargs: passed to `autosearch.tune` (objective, sampler, space, storage, seed, ...).

        Returns:
            The TuneResult on rank 0 (None on other ranks). Every rank ends with the same learned
            attributes: ``strategy_`` (what `fit` trains with) and ``best_strategy_`` (the same),
            ``best_report_`` (its predicted CostReport), ``tuned_cluster_`` (the cluster and
            hardware profile searched); on rank 0 also ``tune_result_`` and ``validation_`` (the
            real runs, if any). The constructor's ``strategy`` and ``cluster`` are not changed.

        Example:
            >>> engine = Engine(lambda: Transformer(spec), optimizer=...)          # doctest: +SKIP
            >>> engine.tune(data, batch_size=16, n_trials=50, validate_top_k=2)   # doctest: +SKIP
            >>> engine.fit(data)                                                   # doctest: +SKIP
        """
        from autosearch.engine import distributed as D
        from autosearch.engine._tune import tune_engine

        if self._prepared and _is_module(self.model):
            raise SpecError("the engine was prepared with a model instance, which cannot be rebuilt for the tuned "
                            "strategy; pass a zero-argument model factory to Engine")
        log = print if (verbose and D.is_rank0()) else (lambda _msg: None)
        outcome = tune_engine(
            model_spec=self._model_spec(), model=self.model,
            strategy=getattr(self, "best_strategy_", None) or self.strategy,
            world_size=D.launched_world_size(), cluster=self.cluster if cluster is None else cluster,
            train_data=train_data, batch_size=batch_size, n_trials=n_trials, validate_top_k=validate_top_k,
            steps=steps, warmup=warmup, timeout_s=timeout_s, factory=factory, out=out,
            calibration_dir=calibration_dir, wait_timeout_s=wait_timeout_s, log=log, **tune_kwargs)
        self.strategy_ = self.best_strategy_ = outcome.strategy
        self.best_report_ = outcome.report
        self.tuned_cluster_ = outcome.cluster
        self.tune_result_ = outcome.result
        self.validation_ = outcome.validation
        self._prepared = False
        return outcome.result


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


def _is_module(obj) -> bool:
    from torch import nn

    return isinstance(obj, nn.Module)


def _full(t):
    """A plain tensor from a DTensor (loss_parallel outputs), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _as_list(metrics) -> list:
    if metrics is None:
        return []
    return list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]


def _call(callbacks, hook: str, *args) -> None:
    for cb in callbacks or ():
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(*args)


def _model_free_problems(strategy: "Strategy") -> list[str]:
    """The Strategy rules that do not depend on the model (batch split, pipeline micro-batches,
    schedule options)."""
    return strategy.problems(None)
