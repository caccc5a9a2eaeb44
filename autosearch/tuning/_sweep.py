"""`sweep`: the search of `tune` for every model x cluster x global batch, as one table.

A sweep is a list of TuneConfigs, one per combination, each run by `autosearch.tune` exactly as
``autosearch tune`` runs it (the same default search: exhaustive when scoring every layout fits
the time budget, else sampled trials and the local search, under the same budget and seed), so
a row is what `tune` picks for that case. Combinations run in parallel processes; each row is
appended to the CSV as soon as it is done (flushed and synced), so a sweep that is interrupted
keeps what it finished, and the same command again computes only the rest. At the end the CSV is
rewritten in the combinations' order with what the table adds to the picks: prices per GPU
type, days and dollars for a token target, the smallest cluster that meets a deadline and the
cheapest, and a note where a larger cluster is slower per device than a smaller one, with the
term of the step that grew. `report.md` beside the CSV plots it.

Capacity planning reads the table: "how many H100s for Llama 3 70B at 4M tokens per step, to
train 15T tokens in 30 days, and what does it cost?" is ``--tokens 15T --deadline-days 30``.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.core.schema import (
    Schema,
    lora_of,
    read_batch,
    read_count,
    read_integer,
    read_price,
    read_text,
    setting,
)
from autosearch.tuning._config import TuneConfig

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec

# The TuneConfig settings a sweep takes for every combination (the flags of `autosearch tune`
# of the same names). Each combination sets its own model, cluster and global batch; a sweep
# searches in memory (no storage, study name or output folder per combination), keeps the best
# strategy of each (no top-k) and prices it per GPU type (its own price_per_gpu_hour).
SHARED = (
    "seq_len",
    "lora_rank",
    "lora_targets",
    "runtime",
    "n_trials",
    "time_budget",
    "sampler",
    "objective",
    "memory_margin",
    "space",
    "pin",
    "fp8",
    "trial_unit",
    "seed",
    "use_recipes",
)
# The shared settings that change how a combination is searched (a CSV computed with others is not
# resumed); the sequence length and LoRA adapters are in a row's key (its seq_len and model).
SEARCH_SETTINGS = tuple(n for n in SHARED if n not in ("seq_len", "lora_rank", "lora_targets"))
# a larger cluster this much slower per device than the next smaller one gets a note
SLOWER_PER_GPU = 0.10
TOKEN_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


# ---- how a sweep's own values are read ----------------------------------------------------------
def _names(value: Any, where: str) -> tuple:
    """Comma-separated names (a text) or a list; ModelSpec and Cluster objects are kept."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise SpecError(f"{where} must be comma-separated names or a list, got {value!r}")
    out = tuple(x.strip() if isinstance(x, str) else x for x in items)
    out = tuple(x for x in out if x != "")
    if not out:
        raise SpecError(f"{where} {value!r} names nothing; e.g. {where} llama3-8b,llama3-70b")
    return out


def _counts(reader: Callable[[Any, str], int]) -> Callable[[Any, str], tuple[int, ...]]:
    def read(value: Any, where: str) -> tuple[int, ...]:
        items = _names(value if not isinstance(value, int) else [value], where)
        return tuple(reader(x, f"{where} ({x!r})") for x in items)

    return read


def read_prices(value: Any, where: str) -> dict[str, float]:
    """Dollars per device-hour: one number for every GPU type (``{"*": 2.5}``), or per type:
    ``h100-sxm=2.5,b200-sxm=4.5``, a mapping, or a YAML file of ``gpu: price`` lines."""
    from autosearch.core._io import read_yaml_mapping

    if isinstance(value, str) and "=" not in value and os.path.isfile(value):
        value = read_yaml_mapping(value, what="price file")
    if isinstance(value, (int, float, str)) and not (isinstance(value, str) and "=" in value):
        return {"*": read_price(value, where)}
    if isinstance(value, str):
        pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise SpecError(f"{where} {value!r}: give GPU=PRICE pairs, e.g. h100-sxm=2.5")
        value = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, Mapping) or not value:
        raise SpecError(
            f"{where} must be a price, GPU=PRICE pairs or a YAML file of them, got {value!r}"
        )
    return {str(k): read_price(v, f"{where} ({k})") for k, v in value.items()}


