"""The paper's Table 2 at CPU scale: end-to-end trained tokens/s of TRL's GRPOTrainer (the
mainstream framework a user would otherwise pick), generating with transformers (`trl-grpo`)
and with vLLM (`trl-grpo-vllm`, TRL's colocate mode), and of our three modes, each with and
without shared-prompt packing, on one model, tokenizer, prompt set and reward. Speedups are
quoted against the faster of the two TRL configurations (`trl_baseline` names it).

    bash experiments/table2_throughput.sh              # QUICK=1: smoke size; wall times: results/run_all_times*.csv
    python experiments/table2_throughput.py [--quick] [--repeats N] [--settings long-prompt,...] [--results results]
                                            [--figures figures] [--runs runs/table2] [section.key=value ...]

What is the same for every system (the run config, experiments/table2_throughput.yaml): model, tokenizer,
prompts, reward (correctness), B prompts per step, G samples each, max new tokens,
temperature, lr, beta, clip range, token-mean loss over the whole batch (TRL's "dapo") and
one optimizer step per generation batch. How TRL is run, and how its tokens are counted and
checked against ours: periodic_async/bench/trl.py. Each system keeps its own best execution
settings (micro-batch sizes, deployment: SYSTEMS, TRL below), recorded in the CSV's `settings` column;
what differs between the table's settings is SETTINGS.
Trained tokens = sum over samples of (P + R_i) in every system; tokens/s excludes the first
iteration (TRL: the first optimizer step) of every run.

The benchmark protocol is periodic_async.bench: systems interleaved, REPEATS rounds,
median with min and max; the speedup columns are ratios of medians, their _min/_max the
paired ratios round by round. Writes results/table2_throughput.csv,
results/table2_token_check.csv (TRL's count and ours per step), results/table2_batch_effect.csv
(the effect of B on sync-separated vs periodic-async) and figures/table2_throughput.png.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.plots import plot_table2
from periodic_async.bench.protocol import SharedEngines, System, flatten, measure
from periodic_async.records import read_csv, write_csv
from periodic_async.bench.trl import export_model, run_trl, trl_settings
from periodic_async.config import RunConfig, load_config
from periodic_async.data import few_shot_examples, iteration_prompts, load_examples, prompt_messages
from periodic_async.data.prompts import encode_chat
from periodic_async.data.tokenizer import ensure_tokenizer
from periodic_async.engine.ray_engine import init_ray
from periodic_async.model import PRESETS
from periodic_async.pipeline import run

HERE = Path(__file__).resolve().parent
IGNORE = ("trainer.output_dir", "logging.")  # not settings of the measured system
MODES = ["sync-colocated", "sync-separated", "periodic-async"]
TRL_SYSTEMS = ("trl-grpo", "trl-grpo-vllm")  # TRL generating with transformers.generate / with vLLM
COLUMNS = ["setting", "system", "shared_prompt", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "repeats",
           "measured_iterations", "devices", "speedup_vs_trl", "speedup_vs_sync_colocated", "paper_speedup",
           "git_commit", "config_hash", "speedup_vs_trl_min", "speedup_vs_trl_max", "mean_prompt_tokens",
           "samples_per_iteration", "trl_baseline", "settings"]

SETTINGS = {  # what differs between the table's settings, over table2_throughput.yaml
    # The paper's case: few-shot prompts of ~500 tokens, G = 16. Per-response training of long rows
    # is what costs (measured here: under 1k tokens/s for TRL and for our per-response modes, 12-shot
    # prompts, B*G = 128): this size keeps the whole table near 15 minutes on 2 cores.
    "long-prompt": {"data.few_shot": 8, "algorithm.group_size": 16,
                    "algorithm.prompts_per_iteration": 4,  # B*G = 64 samples = 4x the engine's 16 slots
                    "engine.max_tokens": 64, "engine.max_num_seqs": 16},
    # A pretrained instruct model (134.5M parameters, vocabulary 49,152): SmolLM2-135M-Instruct
    # (`python -m periodic_async prepare-model smollm2-135m`), 8-shot prompts through its own chat
    # template (~460 tokens), G = 8, responses up to 256 tokens at their real, uneven lengths. Every
    # engine is vLLM (one Ray worker per engine; TRL's own colocated vLLM in trl-grpo-vllm). Run alone:
    # --settings real-model (38 minutes measured, 2 rounds).
    "real-model": {"model.name_or_path": "artifacts/smollm2-135m-instruct", "data.few_shot": 8,
                   "algorithm.group_size": 8,
                   "algorithm.prompts_per_iteration": 2,  # B*G = 16 samples = 2x the engine's 8 slots
                   "engine.max_tokens": 256, "engine.max_num_seqs": 8, "engine.worker_backend": "vllm",
                   "engine.vllm_kv_cache_gib": 0.5},  # 8 sequences x ~720 tokens need ~0.3 GiB
    # Zero-shot prompts of ~60 tokens: shared prompts save little.
    "short-prompt": {"data.few_shot": 0, "algorithm.group_size": 8,
                     "algorithm.prompts_per_iteration": 64,  # B*G = 512 samples = 16x the engine's 32 slots
                     "engine.max_tokens": 64},
}
SYSTEMS_OF_SETTING = {
    # A setting may run only some systems. real-model: per-response training of a 135M model is what
    # costs (16 rows of ~720 tokens per iteration); of our per-response rows only periodic-async's (the
    # shared-prompt ablation of the full method) is run, which keeps the setting near 30 minutes.
    "real-model": ["trl-grpo", "trl-grpo-vllm", "periodic-async/per-response", "sync-colocated/shared",
                   "sync-separated/shared", "periodic-async/shared"],
}
SYSTEMS = {
    # Each mode: its overrides (`per_setting`: more, in one setting) and its micro-batch token budget
    # per packing (algorithm.micro_batch_tokens; one value, or one per setting). The synchronous modes
    # train on the whole batch at once and take large micro-batches; periodic-async takes small ones so
    # that training starts with the first finished group (a budget of about one packed group).
    "sync-colocated": {  # generate with one engine worker per core, then train on both cores
        "overrides": {"pipeline.mode": "sync-colocated", "engine.num_workers": 2, "trainer.threads": 2},
        # A 135M model's vLLM worker holds ~3.5 GB: one worker on both cores, not two on one each.
        "per_setting": {"real-model": {"engine.num_workers": 1, "engine.threads_per_worker": 2}},
        "micro_batch_tokens": {"per-response": 8192, "shared": 8192}},
    "sync-separated": {
        "overrides": {"pipeline.mode": "sync-separated"},
        "micro_batch_tokens": {"per-response": 8192, "shared": 8192}},
    # micro-batch 0 = one group each (micro_batch_groups): a long-prompt shared group is ~580 tokens
    # and B = 4, so a 2048-token budget waited for the last group and nothing overlapped (measured:
    # iteration = generation + training).
    "periodic-async": {
        "overrides": {"pipeline.mode": "periodic-async", "algorithm.micro_batch_groups": 1},
        "micro_batch_tokens": {"per-response": 4096,
                               "shared": {"long-prompt": 0, "short-prompt": 2048, "real-model": 0}}},
}
TRL = {  # TRL's own settings (bench/trl.py); a value given per setting as a mapping takes that setting's
    "threads": 2,
    # TRL pads every micro-batch to the generation batch's longest sequence; its micro-batch
    # (per_device_train_batch_size) is the largest divisor of B*G whose padded size fits this
    # budget, and gradient accumulation = steps_per_generation = B*G / micro-batch.
    "micro_batch_tokens": {"long-prompt": 8192, "short-prompt": 8192, "real-model": 4096},  # real-model: 4 rows
    "loss_type": "dapo",
    "vllm": False,
}
TRL_VLLM = {"vllm_kv_cache_gib": 1}
"""trl-grpo-vllm: TRL with use_vllm=True, vllm_mode=colocate (its vLLM in the TRL process), over `TRL`.
TRL 1.16's weight push into vLLM fails on vLLM's CPU build; the one change made to TRL for this
system (its sync goes through vLLM's reload_weights) is in periodic_async/bench/trl.py."""
BATCH_EFFECT = {"setting": "short-prompt", "systems": ["sync-separated", "periodic-async"], "shared_prompt": True,
                "prompts_per_iteration": [4, 16, 64]}
"""Asynchrony overlaps only within an iteration: the effect of B on short-prompt."""
PAPER_SPEEDUP = "3-5"
"""The paper's end-to-end claim against mainstream frameworks (verl, MindSpeed-RL), for the row of
the full method (periodic-async with shared prompts)."""
REPEATS, WARMUP_ROUNDS = 3, 0
QUICK = {  # --quick: the same path, small (about 2 minutes on 2 quiet cores)
    "run": {"trainer.iterations": 2, "data.num_train": 200,
            "engine.max_num_seqs": 8},  # few slots, so that the small batches below still exceed them
    "settings": {
        "long-prompt": {"data.few_shot": 2, "algorithm.group_size": 4, "algorithm.prompts_per_iteration": 4,
                        "engine.max_tokens": 16},
        "short-prompt": {"algorithm.group_size": 4, "algorithm.prompts_per_iteration": 8, "engine.max_tokens": 16},
        "real-model": {"data.few_shot": 2, "algorithm.group_size": 4, "algorithm.prompts_per_iteration": 2,
                       "engine.max_tokens": 24, "engine.max_num_seqs": 4}},
    "batch_effect": {"setting": "long-prompt", "prompts_per_iteration": [1, 2]},  # QUICK runs long-prompt only
    # the smoke run's long-prompt: real-model's systems (each code path once: per-response packing in
    # periodic-async's row, a setting that runs only some systems)
    "systems_of_setting": {"long-prompt": SYSTEMS_OF_SETTING["real-model"]},
    "repeats": 1,
}


def as_overrides(tree: dict) -> list[str]:
    """Nested or dotted mapping -> ['section.key=<json value>'] for `load_config`."""
    return [f"{k}={json.dumps(v)}" for k, v in flatten(tree).items()]


def earlier_rows(path: Path) -> list[dict]:
    """The rows of an earlier run's CSV (none when it does not exist)."""
    return read_csv(path) if path.is_file() else []


def per_setting(value, setting: str):
    """A value given once, or per setting as a mapping: that setting's."""
    return value[setting] if isinstance(value, dict) and setting in value else value


@dataclass
class Plan:
    """What one invocation runs: the run-config YAML, the --quick overrides under every setting,
    each chosen setting's overrides (with --quick's over them), the batch-size sweep and the rounds."""

    config: Path
    quick_run: dict
    settings: dict[str, dict]
    batch_effect: dict
    repeats: int

    @classmethod
    def of(cls, config: Path, quick: bool, settings: list[str] | None, repeats: int | None) -> Plan:
        chosen = settings or list(SETTINGS)
        if unknown := [s for s in chosen if s not in SETTINGS]:
            raise SystemExit(f"--settings: {unknown} not in the settings {list(SETTINGS)}")
        q = QUICK if quick else {}
        return cls(config, q.get("run", {}),
                   {s: {**over, **q.get("settings", {}).get(s, {})} for s, over in SETTINGS.items() if s in chosen},
                   {**BATCH_EFFECT, **q.get("batch_effect", {})}, repeats or q.get("repeats", REPEATS))

    def run_config(self, setting: str, extra: list[str]) -> RunConfig:
        """The YAML, --quick's overrides, the setting's, then `extra` (a system's, the command line's)."""
        return load_config(RunConfig, self.config,
                           as_overrides(self.quick_run) + as_overrides(self.settings[setting]) + extra)


# --- the experiment ---------------------------------------------------------------------------

def pipeline_system(plan: Plan, setting, mode, shared, extra, runs: Path, engines: SharedEngines,
                    name=None) -> System:
    packing = "shared" if shared else "per-response"
    name = name or f"{mode}/{packing}"
    system = SYSTEMS[mode]
    over = as_overrides(system["overrides"]) + as_overrides(system.get("per_setting", {}).get(setting, {})) + [
        f"algorithm.shared_prompt={shared}",
        f"algorithm.micro_batch_tokens={per_setting(system['micro_batch_tokens'][packing], setting)}",
        f"trainer.output_dir={runs / setting / name.replace('/', '-')}"]
    cfg = plan.run_config(setting, over + extra)
    return System(name, lambda: run(cfg, engine=engines.get(cfg)), cfg)


def trl_plan(name: str, setting: str) -> dict:
    """TRL's settings for system `name` in `setting`: `TRL` (with `TRL_VLLM` over it for trl-grpo-vllm)."""
    trl = {**TRL, **TRL_VLLM, "vllm": True} if name == "trl-grpo-vllm" else TRL
    return {k: per_setting(v, setting) for k, v in trl.items()}


def trl_system(plan: Plan, setting, extra, runs: Path, model_dir_of, name: str = "trl-grpo",
               engines: SharedEngines | None = None) -> System:
    """TRL in a fresh process. Our systems' shared engines are closed first: TRL gets the
    machine's memory to itself (a 135M model's TRL process holds ~11 GB), and the next system
    of ours starts its engine again (engine start-up is outside every measurement)."""
    cfg = plan.run_config(setting, extra)
    out = runs / setting / name
    trl = trl_plan(name, setting)
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
    ap = experiment_parser(__doc__, runs="runs/table2", repeats=(REPEATS, QUICK["repeats"]), figures=True,
                           overrides=True)
    ap.add_argument("--config", default=str(HERE / "table2_throughput.yaml"), help="the run config every system shares")
    ap.add_argument("--settings", default=None,
                    help=f"comma-separated settings to run (default: all of {', '.join(SETTINGS)}), e.g. real-model")
    ap.add_argument("--no-batch-effect", action="store_true", help="skip the batch-size sweep")
    args = ap.parse_args(argv)
    plan = Plan.of(Path(args.config), args.quick, args.settings.split(",") if args.settings else None, args.repeats)
    extra = list(args.overrides)
    probe = plan.run_config(next(iter(plan.settings)), extra)
    model = probe.model.name_or_path
    if model not in PRESETS and not (Path(model) / "config.json").is_file():
        print(f"[table2] WARNING: {model} not found (build it with `bash experiments/warm_start.sh`); "
              "falling back to the random qwen2-1m preset: the responses, and so the numbers, will differ")
        extra.append("model.name_or_path=qwen2-1m")
    ensure_tokenizer(probe.model.tokenizer)
    runs = Path(args.runs)
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
    rows = [{"cpu": "", "measured_iterations": "", **r} for r in earlier_rows(out / "table2_throughput.csv")
            if r["setting"] not in plan.settings]
    checks = [{"cpu": "", **r} for r in earlier_rows(out / "table2_token_check.csv")
              if r["setting"] not in plan.settings]
    batch_rows = []
    try:
        for setting in plan.settings:
            systems = [trl_system(plan, setting, extra, runs, model_dir_of, name, engines) for name in TRL_SYSTEMS]
            systems += [pipeline_system(plan, setting, m, shared, extra, runs, engines)
                        for m in MODES for shared in (False, True)]
            of_setting = {**SYSTEMS_OF_SETTING, **(QUICK["systems_of_setting"] if args.quick else {})}
            if setting in of_setting:  # a setting that runs only some systems
                systems = [s for s in systems if s.name in of_setting[setting]]
            res = measure(systems, repeats=plan.repeats, warmup_rounds=WARMUP_ROUNDS, ignore_settings=IGNORE)
            cfg0 = systems[len(TRL_SYSTEMS)].settings
            p_mean = round(mean_prompt_tokens(cfg0), 1)
            # Speedups are quoted against the faster TRL configuration of this setting.
            trl_name = max(TRL_SYSTEMS, key=lambda n: res[n].stats("tokens_per_s").median)
            trl = res[trl_name]
            for name in TRL_SYSTEMS:
                for round_, r in enumerate(res[name].runs, 1):
                    checks += [{"setting": setting, "system": name, "round": round_, "step": i + 1,
                                "trl_num_tokens": a, "ours": b, "equal": a == b}
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
                    "paper_speedup": PAPER_SPEEDUP if name == "periodic-async/shared" else "",
                    **r.provenance(), "speedup_vs_trl_min": round(vs_trl.min, 3),
                    "speedup_vs_trl_max": round(vs_trl.max, 3), "mean_prompt_tokens": p_mean,
                    "samples_per_iteration": cfg0.algorithm.prompts_per_iteration * cfg0.algorithm.group_size,
                    "trl_baseline": trl_name})
            write_csv(out / "table2_throughput.csv", rows, COLUMNS)  # after each setting
        if not args.no_batch_effect and plan.batch_effect["setting"] in plan.settings:
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


def batch_effect(plan: Plan, extra, runs: Path, engines: SharedEngines) -> list[dict]:
    """sync-separated vs periodic-async at several B (same G, engine slots): periodic asynchrony
    overlaps only within an iteration, so it needs B*G well above the engines' slots."""
    be = plan.batch_effect
    setting, shared = be["setting"], be["shared_prompt"]
    systems = []
    for b in be["prompts_per_iteration"]:
        for mode in be["systems"]:
            systems.append(pipeline_system(plan, setting, mode, shared,
                                           extra + [f"algorithm.prompts_per_iteration={b}"], runs / "batch_effect",
                                           engines, name=f"{mode}/B{b}"))
    res = measure(systems, repeats=plan.repeats, warmup_rounds=WARMUP_ROUNDS, ignore_settings=IGNORE)
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
