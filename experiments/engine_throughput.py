"""Engine throughput: our continuous-batching engine, vLLM and transformers' static `generate`.

    bash experiments/engine_throughput.sh          # QUICK=1 for a short run; RESULTS_DIR=results

Three engines get the same requests (synthetic prompts through the model's chat template, G
samples each, temperature 1, a seed per request) and the same per-request max_tokens, with eos
ignored so every sample is exactly max_tokens long: 'uniform' gives every request the same
length, 'long-tail' draws it from a lognormal (median half, a few up to 6x). Engines:

    builtin   our `ContinuousBatcher` in Ray workers (engine.worker_backend=batcher)
    vllm      vLLM in Ray workers (engine.worker_backend=vllm), continuous batching of its own
    hf        static batches of max_num_seqs sequences (max_num_seqs / G prompts x G) through
              `model.generate`, each batch as long as its longest request; W workers are W
              processes (started once per model), each on the requests our dispatcher gives it
              (periodic_async/bench/hf_generate.py: what it measures, why it is a fair peer)

Each worker has 1 thread. Two models: a tiny preset (random weights, vocabulary 512) with 1 and
2 workers, and the real model SmolLM2-135M-Instruct (`python -m periodic_async prepare-model
smollm2-135m`; vocabulary 49,152) with 1 worker; --quick: the tiny preset on 2 workers only. Only
generation is timed (models loaded and warmed first); tok/s counts generated tokens.

Protocol (periodic_async.bench): for each (model, workers) the six systems (three engines x two
distributions) run interleaved for `--repeats` rounds (default 3; 1 with --quick); tok/s is the
median with min and max, a ratio the ratio of medians with the min/max of same-round ratios.

Also measures weight pushes: the built-in engine's object-store sync for each preset
(weight_sync.csv), and vLLM's push (reload_weights) with the probe check (engine/verify.py:
the largest gap between vLLM's and the trainer's log-probs of a fixed probe) for each model, on
its first pass (vllm_push.csv); --quick measures both kinds of push on the engines of its one
pass. Writes $RESULTS_DIR/engine.csv, weight_sync.csv and vllm_push.csv.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from periodic_async.bench.cli import experiment_parser  # noqa: E402
from periodic_async.bench.hf_generate import HFWorkers  # noqa: E402
from periodic_async.bench.protocol import System, measure  # noqa: E402
from periodic_async.records import write_csv  # noqa: E402
from periodic_async.config import DataConfig, EngineConfig, ModelConfig  # noqa: E402
from periodic_async.data import make_synthetic, prompt_messages  # noqa: E402
from periodic_async.data.prompts import encode_chat  # noqa: E402
from periodic_async.data.tokenizer import ensure_tokenizer  # noqa: E402
from periodic_async.engine import Request, SamplingParams  # noqa: E402

REAL_MODEL = "artifacts/smollm2-135m-instruct"
ENGINES = ("builtin", "vllm", "hf")


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
    """The built-in engine's object-store push of each preset to `workers` workers (median of `repeats`)."""
    from periodic_async.engine.ray_engine import RayEngine

    rows = []
    for name in models:
        cfg = ModelConfig(name_or_path=name, tokenizer=tokenizer_dir, device="cpu")
        engine = RayEngine(EngineConfig(backend="ray", num_workers=workers), cfg)
        try:
            rows.append(sync_row(engine, cfg, name, repeats))
        finally:
            engine.close()
    return rows


def sync_row(engine, model_cfg, label, repeats) -> dict:
    """`repeats` object-store pushes of the model's weights into a built-in `engine` (median)."""
    from periodic_async.model import load_policy, num_parameters

    model, _ = load_policy(model_cfg)
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    syncs = []
    for _ in range(repeats):
        engine.update_weights(state, engine.version + 1)
        syncs.append(dict(engine.last_sync))
    best = min(syncs, key=lambda s: s["total_s"])
    row = dict(model=label, params=num_parameters(model), bytes=nbytes,
               sync_s=round(statistics.median(s["total_s"] for s in syncs), 4), workers=engine.cfg.num_workers,
               publish_s=round(best["publish_s"], 4), load_s=round(best["load_s"], 4))
    print(f"weight sync {row}", flush=True)
    return row


