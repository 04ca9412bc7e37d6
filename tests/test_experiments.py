"""The experiment scripts run end to end in QUICK mode and write the artifacts the README and
notebooks read (slow: about a minute each; `bash run_tests.sh -m slow`)."""

import csv
from pathlib import Path

import pytest




def _rows(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open()))


@pytest.mark.slow
def test_async_speedup_quick(tmp_path, tokenizer_dir, experiment_script):
    experiment_script("async_speedup").main(["--quick", "--results", str(tmp_path), "--runs", str(tmp_path / "runs"),
                                   "--figures", str(tmp_path), "model.name_or_path=qwen2-1m",
                                   f"model.tokenizer={tokenizer_dir}", "logging.wandb_mode=disabled"])
    rows = {r["mode"]: r for r in _rows(tmp_path / "async_speedup.csv")}
    assert set(rows) == {"sync-separated", "periodic-async", "sync-colocated"}
    assert float(rows["sync-separated"]["speedup_vs_sync_separated"]) == 1.0
    assert 1.0 <= float(rows["periodic-async"]["bound"]) <= 2.0
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "timeline" / "periodic-async.trace.jsonl").is_file()


@pytest.mark.slow
def test_shared_async_quick(tmp_path, tokenizer_dir, experiment_script):
    experiment_script("shared_async").main(["--quick", "--results", str(tmp_path), "--runs", str(tmp_path / "runs"),
                                  "model.name_or_path=qwen2-1m", f"model.tokenizer={tokenizer_dir}",
                                  "logging.wandb_mode=disabled"])
    rows = _rows(tmp_path / "shared_async.csv")
    assert [r["mode"] for r in rows] == ["sync-separated", "periodic-async"] * 2 + ["product"]
    shared_sync = next(r for r in rows if r["shared_prompt"] == "True" and r["mode"] == "sync-separated")
    assert float(shared_sync["speedup"]) > 1.0  # 4-shot prompts: packing the prompt once must pay


@pytest.mark.slow
def test_reward_curves_quick(tmp_path, tokenizer_dir, experiment_script):
    """Three modes from one seed; the summary has the columns the README and notebook read."""
    experiment_script("reward_curves").main(["--quick", "--results", str(tmp_path), "--runs", str(tmp_path / "runs"),
                                   "--figures", str(tmp_path), "model.name_or_path=qwen2-1m",
                                   f"model.tokenizer={tokenizer_dir}", "engine.backend=local",
                                   "logging.wandb_mode=disabled"])
    rows = _rows(tmp_path / "reward_curves_summary.csv")
    assert [r["mode"] for r in rows] == ["sync-separated", "periodic-async", "async-offpolicy"]
    assert list(rows[0])[:7] == ["mode", "eval_accuracy_start", "eval_accuracy_end", "eval_stderr", "eval_n",
                                 "max_abs_diff_vs_sync", "tokens_per_s"]
    assert all(r["gain_stderr_paired"] != "" for r in rows)
    assert (tmp_path / "reward_curves.png").stat().st_size > 10_000


def test_paired_gain_stderr(tmp_path, experiment_script):
    """The gain's paired standard error is sd(d)/sqrt(n) over per-problem differences d."""
    import json
    import statistics

    start, end = [1, 0, 1, 0, 0, 1], [1, 1, 1, 0, 1, 0]
    with (tmp_path / "eval.jsonl").open("w") as f:
        for step, correct in ((0, start), (10, end)):
            f.write(json.dumps({"step": step, "accuracy": sum(correct) / 6, "correct": correct}) + "\n")
    d = [b - a for a, b in zip(start, end)]
    got = experiment_script("reward_curves").paired_gain_stderr(tmp_path, 0, 10)
    assert got == pytest.approx(statistics.stdev(d) / len(d) ** 0.5)
    assert experiment_script("reward_curves").paired_gain_stderr(tmp_path, 0, 20) is None  # no such version


@pytest.mark.slow
def test_table2_quick(tmp_path, tokenizer_dir, experiment_script):
    """TRL and our three modes (shared prompt off and on) in both settings; TRL's own token
    counts equal ours on every batch."""
    pytest.importorskip("trl")
    experiment_script("table2_throughput").main(["--quick", "--repeats", "1", "--results", str(tmp_path), "--runs",
                                       str(tmp_path / "runs"), "--figures", str(tmp_path),
                                       "model.name_or_path=qwen2-1m", f"model.tokenizer={tokenizer_dir}"])
    rows = _rows(tmp_path / "table2_throughput.csv")
    assert {(r["setting"], r["system"], r["shared_prompt"]) for r in rows} >= {
        ("long-prompt", "trl-grpo", "False"), ("long-prompt", "periodic-async", "True"),
        ("short-prompt", "sync-colocated", "False"), ("short-prompt", "periodic-async", "True")}
    assert all(r["equal"] == "True" for r in _rows(tmp_path / "table2_token_check.csv"))
