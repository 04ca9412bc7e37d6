"""Render results/*.csv into README.md between <!-- results:NAME --> markers (never by hand).

    python scripts/update_readme.py [--results results]
"""

import argparse
import csv
import re
from pathlib import Path

SOURCES = {  # marker -> (csv file, script that writes it, one-line caption)
    "sft": ("sft.csv", "experiments/warm_start.sh", "Warm start (supervised) of the RL base policy."),
    "async_speedup": ("async_speedup.csv", "experiments/async_speedup.sh",
                      "Asynchrony alone; goals: periodic-async >= 1.8x and >= 0.9 x bound over sync-separated, "
                      ">= 1.4x over sync-colocated (paper: 1.92x, bound 2x)."),
    "shared_async": ("shared_async.csv", "experiments/shared_async.sh",
                     "Shared-prompt attention x asynchrony on 4-shot prompts; speedups against per-response "
                     "sync-separated; `product` = shared-only x async-only (paper: ~8x and ~2x, multiplicative)."),
    "reward_curves": ("reward_curves_summary.csv", "experiments/reward_curves.sh",
                      "Held-out accuracy after RL from the warm start, sync vs async from one seed "
                      "(curves: figures/reward_curves.png)."),
    "shared_prompt": ("shared_prompt.csv", "experiments/shared_prompt_ablation.sh",
                      "Shared-prompt vs per-response packing, forward+backward tokens/s; goal efficiency >= 0.85."),
    "engine": ("engine.csv", "experiments/engine_throughput.sh",
               "Continuous-batching engine vs HF static-batch generate; goals >= 1.3 long-tail, >= 1.0 uniform."),
    "trimodel_cost": ("trimodel_cost.csv", "experiments/trimodel_cost.sh",
                      "Tri-model micro-step cost against a policy-only forward/backward."),
}


def table(path: Path) -> str:
    with path.open() as f:
        rows = list(csv.reader(f))
    head, body = rows[0], rows[1:]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="results")
    ap.add_argument("--readme", default="README.md")
    args = ap.parse_args()
    readme = Path(args.readme)
    text = readme.read_text()
    for name, (file, script, caption) in SOURCES.items():
        path = Path(args.results) / file
        body = (f"{caption} `{path}`, written by `bash {script}`:\n\n{table(path)}" if path.is_file()
                else f"_`{path}` not produced yet: run `bash {script}`._")
        text = re.sub(rf"<!-- results:{name} -->.*?<!-- /results:{name} -->",
                      lambda _: f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->", text, flags=re.S)
    readme.write_text(text)


if __name__ == "__main__":
    main()
