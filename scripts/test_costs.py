"""What the default test suite spends its time on, grouped by what each test starts.

    python scripts/test_costs.py [--out results/test_costs.csv] [--beside-busy] [-- pytest args]

Runs `python -m pytest` (the default suite, plus any pytest args) with PA_TEST_COSTS set and the
recorder plugin tests/cost_plugin.py loaded (`-p cost_plugin`, tests/ on PYTHONPATH), which records
each test's setup + call + teardown seconds and what it started (a Ray instance, Ray engine workers
and their backend, subprocesses by program); writes one CSV row per test, each with the suite's
wall time, the commit, the CPU and the pytest arguments.
`scripts/update_readme.py` renders the grouped table into docs/reproduce.md.

A test's group is the first it belongs to, in the order of `GROUPS`: torchrun ranks, a vLLM engine
worker, a subprocess of `python -m periodic_async`, another script, a Ray instance started, Ray
engine workers started (the built-in batcher), other subprocesses (the reward worker,
multiprocessing trainer ranks, vLLM's engine core), none of these (in-process). A module- or
session-scoped fixture's start-up falls on the first test that uses it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS = [("torchrun ranks", "subprocess_torchrun"), ("a vLLM engine worker", "vllm_workers"),
          ("a `python -m periodic_async` subprocess", "subprocess_cli"), ("a script subprocess", "subprocess_script"),
          ("a Ray instance", "ray"), ("Ray engine workers (built-in batcher)", "engine_workers"),
          ("other subprocesses (reward worker, trainer ranks, vLLM's engine core)", "subprocess_other"),
          ("nothing (in-process)", None)]
COUNTS = ["ray", "engine_workers", "vllm_workers", "subprocess_torchrun", "subprocess_cli", "subprocess_script",
          "subprocess_other"]
COLUMNS = ["test", "group", "seconds", "outcome", *COUNTS, "suite_wall_s", "pytest_args", "load", "cpu", "cores",
           "git_commit"]


def per_test(records: list[dict]) -> dict[str, dict]:
    """The recorder's lines (one per phase) summed per test."""
    tests: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for r in records:
        t = tests[r["test"]]
        t["seconds"] += r["s"]
        if r["phase"] == "call" or r["outcome"] != "passed":
            t["outcome"] = r["outcome"]
        for k in COUNTS:
            t[k] += r.get(k, 0)
    return tests


def group_of(t: dict) -> str:
    return next(label for label, key in GROUPS if key is None or t.get(key, 0) > 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "results" / "test_costs.csv"))
    ap.add_argument("--beside-busy", action="store_true",
                    help="run a CPU-bound process (one core's worth) beside the suite, as a shared machine has")
    ap.add_argument("--regroup", action="store_true", help="recompute the group column of --out from its counts")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    if args.regroup:
        with open(args.out, newline="") as f:
            rows = list(csv.DictReader(f))
        for r in rows:
            r["group"] = group_of({k: float(r[k]) for k in COUNTS})
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        return
    sys.path.insert(0, str(ROOT / "src"))
    from periodic_async.records import cpu_name, git_commit

    commit = git_commit()
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "costs.jsonl"
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.beside_busy else None
        t0 = time.time()
        try:
            path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
            rc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "cost_plugin",
                                 *args.pytest_args], cwd=ROOT,
                                env={**os.environ, "PA_TEST_COSTS": str(record), "PYTHONPATH": path}).returncode
        finally:
            wall = time.time() - t0
            if busy is not None:
                busy.kill()
        records = [json.loads(line) for f in sorted(Path(tmp).glob("costs.jsonl*"))  # .gw0, .gw1 under xdist
                   for line in f.read_text().splitlines() if line.strip()]
    tests = per_test(records)
    if not tests:  # pytest stopped before any test (bad arguments, a collection error): keep the last measurement
        print(f"[test_costs] no test ran (pytest exit {rc}); {args.out} left as it was", file=sys.stderr)
        sys.exit(rc or 1)
    rows = [{"test": name, "group": group_of(t), "seconds": round(t["seconds"], 2), "outcome": t.get("outcome", ""),
             **{k: int(t[k]) for k in COUNTS}, "suite_wall_s": round(wall, 1),
             "pytest_args": " ".join(args.pytest_args), "load": "one CPU-bound process" if busy else "quiet",
             "cpu": cpu_name(cores=False), "cores": os.cpu_count(), "git_commit": commit}
            for name, t in sorted(tests.items(), key=lambda x: -x[1]["seconds"])]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"[test_costs] {len(rows)} tests, suite {wall:.0f} s (pytest exit {rc}); wrote {out}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
