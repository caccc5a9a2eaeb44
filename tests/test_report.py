"""report.md's content: sections present and filled, figures equal to the CSVs (not pixels)."""

from __future__ import annotations

import pytest
from report_tables import read_csv, table

from autosearch import tune
from autosearch.commands.tune import summary
from autosearch.tuning._outputs import plot_limits

SMALL = dict(model="llama3-8b", cluster="h100-sxm:2x8", global_batch_size=64)
WORLD = 16  # devices of SMALL's cluster
GiB = float(1 << 30)


def _usd(tokens_per_s: float, price: float) -> float:
    """Dollars per million tokens: price x devices x hours per million tokens."""
    return price * WORLD / 3600.0 / tokens_per_s * 1e6


def test_multi_objective_report_fills_the_pareto_section_from_pareto_csv(tmp_path):
    out = tmp_path / "run"
    result = tune(
        **SMALL,
        objective="throughput-memory",
        n_trials=80,
        seed=0,
        out=out,
        price_per_gpu_hour=2.5,
    )
    report = (out / "report.md").read_text()
    front = read_csv(out / "pareto.csv")
    assert len(front) == len(result.pareto) >= 3
    assert f"## Pareto front ({len(front)} strategies, `pareto.csv`)" in report
    rows = table(report, "## Pareto front")
    assert len(rows) == len(front)
    for row, c in zip(rows, front):
        tps, mem = float(c["tokens_per_s"]), float(c["peak_memory_bytes"])
        assert row == [
            c["rank"],
            c["strategy"],
            f"{tps:,.0f}",
            f"{mem / GiB:.1f}",
            f"{float(c['mfu']):.1%}",
            f"${float(c['usd_per_million_tokens']):,.3f}",
        ]
        assert float(c["usd_per_million_tokens"]) == pytest.approx(_usd(tps, 2.5), rel=1e-12)
    # a front: fastest first, and each slower point needs less memory
    tps = [float(c["tokens_per_s"]) for c in front]
    mem = [float(c["peak_memory_bytes"]) for c in front]
    assert tps == sorted(tps, reverse=True) and mem == sorted(mem, reverse=True)
    assert "orange diamonds in the throughput vs memory plot" in report
    assert (out / "throughput_memory.png").stat().st_size > 1000


def test_cost_objective_shows_dollars_per_million_tokens_everywhere(tmp_path):
    out = tmp_path / "run"
    price = 3.0
    result = tune(
        **SMALL,
        objective="throughput-cost",
        price_per_gpu_hour=price,
        n_trials=60,
        seed=0,
        out=out,
        top_k=4,
    )
    report = (out / "report.md").read_text()
    best = result.best_report
    usd = _usd(best.tokens_per_s, price)
    # the objective's own second value is the same figure
    assert result.top_k[0].values[1] == pytest.approx(usd, rel=1e-12)
    best_row = table(report, "## Best strategy")[0]
    assert best_row[-1] == f"${usd:,.3f}" and "- price: $3 per device-hour" in report
    top = read_csv(out / "top_k.csv")
    rows = table(report, "## Top 4")
    assert [r[1] for r in rows] == [c["strategy"] for c in top]
    for row, c in zip(rows, top):
        assert row[2] == f"{float(c['tokens_per_s']):,.0f}"
        assert row[-1] == f"${float(c['usd_per_million_tokens']):,.3f}"
    printed = summary(result)
    assert f"cost      ${usd:,.3f} per million tokens at $3 per device-hour" in printed
    assert printed.count("/M tokens") == len(result.top_k) - 1
    n = len(result.pareto)
    assert (
        n >= 1 and f"Pareto front: {n} strateg{'y' if n == 1 else 'ies'} (pareto.csv)" in printed
    )


def test_without_a_price_no_dollar_column_appears(tmp_path):
    out = tmp_path / "run"
    tune(**SMALL, n_trials=12, seed=0, out=out)
    report = (out / "report.md").read_text()
    assert "$/M tokens" not in report and "usd_per_million_tokens" not in (
        out / "top_k.csv"
    ).read_text().splitlines()[0].split(",")


def test_plot_limits_show_what_fits_not_the_outliers():
    # fits up to 60 GiB / 1e5 tokens/s; one strategy needs 900 GiB, one is 5x faster (neither fits)
    pts = [(20.0, 5e4, True), (60.0, 1e5, True), (900.0, 2e4, False), (90.0, 5e5, False)]
    x_hi, y_hi = plot_limits(pts, 80.0)
    assert x_hi == pytest.approx(80.0 * 1.5) and y_hi == pytest.approx(1e5 * 1.15)
    # nothing fits: every point is shown
    x_hi, y_hi = plot_limits([(p[0], p[1], False) for p in pts], 80.0)
    assert x_hi >= 900.0 and y_hi >= 5e5


def test_report_sections_are_present_and_filled(tmp_path):
    out = tmp_path / "run"
    result = tune(**SMALL, n_trials=30, seed=0, out=out, top_k=3)
    report = (out / "report.md").read_text()
    for heading in (
        "## Best strategy",
        "## Top 3 (`top_k.csv`)",
        "## Where the step time goes",
        "## Throughput vs memory",
        "## What matters (parameter importances)",
    ):
        assert heading in report
    assert "## Pareto front" not in report  # one objective
    best_row = table(report, "## Best strategy")[0]
    r = result.best_report
    assert best_row[1] == f"{r.tokens_per_s:,.0f}" and best_row[2] == f"{r.mfu:.1%}"
    top = read_csv(out / "top_k.csv")
    for row, c in zip(table(report, "## Top 3"), top):
        assert row[1] == c["strategy"] and row[5] == f"{float(c['peak_memory_bytes']) / GiB:.1f}"
    assert "- ties: equal predicted values" in report
