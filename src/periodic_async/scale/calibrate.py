"""Cost parameters for the simulator (`simulate.Costs`): fitted on measured runs of this
repository, or derived from a file of published device figures plus stated assumptions.

Fitted (`fit_costs`, from run directories: config.yaml, metrics.jsonl, rollouts.jsonl; the
first iteration of every run is left out, it pays start-up costs):
    generation   a, b (decode step, per active sequence) by non-negative least squares of
                 `time/generate_s` against the engine's schedule in step space
                 (`simulate.engine_chunks` on the run's own response lengths), on the
                 synchronous runs with one engine (the engine alone on its cores). p (prefill)
                 and c (KV reads) are left at 0 unless asked: at CPU scale a group's prefill
                 is one forward of ~40 tokens, folded into a and b, and the responses are
                 tens of tokens; with a fixed prompt length p is not identified anyway
    training     train_token_s, train_micro_step_s, optimizer_step_s by NNLS of `time/train_s`
                 against (packed tokens, micro-batches, 1) of the simulator's own micro-batches
                 (cut groups repeat their prompt), on the synchronous runs with the fewest
                 trainer devices (D0); dp_efficiency from the runs with more
    sync         sync_base_s = median `time/sync_s`; sync_per_byte_s from weight_sync.csv
                 (a line through its model sizes) when given
    contention   one number, by a 1-D search minimising the squared log error of the
                 simulated iteration times of the runs where workers overlap (periodic-async,
                 several engines); 0 when there are none
The prompt length of an iteration is its mean, (tokens/trained - tokens/response) / (B*G).

From devices (`device_costs`): a device file (YAML) gives per device type its peak dense
16-bit FLOP/s, HBM bandwidth and memory, the weight-sync and host-link bandwidths, and
shared `assumptions` (utilisations, data-parallel efficiency, latencies): illustrative
figures, not measurements (see experiments/device_costs.example.yaml). For a dense model of
N parameters in 16-bit weights:
    engine size      the smallest power of two of devices whose memory holds 2 weights
    a                2N bytes / (devices_per_engine * HBM bandwidth * hbm_util) + decode_overhead_s
    b                2N FLOP / (devices_per_engine * peak * mfu_decode)
    c                KV bytes per token / (devices_per_engine * HBM bandwidth * hbm_util)
    p                2N FLOP / (devices_per_engine * peak * mfu_prefill)
    D0               devices whose memory holds the trainer: 16 B/param (fp32 master, Adam, bf16
                     copy and gradient) + 2 B/param reference model, at train_memory_util
    train_token_s    8N FLOP (policy forward+backward 6N, reference forward 2N; the old
                     forward is skipped with one step per iteration) / (D0 * peak * mfu_train)
    sync             sync_latency_s + 2N bytes / sync bandwidth
    colocate switch  2 x (trainer state per device + engine weights per device) / host link

Measured on one GPU (`load_gpu_check`, `measured_device_file`): the trainer's packed tokens/s
and the built-in engine's decode step times from `scripts/gpu_check.sh`'s trainer.csv and
engine.csv become the utilisations of the formulas above (mfu_train, mfu_decode, the engine's
per-step overhead), so that the simulator can size other models and deployments on that GPU.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence, get_args

import numpy as np
import yaml

from periodic_async.config import SyncMode
from periodic_async.scale.simulate import (Costs, Deployment, IterationResult, MicroBatches, Workload, engine_chunks,
                                     simulate_iteration)


@dataclass(frozen=True)
class MeasuredIteration:
    lengths_BxG: list[list[int]]
    """Response tokens per sample, prompts in dataset order."""
    prompt_tokens: int
    """Mean P of the iteration."""
    metrics: dict
    """The iteration's line of metrics.jsonl."""


@dataclass
class MeasuredRun:
    """One real run: what the simulator needs of its configuration, and its iterations."""

    name: str
    deployment: Deployment
    workload: Workload
    devices_per_engine: int
    iterations: list[MeasuredIteration] = field(default_factory=list)


