"""Shared-prompt attention and asynchrony together (paper: ~8x from shared prompts on long
prompts, a further ~2x from asynchrony, multiplicative): the 2x2 grid
{per-response, shared-prompt} x {sync-separated, periodic-async} on long few-shot prompts.

    python experiments/shared_async.py [--quick] [--repeats 3] [--results results] [section.key=value ...]

Same deployment as async_speedup (one engine thread + one trainer thread). Protocol
(periodic_async.bench): the four systems interleaved, `--repeats` rounds, medians with min and
max, first iteration of every run excluded. Writes <results>/shared_async.csv
(shared_prompt,mode,tokens_per_s,speedup,mean_generate_s,mean_train_s,mean_prompt_tokens,
tokens_per_s_min,tokens_per_s_max,speedup_min,speedup_max,repeats,git_commit,config_hash,
settings): speedup is against per-response sync-separated (ratio of medians; _min/_max from
the same-round ratios), and the last row, `product`, is the shared-only speedup times the
async-only speedup, to compare with the measured joint speedup.
"""

from __future__ import annotations

import sys
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.protocol import SharedEngines, System, measure
from periodic_async.records import write_csv
from periodic_async.config import RunConfig, load_config
from periodic_async.engine.ray_engine import init_ray
from periodic_async.pipeline import run
from periodic_async.trace import read_jsonl

HERE = Path(__file__).resolve().parent
COLUMNS = ["shared_prompt", "mode", "tokens_per_s", "speedup", "mean_generate_s", "mean_train_s",
           "mean_prompt_tokens", "tokens_per_s_min", "tokens_per_s_max", "speedup_min", "speedup_max", "repeats",
           "measured_iterations", "git_commit", "config_hash", "settings"]


def run_with_prompt_length(cfg: RunConfig, engines: SharedEngines) -> dict:
    """One pipeline run; adds the mean prompt length of its measured iterations."""
    s = run(cfg, engine=engines.get(cfg))
    history = read_jsonl(Path(cfg.trainer.output_dir) / "metrics.jsonl")
    m = history[1:] or history  # the first iteration pays start-up costs
    s["mean_prompt_tokens"] = sum(x["tokens/trained"] - x["tokens/response"] for x in m) / sum(
        x["train/sequences"] for x in m)
    return s


def main(argv=None) -> None:
    args = experiment_parser(__doc__, runs="runs/shared_async", repeats=(3, 1), overrides=True).parse_args(argv)
    repeats = args.repeats
    extra = ["data.few_shot=4", "algorithm.prompts_per_iteration=32", "algorithm.micro_batch_tokens=2048"]
    base = load_config(RunConfig, HERE / "async_speedup.yaml")
    if not Path(base.model.name_or_path).is_dir():
        extra.append("model.name_or_path=qwen2-1m")
    if args.quick:
        # G = 8 and short responses: the shared prompt is most of each sequence, so packing pays visibly
        extra += ["trainer.iterations=2", "algorithm.prompts_per_iteration=4", "engine.max_tokens=24",
                  "data.num_train=1000"]
    extra += args.overrides
    init_ray(base.engine)
    engines = SharedEngines()
    systems = []
    for shared in (False, True):
        for mode in ("sync-separated", "periodic-async"):
            name = f"{'shared' if shared else 'per-response'}-{mode}"
            cfg = load_config(RunConfig, HERE / "async_speedup.yaml",
                              extra + [f"algorithm.shared_prompt={shared}", f"pipeline.mode={mode}",
                                       f"trainer.output_dir={args.runs}/{name}"])
            systems.append(System(name, lambda cfg=cfg: run_with_prompt_length(cfg, engines), cfg))
    try:
        res = measure(systems, repeats=repeats, ignore_settings=("trainer.output_dir",))
    finally:
        engines.close()
    base_r = res["per-response-sync-separated"]
    tps = {n: r.stats("tokens_per_s").median for n, r in res.items()}
    rows = []
    for name, r in res.items():
        shared, mode = name.startswith("shared"), r.settings.pipeline.mode
        paired = r.ratio(base_r)
        rows.append({"shared_prompt": shared, "mode": mode, **r.row(["tokens_per_s"], 1),
                     "speedup": round(tps[name] / tps["per-response-sync-separated"], 3),
                     "speedup_min": round(paired.min, 3), "speedup_max": round(paired.max, 3),
                     **{k: round(r.stats(k).median, 3) for k in ("mean_generate_s", "mean_train_s")},
                     "mean_prompt_tokens": round(r.stats("mean_prompt_tokens").median, 1),
                     "measured_iterations": r.measured_iterations, **r.provenance()})
        print(f"[shared_async] {name}: {tps[name]:.0f} tokens/s (median of {r.repeats})")
    base = tps["per-response-sync-separated"]
    product = tps["shared-sync-separated"] / base * tps["per-response-periodic-async"] / base
    rows.append({"mode": "product", "speedup": round(product, 3)})
    write_csv(Path(args.results) / "shared_async.csv", rows, COLUMNS)
    for r in rows:
        print({k: v for k, v in r.items() if k not in ("git_commit", "settings")})


if __name__ == "__main__":
    sys.exit(main())
