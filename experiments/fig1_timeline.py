"""The paper's Figure 1 from real runs: 10 requests, 5 generation slots, sync-separated (a)
above periodic-async (b), drawn from the runs' own traces.

    python experiments/fig1_timeline.py [--quick] [--results results] [section.key=value ...]

What the picture must show, and the CSV checks on every drawn iteration: in sync-separated the
trainer starts once the last request finished and takes the requests in dataset order; in
periodic-async the engine's slots refill as requests finish, the trainer starts at the first
finished request and takes them in completion order, and the weight update (optimizer step,
then weight sync to the engine) closes each iteration.

Writes <results>/fig1/<mode>.trace.jsonl (+ rollouts), <results>/fig1_timeline.csv
(mode, iteration, wall_s, first_group_s, train_start_s, generation_s, trains_while_generating,
trained_order: requests numbered 1..B in dataset order, listed as the trainer took them) and
<figures>/fig1_timeline.png (`plots.plot_timeline`, also called by notebooks/fig1_timeline.ipynb).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
from pathlib import Path

from periodic_async.bench.plots import plot_timeline, request_number
from periodic_async.trace import log_experiment, read_jsonl

HERE = Path(__file__).resolve().parent
MODES = ["sync-separated", "periodic-async"]
COLUMNS = ["mode", "iteration", "wall_s", "first_group_s", "train_start_s", "generation_s",
           "trains_while_generating", "trained_order"]


def iteration_phases(events: list[dict]) -> list[dict]:
    """Per iteration, from one run's trace: times from the end of the weight sync that started
    it (version t on the engines) to its first finished request, the trainer's first
    micro-step, the last finished request and the end of the next weight sync; and the order
    in which the trainer took the requests (numbered 1..B by dataset position)."""
    syncs = {e["args"]["version"]: e["start"] + e["dur"] for e in events if e["name"] == "weight_sync"}
    rows = []
    for it in sorted(v for v in syncs if v + 1 in syncs):
        t0 = syncs[it]
        gen = [e for e in events if e["name"] == "generate" and e["args"]["request"].startswith(f"it{it}-")]
        ends: dict[str, float] = {}  # request -> its last sample's end (a group is done then)
        for e in gen:
            ends[e["args"]["request"]] = max(ends.get(e["args"]["request"], 0.0), e["start"] + e["dur"])
        steps = [e for e in events if e["name"] == "micro_step" and e["args"].get("iteration") == it]
        train_start = min(e["start"] for e in steps)
        rows.append({"iteration": it, "wall_s": syncs[it + 1] - t0, "first_group_s": min(ends.values()) - t0,
                     "train_start_s": train_start - t0, "generation_s": max(ends.values()) - t0,
                     "trains_while_generating": train_start < max(ends.values())})
    return rows


def trained_orders(rollouts: list[dict]) -> dict[int, str]:
    """Iteration -> the requests (1..B by dataset position) in the order the trainer took them."""
    out: dict[int, list[int]] = {}
    for r in sorted(rollouts, key=lambda r: (r["iteration"], r["arrival"])):
        out.setdefault(r["iteration"], []).append(r["position"] + 1)
    return {it: " ".join(map(str, order)) for it, order in out.items()}


def draw(results: Path, figures: Path) -> Path:
    """<figures>/fig1_timeline.png from <results>/fig1_timeline.csv and the traces in <results>/fig1/
    (the notebook calls this too): the first iteration of each mode is titled with its order."""
    with (results / "fig1_timeline.csv").open() as f:
        first = {}
        for r in csv.DictReader(f):
            first.setdefault(r["mode"], r)
    panels = [(f"{m}: {len(first[m]['trained_order'].split())} requests, trained in order "
               f"{first[m]['trained_order']}", results / "fig1" / f"{m}.trace.jsonl") for m in MODES]
    return plot_timeline(panels, figures / "fig1_timeline.png", bar_label=request_number)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default="results")
    ap.add_argument("--runs", default="runs/fig1_timeline")
    ap.add_argument("--figures", default=os.environ.get("FIGURES_DIR", "figures"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from periodic_async.config import RunConfig, load_config  # here: the notebook imports `draw` only
    from periodic_async.pipeline import run

    extra = list(args.overrides)
    if not Path(load_config(RunConfig, HERE / "fig1_timeline.yaml", extra).model.name_or_path).is_dir():
        print("[fig1_timeline] no warm start (run `bash experiments/warm_start.sh`); using the random qwen2-1m preset")
        extra.append("model.name_or_path=qwen2-1m")
    extra.append("logging.wandb_group=fig1_timeline")
    out = Path(args.results)
    (out / "fig1").mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in MODES:
        cfg = load_config(RunConfig, HERE / "fig1_timeline.yaml",
                          extra + [f"pipeline.mode={mode}", f"trainer.output_dir={args.runs}/{mode}"])
        run(cfg)
        for name in ("trace.jsonl", "rollouts.jsonl"):  # keep them: the notebook redraws from results/
            shutil.copy(Path(cfg.trainer.output_dir) / name, out / "fig1" / f"{mode}.{name}")
        orders = trained_orders(read_jsonl(out / "fig1" / f"{mode}.rollouts.jsonl"))
        for r in iteration_phases(read_jsonl(out / "fig1" / f"{mode}.trace.jsonl")):
            rows.append({"mode": mode, **{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()},
                         "trained_order": orders[r["iteration"]]})
    with (out / "fig1_timeline.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    png = draw(out, Path(args.figures))
    for r in rows:
        print(r)
    log_experiment("fig1_timeline", [out / "fig1_timeline.csv"], [png])
    print(f"[fig1_timeline] wrote {out}/fig1_timeline.csv, {png}")
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
