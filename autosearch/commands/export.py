"""`autosearch export`: a strategy as the flags or config of Megatron-LM, DeepSpeed, torchtitan."""

from __future__ import annotations

import argparse
import os
import sys

from autosearch.commands._common import (
    add_cluster_args,
    batch_size_arg,
    check_output_folder,
    load_cluster,
    load_model,
    load_strategy,
)
from autosearch.core.errors import SpecError

OUTPUT_FILES = (
    "megatron.sh",
    "ds_config.json",
    "deepspeed_launch.sh",
    "torchtitan.toml",
    "torchtitan.sh",
    "torchtitan_flavor.py",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="print a strategy as Megatron-LM flags, a DeepSpeed config or a torchtitan TOML",
        description="Print (or write with --out) the equivalent configuration of a strategy for "
        "another runtime, with the model's shape and the launch command, and say what has no "
        "equivalent there.",
    )
    p.add_argument(
        "--strategy",
        required=True,
        help='a strategy YAML (e.g. results/<study>/best_strategy.yaml) or "dp=8,tp=8,pp=4,..."',
    )
    p.add_argument(
        "--global-batch-size",
        type=batch_size_arg,
        help="sequences per optimizer step, if the strategy does not give global_batch_size",
    )
    p.add_argument("--to", required=True, help="megatron, deepspeed, torchtitan, or all")
    p.add_argument(
        "--model",
        help="catalog name or model YAML (adds the model's flags, checks the strategy); "
        "defaults to the model of the study a best_strategy.yaml comes from",
    )
    add_cluster_args(p, required=False)
    p.add_argument(
        "--out",
        help="write the files into this folder (megatron.sh, ds_config.json and "
        "deepspeed_launch.sh, torchtitan.toml) instead of printing",
    )
    p.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="export even where the framework cannot build a field of the model as planned "
        "(the files then say which); without it such an export is refused",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autosearch.export import EXPORTERS, export, write_exports

    strategy = load_strategy(args.strategy, global_batch_size=args.global_batch_size)
    model_src, cluster_src = args.model, args.cluster
    if os.path.isfile(args.strategy) and (model_src is None or cluster_src is None):
        recorded_model, recorded_cluster = _recorded_model_cluster(args.strategy)
        if model_src is None:
            model_src = recorded_model
        if cluster_src is None and args.nnodes is None:
            cluster_src = recorded_cluster
    model = load_model(model_src) if model_src is not None else None
    cluster = None
    if cluster_src is not None:
        cluster = load_cluster(cluster_src, nnodes=args.nnodes, gpus_per_node=args.gpus_per_node)
    if model is not None:
        strategy.validate(model, cluster)
    elif cluster is not None and cluster.world_size != strategy.world_size:
        raise SpecError(
            f"dp*tp*pp = {strategy.world_size} but the cluster {cluster.name} has "
            f"{cluster.world_size} devices"
        )
    to = args.to.lower()
    if to != "all" and to not in EXPORTERS:
        raise SpecError(
            f"unknown runtime {args.to!r} to export to; choose one of "
            f"{', '.join(EXPORTERS)} or all"
        )
    targets = list(EXPORTERS) if to == "all" else [to]
    if args.out is not None:
        check_output_folder(args.out, files=OUTPUT_FILES)
        for target in targets:  # refuses a model the framework cannot build, before writing
            export(
                strategy,
                to=target,
                model=model,
                cluster=cluster,
                allow_unsupported=args.allow_unsupported,
            )
        paths = write_exports(
            args.out,
            strategy,
            model=model,
            cluster=cluster,
            to=tuple(targets),
            allow_unsupported=args.allow_unsupported,
        )
        print("wrote " + " ".join(paths))
        return 0
    for i, target in enumerate(targets):
        out = export(
            strategy,
            to=target,
            model=model,
            cluster=cluster,
            allow_unsupported=args.allow_unsupported,
        )
        if len(targets) > 1:
            print(("\n" if i else "") + f"==> {out.runtime}")
            print(out.render(), end="")
            continue
        # One runtime: the config alone on stdout (`> ds_config.json` is valid), caveats on stderr.
        print(out.text)
        caveats = out.render()[len(out.text.rstrip()) :].strip("\n")
        if caveats:
            print(caveats, file=sys.stderr)
    return 0


def _recorded_model_cluster(path: str):
    """The model and cluster of the study a best_strategy.yaml comes from: the full specs from
    the study.yaml beside it, else the names the file records (None where there is nothing)."""
    from autosearch.core._io import read_yaml_mapping

    doc = read_yaml_mapping(path, what="strategy")
    model, cluster = doc.get("model"), doc.get("cluster")
    study = os.path.join(os.path.dirname(os.path.abspath(path)), "study.yaml")
    if "strategy" in doc and os.path.isfile(study):
        meta = read_yaml_mapping(study, what="study record")
        if meta.get("model") == model and isinstance(meta.get("model_spec"), dict):
            model = meta["model_spec"]
        if meta.get("cluster") == cluster and isinstance(meta.get("cluster_spec"), dict):
            cluster = meta["cluster_spec"]
    return model, cluster
