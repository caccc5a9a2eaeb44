"""Strategies out to the runtimes people already use: Megatron-LM, DeepSpeed, torchtitan.

Example:
    >>> from autosearch import Strategy
    >>> from autosearch.export import export
    >>> s = Strategy(dp=4, tp=8, pp=2, global_batch_size=64, sequence_parallel=True)
    >>> out = export(s, to="megatron")
    >>> "--tensor-model-parallel-size 8" in out.text
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING

from autosearch.core._files import atomic_write, own_folder, remove_owned
from autosearch.core.errors import SpecError
from autosearch.export._architecture import MODEL_FIELDS, Architecture, architecture_of
from autosearch.export._base import Exported, Exporter, one_line, refusal
from autosearch.export._deepspeed import DeepSpeedExporter
from autosearch.export._megatron import MegatronExporter
from autosearch.export._torchtitan import TorchTitanExporter

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy

EXPORTERS: dict[str, Exporter] = {
    e.name: e for e in (MegatronExporter(), DeepSpeedExporter(), TorchTitanExporter())
}


def export(
    strategy: "Strategy",
    *,
    to: str,
    model: "ModelSpec | None" = None,
    cluster: "Cluster | None" = None,
    allow_unsupported: bool = False,
) -> Exported:
    """`strategy` in the words of runtime `to` (``megatron``, ``deepspeed`` or ``torchtitan``);
    `model` adds the model's shape, `cluster` the launch command.

    Raises:
        SpecError: the runtime cannot build a field of `model` as planned (`Exported.refused`:
            each field and why), unless `allow_unsupported`, which returns the export with
            those fields listed in a warning on top of its caveats.
    """
    try:
        exporter = EXPORTERS[to.lower()]
    except KeyError:
        raise SpecError(
            f"unknown runtime {to!r} to export to; choose one of {', '.join(EXPORTERS)}"
        ) from None
    out = exporter.export(strategy, model=model, cluster=cluster)
    if out.refused and not allow_unsupported:
        assert model is not None  # only model fields are refused
        raise SpecError(refusal(out.runtime, model.name, out.refused))
    return out


def megatron_args(
    model: "ModelSpec", strategy: "Strategy", cluster: "Cluster | None" = None
) -> str:
    """Megatron-LM's `pretrain_gpt.py` argument list for `model` trained with `strategy`."""
    return export(strategy, to="megatron", model=model, cluster=cluster).text


def deepspeed_config(
    model: "ModelSpec", strategy: "Strategy", cluster: "Cluster | None" = None
) -> str:
    """DeepSpeed's `ds_config.json` for `strategy` (the launch line is `deepspeed_launch`)."""
    return export(strategy, to="deepspeed", model=model, cluster=cluster).text


def deepspeed_launch(
    model: "ModelSpec", strategy: "Strategy", cluster: "Cluster | None" = None
) -> str:
    """The `deepspeed` launcher line that runs a script with `deepspeed_config`'s file."""
    return export(strategy, to="deepspeed", model=model, cluster=cluster).command


def torchtitan_toml(
    model: "ModelSpec", strategy: "Strategy", cluster: "Cluster | None" = None
) -> str:
    """torchtitan's job-config TOML for `model` trained with `strategy`."""
    return export(strategy, to="torchtitan", model=model, cluster=cluster).text


