"""The static-batching peer baseline of experiments/engine_throughput.py: transformers' own
`model.generate`, what a user gets without a serving engine (and how TRL's `trl-grpo` generates,
bench/trl.py), beside our continuous-batching engine and vLLM.

    hf = HFWorkers(model_cfg, workers=2, max_num_seqs=32)   # processes started, models loaded
    tokens_per_s = hf.throughput(requests)                  # generated tokens / wall seconds
    hf.close()

What it measures: generated tokens per second of static batches, each of max_num_seqs sequences
(max_num_seqs // G prompts x their G samples, `static_batches`) run by one `model.generate` call to
the batch's longest request, so a batch's short requests wait for its longest one (the cost that
continuous batching removes). Time is the span from the moment every worker starts (a barrier)
to the last one's end; each worker's model is loaded and warmed up before it.

Why it is a fair peer: the engines it is compared with get the same requests (prompt tokens, G,
per-request max_tokens), the same sampling (temperature 1, no top-p / top-k), eos ignored by all
(`sampling_config`), so every system generates exactly the same number of tokens; the same number
of workers, each a process of its own on 1 thread, each given the requests our dispatcher gives
its worker (`engine.assign_workers`). Only the batching differs.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import queue
import time

import torch

from periodic_async.engine import Request, assign_workers


def sampling_config(model):
    """The model's generation config set to sample as the engines do (temperature 1, top-p 1,
    top-k off) with eos ignored: every batch runs to its max_new_tokens."""
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.eos_token_id = None
    gen_cfg.do_sample, gen_cfg.temperature, gen_cfg.top_p, gen_cfg.top_k = True, 1.0, 1.0, 0
    return gen_cfg


def static_batches(requests: list[Request], max_num_seqs: int) -> list[list[Request]]:
    """`requests` in order, max_num_seqs // G (at least 1) to a batch."""
    per_batch = max(1, max_num_seqs // requests[0].n)
    return [requests[i:i + per_batch] for i in range(0, len(requests), per_batch)]


def generate(model, tokenizer, gen_cfg, batches: list[list[Request]], cap: int | None = None) -> list[torch.Tensor]:
    """One `model.generate` per batch: prompts left-padded, G samples each, as many new tokens as
    the batch's longest request (at most `cap`). Returns each batch's new token ids, [G x prompts, new tokens]."""
    out = []
    for b in batches:
        enc = tokenizer.pad({"input_ids": [r.prompt_ids for r in b]}, return_tensors="pt", padding_side="left")
        cfg = copy.deepcopy(gen_cfg)
        cfg.num_return_sequences = b[0].n
        cfg.max_new_tokens = min(cap or 10**9, max(r.params.max_tokens for r in b))
        with torch.inference_mode():
            out.append(model.generate(**enc, generation_config=cfg)[:, enc["input_ids"].shape[1]:])
    return out


def hf_worker(model_cfg, max_num_seqs, inbox, barrier, results):
    """One baseline process: loads the model once, then for each request list it is sent runs
    static batches through `model.generate` on 1 thread and reports the span it took."""
    torch.set_num_threads(1)
    from periodic_async.model import load_policy

    model, tok = load_policy(model_cfg)
    gen_cfg = sampling_config(model)
    results.put("ready")
    while (requests := inbox.get()) is not None:
        batches = static_batches(requests, max_num_seqs)
        generate(model, tok, gen_cfg, batches[:1], cap=4)  # warm-up
        barrier.wait()
        start = time.time()
        generate(model, tok, gen_cfg, batches)
        results.put((start, time.time()))


class HFWorkers:
    """The static-batching baseline: `workers` processes (1 thread each) that load the model once
    and generate each request list they are given, the requests split as our dispatcher splits them."""

    def __init__(self, model_cfg, workers: int, max_num_seqs: int):
        ctx = mp.get_context("spawn")
        self.workers, self.inboxes, self.results = workers, [ctx.Queue() for _ in range(workers)], ctx.Queue()
        barrier = ctx.Barrier(workers)
        self.procs = [ctx.Process(target=hf_worker, args=(model_cfg, max_num_seqs, q, barrier, self.results),
                                  daemon=True) for q in self.inboxes]
        for p in self.procs:
            p.start()
        self._collect()  # every worker has loaded the model

    def _collect(self) -> list:
        got = []
        while len(got) < self.workers:
            try:
                got.append(self.results.get(timeout=5))
            except queue.Empty:
                if dead := [i for i, p in enumerate(self.procs) if not p.is_alive()]:
                    raise RuntimeError(f"hf baseline worker(s) {dead} died (exit codes "
                                       f"{[self.procs[i].exitcode for i in dead]})") from None
        return got

    def throughput(self, requests: list[Request]) -> float:
        """Generated tokens per second of `requests` (every sample max_tokens long) over all workers."""
        parts = [[] for _ in range(self.workers)]
        for w, r in zip(assign_workers(requests, self.workers), requests):
            parts[w].append(r)
        for q, part in zip(self.inboxes, parts):
            q.put(part)
        spans = self._collect()
        tokens = sum(r.n * r.params.max_tokens for r in requests)
        return tokens / (max(e for _, e in spans) - min(s for s, _ in spans))

    def close(self) -> None:
        for q, p in zip(self.inboxes, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
