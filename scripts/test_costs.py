"""What the default test suite spends its time on, grouped by what each test starts.

    PA_TEST_COSTS=/tmp/costs.jsonl bash run_tests.sh -p no:randomly     # records (tests/conftest.py)
    python scripts/test_costs.py /tmp/costs.jsonl [--top 15]           # a markdown table

Each test's time is its setup + call + teardown (a module- or session-scoped fixture's start-up
falls on the first test that uses it). A test is put in the first group it belongs to, in the
order: torchrun ranks, a vLLM engine worker, a subprocess of `python -m periodic_async`, another
script subprocess, a Ray instance started, Ray engine workers started (the built-in batcher), none
of these (in-process).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

GROUPS = [("torchrun ranks", "subprocess_torchrun"), ("vLLM engine worker", "vllm_workers"),
          ("`python -m periodic_async` subprocess", "subprocess_cli"), ("script subprocess", "subprocess_script"),
          ("a Ray instance", "ray"), ("Ray engine workers (batcher)", "engine_workers"), ("in-process only", None)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("costs")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    tests: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for line in open(args.costs):
        r = json.loads(line)
        t = tests[r["test"]]
        for k, v in r.items():
            if k not in ("test", "phase", "outcome"):
                t[k] += v
    groups: dict[str, list] = defaultdict(list)
    for name, t in tests.items():
        label = next(label for label, key in GROUPS if key is None or t.get(key, 0) > 0)
        groups[label].append((name, t))
    total = sum(t["s"] for t in tests.values())
    print(f"{len(tests)} tests, {total:.0f} s\n")
    print("| what the test starts | tests | seconds | share | starts (Ray / batcher workers / vLLM workers / subprocesses) |")
    print("|---|---|---|---|---|")
    for label, _ in GROUPS:
        rows = groups.get(label, [])
        s = sum(t["s"] for _, t in rows)
        starts = " / ".join(str(int(sum(t.get(k, 0) for _, t in rows))) for k in ("ray", "engine_workers", "vllm_workers"))
        subs = int(sum(v for _, t in rows for k, v in t.items() if k.startswith("subprocess_")))
        print(f"| {label} | {len(rows)} | {s:.0f} | {s / total:.0%} | {starts} / {subs} |")
    print(f"\nThe {args.top} slowest:\n\n| test | seconds |\n|---|---|")
    for name, t in sorted(tests.items(), key=lambda x: -x[1]["s"])[: args.top]:
        print(f"| `{name}` | {t['s']:.1f} |")


if __name__ == "__main__":
    main()
