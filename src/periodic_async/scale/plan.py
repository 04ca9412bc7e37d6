"""The device-split planner: for a model size, a device count and a workload, the split of
devices between inference and training that the simulator (`simulate.py`) predicts fastest
for each mode, with its throughput. Every number it prints is *simulated* from the costs of a
device file (`calibrate.device_costs`; the shipped example holds illustrative assumptions).

    python -m periodic_async plan --model-params 32e9 --devices 64 --batch 512 --group 16
    python -m periodic_async plan --model-params 32e9 --devices 16,32,48,64 --device-type Ascend-910B

The split search: sync-colocated has none (every device generates, then trains); for the
separated modes every multiple of the engine size from one engine up to leaving the trainer
its minimum D0 devices, coarse first (about 8 points), then every split around the best.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence, get_args

from periodic_async.config import OnPolicyMode, SyncMode
from periodic_async.scale.calibrate import DeviceCosts, colocate_switch_s, device_costs, load_device_file
from periodic_async.scale.simulate import Deployment, LengthDist, Workload, run_tokens_per_s, simulate_run

DEFAULT_COSTS = Path(__file__).resolve().parents[3] / "experiments" / "device_costs.example.yaml"


@dataclass(frozen=True)
class PlanPoint:
    """One simulated deployment (kind = simulated)."""

    mode: str
    devices: int
    inference_devices: int
    train_devices: int
    tokens_per_s: float
    iteration_s: float
    generate_s: float
    train_busy_s: float
    after_generation_s: float
    best: bool = False
    kind: str = "simulated"


def simulate_point(mode: str, infer: int, train: int, dc: DeviceCosts, spec: dict, params: float,
                   workload: Workload, lengths: LengthDist, prompt_tokens: int, iterations: int,
                   seed: int) -> PlanPoint:
    costs = dc.costs
    dep = Deployment(mode, infer, train)
    if mode == "sync-colocated":
        costs = replace(costs, colocate_switch_s=colocate_switch_s(spec, params, dep.devices, costs.devices_per_engine))
    res = simulate_run(workload, dep, costs, lengths, prompt_tokens, iterations, seed)
    n = len(res)
    return PlanPoint(mode, dep.devices, infer if mode != "sync-colocated" else dep.devices,
                     train if mode != "sync-colocated" else dep.devices, run_tokens_per_s(res),
                     sum(r.iteration_s for r in res) / n, sum(r.generate_s for r in res) / n,
                     sum(r.train_busy_s for r in res) / n, sum(r.after_generation_s for r in res) / n)


def best_split(mode: str, total: int, dc: DeviceCosts, spec: dict, params: float, workload: Workload,
               lengths: LengthDist, prompt_tokens: int, iterations: int = 1, seed: int = 0) -> list[PlanPoint]:
    """Every split simulated for `mode` on `total` devices (the best one has best=True); empty
    when the model does not fit (fewer than one engine + D0 trainer devices)."""
    tp, d0 = dc.costs.devices_per_engine, dc.costs.train_ref_devices
    args = (dc, spec, params, workload, lengths, prompt_tokens, iterations, seed)
    if mode == "sync-colocated":
        if total < max(tp, d0):
            return []
        return [replace(simulate_point(mode, total, total, *args), best=True)]
    splits = list(range(tp, total - d0 + 1, tp))
    if not splits:
        return []
    stride = max(1, math.ceil(len(splits) / 8))
    points = {i: simulate_point(mode, splits[i], total - splits[i], *args) for i in range(0, len(splits), stride)}
    top = max(points, key=lambda i: points[i].tokens_per_s)
    for i in range(max(0, top - stride + 1), min(len(splits), top + stride)):
        if i not in points:
            points[i] = simulate_point(mode, splits[i], total - splits[i], *args)
    top = max(points, key=lambda i: points[i].tokens_per_s)
    return [replace(p, best=(i == top)) for i, p in sorted(points.items())]


def plan(totals: Sequence[int], params: float, device: str, workload_args: dict, costs_path: str | Path = DEFAULT_COSTS,
         modes: Sequence[str] = get_args(OnPolicyMode), iterations: int = 1, seed: int = 0,
         devices_per_engine: int | None = None) -> tuple[list[PlanPoint], DeviceCosts]:
    """All simulated points for every total in `totals` and every mode. workload_args: batch,
    group, prompt_tokens, response_median, response_sigma, max_tokens, max_num_seqs,
    micro_batch_tokens, shared_prompt."""
    devices, assumptions = load_device_file(costs_path)
    if device not in devices:
        raise ValueError(f"device type {device!r} not in {costs_path}: {sorted(devices)}")
    spec, w = devices[device], workload_args
    lengths = LengthDist(w["max_tokens"], w["response_median"], w["response_sigma"])
    mean_r = min(w["max_tokens"], w["response_median"] * math.exp(w["response_sigma"] ** 2 / 2))
    dc = device_costs(spec, assumptions, params, w["prompt_tokens"] + mean_r, w["max_num_seqs"], devices_per_engine)
    workload = Workload(w["batch"], w["group"], dc.slots, w["micro_batch_tokens"], 1, w["shared_prompt"],
                        dc.notes["model_bytes"])
    points = [p for total in totals for mode in modes
              for p in best_split(mode, total, dc, spec, params, workload, lengths, w["prompt_tokens"], iterations,
                                  seed)]
    return points, dc


def main(argv: list[str] | None = None) -> list[PlanPoint]:
    ap = argparse.ArgumentParser(prog="python -m periodic_async plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-params", type=float, required=True, help="dense parameters, e.g. 32e9")
    ap.add_argument("--devices", default="64", help="total devices, or a comma list (e.g. 16,32,48,64)")
    ap.add_argument("--batch", type=int, default=512, help="B: prompts per iteration")
    ap.add_argument("--group", type=int, default=16, help="G: responses per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--response-median", type=float, default=1024, help="lognormal median of response tokens")
    ap.add_argument("--response-sigma", type=float, default=0.7, help="lognormal sigma (the tail)")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="slots per engine (fewer if the KV cache is full)")
    ap.add_argument("--micro-batch-tokens", type=int, default=65536)
    ap.add_argument("--no-shared-prompt", action="store_true")
    ap.add_argument("--device-type", default="H100-SXM-80GB")
    ap.add_argument("--costs", default=str(DEFAULT_COSTS), help="device file (YAML)")
    ap.add_argument("--devices-per-engine", type=int, default=None, help="tensor-parallel size (default: memory)")
    ap.add_argument("--iterations", type=int, default=1, help="simulated iterations per point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=None, help="also write every simulated point here")
    a = ap.parse_args(argv)
    totals = [int(x) for x in a.devices.split(",") if x]
    w = dict(batch=a.batch, group=a.group, prompt_tokens=a.prompt_tokens, response_median=a.response_median,
             response_sigma=a.response_sigma, max_tokens=a.max_tokens, max_num_seqs=a.max_num_seqs,
             micro_batch_tokens=a.micro_batch_tokens, shared_prompt=not a.no_shared_prompt)
    points, dc = plan(totals, a.model_params, a.device_type, w, a.costs, iterations=a.iterations, seed=a.seed,
                      devices_per_engine=a.devices_per_engine)
    print(f"SIMULATED plan (not measured): {a.model_params:.3g} parameters on {a.device_type}, "
          f"B={a.batch} x G={a.group}, P={a.prompt_tokens}, responses lognormal(median {a.response_median:g}, "
          f"sigma {a.response_sigma:g}) <= {a.max_tokens}")
    print(f"costs from {a.costs} (illustrative assumptions unless you supplied measured ones); derived: "
          + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in dc.notes.items()))
    c = dc.costs
    print(f"  decode step a={c.decode_step_s:.4g}s + b={c.decode_seq_s:.3g}s/seq + c={c.decode_ctx_s:.3g}s/ctx token; "
          f"prefill {c.prefill_token_s:.3g}s/token; train {c.train_token_s:.3g}s/token on D0={c.train_ref_devices}, "
          f"dp_efficiency {c.dp_efficiency}/doubling; sync {c.sync_s(dc.notes['model_bytes']):.2f}s")
    print(f"{'devices':>7} {'mode':<15} {'inference':>9} {'training':>8} {'tokens/s (simulated)':>21} "
          f"{'iteration_s':>11} {'gen_s':>8} {'tail_s':>7}")
    for p in points:
        if p.best:
            print(f"{p.devices:>7} {p.mode:<15} {p.inference_devices:>9} {p.train_devices:>8} {p.tokens_per_s:>21,.0f} "
                  f"{p.iteration_s:>11.1f} {p.generate_s:>8.1f} {p.after_generation_s:>7.1f}")
    best = {(p.devices, p.mode): p.tokens_per_s for p in points if p.best}
    top = max(totals)
    for base in get_args(SyncMode):
        if (top, base) in best:
            beat = [n for n in sorted(totals) if best.get((n, "periodic-async"), 0) > best[(top, base)]]
            print(f"simulated: periodic-async beats {base} on {top} devices from "
                  f"{beat[0] if beat else 'none'} of the totals given" if beat else
                  f"simulated: periodic-async beats {base} on {top} devices at none of the totals given")
    if not points:
        print("no deployment fits: the model needs at least one engine and D0 trainer devices")
    if a.csv:
        from periodic_async.records import write_csv

        write_csv(a.csv, [asdict(p) for p in points], provenance=False)  # a prediction: no machine measured it
    return points
