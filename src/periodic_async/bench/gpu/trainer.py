"""The check's `trainer` step: the tri-model micro-step's packed tokens/s, model FLOPs utilisation
and peak memory per architecture, policy only and policy + reference, and policy + reference with
activation checkpointing and chunked logits (trainer.gradient_checkpointing,
trainer.logits_chunk_tokens: the memory settings of a long-response GPU run); trainer.csv."""

from __future__ import annotations

import statistics

import torch

from periodic_async.batching import split_groups
from periodic_async.bench.gpu.common import (Budget, Sizes, Table, failure, peak_gib, random_group, repeats_for,
                                             reset_peak, timed)
from periodic_async.bench.gpu.models import arch_model, body_parameters, forward_flops, tokenizer_at
from periodic_async.config import AlgorithmConfig
from periodic_async.group import Group
from periodic_async.grpo import LossAccumulator
from periodic_async.model import num_parameters
from periodic_async.trimodel import TriModel


VARIANTS = (("policy", 0.0, (False, 0)), ("policy+ref", 0.04, (False, 0)),
            ("policy+ref, checkpointed", 0.04, (True, 4096)))
"""(models, beta, (gradient_checkpointing, logits_chunk_tokens)) per row; the simulator's costs
(scale/calibrate.py) read the plain policy+ref rows."""


def trainer_inputs(vocab: int, P: int, G: int, R: int, device):
    """One shared-packed group as the trainer gets it (random tokens, advantages +-1)."""
    prompt, responses = random_group(vocab, P, [R] * G, seed=7)
    adv = [1.0 if i % 2 else -1.0 for i in range(G)]
    group = Group(0, 0, 0, prompt, responses, [[-1.0] * R for _ in range(G)], [0.0] * G, adv)
    (mb,) = split_groups([group], max_tokens=0, groups_per_micro_batch=1, shared=True)
    return mb.build(shared=True, device=device)


def step(args, sizes: Sizes, device: torch.device, budget: Budget, table: Table) -> None:
    tokenizer = tokenizer_at(args.work)
    P, G, R = sizes.trainer_group
    peak = args.peak_tflops
    for arch in sizes.archs:
        for models, beta, memory in VARIANTS:
            checkpointing, chunk = memory
            base = dict(model=arch, models=models, P=P, G=G, R=R, attention=args.trainer_backend,
                        autocast="bfloat16", gradient_checkpointing=checkpointing, logits_chunk_tokens=chunk,
                        peak_tflops=peak or "")
            if budget.left() < 15:
                table.add(**base, status="skipped: time budget")
                continue
            tri = policy = optimizer = None
            try:
                reset_peak(device)
                policy = arch_model(arch, tokenizer, device, torch.float32, sizes.toy)
                policy.train()
                cfg = AlgorithmConfig(group_size=G, prompts_per_iteration=1, beta=beta, micro_batch_tokens=0)
                logprob_kwargs = {"backend": args.trainer_backend, "logits_chunk_tokens": chunk}
                tri = TriModel(policy, cfg, logprob_kwargs=logprob_kwargs, autocast_dtype=torch.bfloat16,
                               gradient_checkpointing=checkpointing)
                inputs = trainer_inputs(policy.config.vocab_size, P, G, R, device)
                acc = LossAccumulator.from_config(cfg)
                warm = timed(lambda: tri.micro_step(inputs, acc), device, 1)[0]
                n = max(repeats_for(warm, sizes.toy), 1 if sizes.toy else 3)
                times = timed(lambda: tri.micro_step(inputs, acc), device, n)
                optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
                opt_s = timed(lambda: tri.optimizer_step(optimizer, acc), device, 1)[0]
                med = statistics.median(times)
                tokens, labels = inputs.packed.num_tokens, inputs.num_tokens
                flops = forward_flops(policy, tokens, labels) * (3 + (1 if beta > 0 else 0))
                mfu = flops / med / (peak * 1e12) if peak else None
                table.add(**base, params=num_parameters(policy), body_params=body_parameters(policy),
                          packed_tokens=tokens, labels=labels, time_s=round(med, 4), time_min_s=round(min(times), 4),
                          time_max_s=round(max(times), 4), repeats=n, tokens_per_s=round(tokens / med, 1),
                          model_tflops_per_s=round(flops / med / 1e12, 3), mfu=round(mfu, 4) if mfu else "",
                          optimizer_step_s=round(opt_s, 4), peak_memory_gib=peak_gib(device), status="ok")
            except Exception as e:  # noqa: BLE001
                table.add(**base, status=failure(e))
            del tri, policy, optimizer
            if device.type == "cuda":
                torch.cuda.empty_cache()


