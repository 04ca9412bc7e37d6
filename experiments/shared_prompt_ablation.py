"""Shared-prompt attention ablation (the paper's shared-prompt attention): forward+backward speed of one group packed
as [prompt | r_1 | ... | r_G] against the same group as G per-response rows.

The paper claims ~8x on long prompts; the ceiling is the token ratio
    token_bound = (G*P + sum R) / (P + sum R)
and `efficiency = speedup / token_bound` says how much of it an attention back-end keeps.

Per grid point (P, G, mean R; response lengths uniform in [R/2, 3R/2]) one group is timed,
variants interleaved round by round (rotating order, so machine noise hits them alike). On CPU
the clock is the process's CPU time: other jobs on a shared 2-core CPU can inflate wall times
several-fold, while CPU time stays within a few percent (1 thread: same as a quiet wall clock).
    per-response, varlen:  pack(shared=False) through the split back-end (one causal call per row)
    per-response, padded:  G right-padded rows, plain causal SDPA (what most RL trainers run)
    shared, <backend>:     pack(shared=True) through dense / split (/ flex on CUDA)
speedup = median over rounds of (faster per-response variant / shared); the baseline is the
*fastest* per-response implementation, never a TxT mask over G copies.
peak_mem_ratio = baseline memory / shared memory (> 1: shared needs less): on CUDA the peak
allocated bytes, on CPU the activation bytes saved for backward (parameters excluded).

    bash experiments/shared_prompt_ablation.sh          # full grid, qwen2-1m fp32, 1 CPU thread
    QUICK=1 bash experiments/shared_prompt_ablation.sh  # tiny grid; wall times of both: results/run_all_times*.csv
Writes $RESULTS_DIR/shared_prompt.csv (P,G,R,backend,speedup,token_bound,efficiency,peak_mem_ratio)
and figures/shared_prompt.png (`bench.plots.plot_shared_prompt`, also called by notebooks/shared_prompt.ipynb).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.plots import plot_shared_prompt
from periodic_async.records import read_csv, write_csv

COLUMNS = ["P", "G", "R", "backend", "speedup", "token_bound", "efficiency", "peak_mem_ratio", "model", "repeats",
           "git_commit", "cpu"]


def make_group(vocab: int, P: int, G: int, R: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, R // 2), R + R // 2 + 1, (G,), generator=g).tolist()
    prompt = torch.randint(4, vocab, (P,), generator=g).tolist()
    return prompt, [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def padded_logprobs(model, prompt, responses, device):
    """The usual per-response baseline: G right-padded rows [prompt + r_i], causal attention, no mask
    (right padding is invisible to earlier tokens under causal attention)."""
    L = len(prompt) + max(len(r) for r in responses) - 1
    ids = torch.zeros(len(responses), L, dtype=torch.long)
    rows, cols, labels = [], [], []
    for i, r in enumerate(responses):
        seq = prompt + r[:-1]
        ids[i, :len(seq)] = torch.tensor(seq)
        rows += [i] * len(r)
        cols += list(range(len(prompt) - 1, len(prompt) - 1 + len(r)))
        labels += r
    hidden = model.base_model(input_ids=ids.to(device), use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(hidden[torch.tensor(rows), torch.tensor(cols)])
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(labels, device=device)[:, None])[:, 0]


def activation_bytes(model, fn) -> int:
    """Bytes of the tensors autograd saves for backward (CPU proxy of training peak memory)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack_hook(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        loss = fn().sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def peak_memory(model, fn, device) -> int:
    if device.type != "cuda":
        return activation_bytes(model, fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn().sum().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def fwd_bwd_seconds(model, fn, device) -> float:
    """Seconds of one forward+backward: wall clock on CUDA; on CPU the process's CPU time, which
    other jobs on a shared machine do not inflate (with 1 thread it is the wall time of a quiet run)."""
    model.zero_grad(set_to_none=True)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    fn().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - t0


def measure_point(model, P, G, R, backends, repeats, device, seed=0):
    from periodic_async.shared_prompt import pack, token_logprobs

    vocab = model.config.vocab_size
    prompt, responses = make_group(vocab, P, G, R, seed)
    shared = pack([(prompt, responses)], shared=True).to(device)
    flat = pack([(prompt, responses)], shared=False).to(device)
    variants = {"per-response varlen": lambda: token_logprobs(model, flat, backend="split"),
                "per-response padded": lambda: padded_logprobs(model, prompt, responses, device)}
    for b in backends:
        variants[b] = (lambda b=b: token_logprobs(model, shared, backend=b))
    names = list(variants)
    for n in names:  # warm-up (allocator, flex compilation)
        fwd_bwd_seconds(model, variants[n], device)
    times = {n: [] for n in names}
    for rnd in range(repeats):
        for n in names[rnd % len(names):] + names[:rnd % len(names)]:
            times[n].append(fwd_bwd_seconds(model, variants[n], device))
    base_name = min(["per-response varlen", "per-response padded"], key=lambda n: statistics.median(times[n]))
    base_mem = peak_memory(model, variants[base_name], device)
    sum_r = sum(len(r) for r in responses)
    token_bound = (G * P + sum_r) / (P + sum_r)
    rows = []
    for b in backends:
        speedup = statistics.median(t0 / t1 for t0, t1 in zip(times[base_name], times[b]))
        rows.append(dict(P=P, G=G, R=R, backend=b, speedup=round(speedup, 3), token_bound=round(token_bound, 3),
                         efficiency=round(speedup / token_bound, 3),
                         peak_mem_ratio=round(base_mem / peak_memory(model, variants[b], device), 3)))
    ms = {n: round(1e3 * statistics.median(t), 1) for n, t in times.items()}
    print(f"P={P} G={G} R={R} tokens shared={shared.num_tokens} per-response={flat.num_tokens} "
          f"median ms {ms} baseline={base_name!r}", flush=True)
    return rows


def main(argv=None) -> None:
    from periodic_async.config import ModelConfig
    from periodic_async.model import build_model, resolve_device
    from periodic_async.trace import log_experiment
    from periodic_async.data.tokenizer import ensure_tokenizer

    ap = experiment_parser(__doc__, repeats=(5, 3), figures=True)  # --quick: a tiny grid (< 1 min)
    ap.add_argument("--preset", default="qwen2-1m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads; 1 by default: the ratios are stable on a shared machine")
    ap.add_argument("--tokenizer", default="artifacts/tokenizer")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    backends = ["dense", "split"] + (["flex"] if device.type == "cuda" else [])
    grid = [(P, G, R) for P in (512, 1024) for G in (8, 16) for R in (32, 64, 128)]
    repeats = args.repeats
    if args.quick:
        grid = [(128, 4, 16), (256, 8, 32)]
    tok = ensure_tokenizer(args.tokenizer)
    model = build_model(ModelConfig(name_or_path=args.preset, tokenizer=args.tokenizer, dtype="float32",
                                    device=str(device)), tok)
    print(f"{args.preset} fp32 on {device}, {args.threads} thread(s), {repeats} rounds, back-ends {backends}")
    rows = []
    for P, G, R in grid:
        rows += [{**r, "model": args.preset, "repeats": repeats}
                 for r in measure_point(model, P, G, R, backends, repeats, device)]
    out = write_csv(Path(args.results) / "shared_prompt.csv", rows, COLUMNS)
    png = plot_shared_prompt(out, Path(args.figures) / "shared_prompt.png")
    log_experiment("shared_prompt_ablation", [out], [png])  # W&B (offline unless WANDB_MODE=online)
    print(f"wrote {out} and {png}")
    for r in read_csv(out):  # the rows as written, stamped
        print(",".join(r[c] for c in COLUMNS))


if __name__ == "__main__":
    main()
