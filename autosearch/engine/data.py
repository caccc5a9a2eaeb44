"""Data for the Engine: a distributed loader over the dp ranks, and a synthetic token dataset.

Every batch is ``(inputs, labels)``. The global batch of a step is split over the dp ranks only:
the ranks of one tp group and of one pipeline share the same dp rank, so they read the same
samples (tp peers need identical inputs; pipeline stages other than the first ignore them). The
ranks of one cp group read the same samples too, and the loader keeps each rank's chunks of the
sequence (load-balanced: chunks i and 2cp-1-i of 2 cp; `autosearch.distributed.context_parallel`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from autosearch.core.errors import SpecError


class SyntheticTokens(Dataset):
    """Token sequences from a fixed random Markov chain: each token is followed by its successor
    in a random table (the same for every sample) with probability 0.9, by a uniform token
    otherwise.

    Sample i is ``(tokens[:-1], tokens[1:])`` drawn from a generator seeded with (seed, i), so
    every
    rank and every process sees the same sample i. The loss starts near ln(vocab_size) and falls
    towards the chain's entropy (about 0.33 + 0.1 ln(vocab_size) nats) as the model learns the
    table.
    Datasets with different `seed` and the same `table_seed` (training and validation) share the
    chain.

    Args:
        n_samples: dataset length.
        seq_len: tokens per input sequence.
        vocab_size: token ids are in [0, vocab_size).
        seed: seed of the samples.
        table_seed: seed of the successor table.
        noise: probability of a uniform random token instead of the successor.
    """

    def __init__(
        self,
        n_samples: int,
        *,
        seq_len: int,
        vocab_size: int,
        seed: int = 0,
        table_seed: int = 0,
        noise: float = 0.1,
    ):
        self.n_samples, self.seq_len, self.vocab_size, self.seed, self.noise = (
            n_samples,
            seq_len,
            vocab_size,
            seed,
            noise,
        )
        self.successor = torch.randperm(
            vocab_size, generator=torch.Generator().manual_seed(table_seed)
        )

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


class TokenFile(Dataset):
    """Training sequences from a flat file of token ids, memory-mapped (nanoGPT's ``train.bin``).

    The file is a raw array of ``dtype`` token ids (``np.uint16`` for vocabularies up to 65,536,
    as nanoGPT writes them; ``np.uint32`` beyond), e.g. ``np.array(ids, np.uint16).tofile(path)``.
    Sample i is the window ``tokens[i*stride : i*stride + seq_len + 1]`` split into
    ``(inputs, labels)`` shifted by one, as int64 tensors. With ``stride = seq_len`` (default) the
    windows tile the file without overlap. Only the pages of the samples read are loaded, so the
    file can be far larger than memory; each process maps the file itself.

    Sharding over dp is the Engine's loader (`DistributedSampler`: sample j of each global batch
    goes to dp rank j % dp, with ``shuffle=True`` a seeded permutation per epoch), so every rank
    reads only its own windows.

    Args:
        path: the token file.
        seq_len: tokens per input sequence.
        dtype: numpy dtype of the ids in the file.
        stride: tokens between the starts of consecutive samples (default `seq_len`).
        vocab_size: if given, the file's ids are checked to be below it (reads the file once).
    """

    def __init__(
        self,
        path: "str | os.PathLike",
        *,
        seq_len: int,
        dtype="uint16",
        stride: int | None = None,
        vocab_size: int | None = None,
    ):
        self.path, self.seq_len = os.fspath(path), seq_len
        self.stride = stride or seq_len
        if not all(isinstance(v, int) and v > 0 for v in (seq_len, self.stride)):
            raise SpecError(
                f"seq_len and stride must be positive integers, got {seq_len!r} and {stride!r}"
            )
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise SpecError(
                f"dtype {dtype!r} is not a numpy dtype; use 'uint16' or 'uint32'"
            ) from None
        if self.dtype.kind not in "iu":
            raise SpecError(f"token ids must be integers; dtype {self.dtype} is not")
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise SpecError(f"token file {self.path!r} cannot be read: {exc.strerror}") from None
        if size % self.dtype.itemsize:
            raise SpecError(
                f"token file {self.path!r} has {size} bytes, not a multiple of "
                f"{self.dtype.itemsize} ({self.dtype}); is the dtype right?"
            )
        self.n_tokens = size // self.dtype.itemsize
        if self.n_tokens < seq_len + 1:
            raise SpecError(
                f"token file {self.path!r} holds {self.n_tokens} tokens, fewer than "
                f"one sample (seq_len + 1 = {seq_len + 1})"
            )
        self._tokens: np.ndarray | None = None
        if vocab_size is not None:
            top = int(self.tokens.max())
            if top >= vocab_size:
                raise SpecError(
                    f"token file {self.path!r} holds id {top}, not below "
                    f"vocab_size={vocab_size}; was it tokenized for another model?"
                )

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:  # mapped lazily, so each DataLoader worker maps its own
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return (self.n_tokens - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.stride
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


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

    def __init__(
        self,
        loader: DataLoader,
        sampler: DistributedSampler | None,
        *,
        epochs: int,
        steps_per_epoch: int | None,
        local_batch_size: int,
    ):
        self.loader, self.sampler, self.epochs = loader, sampler, epochs
        self.steps_per_epoch, self.local_batch_size = steps_per_epoch, local_batch_size

    def epoch(self, epoch: int, *, skip: int = 0) -> Iterator[Any]:
        """The batches of one epoch (reshuffled per epoch when shuffling), after the first `skip`.

        Skipping is what resuming uses: global batch k is samples [k B, (k+1) B) of the epoch's
        order whatever the dp degree (`DistributedSampler` deals sample j to dp rank j % dp), so
        each rank drops its first ``skip * B / dp`` indices without reading them. An iterable
        dataset is read through the skipped batches.
        """
        loader: Iterable[Any] = self.loader
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            if skip:
                indices = list(self.sampler)[skip * self.local_batch_size :]
                whole = self.loader
                loader = DataLoader(
                    whole.dataset,
                    batch_size=self.local_batch_size,
                    sampler=indices,
                    drop_last=whole.drop_last,
                    collate_fn=whole.collate_fn,
                    num_workers=whole.num_workers,
                    generator=whole.generator,
                )
        elif skip:
            loader = itertools.islice(loader, skip, None)
        for step, batch in enumerate(loader, start=skip):
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
            raise TypeError(
                "the length of a loader over an iterable dataset is unknown; pass steps_per_epoch"
            )
        return steps * self.epochs


def build_loader(
    dataset: Any,
    *,
    batch_size: int,
    dp: int,
    dp_rank: int,
    shuffle: bool = False,
    drop_last: bool = True,
    collate_fn: Callable | None = None,
    num_workers: int = 0,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    seed: int = 0,
    cp: int = 1,
    cp_rank: int = 0,
) -> DistributedLoader:
    """A loader of local batches (``batch_size / dp`` samples each) for this dp rank; with
    context parallel (`cp` > 1) each batch holds this cp rank's chunks of every sequence."""
    if batch_size % dp:
        raise SpecError(
            f"batch_size={batch_size} does not split over dp={dp} ranks; use a multiple of {dp}"
        )
    local = batch_size // dp
    sampler: DistributedSampler | None = None
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise SpecError(
                "shuffle=True needs a map-style dataset (with __len__ and __getitem__); "
                "shuffle an iterable dataset yourself"
            )
        source = _DpShard(dataset, dp, dp_rank) if dp > 1 else dataset
    else:
        # drop_last on the sampler too, so every dp rank gets the same number of batches.
        sampler = DistributedSampler(
            dataset, num_replicas=dp, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        source = dataset
    if cp > 1:
        collate_fn = _SequenceShard(collate_fn, cp, cp_rank)
    # A generator of its own: creating an iterator draws a base seed from it, which must not
    # move the global RNG (dropout) by a different amount in a resumed run.
    loader = DataLoader(
        source,
        batch_size=local,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
    )
    return DistributedLoader(
        loader, sampler, epochs=epochs, steps_per_epoch=steps_per_epoch, local_batch_size=local
    )


class _SequenceShard:
    """A collate function that keeps this cp rank's chunks of the inputs and labels of a batch
    (a class, not a closure, so that DataLoader workers can pickle it)."""

    def __init__(self, collate_fn: Callable | None, cp: int, cp_rank: int):
        self.collate_fn, self.cp, self.cp_rank = collate_fn, cp, cp_rank

    def __call__(self, samples: list) -> tuple[Any, Any]:
        from torch.utils.data import default_collate

        from autosearch.distributed.context_parallel import shard_sequence

        inputs, labels = split_batch((self.collate_fn or default_collate)(samples))
        inputs = shard_sequence(inputs, self.cp, self.cp_rank)
        if labels is not None:
            labels = shard_sequence(labels, self.cp, self.cp_rank)
        return inputs, labels


def check_batch(strategy, batch_size: int, mode: str) -> None:
    """Refuse a global batch that the strategy cannot split (over dp, into micro-batches, into
    the pipeline's fixed micro-batch count)."""
    s = strategy
    if batch_size % s.dp:
        raise SpecError(
            f"batch_size={batch_size} does not split over dp={s.dp} ranks; "
            f"use a multiple of {s.dp}"
        )
    local = batch_size // s.dp
    if s.pp > 1 and batch_size != s.global_batch_size:
        raise SpecError(
            f"with pp={s.pp} the batch must be the strategy's "
            f"global_batch_size={s.global_batch_size} (the pipeline schedule runs "
            f"{s.grad_accum_steps} micro-batches of {s.micro_batch_size}); "
            f"got batch_size={batch_size}"
        )
    if mode == "train" and local % s.micro_batch_size:
        raise SpecError(
            f"batch_size={batch_size} gives {local} samples per dp rank, not a "
            f"multiple of micro_batch_size={s.micro_batch_size}; use a multiple of "
            f"{s.dp * s.micro_batch_size}"
        )


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, labels)`` of a batch; a bare tensor is inputs without labels (predict).

    A dict batch holds ``inputs`` or ``input_ids`` (the Hugging Face name: a ``datasets``
    Dataset in torch format collates to one) and optionally ``labels``, aligned with the
    inputs position by position (the Engine's loss does not shift them).
    """
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) == 1:
            return batch[0], None
    if isinstance(batch, dict):
        for key in ("inputs", "input_ids"):
            if key in batch:
                return batch[key], batch.get("labels")
    if isinstance(batch, torch.Tensor):
        return batch, None
    raise SpecError(
        "a batch must be (inputs, labels), a dict with 'inputs' or 'input_ids' (and 'labels'), "
        f"or an inputs tensor; got {type(batch).__name__}. Use a collate_fn that returns "
        "(inputs, labels)"
    )
