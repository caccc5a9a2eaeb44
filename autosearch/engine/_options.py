"""What a user gives the Engine and its `fit`, checked before anything runs; checkpoint names.

`FitConfig` is the frozen form of ``Engine.fit``'s keywords (the Paddle-style keyword API stays
at the public method); `engine_argument_problems` checks the constructor's arguments when the
Engine first needs them (sklearn style: ``__init__`` only stores them). Every wrong value is
refused with one SpecError naming the argument, its value and what to pass instead, before a
process group, a model or a file exists. Importing this module does not import torch.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autosearch.core.errors import SpecError

STEP_DIR = re.compile(r"step(\d+)$")
# The seeds torch.manual_seed accepts (a 64-bit integer, signed or not).
SEED_RANGE = (-(2**63), 2**64 - 1)


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


def call(callbacks: Sequence | None, hook: str, *args: Any) -> None:
    """Call ``hook(*args)`` on every callback that has it."""
    for cb in callbacks or ():
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(*args)


# ---- checks ------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_problem(
    name: str, value: Any, *, low: int, what: str, optional: bool = False
) -> list[str]:
    if (optional and value is None) or (_is_int(value) and value >= low):
        return []
    none = " or None" if optional else ""
    return [f"{name}={value!r}: {name} must be an integer >= {low}{none} ({what})"]


def _bool_problem(name: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return []
    return [f"{name}={value!r}: {name} must be True or False"]


def _path_problem(name: str, value: Any, what: str) -> list[str]:
    if value is None or isinstance(value, (str, os.PathLike)):
        return []
    return [f"{name}={value!r}: {name} must be a folder path (str) or None ({what})"]


def _callable_problem(name: str, value: Any, what: str) -> list[str]:
    if value is None or callable(value):
        return []
    return [f"{name}={value!r}: {name} must be a callable or None ({what})"]


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """The options of one `Engine.fit` call (documented there), checked when built."""

    batch_size: int | None = None
    epochs: int = 1
    steps_per_epoch: int | None = None
    valid_freq: int = 1
    valid_steps: int | None = None
    log_freq: int = 10
    save_dir: str | None = None
    save_freq: int = 1
    save_steps: int | None = None
    resume: bool | str = False
    log_dir: str | None = None
    tensorboard: bool = False
    collate_fn: Callable | None = None
    callbacks: Sequence | None = None
    verbose: int = 2
    shuffle: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise SpecError(problems, context="fit")
        for name in ("save_dir", "log_dir"):  # os.PathLike to str, once
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, os.fspath(value))
        if isinstance(self.resume, os.PathLike):
            object.__setattr__(self, "resume", os.fspath(self.resume))

    def problems(self) -> list[str]:
        p = loader_problems(
            batch_size=self.batch_size, epochs=self.epochs, steps_per_epoch=self.steps_per_epoch
        )
        p += _int_problem("valid_freq", self.valid_freq, low=1, what="epochs between evaluations")
        p += _int_problem(
            "valid_steps", self.valid_steps, low=1, what="batches per evaluation", optional=True
        )
        p += _int_problem("log_freq", self.log_freq, low=1, what="steps between progress lines")
        p += _int_problem("save_freq", self.save_freq, low=1, what="epochs between checkpoints")
        p += _int_problem(
            "save_steps", self.save_steps, low=1, what="steps between checkpoints", optional=True
        )
        p += _int_problem("verbose", self.verbose, low=0, what="0, 1 or 2")
        p += _path_problem("save_dir", self.save_dir, "where checkpoints go")
        p += _path_problem("log_dir", self.log_dir, "where metrics.csv goes")
        p += _bool_problem("tensorboard", self.tensorboard)
        p += _bool_problem("shuffle", self.shuffle)
        p += _callable_problem("collate_fn", self.collate_fn, "merges samples into a batch")
        if not isinstance(self.resume, (bool, str, os.PathLike)):
            p.append(f"resume={self.resume!r}: resume must be True, False or a checkpoint path")
        if self.callbacks is not None and (
            isinstance(self.callbacks, (str, bytes)) or not isinstance(self.callbacks, Sequence)
        ):
            p.append(
                f"callbacks={self.callbacks!r}: callbacks must be a list of objects with "
                "on_batch_end(...) and the other hooks; pass callbacks=[...]"
            )
        if (self.save_steps or self.resume is True) and self.save_dir is None:
            p.append(
                "save_steps and resume=True need save_dir=... "
                "(where checkpoints are written and found)"
            )
        if self.tensorboard is True and self.log_dir is None:
            p.append("tensorboard=True needs log_dir=... (the folder TensorBoard reads)")
        return p


def checkpoint_problem(path: Any, *, loading: bool) -> list[str]:
    """Why `path` is not a checkpoint path `Engine.save` / `Engine.load` takes: a text or a
    path; for loading, a file must be a torch.save archive (a zip), checked before the model is
    built (torch.load of a text file says only "KeyError: 101")."""
    import zipfile

    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        return [
            f"path={_short(path)}: a checkpoint is a folder path (Engine.save) or a file path "
            "(Engine.save(path, training=False))"
        ]
    path = os.fspath(path)
    if loading and os.path.isfile(path) and not zipfile.is_zipfile(path):
        return [
            f"path={path!r} is not a checkpoint (not a torch.save archive: a text file, or a "
            "file cut short?); pass a folder written by Engine.save or a file written by "
            "Engine.save(path, training=False)"
        ]
    return []


def data_problem(data: Any, name: str) -> list[str]:
    """Why `data` is not a dataset the Engine's loader reads: a map-style dataset (``len`` and
    ``[i]``) or an iterable one; checked before the loader (torch's sampler says only "object
    of type 'NoneType' has no len()")."""
    mapped = hasattr(data, "__getitem__") and hasattr(data, "__len__")
    if data is None or isinstance(data, (str, bytes)) or not (mapped or hasattr(data, "__iter__")):
        return [
            f"{name}={_short(data)}: {name} must be a dataset of (inputs, labels) samples: "
            "a map-style dataset (len and [i], e.g. TokenFile or a list) or an iterable one"
        ]
    return []


def loader_problems(
    *,
    batch_size: Any,
    epochs: Any = 1,
    steps_per_epoch: Any = None,
    num_workers: Any = 0,
    steps_name: str = "steps_per_epoch",
) -> list[str]:
    """Why these `Engine.dataloader` (and fit / evaluate / predict) options cannot work;
    `steps_name` is what the caller calls `steps_per_epoch` (evaluate's ``steps``)."""
    p = _int_problem(
        "batch_size",
        batch_size,
        low=1,
        what="sequences per global batch over every rank; None for the strategy's",
        optional=True,
    )
    p += _int_problem("epochs", epochs, low=1, what="passes over the data")
    p += _int_problem(
        steps_name, steps_per_epoch, low=1, what="batches per epoch at most", optional=True
    )
    p += _int_problem("num_workers", num_workers, low=0, what="DataLoader worker processes")
    return p


def engine_argument_problems(
    *,
    model: Any,
    loss: Any,
    optimizer: Any,
    metrics: Any,
    lr_scheduler: Any,
    grad_clip_norm: Any,
    seed: Any,
    loss_parallel: Any,
    meta_init: Any,
) -> list[str]:
    """Why the Engine's constructor arguments cannot work (empty when they can); torch-free,
    so a wrong value is refused before torch is imported."""
    p = []
    if not callable(model):  # an nn.Module is callable too
        p.append(
            f"model={_short(model)}: model must be an nn.Module or a zero-argument factory "
            "(e.g. lambda: Transformer(spec))"
        )
    p += _callable_problem("loss", loss, "loss(outputs, labels) -> scalar")
    if optimizer is not None and not callable(optimizer) and not _is_optimizer(optimizer):
        p.append(
            f"optimizer={_short(optimizer)}: optimizer must be a torch.optim.Optimizer or a "
            "callable params -> Optimizer, e.g. torch.optim.AdamW(model.parameters(), lr=3e-4)"
        )
    for metric in metrics if isinstance(metrics, (list, tuple)) else [metrics]:
        if metric is not None and not _is_metric(metric):
            p.append(
                f"metrics={_short(metrics)}: metrics must be a Metric or a list of Metrics (with "
                "name, width, batch_sums and compute), e.g. metrics=[Accuracy()]"
            )
            break
    if lr_scheduler is not None and not callable(lr_scheduler):
        p.append(
            f"lr_scheduler={_short(lr_scheduler)}: lr_scheduler must be a recipe optimizer -> "
            "scheduler, because the Engine rebuilds the optimizer over the parallelized "
            "parameters; e.g. lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 100),"
            " or WarmupDecay(...)"
        )
    if grad_clip_norm is not None and not (
        isinstance(grad_clip_norm, (int, float))
        and not isinstance(grad_clip_norm, bool)
        and grad_clip_norm > 0  # False for nan
    ):
        p.append(
            f"grad_clip_norm={grad_clip_norm!r}: grad_clip_norm must be a number > 0 (the largest "
            "global gradient norm; float('inf') only measures it) or None for no clipping"
        )
    if seed is not None and not (_is_int(seed) and SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        p.append(
            f"seed={_short(seed)}: seed must be an integer in [-2**63, 2**64 - 1] "
            "(what torch.manual_seed takes) or None"
        )
    p += _bool_problem("loss_parallel", loss_parallel)
    p += _bool_problem("meta_init", meta_init)
    return p


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_metric(obj: Any) -> bool:
    return (
        isinstance(getattr(obj, "name", None), str)
        and _is_int(getattr(obj, "width", None))
        and callable(getattr(obj, "batch_sums", None))
        and callable(getattr(obj, "compute", None))
    )


def _is_optimizer(obj: Any) -> bool:
    """An optimizer instance (read without importing torch: torch is loaded if it is one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.optim.Optimizer)
