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

What the curves are sensitive to (task, lr, schedule, base): experiments/reward_curves.yaml's comments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.curves import MODES, run_curves, write_curves
from periodic_async.bench.protocol import SharedEngines
from periodic_async.config import RunConfig, load_config
from periodic_async.model import PRESETS

HERE = Path(__file__).resolve().parent
QUICK = ["trainer.iterations=2", "trainer.eval_every=1", "data.num_train=1000", "data.num_eval=10",
         "algorithm.prompts_per_iteration=4", "algorithm.warmup_steps=1"]


def _modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"{text!r}: expected modes from {', '.join(MODES)}, comma-separated")
    return modes


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, runs="runs/reward_curves", figures=True, overrides=True)
    ap.add_argument("--config", default=str(HERE / "reward_curves.yaml"),
                    help="the experiment (e.g. experiments/reward_curves_real.yaml)")
    ap.add_argument("--tag", default="", help="suffix of the outputs: reward_curves_<tag>.csv, ...")
    ap.add_argument("--modes", type=_modes, default=MODES, help="comma-separated modes to run, in this order")
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
    engines = SharedEngines()  # started once; each mode's run pushes its own initial weights
    try:
        rows, summary = run_curves(config, name, args.modes, extra, args.runs, engines)
    finally:
        engines.close()
    write_curves(name, rows, summary, args.results, args.figures)
    for s in summary:
        print(s)


if __name__ == "__main__":
    sys.exit(main())
