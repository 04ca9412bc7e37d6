"""The consumer's optimizer side: mixed precision that trains (fp32 master weights under
autocast), and the learning-rate schedule (values per optimizer step, saved and resumed)."""

import copy
import io
import math
import random

import pytest
import torch

from periodic_async import grpo
from periodic_async.batching import split_groups
from periodic_async.config import ConfigError, RunConfig, load_config
from periodic_async.consumer import Consumer, lr_scheduler
from periodic_async.group import Group
from periodic_async.model import build_model
from periodic_async.trimodel import TriModel


def run_cfg(**overrides) -> RunConfig:
    base = {"model.name_or_path": "qwen2-micro", "model.device": "cpu", "algorithm.group_size": 4,
            "algorithm.prompts_per_iteration": 2, "algorithm.attention_backend": "split", "trainer.iterations": 1}
    base.update(overrides)
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in base.items()])


def make_groups(tokenizer, version: int = 0, seed: int = 0) -> list[Group]:
    """Two groups of G = 4 random responses with distinct rewards (so every advantage is nonzero)."""
    rng = random.Random(seed)
    groups = []
    for b in range(2):
        responses = [[rng.randrange(4, len(tokenizer)) for _ in range(rng.randint(5, 12))] for _ in range(4)]
        rewards = [1.0, 0.0, 0.5, 0.2]
        groups.append(Group(b, version, version, [rng.randrange(4, len(tokenizer)) for _ in range(10)], responses,
                            [[-1.0] * len(r) for r in responses], rewards, grpo.group_advantages(rewards).tolist()))
    return groups


def flat_delta(model: torch.nn.Module, start: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.detach().float() - start[n]).flatten() for n, p in model.named_parameters()])


def test_bf16_weights_move(tokenizer):
    """model.dtype=bfloat16: the consumer trains float32 master weights with bf16 autocast
    forwards, so one AdamW step at lr 1e-5 moves every weight (by ~lr), and that step agrees
    with the float32 run's step from the same start within bf16 tolerance (cosine > 0.99,
    relative L2 < 0.15). Negative control: the same step on pure-bf16 parameters leaves most
    weights where they were (1e-5 is below half a bf16 ulp of a weight of ~0.01)."""
    cfg16, cfg32 = run_cfg(**{"model.dtype": "bfloat16", "algorithm.lr": 1e-5}), run_cfg(**{"algorithm.lr": 1e-5})
    policy16 = build_model(cfg16.model, tokenizer)
    assert next(policy16.parameters()).dtype == torch.bfloat16
    pure = copy.deepcopy(policy16)
    start = {n: p.detach().float().clone() for n, p in policy16.named_parameters()}
    policy32 = build_model(cfg32.model, tokenizer)
    policy32.load_state_dict(start, strict=False)
    groups = make_groups(tokenizer)

    mixed = Consumer(policy16, cfg16)
    assert all(p.dtype == torch.float32 for p in policy16.parameters()), "master weights must be float32"
    m16 = mixed.train_iteration(groups, 0, 0)
    m32 = Consumer(policy32, cfg32).train_iteration(groups, 0, 0)
    assert {t.dtype for t in mixed.engine_state_dict().values()} == {torch.bfloat16}

    tri = TriModel(pure, cfg16.algorithm, logprob_kwargs={"backend": "split"})  # no masters, no autocast
    optimizer = torch.optim.AdamW(pure.parameters(), lr=1e-5, weight_decay=0.0)
    acc = grpo.LossAccumulator.from_config(cfg16.algorithm)
    for mb in split_groups(groups, max_tokens=4096):
        tri.micro_step(mb.build(), acc)
    tri.optimizer_step(optimizer, acc)

    d16, d32, d_pure = flat_delta(policy16, start), flat_delta(policy32, start), flat_delta(pure, start)
    assert (d16 != 0).float().mean() > 0.99
    assert d16.abs().max() <= 1.1e-5  # Adam's first step: at most ~lr per weight
    assert (d_pure != 0).float().mean() < 0.3
    assert torch.nn.functional.cosine_similarity(d16, d32, dim=0) > 0.99
    assert (d16 - d32).norm() / d32.norm() < 0.15
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.02)


