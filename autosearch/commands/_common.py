"""Arguments, input checks and printing shared by several subcommands.

The CLI reads every user input through the functions here, so that each mistake ends in one
message naming the input and the fix (a SpecError, printed by `autosearch.cli` with exit status 2),
before anything runs or is written.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
from typing import Any

from autosearch.core.errors import SpecError

GiB = float(1 << 30)


def add_model_cluster_args(
    p: argparse.ArgumentParser, *, required: bool = True, cluster_required: bool | None = None
) -> None:
    """--model, --cluster (with --nnodes, --gpus-per-node) and --runtime. `required=False` for a
    command that can take them from a config file (it then checks them itself)."""
    p.add_argument(
        "--model",
        required=required,
        help="catalog name (see `autosearch models`) or a model YAML file"
        + ("" if required else " (required, here or in the config file)"),
    )
    add_cluster_args(p, required=required if cluster_required is None else cluster_required)
    p.add_argument(
        "--runtime",
        default="torch",
        help="runtime the cost model assumes (cost_models/runtimes.yaml): torch (the Engine, "
        "default), torchtitan, megatron-core, composer-fsdp, deepspeed, or megatron-sc21 "
        "(Megatron-LM as in Narayanan et al. 2021)",
    )


def add_cluster_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument(
        "--cluster",
        required=required,
        help="GPU:NODESxGPUS (e.g. h100-sxm:32x8), a GPU with --nnodes and --gpus-per-node, "
        "a cluster YAML file (gpu, n_nodes, gpus_per_node), or a profile YAML path[:NODESxGPUS]",
    )
    p.add_argument(
        "--nnodes",
        type=positive_int_arg,
        help="number of nodes, with --cluster GPU (instead of GPU:NODESxGPUS)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=positive_int_arg,
        help="devices per node, with --cluster GPU and --nnodes",
    )


def load_model_cluster(args: argparse.Namespace):
    model = load_model(args.model)
    return model, load_cluster(
        args.cluster,
        nnodes=getattr(args, "nnodes", None),
        gpus_per_node=getattr(args, "gpus_per_node", None),
    )


def load_model(text: str | None, *, flag: str = "--model"):
    """A catalog model or a model YAML file; a message about a file names its path."""
    from autosearch.core.model_spec import ModelSpec

    if isinstance(text, dict):  # from a config file: the fields of a ModelSpec
        return ModelSpec.from_dict(text, what=f"{flag} (a mapping)")
    text = check_text(text, flag)
    try:
        return ModelSpec.load(text)
    except SpecError as exc:
        if os.path.isfile(text) and text not in str(exc):
            raise SpecError(f"model file {text!r}: {exc}") from None
        raise


def load_cluster(
    text: str | None,
    *,
    nnodes: int | None = None,
    gpus_per_node: int | None = None,
    flag: str = "--cluster",
):
    """A Cluster from the CLI forms: `Cluster.parse` in its strict mode (nothing guessed)."""
    from autosearch.core.hardware import Cluster

    if not isinstance(text, dict):
        text = check_text(text, flag)
    return Cluster.parse(text, strict=True, nnodes=nnodes, gpus_per_node=gpus_per_node, what=flag)


def _gpu_name(name: str, flag: str) -> str:
    """A GPU name as the strict cluster parser reads it (a short alias, with a note)."""
    from autosearch.core.hardware import _gpu_name as gpu_name

    return gpu_name(name, flag, strict=True)


def load_strategy(text: str | None, *, global_batch_size: int | None, flag: str = "--strategy"):
    """The Strategy of `--strategy` (a YAML file or ``key=value`` pairs) and `--global-batch-size`.

    Refused: an empty string or file; a file that does not name its degrees dp, tp and pp (a
    file cut short would otherwise run with defaults); a global batch given by neither the strategy
    nor the flag, or by both with different values.
    """
    from autosearch.core._io import read_yaml_mapping
    from autosearch.core.strategy import ALIASES, Strategy

    text = check_text(text, flag)
    if os.path.exists(text) or text.endswith((".yaml", ".yml")):
        data = read_yaml_mapping(text, what="strategy")
        if "strategy" in data:  # a best_strategy.yaml written by the tuner
            inner = {} if data["strategy"] is None else data["strategy"]
            if isinstance(inner, dict):
                data = inner
        if not data:
            raise SpecError(
                f"strategy file {text!r} is empty; it needs at least dp, tp, pp and "
                "global_batch_size (e.g. a best_strategy.yaml written by `autosearch tune`)"
            )
        named = {ALIASES.get(k, k) for k in data}
        missing = [k for k in ("dp", "tp", "pp") if k not in named]
        if missing:
            raise SpecError(
                f"strategy file {text!r} does not name {', '.join(missing)}: a strategy file must "
                "give every degree (dp, tp, pp), so that a file cut short is not read with "
                "defaults; add the missing keys"
            )
        strategy = Strategy.from_dict(data, what=f"strategy file {text!r}")
        given = "global_batch_size" in named
    else:
        strategy = Strategy.parse(text)
        given = bool(re.search(r"(^|,)\s*global_batch_size\s*=", text))
    if global_batch_size is not None:
        if given and strategy.global_batch_size != global_batch_size:
            raise SpecError(
                f"--global-batch-size {global_batch_size} disagrees with global_batch_size="
                f"{strategy.global_batch_size} in {flag}; give it once"
            )
        strategy = strategy.replace(global_batch_size=global_batch_size)
    elif not given:
        raise SpecError(
            f"{flag} {text!r} does not give the global batch: add --global-batch-size N "
            f"(or global_batch_size=N to the strategy); without it the batch would be "
            f"dp*micro_batch_size = {strategy.global_batch_size}, one micro-batch per replica"
        )
    return strategy


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The defaults a config file gives to the flags of `parser`, checked as the flags are.

    Keys are the flags' names (``global_batch_size`` or ``global-batch-size``); a flag that
    takes KEY=VALUE items repeatedly (``pin``) also takes a mapping. A file with a ``config``
    mapping (the study.yaml that `tune` writes) is read through that mapping.
    """
    from autosearch.core._io import read_yaml_mapping

    data = read_yaml_mapping(check_text(path, "--config"), what="config")
    if isinstance(data.get("config"), dict):
        data = data["config"]
    return config_defaults(data, parser, what=f"--config {path!r}")


