"""Data for the Engine: a distributed loader over the dp ranks, and a synthetic token dataset.

Every batch is ``(inputs, labels)``. The global batch of a step is split over the dp ranks only:
the ranks of one tp group and of one pipeline share the same dp rank, so they read the same
samples (tp peers need identical inputs; pipeline stages other than the first ignore them).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from autosearch.core.errors import SpecError


class SyntheticTokens(Dataset):
    """Token sequences from a fixed random Markov chain: each token is followed by its successor
    in a random table (the same for every sample) with probability 0.9, by a uniform token otherwise.

    Sample i is ``(tokens[:-1], tokens[1:])`` drawn from a generator seeded with (seed, i), so every
    rank and every process sees the same sample i. The loss starts near ln(vocab_size) and falls
    towards the chain's entropy (about 0.33 + 0.1 ln(vocab_size) nats) as the model learns the table.
    Datasets with different `seed` and the same `table_seed` (training and validation) share the chain.

    Args:
        n_samples: dataset length.
        seq_len: tokens per input sequence.
        vocab_size: token ids are in [0, vocab_size).
        seed: seed of the samples.
        table_seed: seed of the successor table.
        noise: probability of a uniform random token instead of the successor.
    """

    def __init__(self, n_samples: int, *, seq_len: int, vocab_size: int, seed: int = 0, table_seed: int = 0,
                 noise: float = 0.1):
        self.n_samples, self.seq_len, self.vocab_size, self.seed, self.noise = n_samples, seq_len, vocab_size, seed, noise
        self.successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(table_seed))

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n_samples:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        random_tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
        jump = torch.rand(self.seq_len + 1, generator=g) < self.noise
        tokens = random_tokens.clone()
        for t in range(1, self.seq_len + 1):
            if not jump[t]:
                tokens[t] = self.successor[tokens[t - 1]]
        return tokens[:-1].clone(), tokens[1:].clone()

    @classmethod
    def for_model(cls, spec, n_samples: int, *, seed: int = 0) -> "SyntheticTokens":
        """A dataset with the sequence length and vocabulary of a ModelSpec."""
        return cls(n_samples, seq_len=spec.seq_len, vocab_size=spec.vocab_size, seed=seed)


class _DpShard(IterableDataset):
    """Sample j of an iterable dataset goes to dp rank j % dp (written by hand: torch has no
    sharding wrapper for iterable datasets outside torchdata). A global batch of B consecutive
    samples is then the union of the dp ranks' local batches, as with DistributedSampler."""

    def __init__(self, dataset: IterableDataset, dp: int, dp_rank: int):
        self.dataset, self.dp, self.dp_rank = dataset, dp, dp_rank

    def __iter__(self) -> Iterator[Any]:
        for j, sample in enumerate(self.dataset):
            if j % self.dp == self.dp_rank:
                yield sample


class DistributedLoader:
    """Local batches of this dp rank for ``epochs`` epochs of at most ``steps_per_epoch`` steps.

    Attributes:
        loader: the underlying `torch.utils.data.DataLoader` (one epoch).
        local_batch_size: samples per batch on this rank (global batch / dp).
    """

    def __init__(self, loader: DataLoader, sampler: DistributedSampler | None, *, epochs: int,
                 steps_per_epoch: int | None, local_batch_size: int):
        self.loader, self.sampler, self.epochs = loader, sampler, epochs
        self.steps_per_epoch, self.local_batch_size = steps_per_epoch, local_batch_size

    def epoch(self, epoch: int) -> Iterator[Any]:
        """The batches of one epoch (reshuffled per epoch when shuffling)."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        for step, batch in enumerate(self.loader):
            if self.steps_per_epoch is not None and step >= self.steps_per_epoch:
                break
            yield batch

    def __iter__(self) -> Iterator[Any]:
        for epoch in range(self.epochs):
            yield from self.epoch(epoch)

    def steps(self) -> int | None:
        """Batches per epoch, if known."""
        try:
            n = len(self.loader)
        except TypeError:
            return self.steps_per_epoch
        return n if self.steps_per_epoch is None else min(n, self.steps_per_epoch)

    def __len__(self) -> int:
        steps = self.steps()
        if steps is None:
            raise TypeError("the length of a loader over an iterable dataset is unknown; pass steps_per_epoch")
        return steps * self.epochs


def build_loader(dataset: Any, *, batch_size: int, dp: int, dp_rank: int, shuffle: bool = False,
                 drop_last: bool = True, collate_fn: Callable | None = None, num_workers: int = 0,
                 epochs: int = 1, steps_per_epoch: int | None = None, seed: int = 0) -> DistributedLoader:
    """A loader of local batches (``batch_size / dp`` samples each) for this dp rank."""
    if batch_size % dp:
        raise SpecError(f"batch_size={batch_size} does not split over dp={dp} ranks; use a multiple of {dp}")
    local = batch_size // dp
    sampler = None
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise SpecError("shuffle=True needs a map-style dataset (with __len__ and __getitem__); "
                            "shuffle an iterable dataset yourself")
        source = _DpShard(dataset, dp, dp_rank) if dp > 1 else dataset
    else:
        # drop_last on the sampler too, so every dp rank gets the same number of batches.
        sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
        source = dataset
    loader = DataLoader(source, batch_size=local, sampler=sampler, drop_last=drop_last,
                        collate_fn=collate_fn, num_workers=num_workers)
    return DistributedLoader(loader, sampler, epochs=epochs, steps_per_epoch=steps_per_epoch,
                             local_batch_size=local)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, labels)`` of a batch; a bare tensor is inputs without labels (predict)."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) == 1:
            return batch[0], None
    if isinstance(batch, dict) and "inputs" in batch:
        return batch["inputs"], batch.get("labels")
    if isinstance(batch, torch.Tensor):
        return batch, None
    raise SpecError(
        f"a batch must be (inputs, labels), a dict with 'inputs' (and 'labels'), or an inputs tensor; "
        f"got {type(batch).__name__}. Use a collate_fn that returns (inputs, labels)"
    )
