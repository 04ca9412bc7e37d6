"""The CSV tables every experiment writes (results/*.csv) and the figures read back.

    write_csv("results/x.csv", rows)          # each row stamped with git_commit and cpu
    rows = read_csv("results/x.csv")          # [{column: text}], the file closed

Guarantees:
- **Provenance**: every row a run measures says which tree and which machine measured it:
  `git_commit` (records.git_commit, read once per process) and `cpu` (records.cpu_name: CPU model,
  vector unit, cores). A row that already has the key keeps its value: a row read back from an
  older CSV (even with an empty cell) or one carrying its run's own commit (run_info.json).
- **Columns**: given, or the union of the rows' keys in first-seen order; a missing value is an
  empty cell, a key outside `columns` an error.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

from periodic_async.records import cpu_name, git_commit

STAMP = ("git_commit", "cpu")
"""The columns `write_csv` adds to every row that lacks them: the tree and the machine that measured it."""


def stamp(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` with `git_commit` and `cpu` where a row lacks the key (a row that has it, even
    empty, as one read back from an older CSV, keeps its value)."""
    here = {"git_commit": git_commit(), "cpu": cpu_name()}
    return [{**r, **{k: v for k, v in here.items() if k not in r}} for r in rows]


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
              provenance: bool = True) -> Path:
    """Write `rows` with `columns` (default: the union of keys, in first-seen order); missing
    values are empty cells. Creates the parent directory. With `provenance` every row is stamped
    (`stamp`) and the stamp's columns end the header when `columns` lacks them; without it (a
    prediction no machine measured, a table with provenance columns of its own) rows are written as given."""
    if provenance:
        rows = stamp(rows)
        if columns is not None:
            columns = list(columns) + [c for c in STAMP if c not in columns]
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), restval="", extrasaction="raise")
        w.writeheader()
        w.writerows(rows)
    return p


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a CSV written by `write_csv` (or any CSV with a header), as text."""
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))
