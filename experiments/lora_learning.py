"""LoRA against full fine-tuning (beyond the paper): does the adapter learn what full fine-tuning learns?

The full fine-tuning curve's workload (reward_curves_real.yaml: SmolLM2-135M-Instruct,
periodic-async) with LoRA r=16 (alpha 32, the merged push: bench/lora_setting.py), its learning
rate chosen by a short sweep, then held-out accuracy before and after the curve's 20 iterations.

The sweep (unless --lr): `trainer.iterations` = --sweep-iterations at each of LRS (constant after
one warm-up step), then greedy accuracy on a validation draw (data.seed=1: other training prompts
and other evaluation problems than the final run's data.seed=0, though a small problem space may
share some); the lr with the highest validation accuracy wins. Batch accuracy cannot rank a few
iterations: full fine-tuning's stays flat over its first five (reward_curves_real.csv) while its
held-out accuracy rises. With --lr the sweep is skipped (chosen_by: given). The final run: that
lr on the full curve's settings (20 iterations, cosine, held-out accuracy every 5), run and
written as experiments/reward_curves.py's curves are (bench/curves.py), on the sweep's engine:
reward_curves_real_lora{,_summary}.csv and their figures.

    python experiments/lora_learning.py [--quick] [--lr LR]   # the sweep, then the final run
    python experiments/lora_learning.py --sweep-only          # the sweep alone; an earlier final run's row kept

Writes <results>/lora_learning.csv (kind sweep | final). --quick: one rate, tiny batches, 2 iterations each run.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.curves import run_curves, write_curves
from periodic_async.bench.lora_setting import RUN_OVERRIDES
from periodic_async.bench.protocol import SharedEngines
from periodic_async.records import read_csv, write_csv
from periodic_async.config import RunConfig, load_config
from periodic_async.pipeline import run
from periodic_async.trace import log_experiment, read_jsonl

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "reward_curves_real.yaml"
LRS = (3e-5, 1e-4, 3e-4)
"""The LoRA learning rates of the sweep: 3x to 30x full fine-tuning's 1e-5 (reward_curves_real.yaml)."""
QUICK = ["data.num_train=200", "algorithm.prompts_per_iteration=2", "algorithm.group_size=2", "engine.max_tokens=8"]
QUICK_FINAL = ["trainer.iterations=2", "trainer.eval_every=2", "data.num_eval=2", "algorithm.warmup_steps=1"]
"""The final run's smoke size, over QUICK (with experiments/reward_curves.py's --quick warm-up of one step)."""


def sweep(args, engines: SharedEngines) -> list[dict]:
    """One periodic-async run per learning rate (one with --quick), then its validation accuracy."""
    quick = QUICK if args.quick else []
    rows = []
    for lr in LRS[:1] if args.quick else LRS:
        cfg = load_config(RunConfig, CONFIG, RUN_OVERRIDES + quick + [
            f"algorithm.lr={lr}", "algorithm.lr_scheduler=constant", "algorithm.warmup_steps=1",
            f"trainer.iterations={args.sweep_iterations}", "data.seed=1",
            f"data.num_eval={2 if args.quick else args.sweep_eval}", "trainer.eval_every=0",
            "trainer.eval_at_end=true", f"trainer.output_dir={args.runs}/sweep-lr{lr:g}"])
        run(cfg, engine=engines.get(cfg))
        out = Path(cfg.trainer.output_dir)
        acc = [m["accuracy"] for m in read_jsonl(out / "metrics.jsonl") if "accuracy" in m]
        val = read_jsonl(out / "eval.jsonl")[-1]
        rows.append({"kind": "sweep", "lr": lr, "iterations": len(acc), "chosen_by": "validation accuracy",
                     "validation_accuracy": round(val["accuracy"], 4), "validation_n": val["n"],
                     "batch_accuracy": round(statistics.mean(acc), 4)})
        print(f"[lora_learning] sweep lr={lr:g}: batch accuracy {[round(a, 3) for a in acc]}, "
              f"validation {val['accuracy']:.3f}", flush=True)
    best = max(rows, key=lambda r: r["validation_accuracy"])
    best["chosen"] = True
    return rows


def final(args, lr: float, chosen_by: str, engines: SharedEngines) -> dict:
    """The full curve's run at `lr` (reward_curves_real_lora{,_summary}.csv); its summary as a `final` row."""
    quick = QUICK + QUICK_FINAL if args.quick else []
    name = "reward_curves_real_lora"
    rows, summary = run_curves(CONFIG, name, ["periodic-async"], quick + RUN_OVERRIDES + [f"algorithm.lr={lr}"],
                               args.runs, engines)
    write_curves(name, rows, summary, args.results, args.figures)
    iterations = load_config(RunConfig, CONFIG, quick).trainer.iterations
    return {"kind": "final", "lr": lr, "chosen_by": chosen_by, "iterations": iterations,
            **{k: summary[0][k] for k in ("eval_accuracy_start", "eval_accuracy_end", "eval_n", "gain", "gain_stderr",
                                          "gain_stderr_paired", "wall_s")}}


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, runs="runs/lora_learning", figures=True)
    ap.add_argument("--sweep-only", action="store_true",
                    help="the sweep alone: its rows replace an earlier sweep's, an earlier final run's row is kept")
    ap.add_argument("--sweep-iterations", type=int, default=None,
                    help="iterations of each learning-rate sweep run (default 4; 2 with --quick)")
    ap.add_argument("--sweep-eval", type=int, default=100, help="validation problems of each sweep run")
    ap.add_argument("--lr", type=float, default=None, help="the learning rate of the final run (no sweep)")
    args = ap.parse_args(argv)
    args.sweep_iterations = args.sweep_iterations or (2 if args.quick else 4)
    if args.sweep_only and args.lr:
        ap.error("--sweep-only runs the sweep, --lr skips it: give one")
    path = Path(args.results) / "lora_learning.csv"
    engines = SharedEngines()  # one engine for the sweep and the final run: each run pushes its own weights
    try:
        rows = [] if args.lr else sweep(args, engines)
        if args.sweep_only:
            rows += [r for r in (read_csv(path) if path.is_file() else []) if r["kind"] == "final"]
        else:
            best = next((r for r in rows if r.get("chosen")), {"lr": args.lr, "chosen_by": "given (--lr)"})
            rows.append(final(args, best["lr"], best["chosen_by"], engines))
    finally:
        engines.close()
    write_csv(path, rows)
    print(f"[lora_learning] wrote {path}: {rows[-1]}")
    log_experiment("lora_learning", [path])


if __name__ == "__main__":
    main()