def expected_lr(kind: str, step: int, lr: float, warmup: int, total: int) -> float:
    """The schedule by hand: linear warm-up from 0, then constant / linear / half-cosine to 0."""
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (total - warmup)
    return lr * {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[kind]


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_schedule_values_per_optimizer_step(kind):
    """`lr_scheduler` gives warm-up then constant / linear / cosine, step by step, as computed by hand."""
    cfg = load_config(RunConfig, None, [f"algorithm.lr_scheduler={kind}", "algorithm.warmup_steps=3"]).algorithm
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    scheduler = lr_scheduler(optimizer, cfg, total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([expected_lr(kind, s, 1e-3, 3, 10) for s in range(10)], abs=1e-12)


def test_lr_schedule_runs_in_the_consumer_and_resumes(tokenizer):
    """Through `train_iteration` (two optimizer steps per iteration, so the schedule counts steps,
    not iterations) the metric `lr` follows warm-up + cosine; a consumer rebuilt from the
    saved state_dict (through torch.save, as in a checkpoint) continues at the same position."""
    cfg = run_cfg(**{"algorithm.lr": 1e-3, "algorithm.lr_scheduler": "cosine", "algorithm.warmup_steps": 2,
                     "algorithm.optimizer_steps_per_iteration": 2, "trainer.iterations": 4})
    consumer = Consumer(build_model(cfg.model, tokenizer), cfg)
    lrs = [consumer.train_iteration(make_groups(tokenizer, it, it), it, it)["lr"] for it in range(2)]
    buffer = io.BytesIO()
    torch.save(consumer.state_dict(), buffer)
    buffer.seek(0)
    resumed = Consumer(build_model(cfg.model, tokenizer), cfg)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))  # as checkpoint.load
    for it in (2, 3):
        lrs.append(resumed.train_iteration(make_groups(tokenizer, it, it), it, it)["lr"])
    per_step = [expected_lr("cosine", s, 1e-3, 2, 8) for s in range(8)]
    # the iteration's metric is the mean over its two optimizer steps
    assert lrs == pytest.approx([(per_step[2 * i] + per_step[2 * i + 1]) / 2 for i in range(4)], abs=1e-12)
    assert resumed.scheduler.last_epoch == 8
    with pytest.raises(KeyError, match="scheduler"):
        resumed.load_state_dict({"optimizer": resumed.optimizer.state_dict()})


def test_lr_schedule_settings_are_validated(tokenizer):
    """Unknown schedules and negative warm-up are config errors naming the field; a decaying
    schedule whose warm-up covers the whole run is refused."""
    with pytest.raises(ConfigError, match="algorithm.lr_scheduler"):
        run_cfg(**{"algorithm.lr_scheduler": "step"})
    with pytest.raises(ConfigError, match="algorithm.warmup_steps"):
        run_cfg(**{"algorithm.warmup_steps": -1})
    cfg = run_cfg(**{"algorithm.lr_scheduler": "linear", "algorithm.warmup_steps": 5, "trainer.iterations": 5})
    with pytest.raises(ValueError, match="warmup_steps=5"):
        Consumer(build_model(cfg.model, tokenizer), cfg)


def _pinned_cores():
    """Cores 0 and 1 of this process (the tests pin the trainer to one, the engine to the other)."""
    from periodic_async.parallel import affinity

    cores = affinity.available_cores()
    if not affinity.SUPPORTED or len(cores) < 2:
        pytest.skip("needs CPU affinity and 2 cores")
    return cores[:2]


