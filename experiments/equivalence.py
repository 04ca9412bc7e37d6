"""On-policy equivalence, iteration by iteration: sync-separated vs periodic-async from one
seed in float64 (the paper, Sec. method point 4), and the negative control that breaks it.

    python experiments/equivalence.py [--quick] [--results results] [section.key=value ...]

    equivalent   one optimizer step per iteration (the method): every sample of the two runs
                 is the same token sequence and the weights agree to float64 rounding, although
                 the async trainer consumed the groups in completion order.
    two-steps    algorithm.optimizer_steps_per_iteration=2 in both modes: the first step sees
                 the first half of the groups, in dataset order (sync) or completion order
                 (async), so the weights part after iteration 0 and the samples from then on.
    real-model   the same on SmolLM2-135M-Instruct in float32 (`python -m periodic_async
                 prepare-model smollm2-135m`), through its chat template: the samples are
                 identical until a float32 summation-order difference in the trainer flips a
                 token, and the weight gap per iteration is float32 rounding.
    real-model-two-steps   its negative control.
    real-model-lora, real-model-lora-two-steps   the same two with LoRA adapters (rank 16 on every
                 projection, lr 1e-4): the engines serve each pushed adapter (vLLM's LoRA requests on
                 the Ray worker); the weights compared are the merged checkpoints.
    episodes, real-model-episodes   `equivalent` and `real-model` on multi-turn episodes: a verifier
                 (episode/envs.py CalculatorEnv, 3 attempts) answers every wrong reply after a
                 random but reproducible wait, so groups finish in another order than they were
                 drawn; each later turn continues the episode's ids on the engine. Samples compare
                 whole episodes (model and environment ids).
The runs stop after every iteration and resume from their checkpoint (resuming continues the
same trajectory: tests/test_pipeline.py), so the weights are compared after each iteration.
The control uses the in-process engine, whose lock-step workers give a completion order that
does not depend on the machine's timing (so the control is the same on every run).

Writes <results>/equivalence.csv (case, iteration, samples, identical_samples,
identical_fraction, max_abs_weight_diff, max_abs_weight_change, trained_in_other_order) and
<figures>/equivalence.png (`plots.plot_equivalence`, also called by notebooks/equivalence.ipynb).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from periodic_async.bench.analysis import compare_iteration
from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.plots import plot_equivalence
from periodic_async.records import STAMP, read_csv, write_csv
from periodic_async.config import RunConfig, load_config
from periodic_async.trace import log_experiment, read_jsonl

HERE = Path(__file__).resolve().parent
MODES = ["sync-separated", "periodic-async"]
REAL_MODEL = ["model.name_or_path=artifacts/smollm2-135m-instruct", "model.dtype=float32", "data.few_shot=0",
              "algorithm.group_size=4", "algorithm.prompts_per_iteration=4", "engine.max_tokens=32",
              "engine.max_num_seqs=8", "algorithm.micro_batch_tokens=512", "trainer.iterations=3"]
LORA = ["model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32", "algorithm.lr=1e-4"]
EPISODES = ["env.factory=periodic_async.episode.envs:CalculatorEnv", "env.tool_format=plain", "env.max_turns=3",
            "env.factory_kwargs={attempts: 3, latency: {median_s: 0.2, p99_s: 3.0, scale: 0.1, seed: 1}}"]
CASES = {"equivalent": ([], "ray"), "two-steps": (["algorithm.optimizer_steps_per_iteration=2"], "local"),
         "real-model": (REAL_MODEL, "ray"),
         "real-model-two-steps": (REAL_MODEL + ["algorithm.optimizer_steps_per_iteration=2"], "local"),
         "real-model-lora": (REAL_MODEL + LORA, "ray"),
         "real-model-lora-two-steps": (REAL_MODEL + LORA + ["algorithm.optimizer_steps_per_iteration=2"], "local"),
         "episodes": (EPISODES + ["env.max_tokens=160"], "ray"),
         "real-model-episodes": (REAL_MODEL + EPISODES + ["env.max_tokens=192"], "ray")}
COLUMNS = ["case", "iteration", "samples", "identical_samples", "identical_fraction", "max_abs_weight_diff",
           "max_abs_weight_change", "trained_in_other_order", "git_commit", "cpu"]


def _weights(run_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint", dtype=torch.float64)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run_case(case: str, overrides: list[str], backend: str, runs: Path) -> list[dict]:
    from periodic_async.engine import make_engine
    from periodic_async.lora import is_lora
    from periodic_async.model import load_policy
    from periodic_async.pipeline import run

    cfgs = {m: load_config(RunConfig, HERE / "equivalence.yaml", overrides + [
        f"pipeline.mode={m}", f"trainer.output_dir={runs}/{case}/{m}", "trainer.resume=auto"]) for m in MODES}
    iterations = cfgs[MODES[0]].trainer.iterations
    policy0 = load_policy(cfgs[MODES[0]].model)[0]
    w0 = (policy0.merge_and_unload() if is_lora(policy0) else policy0).state_dict()  # as the checkpoints hold it
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
    ap = experiment_parser(__doc__, runs="runs/equivalence", figures=True, overrides=True)
    ap.add_argument("--cases", default=None, help=f"comma-separated cases (default: all of {list(CASES)}); "
                    "the other cases' rows of an earlier run are kept")
    args = ap.parse_args(argv)
    # QUICK runs the same code on the tiny model's cases (the real-model cases differ only in config)
    cases = args.cases.split(",") if args.cases else [c for c in CASES if not (args.quick and c.startswith("real"))]
    if unknown := [c for c in cases if c not in CASES]:
        raise SystemExit(f"--cases: {unknown} not in {list(CASES)}")
    # QUICK: one resumed iteration after the first, a batch that still fills the engines' 16 slots at once
    quick = ["trainer.iterations=2", "algorithm.prompts_per_iteration=4", "engine.max_tokens=16"] if args.quick else []
    extra = ["logging.wandb_group=equivalence"] + args.overrides
    from periodic_async.model import PRESETS

    model = load_config(RunConfig, HERE / "equivalence.yaml", extra).model.name_or_path
    tiny = any(not c.startswith("real") for c in cases)
    if tiny and model not in PRESETS and not Path(model).is_dir():
        raise SystemExit(f"{model} not found: run `bash experiments/warm_start.sh` first "
                         "(or pass model.name_or_path=...)")
    if tiny and Path(model).is_dir():  # one frozen copy: every run (and resume) starts from the same weights
        frozen = Path(args.runs) / "base_model"
        shutil.rmtree(frozen, ignore_errors=True)
        shutil.copytree(model, frozen, ignore=shutil.ignore_patterns("wandb", "*.jsonl"))
        extra.append(f"model.name_or_path={frozen}")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    old = out / "equivalence.csv"
    # the other cases' rows of an earlier run keep the provenance they had (an empty cell where it had none)
    rows = [{**dict.fromkeys(STAMP, ""), **r, "max_abs_weight_diff": float(r["max_abs_weight_diff"]),
             "max_abs_weight_change": float(r["max_abs_weight_change"])}
            for r in (read_csv(old) if old.is_file() else []) if r["case"] not in cases]
    for case in cases:
        overrides, backend = CASES[case]
        rows += run_case(case, extra + overrides + quick, backend, Path(args.runs))
    rows.sort(key=lambda r: (list(CASES).index(r["case"]), int(r["iteration"])))
    write_csv(out / "equivalence.csv", [{**r, "max_abs_weight_diff": f"{r['max_abs_weight_diff']:.3g}",
                                         "max_abs_weight_change": f"{r['max_abs_weight_change']:.3g}"} for r in rows],
              COLUMNS)
    png = plot_equivalence(out / "equivalence.csv", Path(args.figures) / "equivalence.png")
    log_experiment("equivalence", [out / "equivalence.csv"], [png])
    print(f"[equivalence] wrote {out}/equivalence.csv, {png}")
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
