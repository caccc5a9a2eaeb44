"""What `tune --out` wrote, read back for the tests: CSVs and the tables of report.md."""

from __future__ import annotations

import csv


def read_csv(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def table(report: str, heading: str) -> list[list[str]]:
    """The rows of the first markdown table after `heading` (cells stripped, no header)."""
    lines = report[report.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return rows
