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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import yaml

from autosearch.core.errors import SpecError
from autosearch.tuning._files import FileLock, atomic_write, remove_stale_temp_files
from autosearch.tuning._objectives import CONSTRAINT, GiB
from autosearch.tuning._reader import report_from_dict

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.tuning._objectives import Objective
    from autosearch.tuning._result import Candidate, TuneResult


def _strategy_fields() -> tuple[str, ...]:
    """Every Strategy field, in its order (new dimensions become columns by themselves)."""
    import dataclasses

    from autosearch.core.strategy import Strategy

    return tuple(f.name for f in dataclasses.fields(Strategy))


STRATEGY_FIELDS = _strategy_fields()
IMPORTANCE_MAX_TRIALS = 5000
# The dimensions whose importance report.md plots: the Strategy fields, with the pipeline
# schedule and its virtual stages as one ("pipeline"), and without what every strategy shares.
IMPORTANCE_FIELDS = tuple(
    "pipeline" if f == "pipeline_schedule" else f
    for f in STRATEGY_FIELDS
    if f not in ("global_batch_size", "virtual_stages")
)


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
    top_rows = [
        dict(
            rank=i + 1,
            trial=c.trial_number,
            strategy=c.strategy.short(),
            **c.strategy.to_dict(),
            **c.report.to_dict(flat=True),
        )
        for i, c in enumerate(result.top_k)
    ]
    write_csv(
        os.path.join(out_dir, "top_k.csv"),
        top_rows,
        ["rank", "trial", "strategy"] + list(STRATEGY_FIELDS) + _report_columns(),
    )
    if result.pareto:
        pareto_rows = [
            dict(
                rank=i + 1,
                trial=c.trial_number,
                strategy=c.strategy.short(),
                **c.strategy.to_dict(),
                **c.report.to_dict(flat=True),
            )
            for i, c in enumerate(result.pareto)
        ]
        write_csv(
            os.path.join(out_dir, "pareto.csv"),
            pareto_rows,
            ["rank", "trial", "strategy"] + list(STRATEGY_FIELDS) + _report_columns(),
        )
    best_path = os.path.join(out_dir, "best_strategy.yaml")
    if result.best_strategy is not None:
        r = result.best_report
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
        "n_trials": result.n_trials,
        "n_new_trials": result.n_new_trials,
        "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
        "summary": result.message,
        "coverage": result.plan,
    }
    atomic_write(os.path.join(out_dir, "study.yaml"), yaml.safe_dump(study_doc, sort_keys=False))
    _write_report(result, rows, out_dir=out_dir, meta=meta)


def _objective_of(result: "TuneResult"):
    from autosearch.tuning._objectives import make_objective

    price = None
    if result.objective == "throughput-cost":
        price = 1.0  # only the value names are needed here
    return make_objective(result.objective, cluster=result.space.cluster, price_per_gpu_hour=price)


