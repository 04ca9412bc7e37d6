"""LoRA against full fine-tuning (beyond the paper): what the barrier pushes, and what it costs.

With `model.lora.enabled` the barrier pushes the adapter alone. Measured on SmolLM2-135M-Instruct,
fp32, LoRA r=16 (alpha 32) on all seven linear projections (bench/lora_setting.py), one thread:
per engine (the built-in engine in this process, vLLM in this process), the bytes of one push and
the seconds of reading it off the trainer (extract_s: what Consumer.engine_state_dict does; with
LoRA a copy of the adapter), of the engine's update (push_s) and of its check (check_s: the
probe's log-probs on the engine against the trainer's); push_check_s is the three together,
median over versions 2..V of one process (version 1 is the engine's first push); then the
engine's sampling speed through what the last push left (gen_tok_s: 8 requests x 32 tokens, eos
ignored; 8 tokens with --quick; with LoRA through the adapter). One process per (engine, mode): a process holds one vLLM
engine. The two modes alternate round by round; ratios are medians of per-round ratios.

    python experiments/lora_push.py [--quick] [--repeats 3] [--versions 6] [--engines local,vllm]

Writes <results>/lora_push.csv. --quick: 1 round, 2 versions, vLLM only, 8 tokens per request sampled.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.fresh_process import in_fresh_process
from periodic_async.bench.lora_setting import MODEL, RANK, model_config
from periodic_async.records import write_csv
from periodic_async.trace import log_experiment


def push_one(engine_name: str, mode: str, versions: int, path: str, gen_tokens: int) -> dict:
    """One process: start the engine, push `versions` versions of a moving policy, check each; then
    sample 8 requests x `gen_tokens` tokens through what the last push left."""
    from periodic_async.config import EngineConfig
    from periodic_async.engine import make_engine
    from periodic_async.engine.base import Request, SamplingParams
    from periodic_async.engine.verify import PushCheck, probe_tokens
    from periodic_async.lora import adapter_parameters
    from periodic_async.model import load_policy

    torch.set_num_threads(1)
    lora = mode == "lora"
    cfg = model_config(path, lora)
    policy, _ = load_policy(cfg)
    gen = torch.Generator().manual_seed(0)
    engine = make_engine(EngineConfig(backend=engine_name, max_num_seqs=8, vllm_kv_cache_gib=0.5), cfg)
    check = PushCheck(policy, probe_tokens(policy.config.vocab_size), 1e-3)
    rows = []
    try:
        for v in range(1, versions + 1):
            with torch.no_grad():  # a training step's worth of change to what is trained
                for p in policy.parameters():
                    if p.requires_grad:
                        p.add_((0.02 if lora else 1e-3) * torch.randn(p.shape, generator=gen))
            t0 = time.perf_counter()
            if lora:  # what the consumer pushes (Consumer.engine_state_dict)
                state = {n: t.detach().to("cpu", copy=True) for n, t in adapter_parameters(policy).items()}
            else:
                state = {n: t.detach() for n, t in policy.state_dict().items()}
            extract_s = time.perf_counter() - t0
            unique = {t.data_ptr(): t for t in state.values()}.values()
            push_s = engine.update_weights(state, v)
            gaps = check.after_push(engine, v, push_s)
            rows.append({"extract_s": extract_s, "push_s": push_s, "check_s": check.last["time/verify_s"],
                         "gap": float(gaps[0]), "bytes": sum(t.numel() * t.element_size() for t in unique),
                         "tensors": len(state)})
        # generation through what the last push left (the adapter with LoRA): 8 slots x gen_tokens each
        prompts = [probe_tokens(policy.config.vocab_size, 24, seed=s) for s in range(8)]
        reqs = [Request(f"gen-{i}", p, 1, SamplingParams(max_tokens=gen_tokens, temperature=1.0, ignore_eos=True), i)
                for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        tokens = sum(len(smp.token_ids) for out in engine.generate(reqs) for smp in out.samples)
        gen_tok_s = tokens / (time.perf_counter() - t0)
    finally:
        engine.close()
    steady = rows[1:] or rows
    out = {k: statistics.median(r[k] for r in steady) for k in ("extract_s", "push_s", "check_s")}
    out["gen_tok_s"] = round(gen_tok_s, 1)
    out.update(bytes=rows[0]["bytes"], tensors=rows[0]["tensors"], max_gap=max(r["gap"] for r in rows),
               versions=len(steady))
    return out


def push_rounds(engines: list[str], rounds: int, versions: int, path: str, gen_tokens: int) -> list[dict]:
    """Each engine's full and LoRA processes, alternating round by round; one row per (engine, mode)."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(rounds):
        for engine_name in engines:
            for mode in ["full", "lora"] if rnd % 2 == 0 else ["lora", "full"]:
                result = in_fresh_process(push_one, engine_name, mode, versions, path, gen_tokens)
                print(f"[lora_push] round {rnd + 1}/{rounds} {engine_name} {mode}: {result}", flush=True)
                runs.setdefault((engine_name, mode), []).append(result)
    rows = []
    for engine_name in engines:
        full, lora = runs[(engine_name, "full")], runs[(engine_name, "lora")]
        for mode, rs in (("full", full), ("lora", lora)):
            barrier = lambda r: r["extract_s"] + r["push_s"] + r["check_s"]  # noqa: E731 (what the barrier waits for)
            total = [barrier(r) for r in rs]
            ratio = [barrier(a) / barrier(b) for a, b in zip(rs, full)]
            rows.append({
                "engine": engine_name, "mode": mode, "bytes": rs[0]["bytes"], "tensors": rs[0]["tensors"],
                "bytes_vs_full": round(rs[0]["bytes"] / full[0]["bytes"], 4),
                "push_s": round(statistics.median(r["push_s"] for r in rs), 4),
                "check_s": round(statistics.median(r["check_s"] for r in rs), 4),
                "push_check_s": round(statistics.median(total), 4),
                "push_check_s_min": round(min(total), 4), "push_check_s_max": round(max(total), 4),
                "push_check_vs_full": round(statistics.median(ratio), 3),
                "push_check_vs_full_min": round(min(ratio), 3), "push_check_vs_full_max": round(max(ratio), 3),
                "extract_s": round(statistics.median(r["extract_s"] for r in rs), 4),
                "gen_tok_s": statistics.median(r["gen_tok_s"] for r in rs),
                "gen_vs_full": round(statistics.median(a["gen_tok_s"] / b["gen_tok_s"] for a, b in zip(rs, full)), 3),
                "max_gap": max(r["max_gap"] for r in rs), "rounds": len(rs),
                "versions_per_round": rs[0]["versions"], "model": Path(path).name, "lora_rank": RANK})
    return rows


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, repeats=(3, 1))
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--versions", type=int, default=None,
                    help="pushes per process, the first not counted (default 6; 2 with --quick)")
    ap.add_argument("--engines", default=None, help="comma-separated engines (default local,vllm; vllm with --quick)")
    args = ap.parse_args(argv)
    versions = args.versions or (2 if args.quick else 6)
    engines = (args.engines or ("vllm" if args.quick else "local,vllm")).split(",")
    rows = push_rounds(engines, args.repeats, versions, args.model, 8 if args.quick else 32)
    out = write_csv(Path(args.results) / "lora_push.csv", rows)
    for r in rows:
        print(f"{r['engine']:6s} {r['mode']:5s} {r['bytes'] / 2**20:7.1f} MiB  push+check "
              f"{r['push_check_s']:.3f} s (x{r['push_check_vs_full']:.2f} full)")
    log_experiment("lora_push", [out])


if __name__ == "__main__":
    main()
