"""Asynchrony alone: tokens/s of sync-separated, periodic-async and sync-colocated on one
workload, against the bound (T_gen + T_train) / max(T_gen, T_train).

    python experiments/async_speedup.py [--quick] [--repeats 3] [--results results] [--settings NAME]
                                        [section.key=value ...]

Settings (--settings): `cpu-tuned` (default: async_speedup.yaml, the tiny warm-start model; the
trainer takes the engine's core once generation ends), `balanced` (the same workload, each
phase on its own core for the whole iteration, as on separate accelerators; outputs tagged
_balanced) and `real-model` (async_speedup_real.yaml: SmolLM2-135M-Instruct on a vLLM engine
worker, each phase on its own core; outputs tagged _real).

Protocol (periodic_async.bench): the three modes run interleaved, `--repeats` rounds; every
number is a median over the rounds, with min and max; the first iteration of every run is
excluded (start-up). T_gen and T_train are measured with each phase alone, in the
sync-separated runs (no overlap there): generation wall time and trainer busy time per
iteration, each the median over the rounds. efficiency = speedup / bound; its min/max come
from the paired (same-round) speedups. bound_overlapped uses the phase times measured inside
the periodic-async runs instead (what the two phases cost when they run side by side).

Writes <results>/async_speedup.csv (mode,tokens_per_s,tokens_per_s_min,tokens_per_s_max,
speedup_vs_sync_separated,speedup_min,speedup_max,bound,efficiency,efficiency_min,
efficiency_max,bound_overlapped,speedup_vs_sync_colocated,repeats,devices,git_commit,
config_hash,settings), <results>/async_speedup_phases.csv (per mode, medians over the rounds:
mean_generate_s, mean_train_s, mean_iteration_s, mean_sync_s (the barrier's push and check),
mean_first_group_s (the trainer's wait for the first group), mean_after_generation_s (its work
left when generation ends), mean_train_thread_cpu_s (the trainer thread's CPU seconds in its
busy time)), figures/timeline.png (the paper's Figure 1 from the last round's runs; traces kept
in <results>/timeline/), figures/async_speedup.png; with a tag, each name carries it
(async_speedup_real.csv, timeline_real/, ...).

`dynamic` (the real-tasks issue's measurement): sync-separated and periodic-async, without and with
dynamic sampling (algorithm.dynamic_sampling: more prompts of the same version are drawn until
B groups whose rewards differ are trained), on balanced's deployment with two workloads
(DYNAMIC_WORKLOADS: generation the longer phase, and training the longer phase), all eight
systems in the same interleaved rounds; writes <results>/dynamic_sampling.csv (per workload, mode
and variant: iteration time, phase times, prompts drawn and groups filtered per iteration, and the
iteration time's growth over the same workload and mode without it) and nothing else. Under
periodic asynchrony the extra draws generate while the trainer trains the groups already kept, so
they are hidden where training is the longer phase, and add to the iteration where generation is.

`lora` (beyond the paper): sync-separated and periodic-async, full fine-tuning and LoRA
(bench/lora_setting.py, the merged push), on real-model's deployment at B=8, interleaved rounds;
writes <results>/lora_iteration.csv (per mode and variant: tokens/s, phase times, the speedup over
sync-separated and the ratio to full fine-tuning) and nothing else.

`real-model` also runs sync-separated and periodic-async without the shared prompt
(algorithm.shared_prompt=false), in the same interleaved rounds, and writes the paper's combined
claim to <results>/shared_async_real.csv: shared prompt alone, asynchrony alone and both against
per-response sync-separated, each with its own bound, and their product (combined_rows).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from periodic_async.bench.analysis import overlap_bound
from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.lora_setting import RUN_OVERRIDES as LORA_OVERRIDES
from periodic_async.bench.plots import plot_async_speedup, plot_timeline
from periodic_async.bench.protocol import SharedEngines, System, measure
from periodic_async.records import write_csv
from periodic_async.config import RunConfig, load_config
from periodic_async.engine.ray_engine import init_ray
from periodic_async.pipeline import run

HERE = Path(__file__).resolve().parent
MODES = ["sync-separated", "periodic-async", "sync-colocated"]
MODE_OVERRIDES = {  # each mode's own use of the 2 cores (the yaml holds what they share)
    "sync-separated": [],
    "periodic-async": [],
    "sync-colocated": ["trainer.threads=2", "engine.num_workers=2"],  # one engine worker per core, then 2 threads
}
SETTINGS = {  # name: (config, output tag, overrides, {mode: overrides replacing MODE_OVERRIDES[mode]})
    "cpu-tuned": ("async_speedup.yaml", "", [], {}),
    "balanced": ("async_speedup.yaml", "balanced", ["trainer.threads_after_generation=0", "trainer.iterations=8"], {}),
    # A 135M model's vLLM worker holds ~3.5 GB: sync-colocated runs one worker on both cores. The
    # synchronous modes train the whole batch at once: large micro-batches are their best setting.
    "real-model": ("async_speedup_real.yaml", "real", [], {
        "sync-separated": ["algorithm.micro_batch_tokens=4096"],
        "sync-colocated": ["trainer.threads=2", "engine.threads_per_worker=2", "algorithm.micro_batch_tokens=4096"]}),
    # real-model's deployment at B=8: one measured iteration per run (the first is start-up)
    "lora": ("async_speedup_real.yaml", "lora", ["algorithm.prompts_per_iteration=8", "trainer.iterations=2"], {
        "sync-separated": ["algorithm.micro_batch_tokens=4096"]}),
}
SETTINGS["dynamic"] = ("async_speedup.yaml", "dynamic", SETTINGS["balanced"][2], {})
LORA_VARIANTS = {"full": [], "lora": LORA_OVERRIDES}
"""The `lora` setting's systems: sync-separated and periodic-async, each with full fine-tuning and with LoRA."""
DYNAMIC_VARIANTS = {"plain": [], "dynamic": ["algorithm.dynamic_sampling=true"]}
"""The `dynamic` setting's systems: sync-separated and periodic-async, without and with dynamic sampling
(algorithm.max_draws_per_iteration left at its default), on each of DYNAMIC_WORKLOADS."""
DYNAMIC_WORKLOADS = {
    "generation-bound": [],  # balanced's workload: generation about twice training
    # the whole tri-model (a KL term: the reference forward; the old forward) and per-response
    # attention: training about twice generation, on the same prompts, samples and groups
    "training-bound": ["algorithm.beta=0.04", "algorithm.skip_old_forward=false", "algorithm.shared_prompt=false"],
}
PER_RESPONSE = {"real-model"}
"""Settings that also run sync-separated and periodic-async with algorithm.shared_prompt=false, in the
same interleaved rounds: the paper's combined claim (shared prompt alone, asynchrony alone, both)
on one workload, written to shared_async_<tag>.csv in experiments/shared_async.py's format."""
QUICK = {  # the same code paths at the smallest size
    "cpu-tuned": ["trainer.iterations=2", "algorithm.prompts_per_iteration=8", "algorithm.group_size=4",
                  "data.num_train=1000", "engine.max_tokens=16"],
    "real-model": ["trainer.iterations=2", "algorithm.prompts_per_iteration=2", "algorithm.group_size=2",
                   "engine.max_tokens=8", "data.num_train=100"],
}
QUICK["lora"] = QUICK["real-model"]


