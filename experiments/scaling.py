"""Scale-out: what a 2-core CPU can measure, the simulator calibrated on it, and the simulator's
predictions (labelled simulated) for 16-64 accelerators.

    python experiments/scaling.py [--quick] [--repeats 2] [--results results] [--figures figures]
                                  [--device-type H100-SXM-80GB] [section.key=value ...]

1. Measured (experiments/scaling.yaml, the bench protocol: systems interleaved round by round,
   median with min and max, first iteration of every run excluded, commit + config hash per
   row): sync-separated and periodic-async with 1 and 2 engine workers (engine.num_workers). On a
   2-core CPU periodic-async with 2 engine workers runs 3 busy workers on 2 cores: it measures
   oversubscription, not scale-out, and the simulator models it as such (processor sharing).
   With --trainer-ranks also sync-separated with 1 and 2 torchrun trainer ranks
   (periodic_async.parallel.distributed; each run a subprocess with its own engine; speedup_vs_1
   compares r2 with r1).
2. The simulator (periodic_async.scale.simulate) is calibrated on every measured run
   (periodic_async.scale.calibrate.fit_costs) and re-simulates each run's iterations from their own
   response lengths: relative error of the median iteration time per system, in-sample and
   leave-one-system-out (calibrated without that system's runs).
3. Predictions, simulated from experiments/device_costs.example.yaml (illustrative
   assumptions, not measurements): a 32B dense model, B=512 x G=16, 16 to 64 devices; per
   mode every inference/training split (periodic_async.scale.plan), the best one marked.
   When a GPU check's CSVs are in --gpu-results (default results/gpu: trainer.csv, engine.csv
   from `bash scripts/gpu_check.sh results/gpu`), the same predictions again on that GPU with
   its measured costs (periodic_async.scale.calibrate.load_gpu_check, measured_device_file;
   the device file it writes: <results>/device_costs.measured.yaml). Every simulated row says
   where its costs came from (column `costs`). --predictions-only skips parts 1 and 2 (and keeps
   the CPU points already in scaling_simulated.csv, with their commit).

Writes <results>/scaling_measured.csv, <results>/scaling_simulated.csv (every row kind=simulated)
and <figures>/scaling.png.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.protocol import SharedEngines, System, measure, settings_dict
from periodic_async.records import read_csv, write_csv
from periodic_async.scale.calibrate import (MeasuredRun, fit_costs, load_gpu_check, load_run, measured_device_file,
                                           simulate_measured)
from periodic_async.config import RunConfig, load_config
from periodic_async.engine.ray_engine import init_ray
from periodic_async.pipeline import run
from periodic_async.scale.plan import DEFAULT_COSTS, plan
from periodic_async.bench.plots import plot_scaling

HERE = Path(__file__).resolve().parent
SYSTEMS = {  # name -> overrides over scaling.yaml
    "sync-separated/e1": ["pipeline.mode=sync-separated", "engine.num_workers=1"],
    "sync-separated/e2": ["pipeline.mode=sync-separated", "engine.num_workers=2"],
    "periodic-async/e1": ["pipeline.mode=periodic-async", "engine.num_workers=1"],
    "periodic-async/e2": ["pipeline.mode=periodic-async", "engine.num_workers=2"],
}
# sync-colocated is not measured: with 2 trainer threads on a loaded, shared 2-core CPU its
# training ran 18x slower than with one thread (OpenMP threads waiting on each other), a
# property of an oversubscribed machine, not of co-location; the simulator's co-located mode is checked by
# tests/test_simulate.py against hand computations instead.
PREDICTION = dict(batch=512, group=16, prompt_tokens=512, response_median=1024, response_sigma=0.7, max_tokens=8192,
                  max_num_seqs=256, micro_batch_tokens=65536, shared_prompt=True)
MODEL_PARAMS = 32e9


def _metrics(summary: dict, r: MeasuredRun) -> dict:
    its = r.iterations
    return {**summary, "devices": r.deployment.devices,
            "iteration_s": statistics.fmean(i.metrics["time/iteration_s"] for i in its),
            "generate_s": statistics.fmean(i.metrics["time/generate_s"] for i in its),
            "train_s": statistics.fmean(i.metrics["time/train_s"] for i in its),
            "sync_s": statistics.fmean(i.metrics["time/sync_s"] for i in its)}


def torchrun_system(name: str, ranks: int, overrides: list[str], measured: dict, cfg: RunConfig) -> System:
    """A run with `ranks` trainer ranks: `torchrun --nproc-per-node=ranks -m periodic_async train`
    in a subprocess (its own engines and Ray, started before iteration 0, outside the measurement)."""
    out = cfg.trainer.output_dir
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
           "periodic_async", "train", "--config", str(HERE / "scaling.yaml"), *overrides]

    def once() -> dict:
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        r = load_run(out, name=name, trainer_ranks=ranks)
        measured[name].append(r)
        return _metrics(json.loads((Path(out) / "summary.json").read_text()), r)
    return System(name, once, {**asdict(cfg), "torchrun": {"nproc_per_node": ranks}})


def measure_cpu(args, extra: list[str]) -> tuple[list[dict], dict[str, list[MeasuredRun]]]:
    base = load_config(RunConfig, HERE / "scaling.yaml", args.overrides)
    if not Path(base.model.name_or_path).is_dir():
        print(f"[scaling] {base.model.name_or_path} not found; using the random qwen2-1m preset")
        extra = extra + ["model.name_or_path=qwen2-1m"]
    init_ray(base.engine)
    engines, measured = SharedEngines(), {name: [] for name in SYSTEMS}
    systems = []
    for name, over in SYSTEMS.items():
        out = f"{args.runs}/{name.replace('/', '-')}"
        cfg = load_config(RunConfig, HERE / "scaling.yaml",
                          args.overrides + extra + over + [f"trainer.output_dir={out}"])

        def once(cfg=cfg, name=name, out=out) -> dict:
            summary = run(cfg, engine=engines.get(cfg))
            r = load_run(out, name=name)
            measured[name].append(r)
            return _metrics(summary, r)
        systems.append(System(name, once, cfg))
    for ranks in (1, 2) if args.trainer_ranks else ():
        name = f"sync-separated/r{ranks}"
        over = args.overrides + extra + ["pipeline.mode=sync-separated", f"trainer.output_dir={args.runs}/r{ranks}"]
        measured[name] = []
        systems.append(torchrun_system(name, ranks, over, measured,
                                       load_config(RunConfig, HERE / "scaling.yaml", over)))
    try:
        res = measure(systems, repeats=args.repeats, ignore_settings=("trainer.output_dir",))
    finally:
        engines.close()
    rows = []
    for name, r in res.items():
        cfg = settings_dict(r.settings)
        ranks = cfg.get("torchrun", {}).get("nproc_per_node", 1)
        one = res.get(name.split("/")[0] + ("/r1" if "/r" in name else "/e1"))
        ratio = r.ratio(one) if one is not None and one is not r else None
        rows.append({"system": name, "mode": cfg["pipeline"]["mode"], "engine_workers": cfg["engine"]["num_workers"],
                     "trainer_ranks": ranks, "trainer_threads": cfg["trainer"]["threads"],
                     "devices": r.runs[0]["devices"], **r.row(["tokens_per_s"], 1),
                     **{k: v for k, v in r.row(["iteration_s"], 3).items() if k != "repeats"},
                     "generate_s": round(r.stats("generate_s").median, 3),
                     "train_s": round(r.stats("train_s").median, 3),
                     "sync_s": round(r.stats("sync_s").median, 4),
                     "speedup_vs_1": round(ratio.median, 3) if ratio else "",
                     "speedup_vs_1_min": round(ratio.min, 3) if ratio else "",
                     "speedup_vs_1_max": round(ratio.max, 3) if ratio else "",
                     "measured_iterations_per_run": len(measured[name][0].iterations), "cpu_cores": os.cpu_count(),
                     **r.provenance()})
    return rows, measured


def simulate_measured_points(measured: dict[str, list[MeasuredRun]], measured_rows: list[dict]) -> list[dict]:
    """Calibrate on every run; re-simulate each system (in-sample, and leave-one-system-out)."""
    cores = os.cpu_count()
    sync_csv = HERE.parent / "results" / "weight_sync.csv"
    sync_csv = sync_csv if sync_csv.is_file() else None
    everything = [r for runs in measured.values() for r in runs]
    costs = fit_costs(everything, host_cores=cores, weight_sync_csv=sync_csv)
    print(f"[scaling] calibrated costs (fit on all {len(everything)} runs): {costs}")
    rows = []
    for row in measured_rows:
        name = row["system"]
        others = [r for n, runs in measured.items() if n != name for r in runs]
        try:
            loo = fit_costs(others, host_cores=cores, weight_sync_csv=sync_csv)
        except ValueError:
            loo = None

        def predict(c):
            sims = [s for r in measured[name] for s in simulate_measured(r, c)]
            return statistics.median(s.iteration_s for s in sims), sims
        it_s, sims = predict(costs)
        meas = row["iteration_s"]
        loo_s = predict(loo)[0] if loo is not None else None
        rows.append({"kind": "simulated", "section": "cpu-measured-point", "device_type": f"cpu ({cores} cores)",
                     "model_params": "", "mode": row["mode"], "system": name, "devices": row["devices"],
                     "inference_devices": measured[name][0].deployment.inference_devices,
                     "train_devices": measured[name][0].deployment.train_devices,
                     "tokens_per_s": round(sum(s.trained_tokens for s in sims) / sum(s.iteration_s for s in sims), 1),
                     "iteration_s": round(it_s, 3),
                     "generate_s": round(statistics.median(s.generate_s for s in sims), 3),
                     "train_busy_s": round(statistics.median(s.train_busy_s for s in sims), 3),
                     "after_generation_s": round(statistics.median(s.after_generation_s for s in sims), 3),
                     "best": "", "measured_iteration_s": meas, "rel_error": round(it_s / meas - 1, 3),
                     "rel_error_leave_out": round(loo_s / meas - 1, 3) if loo_s else "",
                     "calibration": "all measured runs (in-sample); leave-out: without this system's runs",
                     "costs": f"cpu ({cores} cores), measured (fitted)"})
    return rows, costs


def predictions(device_types: list[str], totals: list[int], costs_path=DEFAULT_COSTS,
                costs: str = "example (illustrative assumptions)") -> list[dict]:
    rows = []
    for dev in device_types:
        points, dc = plan(totals, MODEL_PARAMS, dev, PREDICTION, costs_path)
        for p in points:
            d = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(p).items() if k != "kind"}
            rows.append({"kind": "simulated", "section": "prediction", "device_type": dev,
                         "model_params": MODEL_PARAMS, "system": "", **d,
                         "calibration": f"{Path(costs_path).name}; engine "
                                        f"{dc.notes['devices_per_engine']} devices, {dc.slots} slots, "
                                        f"D0={dc.notes['min_train_devices']}", "costs": costs})
    return rows


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, runs="runs/scaling", repeats=(2, 1), figures=True, overrides=True)
    ap.add_argument("--device-types", default="H100-SXM-80GB,Ascend-910B")
    ap.add_argument("--trainer-ranks", action="store_true",
                    help="also measure sync-separated with 1 and 2 torchrun trainer ranks (distributed.py)")
    ap.add_argument("--gpu-results", default="results/gpu",
                    help="a GPU check's CSVs (scripts/gpu_check.sh): predictions on its measured costs too")
    ap.add_argument("--predictions-only", action="store_true", help="skip the CPU measurement and its calibration")
    args = ap.parse_args(argv)
    extra = ["trainer.iterations=2", "algorithm.prompts_per_iteration=4", "data.num_train=1000"] if args.quick else []
    out = Path(args.results)
    measured_rows, sim_rows = [], []
    if not args.predictions_only:
        measured_rows, measured = measure_cpu(args, extra)
        write_csv(out / "scaling_measured.csv", measured_rows)
        sim_rows, _ = simulate_measured_points(measured, measured_rows)
    totals = [16, 64] if args.quick else list(range(16, 65, 8))
    sim_rows += predictions([d for d in args.device_types.split(",") if d], totals)
    gpu = Path(args.gpu_results)
    if (gpu / "trainer.csv").is_file() and (gpu / "engine.csv").is_file():
        m = load_gpu_check(gpu)
        name, device_file = measured_device_file(m, DEFAULT_COSTS, out / "device_costs.measured.yaml")
        print(f"[scaling] measured costs of {m.gpu} from {gpu} -> {device_file}")
        sim_rows += predictions([name], totals, device_file, f"{m.label} ({gpu}, commit {m.commit})")
    else:
        print(f"[scaling] no GPU check in {gpu} (trainer.csv, engine.csv): example costs only")
    if args.predictions_only and (out / "scaling_simulated.csv").is_file():  # keep the CPU points, their commit
        sim_rows = [{**r, "cpu": r.get("cpu", "")} for r in read_csv(out / "scaling_simulated.csv")
                    if r["section"] == "cpu-measured-point"] + sim_rows
    write_csv(out / "scaling_simulated.csv", sim_rows)
    if args.predictions_only:
        print(f"[scaling] wrote {out}/scaling_simulated.csv (predictions only)")
        return
    plot_scaling(out / "scaling_measured.csv", out / "scaling_simulated.csv", Path(args.figures) / "scaling.png")
    for r in measured_rows:
        print({k: r[k] for k in ("system", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "iteration_s",
                                 "speedup_vs_1", "speedup_vs_1_min", "speedup_vs_1_max")})
    for r in sim_rows:
        if r["section"] == "cpu-measured-point" or r["best"]:
            print({k: r[k] for k in ("section", "device_type", "system", "mode", "devices", "inference_devices",
                                     "train_devices", "tokens_per_s", "iteration_s", "rel_error", "rel_error_leave_out")
                   if k in r})
    print(f"[scaling] wrote {out}/scaling_measured.csv, {out}/scaling_simulated.csv, {args.figures}/scaling.png")


if __name__ == "__main__":
    sys.exit(main())
