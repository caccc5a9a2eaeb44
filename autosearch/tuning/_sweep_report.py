"""A sweep's report: report.md with the capacity answers, the table and two plots (matplotlib,
Agg backend): tokens/s per device and dollars per million tokens against the cluster size, one
panel per GPU type, a line per model and batch, with the 90% band where the error bands have runs
of that kind."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.tuning._sweep import SweepConfig

SHOWN = (  # the report's table: what a planner reads first
    ("model", "model"),
    ("seq_len", "seq"),
    ("cluster", "cluster"),
    ("global_batch_size", "batch"),
    ("strategy", "strategy"),
    ("tokens_per_s", "tokens/s"),
    ("tokens_per_s_per_gpu", "per GPU"),
    ("mfu", "MFU"),
    ("peak_memory_gib", "GiB"),
    ("usd_per_million_tokens", "$/M tok"),
    ("days_for_tokens", "days"),
    ("note", "note"),
)


def write_report(rows: list[dict[str, Any]], answers: list[dict[str, Any]], sweep: "SweepConfig"):
    """Write ``<stem>_report/report.md`` and its plots; the report's path."""
    from autosearch.core._files import atomic_write

    folder = sweep.report_dir
    os.makedirs(folder, exist_ok=True)
    ok = [r for r in rows if r["status"] == "ok"]
    plots = [
        _plot(ok, folder, "tokens_per_gpu.png", _per_gpu, "tokens/s per device", band=True),
        _plot(ok, folder, "usd_per_million_tokens.png", _usd, "$ per million tokens", band=True),
    ]
    models = sorted(
        {(r["model"], r["params_b"], r["active_params_b"], r["seq_len"]) for r in rows}
    )
    lines = [
        "# Sweep: "
        + ", ".join(
            f"{m} ({p} B" + (f", {a} B active" if a else "") + f", seq {int(s):,})"
            for m, p, a, s in models
        ),
        "",
        f"{len(rows)} combinations, {len(ok)} with a strategy that fits; each row is what "
        "`autosearch tune` picks for that case (the same search, budget and seed). "
        + (f"Tokens to train: {sweep.tokens:,.0f}. " if sweep.tokens else "")
        + (f"Deadline: {sweep.deadline_days:g} days. " if sweep.deadline_days else "")
        + (_prices(sweep) if sweep.price_per_gpu_hour else "No prices given."),
        "",
        "## Capacity",
        "",
        *(f"- {line}" for line in capacity_lines(answers, sweep)),
        "",
        "## Plots",
        "",
        *(f"![{name}]({name})" for name in plots if name),
        "",
        "Shaded: the 90% band of the prediction, from published and measured runs of the same "
        "kind; a line without one is an extrapolation (no run of its runtime and hardware).",
        "",
        "## Table",
        "",
        "| " + " | ".join(title for _, title in SHOWN) + " |",
        "|" + "---|" * len(SHOWN),
        *("| " + " | ".join(_cell(r, key) for key, _ in SHOWN) + " |" for r in rows),
        "",
    ]
    path = os.path.join(folder, "report.md")
    atomic_write(path, "\n".join(lines))
    return path


def capacity_lines(answers: list[dict[str, Any]], sweep: SweepConfig) -> list[str]:
    lines = []
    for a in answers:
        head = f"{a['model']} on {a['gpu']}, batch {a['global_batch_size']}:"
        parts = []
        if "smallest_in_time" in a:
            r = a["smallest_in_time"]
            parts.append(
                f"smallest in {sweep.deadline_days:g} days: "
                + (
                    f"{r['cluster']} ({r['days_for_tokens']} days"
                    + (f", ${float(r['usd_for_tokens']):,.0f}" if r["usd_for_tokens"] else "")
                    + ")"
                    if r is not None
                    else "none of the swept clusters"
                )
            )
        if "cheapest" in a:
            r = a["cheapest"]
            parts.append(
                f"cheapest {r['cluster']} (${r['usd_per_million_tokens']}/M tokens"
                + (f", ${float(r['usd_for_tokens']):,.0f} in all" if r["usd_for_tokens"] else "")
                + ")"
            )
        r = a["fastest"]
        parts.append(f"fastest {r['cluster']} ({float(r['tokens_per_s']):,.0f} tokens/s)")
        lines.append(f"{head} " + "; ".join(parts))
    return lines


def _prices(sweep: "SweepConfig") -> str:
    prices = sweep.price_per_gpu_hour
    if set(prices) == {"*"}:
        return f"Price: ${prices['*']:g} per device-hour."
    return "Prices per device-hour: " + ", ".join(f"{g} ${p:g}" for g, p in prices.items()) + "."


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key, "")
    if key == "strategy" and not value:
        return f"{row['status']}: {str(row['reason'])[:80]}"
    if key in ("tokens_per_s", "tokens_per_s_per_gpu") and value != "":
        return f"{float(value):,.0f}"
    if key == "mfu" and value != "":
        return f"{float(value):.1%}"
    return str(value).replace("|", "/")


def _per_gpu(row: dict[str, Any], value: str) -> float:
    return float(row[value]) / int(row["n_gpus"])


def _usd(row: dict[str, Any], value: str) -> float | None:
    if row["price_per_gpu_hour"] == "" or row[value] in ("", "0"):
        return None
    return float(row["price_per_gpu_hour"]) * int(row["n_gpus"]) / 3600 / float(row[value]) * 1e6


def _plot(rows, folder: str, name: str, y_of, ylabel: str, *, band: bool) -> str | None:
    """A panel per model (rows) and GPU type (columns), sharing the model's y axis: y against
    devices, a line per global batch; the band shaded; '!' where the table has a note."""
    from autosearch.core._files import atomic_write

    if not rows or y_of(rows[0], "tokens_per_s") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    gpus = sorted({r["gpu"] for r in rows})
    fig, axes = plt.subplots(
        len(models),
        len(gpus),
        figsize=(4.6 * len(gpus), 3.2 * len(models)),
        squeeze=False,
        sharey="row",
    )
    for i, model in enumerate(models):
        for j, gpu in enumerate(gpus):
            ax = axes[i][j]
            lines: dict[str, list[dict[str, Any]]] = {}
            for r in rows:
                if r["gpu"] == gpu and r["model"] == model:
                    lines.setdefault(str(r["global_batch_size"]), []).append(r)
            for gbs, group in sorted(lines.items(), key=lambda kv: int(kv[0])):
                group.sort(key=lambda r: int(r["n_gpus"]))
                x = [int(r["n_gpus"]) for r in group]
                y = [y_of(r, "tokens_per_s") for r in group]
                (line,) = ax.plot(x, y, marker="o", label=f"batch {gbs}")
                if band and all(r["tokens_per_s_low"] != "" for r in group):
                    lo = [y_of(r, "tokens_per_s_low") for r in group]
                    hi = [y_of(r, "tokens_per_s_high") for r in group]
                    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
                for xi, yi, r in zip(x, y, group):
                    if r["note"]:
                        ax.annotate("!", (xi, yi), textcoords="offset points", xytext=(4, 4))
            sizes = sorted({int(r["n_gpus"]) for r in rows if r["gpu"] == gpu})
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{model} on {gpu}", fontsize=9)
            if i == len(models) - 1:
                ax.set_xlabel("devices")
            if j == 0:
                ax.set_ylabel(ylabel)
            if lines:
                ax.legend(fontsize=7)
    fig.suptitle(f"{ylabel} against cluster size (shaded: 90% band; '!': a note)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(folder, name)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return name
