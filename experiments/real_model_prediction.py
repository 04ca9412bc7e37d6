"""Where the real-model speedup would be with more engines: the simulator
(periodic_async.scale.simulate) calibrated on SmolLM2-135M-Instruct's measured phase costs,
predicting sync-separated and periodic-async with 1, 2, 4 and 8 engine workers beside the same
one-core trainer. Every predicted row is labelled kind=simulated: a prediction, not a measurement.

    python experiments/real_model_prediction.py [--runs runs/reward_curves/reward_curves_real_time]
                                                [--results results] [--engines 1 2 4 8]

Input: the two runs of `bash experiments/reward_curves_real.sh`'s wall-clock part (one vLLM
worker on one core, the trainer on the other; 10 iterations each). Calibration: the costs of
generation (per decode step and per active sequence), training (per packed token, micro-step,
optimizer step) and the weight push, fitted to the sync-separated run's iterations, where each
phase ran alone (periodic_async.scale.calibrate.fit_costs; each worker owns its core, as each
engine would own its accelerator). Check: the periodic-async run, which the fit did not see,
re-simulated from its own response lengths (rel_error). Prediction: the measured iterations'
response lengths replayed with N engine workers and the same trainer.

Writes <results>/async_real_prediction.csv: kind (measured | simulated), mode, engines,
iteration_s, generate_s, train_busy_s, tokens_per_s, speedup_vs_sync_separated (same engines),
speedup_vs_1_engine (same mode), rel_error (simulated against measured, for the measured points),
git_commit (the runs').
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.records import write_csv
from periodic_async.scale.calibrate import fit_costs, load_run, simulate_measured
from periodic_async.scale.simulate import Deployment, simulate_iteration


def _median(xs) -> float:
    return round(statistics.median(xs), 3)


def main(argv=None) -> list[dict]:
    ap = experiment_parser(__doc__, quick=False)
    ap.add_argument("--runs", default="runs/reward_curves/reward_curves_real_time",
                    help="the two measured runs (sync-separated/, periodic-async/)")
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args(argv)
    runs = {m: load_run(Path(args.runs) / m, name=m) for m in ("sync-separated", "periodic-async")}
    commit = json.loads((Path(args.runs) / "sync-separated" / "run_info.json").read_text())["git_commit"]
    costs = fit_costs([runs["sync-separated"]])  # each worker owns its core: no host sharing
    print(f"[real_model_prediction] costs fitted on sync-separated (phases alone): {costs}")
    rows = []
    for mode, r in runs.items():
        sims = simulate_measured(r, costs)
        measured = [it.metrics for it in r.iterations]
        rows.append({"kind": "measured", "mode": mode, "engines": r.deployment.inference_devices,
                     "iteration_s": _median(m["time/iteration_s"] for m in measured),
                     "generate_s": _median(m["time/generate_s"] for m in measured),
                     "train_busy_s": _median(m["time/train_s"] for m in measured),
                     "tokens_per_s": round(sum(m["tokens/trained"] for m in measured)
                                           / sum(m["time/iteration_s"] for m in measured), 2),
                     "rel_error": round(_median(s.iteration_s for s in sims)
                                        / _median(m["time/iteration_s"] for m in measured) - 1, 3)})
    lengths = [(it.lengths_BxG, [it.prompt_tokens] * len(it.lengths_BxG)) for it in runs["sync-separated"].iterations]
    workload, train = runs["sync-separated"].workload, runs["sync-separated"].deployment.train_devices
    for engines in args.engines:
        for mode in ("sync-separated", "periodic-async"):
            sims = [simulate_iteration(l, p, workload, Deployment(mode, engines, train), costs) for l, p in lengths]
            rows.append({"kind": "simulated", "mode": mode, "engines": engines,
                         "iteration_s": _median(s.iteration_s for s in sims),
                         "generate_s": _median(s.generate_s for s in sims),
                         "train_busy_s": _median(s.train_busy_s for s in sims),
                         "tokens_per_s": round(sum(s.trained_tokens for s in sims)
                                               / sum(s.iteration_s for s in sims), 2),
                         "rel_error": ""})
    for row in rows:
        same = [r for r in rows if r["kind"] == row["kind"]]
        sync = next(r for r in same if r["mode"] == "sync-separated" and r["engines"] == row["engines"])
        one = next(r for r in same if r["mode"] == row["mode"] and r["engines"] == 1)
        row.update(speedup_vs_sync_separated=round(row["tokens_per_s"] / sync["tokens_per_s"], 3),
                   speedup_vs_1_engine=round(row["tokens_per_s"] / one["tokens_per_s"], 3), git_commit=commit)
    out = write_csv(Path(args.results) / "async_real_prediction.csv", rows)
    for row in rows:
        print({k: v for k, v in row.items() if k != "git_commit"})
    print(f"[real_model_prediction] wrote {out} (kind=simulated rows are predictions)")
    return rows


if __name__ == "__main__":
    main()