def config_defaults(
    data: dict[str, Any], parser: argparse.ArgumentParser, *, what: str
) -> dict[str, Any]:
    """`read_config_file` on a mapping already read."""
    actions = {
        a.dest: a
        for a in parser._actions
        if a.option_strings and a.dest not in ("help", "config", "version")
    }
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise SpecError(
                f"{what}: unknown key {key!r}; valid keys are the flags: "
                + ", ".join(sorted(actions))
            )
        if value is None:
            continue
        out[dest] = _config_value(action, value, f"{what}: {key}")
    return out


def _config_value(action: argparse.Action, value: Any, where: str) -> Any:
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise SpecError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        if isinstance(value, dict):
            items = [
                f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in value.items()
            ]
        elif isinstance(value, list):
            items = [str(v) for v in value]
        else:
            items = [str(value)]
        return items
    if isinstance(value, dict) and action.dest in ("model", "cluster"):
        return value
    if isinstance(value, (dict, list)):
        raise SpecError(f"{where} must be a single value, got a {type(value).__name__}")
    if isinstance(value, bool) and action.type is not None:
        raise SpecError(f"{where} must be a number, got {value!r}")
    convert = action.type
    if callable(convert):
        try:
            value = convert(str(value))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise SpecError(f"{where}: {exc}") from None
    elif not isinstance(value, str):
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise SpecError(
            f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}"
        )
    return value


