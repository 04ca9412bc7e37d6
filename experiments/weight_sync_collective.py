"""The barrier's weight sync: object store vs collective broadcast (engine.weight_sync), per preset.

For each preset, two Ray engines with the same workers are started side by side, one per path,
and the same state dict (fp32, the trainer's weights) is pushed to both, the two paths
interleaved round by round (the first path alternates), so machine noise hits them alike.
`total_s` is `Engine.update_weights` as the barrier sees it (publish + every worker loaded);
`publish_s` the trainer's side (ray.put / pack and start the broadcasts); `load_s` the slowest
worker's receive + copy into its model. One CSV row per (preset, path): median, min and max.

    python experiments/weight_sync_collective.py                     # 3 presets, 2 workers, 5 rounds
    python experiments/weight_sync_collective.py --repeats 3 --presets qwen2-1m
"""

from __future__ import annotations

import statistics
from pathlib import Path
import time

import torch

from periodic_async.bench.cli import experiment_parser
from periodic_async.records import write_csv
from periodic_async.config import RunConfig, load_config
from periodic_async.engine import make_engine
from periodic_async.model import load_policy, num_parameters

PATHS = ("object_store", "collective")


def measure(preset: str, workers: int, repeats: int, tokenizer: str) -> list[dict]:
    cfgs = {p: load_config(RunConfig, None, [f"model.name_or_path={preset}", f"model.tokenizer={tokenizer}",
                                             "model.device=cpu", "engine.backend=ray", f"engine.num_workers={workers}",
                                             f"engine.weight_sync={p}"]) for p in PATHS}
    policy, _ = load_policy(cfgs[PATHS[0]].model)
    state = {k: v.detach() for k, v in policy.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in {id(p): p for p in policy.parameters()}.values())
    times: dict[str, list[dict]] = {p: [] for p in PATHS}
    engines = {}
    try:
        for p in PATHS:
            engines[p] = make_engine(cfgs[p].engine, cfgs[p].model)
        for p in PATHS:  # warm-up: first allocation on both sides
            engines[p].update_weights(state, 1)
        for r in range(repeats):
            order = PATHS if r % 2 == 0 else PATHS[::-1]
            for p in order:
                engines[p].update_weights(state, r + 2)
                times[p].append(dict(engines[p].last_sync))
    finally:
        for p in reversed(PATHS):  # the first engine started Ray: close it last
            if p in engines:
                engines[p].close()
    rows = []
    for p in PATHS:
        total = [t["total_s"] for t in times[p]]
        rows.append({"preset": preset, "parameters": num_parameters(policy), "param_bytes": nbytes,
                     "path": p, "workers": workers, "repeats": repeats,
                     "median_s": round(statistics.median(total), 5), "min_s": round(min(total), 5),
                     "max_s": round(max(total), 5),
                     "median_publish_s": round(statistics.median(t["publish_s"] for t in times[p]), 5),
                     "median_load_s": round(statistics.median(t["load_s"] for t in times[p]), 5)})
    base = rows[0]["median_s"]
    for row in rows:
        row["speedup_vs_object_store"] = round(base / row["median_s"], 3)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = experiment_parser(__doc__, repeats=(5, 5), quick=False)
    ap.add_argument("--presets", nargs="+", default=["qwen2-1m", "qwen2-5m", "qwen3-25m"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokenizer", default="artifacts/tokenizer")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    rows = []
    for preset in args.presets:
        rows += measure(preset, args.workers, args.repeats, args.tokenizer)
        print(rows[-2], rows[-1], sep="\n", flush=True)
    out = write_csv(Path(args.results) / "weight_sync_collective.csv", rows)
    print(f"wrote {out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