def test_threads_after_generation_default_takes_the_engines_cores():
    """trainer.threads_after_generation='auto' (the default): on CPU the trainer takes its own
    threads plus the separate engine workers' (capped at the cores the run holds, not at the
    cores of the already pinned trainer thread) once generation ends; where no cores are freed
    (sync-colocated, the in-process engine, an accelerator, trainer ranks) it keeps
    trainer.threads; an explicit N is N, 0 keeps trainer.threads. Asked from a thread pinned to
    one core (as the trainer's is during a run), with the run's two cores as `held`."""
    import os

    from periodic_async.consumer import threads_after_generation

    engine_core, trainer_core = _pinned_cores()
    held = [engine_core, trainer_core]
    two_workers = {"engine.backend": "ray", "engine.num_workers": 2, "engine.threads_per_worker": 1,
                   "trainer.threads": 1, "pipeline.mode": "periodic-async"}
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, [trainer_core])  # the trainer's thread, pinned
    try:
        assert run_cfg(**two_workers).trainer.threads_after_generation == "auto"
        assert threads_after_generation(run_cfg(**two_workers), held=held) == 2
        assert threads_after_generation(run_cfg(**{**two_workers, "pipeline.mode": "sync-separated"}), held=held) == 2
        one = {**two_workers, "engine.num_workers": 1}
        assert threads_after_generation(run_cfg(**one), held=held) == 2
        for kept in ({"pipeline.mode": "sync-colocated"}, {"engine.backend": "local"}, {"model.device": "cuda"}):
            assert threads_after_generation(run_cfg(**{**two_workers, **kept}), held=held) == 1, kept
        assert threads_after_generation(run_cfg(**two_workers), distributed=True, held=held) == 1
        assert threads_after_generation(run_cfg(**{**two_workers, "trainer.threads_after_generation": 5})) == 5
        assert threads_after_generation(run_cfg(**{**two_workers, "trainer.threads_after_generation": 0})) == 1
    finally:
        os.sched_setaffinity(0, before)
    assert threads_after_generation(run_cfg(**two_workers)) == min(len(before), 3)  # unpinned: this process's cores


def test_trainer_takes_the_freed_cores_once_generation_is_done(tokenizer):
    """Pinned as a run pins it (engine worker on one core, the trainer on the other): once the
    engines are idle (generation_done set) the trainer trains on 2 torch threads whose cores are
    its own and the engine's (the consumer's thread and its OpenMP threads, read back from the
    OS), and at the iteration's end (the barrier) it is back to 1 thread on its own core. The
    producer's thread (on the engine's core) is never moved onto the trainer's."""
    import os
    import threading

    from periodic_async.parallel import affinity

    engine_core, trainer_core = _pinned_cores()
    cfg = run_cfg(**{"engine.backend": "ray", "engine.num_workers": 1, "engine.threads_per_worker": 1,
                     "trainer.threads": 1, "pipeline.mode": "periodic-async",
                     "engine.cpu_affinity": engine_core, "trainer.cpu_affinity": trainer_core})
    plan = affinity.plan(cfg)
    assert plan == affinity.Plan([trainer_core], [engine_core], [[engine_core]])
    consumer = Consumer(build_model(cfg.model, tokenizer), cfg, pinned=affinity.Pinned(plan))
    idle, seen, stop, ready = threading.Event(), [], threading.Event(), threading.Event()
    # as the run's: started once the trainer is pinned, pinning itself to the producer's cores
    producer = threading.Thread(target=lambda: (affinity.pin_thread(plan.producer), ready.set(), stop.wait()),
                                name="producer-0")

    def tasks():  # every thread of this process and its cores
        return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}

    class Watch(list):  # the trainer's torch threads and cores as it takes each group
        def __iter__(self):
            for g in super().__iter__():
                yield g
                seen.append((torch.get_num_threads(), os.sched_getaffinity(0), os.sched_getaffinity(producer.native_id),
                             tasks()))
                idle.set()  # generation ends after the first group

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with consumer.pinned:
            producer.start(), ready.wait()
            m = consumer.train_iteration(Watch(make_groups(tokenizer)), 0, 0, engines_idle=idle)
            after = (torch.get_num_threads(), os.sched_getaffinity(0), tasks())
    finally:
        stop.set()
        if producer.is_alive():
            producer.join()
        torch.set_num_threads(threads)
    both = {engine_core, trainer_core}
    assert m["threads_raised_at"] is not None
    assert seen[0][:3] == (1, {trainer_core}, {engine_core})  # generating: the trainer on its own core
    assert seen[1][:3] == (2, both, {engine_core})  # generation done: its core and the engine's
    widened = [t for t, cores in seen[1][3].items() if cores == both]
    assert len(widened) >= 2, seen[1][3]  # the consumer's thread and the OpenMP thread it started
    assert after[:2] == (1, {trainer_core})  # the barrier: back to its own core
    assert all(after[2][t] == {trainer_core} for t in widened if t in after[2]), after[2]
