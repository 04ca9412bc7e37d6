"""Reward and held-out accuracy curves of RL runs from one seed, one run per mode, and their
summary (experiments/reward_curves.py; experiments/lora_learning.py's final run): what
experiments/reward_curves.py's docstring describes, column by column.

    rows, summary = run_curves(config, "reward_curves_real", ["periodic-async"], overrides, runs, engines)
    write_curves("reward_curves_real", rows, summary, results, figures)

Every mode's run starts from the same config and seed; the engines are `engines`' (started once,
each run pushing its own initial weights). A summary's comparison columns against sync-separated
(max_abs_diff_*, tokens_identical_iterations) are filled when sync-separated is among the modes.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from periodic_async.bench.analysis import identical_iterations, max_abs_diff, paired_gain_stderr
from periodic_async.bench.plots import plot_reward_curves, plot_reward_vs_time
from periodic_async.bench.protocol import SharedEngines
from periodic_async.records import write_csv
from periodic_async.config import RunConfig, load_config
from periodic_async.pipeline import run
from periodic_async.trace import read_jsonl

MODES = ["sync-separated", "periodic-async", "async-offpolicy"]
STATS = {"entropy": "train/entropy", "grad_norm": "train/grad_norm", "kl": "train/kl", "clip_frac": "train/clip_frac",
         "ratio_mean": "train/ratio_mean", "ratio_abs_dev": "train/ratio_abs_dev",
         "behaviour_logp_gap": "train/behaviour_logp_gap"}


def _r(x, nd=4):
    return "" if x is None or x == "" else round(float(x), nd)


def curve_rows(mode: str, out: Path) -> list[dict]:
    """One row per iteration 0..N of one run (iteration = optimizer steps completed)."""
    metrics = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m}
    evals = {e["step"]: e for e in read_jsonl(out / "eval.jsonl")} if (out / "eval.jsonl").is_file() else {}
    mixed: dict[int, list[bool]] = {}
    for g in read_jsonl(out / "rollouts.jsonl"):
        mixed.setdefault(g["iteration"] + 1, []).append(0 < sum(g["correct"]) < len(g["correct"]))
    rows, clock = [], 0.0
    for step in range(0, max([*metrics, *evals, 0]) + 1):
        m, e = metrics.get(step, {}), evals.get(step, {})
        clock += m.get("time/iteration_s", 0.0)
        row = {"mode": mode, "iteration": step, "time_s": round(clock, 2), "reward_mean": _r(m.get("reward/mean")),
               "accuracy": _r(m.get("accuracy")), "eval_accuracy": _r(e.get("accuracy")),
               "eval_stderr": _r(e.get("stderr")), "eval_n": e.get("n", ""),
               "mixed_frac": _r(sum(mixed[step]) / len(mixed[step])) if step in mixed else ""}
        row.update({k: _r(m.get(key), 6) for k, key in STATS.items()})
        rows.append(row)
    return rows


def run_curves(config: Path, name: str, modes: list[str], overrides: list[str], runs: str | Path,
               engines: SharedEngines) -> tuple[dict[str, list[dict]], list[dict]]:
    """One run per mode of `config` + `overrides` (in runs/<name>/<mode>), on `engines`: the curve
    rows per mode and one summary row per mode."""
    rows, summary, outs = {}, [], {}
    for mode in modes:
        cfg = load_config(RunConfig, config,
                          overrides + [f"pipeline.mode={mode}", f"trainer.output_dir={runs}/{name}/{mode}"])
        engine = engines.get(cfg)
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
        s = run(cfg, engine=engine)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.time() - t0
        outs[mode] = Path(cfg.trainer.output_dir)
        rows[mode] = curve_rows(mode, outs[mode])
        ev = [r for r in rows[mode] if r["eval_accuracy"] != ""]
        first, last = ev[0], ev[-1]
        summary.append({
            "mode": mode, "eval_accuracy_start": first["eval_accuracy"],
            "eval_accuracy_end": last["eval_accuracy"],
            "eval_stderr": last["eval_stderr"], "eval_n": last["eval_n"], "max_abs_diff_vs_sync": "",
            "tokens_per_s": round(s["tokens_per_s"], 1),
            "gain": round(last["eval_accuracy"] - first["eval_accuracy"], 4),
            # the two ends as independent samples: conservative (they are the same problems)
            "gain_stderr": round((first["eval_stderr"] ** 2 + last["eval_stderr"] ** 2) ** 0.5, 4),
            "gain_stderr_paired": _r(paired_gain_stderr(outs[mode], first["iteration"], last["iteration"])),
            "eval_stderr_start": first["eval_stderr"], "eval_points": len(ev),
            "max_abs_diff_reward": "", "max_abs_diff_eval": "", "tokens_identical_iterations": "",
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1),
            "git_commit": json.loads((outs[mode] / "run_info.json").read_text())["git_commit"],
        })
        print(f"[reward_curves] {mode}: held-out {first['eval_accuracy']} -> {last['eval_accuracy']} "
              f"(n={last['eval_n']}), {summary[-1]['wall_s']} s")
    sync = "sync-separated"
    for s in summary:
        if sync in rows:
            dr = max_abs_diff(rows[s["mode"]], rows[sync], "reward_mean")
            de = max_abs_diff(rows[s["mode"]], rows[sync], "eval_accuracy")
            s.update(max_abs_diff_reward=_r(dr, 6), max_abs_diff_eval=_r(de, 6),
                     max_abs_diff_vs_sync=_r(max(dr or 0.0, de or 0.0), 6),
                     tokens_identical_iterations=identical_iterations(outs[s["mode"]], outs[sync]))
    return rows, summary


def write_curves(name: str, rows: dict[str, list[dict]], summary: list[dict], results: str | Path,
                 figures: str | Path) -> None:
    """<results>/<name>.csv (the rows, each with its run's commit), <name>_summary.csv, and the
    figures <name>.png and <name>_wallclock.png."""
    res = Path(results)
    commit = {s["mode"]: s["git_commit"] for s in summary}  # each run's tree (the machine: write_csv's stamp)
    for file, table in ((f"{name}.csv", [{**r, "git_commit": commit[m]} for m in rows for r in rows[m]]),
                        (f"{name}_summary.csv", summary)):
        print(f"wrote {write_csv(res / file, table)}")
    print(f"wrote {plot_reward_curves(res / f'{name}.csv', Path(figures) / f'{name}.png')}")
    print(f"wrote {plot_reward_vs_time(res / f'{name}.csv', Path(figures) / f'{name}_wallclock.png')}")
