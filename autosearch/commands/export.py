"""`autosearch export`: a strategy file in the flags / config of Megatron-LM, DeepSpeed or torchtitan."""

from __future__ import annotations

import argparse
import sys

from autosearch.commands._common import batch_size_arg, load_strategy


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="print a strategy as Megatron-LM flags, a DeepSpeed config or a torchtitan TOML",
        description="Print the equivalent configuration of a strategy for another runtime, and say "
        "what has no equivalent there.",
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
        help="catalog name or model YAML (adds layer counts, checks the strategy); "
        "defaults to the model recorded in a tuner's best_strategy.yaml",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from autosearch.core._io import read_yaml_mapping
    from autosearch.core.model_spec import ModelSpec
    from autosearch.export import EXPORTERS, export

    strategy = load_strategy(args.strategy, global_batch_size=args.global_batch_size)
    model_name = args.model
    if model_name is None and os.path.isfile(args.strategy):
        model_name = read_yaml_mapping(args.strategy, what="strategy").get("model")
    model = None
    if model_name:
        model = ModelSpec.load(model_name)
        strategy.validate(model)
    targets = list(EXPORTERS) if args.to.lower() == "all" else [args.to]
    for i, target in enumerate(targets):
        out = export(strategy, to=target, model=model)
        if len(targets) > 1:
            print(("\n" if i else "") + f"==> {out.runtime}")
            print(out.render(), end="")
            continue
        # One runtime: the config alone on stdout (so `> ds_config.json` is valid), caveats on stderr.
        print(out.text)
        caveats = out.render()[len(out.text.rstrip()) :].strip("\n")
        if caveats:
            print(caveats, file=sys.stderr)
    return 0
