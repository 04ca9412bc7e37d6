"""The consumer (PAPER.md point 3): the trainer side of one iteration.

It takes groups in the order they come (completion order in periodic-async mode), packs
them into micro-batches (shared-prompt layout when on, token budget), runs the tri-model
micro-step (policy/old/ref log-probs, GRPO loss sum, backward) and accumulates gradients.
Once all B groups of the iteration are in, it normalises the gradients exactly once,
clips, and takes the optimizer step; the caller then pushes version t+1 (the barrier).

On-policy guarantee: every group must carry the current version t; a group of any other
version raises `StaleGroupError`, never silently trains. Exactly B groups per iteration.
With `optimizer_steps_per_iteration = k > 1` the iteration is cut into k mini-batches of
B/k groups *in arrival order*, each followed by a step: a documented departure that breaks
the sync/async equivalence (the mini-batches then depend on completion order).
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from periodic_async import grpo
from periodic_async.batching import MicroBatcher
from periodic_async.config import RunConfig
from periodic_async.group import Group
from periodic_async.trace import Tracer
from periodic_async.trimodel import TriModel


class StaleGroupError(RuntimeError):
    """A group sampled by another policy version reached the trainer."""


class Consumer:
    """Owns the policy, its tri-model and optimizer. `train_iteration` is one iteration."""

    def __init__(self, policy: torch.nn.Module, cfg: RunConfig, tracer: Tracer | None = None) -> None:
        self.policy, self.cfg = policy, cfg
        a = cfg.algorithm
        if a.prompts_per_iteration % a.optimizer_steps_per_iteration:
            raise ValueError(f"algorithm.optimizer_steps_per_iteration={a.optimizer_steps_per_iteration} must divide "
                             f"algorithm.prompts_per_iteration={a.prompts_per_iteration}")
        self.tri = TriModel(policy, a, logprob_kwargs={"backend": a.attention_backend})
        self.optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=a.lr,
                                           weight_decay=a.weight_decay, betas=(0.9, 0.999))
        self.tracer = tracer or Tracer(enabled=False)
        self.device = next(policy.parameters()).device
        self.dtype = next(policy.parameters()).dtype

    def train_iteration(self, groups: Iterable[Group], iteration: int, version: int) -> dict[str, float]:
        """Train on the B groups of `iteration` (all of `version`); returns the iteration's metrics."""
        a = self.cfg.algorithm
        per_step = a.prompts_per_iteration // a.optimizer_steps_per_iteration
        batcher = MicroBatcher.from_config(a)
        acc = grpo.LossAccumulator.from_config(a, max_tokens=self.cfg.engine.max_tokens)
        busy_s, n_groups, steps, step_metrics = 0.0, 0, 0, []
        received: list[Group] = []
        first_group_at = None
        for group in groups:
            if group.version != version:
                raise StaleGroupError(f"group of prompt {group.prompt_index} (iteration {group.iteration}) was "
                                      f"sampled by version {group.version}; the trainer is at version {version}")
            first_group_at = first_group_at or time.time()
            received.append(group)
            n_groups += 1
            if n_groups > a.prompts_per_iteration:
                raise RuntimeError(f"iteration {iteration}: more than {a.prompts_per_iteration} groups")
            t0 = time.time()
            for mb in batcher.add(group):
                self._micro_step(mb, acc, iteration)
            if n_groups % per_step == 0:
                for mb in batcher.flush():
                    self._micro_step(mb, acc, iteration)
                with self.tracer.span("optimizer_step", "trainer", iteration=iteration):
                    step_metrics.append(self.tri.optimizer_step(self.optimizer, acc))
                steps += 1
                acc = grpo.LossAccumulator.from_config(a, max_tokens=self.cfg.engine.max_tokens)
            busy_s += time.time() - t0
        if n_groups != a.prompts_per_iteration:
            raise RuntimeError(f"iteration {iteration}: got {n_groups} groups, expected {a.prompts_per_iteration}")
        self.tri.refresh_old()
        m = {k: sum(s[k] for s in step_metrics) / len(step_metrics) for k in step_metrics[0]}
        m.update(optimizer_steps=steps, train_busy_s=busy_s, first_group_at=first_group_at)
        return m

    def _micro_step(self, mb, acc: grpo.LossAccumulator, iteration: int) -> None:
        with self.tracer.span("micro_step", "trainer", iteration=iteration, samples=mb.num_samples,
                              tokens=mb.num_packed_tokens(self.cfg.algorithm.shared_prompt)):
            inputs = mb.build(shared=self.cfg.algorithm.shared_prompt, dtype=self.dtype, device=self.device)
            self.tri.micro_step(inputs, acc)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
