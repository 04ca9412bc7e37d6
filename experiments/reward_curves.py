"""Reward and held-out accuracy curves of RL from one seed, three modes side by side:
sync-separated, periodic-async (the paper's, on-policy) and async-offpolicy (one-step-stale,
what the paper argues against).

    bash experiments/reward_curves.sh                      (QUICK=1: smoke run, under a minute)
    python experiments/reward_curves.py [--quick] [--results results] [section.key=value ...]

Base policy: experiments/rl_base.yaml (reward_curves.sh builds artifacts/sft-rl-base when
missing). Held-out greedy accuracy is measured through the engines every
`trainer.eval_every` iterations (eval.jsonl; version 0 is the start), with the binomial
standard error sqrt(p(1-p)/n).

Writes
  <results>/reward_curves.csv          one row per mode and iteration (= optimizer steps
      done): time_s (the run's wall-clock seconds when that step's iteration ended: the sum of
      its iterations' times, start-up excluded), reward_mean / accuracy of the batch of that step
      (none at iteration 0),
      eval_accuracy / eval_stderr / eval_n of the weights after it, mixed_frac (groups whose
      samples disagree: the learning signal), entropy, grad_norm, kl, and the staleness
      statistics clip_frac, ratio_mean, ratio_abs_dev (mean |ratio - 1|), behaviour_logp_gap
      (exactly 0 / 1 / 0 on-policy: the old policy is the sampling policy)
  <results>/reward_curves_summary.csv  mode,eval_accuracy_start,eval_accuracy_end,eval_stderr,
      eval_n,max_abs_diff_vs_sync,tokens_per_s, then gain, gain_stderr (the two ends as
      independent samples: conservative), gain_stderr_paired (per-problem differences on the same
      held-out problems), the two parts of
      max_abs_diff_vs_sync (reward, eval accuracy), tokens_identical_iterations (vs sync),
      wall_s and cpu_s (the run, without the engines' start-up: they start once and serve the
      three modes, each run pushing its own initial weights; cpu_s is this process, trainer +
      producer, Ray engine workers not counted), and
      git_commit (the run's, from its run_info.json)
  <figures>/reward_curves.png, <figures>/reward_curves_wallclock.png (the same against time_s)

In exact arithmetic sync-separated and periodic-async are the same run; in fp32 they share
every sampled token unless a summation-order difference flips one (tokens_identical_iterations).

How the settings were chosen (the lr, schedule and task searched): docs/notes/reward_curves_search.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from periodic_async.bench.analysis import identical_iterations, max_abs_diff, paired_gain_stderr
from periodic_async.bench.plots import plot_reward_curves, plot_reward_vs_time
from periodic_async.bench.protocol import SharedEngines
from periodic_async.records import write_csv
from periodic_async.config import RunConfig, load_config
from periodic_async.model import PRESETS
from periodic_async.pipeline import run
from periodic_async.trace import read_jsonl

HERE = Path(__file__).resolve().parent
MODES = ["sync-separated", "periodic-async", "async-offpolicy"]
QUICK = ["trainer.iterations=2", "trainer.eval_every=1", "data.num_train=1000", "data.num_eval=10",
         "algorithm.prompts_per_iteration=4", "algorithm.warmup_steps=1"]
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


def _modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"{text!r}: expected modes from {', '.join(MODES)}, comma-separated")
    return modes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 iterations, 20 held-out problems")
    ap.add_argument("--results", default=os.environ.get("RESULTS_DIR", "results"))
    ap.add_argument("--runs", default="runs/reward_curves")
    ap.add_argument("--figures", default=os.environ.get("FIGURES_DIR", "figures"))
    ap.add_argument("--config", default=str(HERE / "reward_curves.yaml"),
                    help="the experiment (e.g. experiments/reward_curves_real.yaml)")
    ap.add_argument("--tag", default="", help="suffix of the outputs: reward_curves_<tag>.csv, ...")
    ap.add_argument("--modes", type=_modes, default=MODES, help="comma-separated modes to run, in this order")
    ap.add_argument("overrides", nargs="*", help="section.key=value, applied to every mode")
    args = ap.parse_intermixed_args(argv)
    extra = (QUICK if args.quick else []) + list(args.overrides)
    config = Path(args.config)
    name = f"reward_curves_{args.tag}" if args.tag else "reward_curves"
    base = load_config(RunConfig, config, extra)
    if not Path(base.model.name_or_path).is_dir() and base.model.name_or_path not in PRESETS:
        from periodic_async.prepare import MODELS

        how = {m.out_dir: f"`python -m periodic_async prepare-model {k}`" for k, m in MODELS.items()}
        raise SystemExit(f"{base.model.name_or_path} (model.name_or_path of {config}) does not exist: "
                         + how.get(base.model.name_or_path.rstrip("/"), "`bash experiments/reward_curves.sh`")
                         + " builds it")
    rows, summary, outs = {}, [], {}
    engines = SharedEngines()  # started once; each mode's run pushes its own initial weights
    try:
        for mode in args.modes:
            cfg = load_config(RunConfig, config,
                              extra + [f"pipeline.mode={mode}", f"trainer.output_dir={args.runs}/{name}/{mode}"])
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
    finally:
        engines.close()
    sync = "sync-separated"
    for s in summary:
        if sync in rows:
            dr = max_abs_diff(rows[s["mode"]], rows[sync], "reward_mean")
            de = max_abs_diff(rows[s["mode"]], rows[sync], "eval_accuracy")
            s.update(max_abs_diff_reward=_r(dr, 6), max_abs_diff_eval=_r(de, 6),
                     max_abs_diff_vs_sync=_r(max(dr or 0.0, de or 0.0), 6),
                     tokens_identical_iterations=identical_iterations(outs[s["mode"]], outs[sync]))
    res = Path(args.results)
    commit = {s["mode"]: s["git_commit"] for s in summary}  # each run's tree (the machine: write_csv's stamp)
    for file, table in ((f"{name}.csv", [{**r, "git_commit": commit[m]} for m in rows for r in rows[m]]),
                        (f"{name}_summary.csv", summary)):
        print(f"wrote {write_csv(res / file, table)}")
    print(f"wrote {plot_reward_curves(res / f'{name}.csv', Path(args.figures) / f'{name}.png')}")
    print(f"wrote {plot_reward_vs_time(res / f'{name}.csv', Path(args.figures) / f'{name}_wallclock.png')}")
    for s in summary:
        print(s)


if __name__ == "__main__":
    sys.exit(main())
