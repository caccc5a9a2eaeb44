"""`autosearch estimate`: one strategy through the cost model, as a table or JSON.

The flags and the keys of a ``--config`` file derive from `EstimateConfig`'s fields (their
`Setting`s). A strategy that does not fit exits with status 1 and names the least change that
makes it fit (`autosearch.tuning._advice.nearby_fixes`), else the smallest cluster on which the
least memory-hungry strategy fits (`smallest_cluster`).
"""

from __future__ import annotations

import argparse
import dataclasses

from autosearch.commands._common import (
    check_text,
    fmt_bytes,
    fmt_s,
    load_cluster,
    load_model,
    load_strategy,
    print_json,
)
from autosearch.commands._schema import add_flags, add_presentation_flags, read_args
from autosearch.core.errors import SpecError
from autosearch.core.report import offload_summary
from autosearch.core.schema import flag_of, lora_of, required
from autosearch.tuning._estimate import EstimateConfig

DOES_NOT_FIT = 1  # the exit status of a strategy that does not fit (2: a bad input)
PRESENTATION = {"json": "print the CostReport as JSON (with fits_with when it does not fit)"}
EPILOG = """\
exit status: 0 the strategy fits; 1 it does not fit (the least change that makes it fit is
  printed, or the smallest cluster on which the least memory-hungry strategy fits); 2 a bad
  input (one message on stderr).

config files (--config): a YAML mapping with the flags' names as keys (global_batch_size or
  global-batch-size; model and cluster may be mappings of their fields; json: true); flags on
  the command line override it.

examples:
  autosearch estimate --model llama3-70b --cluster h100-sxm:32x8 --global-batch-size 512 \\
      --strategy "dp=8,tp=8,pp=4,recompute=full,sequence_parallel=true"
  autosearch estimate --config estimate.yaml --json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="predict step time, throughput and memory of one strategy",
        description="Predict step time, throughput and memory of one strategy with the analytic "
        "cost model; when it does not fit, name the least change that makes it fit.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p, EstimateConfig)
    add_presentation_flags(p, PRESENTATION)
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read the settings from a YAML file (keys as the flags; flags given here override "
        "it)",
    )
    p.set_defaults(func=run)


def config_from(args: argparse.Namespace):
    """(model, cluster, strategy, config, presentation) of a command line: the --config file's
    settings overridden by the flags given, the model and cluster read as the CLI reads them
    (`Cluster.parse` strict, messages naming the flags)."""
    from autosearch.core._io import read_yaml_mapping

    data = None
    if args.config is not None:
        data = read_yaml_mapping(check_text(args.config, "--config"), what="config")
    values, shown = read_args(
        args,
        [EstimateConfig],
        data=data,
        what=f"--config {args.config!r}",
        presentation=PRESENTATION,
    )
    fields = dataclasses.fields(EstimateConfig)
    missing = [flag_of(f) for f in fields if required(f) and f.name not in values]
    if missing:
        raise SpecError(
            f"estimate needs {', '.join(missing)}: give the flag(s), or the key(s) in a --config "
            "file"
        )
    lora = lora_of(values.get("lora_rank"), values.get("lora_targets"))
    model = load_model(values["model"], seq_len=values.get("seq_len"), lora=lora)
    cluster = load_cluster(
        values["cluster"], nnodes=values.get("nnodes"), gpus_per_node=values.get("gpus_per_node")
    )
    strategy = load_strategy(values["strategy"], global_batch_size=values.get("global_batch_size"))
    config = EstimateConfig(**{**values, "model": model, "cluster": cluster})
    return model, cluster, strategy, config, shown


def run(args: argparse.Namespace) -> int:
    from autosearch.tuning._advice import fit_advice
    from autosearch.tuning._margin import memory_margin
    from cost_models.analytic import AnalyticCostModel

    model, cluster, strategy, config, shown = config_from(args)
    cm = AnalyticCostModel(model, cluster, runtime=config.runtime)
    margin = memory_margin(cm.runtime, cluster, override=config.memory_margin)
    report = cm.estimate(strategy)
    report = report.with_margin(margin.bytes_of(report.memory_capacity_bytes))
    advice = None
    if not report.fits:
        advice = fit_advice(cm, strategy, report, margin_fraction=margin.fraction)
    if shown["json"]:
        print_json(
            {
                "model": model.name,
                "cluster": cluster.name,
                "runtime": cm.runtime.name,
                "profile_defaults_used": list(cluster.profile.defaults_used()),
                "strategy": strategy.to_dict(),
                "memory_margin": {"fraction": margin.fraction, "why": margin.why},
                "report": report.to_dict(flat=False),
                **(advice.to_dict() if advice is not None else {}),
            }
        )
        return 0 if report.fits else DOES_NOT_FIT
    print(render_report(model, cluster, strategy, report, runtime=cm.runtime.name))
    if report.memory_margin_bytes:
        print(f"note: the memory margin is {margin.fraction:.1%} of the device: {margin.why}")
    if advice is not None:
        print(advice.describe())
        return DOES_NOT_FIT
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
        *(
            [f"offload          {offload_summary(strategy, report)}"]
            if offload_summary(strategy, report)
            else []
        ),
        "",
        "time per step                      memory per device",
    ]
    tb = [(k[:-2], v) for k, v in report.time._asdict().items() if k != "offload_s" or v]
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
