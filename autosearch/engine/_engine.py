"""The Engine: train, evaluate and predict a PyTorch model under any Strategy.

Modelled on PaddlePaddle's auto-parallel ``Engine`` (fit / evaluate / predict / save / load /
cost, and the fine-grained dataloader + prepare + run), built on torch.distributed. The Engine
checks its inputs and builds; the `Trainer` it holds after `prepare` owns the parallelized model,
the optimizers and the counters, and runs the loops (`autosearch.engine._trainer`). Importing
this module does not import torch; the first method that needs it does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.engine._options import (
    FitConfig,
    call,
    checkpoint_problem,
    data_problem,
    engine_argument_problems,
    loader_problems,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.report import CostReport
    from autosearch.core.strategy import Strategy
    from autosearch.distributed.plan import ParallelPlan
    from autosearch.engine._trainer import Trainer
    from autosearch.engine.data import DistributedLoader
    from autosearch.engine.parallel_dims import ParallelDims

MODES = ("train", "eval", "predict")

# sklearn's convention: a learned attribute (name ending in "_") exists only once the method that
# learns it has run; before, reading it raises AttributeError naming that method.
LEARNED_BY = {
    **dict.fromkeys(
        (
            "strategy_",
            "trainer_",
            "plan_",
            "model_parts_",
            "stages_",
            "optimizers_",
            "schedulers_",
            "device_",
            "dims_",
            "mesh_",
            "global_step_",
        ),
        "prepare",
    ),
    "history_": "fit",
    "cost_report_": "cost",
    **dict.fromkeys(
        ("best_strategy_", "best_report_", "tuned_cluster_", "tune_result_", "validation_"),
        "tune",
    ),
}


def token_cross_entropy(outputs: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
    """Mean cross-entropy of logits (..., classes) against labels (...), in fp32 (the default
    loss)."""
    import torch.nn.functional as F

    return F.cross_entropy(outputs.flatten(0, -2).float(), labels.flatten())


def _from_trainer(name: str, doc: str) -> Any:
    """A read-only learned attribute of the Engine that its Trainer owns."""
    return property(lambda engine: getattr(engine.trainer_, name), doc=doc)


# How each method names the data it is given, in a message: {(method, mode): argument}
_DATA_NAMES = {
    ("fit", "train"): "train_data",
    ("fit", "eval"): "valid_data",
    ("evaluate", "eval"): "valid_data",
    ("predict", "predict"): "test_data",
}


class Engine:
    """Train, evaluate and predict a model under a parallel Strategy.

    ``autosearch.Engine`` is this class with `tune` (`autosearch.autotune.Engine`): the search
    composes the training engine from above, so nothing here imports the search.

    Args:
        model: an ``nn.Module``, or a zero-argument factory that builds one. Pass a factory when
            the Engine may have to build the model more than once (after `tune` picks another
            strategy); an instance is parallelized in place and can be prepared only once.
            The reference `autosearch.models.transformer.Transformer` carries its ModelSpec and
            plan.
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
        lr_scheduler: a recipe ``optimizer -> LRScheduler`` (any torch scheduler, or
            `autosearch.engine.WarmupDecay`), built for each optimizer and stepped after each
            optimizer step.
        grad_clip_norm: clip gradients to this global L2 norm (over every shard, tp rank and
            pipeline stage); ``float("inf")`` only measures it. `run` and `fit` report it as
            ``grad_norm`` (before clipping).
        meta_init: build the model on the meta device (no memory), parallelize it, then allocate
            only this rank's shards and initialise them with the model's ``init_weights()`` (else
            each submodule's ``reset_parameters()``), seeded by `seed` on every rank. For models
            larger than one device; `load` a checkpoint afterwards for trained weights. Needs a
            model factory. (On CPU, DTensor has no distributed RNG: every shard of a parameter is
            drawn from the same seed, so random init differs from a single-process run.)

    Attributes (learned: each exists only after the method named, as in scikit-learn):
        strategy_: the Strategy this engine runs (`prepare`, or `tune`'s choice).
        model_parts_, stages_: this rank's parallelized modules and their pipeline stages
            (`prepare`).
        optimizers_, schedulers_: one per model part (`prepare`).
        device_, dims_, mesh_, plan_: this rank's device, the degrees, the DeviceMesh over
            (pp, dp, tp) or None in one process, the ParallelPlan used (`prepare`).
        global_step_: optimizer steps taken, counted over `fit` calls and resumes (`prepare`).
        history_: per-step and per-epoch logs of the last `fit` (also ``history``).
        cost_report_: the CostReport of the last `cost`.
        best_strategy_, best_report_, tuned_cluster_, tune_result_, validation_: see
            `autosearch.Engine.tune`.

    Example (under ``torchrun --nproc_per_node=2``; see examples/train_gpt.py)::

        import torch
        from autosearch import Engine, ModelSpec
        from autosearch.engine import SyntheticTokens
        from autosearch.models.transformer import Transformer

        spec = ModelSpec.load("tiny-gpt")
        engine = Engine(lambda: Transformer(spec),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                        strategy="dp=2,micro_batch_size=4,global_batch_size=8,amp=fp32")
        history = engine.fit(SyntheticTokens.for_model(spec, 64), epochs=1)
    """

    # Private state has class defaults, so that __init__ only stores its arguments.
    _mode: str | None = None
    _instance_used = False
    _built_model: "nn.Module"
    # Learned attributes (see LEARNED_BY); declared here for type checkers.
    strategy_: "Strategy"
    trainer_: "Trainer"
    plan_: "ParallelPlan"
    cost_report_: "CostReport"
    best_strategy_: "Strategy"
    model_parts_: "list[nn.Module]" = _from_trainer("model_parts", "this rank's modules")
    stages_: "list[int | None]" = _from_trainer("stages", "the pipeline stage of each part")
    optimizers_: "list[torch.optim.Optimizer]" = _from_trainer("optimizers", "one per part")
    schedulers_: list = _from_trainer("schedulers", "one per optimizer")
    device_: "torch.device" = _from_trainer("device", "this rank's device")
    dims_: "ParallelDims" = _from_trainer("dims", "the parallel degrees")
    mesh_: "DeviceMesh | None" = _from_trainer("mesh", "the DeviceMesh, None in one process")
    global_step_: int = _from_trainer("global_step", "optimizer steps taken")
    history_: dict[str, list] = _from_trainer("history", "the logs of the last fit")

    def __init__(
        self,
        model,
        loss=None,
        optimizer=None,
        metrics=None,
        strategy=None,
        cluster=None,
        *,
        plan=None,
        model_spec=None,
        loss_parallel: bool = False,
        seed: int | None = None,
        lr_scheduler=None,
        grad_clip_norm: float | None = None,
        meta_init: bool = False,
    ):
        self.model = model
        self.loss = loss
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.grad_clip_norm = grad_clip_norm
        self.meta_init = meta_init
        self.metrics = metrics
        self.strategy = strategy
        self.cluster = cluster
        self.plan = plan
        self.model_spec = model_spec
        self.loss_parallel = loss_parallel
        self.seed = seed

    if not TYPE_CHECKING:  # type checkers see the declared attributes only

        def __getattr__(self, name: str):
            """Only reached when `name` is not set: say which method learns it."""
            method = LEARNED_BY.get(name)
            if method is None:
                raise AttributeError(f"'Engine' object has no attribute {name!r}")
            raise AttributeError(
                f"Engine.{name} does not exist yet: it is learned by {method}(); "
                f"call {method}() first"
            )

    # ---- introspection (Paddle: main_program, dist_context) ---------------------------------
    @property
    def mode(self) -> str | None:
        return self._mode

    @property
    def history(self) -> dict[str, list] | None:
        """The logs of the last `fit` (Paddle's ``engine.history``), None before `fit`."""
        return getattr(self, "history_", None)

    @property
    def main_program(self) -> "nn.Module | list[nn.Module]":
        """The parallelized module this rank runs (a list with several pipeline stages)."""
        self._require_prepared()
        return self.model_parts_[0] if len(self.model_parts_) == 1 else list(self.model_parts_)

    @property
    def mesh(self) -> "DeviceMesh | None":
        """The DeviceMesh over (pp, dp, tp), or None in a single process."""
        self._require_prepared()
        return self.mesh_

    @property
    def _prepared(self) -> bool:
        return "trainer_" in vars(self)

    @_prepared.setter
    def _prepared(self, value: bool) -> None:
        """False drops the trainer (`tune` does): the next method builds it for `strategy_`."""
        if not value:
            vars(self).pop("trainer_", None)

    def _require_prepared(self) -> None:
        if not self._prepared:
            raise SpecError(
                "the engine is not prepared yet; call prepare(mode=...), fit, evaluate or predict"
                " first"
            )

    # ---- strategy, model, plan ------------------------------------------------------------
    def _resolve_strategy(self, batch_size: int | None = None) -> "Strategy":
        """`strategy_` once learned, else the constructor's strategy (not stored: `prepare`
        and `tune` learn `strategy_`)."""
        if "strategy_" in vars(self):
            return self.strategy_
        from autosearch.core.strategy import Strategy
        from autosearch.engine.distributed import launched_world_size

        s = self.strategy
        if s is None:
            world = launched_world_size()
            gbs = batch_size or world
            return Strategy(
                dp=world, micro_batch_size=max(1, gbs // world), global_batch_size=gbs, amp="fp32"
            )
        if isinstance(s, (str, os.PathLike)):
            return Strategy.parse(os.fspath(s))
        if isinstance(s, dict):
            return Strategy.from_dict(s)
        if not isinstance(s, Strategy):
            raise SpecError(
                "strategy must be a Strategy, a YAML path, a 'dp=2,tp=2' string or a dict; "
                f"got {type(s).__name__}"
            )
        return s

    def _model_spec(self) -> "ModelSpec":
        from autosearch.core.model_spec import ModelSpec
        from autosearch.engine.build import wrap_known

        if self.model_spec is not None:
            return ModelSpec.load(self.model_spec)
        spec = getattr(self.model, "spec", None)
        if spec is None and self._prepared:
            spec = getattr(self._built_model, "spec", None)
        if spec is None and _is_module(self.model):
            spec = getattr(wrap_known(self.model), "spec", None)
        if spec is None and callable(self.model) and not _is_module(self.model):
            import torch

            with torch.device("meta"):  # build on the meta device: shapes only, no memory
                spec = getattr(wrap_known(self.model()), "spec", None)
        if not isinstance(spec, ModelSpec):
            raise SpecError(
                "this needs the model's shape and the model carries no ModelSpec; pass "
                "Engine(..., model_spec=ModelSpec.load('tiny-gpt')) or a YAML path with "
                "n_layers, hidden_size, n_heads, vocab_size and seq_len"
            )
        return spec

    def _model_check(self) -> "Callable[[Strategy], list[str]] | None":
        """The model's own check of a strategy (its plan's ``check``: the Strategy rules and a
        family's refusals), from the built model, the instance wrapped, or the factory built
        on the meta device; None for a model whose plan has none."""
        from autosearch.engine.build import plan_for, wrap_known

        if self._prepared:
            model = self._built_model
        elif _is_module(self.model):
            model = wrap_known(self.model)
        elif callable(self.model):
            import torch

            with torch.device("meta"):  # shapes only, no memory
                model = wrap_known(self.model())
        else:
            return None
        return plan_for(model, self.plan).check

    def _build_model(self) -> "nn.Module":
        from autosearch.engine.build import build_model, is_module

        model = build_model(
            self.model, meta_init=self.meta_init, seed=self.seed, instance_used=self._instance_used
        )
        self._instance_used = not callable(self.model) or is_module(self.model)
        return model

    def _apply_lora(self, model: "nn.Module", strategy: "Strategy") -> None:
        """LoRA adapters where the model spec has them (`autosearch.engine.lora`)."""
        from autosearch.core.model_spec import ModelSpec

        given = self.model_spec
        spec = ModelSpec.load(given) if given is not None else getattr(model, "spec", None)
        lora = getattr(spec, "lora", None)
        if lora is None:
            return
        from autosearch.engine.lora import apply_lora, lora_problems

        problems = lora_problems(strategy)
        if self.meta_init:
            problems.append("meta_init with lora: build the model with meta_init=False")
        if problems:
            raise SpecError(problems, context=f"strategy {strategy.short()} with {lora.short()}")
        apply_lora(model, lora)

    def save_adapters(self, path: str) -> None:
        """Write the LoRA adapters alone in peft's format (`autosearch.engine.lora`)."""
        from autosearch.engine.lora import save_adapters

        self._prepare()
        config = getattr(self._built_model, "lora_config_", None)
        save_adapters(self.trainer_.model_parts, path, config=config)

    def load_adapters(self, path: str) -> int:
        """Load LoRA adapters written by `save_adapters` (or peft) into the prepared model."""
        from autosearch.engine.lora import load_adapters

        self._prepare()
        return load_adapters(self.trainer_.model_parts, path)

    def _problems(
        self, strategy: "Strategy", plan: "ParallelPlan", model: "nn.Module"
    ) -> list[str]:
        from autosearch.engine.build import device_label, strategy_problems
        from autosearch.engine.distributed import device

        return strategy_problems(strategy, plan, model, device=device_label(device()))

    # ---- prepare -----------------------------------------------------------------------------
    def to_mode(self, mode: str) -> "Engine":
        """Switch between ``train``, ``eval`` and ``predict`` (dropout on in train only)."""
        if mode not in MODES:
            raise SpecError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        self._mode = mode
        if self._prepared:
            self.trainer_.set_mode(mode)
        return self

    def prepare(self, *, mode: str | None = None) -> "Engine":
        """Check the strategy, build and parallelize the model, its optimizer and pipeline
        schedule.

        Every rank runs the same checks before its first collective, so an invalid strategy
        raises one SpecError on every rank and nothing hangs. Called by the other methods.
        """
        return self._prepare(mode=mode)

    def _prepare(self, *, mode: str | None = None, batch_size: int | None = None) -> "Engine":
        """`prepare`; `batch_size` sizes the default strategy (no strategy given)."""
        if mode is not None:
            self.to_mode(mode)
        if self._prepared:
            return self
        problems = engine_argument_problems(
            model=self.model,
            loss=self.loss,
            optimizer=self.optimizer,
            metrics=self.metrics,
            lr_scheduler=self.lr_scheduler,
            grad_clip_norm=self.grad_clip_norm,
            seed=self.seed,
            loss_parallel=self.loss_parallel,
            meta_init=self.meta_init,
        )
        if problems:
            raise SpecError(problems, context="Engine")
        import torch
        import torch.distributed as dist

        from autosearch.engine import build
        from autosearch.engine import distributed as D
        from autosearch.engine._trainer import Trainer, _PipelineLoss
        from autosearch.engine.build import plan_for
        from autosearch.engine.lr_schedule import build_schedulers
        from autosearch.engine.optim import OptimizerRecipe, build_optimizers, make_grad_scaler
        from autosearch.engine.parallel_dims import ParallelDims
        from autosearch.engine.parallelize import parallelize, tied_parameters
        from autosearch.engine.pipeline import TiedWeights, build_schedule

        strategy = self._resolve_strategy(batch_size)
        world = D.launched_world_size()
        dims = ParallelDims.from_strategy(strategy, world)
        model = self._build_model()
        self._apply_lora(model, strategy)
        plan = plan_for(model, self.plan)
        problems = self._problems(strategy, plan, model)
        if problems:
            raise SpecError(problems, context=f"strategy {strategy.short()} cannot run this model")
        D.init_distributed()
        device = D.device()
        mesh = dims.build_mesh(device.type)
        materialize = None
        if self.meta_init:
            materialize = functools.partial(build.materialize, device=device, seed=self.seed or 0)
        else:
            model.to(device)
            if world > 1:  # every rank starts from rank 0's weights, whatever the seeds were
                with torch.no_grad():
                    for tensor in [*model.parameters(), *model.buffers()]:
                        dist.broadcast(tensor.data, src=0)
        names = {id(p): n for n, p in model.named_parameters()}
        loss_parallel = bool(self.loss_parallel and dims.tp > 1)
        tied_groups = tied_parameters(model)
        parts = parallelize(
            model,
            strategy,
            dims,
            mesh,
            plan,
            device=device,
            loss_parallel=loss_parallel,
            materialize=materialize,
        )
        loss_fn = self.loss or token_cross_entropy
        scaler = make_grad_scaler(strategy.amp, device.type, distributed=world > 1)
        schedule = pipeline_loss = tied = None
        if dims.pp > 1:
            assert mesh is not None  # ParallelDims builds one for more than one process
            pipeline_loss = _PipelineLoss(loss_fn, scaler)
            schedule = build_schedule(parts, strategy, mesh, device, pipeline_loss)
            n_chunks = strategy.pp * strategy.virtual_stages
            tied = TiedWeights.build(tied_groups, parts, mesh, n_chunks)
            if tied is not None:
                tied.broadcast()
        optimizers = []
        if self.optimizer is not None:
            optimizers = build_optimizers(
                [module for _, module in parts],
                OptimizerRecipe(self.optimizer, names),
                dims,
                mesh,
                offload=strategy.offload_optimizer
                and not strategy.offload_params
                and device.type != "cpu",
            )
        self._built_model, self.plan_, self.strategy_ = model, plan, strategy
        self.trainer_ = Trainer(
            strategy=strategy,
            dims=dims,
            mesh=mesh,
            device=device,
            parts=parts,
            loss_fn=loss_fn,
            optimizers=optimizers,
            schedulers=build_schedulers(self.lr_scheduler, optimizers),
            scaler=scaler,
            schedule=schedule,
            pipeline_loss=pipeline_loss,
            metrics=_as_list(self.metrics),
            grad_clip_norm=self.grad_clip_norm,
            loss_parallel=loss_parallel,
            tied=tied,
        )
        self.to_mode(self._mode or "train")
        return self

    # ---- data --------------------------------------------------------------------------------
    def dataloader(
        self,
        dataset,
        *,
        batch_size: int | None = None,
        shuffle: bool = False,
        drop_last: bool | None = None,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        mode: str | None = None,
    ) -> "DistributedLoader":
        """A loader of this rank's share of each global batch (prepares the engine first).

        Args:
            dataset: a map-style or iterable dataset of ``(inputs, labels)`` samples.
            batch_size: the global batch (all dp ranks together); defaults to the strategy's
                ``global_batch_size``. Each dp rank gets ``batch_size / dp`` samples, split into
                micro-batches of ``micro_batch_size``; tp and pp peers get the same samples.
            drop_last: drop a last partial batch; default True in train mode and under
                pipeline parallelism (a partial batch cannot fill the pipeline's micro-batches),
                False otherwise (the distributed sampler then pads the last batch by repeating
                samples).
            epochs, steps_per_epoch: how long iterating the returned loader lasts.
            mode: ``train``, ``eval`` or ``predict`` (switches the engine's mode).
        """
        return self._loader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            collate_fn=collate_fn,
            num_workers=num_workers,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            mode=mode,
        )

    def _loader(
        self,
        dataset: Any,
        *,
        batch_size: int | None,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        num_workers: int = 0,
        shuffle: bool = False,
        drop_last: bool | None = None,
        collate_fn: Callable | None = None,
        mode: str | None = None,
        caller: str = "dataloader",
        steps_name: str = "steps_per_epoch",
    ) -> "DistributedLoader":
        """`dataloader`, with the method and the name of `steps_per_epoch` its messages give."""
        problems = data_problem(dataset, _DATA_NAMES.get((caller, mode or ""), "dataset"))
        problems += loader_problems(
            batch_size=batch_size,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            num_workers=num_workers,
            steps_name=steps_name,
        )
        if problems:
            raise SpecError(problems, context=caller)
        from autosearch.engine.data import build_loader, check_batch

        if mode is not None:
            self.to_mode(mode)
        mode = self._mode or "train"
        strategy = self._resolve_strategy(batch_size)
        batch_size = batch_size or strategy.global_batch_size
        # validates the strategy first, so its own message comes before batch messages
        self._prepare(batch_size=batch_size)
        strategy = self.strategy_
        check_batch(strategy, batch_size, mode)
        if drop_last is None:
            drop_last = mode == "train" or self.dims_.pp > 1
        dp_rank = self.mesh_.get_local_rank("dp") if self.mesh_ is not None else 0
        cp_rank = (
            self.mesh_.get_local_rank("cp") if self.mesh_ is not None and self.dims_.cp > 1 else 0
        )
        return build_loader(
            dataset,
            batch_size=batch_size,
            dp=strategy.dp,
            dp_rank=dp_rank,
            shuffle=shuffle,
            drop_last=drop_last,
            collate_fn=collate_fn,
            num_workers=num_workers,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            seed=self.seed or 0,
            cp=self.dims_.cp,
            cp_rank=cp_rank,
        )

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
        mode = self._mode or "train"
        sums, outputs = self.trainer_.run_batch(data, mode)
        if mode == "predict":
            return {"outputs": outputs}
        logs: dict[str, Any] = dict(self.trainer_.reduce(sums))
        if mode == "train" and self.trainer_.last_grad_norm is not None:
            logs["grad_norm"] = self.trainer_.last_grad_norm
        return logs

    def fit(
        self,
        train_data,
        *,
        batch_size: int | None = None,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        valid_data=None,
        valid_freq: int = 1,
        valid_steps: int | None = None,
        log_freq: int = 10,
        save_dir: str | None = None,
        save_freq: int = 1,
        save_steps: int | None = None,
        resume: "bool | str" = False,
        log_dir: str | None = None,
        tensorboard: bool = False,
        collate_fn: Callable | None = None,
        callbacks: Sequence | None = None,
        verbose: int = 2,
        shuffle: bool = False,
    ) -> dict[str, list]:
        """Train for `epochs` epochs; returns (and stores in ``self.history``) per-step and
        per-epoch logs.

        Args:
            train_data: dataset of ``(inputs, labels)`` (e.g. `TokenFile`).
            batch_size: global batch per optimizer step (default: the strategy's).
            epochs, steps_per_epoch: length of training (steps_per_epoch caps each epoch).
            valid_data, valid_freq, valid_steps: evaluate every `valid_freq` epochs (`valid_steps`
            batches).
            log_freq: print a progress line every `log_freq` steps (rank 0, `verbose` >= 2, when
                stdout is not a terminal; on a terminal a tqdm bar shows loss, tokens/s and MFU).
            save_dir: where checkpoints go: ``epoch<N>`` every `save_freq` epochs,
                ``step<N>`` every `save_steps` optimizer steps, and ``final`` at the end.
            resume: True to continue from the newest ``step<N>`` checkpoint of `save_dir` (if
                any), or a checkpoint path: model, optimizer, schedulers, data position and RNG
                come back.
            log_dir: rank 0 appends one row per step to ``<log_dir>/metrics.csv`` (step, epoch,
                loss, lr, grad_norm, step_time_s, tokens_per_s, mfu); with ``tensorboard=True``
                also TensorBoard scalars there.
            collate_fn: merges samples into a batch.
            callbacks: objects with any of on_train_begin(logs), on_epoch_begin(epoch),
                on_batch_end(step, logs), on_epoch_end(epoch, logs), on_train_end(logs).
            verbose: 0 silent, 1 one line per epoch, 2 also progress.

        Returns:
            ``{"loss", "step_time_s", "tokens_per_s", "lr" (and "grad_norm" when clipping, "mfu"
            when the cluster is known): one entry per step run by this call, "epoch_loss": one
            per epoch,
            "val_loss" and "val_<metric>": one per evaluation, <metric>: one per epoch}``.
        """
        config = FitConfig(
            batch_size=batch_size,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            valid_freq=valid_freq,
            valid_steps=valid_steps,
            log_freq=log_freq,
            save_dir=save_dir,
            save_freq=save_freq,
            save_steps=save_steps,
            resume=resume,
            log_dir=log_dir,
            tensorboard=tensorboard,
            collate_fn=collate_fn,
            callbacks=callbacks,
            verbose=verbose,
            shuffle=shuffle,
        )
        loader = self._loader(
            train_data,
            batch_size=config.batch_size,
            shuffle=config.shuffle,
            collate_fn=config.collate_fn,
            epochs=config.epochs,
            steps_per_epoch=config.steps_per_epoch,
            mode="train",
            caller="fit",
        )
        valid = None
        if valid_data is not None:
            valid = self._loader(
                valid_data,
                batch_size=config.batch_size,
                collate_fn=config.collate_fn,
                steps_per_epoch=config.valid_steps,
                caller="fit",
                steps_name="valid_steps",
                mode="eval",
            )
            self.to_mode("train")
        flops_per_token, peak_flops = self._mfu_inputs()
        return self.trainer_.fit(
            loader, config, valid=valid, flops_per_token=flops_per_token, peak_flops=peak_flops
        )

    def evaluate(
        self,
        valid_data,
        *,
        batch_size: int | None = None,
        steps: int | None = None,
        log_freq: int = 10,
        collate_fn: Callable | None = None,
        callbacks: Sequence | None = None,
        verbose: int = 2,
    ) -> dict[str, float]:
        """Loss and metrics over `valid_data` (or its first `steps` batches), reduced over all
        ranks."""
        from autosearch.engine.distributed import is_rank0

        loader = self._loader(
            valid_data,
            batch_size=batch_size,
            collate_fn=collate_fn,
            steps_per_epoch=steps,
            mode="eval",
            caller="evaluate",
            steps_name="steps",
        )
        logs = self.trainer_.evaluate(loader, callbacks)
        if verbose and is_rank0():
            print("eval: " + " ".join(f"{k} {v:.4f}" for k, v in logs.items()), flush=True)
        call(callbacks, "on_eval_end", logs)
        return logs

    def predict(
        self,
        test_data,
        *,
        batch_size: int | None = None,
        steps: int | None = None,
        collate_fn: Callable | None = None,
        callbacks: Sequence | None = None,
        verbose: int = 2,
    ) -> list:
        """Outputs for this rank's samples, one tensor per batch.

        Each dp rank returns the outputs of the samples the distributed sampler gave it (sample
        j of each batch goes to dp rank j % dp); ranks that do not hold the last pipeline stage
        return an empty list.
        """
        loader = self._loader(
            test_data,
            batch_size=batch_size,
            collate_fn=collate_fn,
            steps_per_epoch=steps,
            mode="predict",
            caller="predict",
            steps_name="steps",
        )
        return self.trainer_.predict(loader, callbacks)

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, path: str, training: bool = True) -> None:
        """Save a DCP checkpoint directory (model, optimizer and the train state `fit` resumes
        from), or with ``training=False`` a plain inference state dict file (``torch.load``-able,
        full tensors, original parameter names). Replacing an existing checkpoint is crash-safe:
        a kill leaves the previous one or the new one complete (`autosearch.engine.checkpoint`)."""
        problems = checkpoint_problem(path, loading=False)
        if problems:
            raise SpecError(problems, context="save")
        self.prepare()
        self.trainer_.save(path, training=training)

    def load(self, path: str, strict: bool = True, load_optimizer: bool = True) -> list[str]:
        """Load a checkpoint saved by `save` under any strategy; returns what was not loaded.

        With `load_optimizer`, the train state comes back too (step, schedulers, data position,
        RNG). Only tensors and plain values are read (no code runs from a checkpoint; see
        `autosearch.engine.checkpoint` for what must still be trusted).
        """
        problems = checkpoint_problem(path, loading=True)
        if problems:
            raise SpecError(problems, context="load")
        self.prepare()
        return self.trainer_.load(path, strict=strict, load_optimizer=load_optimizer)

    def save_pretrained(self, folder: str) -> None:
        """Save a Hugging Face model (any family the Engine wraps) in transformers' format,
        loadable by ``AutoModelForCausalLM.from_pretrained(folder)``, from any strategy."""
        from autosearch.models.hf.causal_lm import save_pretrained

        self.prepare()
        save_pretrained(
            self._built_model, folder, save_weights=functools.partial(self.save, training=False)
        )

    # ---- cost model and search ---------------------------------------------------------------
    def _cluster(self) -> "Cluster":
        from autosearch.core.hardware import Cluster

        if self.cluster is None:
            raise SpecError(
                "this needs a cluster to model: pass Engine(..., cluster='h100-sxm:1x8') "
                "(a profile name from `autosearch hardware`, nodes x devices per node)"
            )
        return Cluster.parse(self.cluster)

    def _mfu_inputs(self) -> tuple[float | None, float | None]:
        """(flops per token, peak FLOP/s of the whole run) if the model spec and cluster are known
        (the engine's cluster, else the one `tune` searched for)."""
        tuned: Cluster | None = getattr(self, "tuned_cluster_", None)  # tune sets it on every rank
        try:
            cluster = self._cluster() if self.cluster is not None else tuned
            if cluster is None:
                return None, None
            spec = self._model_spec()
        except SpecError:
            return None, None
        peak = cluster.profile.peak_flops.get(self.strategy_.amp)
        if not peak:
            return None, None
        return spec.flops_per_token(training=True), peak * self.dims_.world_size

    def cost(self, mode: str = "train") -> tuple[float, float]:
        """Predicted (step_time_s, peak_memory_bytes) of the current strategy on `cluster`,
        from the analytic cost model; ``self.cost_report_`` keeps the full breakdown."""
        from cost_models.analytic import AnalyticCostModel

        if mode != "train":
            raise SpecError(
                f"the analytic cost model predicts training steps; cost(mode={mode!r}) is not"
                " modelled"
            )
        report = AnalyticCostModel(self._model_spec(), self._cluster()).estimate(
            self._resolve_strategy()
        )
        self.cost_report_ = report
        return report.step_time_s, report.peak_memory_bytes


def _is_module(obj: object) -> bool:
    from torch import nn

    return isinstance(obj, nn.Module)


def _as_list(metrics: Any) -> list:
    if metrics is None:
        return []
    return list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]
