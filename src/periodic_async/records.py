"""What a run records about itself, so that every number can be traced to the code, the machine and
the settings that produced it (the paper's comparisons are only as good as their provenance).

A run writes its resolved config (`config.yaml`) and its `run_info.json` (the git commit, then what
the pipeline adds: the model path a hub id resolved to, the cores each process ran on) beside its
outputs (`save_run_info`, `update_run_info`); every measured CSV row carries `git_commit` and the
CPU (`cpu_name`, `stamp`). A resumed run's logs are cut back to its checkpoint (`truncate_logs`).
The results tables every experiment writes (results/*.csv) and the figures read back:

    write_csv("results/x.csv", rows)          # each row stamped with git_commit and cpu
    rows = read_csv("results/x.csv")          # [{column: text}], the file closed

Guarantees:

- the commit is read once per process (`git_commit`), so what the process writes itself (an
  experiment's CSVs, rewritten before its last rows are stamped) never marks its own rows dirty;
- no secret value is ever written: everything saved here, logged to W&B (trace.py) or put on the
  command line W&B records passes through `redact_secrets`, which replaces the value of every
  environment variable with a secret-looking name (*TOKEN*, *KEY*, *SECRET*, *PASSWORD*,
  *CREDENTIAL*) by '<redacted>', even pasted inside a config value;
- every row a run measures says which tree and which machine measured it: `git_commit` and `cpu`
  (CPU model, vector unit, cores). A row that already has the key keeps its value: a row read
  back from an older CSV (even with an empty cell) or one carrying its run's own commit
  (run_info.json). The columns are given, or the union of the rows' keys in first-seen order; a
  missing value is an empty cell, a key outside `columns` an error.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
import platform
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import yaml


OUTPUTS = ("results/", "figures/")
"""Where experiments write their tables and figures: changes there are not code, so they never make
a commit dirty (run_all.sh's experiments run one after another in one tree, each rewriting tracked
CSVs that the next one would otherwise count as changes)."""
OUTPUT_SUFFIXES = (".csv", ".png", ".jsonl")


def changed_code(porcelain: str) -> list[str]:
    """The changed paths of `git status --porcelain` output, less the experiments' outputs
    (OUTPUTS' tables, figures and traces; a YAML there, e.g. measured device costs, is an input)."""
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in porcelain.splitlines() if line.strip()]
    return [p for p in paths if not (p.startswith(OUTPUTS) and p.endswith(OUTPUT_SUFFIXES))]


@functools.cache
def git_commit() -> str:
    """The git commit of the code this process runs (with '-dirty' when the tree had changes other
    than the experiments' outputs: `changed_code`), or 'unknown'. Read once, at the first call, so
    that nothing the process writes itself marks its own rows dirty."""
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                capture_output=True, text=True, timeout=10).stdout
        return (sha + ("-dirty" if changed_code(status) else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name(cores: bool = True) -> str:
    """The CPU model, its widest vector unit and (with `cores`) the cores this process may use,
    e.g. 'AMD EPYC (AVX-512; 2 cores)': recorded beside measured times, since CPUs of one core
    count differ severalfold. No commas (it is a CSV field)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = info.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    detail = f"{isa}; {n} cores" if cores else isa
    return f"{model or platform.machine() or 'unknown'} ({detail})".replace(",", "")


_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
REDACTED = "<redacted>"


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the environment variables whose names look secret (*TOKEN*, *KEY*, *SECRET*,
    *PASSWORD*, *CREDENTIAL*: WANDB_API_KEY, HF_TOKEN, ...), 8 characters or more, longest first."""
    env = os.environ if environ is None else environ
    return sorted({v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= 8}, key=len, reverse=True)


def redact_secrets(obj: Any, secrets: list[str] | None = None) -> Any:
    """`obj` (nested dicts, lists and strings) with every secret environment value (`secret_values`)
    replaced by '<redacted>': what a run writes never carries a token, even one pasted into a
    config value (a cluster address with a password, say)."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(obj, str):
        for v in secrets:
            obj = obj.replace(v, REDACTED)
        return obj
    if isinstance(obj, dict):
        return {redact_secrets(k, secrets): redact_secrets(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_secrets(v, secrets) for v in obj]
    return obj


def save_run_info(cfg: Any, out_dir: str | Path) -> Path:
    """Write `config.yaml` (resolved) and `run_info.json` (git commit) into `out_dir`, both
    through `redact_secrets`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(redact_secrets(dataclasses.asdict(cfg)), sort_keys=False))
    (out / "run_info.json").write_text(json.dumps(redact_secrets({"git_commit": git_commit()}), indent=2))
    return out


def update_run_info(out_dir: str | Path, **fields: Any) -> None:
    """Add `fields` to `run_info.json` in `out_dir` (written by `save_run_info`)."""
    path = Path(out_dir) / "run_info.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(redact_secrets({**info, **fields}), indent=2))


# --- a run's logs ----------------------------------------------------------------------------

LOGS = ("metrics.jsonl", "eval.jsonl", "rollouts.jsonl", "trace.jsonl", "trace.chrome.json", "summary.json")
"""What a run appends to under trainer.output_dir (books.py, trace.py)."""


def remove_logs(out: Path) -> None:
    """A fresh run: the logs of an earlier run in `out` are removed, never appended to."""
    for name in LOGS:
        (Path(out) / name).unlink(missing_ok=True)


def truncate_logs(out: Path, completed: int) -> None:
    """A resume from checkpoint-<completed>: the logs keep what the uninterrupted run would have
    written by then, nothing later, so that the resumed run appends each iteration once (a hard
    kill between checkpoints leaves rows of iterations the resumed run trains again):

        rollouts.jsonl   rows of iterations < completed
        metrics.jsonl    rows of steps <= completed (step = iterations completed), less the
                         evaluation of a version >= completed (`eval/version`: an evaluation at
                         the end of a stopped run; the resumed run evaluates that version again
                         when trainer.eval_every says so, as the uninterrupted run did)
        eval.jsonl       rows of versions < completed

    A line left unfinished by a kill is dropped. trace.jsonl is a timeline of what ran, work
    lost to the kill included: kept whole. Each file is replaced atomically."""
    keep = {"rollouts.jsonl": lambda r: r["iteration"] < completed,
            "metrics.jsonl": lambda r: r["step"] <= completed and r.get("eval/version", -1) < completed,
            "eval.jsonl": lambda r: r["step"] < completed}
    for name, wanted in keep.items():
        path = Path(out) / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the unfinished last line of a killed run
                continue
            if wanted(row):
                kept.append(line + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


# --- results tables (results/*.csv) ------------------------------------------------------------

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
