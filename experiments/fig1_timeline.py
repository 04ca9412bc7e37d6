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
<figures>/fig1_timeline.png (`bench.plots.plot_fig1`, also called by notebooks/fig1_timeline.ipynb).
The phases and orders are computed by `bench.analysis.iteration_phases` and `trained_orders`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from periodic_async.bench.analysis import iteration_phases, trained_orders
from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.plots import plot_fig1
from periodic_async.bench.protocol import SharedEngines
from periodic_async.records import write_csv
from periodic_async.trace import log_experiment, read_jsonl

HERE = Path(__file__).resolve().parent
MODES = ["sync-separated", "periodic-async"]
COLUMNS = ["mode", "iteration", "wall_s", "first_group_s", "train_start_s", "generation_s",
           "trains_while_generating", "trained_order", "git_commit", "cpu"]


def main(argv=None) -> list[dict]:
    args = experiment_parser(__doc__, runs="runs/fig1_timeline", figures=True, overrides=True).parse_args(argv)
    from periodic_async.config import RunConfig, load_config
    from periodic_async.pipeline import run

    extra = (["data.num_train=1000"] if args.quick else []) + list(args.overrides)
    if not Path(load_config(RunConfig, HERE / "fig1_timeline.yaml", extra).model.name_or_path).is_dir():
        print("[fig1_timeline] no warm start (run `bash experiments/warm_start.sh`); using the random qwen2-1m preset")
        extra.append("model.name_or_path=qwen2-1m")
    extra.append("logging.wandb_group=fig1_timeline")
    out = Path(args.results)
    (out / "fig1").mkdir(parents=True, exist_ok=True)
    rows = []
    engines = SharedEngines()  # one start for both modes; each run pushes its own initial weights
    try:
        for mode in MODES:
            cfg = load_config(RunConfig, HERE / "fig1_timeline.yaml",
                              extra + [f"pipeline.mode={mode}", f"trainer.output_dir={args.runs}/{mode}"])
            run(cfg, engine=engines.get(cfg))
            for name in ("trace.jsonl", "rollouts.jsonl"):  # keep them: the notebook redraws from results/
                shutil.copy(Path(cfg.trainer.output_dir) / name, out / "fig1" / f"{mode}.{name}")
            orders = trained_orders(read_jsonl(out / "fig1" / f"{mode}.rollouts.jsonl"))
            for r in iteration_phases(read_jsonl(out / "fig1" / f"{mode}.trace.jsonl")):
                rows.append({"mode": mode, **{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()},
                             "trained_order": orders[r["iteration"]]})
    finally:
        engines.close()
    write_csv(out / "fig1_timeline.csv", rows, COLUMNS)
    png = plot_fig1(out, Path(args.figures), MODES)
    for r in rows:
        print(r)
    log_experiment("fig1_timeline", [out / "fig1_timeline.csv"], [png])
    print(f"[fig1_timeline] wrote {out}/fig1_timeline.csv, {png}")
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