SHARED_ASYNC_COLUMNS = ["shared_prompt", "mode", "tokens_per_s", "speedup", "mean_generate_s", "mean_train_s",
                        "tokens_per_s_min", "tokens_per_s_max", "speedup_min", "speedup_max", "bound", "efficiency",
                        "repeats", "measured_iterations", "git_commit", "config_hash", "settings"]


def combined_rows(shared: dict, per_response: dict) -> list[dict]:
    """The 2x2 grid {per-response, shared prompt} x {sync-separated, periodic-async}: tokens/s
    against per-response sync-separated (ratio of medians; min/max from same-round ratios), each
    row's asynchrony bound from its own sync-separated phases, and a last row `product` = the
    shared-only speedup x the async-only speedup (the paper: the two multiply)."""
    base = per_response["sync-separated"]
    tps = lambda r: r.stats("tokens_per_s").median  # noqa: E731
    rows = []
    for is_shared, grid in ((False, per_response), (True, shared)):
        alone = grid["sync-separated"]
        bound = overlap_bound(alone.stats("mean_generate_s").median, alone.stats("mean_train_s").median)
        for mode in MODES[:2]:
            r, paired = grid[mode], grid[mode].ratio(base)
            own = tps(r) / tps(alone)
            rows.append({"shared_prompt": is_shared, "mode": mode, **r.row(["tokens_per_s"], 1),
                         "speedup": round(tps(r) / tps(base), 3), "speedup_min": round(paired.min, 3),
                         "speedup_max": round(paired.max, 3),
                         **{k: round(r.stats(k).median, 3) for k in ("mean_generate_s", "mean_train_s")},
                         "bound": round(bound, 3),
                         "efficiency": round(own / bound, 3) if mode != "sync-separated" else "",
                         "measured_iterations": r.measured_iterations, **r.provenance()})
    product = (tps(shared["sync-separated"]) / tps(base)) * (tps(per_response["periodic-async"]) / tps(base))
    rows.append({"mode": "product", "speedup": round(product, 3)})
    return rows


