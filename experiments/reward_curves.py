"""Reward and accuracy curves of sync-separated vs periodic-async RL from one seed.

    python experiments/reward_curves.py [--quick] [--results results] [section.key=value ...]

Writes <results>/reward_curves.csv (mode,iteration,reward_mean,accuracy,eval_accuracy),
<results>/reward_curves_summary.csv (mode,eval_accuracy_start,eval_accuracy_end,
tokens_identical_iterations) and figures/reward_curves.png. In exact arithmetic the two
runs are identical; in fp32 they share every sampled token until a summation-order
difference flips a sample, after which they are two draws of the same process.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

from periodic_async.config import RunConfig, load_config
from periodic_async.data import few_shot_examples, load_examples
from periodic_async.evaluate import evaluate
from periodic_async.model import load_policy
from periodic_async.pipeline import run
from periodic_async.plots import plot_reward_curves
from periodic_async.trace import read_jsonl

HERE = Path(__file__).resolve().parent
MODES = ["sync-separated", "periodic-async"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default="results")
    ap.add_argument("--runs", default="runs/reward_curves")
    ap.add_argument("--figures", default=os.environ.get("FIGURES_DIR", "figures"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    extra = list(args.overrides)
    base = load_config(RunConfig, HERE / "reward_curves.yaml", extra)
    if not Path(base.model.name_or_path).is_dir():
        raise SystemExit(f"{base.model.name_or_path} does not exist: run `bash experiments/warm_start.sh` first")
    if args.quick:
        extra += ["trainer.iterations=4", "trainer.eval_every=2", "data.num_eval=40"]
    cfg0 = load_config(RunConfig, HERE / "reward_curves.yaml", extra)
    model, tok = load_policy(cfg0.model)
    start = evaluate(model, tok, load_examples(cfg0.data, "eval"), few_shot_examples(cfg0.data),
                     cfg0.engine.max_tokens)["accuracy"]
    rows, summary, rollouts = [], [], {}
    for mode in MODES:
        cfg = load_config(RunConfig, HERE / "reward_curves.yaml",
                          extra + [f"pipeline.mode={mode}", f"trainer.output_dir={args.runs}/{mode}"])
        s = run(cfg)
        out = Path(cfg.trainer.output_dir)
        for m in read_jsonl(out / "metrics.jsonl"):
            rows.append({"mode": mode, "iteration": m["step"], "reward_mean": round(m["reward/mean"], 4),
                         "accuracy": round(m["accuracy"], 4), "eval_accuracy": m.get("eval/accuracy", "")})
        rollouts[mode] = read_jsonl(out / "rollouts.jsonl")
        summary.append({"mode": mode, "eval_accuracy_start": start, "eval_accuracy_end": s.get("eval_accuracy")})
    # How long did the two runs sample identical tokens?
    by_it = [{(r["iteration"], r["prompt_index"]): r["response_ids"] for r in rollouts[m]} for m in MODES]
    iterations = sorted({k[0] for k in by_it[0]})
    same = 0
    for it in iterations:
        if all(by_it[0][k] == by_it[1].get(k) for k in by_it[0] if k[0] == it):
            same += 1
        else:
            break
    for s in summary:
        s["tokens_identical_iterations"] = f"{same}/{len(iterations)}"
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    for name, table in (("reward_curves.csv", rows), ("reward_curves_summary.csv", summary)):
        with (res / name).open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    plot_reward_curves(res / "reward_curves.csv", Path(args.figures) / "reward_curves.png")
    for s in summary:
        print(s)


if __name__ == "__main__":
    sys.exit(main())
