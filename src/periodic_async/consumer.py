"""The consumer (the paper's method point 3): the trainer side of one iteration.

It takes groups in the order they come (completion order in periodic-async mode), packs
them into micro-batches (shared-prompt layout when on, token budget), runs the tri-model
micro-step (policy/old/ref log-probs, GRPO loss sum, backward) and accumulates gradients.
Once all B groups of the iteration are in, it normalises the gradients exactly once,
clips, and takes the optimizer step; the caller then pushes version t+1 (the barrier).

On-policy guarantee: every group must carry the version the mode says sampled it (t in the
on-policy modes, t-1 in the off-policy baseline); a group of any other version raises
`StaleGroupError`, never silently trains. Exactly B groups per iteration; with dynamic sampling
(producer.py) at most B, all informative: fewer when its draws reached their cap (one step on
those, normalised over their tokens), none (no step; the lr schedule advances) when no group was.
With `optimizer_steps_per_iteration = k > 1` the iteration is cut into k mini-batches of
B/k groups *in arrival order*, each followed by a step: a documented departure that breaks
the sync/async equivalence (the mini-batches then depend on completion order). With token-mean
over the iteration (`algorithm.token_mean_scope=iteration`, TRL's dapo) every step is divided by
the iteration's tokens / k: the first step's groups are trained as they arrive, but the step
waits for the iteration's last group, and the later steps' groups wait for it.

Trainer ranks (`distributed.Ranks`, under torchrun): each rank trains the groups it claims, and
once its stream ends the ranks reduce gradient sums and counts together and take the one
optimizer step of the iteration (see distributed.py); a single process is `Ranks()`.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Iterable

import torch

from periodic_async import grpo, interrupt
from periodic_async.batching import MicroBatcher
from periodic_async.batching import split_groups
from periodic_async.config import RunConfig
from periodic_async.parallel.affinity import Pinned, available_cores
from periodic_async.parallel.distributed import Ranks
from periodic_async.group import Group
from periodic_async.lora import adapter_state, is_lora, merge_lora
from periodic_async.model import resolve_device, resolve_dtype
from periodic_async.trace import Tracer
from periodic_async.trimodel import TriModel


class StaleGroupError(RuntimeError):
    """A group sampled by another policy version reached the trainer."""


class _Threads:
    """The trainer's torch threads: `base`, raised to `after_generation` once `idle` is set and
    back to `base` at `reset()` (the barrier). When the process is pinned (`pinned`), the
    trainer's threads run on its cores and the engines' while raised (`Pinned.widen`), on its
    own again after `reset()` (`Pinned.narrow`)."""

    def __init__(self, base: int, after_generation: int, idle: threading.Event | None,
                 pinned: Pinned | None = None) -> None:
        self.base, self.after, self.idle, self.pinned = base, after_generation, idle, pinned
        self.raised_at: float | None = None

    def update(self) -> None:
        if self.raised_at is None and self.after > self.base and self.idle is not None and self.idle.is_set():
            if self.pinned is not None:
                self.pinned.widen()
            torch.set_num_threads(self.after)
            self.raised_at = time.time()

    def reset(self) -> None:
        if self.raised_at is not None:
            torch.set_num_threads(self.base)
            if self.pinned is not None:
                self.pinned.narrow()


def threads_after_generation(cfg: RunConfig, distributed: bool = False, held: list[int] | None = None) -> int:
    """`trainer.threads_after_generation` resolved (see TrainerConfig): the trainer's torch
    threads from the end of an iteration's generation to its barrier. 'auto' is capped at the
    cores the run holds: `held` (the pinned trainer's and producer's, `Pinned.held`), else the
    cores this thread may use (never the trainer's alone once pinned: that would cap it at
    `trainer.threads`)."""
    t, e = cfg.trainer, cfg.engine
    if t.threads_after_generation != "auto":
        return t.threads_after_generation or t.threads
    frees_cores = e.backend != "local" and cfg.pipeline.mode != "sync-colocated"
    if distributed or not frees_cores or resolve_device(cfg.model.device).type != "cpu":
        return t.threads
    cores = len(held) if held else len(available_cores())
    return max(t.threads, min(cores, t.threads + e.num_workers * e.threads_per_worker))


class Consumer:
    """Owns the policy, its tri-model and optimizer. `train_iteration` is one iteration."""

    def __init__(self, policy: torch.nn.Module, cfg: RunConfig, tracer: Tracer | None = None,
                 ranks: Ranks | None = None, pinned: Pinned | None = None) -> None:
        self.policy, self.cfg, self.pinned = policy, cfg, pinned
        self.ranks = ranks or Ranks()
        # what it reads of the run's config from here on: algorithm and engine.max_tokens; of `cfg`
        # only the push's form (model.lora.push) and the thread counts (`threads_after_generation`)
        self.algorithm = a = cfg.algorithm
        # algorithm.loss_norm='constant' divides by B * G * max_tokens: a response's budget (episodes: env's)
        self.max_tokens = cfg.env.budget(cfg.engine) if cfg.env.enabled else cfg.engine.max_tokens
        if self.ranks.distributed and a.optimizer_steps_per_iteration != 1:
            raise ValueError(f"algorithm.optimizer_steps_per_iteration={a.optimizer_steps_per_iteration}: trainer "
                             "ranks take one optimizer step per iteration")
        if self.ranks.distributed and a.dynamic_sampling:
            raise ValueError("algorithm.dynamic_sampling: trainer ranks split exactly B groups per iteration; "
                             "run it in a single trainer process")
        if a.prompts_per_iteration % a.optimizer_steps_per_iteration:
            raise ValueError(f"algorithm.optimizer_steps_per_iteration={a.optimizer_steps_per_iteration} must divide "
                             f"algorithm.prompts_per_iteration={a.prompts_per_iteration}")
        # Mixed precision: a bf16/fp16 model trains on float32 master weights (converted here, in
        # place: the caller's `policy` object) with its forwards under autocast; the engines
        # keep the half dtype (`engine_state_dict`). A pure-bf16 AdamW would drop most updates.
        # With LoRA only the adapters train: they are float32 already (peft's autocast_adapter_dtype)
        # and the frozen base stays in the model dtype (half the memory of float32 copies).
        self.model_dtype = resolve_dtype(cfg.model.dtype)
        self.lora = is_lora(policy)
        half = self.model_dtype in (torch.bfloat16, torch.float16)
        if half and not self.lora:
            policy.float()
        # Score the tempered distribution the engines sample from (engine/batcher.py:sample_next).
        self.tri = TriModel(policy, a, logprob_kwargs={"backend": a.attention_backend,
                                                       "temperature": cfg.engine.temperature,
                                                       "logits_chunk_tokens": cfg.trainer.logits_chunk_tokens},
                            old_from_behaviour=cfg.pipeline.mode == "async-offpolicy",
                            autocast_dtype=self.model_dtype if half else None, layout=self.ranks.layout,
                            gradient_checkpointing=cfg.trainer.gradient_checkpointing)
        self.optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=a.lr,
                                           weight_decay=a.weight_decay, betas=tuple(a.adam_betas), eps=a.adam_eps)
        self.scheduler = lr_scheduler(self.optimizer, a, cfg.trainer.iterations * a.optimizer_steps_per_iteration)
        self.tracer = tracer or Tracer(enabled=False)
        self.device = next(policy.parameters()).device
        self.dtype = next(p for p in policy.parameters() if p.requires_grad).dtype  # the masters' (the adapters')
        self.version = 0
        """The policy's version: iterations whose optimizer steps are all taken. It changes with the
        step (signals deferred), so it always labels the weights; `checkpoint.load` restores it."""
        self._micro_losses: list[tuple[str, torch.Tensor]] = []

    def train_iteration(self, groups: Iterable[Group], iteration: int, version: int,
                        engines_idle: threading.Event | None = None) -> dict[str, float]:
        """Train on the B groups of `iteration`, all sampled by `version` (= iteration on-policy);
        returns the iteration's metrics. Once `engines_idle` is set (the producer's
        `generation_done`) the trainer takes `trainer.threads_after_generation` torch threads
        for the rest of the iteration: on one machine the engines' cores are free until the
        barrier. (On GPUs the engines' devices cannot join a running trainer this way.)"""
        a = self.algorithm
        held = self.pinned.held if self.pinned is not None else None  # the cores planned, not the pinned thread's
        threads = _Threads(self.cfg.trainer.threads, threads_after_generation(self.cfg, self.ranks.distributed, held),
                           engines_idle, self.pinned)
        per_step = a.prompts_per_iteration // a.optimizer_steps_per_iteration
        batcher = MicroBatcher.from_config(a)
        acc = grpo.LossAccumulator.from_config(a, max_tokens=self.max_tokens)
        busy_s, cpu_s, n_groups, steps, step_metrics = 0.0, 0.0, 0, 0, []
        self._micro_losses = []
        first_group_at = None
        local_steps = not self.ranks.distributed  # ranks: one step, once every rank's stream has ended
        # token-mean over the iteration with k > 1 steps (TRL's dapo): each step is divided by the
        # iteration's tokens / k, known once its last group is in. The first step's groups are trained
        # as they come; the later steps' wait in `waiting` (they need the policy after the first step).
        defer = local_steps and acc.scope == "iteration"
        waiting: list[Group] = []
        iteration_tokens = 0
        for group in groups:
            if group.version != version:
                raise StaleGroupError(f"group of prompt {group.prompt_index} (iteration {group.iteration}) was "
                                      f"sampled by version {group.version}; iteration {iteration} takes version "
                                      f"{version} only")
            first_group_at = first_group_at or time.time()
            n_groups += 1
            if n_groups > a.prompts_per_iteration:
                raise RuntimeError(f"iteration {iteration}: more than {a.prompts_per_iteration} groups")
            iteration_tokens += group.num_loss_tokens
            t0, c0 = time.time(), time.thread_time()
            threads.update()
            if defer and n_groups > per_step:
                waiting.append(group)
            else:
                for mb in batcher.add(group):
                    self._micro_step(mb, acc, iteration)
            if local_steps and n_groups % per_step == 0:
                threads.update()
                for mb in batcher.flush():
                    self._micro_step(mb, acc, iteration)
                if not defer:
                    step_metrics.append(self._optimizer_step(acc, iteration, steps,
                                                             n_groups == a.prompts_per_iteration))
                    steps += 1
                    acc = grpo.LossAccumulator.from_config(a, max_tokens=self.max_tokens)
                elif n_groups == a.prompts_per_iteration:
                    step_metrics += self._steps_over_the_iteration(acc, waiting, per_step, iteration_tokens, iteration)
                    steps = len(step_metrics)
            busy_s += time.time() - t0
            cpu_s += time.thread_time() - c0
        if local_steps and a.dynamic_sampling and 0 < n_groups < a.prompts_per_iteration:
            # dynamic sampling at its cap: one step on the informative groups there are, normalised
            # over them alone (`acc` counted their tokens and sequences as they came)
            t0, c0 = time.time(), time.thread_time()
            for mb in batcher.flush():
                self._micro_step(mb, acc, iteration)
            step_metrics.append(self._optimizer_step(acc, iteration, steps, True))
            steps += 1
            busy_s += time.time() - t0
            cpu_s += time.thread_time() - c0
        if not local_steps:
            t0, c0 = time.time(), time.thread_time()
            for mb in batcher.flush():
                self._micro_step(mb, acc, iteration)
            while self.ranks.lockstep and self.ranks.agree(False):  # another rank still has a micro-batch
                self._zero_micro_step(iteration)
            n_groups = self.ranks.reduce_iteration(self.policy.parameters(), acc, n_groups)
            if n_groups == a.prompts_per_iteration:
                step_metrics.append(self._optimizer_step(acc, iteration, steps, True))
                steps += 1
            busy_s += time.time() - t0
            cpu_s += time.thread_time() - c0
        threads.reset()
        if n_groups != a.prompts_per_iteration and not a.dynamic_sampling:
            raise RuntimeError(f"iteration {iteration}: got {n_groups} groups, expected {a.prompts_per_iteration}")
        if not steps:  # dynamic sampling found no informative group: the weights stay, the schedule advances
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before")
                self.scheduler.step()
            self.version = iteration + 1
            step_metrics = [{}]
        self.tri.refresh_old()
        m = {k: (min if k.endswith("_min") else max if k.endswith("_max") else _mean)(s[k] for s in step_metrics)
             for k in step_metrics[0]}
        m.update(optimizer_steps=steps, train_busy_s=busy_s, thread_cpu_s=cpu_s, first_group_at=first_group_at,
                 threads_raised_at=threads.raised_at)
        return m

    def _steps_over_the_iteration(self, acc: grpo.LossAccumulator, waiting: list[Group], per_step: int,
                                  tokens: int, iteration: int) -> list[dict[str, float]]:
        """token_mean_scope='iteration', once the iteration's last group is in: the first step (its
        micro-batches are done: `acc`), then each later step on its `waiting` groups (arrival
        order), every one divided by the iteration's `tokens` / k. Returns the steps' metrics."""
        a = self.algorithm
        blocks = [[]] + [waiting[i:i + per_step] for i in range(0, len(waiting), per_step)]
        batcher = MicroBatcher.from_config(a)
        metrics = []
        for step, block in enumerate(blocks):
            if step:
                acc = grpo.LossAccumulator.from_config(a, max_tokens=self.max_tokens)
                for g in block:
                    for mb in batcher.add(g):
                        self._micro_step(mb, acc, iteration)
                for mb in batcher.flush():
                    self._micro_step(mb, acc, iteration)
            acc.iteration_tokens = tokens
            metrics.append(self._optimizer_step(acc, iteration, step, step == len(blocks) - 1))
        return metrics

    def _optimizer_step(self, acc: grpo.LossAccumulator, iteration: int, step: int, last: bool) -> dict[str, float]:
        """Normalise once, clip, step (signals deferred); the last step of the iteration sets the version."""
        with self.tracer.span("optimizer_step", "trainer", iteration=iteration), interrupt.deferred():
            try:
                metrics = self.tri.optimizer_step(self.optimizer, acc)
            except FloatingPointError as e:
                raise FloatingPointError(f"iteration {iteration}, optimizer step {step}"
                                         f"{self._non_finite_micro_batch()}: {e}") from e
            self.scheduler.step()
            self._micro_losses = []
            if last:
                self.version = iteration + 1
        return metrics

    def _zero_micro_step(self, iteration: int) -> None:
        """FSDP lock-step: a forward and backward with zero weight (a 2-token stand-in group), so
        this rank joins the collectives of another rank's micro-step and adds nothing."""
        stand_in = Group(prompt_index=-1, iteration=iteration, version=-1, prompt_ids=[0], response_ids=[[0]],
                         behaviour_logprobs=[[0.0]], rewards=[0.0], advantages=[0.0])
        (mb,) = split_groups([stand_in], shared=self.algorithm.shared_prompt)
        inputs = mb.build(shared=self.algorithm.shared_prompt, dtype=self.dtype, device=self.device)
        with self.tracer.span("micro_step", "trainer", iteration=iteration, samples=0, tokens=0):
            out = self.tri.forward(inputs.packed, with_entropy=False)
            (out.policy_N.sum() * 0.0).backward()

    def _micro_step(self, mb, acc: grpo.LossAccumulator, iteration: int) -> None:
        if self.ranks.lockstep:
            self.ranks.agree(True)
        with self.tracer.span("micro_step", "trainer", iteration=iteration, samples=mb.num_samples,
                              tokens=mb.num_packed_tokens(self.algorithm.shared_prompt)):
            inputs = mb.build(shared=self.algorithm.shared_prompt, dtype=self.dtype, device=self.device)
            sums = self.tri.micro_step(inputs, acc)
            prompts = sorted({s.group.prompt_index for s in mb.slices})
            self._micro_losses.append((f"micro-batch {len(self._micro_losses)} (prompts {prompts})", sums["loss"]))

    def _non_finite_micro_batch(self) -> str:
        """', <the first micro-batch of the step whose loss sum is not finite>' (checked only
        after a failed step: no device sync per micro-step)."""
        bad = [name for name, loss in self._micro_losses if not bool(torch.isfinite(loss))]
        self._micro_losses = []
        return f", {bad[0]}" if bad else ", no micro-batch with a non-finite loss sum"

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights as the engines hold them: in `model.dtype` (half precision
        when training mixed; the float32 masters stay here). With LoRA the adapter alone, in its
        training dtype (`lora.adapter_state`), or with model.lora.push='merged' the whole model with
        the adapter merged (`lora.merge_lora`)."""
        if self.lora and self.cfg.model.lora.push == "merged":
            state = merge_lora(self.policy, self.ranks.full_state_dict(self.policy))  # fsdp: all ranks join
            return {n: t.detach().to(self.model_dtype) for n, t in state.items()}
        if self.lora:
            return adapter_state(self.policy, gathered=self.ranks.lockstep)  # fsdp: a gather every rank joins
        state = self.ranks.full_state_dict(self.policy)  # fsdp: a gather every rank joins
        return {n: t.detach().to(self.model_dtype) for n, t in state.items()}

    def state_dict(self) -> dict:
        """Optimizer, lr-scheduler (and fp16 loss-scaler) state: what a resume needs besides the weights."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.tri.scaler is not None:
            state["grad_scaler"] = self.tri.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict, optimizer: bool = True) -> None:
        """Restore `state_dict()`'s state. optimizer=False: the optimizer's is restored elsewhere
        (trainer ranks: `distributed.Ranks.load_checkpoint_state`), the rest here."""
        missing = [k for k in ("optimizer", "scheduler")[0 if optimizer else 1:] if k not in state]
        if missing:
            raise KeyError(f"trainer state has no {missing} (a checkpoint from before lr schedules existed "
                           "cannot resume its schedule; start a fresh run)")
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The position comes from the checkpoint, the schedule from this run's config: set the
        # lr it gives there (same config: the saved lr; more trainer.iterations: the stretched schedule).
        step = self.scheduler.last_epoch
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * factor(step)
        if self.tri.scaler is not None and "grad_scaler" in state:
            self.tri.scaler.load_state_dict(state["grad_scaler"])


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""`algorithm.lr_scheduler` -> the name `transformers.get_scheduler` knows."""


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    """The learning-rate schedule of `cfg` (an `AlgorithmConfig`), counted in optimizer steps:
    linear warm-up from 0 over `cfg.warmup_steps`, then constant, or linear / cosine decay to 0
    at `total_steps` (trainer.iterations x optimizer_steps_per_iteration). Call `.step()` after
    each optimizer step. As in HF Trainer, step 0 runs at lr 0 when warmup_steps > 0."""
    from transformers import get_scheduler

    if cfg.lr_scheduler != "constant" and 0 < total_steps <= cfg.warmup_steps:
        raise ValueError(f"algorithm.warmup_steps={cfg.warmup_steps} leaves no decay: the run has only "
                         f"{total_steps} optimizer steps (trainer.iterations x optimizer_steps_per_iteration) "
                         f"for algorithm.lr_scheduler={cfg.lr_scheduler!r}")
    return get_scheduler(SCHEDULES[cfg.lr_scheduler], optimizer, num_warmup_steps=cfg.warmup_steps,
                         num_training_steps=max(total_steps, 1))
