"""The paper's Table 2 at CPU scale: end-to-end trained tokens/s of TRL's GRPOTrainer (the
mainstream framework a user would otherwise pick), generating with transformers (`trl-grpo`)
and with vLLM (`trl-grpo-vllm`, TRL's colocate mode), and of our three modes, each with and
without shared-prompt packing, on one model, tokenizer, prompt set and reward. Speedups are
quoted against the faster of the two TRL configurations (`trl_baseline` names it).

    bash experiments/table2_throughput.sh              # ~50 min on 2 cores; QUICK=1: ~1 min
    python experiments/table2_throughput.py [--quick] [--repeats N] [--results results] [--figures figures]
                                            [--runs runs/table2] [section.key=value ...]

What is the same for every system (experiments/table2_throughput.yaml): model, tokenizer,
prompts, reward (correctness), B prompts per step, G samples each, max new tokens,
temperature, lr, beta, clip range, token-mean loss over the whole batch (TRL's "dapo") and
one optimizer step per generation batch. How TRL is run, and how its tokens are counted and
checked against ours: periodic_async/bench/trl.py. Each system keeps its own best execution
settings (micro-batch sizes, deployment), recorded in the CSV's `settings` column.
Trained tokens = sum over samples of (P + R_i) in every system; tokens/s excludes the first
iteration (TRL: the first optimizer step) of every run.

The benchmark protocol is periodic_async.bench: systems interleaved, `bench.repeats` rounds,
median with min and max; the speedup columns are ratios of medians, their _min/_max the
paired ratios round by round. Writes results/table2_throughput.csv,
results/table2_token_check.csv (TRL's count and ours per step), results/table2_batch_effect.csv
(the effect of B on sync-separated vs periodic-async) and figures/table2_throughput.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

import yaml

from periodic_async.bench.plots import plot_table2
from periodic_async.bench.protocol import SharedEngines, System, flatten, measure, write_csv
from periodic_async.bench.trl import export_model, run_trl, trl_settings
from periodic_async.config import RunConfig, load_config
from periodic_async.data import few_shot_examples, iteration_prompts, load_examples, prompt_messages
from periodic_async.data.prompts import encode_chat
from periodic_async.data.tokenizer import ensure_tokenizer
from periodic_async.engine.ray_engine import init_ray
from periodic_async.model import PRESETS
from periodic_async.pipeline import run
from periodic_async.records import git_commit

HERE = Path(__file__).resolve().parent
IGNORE = ("trainer.output_dir", "logging.")  # not settings of the measured system
MODES = ["sync-colocated", "sync-separated", "periodic-async"]
COLUMNS = ["setting", "system", "shared_prompt", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "repeats",
           "measured_iterations", "devices", "speedup_vs_trl", "speedup_vs_sync_colocated", "paper_speedup",
           "git_commit", "config_hash", "speedup_vs_trl_min", "speedup_vs_trl_max", "mean_prompt_tokens",
           "samples_per_iteration", "trl_baseline", "settings"]


def read_csv(path: Path) -> list[dict]:
    """The rows of an earlier run's CSV (none when it does not exist)."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def load_plan(path: Path, quick: bool) -> dict:
    """The YAML plan; with `quick`, its `quick` section merged over it (one level deep per section)."""
    plan = yaml.safe_load(path.read_text())
    if quick:
        for section, over in plan.get("quick", {}).items():
            if section == "run":
                plan["run_quick"] = over
            elif section == "settings":
                for name, o in over.items():
                    plan["settings"][name] = {**plan["settings"][name], **o}
            else:
                plan[section] = {**plan[section], **over}
    return plan


def as_overrides(tree: dict) -> list[str]:
    """Nested or dotted mapping -> ['section.key=<json value>'] for `load_config`."""
    return [f"{k}={json.dumps(v)}" for k, v in flatten(tree).items()]