def write_exports(
    out_dir: "str | os.PathLike",
    strategy: "Strategy",
    *,
    model: "ModelSpec | None" = None,
    cluster: "Cluster | None" = None,
    to: "tuple[str, ...] | None" = None,
    allow_unsupported: bool = False,
    headers: "dict[str, list[str]] | None" = None,
) -> list[str]:
    """Write what each runtime takes, next to best_strategy.yaml: the launch script
    `megatron.sh`; `torchtitan.toml` with `torchtitan.sh` (and `torchtitan_flavor.py` where
    torchtitan ships no flavor of the model's shape); `ds_config.json` with
    `deepspeed_launch.sh`. The configs are written by serializers (JSON, TOML), the scripts
    quote every word for the shell, and caveats are comments of one line each, so no name
    becomes code. Each file is written whole (`atomic_write`: an unpredictable temporary name,
    then renamed), into a folder that is new, empty, or autosearch's own (`own_folder`).

    A runtime that cannot build the model as planned (`Exported.refused`) still gets its files
    (tune writes them all beside its pick), but its launch script stops with the refused
    fields until run with ALLOW_UNSUPPORTED=1, unless `allow_unsupported`. `headers` puts
    lines on top of a runtime's scripts and TOML as comments ({runtime: lines}: the warning of
    a strategy written although it does not fit there, `autosearch export --force`; whose pick
    it is, `autosearch tune`).

    Returns:
        the paths written.
    """
    made = not os.path.lexists(out_dir)
    folder = own_folder(out_dir, kind="export", what=f"--out {os.fspath(out_dir)!r}", accept=OWN)
    rendered: dict[str, tuple[str, int]] = {}  # every file first, then the writes
    for name in to or tuple(EXPORTERS):
        out = export(strategy, to=name, model=model, cluster=cluster, allow_unsupported=True)
        if allow_unsupported and out.refused:  # asked to go on: the warning, not the guard
            out = dataclasses.replace(
                out, script=out.script.replace('"${ALLOW_UNSUPPORTED:-0}" != 1', "false", 1)
            )
        files = dict(out.files)
        if name == "megatron":
            files["megatron.sh"] = _with_caveats(out.script, out)
        elif name == "deepspeed":
            files["ds_config.json"] = out.text.rstrip() + "\n"
            files["deepspeed_launch.sh"] = _with_caveats(out.script, out)
        else:
            files[out.filename] = out.render()
            files["torchtitan.sh"] = _with_caveats(out.script, out)
        warned = [f"# {one_line(line)}" for line in (headers or {}).get(name, ())]
        for filename, text in files.items():
            if warned and filename.endswith((".sh", ".toml")):
                text = _with_lines(text, warned)
            rendered[filename] = (text, 0o755 if filename.endswith(".sh") else 0o644)
    written: list[str] = []
    new: list[str] = []  # the files this call adds (none was there before)
    try:
        for filename, (text, mode) in rendered.items():
            path = os.path.join(folder, filename)
            existed = os.path.lexists(path)
            atomic_write(path, text, mode=mode)
            written.append(path)
            if not existed:
                new.append(path)
    except SpecError as exc:  # a full disk: no half set of launch files beside the others
        for path in new:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if made:
            remove_owned(folder)  # the folder this call made, empty again
        raise SpecError(
            f"{exc}; the files this export added were removed again"
            + (
                f" ({len(written) - len(new)} it had replaced hold the new plan)"
                if len(written) > len(new)
                else ""
            )
        ) from None
    return written


def _with_caveats(script: str, out: Exported) -> str:
    """The launch script with the export's caveats as comment lines after its first line."""
    first, rest = script.split("\n", 1)
    caveats = "\n".join(out.caveats(comment="#")).strip("\n")
    return f"{first}\n{caveats}\n{rest}" if caveats else script


def _with_lines(text: str, lines: list[str]) -> str:
    """`lines` on top of a file, after its shebang line if it has one."""
    if text.startswith("#!"):
        first, rest = text.split("\n", 1)
        return "\n".join([first, *lines, rest])
    return "\n".join([*lines, text])


# What write_exports may write (tune checks that none is a folder before it starts).
EXPORT_FILES = (
    "megatron.sh",
    "ds_config.json",
    "deepspeed_launch.sh",
    "torchtitan.toml",
    "torchtitan.sh",
    "torchtitan_flavor.py",
)


# Files that mark a folder written by autosearch before it wrote a marker: a study's outputs.
OWN = ("study.yaml", "best_strategy.yaml")


__all__ = [
    "EXPORTERS",
    "EXPORT_FILES",
    "MODEL_FIELDS",
    "Architecture",
    "architecture_of",
    "DeepSpeedExporter",
    "Exported",
    "Exporter",
    "MegatronExporter",
    "TorchTitanExporter",
    "deepspeed_config",
    "deepspeed_launch",
    "export",
    "megatron_args",
    "torchtitan_toml",
    "write_exports",
]
