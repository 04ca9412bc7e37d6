"""Shared-prompt attention and asynchrony together (paper: ~8x from shared prompts on long
prompts, a further ~2x from asynchrony, multiplicative): the 2x2 grid
{per-response, shared-prompt} x {sync-separated, periodic-async} on long few-shot prompts.

    python experiments/shared_async.py [--quick] [--results results] [section.key=value ...]

Same deployment as async_speedup (one engine thread + one trainer thread). Writes
<results>/shared_async.csv (shared_prompt,mode,tokens_per_s,speedup,mean_generate_s,
mean_train_s,mean_prompt_tokens): speedup is against per-response sync-separated, and the
last row, `product`, is the shared-only speedup times the async-only speedup, to compare
with the measured joint speedup.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from periodic_async.config import RunConfig, load_config
from periodic_async.pipeline import run
from periodic_async.trace import read_jsonl

HERE = Path(__file__).resolve().parent


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default="results")
    ap.add_argument("--runs", default="runs/shared_async")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    extra = ["data.few_shot=4", "algorithm.prompts_per_iteration=32", "algorithm.micro_batch_tokens=2048"]
    if not Path(load_config(RunConfig, HERE / "async_speedup.yaml").model.name_or_path).is_dir():
        extra.append("model.name_or_path=qwen2-1m")
    if args.quick:
        extra += ["trainer.iterations=3", "algorithm.prompts_per_iteration=16"]
    extra += args.overrides
    rows, tps = [], {}
    for shared in (False, True):
        for mode in ("sync-separated", "periodic-async"):
            name = f"{'shared' if shared else 'per-response'}-{mode}"
            cfg = load_config(RunConfig, HERE / "async_speedup.yaml",
                              extra + [f"algorithm.shared_prompt={shared}", f"pipeline.mode={mode}",
                                       f"trainer.output_dir={args.runs}/{name}"])
            s = run(cfg)
            history = read_jsonl(Path(cfg.trainer.output_dir) / "metrics.jsonl")
            m = history[1:] or history  # the first iteration pays start-up costs
            mean_p = sum((x["tokens/trained"] - x["tokens/response"]) for x in m) / sum(
                x["train/sequences"] for x in m)
            tps[(shared, mode)] = s["tokens_per_s"]
            rows.append({"shared_prompt": shared, "mode": mode, "tokens_per_s": round(s["tokens_per_s"], 1),
                         "mean_generate_s": round(s["mean_generate_s"], 3), "mean_train_s": round(s["mean_train_s"], 3),
                         "mean_prompt_tokens": round(mean_p, 1)})
            print(f"[shared_async] {name}: {s['tokens_per_s']:.0f} tokens/s")
    base = tps[(False, "sync-separated")]
    for r in rows:
        r["speedup"] = round(tps[(r["shared_prompt"], r["mode"])] / base, 3)
    product = tps[(True, "sync-separated")] / base * tps[(False, "periodic-async")] / base
    rows.append({"shared_prompt": "", "mode": "product", "tokens_per_s": "", "mean_generate_s": "",
                 "mean_train_s": "", "mean_prompt_tokens": "", "speedup": round(product, 3)})
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    fields = ["shared_prompt", "mode", "tokens_per_s", "speedup", "mean_generate_s", "mean_train_s",
              "mean_prompt_tokens"]
    with (out / "shared_async.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r)


if __name__ == "__main__":
    sys.exit(main())