def run_config(plan: dict, setting: str, extra: list[str]) -> RunConfig:
    over = as_overrides(plan["run"]) + as_overrides(plan.get("run_quick", {})) + as_overrides(plan["settings"][setting])
    return load_config(RunConfig, None, over + extra)


# --- the experiment ---------------------------------------------------------------------------

def pipeline_system(plan, setting, mode, shared, extra, runs: Path, engines: SharedEngines, name=None) -> System:
    packing = "shared" if shared else "per-response"
    name = name or f"{mode}/{packing}"
    system = plan["systems"][mode]
    budget = system["micro_batch_tokens"][packing]
    budget = budget[setting] if isinstance(budget, dict) else budget  # one value, or one per setting
    over = as_overrides(system["overrides"]) + as_overrides(system.get("per_setting", {}).get(setting, {})) + [
        f"algorithm.shared_prompt={shared}", f"algorithm.micro_batch_tokens={budget}",
        f"trainer.output_dir={runs / setting / name.replace('/', '-')}"]
    cfg = run_config(plan, setting, over + extra)
    return System(name, lambda: run(cfg, engine=engines.get(cfg)), cfg)


TRL_SYSTEMS = ("trl-grpo", "trl-grpo-vllm")  # TRL generating with transformers.generate / with vLLM


def trl_plan(plan: dict, name: str, setting: str) -> dict:
    """TRL's settings for system `name` in `setting`: the plan's `trl` (a value given per setting
    as a mapping takes that setting's), with `trl_vllm` over it for trl-grpo-vllm."""
    trl = {**plan["trl"], **plan.get("trl_vllm", {}), "vllm": True} if name == "trl-grpo-vllm" else dict(plan["trl"])
    return {k: v[setting] if isinstance(v, dict) and setting in v else v for k, v in trl.items()}


def trl_system(plan, setting, extra, runs: Path, model_dir_of, name: str = "trl-grpo",
               engines: SharedEngines | None = None) -> System:
    """TRL in a fresh process. Our systems' shared engines are closed first: TRL gets the
    machine's memory to itself (a 135M model's TRL process holds ~11 GB), and the next system
    of ours starts its engine again (engine start-up is outside every measurement)."""
    cfg = run_config(plan, setting, extra)
    out = runs / setting / name
    trl = trl_plan(plan, name, setting)
    settings = trl_settings(cfg, trl, load_policy_tokenizer(cfg))

    def run_it():
        if engines is not None:
            engines.close()
        return run_trl(cfg, trl, model_dir_of(cfg), out)

    return System(name, run_it, settings)


def load_policy_tokenizer(cfg: RunConfig):
    """The tokenizer the run uses: the model directory's own, else model.tokenizer."""
    from periodic_async.data.tokenizer import load_tokenizer

    model_dir = Path(cfg.model.name_or_path)
    return load_tokenizer(model_dir if (model_dir / "tokenizer_config.json").is_file() else cfg.model.tokenizer)


