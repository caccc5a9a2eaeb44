"""What a search leaves in its folder: trials.csv, top_k.csv, best_strategy.yaml, study.yaml and
report.md with its plots (matplotlib, Agg backend).

Every file goes through `_files.atomic_write` (temporary name in the folder, fsync, rename), so a
run killed while writing never leaves a torn file; writers take the folder's lock (`.lock`,
opened without following a symbolic link), and remove what killed writers left behind.
One folder holds the outputs of one study: `claim_out_folder` refuses another study's folder.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import yaml

from autosearch.core._files import (
    FileLock,
    atomic_write,
    is_owned,
    mark_folder,
    own_folder,
    remove_stale_temp_files,
)
from autosearch.core.errors import SpecError
from autosearch.tuning._objectives import CONSTRAINT, GiB
from autosearch.tuning._reader import report_from_dict
from autosearch.tuning._result import scored

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.tuning._objectives import Objective
    from autosearch.tuning._result import Candidate, TuneResult


def _strategy_fields() -> tuple[str, ...]:
    """Every Strategy field, in its order (new dimensions become columns by themselves)."""
    import dataclasses

    from autosearch.core.strategy import Strategy

    return tuple(f.name for f in dataclasses.fields(Strategy))


STRATEGY_FIELDS = _strategy_fields()


def _report_columns() -> list[str]:
    from autosearch.core.report import CostReport, MemoryBreakdown, TimeBreakdown

    head = [k for k in CostReport._fields if k not in ("time", "memory", "notes")] + [
        "memory_excess_bytes"
    ]
    return (
        head
        + [f"time_{k}" for k in TimeBreakdown._fields]
        + [f"memory_{k}" for k in MemoryBreakdown._fields]
        + ["infeasible_reason", "notes"]
    )


def trial_row(trial, objective: "Objective") -> dict[str, Any]:
    """One CSV row: trial number and state, feasibility and why, objective values, every
    Strategy field, every CostReport field (breakdowns flattened to time_* / memory_*)."""
    from autosearch.core.strategy import Strategy

    row: dict[str, Any] = {"trial": trial.number, "state": trial.state.name}
    attrs = trial.user_attrs
    report = report_from_dict(attrs["report"]) if "report" in attrs else None
    row["feasible"] = bool(report.fits) if report is not None else False
    row["reason"] = (
        report.infeasible_reason if report is not None else attrs.get("error", "")
    ) or ""
    values = trial.values or [None] * len(objective.value_names)
    for name, value in zip(objective.value_names, values):
        row[f"objective_{name}"] = value
    row[CONSTRAINT] = trial.constraints.get(CONSTRAINT) if hasattr(trial, "constraints") else None
    strategy = Strategy.from_dict(attrs["strategy"]) if "strategy" in attrs else None
    row["strategy"] = strategy.short() if strategy else ""
    for f in STRATEGY_FIELDS:
        row[f] = getattr(strategy, f) if strategy else None
    flat = report.to_dict(flat=True) if report is not None else {}
    for col in _report_columns():
        row[col] = flat.get(col)
    row["strategies_scored"] = attrs.get("group_size", 1)
    row["worker"] = attrs.get("worker", "")
    return row


def columns(objective: "Objective") -> list[str]:
    return (
        ["trial", "state", "feasible", "reason"]
        + [f"objective_{n}" for n in objective.value_names]
        + [CONSTRAINT, "strategy"]
        + list(STRATEGY_FIELDS)
        + _report_columns()
        + ["strategies_scored", "worker"]
    )


def write_csv(path: str, rows: "Iterable[dict[str, Any]]", cols: list[str]) -> None:
    """Write `rows` (any iterable, consumed once: a study's rows are streamed, not held)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: _cell(row.get(k)) for k in cols})

    atomic_write(path, write)


def plot_row(trial) -> dict[str, Any] | None:
    """The few fields the plots need, straight from a trial's stored records."""
    report = trial.user_attrs.get("report")
    if not report or report.get("tokens_per_s") is None:
        return None
    row = {
        "peak_memory_bytes": report["peak_memory_bytes"],
        "tokens_per_s": report["tokens_per_s"],
        "memory_capacity_bytes": report.get("memory_capacity_bytes"),
        "feasible": bool(report.get("fits")),
    }
    if row["feasible"] and "strategy" in trial.user_attrs:
        row.update(trial.user_attrs["strategy"])
    return row


def write_outputs(
    result: "TuneResult", trials: list, *, out_dir: str, meta: dict[str, Any]
) -> None:
    """Write every output of a search into `out_dir` from one snapshot of its finished trials
    (call it holding `outputs_lock`)."""
    _make_folder(out_dir)
    objective = _objective_of(result)
    write_csv(
        os.path.join(out_dir, "trials.csv"),
        (trial_row(t, objective) for t in trials),
        columns(objective),
    )
    rows = [r for r in map(plot_row, trials) if r is not None]
    cand_cols = ["rank", "trial", "strategy"] + list(STRATEGY_FIELDS) + _report_columns()
    if result.price_per_gpu_hour is not None:
        cand_cols.append("usd_per_million_tokens")
    write_csv(os.path.join(out_dir, "top_k.csv"), _candidate_rows(result, result.top_k), cand_cols)
    if result.pareto:
        write_csv(
            os.path.join(out_dir, "pareto.csv"),
            _candidate_rows(result, result.pareto),
            cand_cols,
        )
    best_path = os.path.join(out_dir, "best_strategy.yaml")
    r = result.best_report
    if result.best_strategy is not None and r is not None:
        doc = {
            "strategy": result.best_strategy.to_dict(),
            "model": meta["model"],
            "cluster": meta["cluster"],
            "runtime": meta["runtime"],
            "objective": meta["objective"],
            "prediction": {
                "step_time_s": r.step_time_s,
                "tokens_per_s": r.tokens_per_s,
                "mfu": r.mfu,
                "tflops_per_gpu": r.tflops_per_gpu,
                "peak_memory_gib": r.peak_memory_bytes / GiB,
                "memory_capacity_gib": r.memory_capacity_bytes / GiB,
            },
        }
        header = (
            f"# The best strategy found by `autosearch tune` (study {meta['study_name']}).\n"
            "# Load it with Strategy.from_yaml(path); export it with\n"
            "# `autosearch export --strategy PATH`.\n"
        )
        atomic_write(best_path, header + yaml.safe_dump(doc, sort_keys=False))
    elif os.path.exists(best_path):
        os.remove(best_path)
    study_doc = {
        **meta,
        "case": result.case(),
        "n_trials": result.n_trials,
        "n_new_trials": result.n_new_trials,
        "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
        "summary": result.message,
        "coverage": result.plan,
    }
    atomic_write(os.path.join(out_dir, "study.yaml"), yaml.safe_dump(study_doc, sort_keys=False))
    _write_report(result, rows, trials, out_dir=out_dir, meta=meta)


def _candidate_rows(result: "TuneResult", cands) -> list[dict[str, Any]]:
    """Rows of top_k.csv and pareto.csv: rank, trial, strategy, its fields, its full report
    (and dollars per million tokens when a price was given)."""
    return [
        dict(
            rank=i + 1,
            trial=c.trial_number,
            strategy=c.strategy.short(),
            **c.strategy.to_dict(),
            **c.report.to_dict(flat=True),
            usd_per_million_tokens=result.usd_per_million_tokens(c.report),
        )
        for i, c in enumerate(cands)
    ]


def _objective_of(result: "TuneResult"):
    from autosearch.tuning._objectives import make_objective

    price = None
    if result.objective == "throughput-cost":
        price = 1.0  # only the value names are needed here
    return make_objective(result.objective, cluster=result.space.cluster, price_per_gpu_hour=price)


# ---- report.md and plots ------------------------------------------------------------------------
def dashboard_importances(trials: list, directions: list) -> list[dict[str, float]]:
    """Parameter importances of a stored study, one dict per objective, computed as
    optuna-dashboard computes them (``optuna_dashboard/_importance.py``, version 0.21):
    `optuna.importance.get_param_importances` with ``PedAnovaImportanceEvaluator()`` (PED-ANOVA,
    Watanabe et al. 2023: deterministic, no random seed) over the completed trials, fitting or
    not, with the target negated for an objective that is maximized, normalized to sum to 1.

    Args:
        trials: the study's trials (one snapshot; only the completed ones count).
        directions: the study's directions (`optuna.study.StudyDirection`).

    Returns:
        One ``{parameter: importance}`` per objective, most important first; empty dicts when
        fewer than two trials completed (the dashboard shows nothing then).
    """
    import warnings

    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    done = [t for t in trials if t.state == TrialState.COMPLETE]
    if len(done) <= 1:
        return [{} for _ in directions]
    # The snapshot as a study (the parameters, distributions and values the evaluator reads),
    # so the figures describe the same trials as trials.csv even while other workers add more.
    study = optuna.create_study(directions=list(directions))
    study.add_trials(
        [
            optuna.trial.create_trial(
                params=t.params, distributions=t.distributions, values=t.values
            )
            for t in done
        ]
    )
    out = []
    for i, direction in enumerate(directions):
        sign = -1.0 if direction == StudyDirection.MAXIMIZE else 1.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PED-ANOVA's notes on the target and few trials
            out.append(
                get_param_importances(
                    study,
                    target=_signed_value(i, sign),
                    evaluator=PedAnovaImportanceEvaluator(),
                )
            )
    return out


def _signed_value(i: int, sign: float) -> "Callable[[Any], float]":
    """The importance target of objective `i`, negated when it is maximized."""
    return lambda t: sign * t.values[i]


def _markdown_table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    """A markdown table: the header, its rule, one line per row."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _usd(result: "TuneResult", report) -> str:
    usd = result.usd_per_million_tokens(report)
    return f"${usd:,.3f}" if usd is not None else ""


def _write_report(
    result: "TuneResult",
    rows: list[dict[str, Any]],
    trials: list,
    *,
    out_dir: str,
    meta: dict[str, Any],
) -> None:
    plots: dict[str, str | None] = {}
    notes = []
    objective = _objective_of(result)
    importances: list[dict[str, float]] = []
    try:
        importances = dashboard_importances(trials, list(result.study.directions))
    except (ValueError, RuntimeError) as exc:
        notes.append(f"parameter importances failed: {exc}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        plots["time_breakdown"] = _plot_time_breakdown(result.top_k, out_dir)
        plots["throughput_memory"] = _plot_throughput_memory(rows, result, out_dir)
        plots["importances"] = _plot_importances(importances, objective, out_dir)
    except ImportError as exc:  # matplotlib is a dependency; keep the report if it is broken
        notes.append(f"plots skipped: {exc}")
    priced = result.price_per_gpu_hour is not None
    lines = [f"# Strategy search: {result.case()}", ""]
    lines += [
        f"- objective: {meta['objective']} (memory limit as a constraint), "
        f"sampler {meta['sampler']}, "
        f"trial unit {meta['trial_unit']}, cost model runtime {meta['runtime']}",
        f"- space: {meta['space']}",
        f"- search: {result.plan}",
        *(
            [
                f"- memory: a strategy fits when its predicted peak is at most the capacity "
                f"less {result.margin.fraction:.1%} ({result.margin.why})"
            ]
            if result.margin is not None
            else []
        ),
        *(
            ["- dimensions of the runtime (why each is searched or not):"]
            + [f"  - {o.name} {_values(o.values)}: {o.why}" for o in result.opened]
            if result.opened
            else []
        ),
        f"- trials: {result.n_trials} finished ({result.n_new_trials} in the last run); study "
        f"`{meta['study_name']}` in {meta['storage']}",
        *(
            [f"- price: ${result.price_per_gpu_hour:g} per device-hour"]
            if result.price_per_gpu_hour is not None
            else []
        ),
        "- ties: equal predicted values (to 12 digits) go to less peak memory, then bf16 before "
        "fp16 before fp32, then fewer parallel axes, then the earlier trial; a strategy scored "
        "twice is listed once",
        "",
    ]
    r = result.best_report
    if result.best_strategy is not None and r is not None:
        lines += [
            "## Best strategy",
            "",
            f"`{result.best_strategy.short()}`",
            "",
            *_markdown_table(
                ["step time", "tokens/s", "MFU", "TFLOP/s per GPU", "peak memory"]
                + (["$/M tokens"] if priced else []),
                [
                    [
                        f"{r.step_time_s:.3f} s",
                        f"{r.tokens_per_s:,.0f}",
                        f"{r.mfu:.1%}",
                        f"{r.tflops_per_gpu:.1f}",
                        f"{r.peak_memory_bytes / GiB:.1f} of "
                        f"{r.memory_usable_bytes / GiB:.1f} GiB usable "
                        f"({r.memory_capacity_bytes / GiB:.1f} less a "
                        f"{r.memory_margin_bytes / GiB:.1f} GiB margin)",
                    ]
                    + ([_usd(result, r)] if priced else [])
                ],
            ),
            "",
            f"How sure: {r.band.describe(r.step_time_s) if r.band else 'no error band'}.",
            "",
            *(
                [
                    "Ranked by the pessimistic end of each strategy's band (objective "
                    "throughput-pessimistic): the throughput if the run is as slow as 95% of "
                    "the published and measured runs of its kind allow; kinds without evidence "
                    "are taken at the worst band known.",
                    "",
                ]
                if meta["objective"] == "throughput-pessimistic"
                else []
            ),
            "Saved in `best_strategy.yaml`; "
            "`autosearch export --strategy best_strategy.yaml --to megatron` "
            "prints the equivalent launch flags.",
            "",
        ]
    else:
        lines += ["## No strategy fits", "", result.message, ""]
        least = scored([result.least_hungry] if result.least_hungry else [])
        for c, r in least:
            lines += [
                f"Least memory-hungry strategy tried: `{c.strategy.short()}`, "
                f"{r.infeasible_reason}.",
                "",
            ]
    if result.top_k:
        lines += [f"## Top {len(result.top_k)} (`top_k.csv`)", ""]
        header = ["#", "strategy", "tokens/s", "MFU", "step s", "memory GiB", "bubble s"]
        header += ["dp comm s", "tp comm s"] + (["$/M tokens"] if priced else [])
        table = [
            [
                str(i),
                f"`{c.strategy.short()}`",
                f"{r.tokens_per_s:,.0f}",
                f"{r.mfu:.1%}",
                f"{r.step_time_s:.3f}",
                f"{r.peak_memory_bytes / GiB:.1f}",
                f"{r.time.bubble_s:.3f}",
                f"{r.time.dp_comm_exposed_s:.3f}",
                f"{r.time.tp_comm_s:.3f}",
            ]
            + ([_usd(result, r)] if priced else [])
            for i, (c, r) in enumerate(scored(result.top_k), 1)
        ]
        lines += [*_markdown_table(header, table), ""]
    if result.pareto:
        lines += _pareto_section(result, objective, has_plot=bool(plots.get("throughput_memory")))
    titles = {
        "time_breakdown": "Where the step time goes (top-k)",
        "throughput_memory": "Throughput vs memory",
    }
    for key in ("time_breakdown", "throughput_memory"):
        path = plots.get(key)
        if path:
            lines += [f"## {titles[key]}", "", f"![{key}]({os.path.basename(path)})", ""]
            if key == "throughput_memory":
                lines += [_THROUGHPUT_MEMORY_LEGEND, ""]
    lines += _importance_section(importances, objective, plots.get("importances"), trials, meta)
    lines += [f"_Note: {n}_" for n in notes]
    lines += [
        "",
        "Files: `trials.csv` (every trial: strategy, full cost report, feasibility), `top_k.csv`, "
        + ("`pareto.csv`, " if result.pareto else "")
        + "`best_strategy.yaml`, `study.yaml` (run metadata).",
        "",
    ]
    atomic_write(os.path.join(out_dir, "report.md"), "\n".join(lines))


_THROUGHPUT_MEMORY_LEGEND = (
    "Each trial's kept strategy: blue dots fit, grey crosses do not; the red dashed line is the "
    "device memory and the shaded region beyond it does not fit. The axes show the strategies "
    "that fit (with room around them); trials farther out are counted in the legend, not drawn."
)


def _pareto_section(result: "TuneResult", objective: "Objective", *, has_plot: bool) -> list:
    priced = result.price_per_gpu_hour is not None
    names = " and ".join(objective.value_names)
    lines = [
        f"## Pareto front ({len(result.pareto)} "
        f"strateg{'y' if len(result.pareto) == 1 else 'ies'}, `pareto.csv`)",
        "",
        f"The strategies that fit and that no other strategy that fits beats on both {names}, "
        "fastest first"
        + (" (marked as orange diamonds in the throughput vs memory plot)." if has_plot else ".")
        + (
            " On one cluster dollars per token fall as tokens/s rise, so this front is the "
            "fastest strategy (and its ties); compare cluster sizes with `autosearch sweep "
            "--price-per-gpu-hour`."
            if objective.name == "throughput-cost"
            else ""
        ),
        "",
    ]
    header = ["#", "strategy", "tokens/s", "peak memory GiB", "MFU"]
    rows = [
        [
            str(i),
            f"`{c.strategy.short()}`",
            f"{r.tokens_per_s:,.0f}",
            f"{r.peak_memory_bytes / GiB:.1f}",
            f"{r.mfu:.1%}",
        ]
        + ([_usd(result, r)] if priced else [])
        for i, (c, r) in enumerate(scored(result.pareto), 1)
    ]
    lines += _markdown_table(header + (["$/M tokens"] if priced else []), rows)
    return lines + [""]


def _importance_section(
    importances: list[dict[str, float]],
    objective: "Objective",
    plot: str | None,
    trials: list,
    meta: dict[str, Any],
) -> list:
    from optuna.trial import TrialState

    if not any(importances):
        return [
            "## What matters (parameter importances)",
            "",
            "Not computed: parameter importances need at least two completed trials.",
            "",
        ]
    n_done = sum(t.state == TrialState.COMPLETE for t in trials)
    names = list(importances[0])
    storage = meta.get("storage", "")
    lines = [
        "## What matters (parameter importances)",
        "",
        f"How much each parameter decides whether a trial is among the best 10% of the {n_done} "
        "completed trials (fitting or not), as optuna-dashboard computes it: "
        "`optuna.importance.get_param_importances(study, "
        "evaluator=PedAnovaImportanceEvaluator(), target=...)` (PED-ANOVA, Watanabe et al. "
        "2023; deterministic, no random seed), normalized to sum to 1 per objective. "
        f"`optuna-dashboard {_dashboard_target(storage)}` shows the same figures.",
        "",
        *_markdown_table(
            ["parameter", *objective.value_names],
            [[name, *(f"{imp.get(name, 0.0):.4f}" for imp in importances)] for name in names],
        ),
        "",
    ]
    if plot:
        lines += [f"![importances]({os.path.basename(plot)})", ""]
    return lines


def _dashboard_target(storage_description: str) -> str:
    """What optuna-dashboard takes for this study's storage, from its description (a journal
    file by path, SQLite as ``sqlite:///PATH``, a database by its URL; the password is never
    in the description)."""
    text = storage_description.strip()
    if "://" in text:
        return text
    if text.endswith((".db", ".sqlite", ".sqlite3")):
        return f"sqlite:///{text}"
    return text or "STORAGE"


def _plot_time_breakdown(top_k: tuple["Candidate", ...], out_dir: str) -> str | None:
    if not top_k:
        return None
    import matplotlib.pyplot as plt

    pairs = scored(top_k)
    terms = list(pairs[0][1].time._fields)
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(pairs) + 1.8))
    labels = [c.strategy.short() for c, _ in pairs][::-1]
    left = [0.0] * len(pairs)
    for term in terms:
        widths = [getattr(r.time, term) for _, r in pairs][::-1]
        if not any(widths):
            continue
        ax.barh(labels, widths, left=left, label=term[:-2])
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds per optimizer step")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return _save(fig, out_dir, "time_breakdown.png")


def plot_limits(
    points: list[tuple[float, float, bool]], capacity_gib: float | None
) -> tuple[float, float]:
    """Upper limits (memory GiB, tokens/s) of the throughput vs memory plot: the points that
    fit, the device memory, and room around them (x 1.5 in memory, x 1.15 in throughput), so a
    few infeasible outliers (a strategy needing 10x the memory, or its throughput) cannot
    squash what fits. With nothing that fits, every point."""
    ok = [(m, t) for m, t, f in points if f]
    ref = ok or [(m, t) for m, t, _ in points]
    mem = max([m for m, _ in ref] + ([capacity_gib] if capacity_gib else []))
    tps = max(t for _, t in ref)
    if not ok:
        return mem * 1.05, tps * 1.05
    return mem * 1.5, tps * 1.15


def _plot_throughput_memory(
    rows: list[dict[str, Any]], result: "TuneResult", out_dir: str
) -> str | None:
    pts = [
        (r["peak_memory_bytes"] / GiB, r["tokens_per_s"], r["feasible"])
        for r in rows
        if r.get("tokens_per_s") is not None
    ]
    if not pts:
        return None
    import matplotlib.pyplot as plt

    cap_bytes = rows[0].get("memory_capacity_bytes") if rows else None
    cap = cap_bytes / GiB if cap_bytes else None
    # what fits is decided within the capacity less the margin: the line is drawn there
    held = result.margin.fraction if result.margin is not None else 0.0
    usable = cap * (1 - held) if cap else None
    x_hi, y_hi = plot_limits(pts, cap)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ok = [(m, t) for m, t, f in pts if f]
    bad = [(m, t) for m, t, f in pts if not f and m <= x_hi and t <= y_hi]
    outside = sum(1 for m, t, f in pts if not f and (m > x_hi or t > y_hi))
    if cap and usable:
        ax.axvspan(usable, max(x_hi, cap) * 1.01, color="0.92", zorder=0)
        ax.axvline(
            usable,
            c="tab:red",
            ls="--",
            lw=1,
            label=f"usable ({usable:.1f} GiB: {cap:.0f} GiB less a {held:.1%} margin)"
            if held
            else f"device memory ({cap:.0f} GiB)",
        )
        if held:
            ax.axvline(cap, c="tab:red", ls=":", lw=0.8)
    if bad or outside:
        label = "does not fit" + (f" ({outside} beyond the axes)" if outside else "")
        xs, ys = zip(*bad) if bad else ((), ())
        ax.scatter(xs, ys, s=14, c="grey", marker="x", label=label)
    if ok:
        xs, ys = zip(*ok)
        ax.scatter(xs, ys, s=12, c="tab:blue", label="fits")
    if result.pareto:
        front = sorted(
            (r.peak_memory_bytes / GiB, r.tokens_per_s) for _, r in scored(result.pareto)
        )
        ax.plot(
            *zip(*front),
            c="tab:orange",
            marker="D",
            ms=5,
            label=f"Pareto front ({len(front)}, pareto.csv)",
            zorder=4,
        )
    elif ok:
        front, best_t = [], -math.inf
        for m, t in sorted(ok, key=lambda p: (p[0], -p[1])):  # more throughput for more memory
            if t > best_t:
                front.append((m, t))
                best_t = t
        ax.plot(*zip(*front), c="tab:orange", lw=1, label="fastest for its memory")
    if result.best_report is not None:
        ax.scatter(
            [result.best_report.peak_memory_bytes / GiB],
            [result.best_report.tokens_per_s],
            marker="*",
            s=160,
            c="tab:green",
            label="best",
            zorder=5,
        )
    ax.set_xlim(0, x_hi)
    ax.set_ylim(0, y_hi)
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("tokens per second")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return _save(fig, out_dir, "throughput_memory.png")


def _plot_importances(
    importances: list[dict[str, float]], objective: "Objective", out_dir: str
) -> str | None:
    """The importances of the first objective (those of report.md and optuna-dashboard)."""
    if not importances or not importances[0]:
        return None
    import matplotlib.pyplot as plt

    first = importances[0]
    names = list(first)[::-1]
    fig, ax = plt.subplots(figsize=(7.5, 0.35 * len(names) + 1.2))
    ax.barh(names, [first[n] for n in names], color="tab:purple")
    ax.set_xlabel(
        f"importance for {objective.value_names[0]} (PED-ANOVA, as optuna-dashboard computes it)"
    )
    fig.tight_layout()
    return _save(fig, out_dir, "importances.png")


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return path


STUDY_FILE = "study.yaml"
LOCK_FILE = ".lock"
# `name.tmp<pid>`: temporary names of earlier versions and of the exports written next to ours
_OTHER_TEMP = re.compile(r".+\.tmp(\d+)(\.png)?$")


@contextlib.contextmanager
def outputs_lock(out_dir: str):
    """An exclusive lock on `out_dir` (``.lock``, flock, never through a symbolic link) while one
    worker writes the outputs; temporary files of killed writers are removed under it."""
    _make_folder(out_dir)
    with FileLock(os.path.join(out_dir, LOCK_FILE)):
        remove_stale_temp_files(out_dir, extra=_OTHER_TEMP)
        yield


def claim_out_folder(out_dir: str, *, study_name: str, storage: str) -> None:
    """Refuse to write one study's outputs over another's (told apart by the study name; a
    study's storage refuses a search it was not made for on its own), or over the user's files:
    the folder must be new, empty, or autosearch's (`own_folder`); it is created and marked.

    Raises:
        SpecError: `out_dir` holds the outputs of a study with another name, or files that
            autosearch did not write; the message says what to do.
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SpecError(f"--out {out_dir!r} is a file; give a folder")
    path = os.path.join(out_dir, STUDY_FILE)
    doc = None
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            doc = None  # unreadable outputs: rewritten by this study
    theirs = doc.get("study_name") if isinstance(doc, dict) else None
    if isinstance(doc, dict) and theirs is not None and theirs != study_name:
        raise SpecError(
            f"{out_dir!r} holds the outputs of study {theirs!r} (storage "
            f"{doc.get('storage')}), not of {study_name!r} ({storage}); outputs of different "
            f"studies never share a folder. Pass another --out (for example "
            f"results/{study_name}), or --study-name {theirs} to continue that study"
        )
    # A folder of the user's files is never written into (nor is anything there removed).
    # (checked now; a folder that does not exist yet is made and marked with the first outputs;
    # one holding only a journal is a study whose first run was killed before its outputs)
    own_folder(
        out_dir,
        kind="study",
        what=f"--out {out_dir!r}",
        accept=(STUDY_FILE, "study.journal", *_storage_names(out_dir, storage)),
        create=False,
    )


def _storage_names(out_dir: str, storage: str) -> tuple[str, ...]:
    """The names a study's storage file (journal or SQLite) and its lock have in `out_dir`, when
    it is there (a folder holding them is the study's, whose first run ended before outputs)."""
    if "://" in storage or os.path.dirname(os.path.abspath(storage)) != os.path.abspath(out_dir):
        return ()
    name = os.path.basename(storage)
    return (name, f"{name}.lock", f"{name}.flock")


def _make_folder(out_dir: str) -> None:
    """Create the output folder (claimed by `claim_out_folder` before the search) and mark it as
    autosearch's."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except FileExistsError:
        raise SpecError(f"--out {out_dir!r}: a file is in the way of this folder") from None
    except OSError as exc:
        raise SpecError(f"cannot create the output folder {out_dir!r}: {exc.strerror}") from None
    if not is_owned(out_dir):
        mark_folder(out_dir, kind="study", what=f"--out {out_dir!r}")


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ""
    if value is None:
        return ""
    return value


def _values(values: Any) -> str:
    if values is None:
        return "all"
    if isinstance(values, bool):
        return str(values).lower()
    return "[" + ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values) + "]"
