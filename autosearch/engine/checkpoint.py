"""Checkpoints with torch.distributed.checkpoint (DCP), portable across strategies.

State dicts come from `torch.distributed.checkpoint.state_dict`, which names every entry by its
original parameter name (no DDP / FSDP / checkpoint-wrapper prefixes) and keeps tp / FSDP shards
as DTensors. Pipeline stages keep the names of the full model, so the union of the parts' state
dicts is the full model's. DCP writes each shard once and reshards on load: a checkpoint saved
under dp=2 loads under tp=2, one saved under pp=2 loads in a single process.

Layout: ``model.<name>`` for parameters and buffers, ``optim.state.<name>.<key>`` and
``optim.param_groups.<name>.<key>`` for the optimizer (the flattened form of `get_state_dict`).
"""
from __future__ import annotations

import contextlib
import os
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

    return [get_optimizer_state_dict(part, opt, options=_options(flatten_optimizer_state_dict=True))
            for part, opt in zip(parts, optimizers)]


@contextlib.contextmanager
def _quiet():
    """Silence DCP's "assuming the intent is to save in a single process" when that is the intent."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save(path: str, parts: list[nn.Module], optimizers: list | None, *, training: bool = True) -> None:
    """Save for training (a DCP directory: model and optimizer) or for inference (one torch.save file)."""
    import torch.distributed.checkpoint as dcp

    if training:
        state: dict[str, Any] = {"model": model_state(parts)}
        if optimizers:
            state["optim"] = {k: v for osd in optimizer_states(parts, optimizers) for k, v in osd.items()}
        with _quiet():
            dcp.save(state, checkpoint_id=path)
        return
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = f"{path}.dcp-tmp"
    with _quiet():
        dcp.save(model_state(parts), checkpoint_id=tmp)
    _barrier()
    if dist.get_rank() == 0 if dist.is_initialized() else True:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        with _quiet():
            dcp_to_torch_save(tmp, path)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()


def saved_keys(path: str) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(path).read_metadata().state_dict_metadata)
    except (FileNotFoundError, OSError) as exc:
        raise SpecError(f"no checkpoint at {path!r} ({exc}); pass a directory written by Engine.save "
                        "or a file written by Engine.save(path, training=False)") from None


def load(path: str, parts: list[nn.Module], optimizers: list | None, *, strict: bool = True,
         load_optimizer: bool = True) -> list[str]:
    """Load a checkpoint saved under any strategy into these parts; returns what was not loaded."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if os.path.isfile(path):  # an inference state dict: full tensors, resharded by set_model_state_dict
        full = torch.load(path, map_location="cpu", weights_only=True)
        missing = []
        for part in parts:
            keys = model_state([part]).keys()
            missing += [k for k in keys if k not in full]
            set_model_state_dict(part, {k: full[k] for k in keys if k in full},
                                 options=_options(full_state_dict=True, strict=False))
        if missing and strict:
            raise SpecError(f"{path!r} lacks {len(missing)} entries of this model, e.g. {missing[:3]}; "
                            "pass strict=False to load the rest")
        return missing

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    saved = saved_keys(path)
    model = model_state(parts)
    missing = [k for k in model if f"model.{k}" not in saved]
    if missing and strict:
        raise SpecError(f"checkpoint {path!r} lacks {len(missing)} entries of this model, e.g. {missing[:3]}; "
                        "check that it is the same model, or pass strict=False to load the rest")
    state: dict[str, Any] = {"model": {k: v for k, v in model.items() if k not in missing}}
    osds = None
    has_optim = any(k.startswith("optim.") for k in saved)
    if load_optimizer and optimizers:
        if has_optim:
            osds = optimizer_states(parts, optimizers)
            state["optim"] = {k: v for osd in osds for k, v in osd.items() if f"optim.{k}" in saved}
        else:
            missing.append("optimizer state (the checkpoint has none; the optimizer starts fresh)")
    with _quiet():
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    for part in parts:
        own = model_state([part]).keys()
        set_model_state_dict(part, {k: state["model"][k] for k in own if k in state["model"]},
                             options=_options(strict=False))
    if osds is not None:
        for part, opt, osd in zip(parts, optimizers, osds):
            set_optimizer_state_dict(part, opt, {k: state["optim"].get(k, v) for k, v in osd.items()},
                                     options=_options(flatten_optimizer_state_dict=True))
    return missing