def read_tokens(value: Any, where: str) -> float:
    """A token count: a number, or with a suffix (``15T``, ``300B``, ``2.5e12``)."""
    text = str(value).strip().upper() if isinstance(value, str) else None
    if text is not None:
        match = re.fullmatch(r"([0-9.]+(?:E[+-]?[0-9]+)?)\s*([KMBGT]?)", text)
        if match is None:
            raise SpecError(f"{where}: {value!r} is not a token count (e.g. 15T, 300B, 1e12)")
        value = float(match.group(1)) * TOKEN_SUFFIXES.get(match.group(2), 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a token count, got {value!r}")
    if not (math.isfinite(value) and value >= 1):
        raise SpecError(f"{where} must be a token count >= 1 (e.g. 15T), got {value!r}")
    return float(value)


def read_days(value: Any, where: str) -> float:
    """A number of days > 0 (a number, or its text)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise SpecError(f"{where}: {value!r} is not a number of days (e.g. 30)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a number of days, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise SpecError(f"{where} must be a number of days > 0, got {value!r}")
    return float(value)


def read_jobs(value: Any, where: str) -> int:
    return read_integer(value, where, 0, 1024)


def read_settings(value: Any, where: str) -> dict[str, Any]:
    """The TuneConfig settings every combination shares (`SHARED`), read as `tune` reads them."""
    if not isinstance(value, Mapping):
        raise SpecError(f"{where} must be a mapping of tune settings, got {value!r}")
    others = [k for k in value if str(k).replace("-", "_") not in SHARED]
    if others:
        raise SpecError(
            f"{where}: {', '.join(map(str, others))} cannot be shared by a sweep's "
            "combinations (each sets its own model, cluster and batch, searches in memory and "
            f"keeps its best); a sweep takes {', '.join(SHARED)}"
        )
    return TuneConfig.read(value, what=where)


@dataclass(frozen=True, kw_only=True)
class SweepConfig(Schema):
    """Every setting of a sweep: the combinations, what the table adds, and the settings of
    `tune` they share (`settings`, the TuneConfig fields of `SHARED`)."""

    models: tuple = setting(
        read=_names,
        help="comma-separated catalog names, model YAML or Hugging Face config.json files, or "
        "model folders",
    )
    clusters: tuple = setting(
        (), read=_names, help="comma-separated GPU:NODESxGPUS, e.g. h100-sxm:16x8,h100-sxm:32x8"
    )
    gpus: tuple = setting(
        (), read=_names, help="comma-separated GPU profiles, crossed with --nodes"
    )
    nodes: tuple = setting(
        (), read=_counts(read_count), help="comma-separated node counts, crossed with --gpus"
    )
    global_batch_sizes: tuple = setting(
        read=_counts(read_batch), help="comma-separated sequences per step, e.g. 256,512,1024"
    )
    price_per_gpu_hour: dict[str, float] = setting(
        {},
        read=read_prices,
        metavar="PRICE|GPU=PRICE,...|FILE",
        help="dollars per device-hour: one price, a price per GPU type (h100-sxm=2.5,"
        "b200-sxm=4.5) or a YAML file of gpu: price; adds dollars per million tokens",
    )
    tokens: float | None = setting(
        None,
        read=read_tokens,
        metavar="N",
        help="tokens to train (15T, 300B, 1e12): adds the days and dollars each row takes",
    )
    deadline_days: float | None = setting(
        None,
        read=read_days,
        metavar="DAYS",
        help="with --tokens: marks the rows that finish in time, and names the smallest swept "
        "cluster that does for each model and GPU type",
    )
    jobs: int = setting(
        0,
        read=read_jobs,
        help="combinations searched at once, in separate processes (default 0: one per CPU "
        "core, at most one per combination)",
    )
    out: str = setting(
        os.path.join("results", "sweep.csv"),
        read=read_text,
        help="the CSV (default results/sweep.csv); report.md and its plots go beside it, into "
        "<stem>_report/",
    )
    settings: dict[str, Any] = setting(
        {}, read=read_settings, help="the tune settings every combination shares"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.gpus) != bool(self.nodes):
            raise SpecError(
                "--gpus and --nodes go together (their cross product is swept); "
                "or give --clusters GPU:NODESxGPUS,..."
            )
        if not (self.clusters or self.gpus):
            raise SpecError(
                "give --clusters (e.g. h100-sxm:16x8,h100-sxm:32x8) or --gpus with --nodes"
            )
        if self.deadline_days is not None and self.tokens is None:
            raise SpecError("--deadline-days needs --tokens: the tokens to train by then")
        objective = self.settings.get("objective", "throughput")
        if objective in ("throughput-memory", "throughput-cost"):
            raise SpecError(
                f"a sweep keeps one strategy per combination; objective {objective} is a "
                "Pareto front: run `autosearch tune` for it, or sweep with throughput"
            )

    @property
    def report_dir(self) -> str:
        return os.path.splitext(self.out)[0] + "_report"


# ---- the combinations ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One combination: its TuneConfig and its key in the CSV."""

    config: TuneConfig
    key: tuple[str, int, str, int]  # model label, seq_len, cluster, global batch
    order: int


def plan_cases(sweep: SweepConfig, *, load_model=None, load_cluster=None) -> list[Case]:
    """Every combination as a TuneConfig with its model and cluster read (every input is
    checked here, before any search). `load_model(value, seq_len=, lora=)` and
    `load_cluster(text)` default to the library's readers (the CLI passes its own, whose
    messages name its flags)."""
    from autosearch.core.hardware import Cluster, HardwareProfile
    from autosearch.core.hardware import _gpu_name as gpu_name
    from autosearch.tuning._study import _load_model

    settings = sweep.settings
    lora = lora_of(settings.get("lora_rank"), settings.get("lora_targets"))
    load_model = load_model or (lambda v, **kw: _load_model(v, **kw))
    load_cluster = load_cluster or (lambda t: Cluster.parse(t, strict=True))
    models = [load_model(m, seq_len=settings.get("seq_len"), lora=lora) for m in sweep.models]
    clusters = [load_cluster(c) for c in sweep.clusters]
    for g in sweep.gpus:
        if not isinstance(g, str) or ":" in g or g.endswith((".yaml", ".yml")):
            raise SpecError(
                f"--gpus takes GPU profile names (e.g. h100-sxm), got {g!r}; give whole "
                "clusters with --clusters"
            )
        name = gpu_name(g, "--gpus", strict=True)
        per_node = HardwareProfile.load(name).gpus_per_node
        clusters += [load_cluster(f"{name}:{n}x{per_node}") for n in sweep.nodes]
    missing = sorted(
        {c.profile.name for c in clusters}
        - set(sweep.price_per_gpu_hour)
        - (set() if "*" not in sweep.price_per_gpu_hour else {c.profile.name for c in clusters})
    )
    if sweep.price_per_gpu_hour and missing:
        raise SpecError(
            f"--price-per-gpu-hour gives no price for {', '.join(missing)}; add "
            f"{missing[0]}=PRICE (or one price for every GPU type)"
        )
    _check_given_once("--models", sweep.models, [label(m) for m in models])
    _check_given_once("--clusters", sweep.clusters, [c.name for c in clusters])
    _check_given_once("--global-batch-sizes", sweep.global_batch_sizes, sweep.global_batch_sizes)
    shared = {k: v for k, v in settings.items() if k != "seq_len"}
    cases = []
    for i, (m, c, b) in enumerate(itertools.product(models, clusters, sweep.global_batch_sizes)):
        price = sweep.price_per_gpu_hour.get(c.profile.name, sweep.price_per_gpu_hour.get("*"))
        config = TuneConfig(
            model=m, cluster=c, global_batch_size=b, price_per_gpu_hour=price, top_k=1, **shared
        )
        cases.append(Case(config=config, key=(label(m), m.seq_len, c.name, b), order=i))
    return cases


def _check_given_once(flag: str, given: Iterable[Any], names: Iterable[Any]) -> None:
    """A combination is a row, keyed by what it reads as: two spellings of one model, cluster
    or batch (``h100:1x8`` and ``h100-sxm:1x8``) would be one key given twice."""
    seen: dict[Any, Any] = {}
    for text, name in zip(given, names):
        if name in seen:
            also = "" if str(seen[name]) == str(text) else f" (as {seen[name]!r} and {text!r})"
            raise SpecError(
                f"{flag} names {name} twice{also}; each combination is one row of the table: "
                "give it once"
            )
        seen[name] = text


def label(model: "ModelSpec") -> str:
    """The model column: its name, and its LoRA adapters when it has them (a fine-tune and a
    full training run of one model are two rows)."""
    return model.name + (f"-{model.lora.short()}" if model.lora is not None else "")


def digest(sweep: SweepConfig) -> str:
    """The shared settings that decide how each combination is searched, as a short hash
    (each row's `settings` column): a CSV computed with other values is not resumed."""
    picked = {k: sweep.settings.get(k) for k in SEARCH_SETTINGS}
    text = json.dumps(picked, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ---- one row ------------------------------------------------------------------------------------
def _strategy_columns() -> list[str]:
    from autosearch.core.strategy import Strategy

    return [f.name for f in dataclasses.fields(Strategy) if f.name != "global_batch_size"]


# What the search picked (computed once per combination, by `case_row`)...
PICK_COLUMNS = [
    "model",
    "params_b",
    "active_params_b",
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
    *_strategy_columns(),
    "tokens_per_s",
    "tokens_per_s_low",
    "tokens_per_s_high",
    "band_runs",
    "extrapolation",
    "tokens_per_s_per_gpu",
    "step_time_s",
    "mfu",
    "tflops_per_gpu",
    "peak_memory_gib",
    "usable_memory_gib",
    "memory_capacity_gib",
    "step_shares",
    "search",
    "space_size",
    "trials",
    "search_s",
    "settings",
    "reason",
]
# ... and what the table adds (recomputed from the picks whenever the sweep finishes).
TABLE_COLUMNS = [
    "price_per_gpu_hour",
    "usd_per_million_tokens",
    "days_per_trillion_tokens",
    "days_for_tokens",
    "usd_for_tokens",
    "meets_deadline",
    "note",
]
COLUMNS = PICK_COLUMNS + TABLE_COLUMNS
TIME_TERMS = {  # the step's terms, as a note names them
    "compute_s": "compute",
    "recompute_s": "recompute",
    "tp_comm_s": "tensor-parallel communication",
    "pp_comm_s": "pipeline sends",
    "dp_comm_exposed_s": "exposed data-parallel communication",
    "bubble_s": "pipeline bubble",
    "optimizer_s": "optimizer step",
    "other_s": "fixed overhead",
}


def sig(x: float, digits: int = 4) -> float:
    """`x` rounded to `digits` significant digits (a table for people, not 17 of them)."""
    if not x or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def case_row(config: TuneConfig, settings_digest: str) -> dict[str, Any]:
    """The row of one combination: what `tune(config)` picks, or why nothing is picked."""
    from autosearch.tuning._result import NoFeasibleStrategyError
    from autosearch.tuning._study import tune

    model, cluster = config.model, config.cluster
    assert not isinstance(model, (str, dict)) and not isinstance(cluster, (str, dict))
    row: dict[str, Any] = dict.fromkeys(PICK_COLUMNS, "")
    row.update(
        model=label(model),
        params_b=sig(model.n_params / 1e9),
        active_params_b=sig(model.n_active_params / 1e9) if model.moe is not None else "",
        seq_len=model.seq_len,
        cluster=cluster.name,
        gpu=cluster.profile.name,
        n_nodes=cluster.n_nodes,
        gpus_per_node=cluster.gpus_per_node,
        n_gpus=cluster.world_size,
        global_batch_size=config.global_batch_size,
        tokens_per_step=config.global_batch_size * model.seq_len,
        settings=settings_digest,
    )
    t0 = time.perf_counter()
    try:
        result = tune(config)
    except NoFeasibleStrategyError as exc:
        partial = exc.result
        row.update(status="infeasible", reason=str(exc))
        if partial is not None:
            row.update(
                space_size=partial.space.size, trials=partial.n_trials, search=partial.search
            )
        return row
    except SpecError as exc:  # e.g. no (dp, tp, pp) split of this batch on this cluster
        row.update(status="invalid", reason=str(exc))
        return row
    s, r = result.best_strategy, result.best_report
    assert s is not None and r is not None  # tune raises NoFeasibleStrategyError first
    band = r.band
    sure = band is not None and not band.extrapolation
    shares = {k: v / r.step_time_s for k, v in r.time._asdict().items()}
    row.update(
        status="ok",
        strategy=s.short(),
        **{k: v for k, v in s.to_dict().items() if k in row and k != "global_batch_size"},
        tokens_per_s=round(r.tokens_per_s),
        tokens_per_s_low=round(r.tokens_per_s / band.high) if sure and band else "",
        tokens_per_s_high=round(r.tokens_per_s / band.low) if sure and band else "",
        band_runs=band.runs if band is not None else 0,
        extrapolation="yes" if not sure else "no",
        tokens_per_s_per_gpu=sig(r.tokens_per_s / cluster.world_size),
        step_time_s=sig(r.step_time_s),
        mfu=round(r.mfu, 4),
        tflops_per_gpu=round(r.tflops_per_gpu, 1),
        peak_memory_gib=round(r.peak_memory_bytes / 2**30, 2),
        usable_memory_gib=round(r.memory_usable_bytes / 2**30, 2),
        memory_capacity_gib=round(r.memory_capacity_bytes / 2**30, 2),
        step_shares=json.dumps({k: round(v, 4) for k, v in shares.items()}),
        search=result.search,
        space_size=result.space.size,
        trials=result.n_trials,
        search_s=round(time.perf_counter() - t0, 2),
    )
    # The CLI's forms: 15/16/16/15 for a split, empty for "every layer"
    row["pipeline_split"] = "/".join(map(str, s.pipeline_split)) if s.pipeline_split else ""
    row["recompute_num_layers"] = "" if s.recompute_num_layers is None else s.recompute_num_layers
    return row


def _case_row_in_worker(work: tuple[TuneConfig, str]) -> dict[str, Any]:
    return case_row(*work)


# ---- the table ----------------------------------------------------------------------------------
def complete(rows: list[dict[str, Any]], sweep: SweepConfig) -> list[dict[str, Any]]:
    """The rows with what the table adds: prices, days and dollars for the token target, whether
    the deadline is met, and a note where a larger cluster is slower per device than the next
    smaller one of the same model, GPU type and batch (with the term of the step that grew)."""
    out = []
    for row in rows:
        row = {**dict.fromkeys(COLUMNS, ""), **row}
        row.update(dict.fromkeys(TABLE_COLUMNS, ""))
        gpu = row["gpu"]
        price = sweep.price_per_gpu_hour.get(gpu, sweep.price_per_gpu_hour.get("*"))
        if row["status"] == "ok":
            tps, n = float(row["tokens_per_s"]), int(row["n_gpus"])
            row["days_per_trillion_tokens"] = sig(1e12 / tps / 86400, 3)
            if price is not None:
                row["price_per_gpu_hour"] = price
                row["usd_per_million_tokens"] = sig(price * n / 3600 / tps * 1e6)
            if sweep.tokens is not None:
                days = sweep.tokens / tps / 86400
                row["days_for_tokens"] = sig(days, 3)
                if price is not None:
                    row["usd_for_tokens"] = sig(price * n * days * 24, 3)
                if sweep.deadline_days is not None:
                    row["meets_deadline"] = "yes" if days <= sweep.deadline_days else "no"
        out.append(row)
    _note_scaling(out)
    return out


def _note_scaling(rows: list[dict[str, Any]]) -> None:
    """Note a row slower per device than the next smaller swept cluster of its group by more
    than `SLOWER_PER_GPU` (or slower in total), naming the term whose share of the step grew
    most: capacity planning reads the table as monotone, and a row that is not must say why."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "ok":
            key = (r["model"], r["seq_len"], r["gpu"], r["global_batch_size"])
            groups.setdefault(key, []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: int(r["n_gpus"]))
        for small, big in itertools.pairwise(group):
            per_small = float(small["tokens_per_s"]) / int(small["n_gpus"])
            per_big = float(big["tokens_per_s"]) / int(big["n_gpus"])
            slower_total = float(big["tokens_per_s"]) < float(small["tokens_per_s"])
            if per_big >= per_small * (1 - SLOWER_PER_GPU) and not slower_total:
                continue
            before, after = json.loads(small["step_shares"]), json.loads(big["step_shares"])
            term = max(after, key=lambda k: after[k] - before.get(k, 0.0))
            what = (
                "slower in total" if slower_total else f"{per_big / per_small - 1:+.0%} per device"
            )
            big["note"] = (
                f"{what} than {small['n_gpus']} GPUs: {TIME_TERMS.get(term, term)} "
                f"{before.get(term, 0.0):.0%} -> {after[term]:.0%} of the step"
                + (
                    f" ({big['global_batch_size']} sequences over {big['n_gpus']} GPUs)"
                    if int(big["global_batch_size"]) < 2 * int(big["n_gpus"])
                    else ""
                )
            )


def capacity(rows: list[dict[str, Any]], sweep: SweepConfig) -> list[dict[str, Any]]:
    """For each model, GPU type and batch: the smallest swept cluster that meets the deadline
    (with --tokens and --deadline-days), the fastest, and the cheapest per token (with prices)."""
    answers = []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "ok":
            groups.setdefault((r["model"], r["gpu"], r["global_batch_size"]), []).append(r)
    for (model, gpu, gbs), group in groups.items():
        answer: dict[str, Any] = {"model": model, "gpu": gpu, "global_batch_size": gbs}
        fastest = max(group, key=lambda r: float(r["tokens_per_s"]))
        answer["fastest"] = fastest
        if sweep.deadline_days is not None:
            meets = [r for r in group if r["meets_deadline"] == "yes"]
            answer["smallest_in_time"] = min(meets, key=lambda r: int(r["n_gpus"]), default=None)
        if any(r["usd_per_million_tokens"] != "" for r in group):
            answer["cheapest"] = min(group, key=lambda r: float(r["usd_per_million_tokens"]))
        answers.append(answer)
    return answers


# ---- the run ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepResult:
    """What a sweep wrote: every row (in the combinations' order), the capacity answers, and
    where the CSV and the report are."""

    rows: list[dict[str, Any]]
    answers: list[dict[str, Any]]
    out: str
    report: str | None
    computed: int  # rows computed by this run (the others were in the CSV already)
    wall_s: float
    jobs: int


def sweep(
    config: SweepConfig,
    *,
    cases: list[Case] | None = None,
    log: Callable[[str], None] | None = None,
) -> SweepResult:
    """Run `config`: every combination's search (in parallel processes), the CSV, the report.

    Args:
        config: the sweep.
        cases: the combinations, when already planned (`plan_cases`; the CLI plans them with
            its own readers); default: planned here.
        log: where progress lines go (one per combination done); None: nowhere.

    Raises:
        SpecError: a bad input, or a CSV that cannot be written (the rows written before are
            kept, and the same call continues from them).
    """
    from autosearch.tuning._checks import check_output_file, check_path_length

    t0 = time.perf_counter()
    say = log or (lambda _line: None)
    out = config.out
    check_output_file(out)
    check_path_length(config.report_dir)
    _check_regular_output(out)
    cases = plan_cases(config) if cases is None else cases
    settings_digest = digest(config)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with _only_sweep_on(out):
        return _sweep_locked(config, cases, settings_digest, say, t0)


def _sweep_locked(
    config: SweepConfig,
    cases: list[Case],
    settings_digest: str,
    say: Callable[[str], None],
    t0: float,
) -> SweepResult:
    """`sweep`, with its CSV held by this process alone."""
    out = config.out
    _check_header(out)  # before anything changes the file: a file not ours stays as it is
    _drop_torn_last_line(out)
    kept = _rows_kept(out, settings_digest)
    todo = [c for c in cases if c.key not in kept]
    jobs = config.jobs or (os.cpu_count() or 1)
    jobs = max(1, min(jobs, len(todo)))
    say(
        f"sweep: {len(cases)} combinations ({len(cases) - len(todo)} already in {out}), "
        f"{jobs} at a time; each searched as `autosearch tune` searches it"
    )
    computed = _append_rows(out, todo, settings_digest, jobs=jobs, say=say)
    rows = _rows_of(out, [c.key for c in cases], settings_digest)
    rows = complete(rows, config)
    answers = capacity(rows, config)
    _rewrite(out, rows)
    report = None
    try:
        from autosearch.tuning._sweep_report import write_report

        report = write_report(rows, answers, config)
    except OSError as exc:  # the CSV is complete; only the report is lost
        say(f"note: the report was not written ({exc.strerror}); {out} holds every row")
    return SweepResult(
        rows=rows,
        answers=answers,
        out=out,
        report=report,
        computed=computed,
        wall_s=time.perf_counter() - t0,
        jobs=jobs,
    )


def _append_rows(
    out: str, todo: list[Case], settings_digest: str, *, jobs: int, say: Callable[[str], None]
) -> int:
    """Search every combination of `todo`, `jobs` at a time, appending each row as soon as it
    is done (flushed and synced to the disk); the number of rows written."""
    import multiprocessing

    from autosearch.core._files import DISK_HINTS

    if not todo:
        return 0
    new_file = not os.path.exists(out) or os.path.getsize(out) == 0
    written = 0
    pool = None
    if jobs > 1:  # spawned workers: nothing of this process (threads, locks) is inherited
        context = multiprocessing.get_context("spawn")
        pool = context.Pool(jobs, initializer=_worker_init)
    try:
        fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SpecError(f"cannot write --out {out!r}: {exc.strerror}") from None
    f = os.fdopen(fd, "wb")
    try:
        if new_file:
            _append_record(f, COLUMNS)
        for i, row in enumerate(_rows_as_done(todo, settings_digest, pool), 1):
            full = {**dict.fromkeys(COLUMNS, ""), **row}
            _append_record(f, [full[c] for c in COLUMNS])
            written += 1
            tps = f"{row['tokens_per_s']:,} tok/s " if row["tokens_per_s"] != "" else ""
            say(
                f"[{i}/{len(todo)}] {row['model']} {row['cluster']} gbs "
                f"{row['global_batch_size']}: {row['status']} {tps}"
                f"{row['strategy'] or _first_line(row['reason'])}"
                + (f" ({row['search_s']} s, {row['search']})" if row["search"] else "")
            )
    except OSError as exc:
        raise SpecError(
            f"cannot write --out {out!r}: {exc.strerror}"
            + DISK_HINTS.get(exc.errno or 0, "")
            + f"; the {written} rows written before are kept there, and the same "
            "command continues from them"
        ) from None
    finally:
        with contextlib.suppress(OSError):  # a flush that failed: said once, above
            f.close()
        if pool is not None:  # done, failed or interrupted: no search goes on behind
            pool.terminate()
            pool.join()
    return written


def _append_record(f, values: list[Any]) -> None:
    """One CSV record appended with a single write, then synced: a kill leaves the record
    whole or (at worst) a torn tail that `_drop_torn_last_line` drops, never half of one
    record glued to the next."""
    import io

    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(values)
    data = buffer.getvalue().encode("utf-8")
    while data:  # a regular file takes it in one write; a short write goes on from there
        data = data[os.write(f.fileno(), data) :]
    os.fsync(f.fileno())


@contextlib.contextmanager
def _only_sweep_on(out: str):
    """Hold an exclusive lock on the CSV (`flock` of the file itself, dropped by the kernel when
    this process ends, however it ends): two sweeps appending to one CSV would each compute the
    combinations the other has not written yet, and write them twice."""
    try:
        fd = os.open(out, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise SpecError(f"cannot write --out {out!r}: {exc.strerror}") from None
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        except BlockingIOError:
            raise SpecError(
                f"--out {out!r} is being written by another sweep now; wait for it to end (the "
                "same command then goes on from its rows), or give another --out"
            ) from None
        yield
    finally:
        os.close(fd)


def _rows_as_done(todo: list[Case], settings_digest: str, pool) -> Iterable[dict[str, Any]]:
    """Each combination's row as soon as its search ends (in this process when `pool` is
    None)."""
    if pool is None:
        for case in todo:
            yield case_row(case.config, settings_digest)
        return
    work = [(c.config, settings_digest) for c in todo]
    yield from pool.imap_unordered(_case_row_in_worker, work)


def _worker_init() -> None:
    """A worker leaves Ctrl-C to the sweep, which stops every worker at once (no traceback
    from each), and logs only Optuna's warnings."""
    import signal

    import optuna

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _first_line(text: str) -> str:
    return text.split(". ")[0][:160]


def _key_of(row: Mapping[str, Any]) -> tuple[str, int, str, int] | None:
    try:
        return (
            str(row["model"]),
            int(row["seq_len"]),
            str(row["cluster"]),
            int(row["global_batch_size"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def _read_rows(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except UnicodeDecodeError:
        raise SpecError(
            f"--out {path!r} is not a CSV this sweep wrote (it is not text); give another "
            "--out, or move the file away"
        ) from None


def _rows_kept(path: str, settings_digest: str) -> set[tuple]:
    """The keys of the rows already in the CSV; refused when they were computed with other
    shared settings (a row is what `tune` picks with the settings it was computed with)."""
    rows = _read_rows(path)
    other = {r.get("settings") for r in rows} - {settings_digest, None, ""}
    if other:
        raise SpecError(
            f"--out {path!r} holds rows computed with other tune settings (runtime, space, "
            "pins, seed, budget ...) than this sweep's; give another --out, or move the file "
            "away to start again"
        )
    return {k for k in map(_key_of, rows) if k is not None}


def _rows_of(path: str, keys: list[tuple], settings_digest: str) -> list[dict[str, Any]]:
    """The rows of the CSV, each key once (the last written wins): the rows of other sweeps
    into the same file first, in their order, then this sweep's in its combinations' order."""
    by_key: dict[tuple, dict[str, Any]] = {}
    for row in _read_rows(path):
        key = _key_of(row)
        if key is not None and row.get("settings") == settings_digest:
            by_key[key] = {c: row.get(c, "") for c in PICK_COLUMNS}
    ours = set(keys)
    return [r for k, r in by_key.items() if k not in ours] + [
        by_key[k] for k in keys if k in by_key
    ]


def _rewrite(path: str, rows: list[dict[str, Any]]) -> None:
    """The CSV again, whole and atomically: the rows in order, with the table's columns."""
    import io

    from autosearch.core._files import atomic_write

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    try:
        atomic_write(path, buffer.getvalue())
    except OSError as exc:
        raise SpecError(
            f"cannot write --out {path!r}: {exc.strerror}; every row is in it already, "
            "unsorted, and the same command writes it again"
        ) from None


def _check_regular_output(path: str) -> None:
    """The CSV is appended to and read back (the rows done): it must be a regular file or not
    exist yet. A device would be read forever (/dev/full, /dev/zero) or lose the rows
    (/dev/null); a FIFO would block."""
    from autosearch.core._io import file_kind

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


def _check_header(path: str) -> None:
    """Refuse to append to a file that is not a CSV of this version's columns (rows would
    misalign), or not text at all; nothing in it is changed."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb") as raw:
        data = raw.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"--out {path!r} is not a CSV this sweep wrote (byte {exc.start} is not UTF-8 "
            "text); give another --out, or move the file away"
        ) from None
    header = next(csv.reader(text.splitlines()[:1]), [])
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


def _drop_torn_last_line(path: str) -> None:
    """A sweep killed while writing a row leaves a record without its end: drop it. A record
    ends at a newline outside quotes (a reason may hold newlines inside its quotes), so the
    file is cut after the last such newline."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = pos = quotes = 0
        for line in data.split(b"\n")[:-1]:  # each piece that a newline ends
            pos += len(line) + 1
            quotes += line.count(b'"')  # a doubled quote inside a field counts twice
            if quotes % 2 == 0:
                end = pos
        if end != len(data):
            f.truncate(end)
