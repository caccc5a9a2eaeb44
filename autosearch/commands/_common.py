"""Arguments and printing shared by several subcommands."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from autosearch.core.errors import SpecError

GiB = float(1 << 30)


def add_model_cluster_args(p: argparse.ArgumentParser, *, cluster_required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="catalog name (see `autosearch models`) or a model YAML file",
    )
    p.add_argument(
        "--cluster",
        required=cluster_required,
        help="GPU:NODESxGPUS (e.g. h100-sxm:32x8), a cluster YAML file, or a profile YAML path",
    )
    p.add_argument(
        "--runtime",
        default="torch",
        help="runtime behaviour the cost model assumes: torch (default) "
        "or megatron-sc21 (Megatron-LM as in Narayanan et al. 2021)",
    )


def load_model_cluster(args: argparse.Namespace):
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec

    return ModelSpec.load(args.model), Cluster.parse(args.cluster)


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
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecError(message)
