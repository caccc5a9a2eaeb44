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
import sys
from typing import Any

from autosearch.core.errors import SpecError

GiB = float(1 << 30)

# Short GPU names people say are profile data (each profile's `aliases`; the CLI prints a note
# when it reads one). "a100" is not one: it names two profiles (40 and 80 GB), so it is an error.
_AMBIGUOUS_GPUS = {"a100": ("a100-sxm4-40gb", "a100-sxm4-80gb")}


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
    """A Cluster from the CLI forms, stricter than `Cluster.parse` where it would guess.

    Refused: ``GPU:N`` (is it N nodes or N GPUs?) and a bare GPU name without --nnodes and
    --gpus-per-node (the devices per node would be the profile's, unsaid), a cluster YAML without
    ``gpus_per_node``, a world size above `MAX_DEVICES`. Accepted with a note on stderr: a short
    GPU name a profile lists in its `aliases` (``h100`` for ``h100-sxm``).
    """
    from autosearch.core._io import MAX_DEVICES, read_yaml_mapping
    from autosearch.core.hardware import Cluster

    if isinstance(text, dict):  # from a config file: gpu, n_nodes, gpus_per_node
        if "gpus_per_node" not in text:
            raise SpecError(f"{flag} (a mapping) has no gpus_per_node; add it (e.g. 8)")
        data = dict(text)
        if isinstance(data.get("gpu"), str):
            data["gpu"] = _gpu_name(data["gpu"], f"{flag}: gpu")
        cluster = Cluster.from_dict(data, what=f"{flag} (a mapping)")
        if cluster.world_size > MAX_DEVICES:
            raise SpecError(
                f"{flag} has {cluster.world_size:,} devices, above the limit of {MAX_DEVICES:,}"
            )
        return cluster
    text = check_text(text, flag)
    if (nnodes is None) != (gpus_per_node is None):
        raise SpecError(
            "--nnodes and --gpus-per-node go together (e.g. --cluster h100-sxm --nnodes 32 "
            "--gpus-per-node 8), or give --cluster h100-sxm:32x8 alone"
        )
    full = re.fullmatch(r"(.+?):(\d+)x(\d+)", text)
    nodes_only = re.fullmatch(r"(.+?):(\d+)", text)
    if nnodes is not None and (full or nodes_only):
        raise SpecError(
            f"{flag} {text!r} already gives the nodes and devices; --nnodes and "
            "--gpus-per-node go with a bare GPU name (--cluster GPU --nnodes N --gpus-per-node G)"
        )
    if nodes_only and not full:
        gpu, n = nodes_only.groups()
        raise SpecError(
            f"{flag} {text!r} does not say how many devices a node has: write "
            f"{gpu}:{n}x8 for {n} nodes of 8 devices, {gpu}:1x{n} for one node of {n}, or "
            f"--cluster {gpu} --nnodes {n} --gpus-per-node G"
        )
    if full:
        gpu, n_nodes, per_node = full.groups()
        cluster = _cluster(_gpu_name(gpu, flag), int(n_nodes), int(per_node), flag)
    elif text.endswith((".yaml", ".yml")) and os.path.exists(text):
        data = read_yaml_mapping(text, what="cluster")
        if "gpu" not in data and "peak_flops" in data:  # a bare hardware profile
            cluster = _cluster(text, nnodes or 1, gpus_per_node, flag)
        else:
            if nnodes is not None:
                raise SpecError(
                    f"cluster file {text!r} already gives the nodes and devices; drop --nnodes "
                    "and --gpus-per-node, or give a GPU name with them"
                )
            if "gpus_per_node" not in data:
                raise SpecError(
                    f"cluster file {text!r} has no gpus_per_node; add it (e.g. gpus_per_node: 8) "
                    "so the devices per node are not guessed from the GPU profile"
                )
            if "gpu" in data and isinstance(data["gpu"], str):
                data["gpu"] = _gpu_name(data["gpu"], f"cluster file {text!r}: gpu")
            cluster = Cluster.from_dict(data, what=f"cluster file {text!r}")
    elif ":" in text and not os.path.exists(text):
        raise SpecError(
            f"{flag} {text!r} is not GPU:NODESxGPUS (example: h100-sxm:32x8) nor a YAML file"
        )
    elif nnodes is None and not os.path.exists(text):
        gpu = _gpu_name(text, flag)
        raise SpecError(
            f"{flag} {text!r} does not say how many nodes and devices: write {gpu}:1x8 for one "
            f"node of 8 devices, {gpu}:NODESx8 for more, or add --nnodes N --gpus-per-node G"
        )
    else:
        cluster = _cluster(_gpu_name(text, flag), nnodes or 1, gpus_per_node, flag)
    if cluster.world_size > MAX_DEVICES:
        raise SpecError(
            f"{flag} {text!r} has {cluster.world_size:,} devices, above the limit of "
            f"{MAX_DEVICES:,}; check the node and device counts"
        )
    return cluster


def _cluster(gpu: str, n_nodes: int, gpus_per_node: int | None, flag: str):
    from autosearch.core._io import positive_int
    from autosearch.core.hardware import Cluster

    # Check the numbers before the profile is read, so the message names the flag.
    positive_int(n_nodes, f"{flag}: n_nodes")
    if gpus_per_node is None:  # a profile YAML: its own devices per node
        return Cluster(gpu=gpu, n_nodes=n_nodes)
    positive_int(gpus_per_node, f"{flag}: gpus_per_node")
    return Cluster(gpu=gpu, n_nodes=n_nodes, gpus_per_node=gpus_per_node)


def _gpu_name(name: str, flag: str) -> str:
    from autosearch.core.hardware import profile_aliases

    low, aliases = name.lower(), profile_aliases()
    if low in aliases:
        print(
            f"note: {flag}: {name!r} is read as the {aliases[low]!r} profile; write "
            f"{aliases[low]} to silence this note (`autosearch hardware` lists the profiles)",
            file=sys.stderr,
        )
        return aliases[low]
    if low in _AMBIGUOUS_GPUS:
        raise SpecError(
            f"{flag}: {name!r} names more than one profile: "
            f"{' or '.join(_AMBIGUOUS_GPUS[low])}; write one of them"
        )
    return name


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
