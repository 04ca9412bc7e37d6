"""The paper's learning claims on tasks nobody here wrote: reasoning-gym's gsm_symbolic and
basic_arithmetic, each scored by the task's own verifier (data.source: reasoning-gym:NAME).

    bash experiments/reward_curves_tasks.sh                 (QUICK=1: a smoke run on a tiny preset)
    python experiments/reward_curves_tasks.py [--quick] [--tasks gsm_symbolic,basic_arithmetic]
        [--variants sync-separated,periodic-async,...] [--results results] [section.key=value ...]

Per task (its settings: TASKS below, on top of reward_curves_tasks.yaml, which says why these two):
  1. base        the model as prepared: held-out greedy accuracy through the engines (a run of 0
                 iterations). SmolLM2-135M-Instruct writes no <answer> tag under reasoning-gym's
                 prompt, so it scores about 0: hence
  2. warm start  `sft` on the task's training entries (the worked solution where the task has one,
                 then the tagged answer); its held-out accuracy is every RL run's version 0.
  3. RL          from the warm start, one seed: sync-separated and periodic-async (identical in
                 every iteration), async-offpolicy (the one-step-stale baseline), and the two
                 on-policy modes again with dynamic sampling (algorithm.dynamic_sampling).
Held-out accuracy (full credit, greedy, >= 200 held-out entries) every trainer.eval_every
iterations, with its standard error; the gain from version 0 to the end with the paired standard
error (the same entries) and its 95% interval; the verdict says whether the interval excludes 0.

Writes (after every run, merged with the rows of the tasks and variants not run this time, which
keep their values and git_commit)
  <results>/reward_curves_tasks.csv          one row per task, variant and iteration: reward_mean,
      accuracy (the batch, full credit), eval_accuracy / eval_stderr / eval_n, iteration_s, time_s,
      informative_frac (groups whose rewards differ, of all sampled), and with dynamic sampling
      drawn / kept / filtered / cap_reached
  <results>/reward_curves_tasks_summary.csv  one row per task and variant: base and warm-start
      accuracy, end accuracy, gain, gain_stderr_paired, ci95_low / ci95_high, verdict,
      max_abs_diff_vs_sync (the same variant in sync-separated: reward and held-out accuracy per
      iteration), mean_iteration_s, mean drawn / filtered per iteration, cap_reached_iterations,
      git_commit
  <figures>/reward_curves_tasks_<task>.png   reward and held-out accuracy per variant (its data:
      <results>/reward_curves_tasks_<task>.csv)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from periodic_async.bench.analysis import paired_gain_stderr
from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.plots import plot_reward_curves
from periodic_async.bench.protocol import SharedEngines
from periodic_async.records import read_csv, write_csv
from periodic_async.config import RunConfig, SFTRunConfig, load_config
from periodic_async.pipeline import run
from periodic_async.sft import run_sft
from periodic_async.trace import log_experiment, read_jsonl

HERE = Path(__file__).resolve().parent
TASKS = {
    # GSM8K's templates: long worked solutions (answer_cot) to warm-start on and to generate
    "gsm_symbolic": {"task_config": {},
                     "run": ["engine.max_tokens=192", "algorithm.prompts_per_iteration=8"],
                     "sft": ["sft.max_steps=100", "sft.batch_size=8", "sft.lr=3e-5", "sft.warmup_steps=10",
                             "sft.max_minutes=40"]},
    # the arithmetic family (the yaml says why this one): answers of a few tokens
    "basic_arithmetic": {"task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                         "operators": ["+", "-"]},
                         "run": [],
                         "sft": ["sft.max_steps=60", "sft.batch_size=8", "sft.lr=3e-5", "sft.warmup_steps=5",
                                 "sft.max_minutes=15"]},
}
VARIANTS = [("sync-separated", False), ("periodic-async", False), ("async-offpolicy", False),
            ("sync-separated", True), ("periodic-async", True)]
QUICK = ["model.name_or_path=qwen2-1m", "model.tokenizer=artifacts/tokenizer", "engine.backend=local",
         "data.num_train=64", "data.num_eval=8", "engine.max_tokens=8", "algorithm.prompts_per_iteration=2",
         "algorithm.group_size=2", "algorithm.max_draws_per_iteration=4", "algorithm.warmup_steps=1",
         "trainer.iterations=2", "trainer.eval_every=1"]
QUICK_SFT = ["sft.max_steps=3", "sft.batch_size=4", "sft.warmup_steps=1"]


def variant(mode: str, dynamic: bool) -> str:
    return mode + ("+dynamic" if dynamic else "")


def _r(x, nd=4):
    return "" if x is None or x == "" else round(float(x), nd)


def curve_rows(task: str, name: str, out: Path) -> list[dict]:
    """One row per version 0..N of one run (version = iterations completed)."""
    metrics = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m}
    evals = {e["step"]: e for e in read_jsonl(out / "eval.jsonl")} if (out / "eval.jsonl").is_file() else {}
    informative: dict[int, list[bool]] = {}
    for g in read_jsonl(out / "rollouts.jsonl") if (out / "rollouts.jsonl").is_file() else []:
        informative.setdefault(g["iteration"] + 1, []).append(len(set(g["rewards"])) > 1)
    rows, clock = [], 0.0
    for step in range(0, max([*metrics, *evals, 0]) + 1):
        m, e = metrics.get(step, {}), evals.get(step, {})
        clock += m.get("time/iteration_s", 0.0)
        inf = informative.get(step)
        rows.append({"task": task, "mode": name, "iteration": step, "reward_mean": _r(m.get("reward/mean")),
                     "accuracy": _r(m.get("accuracy")), "eval_accuracy": _r(e.get("accuracy")),
                     "eval_stderr": _r(e.get("stderr")), "eval_n": e.get("n", ""),
                     "iteration_s": _r(m.get("time/iteration_s"), 2), "time_s": round(clock, 2),
                     "informative_frac": _r(sum(inf) / len(inf)) if inf else "",
                     **{k: m.get(f"dynamic/{k}", "") for k in ("drawn", "kept", "filtered", "cap_reached")},
                     "clip_frac": _r(m.get("train/clip_frac"), 6),
                     "ratio_abs_dev": _r(m.get("train/ratio_abs_dev"), 6)})
    return rows


def _max_abs_diff(a: list[dict], b: list[dict]) -> float | str:
    pairs = [(float(x[k]), float(y[k])) for x, y in zip(a, b) for k in ("reward_mean", "eval_accuracy")
             if x[k] != "" and y[k] != ""]
    return _r(max(abs(x - y) for x, y in pairs), 6) if pairs else ""


def summary_row(task: str, name: str, out: Path, rows: list[dict], base: dict) -> dict:
    ev = [r for r in rows if r["eval_accuracy"] != ""]
    first, last = ev[0], ev[-1]
    gain = float(last["eval_accuracy"]) - float(first["eval_accuracy"])
    se = paired_gain_stderr(out, first["iteration"], last["iteration"])
    lo, hi = (gain - 1.96 * se, gain + 1.96 * se) if se is not None else (None, None)
    trained = [r for r in rows if r["iteration_s"] != ""]

    def mean(k: str):
        return _r(sum(float(r[k]) for r in trained) / len(trained), 3) if trained and trained[0][k] != "" else ""

    return {"task": task, "mode": name, "base_accuracy": _r(base["accuracy"]), "base_stderr": _r(base["stderr"]),
            "warm_start_accuracy": first["eval_accuracy"], "warm_start_stderr": first["eval_stderr"],
            "eval_accuracy_end": last["eval_accuracy"], "eval_stderr_end": last["eval_stderr"],
            "eval_n": last["eval_n"], "iterations": last["iteration"], "gain": _r(gain), "gain_stderr_paired": _r(se),
            "ci95_low": _r(lo), "ci95_high": _r(hi),
            "verdict": "" if lo is None else "met: the 95% interval excludes 0" if lo > 0 else "missed",
            "max_abs_diff_vs_sync": "", "mean_iteration_s": mean("iteration_s"), "mean_drawn": mean("drawn"),
            "mean_filtered": mean("filtered"),
            "cap_reached_iterations": sum(int(r["cap_reached"] or 0) for r in trained),
            "git_commit": json.loads((out / "run_info.json").read_text())["git_commit"]}


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, runs="runs/reward_curves_tasks", figures=True, overrides=True)
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    ap.add_argument("--variants", default=",".join(variant(*v) for v in VARIANTS),
                    help="comma-separated, run in this order; each run's rows replace its earlier ones in the CSVs, "
                         "beside the other tasks' and variants'")
    ap.add_argument("--config", default=str(HERE / "reward_curves_tasks.yaml"))
    ap.add_argument("--reuse", action="store_true",
                    help="keep the runs under --runs that finished (a stopped experiment resumes where it stopped)")
    args = ap.parse_intermixed_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"--tasks: unknown {unknown}; expected some of {', '.join(TASKS)}")
    names = {variant(*v): v for v in VARIANTS}
    chosen = [names[n] for n in args.variants.split(",") if n in names]
    if len(chosen) != len([n for n in args.variants.split(",") if n]):
        raise SystemExit(f"--variants: {args.variants}; expected some of {', '.join(names)}")
    runs, res = Path(args.runs), Path(args.results)
    written: list[Path] = []
    figures: dict[Path, None] = {}
    engines = SharedEngines()  # one per configuration; each run pushes its own initial weights
    try:
        for task in tasks:
            spec = TASKS[task]
            settings = [f"data.source=reasoning-gym:{task}", f"data.task_config={json.dumps(spec['task_config'])}",
                        *spec["run"], *(QUICK if args.quick else []), *args.overrides]
            cfg = load_config(RunConfig, args.config, settings)
            # 1. the base model's held-out accuracy: a run of no iteration, evaluated at its end
            base_out = runs / task / "base"
            if not (args.reuse and (base_out / "eval.jsonl").is_file()):
                run(load_config(RunConfig, args.config, settings + [
                    f"trainer.output_dir={base_out}", "trainer.iterations=0", "trainer.eval_at_end=true"]),
                    engine=engines.get(cfg))
            base = read_jsonl(base_out / "eval.jsonl")[-1]
            # 2. the warm start on the training entries (its held-out accuracy: the RL runs' version 0)
            warm = runs / task / "sft"
            m, d = cfg.model, cfg.data
            if not (args.reuse and (warm / "config.json").is_file()):
                run_sft(load_config(SFTRunConfig, None, [
                    f"model.name_or_path={m.name_or_path}", f"model.tokenizer={m.tokenizer}", f"model.dtype={m.dtype}",
                    f"data.source={d.source}", f"data.task_config={json.dumps(d.task_config)}", f"data.seed={d.seed}",
                    f"data.num_train={d.num_train}", "data.num_eval=0", f"sft.output_dir={warm}",
                    f"logging.wandb_mode={cfg.logging.wandb_mode}", *spec["sft"], *(QUICK_SFT if args.quick else [])]))
            # 3. RL from the warm start, every variant from one seed
            for mode, dynamic in chosen:
                name = variant(mode, dynamic)
                out = runs / task / name
                rl = load_config(RunConfig, args.config, settings + [
                    f"model.name_or_path={warm}", f"pipeline.mode={mode}", f"algorithm.dynamic_sampling={dynamic}",
                    f"trainer.output_dir={out}"])
                if not (args.reuse and (out / "summary.json").is_file()):
                    run(rl, engine=engines.get(rl))
                rows = curve_rows(task, name, out)
                s = summary_row(task, name, out, rows, base)
                print(f"[reward_curves_tasks] {task} {name}: {s['warm_start_accuracy']} -> {s['eval_accuracy_end']} "
                      f"(n={s['eval_n']}), gain {s['gain']} +- {s['gain_stderr_paired']}")
                # after every run, so that a stopped experiment keeps what it finished
                *written, figure = save(res, Path(args.figures), task, name, rows, s)
                figures[figure] = None
    finally:
        engines.close()
    for path in [*written, *figures]:
        print(f"wrote {path}")
    log_experiment("reward_curves_tasks", written, list(figures))


def _order(r: dict) -> tuple:
    names = [variant(*v) for v in VARIANTS]
    return (list(TASKS).index(r["task"]) if r["task"] in TASKS else len(TASKS),
            names.index(r["mode"]) if r["mode"] in names else len(names), int(r.get("iteration") or 0))


def save(res: Path, figures: Path, task: str, name: str, rows: list[dict], s: dict) -> list[Path]:
    """Merge one run (its curve `rows`, its summary row `s`) into the CSVs under `res`: the rows of
    every other task and variant, from an earlier invocation (`--tasks`/`--variants` pick a subset),
    keep their values and their git_commit. Then each summary row of `task` gets its distance to the
    sync-separated run of the same dynamic setting, and the task's figure is redrawn."""
    curves_path, summary_path = res / "reward_curves_tasks.csv", res / "reward_curves_tasks_summary.csv"
    old_curves = read_csv(curves_path) if curves_path.is_file() else []
    old_summary = read_csv(summary_path) if summary_path.is_file() else []
    curves = sorted([r for r in old_curves if (r["task"], r["mode"]) != (task, name)] + rows, key=_order)
    summary = sorted([r for r in old_summary if (r["task"], r["mode"]) != (task, name)] + [s], key=_order)
    by_mode = {m: [r for r in curves if (r["task"], r["mode"]) == (task, m)] for m in {r["mode"] for r in curves}}
    for r in summary:
        sync = variant("sync-separated", r["mode"].endswith("+dynamic"))
        if r["task"] == task and by_mode.get(r["mode"]) and by_mode.get(sync):
            r["max_abs_diff_vs_sync"] = _max_abs_diff(by_mode[r["mode"]], by_mode[sync])
    per_task = write_csv(res / f"reward_curves_tasks_{task}.csv", [r for r in curves if r["task"] == task])
    return [write_csv(curves_path, curves), write_csv(summary_path, summary),
            plot_reward_curves(per_task, figures / f"reward_curves_tasks_{task}.png")]


if __name__ == "__main__":
    sys.exit(main())
