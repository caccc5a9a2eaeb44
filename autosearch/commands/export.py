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
        "--force",
        action="store_true",
        help="write (or print) a strategy that does not fit, or cannot run, under the target "
        "framework's runtime, with that warning on top; without it such an export is refused "
        "(exit status 2)",
    )
    p.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="export even where the framework cannot build a field of the model as planned "
        "(the files then say which); without it such an export is refused",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autosearch.export import EXPORT_FILES, EXPORTERS, export, write_exports

    strategy = load_strategy(args.strategy, global_batch_size=args.global_batch_size)
    model_src, cluster_src = args.model, args.cluster
    recorded: dict = {}
    if os.path.isfile(args.strategy):
        recorded = _recorded(args.strategy)
        if model_src is None:
            model_src = recorded.get("model")
        if cluster_src is None and args.nnodes is None:
            cluster_src = recorded.get("cluster")
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
    warnings = _checked(strategy, targets, model, cluster, recorded, force=args.force)
    if args.out is not None:
        check_output_folder(args.out, files=EXPORT_FILES)
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
            headers={t: [f"WARNING: {x}" for x in lines] for t, lines in warnings.items()},
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
        warned = "".join(f"# WARNING: {line}\n" for line in warnings.get(target, ()))
        if len(targets) > 1:
            print(("\n" if i else "") + f"==> {out.runtime}")
            print(warned + out.render(), end="")
            continue
        if warned:
            print(warned, end="", file=sys.stderr)
        # One runtime: the config alone on stdout (`> ds_config.json` is valid), caveats on stderr.
        print(out.text)
        caveats = out.render()[len(out.text.rstrip()) :].strip("\n")
        if caveats:
            print(caveats, file=sys.stderr)
    return 0


def _checked(strategy, targets, model, cluster, recorded: dict, *, force: bool):
    """Each target's check before anything is written (`check_export`): the strategy priced
    under the framework's runtime, said on stderr; one that does not fit or cannot run there
    is refused unless `force`, and then its warning lines go on top of the files
    ({target: lines}). With a best_strategy.yaml tuned for another runtime, that framework's
    own pick is searched and named."""
    from autosearch.tuning._config import TuneConfig
    from autosearch.tuning._export_check import check_export

    if model is None or cluster is None:
        print(
            "note: not priced under the target frameworks (no model or cluster): give --model "
            "and --cluster, or a best_strategy.yaml written by tune",
            file=sys.stderr,
        )
        return {}
    search = recorded.get("config") or TuneConfig(
        model=model, cluster=cluster, global_batch_size=strategy.global_batch_size
    )
    search = search.replace(model=model, cluster=cluster, nnodes=None, gpus_per_node=None)
    warnings, refused = {}, []
    for target in targets:
        check = check_export(
            strategy,
            target=target,
            model=model,
            cluster=cluster,
            tuned_for=recorded.get("runtime"),
            search=search,
        )
        for line in check.lines():
            print(line, file=sys.stderr)
        if not check.ok:
            refused.append(target)
            warnings[target] = check.lines()
    if refused and not force:
        raise SpecError(
            f"{strategy.short()} does not fit, or cannot run, under "
            f"{', '.join(refused)} (above); export the framework's own pick, tune with "
            "--runtime for it, or --force to write it anyway with the warning on top"
        )
    return warnings


def _recorded(path: str) -> dict:
    """What a best_strategy.yaml's study records: the model and cluster (their full specs from
    the study.yaml beside it, else the names the file records), the runtime it was tuned for,
    and the study's TuneConfig (for the target framework's own pick); keys absent where there
    is nothing."""
    from autosearch.core._io import read_yaml_mapping
    from autosearch.tuning._config import TuneConfig

    doc = read_yaml_mapping(path, what="strategy")
    out = {k: doc[k] for k in ("model", "cluster", "runtime") if doc.get(k) is not None}
    study = os.path.join(os.path.dirname(os.path.abspath(path)), "study.yaml")
    if "strategy" in doc and os.path.isfile(study):
        meta = read_yaml_mapping(study, what="study record")
        if meta.get("model") == out.get("model") and isinstance(meta.get("model_spec"), dict):
            out["model"] = meta["model_spec"]
        if meta.get("cluster") == out.get("cluster") and isinstance(
            meta.get("cluster_spec"), dict
        ):
            out["cluster"] = meta["cluster_spec"]
        try:
            out["config"] = TuneConfig.from_dict(meta, what=f"study record {study!r}")
        except SpecError:  # an older or edited record: the pick is searched from the case
            pass
    return out