def mean_prompt_tokens(cfg: RunConfig) -> float:
    tok = load_policy_tokenizer(cfg)
    examples, shots = load_examples(cfg.data, "train"), few_shot_examples(cfg.data)
    batch = iteration_prompts(examples, 0, cfg.algorithm.prompts_per_iteration, cfg.data.seed)
    return sum(len(encode_chat(tok, prompt_messages(ex, shots, cfg.data))) for _, ex in batch) / len(batch)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default=os.environ.get("RESULTS_DIR", "results"))
    ap.add_argument("--figures", default=os.environ.get("FIGURES_DIR", "figures"))
    ap.add_argument("--runs", default="runs/table2")
    ap.add_argument("--plan", default=str(HERE / "table2_throughput.yaml"))
    ap.add_argument("--repeats", type=int, default=None, help="measured rounds (default: bench.repeats of the plan)")
    ap.add_argument("--settings", default=None,
                    help="comma-separated settings to run (default: all of the plan's), e.g. real-model")
    ap.add_argument("--no-batch-effect", action="store_true", help="skip the batch-size sweep")
    ap.add_argument("overrides", nargs="*", help="section.key=value for every system (e.g. model.name_or_path=...)")
    args = ap.parse_args(argv)
    plan = load_plan(Path(args.plan), args.quick)
    if args.settings:
        wanted = args.settings.split(",")
        unknown = [w for w in wanted if w not in plan["settings"]]
        if unknown:
            raise SystemExit(f"--settings: {unknown} not in the plan's settings {list(plan['settings'])}")
        plan["settings"] = {k: v for k, v in plan["settings"].items() if k in wanted}
    extra = list(args.overrides)
    probe = run_config(plan, next(iter(plan["settings"])), extra)
    model = probe.model.name_or_path
    if model not in PRESETS and not (Path(model) / "config.json").is_file():
        print(f"[table2] WARNING: {model} not found (build it with `bash experiments/warm_start.sh`); "
              "falling back to the random qwen2-1m preset: the responses, and so the numbers, will differ")
        extra.append("model.name_or_path=qwen2-1m")
    ensure_tokenizer(probe.model.tokenizer)
    runs = Path(args.runs)
    if args.repeats:
        plan["bench"]["repeats"] = args.repeats
    bench = plan["bench"]
    if probe.trainer.iterations < 2:
        raise ValueError("trainer.iterations must be >= 2: the first iteration of every run is excluded")
    init_ray(probe.engine)
    engines = SharedEngines()
    exported = {}

    def model_dir_of(cfg):
        key = cfg.model.name_or_path
        if key not in exported:
            exported[key] = export_model(cfg, runs / "trl-model" / Path(key).name)
        return exported[key]

    out = Path(args.results)
    # With --settings, the other settings' rows of an earlier run are kept (one CSV, all settings).
    # (an older row keeps the provenance it had: no cpu stamped on a row this machine did not measure)
    rows = [{"cpu": "", "measured_iterations": "", **r} for r in read_csv(out / "table2_throughput.csv")
            if r["setting"] not in plan["settings"]]
    checks = [{"cpu": "", **r} for r in read_csv(out / "table2_token_check.csv")
              if r["setting"] not in plan["settings"]]
    batch_rows, commit = [], git_commit()
    try:
        for setting in plan["settings"]:
            systems = [trl_system(plan, setting, extra, runs, model_dir_of, name, engines) for name in TRL_SYSTEMS]
            systems += [pipeline_system(plan, setting, m, shared, extra, runs, engines)
                        for m in MODES for shared in (False, True)]
            if setting in plan.get("systems_of_setting", {}):  # a setting that runs only some systems
                keep = plan["systems_of_setting"][setting]
                systems = [s for s in systems if s.name in keep]
            res = measure(systems, repeats=bench["repeats"], warmup_rounds=bench["warmup_rounds"],
                          ignore_settings=IGNORE)
            cfg0 = systems[len(TRL_SYSTEMS)].settings
            p_mean = round(mean_prompt_tokens(cfg0), 1)
            # Speedups are quoted against the faster TRL configuration of this setting.
            trl_name = max(TRL_SYSTEMS, key=lambda n: res[n].stats("tokens_per_s").median)
            trl = res[trl_name]
            for name in TRL_SYSTEMS:
                for round_, r in enumerate(res[name].runs, 1):
                    checks += [{"setting": setting, "system": name, "round": round_, "step": i + 1,
                                "trl_num_tokens": a, "ours": b, "equal": a == b, "git_commit": commit}
                               for i, (a, b) in enumerate(r["token_check"])]
            for name, r in res.items():
                mode, _, packing = name.partition("/")
                shared = packing == "shared"
                colocated = res.get(f"sync-colocated/{packing}") if packing else None
                vs_trl = r.ratio(trl)
                rows.append({
                    "setting": setting, "system": mode, "shared_prompt": shared, **r.row(["tokens_per_s"], 1),
                    "measured_iterations": r.measured_iterations or cfg0.trainer.iterations - 1,  # TRL: steps 2..N
                    "devices": r.runs[0]["devices"],
                    "speedup_vs_trl": round(r.stats("tokens_per_s").median / trl.stats("tokens_per_s").median, 3),
                    "speedup_vs_sync_colocated": round(r.stats("tokens_per_s").median /
                                                       colocated.stats("tokens_per_s").median, 3) if colocated else "",
                    "paper_speedup": plan["paper_speedup"] if name == "periodic-async/shared" else "",
                    **r.provenance(), "speedup_vs_trl_min": round(vs_trl.min, 3),
                    "speedup_vs_trl_max": round(vs_trl.max, 3), "mean_prompt_tokens": p_mean,
                    "samples_per_iteration": cfg0.algorithm.prompts_per_iteration * cfg0.algorithm.group_size,
                    "trl_baseline": trl_name})
            write_csv(out / "table2_throughput.csv", rows, COLUMNS)  # after each setting
        if not args.no_batch_effect and plan["batch_effect"]["setting"] in plan["settings"]:
            batch_rows = batch_effect(plan, extra, runs, engines)
    finally:
        engines.close()
    write_csv(out / "table2_throughput.csv", rows, COLUMNS)
    write_csv(out / "table2_token_check.csv", checks)
    if batch_rows:
        write_csv(out / "table2_batch_effect.csv", batch_rows)
    if not all(str(c["equal"]) == "True" for c in checks):
        raise RuntimeError(f"TRL's token counts disagree with ours: see {out / 'table2_token_check.csv'}")
    fig = plot_table2(out / "table2_throughput.csv", Path(args.figures) / "table2_throughput.png",
                      out / "table2_batch_effect.csv")
    for r in rows:
        print({k: r[k] for k in ("setting", "system", "shared_prompt", "tokens_per_s", "speedup_vs_trl",
                                 "speedup_vs_trl_min", "speedup_vs_trl_max", "speedup_vs_sync_colocated")})
    print(f"[table2] wrote {out}/table2_throughput.csv, table2_batch_effect.csv, table2_token_check.csv, {fig}")
    return rows


