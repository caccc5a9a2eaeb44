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
repairs the names and removes what is left over. An inference file is merged into an
unpredictable temporary name in the same folder (`tempfile.mkstemp`) and renamed over ``path``.

Ownership: a save writes only into a new or empty folder or over a checkpoint of its own (a
folder holding the marker file ``.autosearch``; for an inference file, a ``torch.save``
archive), and renames or removes only folders holding that marker. A symbolic link at ``path``,
``.partial``, ``.old`` or ``.dcp-tmp``, or something of the user's under those names, is refused
before anything is written. A disk that cannot take the checkpoint (full, read-only) ends in one
SpecError, with the previous checkpoint kept.

Trust: loading reads tensors with ``torch.load(weights_only=True)`` (torch's restricted unpickler)
and DCP's pickled ``.metadata`` with an unpickler that accepts only the classes DCP metadata is
made of (`_SafeReader`), so a crafted checkpoint cannot run code when loaded. It can still hold
wrong or huge tensors: load checkpoints from sources you trust with your model's behaviour.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import tempfile
import warnings
import zipfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autosearch.core._files import (
    DISK_HINTS,
    atomic_write,
    is_owned,
    mark_folder,
    remove_owned,
    remove_stale_temp_files,
)
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


def _refuse(message: str) -> None:
    raise SpecError(message)


def _check_targets(path: str, *, training: bool) -> None:
    """Refuse, before anything is written or removed, a save that would touch what autosearch
    did not write: `path` must be new, or a checkpoint of autosearch's (a folder holding its
    marker, `_files.MARKER`; for an inference file, a ``torch.save`` archive), and the names
    it works under (``.partial``, ``.old``, ``.dcp-tmp``) must be free or its own. A symbolic
    link at any of them is refused: a write through it would land where it points."""
    for name in (path, *(f"{path}{s}" for s in _SCRATCH)):
        if os.path.islink(name):
            _refuse(
                f"cannot save checkpoint {path!r}: {name!r} is a symbolic link, and autosearch "
                "never writes through one it did not make. Remove the link, or save elsewhere"
            )
    for name in (f"{path}{s}" for s in _SCRATCH):
        if os.path.lexists(name) and not is_owned(name):
            _refuse(
                f"cannot save checkpoint {path!r}: {name!r} exists and autosearch did not write "
                "it (a checkpoint uses that name while it saves). Move it away, or save elsewhere"
            )
    if not os.path.lexists(path):
        return
    if training and os.path.isdir(path):
        if is_owned(path) or not os.listdir(path):
            return
        _refuse(
            f"cannot save checkpoint {path!r}: the folder holds files autosearch did not write; "
            "a checkpoint replaces its whole folder, so it is saved only into a new or empty "
            "folder, or over an earlier checkpoint of autosearch's. Give another path"
        )
    if not training and os.path.isfile(path) and zipfile.is_zipfile(path):
        return  # an earlier torch.save file: replaced, as torch.save itself would
    kind = "folder" if os.path.isdir(path) else "file"
    want = "an inference file (training=False)" if not training else "a checkpoint folder"
    _refuse(
        f"cannot save checkpoint {path!r}: a {kind} autosearch did not write is there, and "
        f"{want} would replace it. Give another path"
    )


_SCRATCH = (".partial", ".old", ".dcp-tmp")


def recover(path: str) -> None:
    """Repair what a killed `save` left at `path` (rank 0 only; see the module doc). Only what
    autosearch wrote (its marker inside) is renamed or removed; anything else stays."""
    path = os.path.abspath(path)
    old, partial = f"{path}.old", f"{path}.partial"
    if is_owned(old):
        if os.path.lexists(path):  # killed after the swap: the new checkpoint is in place
            remove_owned(old)
        else:  # killed between the two renames: the previous checkpoint comes back
            os.rename(old, path)
    for name in (partial, f"{path}.dcp-tmp"):
        remove_owned(name)
    remove_stale_temp_files(os.path.dirname(path))  # an inference file's, of a killed save


def _new_folder(path: str) -> None:
    """Make the folder `path` (it must not exist) marked as autosearch's: made and marked under
    an unpredictable name beside it, then renamed, so that a kill never leaves `path` unmarked
    (a folder the next save would have to refuse as the user's)."""
    made = tempfile.mkdtemp(prefix=".autosearch-", dir=os.path.dirname(path))
    try:
        mark_folder(made, kind="checkpoint", what=f"checkpoint folder {path!r}")
        os.rename(made, path)
    except BaseException:
        remove_owned(made)
        raise


def save(
    path: str,
    parts: list[nn.Module],
    optimizers: list | None,
    *,
    training: bool = True,
    train_state: dict[str, Any] | None = None,
) -> None:
    """Save for training (a DCP directory: model, optimizer, this rank's `train_state`) or for
    inference (one torch.save file of full tensors), replacing what is at `path` crash-safely.

    Raises:
        SpecError: `path` or a name the save works under holds what autosearch did not write
            (nothing is touched then), or the disk cannot take the checkpoint (full, read-only:
            the previous checkpoint stays, and nothing of the new one is left behind).
    """
    path = os.path.abspath(path)
    _check_targets(path, training=training)
    if _rank() == 0:
        recover(path)
        _writing(os.makedirs, os.path.dirname(path), path=path, exist_ok=True)
    _barrier()
    if not training:
        _writing(_save_inference_file, path, parts, path=path)
        return
    partial = f"{path}.partial"
    try:
        _save_folder(path, partial, parts, optimizers, train_state)
    except BaseException:
        if _rank() == 0:
            remove_owned(partial)
        raise


def _save_folder(path, partial, parts, optimizers, train_state) -> None:
    import torch.distributed.checkpoint as dcp

    if _rank() == 0:
        _writing(_new_folder, partial, path=path)
    _barrier()
    state: dict[str, Any] = {"model": model_state(parts)}
    if optimizers:
        osds = optimizer_states(parts, optimizers)
        state["optim"] = {k: v for osd in osds for k, v in osd.items()}
    with _quiet():
        _writing(dcp.save, state, path=path, checkpoint_id=partial)
    if train_state is not None:
        folder = os.path.join(partial, "train_state")
        os.makedirs(folder, exist_ok=True)
        _writing(torch.save, train_state, os.path.join(folder, f"rank{_rank()}.pt"), path=path)
    _barrier()
    if _rank() == 0:
        _fsync_tree(partial)
        old = f"{path}.old"
        if is_owned(path):
            os.rename(path, old)
        elif os.path.isdir(path):
            os.rmdir(path)  # the empty folder it was given (rmdir removes nothing else)
        os.rename(partial, path)
        _fsync_dir(os.path.dirname(path))
        remove_owned(old)
    _barrier()


def _writing(fn, *args: Any, path: str, **kwargs: Any):
    """`fn(*args, **kwargs)`, with a disk that cannot take the checkpoint (full, read-only, no
    permission: an OSError, bare or inside DCP's CheckpointException) said in one message."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn(*args, **kwargs)
    except (OSError, CheckpointException, RuntimeError) as exc:
        cause = _os_error(exc)
        if cause is None:
            raise
        raise SpecError(
            f"cannot save checkpoint {path!r}: {cause.strerror or cause}"
            f"{DISK_HINTS.get(cause.errno or 0, '')}; the previous checkpoint (if any) is kept"
        ) from None


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` (itself, its cause or context, or one of DCP's failures)."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]  # type: ignore[list-item]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        if isinstance(e, RuntimeError) and "PytorchStreamWriter failed" in str(e):
            return OSError(errno.EIO, str(e).splitlines()[0])
        if isinstance(e, RuntimeError) and "unexpected pos" in str(e):
            # torch.save's zip writer finding its file shorter than it wrote: a write that the
            # disk cut short ("[enforce fail at inline_container.cc] unexpected pos 4544 vs 4438")
            return OSError(errno.EIO, "a write was cut short (is the disk full?)")
    return None


def _save_inference_file(path: str, parts: list[nn.Module]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = f"{path}.dcp-tmp"  # DCP writes the shards; rank 0 merges them into one file
    try:
        if _rank() == 0:
            _new_folder(tmp)
        _barrier()
        with _quiet():
            dcp.save(model_state(parts), checkpoint_id=tmp)
        _barrier()
        if _rank() == 0:
            # merged into an unpredictable name in the same folder (mkstemp), then renamed
            atomic_write(path, lambda partial: _merge(dcp_to_torch_save, tmp, partial))
    finally:
        if _rank() == 0:
            remove_owned(tmp)
        _barrier()


def _merge(dcp_to_torch_save, tmp: str, partial: str) -> None:
    with _quiet():
        dcp_to_torch_save(tmp, partial)


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


def _trusted(fn, *args: Any, path: str, **kwargs: Any):
    """`fn(*args, **kwargs)` reading checkpoint `path`, with a refusal of torch's restricted
    unpickler (``weights_only=True``: a pickle that names code) said in one message, whether it
    comes bare or inside DCP's CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn(*args, **kwargs)
    except (pickle.UnpicklingError, CheckpointException, RuntimeError, SpecError) as exc:
        if isinstance(exc, SpecError):
            raise
        refused = _unpickling_error(exc)
        if refused is None:
            raise
        raise SpecError(
            f"refusing to load checkpoint {path!r}: this checkpoint holds data autosearch will "
            f"not unpickle ({refused}); load only checkpoints written by Engine.save, from a "
            "source you trust"
        ) from None


def _unpickling_error(exc: BaseException) -> str | None:
    """What torch's restricted unpickler refused behind `exc` (one line), or None."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:  # DCP's: the ranks' own errors say why
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
            continue
        if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e):
            text, mark = str(e), "WeightsUnpickler error:"
            if mark in text:  # torch's reason follows the mark, up to its next paragraph
                reason = " ".join(text.split(mark, 1)[1].strip().split("\n\n")[0].split())
                return f"torch's restricted unpickler refused it: {reason}"[:300]
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            return (lines[0] if lines else type(e).__name__)[:300]
        todo += [e.__cause__, e.__context__]  # type: ignore[list-item]
    return None


def read_train_state(path: str) -> dict[str, Any] | None:
    """This rank's saved train state (rank 0's if the checkpoint had fewer ranks), or None."""
    folder = os.path.join(path, "train_state")
    if not os.path.isdir(folder):
        return None
    mine = os.path.join(folder, f"rank{_rank()}.pt")
    state = _trusted(
        torch.load,
        mine if os.path.exists(mine) else os.path.join(folder, "rank0.pt"),
        path=path,
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
        if not zipfile.is_zipfile(path):  # torch.save's format is a zip archive
            raise SpecError(
                f"{path!r} is not a checkpoint (not a torch.save archive: a text file, or a "
                "file cut short?); pass a folder written by Engine.save or a file written by "
                "Engine.save(path, training=False)"
            )
        full = _trusted(torch.load, path, path=path, map_location="cpu", weights_only=True)
        if not isinstance(full, dict):
            raise SpecError(
                f"{path!r} holds a {type(full).__name__}, not a state dict; pass a file written "
                "by Engine.save(path, training=False)"
            )
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
        _trusted(
            dcp.load, state, path=path, storage_reader=_safe_reader(path), planner=_safe_planner()
        )
    for part in parts:
        own = model_state([part]).keys()
        set_model_state_dict(
            part,
            {k: state["model"][k] for k in own if k in state["model"]},
            options=_options(strict=False),
        )
    if osds is not None and optimizers:
        for part, opt, osd in zip(parts, optimizers, osds):
            set_optimizer_state_dict(
                part,
                opt,
                {k: state["optim"].get(k, v) for k, v in osd.items()},
                options=_options(flatten_optimizer_state_dict=True),
            )
    return missing
