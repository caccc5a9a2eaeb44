"""`autosearch sweep`: the best strategy for every model x cluster x batch size, in one CSV.

Each combination is one `tune` (in memory); its row is appended to the CSV as soon as it is done,
so a sweep that is interrupted keeps what it finished, and running the same command again skips
the combinations already in the file.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import itertools
import os
import sys
import time
from typing import Any

from autosearch.commands._common import (
    _gpu_name,
    add_lora_args,
    check_output_file,
    check_text,
    finite_float_arg,
    load_cluster,
    load_model,
    lora_arg,
    positive_int_arg,
    quiet_interrupted_trials,
    seq_len_arg,
)
from autosearch.core.strategy import Strategy

COLUMNS = [
    "model",
    "params_b",
    "seq_len",
    "cluster",
    "gpu",
    "n_nodes",
    "gpus_per_node",
    "n_gpus",
    "global_batch_size",
    "tokens_per_step",
    "status",
    "strategy",
    # every dimension of a strategy (autosearch.core.dimensions), in a strategy file's order
    *(f.name for f in dataclasses.fields(Strategy) if f.name != "global_batch_size"),
    "tokens_per_s",
    "step_time_s",
    "mfu",
    "tflops_per_gpu",
    "peak_memory_gib",
    "memory_capacity_gib",
    "days_per_trillion_tokens",
    "usd_per_million_tokens",
    "space_size",
    "trials",
    "search_s",
    "reason",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="best strategy for many models x clusters x batch sizes, in one CSV",
        description="Run the search for every combination of models, clusters and global batch "
        "sizes "
        "and write one CSV row per combination (its best strategy and figures).",
    )
    p.add_argument(
        "--models", required=True, help="comma-separated catalog names or model YAML files"
    )
    p.add_argument(
        "--seq-len",
        type=seq_len_arg,
        help="training sequence length in tokens for every model, replacing each model's",
    )
    add_lora_args(p)
    p.add_argument(
        "--clusters", help="comma-separated GPU:NODESxGPUS, e.g. h100-sxm:16x8,h100-sxm:32x8"
    )
    p.add_argument("--gpus", help="comma-separated GPU profiles, crossed with --nodes")
    p.add_argument(
        "--nodes", help="comma-separated node counts, crossed with --gpus (e.g. 8,16,32)"
    )
    p.add_argument(
        "--global-batch-sizes", required=True, help="comma-separated, e.g. 256,512,1024"
    )
    p.add_argument("--n-trials", type=positive_int_arg, default=200, help="trials per combination")
    p.add_argument(
        "--sampler",
        choices=["tpe", "random", "exhaustive"],
        default="tpe",
        help="Optuna sampler of each search (default tpe)",
    )
    p.add_argument("--space", help="search space YAML or shipped name (default, megatron)")
    p.add_argument(
        "--runtime",
        default="torch",
        help="cost-model runtime (cost_models/runtimes.yaml): torch, torchtitan, megatron-core, "
        "composer-fsdp, deepspeed or megatron-sc21",
    )
    p.add_argument(
        "--price-per-gpu-hour",
        type=finite_float_arg,
        help="dollars per device-hour: adds usd_per_million_tokens",
    )
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    p.add_argument(
        "--out",
        default=os.path.join("results", "sweep.csv"),
        help="CSV path (default results/sweep.csv)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def _split(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    from autosearch.core._files import DISK_HINTS
    from autosearch.core._io import INT_LIMITS
    from autosearch.core.errors import SpecError
    from autosearch.core.hardware import HardwareProfile

    check_output_file(args.out)
    _check_regular_output(args.out)
    models = [
        load_model(m, flag="--models", seq_len=args.seq_len, lora=lora_arg(args))
        for m in _split(check_text(args.models, "--models"))
    ]
    if not models:
        raise SpecError(f"--models {args.models!r} names no model; e.g. --models llama3-8b")
    clusters = [load_cluster(c, flag="--clusters") for c in _split(args.clusters)]
    if args.gpus or args.nodes:
        if not (args.gpus and args.nodes):
            raise SpecError(
                "--gpus and --nodes go together (their cross product is swept); "
                "or give --clusters GPU:NODESxGPUS,..."
            )
        try:
            nodes = [int(n) for n in _split(args.nodes)]
        except ValueError:
            nodes = []
        if not nodes or min(nodes) < 1:
            raise SpecError(
                f"--nodes must be comma-separated integers >= 1 (e.g. 8,16,32), got {args.nodes!r}"
            )
        for g in _split(args.gpus):
            if ":" in g or g.endswith((".yaml", ".yml")):
                raise SpecError(
                    f"--gpus takes GPU profile names (e.g. h100-sxm), got {g!r}; "
                    "give whole clusters with --clusters"
                )
            name = _gpu_name(g, "--gpus")
            per_node = HardwareProfile.load(name).gpus_per_node
            clusters += [load_cluster(f"{name}:{n}x{per_node}", flag="--nodes") for n in nodes]
    if not clusters:
        raise SpecError(
            "give --clusters (e.g. h100-sxm:16x8,h100-sxm:32x8) or --gpus with --nodes"
        )
    try:
        batches = [int(b) for b in _split(args.global_batch_sizes)]
    except ValueError:
        raise SpecError(
            "--global-batch-sizes must be comma-separated integers, "
            f"got {args.global_batch_sizes!r}"
        ) from None
    limit = INT_LIMITS["global_batch_size"]
    bad = [b for b in batches if not 1 <= b <= limit]
    if bad or not batches:
        raise SpecError(
            f"--global-batch-sizes {args.global_batch_sizes!r}: each must be an integer from 1 "
            f"to {limit:,}" + (f"; got {bad[0]:,}" if bad else "")
        )

    quiet_interrupted_trials()
    _drop_torn_last_line(args.out)
    _check_header(args.out)
    done = _rows_done(args.out)
    combos = list(itertools.product(models, clusters, batches))
    todo = [c for c in combos if (_label(c[0]), c[0].seq_len, c[1].name, c[2]) not in done]
    if not args.quiet:
        print(
            f"sweep: {len(combos)} combinations "
            f"({len(combos) - len(todo)} already in {args.out}), "
            f"{args.n_trials} trials each",
            file=sys.stderr,
        )
    written = 0
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        new_file = not os.path.exists(args.out) or os.path.getsize(args.out) == 0
        f = open(args.out, "a", newline="", encoding="utf-8")
        try:
            written = _write_rows(args, f, todo, new_file=new_file)
        finally:
            with contextlib.suppress(OSError):  # a flush that failed: said once, below
                f.close()
    except _WriteError as exc:
        written, err = exc.args
        raise SpecError(
            f"cannot write --out {args.out!r}: {err.strerror}"
            + DISK_HINTS.get(err.errno or 0, "")
            + f"; the {len(done) + written} rows written before are kept there, and the same "
            "command continues from them"
        ) from None
    except OSError as exc:
        raise SpecError(f"cannot write --out {args.out!r}: {exc.strerror}") from None
    print(f"wrote {args.out} ({len(combos)} rows)")
    return 0


class _WriteError(Exception):
    """(rows written, the OSError) of a write that failed after some rows were kept."""


def _write_rows(args: argparse.Namespace, f, todo: list, *, new_file: bool) -> int:
    """Append one row per combination, each flushed to the disk before the next is computed;
    the number of rows written."""
    writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
    done = 0
    try:
        if new_file:
            writer.writeheader()
            f.flush()
        for i, (model, cluster, gbs) in enumerate(todo, 1):
            t0 = time.perf_counter()
            row = sweep_row(
                model,
                cluster,
                gbs,
                n_trials=args.n_trials,
                sampler=args.sampler,
                space=args.space,
                runtime=args.runtime,
                price_per_gpu_hour=args.price_per_gpu_hour,
                seed=args.seed,
            )
            writer.writerow(row)
            f.flush()
            os.fsync(f.fileno())
            done += 1
            if not args.quiet:
                what = row["strategy"] or row["reason"]
                tps = f"{row['tokens_per_s']:,.0f} tok/s " if row["tokens_per_s"] != "" else ""
                print(
                    f"[{i}/{len(todo)}] {model.name} {cluster.name} gbs {gbs}: "
                    f"{row['status']} {tps}{what} "
                    f"({time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                )
    except OSError as exc:
        raise _WriteError(done, exc) from None
    return done


def _check_regular_output(path: str) -> None:
    """The CSV is appended to and read back (the rows done): it must be a regular file or not
    exist yet. A device would be read forever (/dev/full, /dev/zero) or lose the rows
    (/dev/null); a FIFO would block."""
    from autosearch.core._io import file_kind
    from autosearch.core.errors import SpecError

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SpecError(f"cannot use --out {path!r}: {exc.strerror}") from None
    kind = file_kind(mode)
    if kind is not None:
        raise SpecError(
            f"--out {path!r} is {kind}, not a regular file: the sweep appends its rows to the "
            "CSV and reads them back to continue; give a file path, e.g. results/sweep.csv"
        )


def sweep_row(
    model,
    cluster,
    gbs: int,
    *,
    n_trials: int,
    sampler: str,
    space,
    runtime: str,
    price_per_gpu_hour: float | None,
    seed: int | None,
) -> dict:
    """One CSV row: the best strategy for (model, cluster, gbs), or why there is none."""
    from autosearch.core.errors import SpecError
    from autosearch.tuning import NoFeasibleStrategyError, usd_per_million_tokens
    from autosearch.tuning._study import tune
    from search_spaces import SearchSpace

    row: dict[str, Any] = {k: "" for k in COLUMNS}
    row.update(
        model=_label(model),
        params_b=round(model.n_params / 1e9, 3),
        seq_len=model.seq_len,
        cluster=cluster.name,
        gpu=cluster.profile.name,
        n_nodes=cluster.n_nodes,
        gpus_per_node=cluster.gpus_per_node,
        n_gpus=cluster.world_size,
        global_batch_size=gbs,
        tokens_per_step=gbs * model.seq_len,
    )
    try:
        sp = SearchSpace(model, cluster, global_batch_size=gbs, config=space, runtime=runtime)
        row["space_size"] = sp.size
        result = tune(
            model,
            cluster,
            global_batch_size=gbs,
            space=sp,
            n_trials=n_trials,
            sampler=sampler,
            seed=seed,
            runtime=runtime,
            top_k=1,
        )
    except NoFeasibleStrategyError as exc:
        row.update(
            status="infeasible", reason=str(exc), trials=exc.result.n_trials if exc.result else ""
        )
        return row
    except SpecError as exc:  # e.g. no (dp, tp, pp) split of this batch on this cluster
        row.update(status="invalid", reason=str(exc))
        return row
    s, r = result.best_strategy, result.best_report
    if s is None or r is None:  # tune raises NoFeasibleStrategyError first
        row.update(status="infeasible", reason=result.message)
        return row
    row.update(
        status="ok",
        strategy=s.short(),
        **{k: v for k, v in s.to_dict().items() if k in COLUMNS},
        tokens_per_s=r.tokens_per_s,
        step_time_s=r.step_time_s,
        mfu=r.mfu,
        tflops_per_gpu=r.tflops_per_gpu,
        peak_memory_gib=r.peak_memory_bytes / 2**30,
        memory_capacity_gib=r.memory_capacity_bytes / 2**30,
        days_per_trillion_tokens=1e12 / r.tokens_per_s / 86400,
        trials=result.n_trials,
        search_s=round(result.timings.get("search_s", 0.0), 3),
    )
    # The CLI's forms: 15/16/16/15 for a split, empty for "every layer"
    row["pipeline_split"] = "/".join(map(str, s.pipeline_split)) if s.pipeline_split else ""
    row["recompute_num_layers"] = "" if s.recompute_num_layers is None else s.recompute_num_layers
    if price_per_gpu_hour:
        row["usd_per_million_tokens"] = usd_per_million_tokens(
            r, price_per_gpu_hour, cluster.world_size
        )
    return row


def _check_header(path: str) -> None:
    """Refuse to append to a CSV whose columns are not this version's (rows would misalign)."""
    from autosearch.core.errors import SpecError

    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    if header != COLUMNS:
        missing = [c for c in COLUMNS if c not in header]
        raise SpecError(
            f"--out {path!r} has other columns than this sweep writes"
            + (
                f" (no {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
                if missing
                else ""
            )
            + "; give another --out, or move the file away to start it again"
        )


def _label(model) -> str:
    """The model column: its name, and its LoRA adapters when it has them (a fine-tune and a
    full training run of one model are two rows)."""
    return model.name + (f"-{model.lora.short()}" if model.lora is not None else "")


def _rows_done(path: str) -> set[tuple[str, int, str, int]]:
    if not os.path.exists(path):
        return set()
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    done = set()
    for r in rows:
        try:
            done.add((r["model"], int(r["seq_len"]), r["cluster"], int(r["global_batch_size"])))
        except (KeyError, TypeError, ValueError):
            continue
    return done


def _drop_torn_last_line(path: str) -> None:
    """A sweep killed while writing a row leaves a line without its newline: drop it."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)
