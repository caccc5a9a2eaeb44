"""`autosearch estimate`: one strategy through the cost model, as a table or JSON."""

from __future__ import annotations

import argparse

from autosearch.commands._common import (
    add_model_cluster_args,
    batch_size_arg,
    fmt_bytes,
    fmt_s,
    load_model_cluster,
    load_strategy,
    print_json,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="predict step time, throughput and memory of one strategy",
        description="Predict step time, throughput and memory of one strategy with the analytic "
        "cost model.",
    )
    add_model_cluster_args(p)
    p.add_argument(
        "--strategy",
        required=True,
        help='a strategy YAML file (naming dp, tp and pp), or "dp=8,tp=8,pp=4,micro_batch_size=1,'
        'global_batch_size=512,..." (degrees not named are 1)',
    )
    p.add_argument(
        "--global-batch-size",
        type=batch_size_arg,
        help="sequences per optimizer step, if the strategy does not give global_batch_size",
    )
    p.add_argument(
        "--memory-margin",
        type=margin_arg,
        metavar="FRACTION",
        help="device memory held back: the strategy fits when its peak is at most (1 - "
        "FRACTION) x capacity, e.g. 0.1 or 10%%; default: from the measured memory error of runs "
        "of this kind (cost_models/memory_bands.yaml), as tune holds back",
    )
    p.add_argument("--json", action="store_true", help="print the CostReport as JSON")
    p.set_defaults(func=run)


def margin_arg(text: str) -> float:
    """argparse type: a fraction of device memory (0.1 or 10%), read as `tune` reads it."""
    from autosearch.core.errors import SpecError
    from autosearch.core.schema import read_margin

    try:
        return read_margin(text, "--memory-margin")
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--memory-margin")) from None


def run(args: argparse.Namespace) -> int:
    from autosearch.tuning._margin import memory_margin
    from cost_models.analytic import AnalyticCostModel

    model, cluster = load_model_cluster(args)
    strategy = load_strategy(args.strategy, global_batch_size=args.global_batch_size)
    cm = AnalyticCostModel(model, cluster, runtime=args.runtime)
    margin = memory_margin(cm.runtime, cluster, override=args.memory_margin)
    report = cm.estimate(strategy)
    report = report.with_margin(margin.bytes_of(report.memory_capacity_bytes))
    if args.json:
        print_json(
            {
                "model": model.name,
                "cluster": cluster.name,
                "runtime": cm.runtime.name,
                "profile_defaults_used": list(cluster.profile.defaults_used()),
                "strategy": strategy.to_dict(),
                "memory_margin": {"fraction": margin.fraction, "why": margin.why},
                "report": report.to_dict(flat=False),
            }
        )
        return 0
    print(render_report(model, cluster, strategy, report, runtime=cm.runtime.name))
    if report.memory_margin_bytes:
        print(f"note: the memory margin is {margin.fraction:.1%} of the device: {margin.why}")
    return 0


def render_report(model, cluster, strategy, report, *, runtime: str = "torch") -> str:
    lines = [
        f"model     {model.name}  ({model.n_params / 1e9:.2f} B parameters, seq {model.seq_len})",
        *(
            [
                f"lora      rank {model.lora.rank} on {', '.join(model.lora.targets or ())}: "
                f"{model.lora.layer_params(model) * model.n_layers / 1e6:,.1f} M trainable, "
                "the rest frozen"
            ]
            if model.lora is not None
            else []
        ),
        f"cluster   {cluster.name}  ({cluster.world_size} devices, runtime {runtime})",
        f"strategy  {strategy.short()}  (grad accumulation {strategy.grad_accum_steps})",
        "",
        f"step time        {fmt_s(report.step_time_s)}",
        *(
            [f"how sure         {report.band.describe(report.step_time_s)}"]
            if report.band is not None
            else []
        ),
        f"throughput       {report.tokens_per_s:,.0f} tokens/s   "
        f"{report.samples_per_s:,.2f} samples/s",
        f"per device       {report.tflops_per_gpu:.1f} TFLOP/s   MFU {report.mfu * 100:.1f}%",
        f"memory           {fmt_bytes(report.peak_memory_bytes)} of "
        f"{fmt_bytes(report.memory_usable_bytes)} usable "
        f"({fmt_bytes(report.memory_capacity_bytes)} less a "
        f"{fmt_bytes(report.memory_margin_bytes)} margin)  "
        + ("fits" if report.fits else f"DOES NOT FIT: {report.infeasible_reason}"),
        "",
        "time per step                      memory per device",
    ]
    tb = [(k[:-2], v) for k, v in report.time._asdict().items()]
    mb = [(k[:-6], v) for k, v in report.memory._asdict().items()]
    for i in range(max(len(tb), len(mb))):
        left = (
            f"  {tb[i][0]:<18} {fmt_s(tb[i][1]):>11} {tb[i][1] / report.step_time_s * 100:5.1f}%"
            if i < len(tb)
            else " " * 39
        )
        right = f"  {mb[i][0]:<12} {fmt_bytes(mb[i][1]):>11}" if i < len(mb) else ""
        lines.append(f"{left:<37}{right}")
    for note in report.notes:
        lines.append(f"note: {note}")
    defaults = cluster.profile.defaults_used()
    if defaults:
        lines.append(
            f"note: profile {cluster.profile.name} uses datasheet/default values "
            f"(not measured here) for: "
            f"{', '.join(defaults)}; `autosearch calibrate` measures them"
        )
    return "\n".join(lines)