def vllm_push(engine, model_cfg, repeats=3, seed=0) -> dict:
    """vLLM pushes of weights moved by 1e-3 x N(0, 1) (every tensor, tied embedding included),
    each checked with the probe (engine/verify.py); also the gap of a push that was *not* made
    (the control: the probe must see it)."""
    from periodic_async.engine.verify import PushCheck, model_logprobs, probe_tokens
    from periodic_async.model import load_policy

    policy, _ = load_policy(model_cfg)
    probe = probe_tokens(policy.config.vocab_size)
    check = PushCheck(policy, probe, atol=1e-3)
    g = torch.Generator().manual_seed(seed)
    pushes, gaps, verify = [], [], []
    for v in range(1, repeats + 1):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=g))
        state = policy.state_dict()
        push_s = engine.update_weights(state, engine.version + 1)
        got = check.after_push(engine, engine.version, push_s)
        pushes.append(push_s)
        gaps.append(max(got.values()))
        verify.append(check.last["time/verify_s"])
    with torch.no_grad():  # the control: the trainer moves on, the engine is not told
        for p in policy.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g))
    engine_lp = engine.probe_logprobs(probe)
    stale = max(float(np.max(np.abs(np.asarray(lp) - model_logprobs(policy, probe)))) for lp in engine_lp.values())
    nbytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values())
    return dict(push_s=round(statistics.median(pushes), 3), push_s_min=round(min(pushes), 3),
                push_s_max=round(max(pushes), 3), verify_s=round(statistics.median(verify), 3),
                probe_max_gap=float(f"{max(gaps):.3g}"), gap_without_push=float(f"{stale:.3g}"),
                tensors=len(state), bytes=nbytes, repeats=repeats)


def hf_directory(name: str, tokenizer_dir: str, root: Path) -> str:
    """A preset as an HF directory (vLLM loads directories): its seeded random weights saved once."""
    from periodic_async.model import load_policy

    out = root / name
    if not (out / "config.json").is_file():
        model, tok = load_policy(ModelConfig(name_or_path=name, tokenizer=tokenizer_dir, device="cpu"))
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return str(out.resolve())