def batch_effect(plan, extra, runs: Path, engines: SharedEngines) -> list[dict]:
    """sync-separated vs periodic-async at several B (same G, engine slots): periodic asynchrony
    overlaps only within an iteration, so it needs B*G well above the engines' slots."""
    be, bench = plan["batch_effect"], plan["bench"]
    setting, shared = be["setting"], be["shared_prompt"]
    systems = []
    for b in be["prompts_per_iteration"]:
        for mode in be["systems"]:
            systems.append(pipeline_system(plan, setting, mode, shared,
                                           extra + [f"algorithm.prompts_per_iteration={b}"], runs / "batch_effect",
                                           engines, name=f"{mode}/B{b}"))
    res = measure(systems, repeats=bench["repeats"], warmup_rounds=bench["warmup_rounds"], ignore_settings=IGNORE)
    rows = []
    for name, r in res.items():
        mode, _, b = name.partition("/B")
        cfg = r.settings
        base = res[f"{be['systems'][0]}/B{b}"]
        ratio = r.ratio(base)
        rows.append({"setting": setting, "system": mode, "shared_prompt": shared, "prompts_per_iteration": int(b),
                     "group_size": cfg.algorithm.group_size,
                     "samples_per_iteration": int(b) * cfg.algorithm.group_size,
                     "engine_slots": cfg.engine.num_workers * cfg.engine.max_num_seqs,
                     **r.row(["tokens_per_s"], 1),
                     f"speedup_vs_{be['systems'][0].replace('-', '_')}": round(r.stats("tokens_per_s").median /
                                                             base.stats("tokens_per_s").median, 3),
                     "speedup_min": round(ratio.min, 3), "speedup_max": round(ratio.max, 3),
                     "mean_generate_s": round(r.stats("mean_generate_s").median, 3),
                     "mean_train_s": round(r.stats("mean_train_s").median, 3), **r.provenance()})
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
