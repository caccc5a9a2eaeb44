"""Metrics the Engine accumulates over batches and reduces over the ranks.

A metric turns one batch into a vector of sums (`batch_sums`); the Engine adds them up locally,
sums them over the dp ranks (and from the last pipeline stage) at the end, and calls `compute`.
Sums, not per-rank averages, so the result is the same for any dp degree.
"""

from __future__ import annotations

import torch


class Metric:
    """Base class: subclasses define `name`, `width` (how many sums), `batch_sums` and
    `compute`."""

    name = "metric"
    width = 1

    def batch_sums(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A 1-D float64 tensor of `width` sums over the samples of one batch."""
        raise NotImplementedError

    def compute(self, sums: torch.Tensor) -> float:
        """The metric from the sums over every batch and every rank."""
        raise NotImplementedError


class Accuracy(Metric):
    """Top-k accuracy of class (or next-token) predictions; outputs (..., classes), labels
    (...)."""

    def __init__(self, topk: int = 1, *, ignore_index: int = -100):
        self.topk, self.ignore_index = topk, ignore_index
        self.name = "accuracy" if topk == 1 else f"top{topk}_accuracy"
        self.width = 2  # hits, counted labels

    def batch_sums(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        top = outputs.topk(self.topk, dim=-1).indices
        valid = labels != self.ignore_index
        hit = (top == labels.unsqueeze(-1)).any(-1) & valid
        return torch.tensor([hit.sum().item(), valid.sum().item()], dtype=torch.float64)

    def compute(self, sums: torch.Tensor) -> float:
        return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