def check_text(text: str | None, flag: str) -> str:
    """A non-empty argument (an empty string is a mistake, not a default)."""
    if text is None or not str(text).strip():
        raise SpecError(f"{flag} is empty; give a value (see --help)")
    return str(text).strip()


def check_output_folder(out: str, *, files: tuple[str, ...] = (), flag: str = "--out") -> None:
    """Refuse, before any work, an output folder that could not take every output file.

    `out` must not be the root of the file system nor an existing file, its nearest existing
    ancestor must be a writable folder, and none of `files` may exist there as a folder.
    """
    text = check_text(out, flag)
    path = os.path.abspath(text)
    if path == os.path.abspath(os.sep):
        raise SpecError(
            f"{flag} {text!r} is the root of the file system; give a folder of its own, "
            "e.g. results/my-study"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise SpecError(f"{flag} {text!r} is a file, not a folder; give a folder path")
    _check_writable_parent(path, flag, text, folder=True)
    for name in files:
        target = os.path.join(path, name)
        if os.path.isdir(target):
            raise SpecError(
                f"{flag} {text!r} holds a folder named {name!r} where an output file goes; "
                "move it away or give another --out"
            )


def check_output_file(out: str, *, flag: str = "--out") -> None:
    """Refuse, before any work, an output file path that could not be written."""
    text = check_text(out, flag)
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise SpecError(f"{flag} {text!r} is a folder; give a file path, e.g. {text}/out.csv")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SpecError(f"{flag} {text!r} is not writable; give another path")
    _check_writable_parent(os.path.dirname(path), flag, text, folder=True)


def _check_writable_parent(path: str, flag: str, text: str, *, folder: bool) -> None:
    """Walk up to the nearest existing ancestor of `path`: it must be a writable folder."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise SpecError(
            f"{flag} {text!r} cannot be created: {probe!r} is a file, not a folder; "
            "give a path under a folder"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecError(
            f"{flag} {text!r} cannot be written: the folder {probe!r} is read-only for this "
            "user; give a path under a writable folder"
        )


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def fmt_s(x: float) -> str:
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e6:.1f} us"


def print_json(obj: Any) -> None:
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    print(json.dumps(clean(obj), indent=2))


def positive_int_arg(text: str) -> int:
    """argparse type: an integer >= 1 and within the input limits (a huge number is a typo)."""
    from autosearch.core._io import DEFAULT_INT_LIMIT

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    if value > DEFAULT_INT_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is above the limit of {DEFAULT_INT_LIMIT:,}")
    return value


def batch_size_arg(text: str) -> int:
    """argparse type for a global batch size (sequences): within `INT_LIMITS`."""
    from autosearch.core._io import INT_LIMITS

    value = positive_int_arg(text)
    limit = INT_LIMITS["global_batch_size"]
    if value > limit:
        raise argparse.ArgumentTypeError(
            f"{value:,} sequences is above the limit of {limit:,}; check the number"
        )
    return value


def finite_float_arg(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


class _DropInterruptedTrials(logging.Filter):
    """Drops Optuna's two warnings about a trial that a Ctrl-C stopped: the one with the
    KeyboardInterrupt traceback and the "failed with value None" that follows it (the CLI says
    "interrupted" once; Optuna logs them from `optuna/study/_optimize.py` `_log_failed_trial`)."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0] if record.exc_info else None
        if exc is not None and issubclass(exc, KeyboardInterrupt):
            self.interrupted = True
            return False
        return not (self.interrupted and "failed with value" in record.getMessage())


def quiet_interrupted_trials() -> None:
    """Keep Optuna from printing a traceback when Ctrl-C stops a trial (call before a search)."""
    import optuna

    optuna.logging.get_logger("optuna")  # makes Optuna attach its handler
    for handler in logging.getLogger("optuna").handlers:
        if not any(isinstance(f, _DropInterruptedTrials) for f in handler.filters):
            handler.addFilter(_DropInterruptedTrials())


def require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecError(message)