def write_lora_rows(res: dict, path: Path) -> list[dict]:
    """The `lora` setting's table: per mode and variant, tokens/s, the phases, the speedup over
    sync-separated of the same variant and the ratio to full fine-tuning in the same mode."""
    rows = []
    for name, r in res.items():
        variant, mode = name.split("/")
        same_variant_sync, same_mode_full = res[f"{variant}/sync-separated"], res[f"full/{mode}"]
        rows.append({"mode": mode, "variant": variant, **r.row(["tokens_per_s"], 1),
                     **{k: round(r.stats(k).median, 3) for k in ("mean_iteration_s", "mean_generate_s",
                                                                 "mean_train_s", "mean_sync_s")},
                     "speedup_vs_sync_separated": round(r.ratio(same_variant_sync).median, 3),
                     "tokens_per_s_vs_full": round(r.ratio(same_mode_full).median, 3),
                     "tokens_per_s_vs_full_min": round(r.ratio(same_mode_full).min, 3),
                     "tokens_per_s_vs_full_max": round(r.ratio(same_mode_full).max, 3),
                     "measured_iterations": r.measured_iterations, **r.provenance()})
    write_csv(path, rows)
    for r in rows:
        print(f"{r['variant']:5s} {r['mode']:15s} {r['tokens_per_s']:7.1f} tokens/s "
              f"(x{r['speedup_vs_sync_separated']:.2f} sync-separated, x{r['tokens_per_s_vs_full']:.2f} full)")
    print(f"[async_speedup] wrote {path}")
    return rows


def write_dynamic_rows(res: dict, path: Path) -> list[dict]:
    """The `dynamic` setting's table: per workload, mode and variant, the iteration time, the prompts
    drawn and groups filtered per iteration, and the iteration time's growth with dynamic sampling
    (same workload and mode, paired rounds: dynamic / plain)."""
    rows = []
    for name, r in res.items():
        workload, variant, mode = name.split("/")
        growth = r.ratio(res[f"{workload}/plain/{mode}"], "mean_iteration_s")
        rows.append({"workload": workload, "mode": mode, "variant": variant, **r.row(["mean_iteration_s"], 3),
                     **{k: round(r.stats(k).median, 3) for k in ("mean_generate_s", "mean_train_s", "mean_drawn",
                                                                 "mean_filtered")},
                     "growth_vs_plain": round(growth.median, 3), "growth_min": round(growth.min, 3),
                     "growth_max": round(growth.max, 3), "measured_iterations": r.measured_iterations,
                     **r.provenance()})
    write_csv(path, rows)
    for r in rows:
        print(f"{r['workload']:16s} {r['variant']:7s} {r['mode']:15s} {r['mean_iteration_s']:7.2f} s/iteration, "
              f"{r['mean_drawn']:.1f} "
              f"drawn, {r['mean_filtered']:.1f} filtered (x{r['growth_vs_plain']:.2f} of plain)")
    print(f"[async_speedup] wrote {path}")
    return rows


