"""Learning-rate schedules for the Engine: warm-up then cosine or linear decay, or any torch
scheduler.

The Engine builds one optimizer per model part (several with pipeline stages), so a schedule is
given as a recipe ``optimizer -> torch.optim.lr_scheduler.LRScheduler`` and built once per
optimizer; it is stepped after every optimizer step. Any torch scheduler fits::

    Engine(..., lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100))
    Engine(..., lr_scheduler=WarmupDecay(warmup_steps=100, total_steps=2000, decay="cosine"))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autosearch.core.errors import SpecError

DECAYS = ("cosine", "linear", "constant")


@dataclass(frozen=True, kw_only=True)
class WarmupDecay:
    """Linear warm-up, then cosine or linear decay to ``min_lr_ratio`` x the base learning rate.

    The multiplier of the base rate after `step` optimizer steps is ``(step + 1) / (warmup_steps +
    1)`` during warm-up (nanoGPT's form, never 0), then for progress p = (step - warmup) / (total -
    warmup) clipped to [0, 1]: ``min + (1 - min) * (1 + cos(pi p)) / 2`` (cosine; Loshchilov and
    Hutter 2017, without restarts) or ``min + (1 - min) * (1 - p)`` (linear).

    Args:
        warmup_steps: steps of linear warm-up (0 for none).
        total_steps: the step at which the decay reaches its minimum (and stays there).
        decay: ``cosine``, ``linear`` or ``constant`` (warm-up only).
        min_lr_ratio: the final learning rate as a fraction of the base rate.
    """

    warmup_steps: int = 0
    total_steps: int
    decay: str = "cosine"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            problems.append(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.total_steps, int) or self.total_steps <= 0:
            problems.append(f"total_steps must be an integer > 0, got {self.total_steps!r}")
        elif isinstance(self.warmup_steps, int) and self.warmup_steps > self.total_steps:
            problems.append(
                f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}"
            )
        if self.decay not in DECAYS:
            problems.append(f"decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if problems:
            raise SpecError(problems, context="learning-rate schedule")

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate after `step` optimizer steps."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        p = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1.0 + math.cos(math.pi * p)) if self.decay == "cosine" else 1.0 - p
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def __call__(self, optimizer):
        from torch.optim.lr_scheduler import LambdaLR

        factor = self.factor

        def lr_lambda(step: int) -> float:  # a plain function: LambdaLR's state_dict skips it
            return factor(step)

        return LambdaLR(optimizer, lr_lambda)


def build_schedulers(recipe, optimizers: list) -> list:
    """One scheduler per optimizer from `recipe` (``optimizer -> LRScheduler``); [] for None."""
    if recipe is None:
        return []
    import torch

    if isinstance(recipe, torch.optim.lr_scheduler.LRScheduler):
        raise SpecError(
            "lr_scheduler must be a recipe optimizer -> scheduler, because the Engine rebuilds "
            "the "
            "optimizer over the parallelized parameters; e.g. lr_scheduler=lambda opt: "
            f"torch.optim.lr_scheduler.{type(recipe).__name__}(opt, ...), or WarmupDecay(...)"
        )
    if not callable(recipe):
        raise SpecError(
            f"lr_scheduler must be a callable optimizer -> scheduler, got {type(recipe).__name__}"
        )
    schedulers = [recipe(opt) for opt in optimizers]
    for s in schedulers:
        if not hasattr(s, "step") or not hasattr(s, "state_dict"):
            raise SpecError(
                f"lr_scheduler returned {type(s).__name__}, not a torch learning-rate scheduler"
            )
    return schedulers
