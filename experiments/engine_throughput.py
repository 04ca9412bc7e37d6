"""Engine throughput: our continuous-batching engine vs transformers' static-batch `generate`.

    bash experiments/engine_throughput.sh          # QUICK=1 for a < 2 min run; RESULTS_DIR=results

Both sides get the same requests (synthetic prompts through the chat template, G samples
each, temperature 1) and the same per-request max_tokens, with eos ignored so every sample
is exactly max_tokens long (random tiny models rarely emit eos): 'uniform' gives every
request the same length, 'long-tail' draws it from a lognormal. The HF baseline runs static
batches of max_num_seqs sequences (max_num_seqs / G prompts x G), each as long as its
longest request; with W workers it is W processes of 1 thread, each on the requests our
dispatcher gives that worker. Our engine is `RayEngine` with W actors of 1 thread. Only
generation is timed (models are loaded and warmed first); tok/s counts useful tokens.

Protocol (periodic_async.bench): for each worker count the four systems (HF and ours, on each
distribution) run interleaved for `--repeats` rounds (default 3; 1 with --quick); tok/s is the
median with min and max, speedup the ratio of medians with the min/max of same-round ratios.

Also measures `update_weights` (object-store sync to every worker) for each model preset.
Writes $RESULTS_DIR/engine.csv and $RESULTS_DIR/weight_sync.csv.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from periodic_async.bench.protocol import System, measure, write_csv  # noqa: E402
from periodic_async.config import DataConfig, EngineConfig, ModelConfig, git_commit  # noqa: E402
from periodic_async.data import make_synthetic, prompt_messages  # noqa: E402
from periodic_async.engine import Request, SamplingParams, assign_workers  # noqa: E402
from periodic_async.data.prompts import encode_chat  # noqa: E402
from periodic_async.data.tokenizer import ensure_tokenizer  # noqa: E402


def make_requests(tokenizer, n_prompts: int, group: int, dist: str, uniform_tokens: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    examples = make_synthetic(n_prompts, DataConfig(), seed=seed)
    if dist == "uniform":
        lengths = [uniform_tokens] * n_prompts
    else:  # median uniform_tokens / 2, a few up to 6x uniform_tokens
        lengths = np.clip(rng.lognormal(np.log(uniform_tokens / 2), 1.0, n_prompts), 4, 6 * uniform_tokens)
        lengths = [int(x) for x in lengths]
    return [Request(f"{dist}-{i}", encode_chat(tokenizer, prompt_messages(ex)), group,
                    SamplingParams(max_tokens=m, ignore_eos=True), seed=i)
            for i, (ex, m) in enumerate(zip(examples, lengths))]


def hf_worker(model_cfg, requests, max_num_seqs, barrier, results):
    """One baseline process: static batches through `model.generate`, 1 thread."""
    torch.set_num_threads(1)
    from periodic_async.model import load_policy

    model, tok = load_policy(model_cfg)
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.eos_token_id = None  # ignore eos: every batch runs to its max_new_tokens
    gen_cfg.do_sample, gen_cfg.temperature, gen_cfg.top_p, gen_cfg.top_k = True, 1.0, 1.0, 0
    per_batch = max(1, max_num_seqs // requests[0].n)
    batches = [requests[i:i + per_batch] for i in range(0, len(requests), per_batch)]

    def run(batches, cap=None):
        for b in batches:
            enc = tok.pad({"input_ids": [r.prompt_ids for r in b]}, return_tensors="pt", padding_side="left")
            cfg = copy.deepcopy(gen_cfg)
            cfg.num_return_sequences = b[0].n
            cfg.max_new_tokens = min(cap or 10**9, max(r.params.max_tokens for r in b))
            with torch.inference_mode():
                model.generate(**enc, generation_config=cfg)

    run(batches[:1], cap=4)  # warm-up
    barrier.wait()
    start = time.time()
    run(batches)
    results.put((start, time.time()))


def hf_throughput(model_cfg, requests, workers, max_num_seqs) -> float:
    parts = [[] for _ in range(workers)]
    for w, r in zip(assign_workers(requests, workers), requests):
        parts[w].append(r)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=hf_worker, args=(model_cfg, p, max_num_seqs, barrier, results)) for p in parts]
    for p in procs:
        p.start()
    spans = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    tokens = sum(r.n * r.params.max_tokens for r in requests)
    return tokens / (max(e for _, e in spans) - min(s for s, _ in spans))


def engine_throughput(engine, requests) -> float:
    warm = [copy.deepcopy(r) for r in requests[:2]]
    for r in warm:
        r.params.max_tokens = 4
    list(engine.generate(warm))  # warm-up
    t = time.perf_counter()
    outs = list(engine.generate(requests))
    seconds = time.perf_counter() - t
    tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
    expected = sum(r.n * r.params.max_tokens for r in requests)
    if tokens != expected:  # every request runs to max_tokens (no stop): anything else is a wrong count
        raise RuntimeError(f"engine_throughput: generated {tokens} tokens, expected {expected}")
    return tokens / seconds


def weight_sync(models, tokenizer_dir, workers, repeats=3) -> list[dict]:
    from periodic_async.engine.ray_engine import RayEngine
    from periodic_async.model import load_policy, num_parameters

    rows = []
    for name in models:
        cfg = ModelConfig(name_or_path=name, tokenizer=tokenizer_dir, device="cpu")
        model, _ = load_policy(cfg)
        state = model.state_dict()
        nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
        engine = RayEngine(EngineConfig(backend="ray", num_workers=workers), cfg)
        try:
            syncs = []
            for v in range(1, repeats + 1):
                engine.update_weights(state, v)
                syncs.append(dict(engine.last_sync))
        finally:
            engine.close()
        best = min(syncs, key=lambda s: s["total_s"])
        rows.append(dict(model=name, params=num_parameters(model), bytes=nbytes,
                         sync_s=round(statistics.median(s["total_s"] for s in syncs), 4), workers=workers,
                         publish_s=round(best["publish_s"], 4), load_s=round(best["load_s"], 4)))
        print(f"weight sync {rows[-1]}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model and workload (< 2 min)")
    ap.add_argument("--repeats", type=int, default=None, help="measured rounds (default 3; 1 with --quick)")
    ap.add_argument("--results-dir", default=os.environ.get("RESULTS_DIR", "results"))
    ap.add_argument("--tokenizer", default="artifacts/tokenizer")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    model = "qwen2-1m" if args.quick else "qwen2-5m"
    n_prompts, group, max_num_seqs, uniform_tokens = (32, 4, 32, 64) if args.quick else (64, 4, 32, 96)
    tokenizer = ensure_tokenizer(args.tokenizer)
    model_cfg = ModelConfig(name_or_path=model, tokenizer=str(Path(args.tokenizer).resolve()), device="cpu")
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    import ray

    from periodic_async.engine.ray_engine import RayEngine

    ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    rows = []
    workloads = {d: make_requests(tokenizer, n_prompts, group, d, uniform_tokens, seed=0)
                 for d in ("uniform", "long-tail")}
    for workers in (1, 2):
        engine_cfg = EngineConfig(backend="ray", num_workers=workers, threads_per_worker=1, max_num_seqs=max_num_seqs)
        engine = RayEngine(engine_cfg, model_cfg)
        workload = dict(n_prompts=n_prompts, group=group, uniform_tokens=uniform_tokens, seed=0)
        systems = []
        for d, reqs in workloads.items():
            common = {"model": model, "distribution": d, "workers": workers, "max_num_seqs": max_num_seqs, **workload}
            systems += [
                System(f"hf/{d}", lambda reqs=reqs: {"tok_s": hf_throughput(model_cfg, reqs, workers, max_num_seqs)},
                       {**common, "system": "hf-static-generate", "processes": workers, "threads": 1}),
                System(f"engine/{d}", lambda reqs=reqs: {"tok_s": engine_throughput(engine, reqs)},
                       {**common, "system": "ray-engine", "engine": vars(engine_cfg)}),
            ]
        try:
            res = measure(systems, repeats=repeats)
        finally:
            engine.close()
        for d, reqs in workloads.items():
            ours, hf = res[f"engine/{d}"], res[f"hf/{d}"]
            o, h, paired = ours.stats("tok_s"), hf.stats("tok_s"), ours.ratio(hf, "tok_s")
            rows.append(dict(distribution=d, workers=workers, engine_tok_s=round(o.median, 1),
                             hf_tok_s=round(h.median, 1), speedup=round(o.median / h.median, 3), model=model,
                             tokens=sum(r.n * r.params.max_tokens for r in reqs),
                             engine_tok_s_min=round(o.min, 1), engine_tok_s_max=round(o.max, 1),
                             hf_tok_s_min=round(h.min, 1), hf_tok_s_max=round(h.max, 1),
                             speedup_min=round(paired.min, 3), speedup_max=round(paired.max, 3),
                             repeats=ours.repeats, git_commit=git_commit(), config_hash=ours.config_hash,
                             hf_config_hash=hf.config_hash))
            print(rows[-1], flush=True)
    write_csv(out_dir / "engine.csv", rows)
    sync_rows = weight_sync(["qwen2-1m", "qwen2-5m", "qwen3-25m"], model_cfg.tokenizer, workers=2)
    write_csv(out_dir / "weight_sync.csv", [{**r, "git_commit": git_commit()} for r in sync_rows])
    ray.shutdown()
    print(f"wrote {out_dir / 'engine.csv'} and {out_dir / 'weight_sync.csv'}")


if __name__ == "__main__":
    main()