# ---- report.md and plots ------------------------------------------------------------------------
def _write_report(
    result: "TuneResult", rows: list[dict[str, Any]], *, out_dir: str, meta: dict[str, Any]
) -> None:
    plots = {}
    notes = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        plots["time_breakdown"] = _plot_time_breakdown(result.top_k, out_dir)
        plots["throughput_memory"] = _plot_throughput_memory(rows, result, out_dir)
        imp_path, imp_note = _plot_importances(rows, out_dir)
        plots["importances"] = imp_path
        if imp_note:
            notes.append(imp_note)
    except ImportError as exc:  # matplotlib is a dependency; keep the report if it is broken
        notes.append(f"plots skipped: {exc}")
    lines = [
        f"# Strategy search: {meta['model']} on {meta['cluster']}, "
        f"global batch {meta['global_batch_size']}",
        "",
    ]
    lines += [
        f"- objective: {meta['objective']} (memory limit as a constraint), "
        f"sampler {meta['sampler']}, "
        f"trial unit {meta['trial_unit']}, cost model runtime {meta['runtime']}",
        f"- space: {meta['space']}",
        f"- search: {result.plan}",
        f"- trials: {result.n_trials} finished ({result.n_new_trials} in the last run); study "
        f"`{meta['study_name']}` in {meta['storage']}",
        "",
    ]
    if result.best_strategy is not None:
        r = result.best_report
        lines += [
            "## Best strategy",
            "",
            f"`{result.best_strategy.short()}`",
            "",
            "| step time | tokens/s | MFU | TFLOP/s per GPU | peak memory |",
            "|---|---|---|---|---|",
            f"| {r.step_time_s:.3f} s | {r.tokens_per_s:,.0f} | {r.mfu:.1%} | "
            f"{r.tflops_per_gpu:.1f} | "
            f"{r.peak_memory_bytes / GiB:.1f} of {r.memory_capacity_bytes / GiB:.1f} GiB |",
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
        if result.least_hungry is not None:
            c = result.least_hungry
            lines += [
                f"Least memory-hungry strategy tried: `{c.strategy.short()}`, "
                f"{c.report.infeasible_reason}.",
                "",
            ]
    if result.top_k:
        lines += [
            f"## Top {len(result.top_k)}",
            "",
            "| # | strategy | tokens/s | MFU | step s | memory GiB | bubble s | "
            "dp comm s | tp comm s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for i, c in enumerate(result.top_k, 1):
            r = c.report
            lines.append(
                f"| {i} | `{c.strategy.short()}` | {r.tokens_per_s:,.0f} | {r.mfu:.1%} | "
                f"{r.step_time_s:.3f} | {r.peak_memory_bytes / GiB:.1f} | "
                f"{r.time.bubble_s:.3f} | {r.time.dp_comm_exposed_s:.3f} | "
                f"{r.time.tp_comm_s:.3f} |"
            )
        lines.append("")
    if result.pareto:
        lines += [f"## Pareto front ({len(result.pareto)} strategies, `pareto.csv`)", ""]
    titles = {
        "time_breakdown": "Where the step time goes (top-k)",
        "throughput_memory": "Throughput vs memory",
        "importances": (
            "What matters (importance of each dimension for throughput, trials that fit)"
        ),
    }
    for key, path in plots.items():
        if path:
            lines += [f"## {titles[key]}", "", f"![{key}]({os.path.basename(path)})", ""]
    lines += [f"_Note: {n}_" for n in notes]
    lines += [
        "",
        "Files: `trials.csv` (every trial: strategy, full cost report, feasibility), `top_k.csv`, "
        "`best_strategy.yaml`, `study.yaml` (run metadata).",
        "",
    ]
    atomic_write(os.path.join(out_dir, "report.md"), "\n".join(lines))


def _plot_time_breakdown(top_k: tuple["Candidate", ...], out_dir: str) -> str | None:
    if not top_k:
        return None
    import matplotlib.pyplot as plt

    terms = list(top_k[0].report.time._fields)
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(top_k) + 1.8))
    labels = [c.strategy.short() for c in top_k][::-1]
    left = [0.0] * len(top_k)
    for term in terms:
        widths = [getattr(c.report.time, term) for c in top_k][::-1]
        if not any(widths):
            continue
        ax.barh(labels, widths, left=left, label=term[:-2])
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds per optimizer step")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return _save(fig, out_dir, "time_breakdown.png")


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

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [(m, t) for m, t, f in pts if f]
    bad = [(m, t) for m, t, f in pts if not f]
    if bad:
        ax.scatter(*zip(*bad), s=10, c="lightgray", label="does not fit")
    if ok:
        ax.scatter(*zip(*ok), s=12, c="tab:blue", label="fits")
        front, best_t = [], -math.inf
        for m, t in sorted(ok, key=lambda p: (p[0], -p[1])):  # more throughput for more memory
            if t > best_t:
                front.append((m, t))
                best_t = t
        ax.plot(*zip(*front), c="tab:orange", marker="o", ms=4, label="Pareto front")
    cap = rows[0].get("memory_capacity_bytes") if rows else None
    if cap:
        ax.axvline(cap / GiB, c="tab:red", ls="--", lw=1, label="device memory")
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
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("tokens per second")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out_dir, "throughput_memory.png")


