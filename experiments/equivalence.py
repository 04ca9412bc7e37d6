"""On-policy equivalence, iteration by iteration: sync-separated vs periodic-async from one
seed in float64 (the paper, Sec. method point 4), and the negative control that breaks it.

    python experiments/equivalence.py [--quick] [--results results] [section.key=value ...]

    equivalent   one optimizer step per iteration (the method): every sample of the two runs
                 is the same token sequence and the weights agree to float64 rounding, although
                 the async trainer consumed the groups in completion order.
    two-steps    algorithm.optimizer_steps_per_iteration=2 in both modes: the first step sees
                 the first half of the groups, in dataset order (sync) or completion order
                 (async), so the weights part after iteration 0 and the samples from then on.
The runs stop after every iteration and resume from their checkpoint (resuming continues the
same trajectory: tests/test_pipeline.py), so the weights are compared after each iteration.
The control uses the in-process engine, whose lock-step workers give a completion order that
does not depend on the machine's timing (so the control is the same on every run).

Writes <results>/equivalence.csv (case, iteration, samples, identical_samples,
identical_fraction, max_abs_weight_diff, max_abs_weight_change, trained_in_other_order) and
<figures>/equivalence.png (`plots.plot_equivalence`, also called by notebooks/equivalence.ipynb).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
from pathlib import Path

from periodic_async.bench.analysis import compare_iteration
from periodic_async.bench.plots import plot_equivalence
from periodic_async.config import RunConfig, load_config
from periodic_async.trace import log_experiment, read_jsonl

HERE = Path(__file__).resolve().parent
MODES = ["sync-separated", "periodic-async"]
CASES = {"equivalent": ([], "ray"), "two-steps": (["algorithm.optimizer_steps_per_iteration=2"], "local")}
COLUMNS = ["case", "iteration", "samples", "identical_samples", "identical_fraction", "max_abs_weight_diff",
           "max_abs_weight_change", "trained_in_other_order"]


def _weights(run_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint", dtype=torch.float64).state_dict()


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run_case(case: str, overrides: list[str], backend: str, runs: Path) -> list[dict]:
    from periodic_async.engine import make_engine
    from periodic_async.model import load_policy
    from periodic_async.pipeline import run

    cfgs = {m: load_config(RunConfig, HERE / "equivalence.yaml", overrides + [
        f"pipeline.mode={m}", f"trainer.output_dir={runs}/{case}/{m}", "trainer.resume=auto"]) for m in MODES}
    iterations = cfgs[MODES[0]].trainer.iterations
    w0 = load_policy(cfgs[MODES[0]].model)[0].state_dict()
    rows = []
    for cfg in cfgs.values():  # a fresh start: resume only from this experiment's own checkpoints
        shutil.rmtree(cfg.trainer.output_dir, ignore_errors=True)
    with make_engine(cfgs[MODES[0]].engine, cfgs[MODES[0]].model, backend=backend) as engine:
        for k in range(1, iterations + 1):
            for m, cfg in cfgs.items():
                cfg.trainer.iterations = k  # stop after iteration k-1, resume there for the next
                run(cfg, engine=engine)
            ws, wa = (_weights(Path(cfgs[m].trainer.output_dir)) for m in MODES)
            sync_rows, async_rows = ([r for r in read_jsonl(Path(cfgs[m].trainer.output_dir) / "rollouts.jsonl")
                                      if r["iteration"] == k - 1] for m in MODES)
            rows.append({"case": case, "iteration": k - 1, **compare_iteration(sync_rows, async_rows),
                         "max_abs_weight_diff": _max_diff(ws, wa), "max_abs_weight_change": _max_diff(ws, w0)})
            print(f"[equivalence] {rows[-1]}")
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default="results")
    ap.add_argument("--runs", default="runs/equivalence")
    ap.add_argument("--figures", default=os.environ.get("FIGURES_DIR", "figures"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    extra = (["trainer.iterations=2"] if args.quick else []) + ["logging.wandb_group=equivalence"] + args.overrides
    from periodic_async.model import PRESETS

    model = load_config(RunConfig, HERE / "equivalence.yaml", extra).model.name_or_path
    if model not in PRESETS and not Path(model).is_dir():
        raise SystemExit(f"{model} not found: run `bash experiments/warm_start.sh` first (or pass model.name_or_path=...)")
    if Path(model).is_dir():  # one frozen copy: every run (and resume) starts from the same weights
        frozen = Path(args.runs) / "base_model"
        shutil.rmtree(frozen, ignore_errors=True)
        shutil.copytree(model, frozen, ignore=shutil.ignore_patterns("wandb", "*.jsonl"))
        extra.append(f"model.name_or_path={frozen}")
    rows = []
    for case, (overrides, backend) in CASES.items():
        rows += run_case(case, extra + overrides, backend, Path(args.runs))
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "equivalence.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({**r, "max_abs_weight_diff": f"{r['max_abs_weight_diff']:.3g}",
                     "max_abs_weight_change": f"{r['max_abs_weight_change']:.3g}"} for r in rows)
    png = plot_equivalence(out / "equivalence.csv", Path(args.figures) / "equivalence.png")
    log_experiment("equivalence", [out / "equivalence.csv"], [png])
    print(f"[equivalence] wrote {out}/equivalence.csv, {png}")
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