def main(argv=None) -> list[dict]:
    ap = experiment_parser(__doc__, runs="runs/async_speedup", repeats=(3, 1), figures=True, overrides=True)
    ap.add_argument("--settings", choices=sorted(SETTINGS), default="cpu-tuned", help="the workload and deployment")
    args = ap.parse_args(argv)
    repeats = args.repeats
    config_name, tag, setting_overrides, mode_overrides = SETTINGS[args.settings]
    config = HERE / config_name
    name = f"async_speedup_{tag}" if tag else "async_speedup"
    overrides = setting_overrides + args.overrides
    base = load_config(RunConfig, config, overrides)
    extra = []
    from periodic_async.model import PRESETS

    if base.model.name_or_path not in PRESETS and not Path(base.model.name_or_path).is_dir():
        if config_name == "async_speedup_real.yaml":
            sys.exit(f"[async_speedup] {base.model.name_or_path} not found: "
                     "python -m periodic_async prepare-model smollm2-135m")
        print(f"[async_speedup] {base.model.name_or_path} not found (run `bash run_all.sh` for the warm start); "
              "using the random qwen2-1m preset")
        extra.append("model.name_or_path=qwen2-1m")
    if args.quick:
        extra += QUICK.get(args.settings, QUICK["cpu-tuned"])
    init_ray(base.engine)
    engines = SharedEngines()

    def system(label: str, mode: str, more: list[str]) -> System:
        cfg = load_config(RunConfig, config, setting_overrides + extra + mode_overrides.get(mode, MODE_OVERRIDES[mode])
                          + args.overrides + more
                          + [f"pipeline.mode={mode}", f"trainer.output_dir={args.runs}/{name}/{label}"])
        return System(label, lambda: run(cfg, engine=engines.get(cfg)), cfg)

    if args.settings == "lora":
        systems = [system(f"{variant}/{mode}", mode, more) for variant, more in LORA_VARIANTS.items()
                   for mode in MODES[:2]]
    elif args.settings == "dynamic":
        systems = [system(f"{workload}/{variant}/{mode}", mode, load + more)
                   for workload, load in DYNAMIC_WORKLOADS.items() for variant, more in DYNAMIC_VARIANTS.items()
                   for mode in MODES[:2]]
    else:
        systems = [system(mode, mode, []) for mode in MODES]
    if args.settings in PER_RESPONSE:
        systems += [system(f"per-response-{mode}", mode, ["algorithm.shared_prompt=false"]) for mode in MODES[:2]]
    try:
        res = measure(systems, repeats=repeats, ignore_settings=("trainer.output_dir",))
    finally:
        engines.close()
    if args.settings == "lora":
        return write_lora_rows(res, Path(args.results) / "lora_iteration.csv")
    if args.settings == "dynamic":
        return write_dynamic_rows(res, Path(args.results) / "dynamic_sampling.csv")
    per_response = {m: res.pop(f"per-response-{m}") for m in MODES[:2] if f"per-response-{m}" in res}
    sync, asyn = res["sync-separated"], res["periodic-async"]
    t_gen, t_train = sync.stats("mean_generate_s").median, sync.stats("mean_train_s").median
    bound = overlap_bound(t_gen, t_train)
    # The bound assumes each phase keeps its solo speed when they overlap; bound_overlapped uses
    # the phase times measured inside the async runs (slower when the two share a machine).
    bound_overlapped = (t_gen + t_train) / max(asyn.stats("mean_generate_s").median, asyn.stats("mean_train_s").median)
    tps = {m: r.stats("tokens_per_s").median for m, r in res.items()}
    rows = []
    for mode, r in res.items():
        paired = r.ratio(sync)
        speedup = tps[mode] / tps["sync-separated"]
        rows.append({"mode": mode, **r.row(["tokens_per_s"], 1), "speedup_vs_sync_separated": round(speedup, 3),
                     "speedup_min": round(paired.min, 3), "speedup_max": round(paired.max, 3),
                     "bound": round(bound, 3), "efficiency": round(speedup / bound, 3),
                     "efficiency_min": round(paired.min / bound, 3), "efficiency_max": round(paired.max / bound, 3),
                     "bound_overlapped": round(bound_overlapped, 3) if mode == "periodic-async" else "",
                     "speedup_vs_sync_colocated": round(tps[mode] / tps["sync-colocated"], 3),
                     "devices": r.runs[0]["devices"], "measured_iterations": r.measured_iterations, **r.provenance()})
    columns = ["mode", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "speedup_vs_sync_separated",
               "speedup_min", "speedup_max", "bound", "efficiency", "efficiency_min", "efficiency_max",
               "bound_overlapped", "speedup_vs_sync_colocated", "repeats", "measured_iterations", "devices",
               "git_commit", "config_hash", "settings"]
    out = Path(args.results)
    write_csv(out / f"{name}.csv", rows, columns)
    phases = [{"mode": m, **{k: round(r.stats(k).median, 3) for k in ("mean_generate_s", "mean_train_s",
                                                                      "mean_iteration_s", "mean_sync_s",
                                                                      "mean_first_group_s",
                                                                      "mean_after_generation_s",
                                                                      "mean_train_thread_cpu_s")},
               "tokens_per_s_per_device": round(r.stats("tokens_per_s_per_device").median, 1),
               "devices": r.runs[0]["devices"], "repeats": r.repeats, "git_commit": r.provenance()["git_commit"],
               "config_hash": r.config_hash} for m, r in res.items()]
    write_csv(out / f"{name}_phases.csv", phases)
    if per_response:
        write_csv(out / f"shared_async_{tag}.csv", combined_rows(res, per_response), SHARED_ASYNC_COLUMNS)
    timeline = []
    for m in ("sync-separated", "periodic-async"):  # keep the last round's traces: the notebook redraws from results/
        trace = out / ("timeline" if not tag else f"timeline_{tag}") / f"{m}.trace.jsonl"
        trace.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(args.runs) / name / m / "trace.jsonl", trace)
        timeline.append((f"{m}: {res[m].runs[-1]['tokens_per_s']:.0f} tokens/s (last round)", trace))
    suffix = f"_{tag}" if tag else ""
    plot_timeline(timeline, Path(args.figures) / f"timeline{suffix}.png")
    plot_async_speedup(out / f"{name}.csv", Path(args.figures) / f"{name}.png")
    for r in rows:
        print({k: v for k, v in r.items() if k not in ("git_commit", "settings")})
    print(f"[async_speedup] T_gen={t_gen:.2f}s T_train={t_train:.2f}s bound={bound:.2f} (medians of {repeats} rounds); "
          f"wrote {out}/{name}.csv, {args.figures}/timeline{suffix}.png")
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
