"""Checkpoints with torch.distributed.checkpoint (DCP), portable across strategies.

State dicts come from `torch.distributed.checkpoint.state_dict`, which names every entry by its
original parameter name (no DDP / FSDP / checkpoint-wrapper prefixes) and keeps tp / FSDP shards
as DTensors. Pipeline stages keep the names of the full model, so the union of the parts' state
dicts is the full model's. DCP writes each shard once and reshards on load: a checkpoint saved
under dp=2 loads under tp=2, one saved under pp=2 loads in a single process.

Layout: ``model.<name>`` for parameters and buffers, ``optim.state.<name>.<key>`` and
``optim.param_groups.<name>.<key>`` for the optimizer (the flattened form of `get_state_dict`),
and ``train_state/rank<r>.pt`` for what resuming needs beyond them (global step, data position,
learning-rate schedulers, loss scaler, this rank's RNG states).

Crash safety: a checkpoint is written to ``<path>.partial`` and renamed into place once every rank
has written its part (DCP writes its ``.metadata`` last, atomically). Replacing an existing
checkpoint takes two renames (``path -> path.old``, ``path.partial -> path``), then removes
``path.old``; a kill at any point leaves either the previous checkpoint (at ``path`` or, between
the renames, at ``path.old``) or the new one complete, and the next `save` or `load` of that path
repairs the names and removes what is left over. An inference file is written to
``<path>.partial`` and renamed over ``path`` (atomic on POSIX).

Trust: loading reads tensors with ``torch.load(weights_only=True)`` (torch's restricted unpickler)
and DCP's pickled ``.metadata`` with an unpickler that accepts only the classes DCP metadata is
made of (`_SafeReader`), so a crafted checkpoint cannot run code when loaded. It can still hold
wrong or huge tensors: load checkpoints from sources you trust with your model's behaviour.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autosearch.core.errors import SpecError


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def model_state(parts: list[nn.Module]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out: dict[str, Any] = {}
    for part in parts:
        out.update(get_model_state_dict(part))
    return out


def optimizer_states(parts: list[nn.Module], optimizers: list) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return [
        get_optimizer_state_dict(part, opt, options=_options(flatten_optimizer_state_dict=True))
        for part, opt in zip(parts, optimizers)
    ]


@contextlib.contextmanager
def _quiet():
    """Silence DCP's "assuming the intent is to save in a single process" when that is the
    intent."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _fsync_tree(path: str) -> None:
    """Flush the files of a folder and the folder itself to disk (before renaming it)."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(path: str) -> None:
    """Repair what a killed `save` left at `path` (rank 0 only; see the module doc)."""
    path = os.path.abspath(path)
    old, partial = f"{path}.old", f"{path}.partial"
    if os.path.isdir(old):
        if os.path.exists(path):  # killed after the swap: the new checkpoint is in place
            shutil.rmtree(old, ignore_errors=True)
        else:  # killed between the two renames: the previous checkpoint comes back
            os.rename(old, path)
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(f"{path}.dcp-tmp", ignore_errors=True)
    if os.path.isfile(partial):
        os.remove(partial)


def save(
    path: str,
    parts: list[nn.Module],
    optimizers: list | None,
    *,
    training: bool = True,
    train_state: dict[str, Any] | None = None,
) -> None:
    """Save for training (a DCP directory: model, optimizer, this rank's `train_state`) or for
    inference (one torch.save file of full tensors), replacing what is at `path` crash-safely."""
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(path)
    partial = f"{path}.partial"
    if _rank() == 0:
        recover(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
    _barrier()
    if not training:
        _save_inference_file(path, parts)
        return
    state: dict[str, Any] = {"model": model_state(parts)}
    if optimizers:
        osds = optimizer_states(parts, optimizers)
        state["optim"] = {k: v for osd in osds for k, v in osd.items()}
    with _quiet():
        dcp.save(state, checkpoint_id=partial)
    if train_state is not None:
        folder = os.path.join(partial, "train_state")
        os.makedirs(folder, exist_ok=True)
        torch.save(train_state, os.path.join(folder, f"rank{_rank()}.pt"))
    _barrier()
    if _rank() == 0:
        _fsync_tree(partial)
        old = f"{path}.old"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(partial, path)
        _fsync_dir(os.path.dirname(path))
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _save_inference_file(path: str, parts: list[nn.Module]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = f"{path}.dcp-tmp"  # DCP writes the shards; rank 0 merges them into one file
    try:
        with _quiet():
            dcp.save(model_state(parts), checkpoint_id=tmp)
        _barrier()
        if _rank() == 0:
            partial = f"{path}.partial"
            with _quiet():
                dcp_to_torch_save(tmp, partial)
            with open(partial, "rb") as f:
                os.fsync(f.fileno())
            os.replace(partial, path)
            _fsync_dir(os.path.dirname(path))
    finally:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()


# ---- safe loading ---------------------------------------------------------------------------
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
}


_PATH_CLASSES = (
    "PosixPath",
    "PurePosixPath",
    "WindowsPath",
    "PureWindowsPath",
    "Path",
    "PurePath",
)
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` accepting only what it is made of: DCP's metadata classes,
    torch sizes, dtypes, layouts and memory formats, and paths (the "restricting globals"
    pattern of the `pickle` documentation). Anything else is refused before it is called."""

    def find_class(self, module: str, name: str):
        obj = None
        if module.startswith("pathlib"):
            if name in _PATH_CLASSES:
                obj = super().find_class(module, name)
        elif (module, name) in _ALLOWED_GLOBALS or module == _METADATA_MODULE:
            obj = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            obj = getattr(torch, name)
        if obj is None:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of a DCP checkpoint's metadata"
            )
        return obj


