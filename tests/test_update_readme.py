"""scripts/update_readme.py renders the run's times into docs/reproduce.md from the CSVs that
run_all.sh writes: the full run as the sum of its experiments (one at a time, however many
sittings), the smoke run as the span of its two lanes; and vLLM's speed over the built-in engine
from engine.csv into README.md and docs/gpu.md."""

import csv
import re
import shutil
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _experiments() -> list[str]:
    return re.search(r"^EXPERIMENTS=\((.*?)\)", (ROOT / "run_all.sh").read_text(), flags=re.S | re.M).group(1).split()


def _write(path: Path, rows: list[tuple[str, int, datetime]], quick: int) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["experiment", "seconds", "quick", "git_commit", "finished"])
        for exp, seconds, finished in rows:
            w.writerow([exp, seconds, quick, "abcdef1234", finished.strftime("%Y-%m-%dT%H:%M:%SZ")])


def _render(tmp_path: Path, results: Path) -> dict[str, Path]:
    """update_readme.py on copies of the rendered documents (the repository's stay untouched)."""
    docs = {name: tmp_path / Path(name).name for name in ("README.md", "docs/results.md", "docs/reproduce.md",
                                                           "docs/gpu.md")}
    for name, copy in docs.items():
        shutil.copy(ROOT / name, copy)
    subprocess.run([sys.executable, "scripts/update_readme.py", "--results", str(results),
                    "--readme", str(docs["README.md"]), "--tables", str(docs["docs/results.md"]),
                    "--reproduce", str(docs["docs/reproduce.md"]), "--gpu", str(docs["docs/gpu.md"])],
                   cwd=ROOT, check=True)
    return docs


def test_times_table_sums_the_full_run_and_spans_the_smoke_run(tmp_path):
    exps = _experiments()
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    # the full run: one at a time, resumed a day later part-way (the gap is not the run's time)
    full, at = [], t0
    for i, exp in enumerate(exps):
        at += timedelta(seconds=600 + (86400 if i == 5 else 0))
        full.append((exp, 600, at))
    # the smoke run: two lanes from t0, each experiment 10 + i seconds, alternating lanes
    ends, quick = [t0, t0], []
    for i, exp in enumerate(exps):
        ends[i % 2] += timedelta(seconds=10 + i)
        quick.append((exp, 10 + i, ends[i % 2]))
    span = (max(ends) - t0).total_seconds()
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "run_all_times.csv", full, 0)
    _write(results / "run_all_times_quick.csv", quick, 1)
    docs = _render(tmp_path, results)
    block = re.search(r"<!-- results:run_all_times -->(.*?)<!-- /results:run_all_times -->",
                      docs["docs/reproduce.md"].read_text(), flags=re.S).group(1)
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `(\w+)` \| (.*?) \| (.*?) \|$", block, flags=re.M)}
    assert list(rows) == exps
    assert rows[exps[0]] == ("10 min", "10 s") and rows[exps[-1]] == ("10 min", f"{10 + len(exps) - 1} s")
    total = re.search(r"\| \*\*the whole run\*\* \| (.*?) \| (.*?) \|", block).groups()
    assert total == (f"{600 * len(exps) / 3600:.1f} h (the sum)", f"{span:.0f} s (two at a time)")
    assert span < sum(10 + i for i in range(len(exps)))  # the lanes overlapped

    # a run that has not finished every experiment is not given a total
    _write(results / "run_all_times.csv", full[:-1], 0)
    _render(tmp_path, results)
    text = docs["docs/reproduce.md"].read_text()
    assert f"| `{exps[-1]}` | not timed |" in text and "| **the whole run** | not timed end to end |" in text


def test_vllm_speed_is_the_range_of_engine_csv_per_model(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    ratios = {"model-a": [1.234, 2.46, 1.9], "model-b": [3.02]}
    with (results / "engine.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "distribution", "vllm_vs_builtin"])
        for model, values in ratios.items():
            w.writerows([model, "uniform", v] for v in values)
    docs = _render(tmp_path, results)
    for name in ("README.md", "docs/gpu.md"):
        block = re.search(r"<!-- results:vllm_speed -->\n(.*?)\n<!-- /results:vllm_speed -->",
                          docs[name].read_text(), flags=re.S).group(1)
        assert block == (f"1.2-2.5x the built-in engine on model-a, 3.0x the built-in engine on model-b "
                         f"(`{results}/engine.csv`)"), (name, block)