def load_run(run_dir: str | Path, name: str | None = None, skip_first: bool = True,
             trainer_ranks: int = 1) -> MeasuredRun:
    """Read a run directory written by `pipeline.run` (config.yaml, metrics.jsonl,
    rollouts.jsonl; checkpoint*/*.safetensors for the model's bytes). trainer_ranks: the
    torchrun ranks it trained on (its config does not say); trainer devices = ranks x threads."""
    d = Path(run_dir)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    e, a, t = cfg["engine"], cfg["algorithm"], cfg["trainer"]
    mode = cfg["pipeline"]["mode"]
    infer, train = e["num_workers"] * e["threads_per_worker"], t["threads"] * trainer_ranks
    weights = sorted(d.glob("checkpoint*/*.safetensors"))
    model_bytes = weights[-1].stat().st_size if weights else 0
    workload = Workload(a["prompts_per_iteration"], a["group_size"], e["max_num_seqs"], a["micro_batch_tokens"],
                        a["micro_batch_groups"], a["shared_prompt"], float(model_bytes))
    metrics = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    metrics = [m for m in metrics if "tokens/trained" in m]  # iterations only (not the end's held-out line)
    rollouts = [json.loads(x) for x in (d / "rollouts.jsonl").read_text().splitlines() if x.strip()]
    run = MeasuredRun(name or d.name, Deployment(mode, infer, train), workload, e["threads_per_worker"])
    B, G = workload.prompts, workload.group_size
    for i, m in enumerate(metrics):
        if skip_first and i == 0:
            continue
        groups = sorted((r for r in rollouts if r["iteration"] == m["step"] - 1), key=lambda r: r["position"])
        if len(groups) != B:
            raise ValueError(f"{d}: iteration {m['step'] - 1} has {len(groups)} groups in rollouts.jsonl, expected {B}")
        p = round((m["tokens/trained"] - m["tokens/response"]) / (B * G))
        run.iterations.append(MeasuredIteration([[len(x) for x in r["response_ids"]] for r in groups], p, m))
    return run


def costs_for(run: MeasuredRun, costs: Costs) -> Costs:
    """`costs` with the run's engine size (threads per worker)."""
    return replace(costs, devices_per_engine=run.devices_per_engine)


def simulate_measured(run: MeasuredRun, costs: Costs) -> list[IterationResult]:
    """The simulated twin of every measured iteration (same lengths, prompts, deployment)."""
    c = costs_for(run, costs)
    return [simulate_iteration(it.lengths_BxG, [it.prompt_tokens] * len(it.lengths_BxG), run.workload,
                               run.deployment, c) for it in run.iterations]


def nnls(X: np.ndarray, y: np.ndarray, parsimony: float = 0.05) -> np.ndarray:
    """Non-negative least squares by trying every subset of columns (few columns), keeping the
    smallest subset whose squared error is within `parsimony` (relative) of the best: with
    collinear features (a fixed slot count makes decode steps proportional to tokens) the data
    do not identify more parameters, and fewer extrapolate more plainly."""
    fits = []
    for k in range(1, X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), k):
            sol, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if np.all(sol >= 0):
                theta = np.zeros(X.shape[1])
                theta[list(cols)] = sol
                fits.append((k, cols, float(np.sum((X @ theta - y) ** 2)), theta))
    if not fits:
        return np.zeros(X.shape[1])
    best = min(err for _, _, err, _ in fits)
    # Among fits as good as the best, the fewest columns, then the earliest ones: columns come
    # in order of physical importance (the per-token cost before per-step constants), so when
    # identical workloads cannot tell them apart the work stays per token, where the simulator
    # can overlap it, instead of becoming one constant at the end of the iteration.
    return min((f for f in fits if f[2] <= best * (1 + parsimony) + 1e-18), key=lambda f: (f[0], f[1]))[3]


