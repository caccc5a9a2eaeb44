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
from autosearch.tuning._checks import check_output_file as check_output_file
from autosearch.tuning._checks import check_output_folder as check_output_folder

GiB = float(1 << 30)


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


def load_model(text: str | None, *, flag: str = "--model", seq_len: int | None = None, lora=None):
    """A catalog model, a model YAML file, or a Hugging Face config.json or the folder holding
    one, at `seq_len` tokens when given (``--seq-len``); a message about a file or folder names
    its path. A config.json without `seq_len` trains at its maximum positions: above 32k tokens
    that is said in one note line on stderr; a key its family does not know (a typo, often) in
    a warning line there (not Python warnings with a file and line)."""
    import sys
    import warnings

    from autosearch.core.hf_config import LongSequenceWarning, UnknownConfigKeyWarning
    from autosearch.core.model_spec import ModelSpec

    lines = {LongSequenceWarning: "note", UnknownConfigKeyWarning: "warning"}

    if isinstance(text, dict):  # from a config file: the fields of a ModelSpec
        spec = ModelSpec.from_dict(text, what=f"{flag} (a mapping)")
        return ModelSpec.load(spec, seq_len=seq_len, lora=lora)
    text = check_text(text, flag)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            for category in lines:
                warnings.simplefilter("always", category)
            spec = ModelSpec.load(text, seq_len=seq_len, lora=lora)
    except SpecError as exc:
        if os.path.exists(text) and text not in str(exc):
            kind = "folder" if os.path.isdir(text) else "file"
            raise SpecError(f"model {kind} {text!r}: {exc}") from None
        raise
    finally:  # before an error too: an unknown key may be why
        for w in caught:
            if w.category in lines:
                print(f"{lines[w.category]}: {w.message}", file=sys.stderr)
            else:  # not ours to reword
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return spec


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


def check_text(text: str | None, flag: str) -> str:
    """A non-empty argument (an empty string is a mistake, not a default)."""
    if text is None or not str(text).strip():
        raise SpecError(f"{flag} is empty; give a value (see --help)")
    return str(text).strip()


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
