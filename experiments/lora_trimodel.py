"""LoRA against full fine-tuning (beyond the paper): what the unified tri-model holds, and costs.

With `model.lora.enabled` the tri-model keeps one base: the reference is the base with the
adapter off, the old policy a copy of the adapter tensors. Measured on SmolLM2-135M-Instruct,
fp32, LoRA r=16 (alpha 32) on all seven linear projections (bench/lora_setting.py), one thread:
parameter bytes of policy + old + ref, and one micro-step's time (2 groups x 4 responses x 64
tokens after a 128-token prompt), LoRA against full, with every model kept (beta > 0, two
optimizer steps per iteration) and in the default (beta = 0, one step: policy only); variants
interleaved round by round in one process (round 0 warms up). The trainer's peak memory
(peak_rss_mib, on the all_kept rows): the peak resident set of a process that loads the policy
and runs one such micro-step and one AdamW step (interpreter and libraries included), one fresh
process per mode and round.

    python experiments/lora_trimodel.py [--quick] [--repeats 3] [--model DIR]

Writes <results>/lora_trimodel.csv. --quick: 1 round, a micro-batch of 1 group x 2 responses x 16 tokens
after a 32-token prompt (the peak memory's too).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from periodic_async import grpo
from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.fresh_process import in_fresh_process
from periodic_async.bench.lora_setting import MODEL, RANK, model_config
from periodic_async.bench.micro_batch import make_micro_batch
from periodic_async.records import write_csv
from periodic_async.config import AlgorithmConfig
from periodic_async.model import load_policy, num_parameters
from periodic_async.trace import log_experiment
from periodic_async.trimodel import TriModel

SHAPE = (2, 4, 128, 64)
"""The micro-batch: groups, responses per group, prompt tokens, response tokens."""
QUICK_SHAPE = (1, 2, 32, 16)


def trimodel_rounds(rounds: int, path: str, shape: tuple[int, int, int, int]) -> list[dict]:
    """Tri-model bytes and micro-step time, LoRA against full, interleaved in this process."""
    torch.set_num_threads(1)
    models = {mode: load_policy(model_config(path, mode == "lora"))[0] for mode in ("full", "lora")}
    one = num_parameters(models["full"]) * 4
    inputs = make_micro_batch(models["full"].config.vocab_size, *shape).build(shared=True)
    variants = {"all_kept": (0.04, False, 2), "default": (0.0, True, 1)}  # beta, skip_old_forward, steps
    tris = {(mode, v): TriModel(models[mode], AlgorithmConfig(group_size=4, beta=b, skip_old_forward=s,
                                                              optimizer_steps_per_iteration=k))
            for mode in models for v, (b, s, k) in variants.items()}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in tris}
    for rnd in range(rounds + 1):
        order = list(tris)
        random.Random(rnd).shuffle(order)
        for key in order:
            models[key[0]].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            tris[key].micro_step(inputs, grpo.LossAccumulator("token-mean"))
            if rnd > 0:  # round 0 warms up
                times[key].append(time.perf_counter() - t0)
        print(f"[lora_trimodel] round {rnd}/{rounds}", flush=True)
    rows = []
    for (mode, v), ts in times.items():
        full = times[("full", v)]
        mem = tris[(mode, v)].memory()
        rows.append({"mode": mode, "variant": v, **mem, "weights_vs_one_model": round(mem["total_bytes"] / one, 3),
                     "micro_step_s": round(statistics.median(ts), 4), "micro_step_s_min": round(min(ts), 4),
                     "micro_step_s_max": round(max(ts), 4),
                     "micro_step_vs_full": round(statistics.median(t / f for t, f in zip(ts, full)), 3),
                     "packed_tokens": inputs.packed.num_tokens, "rounds": len(ts), "model": Path(path).name,
                     "lora_rank": RANK})
    return rows


def peak_one(mode: str, path: str, shape: tuple[int, int, int, int]) -> dict:
    """In a fresh process: load the policy (full or LoRA), run one tri-model micro-step (every
    model kept: beta > 0, the old policy's forward) and one optimizer step; its peak resident memory."""
    torch.set_num_threads(1)
    policy = load_policy(model_config(path, mode == "lora"))[0]
    tri = TriModel(policy, AlgorithmConfig(group_size=4, beta=0.04, skip_old_forward=False))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6)
    inputs = make_micro_batch(policy.config.vocab_size, *shape).build(shared=True)
    tri.micro_step(inputs, grpo.LossAccumulator("token-mean"))
    opt.step()
    # VmHWM: this process's own high-water mark (getrusage's ru_maxrss survives exec on Linux: it
    # would report the parent's resident set at the fork when that was larger)
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return {"peak_rss_mib": round(int(hwm.split()[1]) / 1024, 1)}


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, repeats=(3, 1))
    ap.add_argument("--model", default=MODEL)
    args = ap.parse_args(argv)
    shape = QUICK_SHAPE if args.quick else SHAPE
    rows = trimodel_rounds(args.repeats, args.model, shape)
    peaks: dict[str, list[float]] = {"full": [], "lora": []}
    for rnd in range(args.repeats):
        for mode in ("full", "lora") if rnd % 2 == 0 else ("lora", "full"):
            peaks[mode].append(in_fresh_process(peak_one, mode, args.model, shape)["peak_rss_mib"])
    for row in rows:
        if row["variant"] == "all_kept":  # the process that trains with every model kept
            row["peak_rss_mib"] = statistics.median(peaks[row["mode"]])
            row["peak_rss_vs_full"] = round(row["peak_rss_mib"] / statistics.median(peaks["full"]), 3)
    out = write_csv(Path(args.results) / "lora_trimodel.csv", rows)
    for r in rows:
        print(f"{r['mode']:5s} {r['variant']:9s} weights x{r['weights_vs_one_model']:.3f} one model, "
              f"micro-step {r['micro_step_s']:.3f} s (x{r['micro_step_vs_full']:.2f} full)")
    log_experiment("lora_trimodel", [out])


if __name__ == "__main__":
    main()