def _safe_reader(path: str):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        """DCP's file reader with the metadata read by `_MetadataUnpickler` (tensors are read
        with ``torch.load(weights_only=True)`` by DCP itself)."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(meta_path, "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except (
                    pickle.UnpicklingError,
                    EOFError,
                    AttributeError,
                    ValueError,
                    TypeError,
                ) as exc:
                    raise SpecError(
                        f"refusing to load checkpoint {path!r}: its .metadata is not a DCP "
                        f"checkpoint's ({exc}); was it written by Engine.save?"
                    ) from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


def _safe_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class _SafePlanner(DefaultLoadPlanner):
        """DCP's default planner, but non-tensor entries (optimizer hyper-parameters) are read
        with ``torch.load(weights_only=True)`` instead of a full unpickling."""

        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _SafePlanner(allow_partial_load=True)


def read_train_state(path: str) -> dict[str, Any] | None:
    """This rank's saved train state (rank 0's if the checkpoint had fewer ranks), or None."""
    folder = os.path.join(path, "train_state")
    if not os.path.isdir(folder):
        return None
    mine = os.path.join(folder, f"rank{_rank()}.pt")
    state = torch.load(
        mine if os.path.exists(mine) else os.path.join(folder, "rank0.pt"),
        map_location="cpu",
        weights_only=True,
    )
    state["same_rank"] = os.path.exists(mine)
    return state


def saved_keys(path: str) -> set[str]:
    try:
        return set(_safe_reader(path).read_metadata().state_dict_metadata)
    except (FileNotFoundError, OSError) as exc:
        raise SpecError(
            f"no checkpoint at {path!r} ({exc}); pass a directory written by Engine.save "
            "or a file written by Engine.save(path, training=False)"
        ) from None


def load(
    path: str,
    parts: list[nn.Module],
    optimizers: list | None,
    *,
    strict: bool = True,
    load_optimizer: bool = True,
) -> list[str]:
    """Load a checkpoint saved under any strategy into these parts; returns what was not loaded."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if _rank() == 0 and not os.path.exists(path):
        recover(path)  # a save killed between its renames left the previous one at path.old
    _barrier()
    if os.path.isfile(
        path
    ):  # an inference state dict: full tensors, resharded by set_model_state_dict
        full = torch.load(path, map_location="cpu", weights_only=True)
        missing = []
        for part in parts:
            keys = model_state([part]).keys()
            missing += [k for k in keys if k not in full]
            set_model_state_dict(
                part,
                {k: full[k] for k in keys if k in full},
                options=_options(full_state_dict=True, strict=False),
            )
        if missing and strict:
            raise SpecError(
                f"{path!r} lacks {len(missing)} entries of this model, e.g. {missing[:3]}; "
                "pass strict=False to load the rest"
            )
        return missing

    import torch.distributed.checkpoint as dcp

    saved = saved_keys(path)
    model = model_state(parts)
    missing = [k for k in model if f"model.{k}" not in saved]
    if missing and strict:
        raise SpecError(
            f"checkpoint {path!r} lacks {len(missing)} entries of this model, e.g. {missing[:3]}; "
            "check that it is the same model, or pass strict=False to load the rest"
        )
    state: dict[str, Any] = {"model": {k: v for k, v in model.items() if k not in missing}}
    osds = None
    has_optim = any(k.startswith("optim.") for k in saved)
    if load_optimizer and optimizers:
        if has_optim:
            osds = optimizer_states(parts, optimizers)
            state["optim"] = {
                k: v for osd in osds for k, v in osd.items() if f"optim.{k}" in saved
            }
        else:
            missing.append("optimizer state (the checkpoint has none; the optimizer starts fresh)")
    with _quiet():
        dcp.load(state, storage_reader=_safe_reader(path), planner=_safe_planner())
    for part in parts:
        own = model_state([part]).keys()
        set_model_state_dict(
            part,
            {k: state["model"][k] for k in own if k in state["model"]},
            options=_options(strict=False),
        )
    if osds is not None:
        for part, opt, osd in zip(parts, optimizers, osds):
            set_optimizer_state_dict(
                part,
                opt,
                {k: state["optim"].get(k, v) for k, v in osd.items()},
                options=_options(flatten_optimizer_state_dict=True),
            )
    return missing
