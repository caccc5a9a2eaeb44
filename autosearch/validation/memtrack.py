"""Peak bytes of live tensors on the CPU, where PyTorch keeps no allocator statistics.

Written by hand: `torch.distributed._tools.mem_tracker.MemTracker` does this and more, but refuses
modules called several times per step (gradient accumulation calls the model once per
micro-batch). This tracker only counts: every storage already reachable from the model and
optimizer when it starts, plus every storage an operator creates while it runs; after each
operator it sums the live ones (sizes are read each time because FSDP2 frees unsharded
parameters by resizing their storage to 0, which no operator reports).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _plain(t: Any) -> torch.Tensor | None:
    """The plain tensor that owns memory: a DTensor's local shard, or the tensor itself."""
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    return t if type(t) in (torch.Tensor, torch.nn.Parameter) else None


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker(modules, optimizers) as t: step()`` then ``t.peak_bytes``."""

    def __init__(self, modules: Iterable[torch.nn.Module] = (), optimizers: Iterable[Any] = ()):
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self.peak_bytes = 0
        for module in modules:
            for p in module.parameters():
                self._add(p)
                self._add(p.grad)
            for b in module.buffers():
                self._add(b)
        for opt in optimizers:
            inner = getattr(opt, "optimizers", None) or [opt]  # containers of optimizers
            for o in inner:
                for state in getattr(o, "state", {}).values():
                    for v in state.values():
                        self._add(v)
        self.peak_bytes = self.current_bytes()

    def _add(self, t: Any) -> None:
        plain = _plain(t)
        if plain is None:
            return
        storage = plain.untyped_storage()
        key = storage._cdata
        if key not in self._live:

            def forget(_: object, key: int = key) -> None:
                self._live.pop(key, None)

            self._live[key] = weakref.ref(storage, forget)

    def current_bytes(self) -> int:
        total = 0
        for ref in list(self._live.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t)
        current = self.current_bytes()
        if current > self.peak_bytes:
            self.peak_bytes = current
        return out