def engine_features(run: MeasuredRun, it: MeasuredIteration) -> np.ndarray:
    """Coefficients of (a, b, c, p) of the busiest engine's whole generation (round-robin dispatch)."""
    n = max(1, run.deployment.inference_devices // run.devices_per_engine)
    feats = []
    for e in range(n):
        samples = [(g, it.prompt_tokens, r) for g in range(e, len(it.lengths_BxG), n) for r in it.lengths_BxG[g]]
        feats.append(sum((ch.features() for ch in engine_chunks(samples, run.workload.slots)), np.zeros(4)))
    return max(feats, key=lambda f: f[1])


def trainer_features(run: MeasuredRun, it: MeasuredIteration) -> np.ndarray:
    """Coefficients of (train_token_s, train_micro_step_s, optimizer_step_s): the packed tokens
    and the number of the micro-batches the simulator forms (`simulate.MicroBatches`), and 1."""
    w = run.workload
    batcher = MicroBatches(w.micro_batch_tokens, w.micro_batch_groups, w.shared_prompt)
    tokens = [t for lengths in it.lengths_BxG for t in batcher.add(it.prompt_tokens, lengths)] + batcher.flush()
    return np.array([sum(tokens), len(tokens), 1.0])


def weight_sync_slope(path: str | Path) -> float:
    """Seconds per byte of a line through weight_sync.csv (bytes, sync_s), least squares."""
    rows = list(csv.DictReader(Path(path).open()))
    x = np.array([float(r["bytes"]) for r in rows])
    y = np.array([float(r["sync_s"]) for r in rows])
    return max(float(np.polyfit(x, y, 1)[0]), 0.0) if len(rows) >= 2 else 0.0


def fit_costs(runs: Sequence[MeasuredRun], host_cores: float | None = None,
              weight_sync_csv: str | Path | None = None, fit_prefill: bool = False) -> Costs:
    """Fit `Costs` to measured runs (see the module docstring). host_cores: the cores the runs
    shared (None: each worker had its own devices); fit_prefill: fit p too (needs runs whose
    prompt lengths vary independently of their response lengths, or it is not identified)."""
    sync_runs = [r for r in runs if r.deployment.mode in get_args(SyncMode)]
    if not sync_runs:
        raise ValueError("calibration needs at least one synchronous run (phases measured alone)")
    solo = [r for r in sync_runs if r.deployment.inference_devices // r.devices_per_engine == 1] or sync_runs
    X = np.array([engine_features(r, it) for r in solo for it in r.iterations])
    y = np.array([it.metrics["time/generate_s"] for r in solo for it in r.iterations])
    cols = [0, 1, 3] if fit_prefill else [0, 1]
    a, b, p = (*nnls(X[:, cols], y), 0.0)[:3]
    d0 = min(r.deployment.train_devices for r in sync_runs)
    ref = [(r, it) for r in sync_runs if r.deployment.train_devices == d0 for it in r.iterations]
    Xt = np.array([trainer_features(r, it) for r, it in ref])
    tok, micro, opt = nnls(Xt, np.array([it.metrics["time/train_s"] for _, it in ref]))
    effs = []
    for r in sync_runs:
        ratio = r.deployment.train_devices / d0
        for it in r.iterations if ratio > 1 else []:
            solo_s = float(trainer_features(r, it) @ np.array([tok, micro, opt]))
            effs.append(math.log(solo_s / it.metrics["time/train_s"] / ratio) / math.log2(ratio))
    eff = min(1.5, math.exp(statistics.fmean(effs))) if effs else 1.0
    syncs = [it.metrics["time/sync_s"] for r in runs for it in r.iterations]
    per_byte = weight_sync_slope(weight_sync_csv) if weight_sync_csv else 0.0
    model_bytes = statistics.median(r.workload.model_bytes for r in runs)
    a, b, p, tok, micro, opt = (float(x) for x in (a, b, p, tok, micro, opt))
    costs = Costs(decode_step_s=a, decode_seq_s=b, prefill_token_s=p, train_token_s=tok, train_micro_step_s=micro,
                  optimizer_step_s=opt, train_ref_devices=d0, dp_efficiency=eff, sync_per_byte_s=per_byte,
                  sync_base_s=max(0.0, statistics.median(syncs) - per_byte * model_bytes), host_cores=host_cores)
    overlapping = [r for r in runs if r.deployment.mode == "periodic-async"
                   or r.deployment.inference_devices // r.devices_per_engine > 1]
    if overlapping and host_cores:
        costs = replace(costs, contention=_fit_contention(overlapping, costs))
    return costs


def _log_error(runs: Sequence[MeasuredRun], costs: Costs) -> float:
    return sum(math.log(s.iteration_s / it.metrics["time/iteration_s"]) ** 2
               for r in runs for s, it in zip(simulate_measured(r, costs), r.iterations))


def _fit_contention(runs: Sequence[MeasuredRun], costs: Costs, lo: float = 0.0, hi: float = 1.5) -> float:
    """Golden-section search of `contention` in [lo, hi] (the error is unimodal in practice)."""
    g = (math.sqrt(5) - 1) / 2
    f = {}

    def err(x: float) -> float:
        if x not in f:
            f[x] = _log_error(runs, replace(costs, contention=x))
        return f[x]

    a, b = lo, hi
    for _ in range(25):
        c, d = b - g * (b - a), a + g * (b - a)
        a, b = (a, d) if err(c) < err(d) else (c, b)
    return round((a + b) / 2, 4)


# --- published device figures --------------------------------------------------------------

DEVICE_KEYS = ("peak_tflops", "hbm_GBps", "memory_GB", "sync_GBps", "host_link_GBps")
ASSUMPTION_KEYS = ("mfu_train", "mfu_prefill", "mfu_decode", "hbm_util", "decode_overhead_s", "dp_efficiency",
                   "sync_latency_s", "engine_memory_util", "train_memory_util")


def load_device_file(path: str | Path) -> tuple[dict[str, dict], dict]:
    """({device type: figures}, assumptions) from a device file; checks every key is there."""
    data = yaml.safe_load(Path(path).read_text())
    devices, assumptions = data.get("devices") or {}, data.get("assumptions") or {}
    for name, spec in devices.items():
        missing = [k for k in DEVICE_KEYS if k not in spec]
        if missing:
            raise ValueError(f"{path}: device {name!r} lacks {missing}")
    missing = [k for k in ASSUMPTION_KEYS if k not in assumptions]
    if missing:
        raise ValueError(f"{path}: assumptions lack {missing}")
    return devices, assumptions


def kv_bytes_per_token(params: float) -> float:
    """KV-cache bytes per token of a grouped-query-attention model, 16-bit: 8.2e-6 x N bytes (a
    rule of thumb fitted to Qwen2.5-7B, 57 KiB, and -32B, 256 KiB: layers x 2 x kv heads x 128 x 2)."""
    return 8.2e-6 * params


@dataclass(frozen=True)
class DeviceCosts:
    costs: Costs
    slots: int
    """Sequences per engine: max_num_seqs, or fewer where the KV cache does not hold them."""
    notes: dict
    """Derived quantities (engine size, D0, KV capacity) for the report."""


def colocate_switch_s(spec: dict, params: float, devices: int, devices_per_engine: int) -> float:
    """Both switches of a co-located iteration: trainer state (18 B/param over `devices`) and
    engine weights (2 B/param over `devices_per_engine`) out and back over the host link."""
    return 2 * (18.0 * params / devices + 2.0 * params / devices_per_engine) / (spec["host_link_GBps"] * 1e9)


def device_costs(spec: dict, assumptions: dict, params: float, context_tokens: float, max_num_seqs: int = 256,
                 devices_per_engine: int | None = None) -> DeviceCosts:
    """`Costs` of a dense model of `params` parameters on a device type (see the module
    docstring); context_tokens: the mean P + R a sequence holds in the KV cache."""
    s, u = spec, assumptions
    peak, hbm, mem = s["peak_tflops"] * 1e12, s["hbm_GBps"] * 1e9, s["memory_GB"] * 1e9
    weights = 2.0 * params
    tp = devices_per_engine or 1
    while devices_per_engine is None and weights > u["engine_memory_util"] * tp * mem / 2:
        tp *= 2  # weights in at most half the engine's usable memory, the rest for the KV cache
    kv = kv_bytes_per_token(params)
    kv_tokens = max(0.0, u["engine_memory_util"] * tp * mem - weights) / kv
    slots = int(max(1, min(max_num_seqs, kv_tokens // max(context_tokens, 1))))
    train_state = 18.0 * params
    d0 = max(1, math.ceil(train_state / (u["train_memory_util"] * mem)))
    bw = tp * hbm * u["hbm_util"]
    costs = Costs(decode_step_s=weights / bw + u["decode_overhead_s"],
                  decode_seq_s=2 * params / (tp * peak * u["mfu_decode"]),
                  decode_ctx_s=kv / bw, prefill_token_s=2 * params / (tp * peak * u["mfu_prefill"]),
                  train_token_s=8 * params / (d0 * peak * u["mfu_train"]), train_ref_devices=d0,
                  dp_efficiency=u["dp_efficiency"], sync_base_s=u["sync_latency_s"],
                  sync_per_byte_s=1 / (s["sync_GBps"] * 1e9),
                  colocate_switch_s=colocate_switch_s(spec, params, d0, tp), devices_per_engine=tp)
    notes = {"devices_per_engine": tp, "slots_per_engine": slots, "kv_capacity_tokens": int(kv_tokens),
             "min_train_devices": d0, "model_bytes": weights}
    return DeviceCosts(costs, slots, notes)


# --- one GPU, measured (scripts/gpu_check.sh) ---------------------------------------------------

@dataclass(frozen=True)
class GpuMeasurements:
    """What the simulator takes from a GPU check (`scripts/gpu_check.sh OUT`: OUT/trainer.csv,
    OUT/engine.csv): the tri-model trainer's cost per packed token and the built-in engine's
    decode step, both measured on one device, with the device's datasheet figures."""

    gpu: str
    commit: str
    peak_tflops: float
    """Dense bf16 peak the check computed MFU against (its datasheet table, or --peak-tflops)."""
    hbm_GBps: float
    memory_GB: float
    train_model: str
    train_params: float
    train_token_s: float
    """Seconds per packed token of the micro-step with policy and reference (the largest model measured)."""
    engine_model: str
    engine_params: float
    decode_step_s: float
    """a: a decode step's fixed cost (line through the step times at the slot counts measured);
    with one slot count measured, that step's whole time (`decode_slots`)."""
    decode_seq_s: float | None
    """b: its cost per active sequence; None when one slot count was measured (a line needs two):
    `measured_device_file` then takes b from the example's mfu_decode."""
    source: str
    decode_slots: int = 0
    """The slot count of decode_step_s when decode_seq_s is None."""

    @property
    def label(self) -> str:
        """The `costs` label of rows simulated from these measurements."""
        return f"one {self.gpu}, measured"


def _ok_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"{path}: not found (run `bash scripts/gpu_check.sh {path.parent}` on the GPU)")
    return [r for r in csv.DictReader(path.open()) if r.get("status") == "ok"]


def _number(row: dict, key: str, path: Path) -> float:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: column {key!r} is missing or not a number ({row.get(key)!r})") from None


def load_gpu_check(directory: str | Path) -> GpuMeasurements:
    """Read a GPU check's trainer.csv and engine.csv (rows with status ok). Trainer: the
    policy + reference row of the largest model; engine: the built-in batcher's step time
    (wall_s / decode_steps) against its slots, a + b * slots by non-negative least squares."""
    d = Path(directory)
    tpath, epath = d / "trainer.csv", d / "engine.csv"
    train = [r for r in _ok_rows(tpath) if r.get("models") == "policy+ref"]
    if not train:
        raise ValueError(f"{tpath}: no row with models=policy+ref and status ok")
    t = max(train, key=lambda r: _number(r, "params", tpath))
    rows = [r for r in _ok_rows(epath) if r.get("engine") == "batcher"]
    if not rows:
        raise ValueError(f"{epath}: no row with engine=batcher and status ok")
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    model, rows = max(by_model.items(), key=lambda kv: len({r["slots"] for r in kv[1]}))
    slots = np.array([_number(r, "slots", epath) for r in rows])
    step_s = np.array([_number(r, "wall_s", epath) / max(_number(r, "decode_steps", epath), 1.0) for r in rows])
    if len(set(slots.tolist())) < 2:  # a line needs two: b comes from the example (measured_device_file)
        a, b, one = float(np.median(step_s)), None, int(slots[0])
    else:
        (a, b), one = (float(x) for x in nnls(np.stack([np.ones_like(slots), slots], 1), step_s)), 0
    return GpuMeasurements(
        gpu=t["gpu"], commit=t.get("commit", ""), peak_tflops=_number(t, "peak_tflops", tpath),
        hbm_GBps=_number(t, "hbm_gbps", tpath), memory_GB=_number(t, "memory_gb", tpath), train_model=t["model"],
        train_params=_number(t, "params", tpath), train_token_s=1.0 / _number(t, "tokens_per_s", tpath),
        engine_model=model, engine_params=_number(rows[0], "params", epath), decode_step_s=a, decode_seq_s=b,
        source=str(d), decode_slots=one)


def measured_device_file(m: GpuMeasurements, example: str | Path, out: str | Path) -> tuple[str, Path]:
    """Write a device file (the format of `load_device_file`) for the measured GPU and return
    (its device type, the file). Measured, in the file's conventions (N parameters of the model
    measured, the same formulas as `device_costs`, so they carry over to another model size):
        mfu_train          8 N / (train_token_s * peak)     (policy forward+backward + reference forward)
        mfu_decode         2 N / (b * peak)                 (b > 0; else the example's)
        decode_overhead_s  a - 2N bytes / (HBM * hbm_util)  (>= 0; the engine's per-step cost)
    Datasheet: peak and HBM bandwidth (the check's table); memory: what torch reports. Taken
    from `example` (not measured): hbm_util, the other assumptions, and the link bandwidths of
    its first device (sync_GBps, host_link_GBps). With one slot count measured (decode_seq_s
    None), b is the example's (2N / (mfu_decode * peak)) and a the measured step less b * slots."""
    devices, assumptions = load_device_file(example)
    links = next(iter(devices.values()))
    peak = m.peak_tflops * 1e12
    u = dict(assumptions)
    u["mfu_train"] = float(f"{8 * m.train_params / (m.train_token_s * peak):.4g}")
    step_s, seq_s = m.decode_step_s, m.decode_seq_s
    if seq_s is None:  # one slot count: the example's per-sequence cost, the rest of the step is fixed
        seq_s = 2 * m.engine_params / (u["mfu_decode"] * peak)
        step_s = m.decode_step_s - seq_s * m.decode_slots
    elif seq_s > 0:  # else (no growth with the slots measured) the example's
        u["mfu_decode"] = float(f"{2 * m.engine_params / (seq_s * peak):.4g}")
    weights_read = 2 * m.engine_params / (m.hbm_GBps * 1e9 * u["hbm_util"])
    u["decode_overhead_s"] = float(f"{max(0.0, step_s - weights_read):.4g}")
    name = f"{m.gpu} (measured)"
    spec = {"peak_tflops": m.peak_tflops, "hbm_GBps": m.hbm_GBps, "memory_GB": m.memory_GB,
            "sync_GBps": links["sync_GBps"], "host_link_GBps": links["host_link_GBps"]}
    header = (f"# MEASURED on one {m.gpu} by scripts/gpu_check.sh (commit {m.commit}; {m.source}):\n"
              f"#   trainer {m.train_model}: {1 / m.train_token_s:.0f} packed tokens/s (policy + reference)\n"
              + (f"#   engine {m.engine_model}: decode step {m.decode_step_s * 1e3:.3g} ms + "
                 f"{m.decode_seq_s * 1e3:.3g} ms per sequence\n" if m.decode_seq_s is not None else
                 f"#   engine {m.engine_model}: decode step {m.decode_step_s * 1e3:.3g} ms at {m.decode_slots} slots "
                 f"(one slot count: mfu_decode is the example's)\n") +
              f"# -> mfu_train, mfu_decode, decode_overhead_s below; peak, HBM: datasheet; every other\n"
              f"#    figure is the illustrative assumption of {Path(example).name}. Written by\n"
              f"#    periodic_async.scale.calibrate.measured_device_file; simulations from it are SIMULATED.\n")
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(header + yaml.safe_dump({"devices": {name: spec}, "assumptions": u}, sort_keys=False))
    return name, p
