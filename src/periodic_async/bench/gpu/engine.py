"""The check's `engine` step: the built-in continuous-batching engine's decode tokens/s at each slot
count against Hugging Face `generate` (same model, prompts and lengths); engine.csv."""

from __future__ import annotations

import statistics
import time

import torch

from periodic_async.bench.gpu.common import Budget, Sizes, Table, failure, random_group, sync
from periodic_async.bench.gpu.models import arch_model, tokenizer_at
from periodic_async.engine import Request, SamplingParams
from periodic_async.engine.local import LocalEngine
from periodic_async.model import num_parameters


def engine_requests(vocab: int, slots: int, group: int, P: int, R: int):
    params = SamplingParams(max_tokens=R, temperature=1.0, ignore_eos=True)
    return [Request(f"r{i}", random_group(vocab, P, [], seed=100 + i)[0], group, params, seed=i)
            for i in range(max(1, slots // group))]


def step(args, sizes: Sizes, device: torch.device, budget: Budget, table: Table) -> None:
    tokenizer = tokenizer_at(args.work)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch, P, R = sizes.engine_arch, sizes.engine_prompt, sizes.engine_max_tokens
    G = min(sizes.group, min(sizes.engine_slots))
    model = arch_model(arch, tokenizer, device, dtype, sizes.toy)
    model.eval()
    vocab = model.config.vocab_size
    hf_rate = {}

    def batcher_once(slots: int, max_tokens: int):
        reqs = engine_requests(vocab, slots, G, P, max_tokens)
        with LocalEngine(model, tokenizer, max_num_seqs=slots) as engine:
            worker = engine.workers[0]
            steps0 = worker.steps
            sync(device)
            t = time.perf_counter()
            tokens = sum(len(s.token_ids) for out in engine.generate(reqs) for s in out.samples)
            sync(device)
            return time.perf_counter() - t, tokens, worker.steps - steps0, len(reqs)

    @torch.inference_mode()
    def generate_once(slots: int, max_tokens: int):
        reqs = engine_requests(vocab, slots, G, P, max_tokens)
        ids = torch.tensor([r.prompt_ids for r in reqs for _ in range(r.n)], device=device)
        sync(device)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        sync(device)
        return time.perf_counter() - t, int(out.shape[0] * (out.shape[1] - ids.shape[1])), max_tokens, len(reqs)

    for slots in sizes.engine_slots:
        for engine_name, once in (("hf_generate", generate_once), ("batcher", batcher_once)):
            base = dict(engine=engine_name, model=arch, params=num_parameters(model),
                        dtype=str(dtype).removeprefix("torch."), slots=slots, group_size=G, prompt_tokens=P,
                        max_tokens=R)
            if budget.left() < 15:
                table.add(**base, status="skipped: time budget")
                continue
            try:
                once(slots, 4)  # warm-up: kernels, allocator, caches
                runs = [once(slots, R)]
                if not sizes.toy and budget.left() > 3 * runs[0][0] + 15:
                    runs.append(once(slots, R))
                wall = statistics.median(r[0] for r in runs)
                _, tokens, steps, n_req = runs[0]
                rate = tokens / wall
                row = dict(**base, requests=n_req, generated_tokens=tokens, wall_s=round(wall, 3),
                           wall_min_s=round(min(r[0] for r in runs), 3), repeats=len(runs), decode_steps=steps,
                           step_ms=round(1000 * wall / max(steps, 1), 3), tokens_per_s=round(rate, 1))
                if engine_name == "hf_generate":
                    hf_rate[slots] = rate
                elif slots in hf_rate:
                    row["vs_hf_generate"] = round(rate / hf_rate[slots], 3)
                table.add(**row, status="ok")
            except Exception as e:  # noqa: BLE001
                table.add(**base, status=failure(e))
                if device.type == "cuda":
                    torch.cuda.empty_cache()