def compare(model_cfg, label, workers, workload, repeats, max_num_seqs, kv_gib, measure_push: bool,
            measure_sync: bool) -> tuple[list[dict], dict | None, dict | None]:
    """The six systems of one (model, workers) interleaved: rows for engine.csv; with `measure_push`,
    the vLLM push row; with `measure_sync`, the built-in engine's weight-sync row (on the engine
    just measured)."""
    from periodic_async.data.tokenizer import load_tokenizer
    from periodic_async.engine.ray_engine import RayEngine

    tokenizer = load_tokenizer(model_cfg.name_or_path)
    requests = {d: make_requests(tokenizer, workload["n_prompts"], workload["group"], d, workload["uniform_tokens"],
                                 seed=0) for d in ("uniform", "long-tail")}
    cfgs = {e: EngineConfig(backend="ray", worker_backend="vllm" if e == "vllm" else "batcher", num_workers=workers,
                            threads_per_worker=1, max_num_seqs=max_num_seqs, vllm_kv_cache_gib=kv_gib)
            for e in ("builtin", "vllm")}
    engines = {e: RayEngine(c, model_cfg) for e, c in cfgs.items()}
    hf = None
    try:
        hf = HFWorkers(model_cfg, workers, max_num_seqs)
        systems = []
        for d, reqs in requests.items():
            common = {"model": label, "distribution": d, "workers": workers, "max_num_seqs": max_num_seqs, **workload}
            systems += [System(f"hf/{d}", lambda reqs=reqs: {"tok_s": hf.throughput(reqs)},
                               {**common, "system": "hf-static-generate", "processes": workers, "threads": 1})]
            systems += [System(f"{e}/{d}", lambda reqs=reqs, e=e: {"tok_s": engine_throughput(engines[e], reqs)},
                               {**common, "system": e, "engine": vars(cfgs[e])}) for e in ("builtin", "vllm")]
        res = measure(systems, repeats=repeats)
        push = vllm_push(engines["vllm"], model_cfg, repeats=repeats) if measure_push else None
        sync = sync_row(engines["builtin"], model_cfg, label, repeats=3) if measure_sync else None
    finally:
        if hf is not None:
            hf.close()
        for e in engines.values():
            e.close()
    rows = []
    for d, reqs in requests.items():
        row = dict(model=label, distribution=d, workers=workers)
        for e in ENGINES:
            st = res[f"{e}/{d}"].stats("tok_s")
            row.update({f"{e}_tok_s": round(st.median, 1), f"{e}_tok_s_min": round(st.min, 1),
                        f"{e}_tok_s_max": round(st.max, 1)})
        for a, b in (("vllm", "builtin"), ("vllm", "hf"), ("builtin", "hf")):
            ra, rb = res[f"{a}/{d}"], res[f"{b}/{d}"]
            paired = ra.ratio(rb, "tok_s")
            row.update({f"{a}_vs_{b}": round(ra.stats("tok_s").median / rb.stats("tok_s").median, 3),
                        f"{a}_vs_{b}_min": round(paired.min, 3), f"{a}_vs_{b}_max": round(paired.max, 3)})
        row.update(faster=max(("builtin", "vllm"), key=lambda e: row[f"{e}_tok_s"]),
                   tokens=sum(r.n * r.params.max_tokens for r in reqs), repeats=res[f"vllm/{d}"].repeats,
                   git_commit=res[f"vllm/{d}"].git_commit, config_hash=res[f"vllm/{d}"].config_hash)
        rows.append(row)
        print(row, flush=True)
    return rows, push, sync


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, runs="runs/engine_throughput", repeats=(3, 1))
    ap.add_argument("--tokenizer", default="artifacts/tokenizer")
    ap.add_argument("--no-real-model", action="store_true", help="the tiny preset only")
    args = ap.parse_args(argv)
    repeats = args.repeats
    tiny = "qwen2-1m" if args.quick else "qwen2-5m"
    tiny_workload = dict(n_prompts=16, group=4, uniform_tokens=32) if args.quick else \
        dict(n_prompts=64, group=4, uniform_tokens=96)
    real_workload = dict(n_prompts=1, group=4, uniform_tokens=8) if args.quick else \
        dict(n_prompts=8, group=4, uniform_tokens=64)
    tok_dir = str(Path(args.tokenizer).resolve())
    ensure_tokenizer(tok_dir)
    out_dir = Path(args.results)
    out_dir.mkdir(parents=True, exist_ok=True)

    from periodic_async.engine.ray_engine import init_ray

    init_ray(EngineConfig(backend="ray"))
    rows, pushes, sync_rows = [], [], []
    # QUICK: the tiny preset on 2 workers only, its vLLM push and weight sync measured on the same
    # engines (the full run's 1-worker and real-model passes run the same code on other sizes)
    runs = [(tiny, hf_directory(tiny, tok_dir, Path(args.runs)), w, tiny_workload)
            for w in ((2,) if args.quick else (1, 2))]
    if not args.no_real_model and not args.quick:
        if not (Path(REAL_MODEL) / "config.json").is_file():
            raise SystemExit(f"{REAL_MODEL} is missing: python -m periodic_async prepare-model smollm2-135m")
        runs.append(("smollm2-135m-instruct", str(Path(REAL_MODEL).resolve()), 1, real_workload))
    pushed = set()
    for label, path, workers, workload in runs:
        model_cfg = ModelConfig(name_or_path=path, device="cpu")
        r, push, sync = compare(model_cfg, label, workers, workload, repeats,
                                max_num_seqs=32 if workload is tiny_workload else 16, kv_gib=1.0,
                                measure_push=label not in pushed,  # each model's push: on its first pass
                                measure_sync=args.quick)
        pushed.add(label)
        rows += r
        if push:
            pushes.append({"model": label, "workers": workers, **push})
            print(f"vllm push {pushes[-1]}", flush=True)
        if sync:
            sync_rows.append(sync)
    write_csv(out_dir / "engine.csv", rows)
    write_csv(out_dir / "vllm_push.csv", pushes)
    if not args.quick:
        sync_rows = weight_sync(["qwen2-1m", "qwen2-5m", "qwen3-25m"], tok_dir, workers=2)
    write_csv(out_dir / "weight_sync.csv", sync_rows)
    import ray

    ray.shutdown()
    print(f"wrote {out_dir / 'engine.csv'}, {out_dir / 'vllm_push.csv'} and {out_dir / 'weight_sync.csv'}")


if __name__ == "__main__":
    main()