def _plot_importances(rows: list[dict[str, Any]], out_dir: str) -> tuple[str | None, str | None]:
    """fANOVA importance of each Strategy dimension for throughput, over the trials that fit.

    The sampler's own parameters are conditional (their names carry their choice lists), so the
    importance is computed on a throw-away in-memory study whose parameters are the Strategy
    fields themselves, each a categorical over the values seen."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    from search_spaces import pipeline_label

    ok = [r for r in rows if r["feasible"] and r.get("tokens_per_s")]
    if len(ok) < 4:
        return None, "parameter importances need at least 4 trials that fit"
    note = None
    if len(ok) > IMPORTANCE_MAX_TRIALS:  # fANOVA's forest grows with the trials: subsample
        stride = math.ceil(len(ok) / IMPORTANCE_MAX_TRIALS)
        note = (
            f"parameter importances from every {stride}th of the {len(ok):,} trials that fit "
            f"({len(ok[::stride]):,} trials)"
        )
        ok = ok[::stride]
    values = {f: [] for f in IMPORTANCE_FIELDS}
    for r in ok:
        for f in IMPORTANCE_FIELDS:
            v = (
                pipeline_label(r["pipeline_schedule"], r["virtual_stages"])
                if f == "pipeline"
                else r.get(f)
            )
            values[f].append(str(v))
    fields = [f for f in IMPORTANCE_FIELDS if len(set(values[f])) > 1]
    if not fields:
        return None, "every trial that fits has the same strategy; no importance to show"
    dists = {f: CategoricalDistribution(sorted(set(values[f]))) for f in fields}
    study = optuna.create_study(direction="maximize")
    study.add_trials(
        [
            optuna.trial.create_trial(
                params={f: values[f][i] for f in fields},
                distributions=dists,
                value=r["tokens_per_s"],
            )
            for i, r in enumerate(ok)
        ]
    )
    try:
        importances = optuna.importance.get_param_importances(
            study, evaluator=_importance_evaluator()
        )
    except (ValueError, RuntimeError, ImportError) as exc:
        return None, f"parameter importances failed: {exc}"
    import matplotlib.pyplot as plt

    names = list(importances)[::-1]
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(names) + 1.2))
    ax.barh(names, [importances[n] for n in names], color="tab:purple")
    method = type(_importance_evaluator()).__name__.replace("ImportanceEvaluator", "")
    ax.set_xlabel(f"importance for tokens/s ({method}, trials that fit)")
    fig.tight_layout()
    return _save(fig, out_dir, "importances.png"), note


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
    study's storage refuses a search it was not made for on its own).

    Raises:
        SpecError: `out_dir` holds the outputs of a study with another name; the
            message says how to continue that one or where to put this one.
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SpecError(f"--out {out_dir!r} is a file; give a folder")
    path = os.path.join(out_dir, STUDY_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return  # no (readable) outputs yet
    if not isinstance(doc, dict):
        return
    theirs = doc.get("study_name")
    if theirs is not None and theirs != study_name:
        raise SpecError(
            f"{out_dir!r} holds the outputs of study {theirs!r} (storage "
            f"{doc.get('storage')}), not of {study_name!r} ({storage}); outputs of different "
            f"studies never share a folder. Pass another --out (for example "
            f"results/{study_name}), or --study-name {theirs} to continue that study"
        )


def _make_folder(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
    except FileExistsError:
        raise SpecError(f"--out {out_dir!r}: a file is in the way of this folder") from None
    except OSError as exc:
        raise SpecError(f"cannot create the output folder {out_dir!r}: {exc.strerror}") from None


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ""
    if value is None:
        return ""
    return value


def _importance_evaluator():
    """fANOVA (Hutter et al. 2014) when scikit-learn is installed, else PED-ANOVA (Watanabe et al.
    2023), which Optuna implements with numpy and scipy alone."""
    import optuna

    try:
        import sklearn  # noqa: F401
    except ImportError:
        return optuna.importance.PedAnovaImportanceEvaluator()
    return optuna.importance.FanovaImportanceEvaluator(seed=0)
