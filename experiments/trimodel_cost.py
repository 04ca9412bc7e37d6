"""What the unified tri-model costs (the paper's unified tri-model): time of one micro-step and weight memory.

One micro-step of the streaming consumer runs the policy forward+backward and, on the same
packed input, the old and reference forwards. This measures, side by side in one run
(variants interleaved round by round, so machine noise hits them alike; ratios are medians
of per-round ratios):

    policy_only         policy forward + backward of sum(logp)   (the floor)
    tri_full            policy fwd+bwd + old fwd + ref fwd + GRPO loss (beta > 0, several steps/iter)
    tri_skip_old        old forward skipped (one step per iteration, ratio == 1), ref fwd kept
    tri_full_beta0      old fwd kept, no reference (beta == 0)
    tri_skip_old_beta0  neither: policy fwd+bwd + GRPO loss only

and the parameter bytes of the models each variant keeps. Writes one CSV row per variant.

    bash experiments/trimodel_cost.sh                 # qwen2-5m, fp32
    QUICK=1 bash experiments/trimodel_cost.sh         # qwen2-1m (wall time: results/run_all_times_quick.csv)
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from periodic_async import grpo
from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.micro_batch import make_micro_batch
from periodic_async.records import write_csv
from periodic_async.config import AlgorithmConfig, ModelConfig
from periodic_async.model import build_model, num_parameters
from periodic_async.shared_prompt import token_logprobs
from periodic_async.data.tokenizer import ensure_tokenizer
from periodic_async.trace import log_experiment
from periodic_async.trimodel import TriModel

VARIANTS = {  # name: (beta, skip_old_forward, optimizer_steps_per_iteration)
    "tri_full": (0.04, False, 2),
    "tri_skip_old": (0.04, True, 1),
    "tri_full_beta0": (0.0, False, 2),
    "tri_skip_old_beta0": (0.0, True, 1),
}


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, repeats=(8, 3))  # timed rounds, after one warm-up round
    ap.add_argument("--preset", default="qwen2-5m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--groups", type=int, default=2, help="groups in the micro-batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokenizer", default="artifacts/tokenizer")
    args = ap.parse_args(argv)
    if args.quick:  # qwen2-1m, a small micro-batch
        args.preset, args.groups, args.group_size, args.prompt_len, args.response_len = "qwen2-1m", 2, 4, 48, 24
    torch.set_num_threads(args.threads)

    tokenizer = ensure_tokenizer(args.tokenizer)
    mcfg = ModelConfig(name_or_path=args.preset, dtype=args.dtype, device="cpu", tokenizer=args.tokenizer)
    policy = build_model(mcfg, tokenizer)
    inputs = make_micro_batch(len(tokenizer), args.groups, args.group_size, args.prompt_len,
                              args.response_len).build(shared=True, dtype=policy.dtype)
    tris = {}
    for name, (beta, skip, steps) in VARIANTS.items():
        cfg = AlgorithmConfig(group_size=args.group_size, beta=beta, skip_old_forward=skip,
                              optimizer_steps_per_iteration=steps)
        tris[name] = TriModel(policy, cfg)  # all share the policy; each keeps its own old / ref copies

    def policy_only() -> None:
        token_logprobs(policy, inputs.packed).sum().backward()

    def tri_step(tri: TriModel):
        return lambda: tri.micro_step(inputs, grpo.LossAccumulator("token-mean"))

    steps = {"policy_only": policy_only, **{n: tri_step(t) for n, t in tris.items()}}
    times: dict[str, list[float]] = {n: [] for n in steps}
    for rnd in range(args.repeats + 1):
        order = list(steps)
        random.Random(rnd).shuffle(order)
        for name in order:
            policy.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            steps[name]()
            dt = time.perf_counter() - t0
            if rnd > 0:  # round 0 warms up
                times[name].append(dt)

    base = times["policy_only"]
    one = num_parameters(policy) * policy.dtype.itemsize
    rows = []
    for name, ts in times.items():
        mem = tris[name].memory() if name in tris else {"policy_bytes": one, "old_bytes": 0, "ref_bytes": 0,
                                                         "total_bytes": one}
        rows.append({
            "variant": name, "preset": args.preset, "dtype": args.dtype, "threads": args.threads,
            "packed_tokens": inputs.packed.num_tokens, "label_tokens": inputs.num_tokens,
            "repeats": len(ts), "median_ms": round(1e3 * statistics.median(ts), 2),
            "ratio_vs_policy_only": round(statistics.median(t / b for t, b in zip(ts, base)), 3),
            **mem, "memory_ratio": round(mem["total_bytes"] / one, 3),
        })
    out = write_csv(Path(args.results) / "trimodel_cost.csv", rows)
    for r in rows:
        print(f"{r['variant']:20s} {r['median_ms']:9.2f} ms  x{r['ratio_vs_policy_only']:.2f} time  "
              f"x{r['memory_ratio']:.0f} weights ({r['total_bytes'] / 2**20:.1f} MiB)")
    log_experiment("trimodel_cost", [out])  # W&B (offline unless WANDB_MODE=online)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
