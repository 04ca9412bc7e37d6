"""The check's `attention` step: forward+backward time of one group packed shared against per
response, per attention back-end, at the paper's shapes, beside the token bound; attention.csv."""

from __future__ import annotations

import statistics

import torch

from periodic_async import shared_prompt as sp
from periodic_async.bench.gpu.common import (Budget, Sizes, Table, backends_for, failure, peak_gib, random_group,
                                             repeats_for, reset_peak, timed)
from periodic_async.bench.gpu.models import arch_model, tokenizer_at
from periodic_async.shared_prompt import pack, token_logprobs


def group_batches(prompt: list[int], responses: list[list[int]], shared: bool, budget_tokens: int, device):
    """The packed micro-batches of one group: one row when shared; per-response rows in
    micro-batches of at most `budget_tokens` packed tokens (the trainer's token budget)."""
    if shared:
        return [pack([(prompt, responses)], shared=True).to(device)]
    row = len(prompt) + len(responses[0]) - 1
    k = max(1, budget_tokens // row)
    return [pack([(prompt, responses[i:i + k])], shared=False).to(device) for i in range(0, len(responses), k)]


def step(args, sizes: Sizes, device: torch.device, budget: Budget, table: Table) -> None:
    tokenizer = tokenizer_at(args.work)
    arch, G = sizes.attention_arch, sizes.group
    model = arch_model(arch, tokenizer, device, torch.float32, sizes.toy)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    shapes = [(P, R) for P in sizes.attention_prompts for R in sizes.attention_responses]
    flex_broken = None

    def fwd_bwd(batches, backend):
        for b in batches:
            with autocast:
                logp = token_logprobs(model, b, backend=backend)
            logp.sum().backward()
        model.zero_grad(set_to_none=True)

    for backend in backends_for(device, table):
        per_time = {}
        for P, R in shapes:
            prompt, responses = random_group(model.config.vocab_size, P, [R] * G, seed=P + R)
            bound = (G * P + G * R) / (P + G * R)
            for packing in ("per_response", "shared"):
                base = dict(model=arch, backend=backend, packing=packing, P=P, G=G, R=R, token_bound=round(bound, 3),
                            grad_checkpointing=True, autocast="bfloat16")
                if flex_broken and backend == "flex":
                    table.add(**base, status=f"skipped: {flex_broken}")
                    continue
                if budget.left() < (20 if sizes.toy else 25):
                    table.add(**base, status="skipped: time budget")
                    continue
                try:
                    batches = group_batches(prompt, responses, packing == "shared", sizes.micro_batch_tokens, device)
                    reset_peak(device)
                    sp._flex_failed = False
                    warm = timed(lambda: fwd_bwd(batches, backend), device, 1)[0]
                    if backend == "flex" and sp._flex_failed:
                        flex_broken = "FlexAttention fell back to split (see the log)"
                        table.add(**base, status="FAILED: " + flex_broken)
                        continue
                    n = repeats_for(warm, sizes.toy)
                    if budget.left() < n * warm + 5:
                        n = 1
                    times = timed(lambda: fwd_bwd(batches, backend), device, n)
                    med = statistics.median(times)
                    tokens = sum(b.num_tokens for b in batches)
                    row = dict(**base, packed_tokens=tokens, micro_batches=len(batches),
                               labels=sum(len(b.labels_N) for b in batches), time_s=round(med, 4),
                               time_min_s=round(min(times), 4), time_max_s=round(max(times), 4), repeats=n,
                               warmup_s=round(warm, 3), tokens_per_s=round(tokens / med, 1),
                               peak_memory_gib=peak_gib(device))
                    if packing == "per_response":
                        per_time[P, R] = med
                    elif (P, R) in per_time:
                        row["speedup_vs_per_response"] = round(per_time[P, R] / med, 3)
                    table.add(**row, status="ok")
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: the next shape still runs
                    table.add(**base, status=failure(e))
                    model.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()


