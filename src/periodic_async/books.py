"""The books of a run, kept by rank 0 while the next iteration generates: per iteration its
metrics (metrics.jsonl + W&B), the held-out results that arrived (eval.jsonl), its rollouts
(rollouts.jsonl) and the progress bar; at the end the summary (summary.json). `pipeline.run`
keeps them; nothing here touches the engines or the trainer.

Per-iteration metrics: reward, accuracy, lengths, trained tokens, tokens/s per device, phase
times and idle times; with episodes (env.*) their counters summed over the iteration's episodes
(episode/model_tokens, episode/env_tokens, episode/turns, episode/tool_calls, episode/bad_calls,
episode/tool_errors, episode/feedback_turns, episode/truncated, episode/failed, episode/episodes,
episode/used_tools) and episode/tool_use_rate (episodes that called a tool / episodes). Definitions:
    trained tokens        sum over samples of (P + R_i): the logical tokens, whatever the packing
    devices               trainer ranks and the engine workers in use: `devices_in_use`
    tokens/s per device   trained tokens / iteration wall time / devices; the summary's is
                          trained tokens / device-seconds (devices may change: num_workers_schedule)
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from periodic_async.config import RunConfig
from periodic_async.group import Group
from periodic_async.model import resolve_device
from periodic_async.reward import reward_stats

if TYPE_CHECKING:
    from periodic_async.engine.verify import PushCheck
    from periodic_async.producer import Producer
    from periodic_async.trace import MetricsLogger


def devices_in_use(cfg: RunConfig, trainer_ranks: int = 1, version: int = 0) -> float:
    """The devices the run holds while its engines serve `version` (the definition behind
    throughput/tokens_per_s_per_device, throughput/devices and the summary's devices):

        trainer   trainer_ranks (torchrun's world size) x the devices of one rank
        engines   the workers serving `version` (engine.num_workers_schedule: the count of its
                  largest key <= version; else engine.num_workers) x the devices of one worker;
                  none with engine.backend=local (in the trainer's process, on its devices)
        devices   trainer + engines in the separated modes; max(trainer, engines) in
                  sync-colocated, where the two take turns on the same devices

    On CPU a device is a core: trainer.threads per rank, engine.threads_per_worker per worker.
    On an accelerator (model.device cuda or npu) a device is one GPU/NPU: one per rank,
    engine.gpus_per_worker (default 1) per worker."""
    schedule = sorted(cfg.engine.num_workers_schedule.items())
    workers = ([n for v, n in schedule if v <= version] or [cfg.engine.num_workers])[-1]
    if resolve_device(cfg.model.device).type == "cpu":
        per_rank, per_worker = cfg.trainer.threads, cfg.engine.threads_per_worker
    else:
        per_rank, per_worker = 1, 1 if cfg.engine.gpus_per_worker is None else cfg.engine.gpus_per_worker
    engines = workers * per_worker if cfg.engine.backend != "local" else 0
    trainer = trainer_ranks * per_rank
    if cfg.pipeline.mode == "sync-colocated":
        return max(trainer, engines)
    return engines + trainer


def iteration_metrics(groups: list[Group], t_start: float, t_end: float, train: dict, sync_s: float,
                      cfg: RunConfig, trainer_ranks: int = 1, filtered: list[Group] = ()) -> dict[str, float]:
    """Iteration t's metrics (the module docstring defines them) from its groups, its clock
    (t_start to the end of its barrier), the consumer's `train` metrics and the push's seconds.
    `groups`: those trained; `filtered`: those dynamic sampling drew and did not train. Rewards,
    accuracy, lengths and generation time are over all the iteration sampled, tokens over those trained."""
    sampled = list(groups) + list(filtered)
    rewards = [r for g in sampled for r in g.rewards if r == r]  # NaN: scored by no function (TRL), a failed episode
    lengths = [len(r) for g in sampled for r in g.response_ids]
    trained = sum(len(g.prompt_ids) * g.size + g.num_response_tokens for g in groups)
    wall = t_end - t_start
    gen_s = max(0.0, max(g.timings["finished"] for g in sampled) - t_start)  # 0: prefetched (off-policy)
    devices = devices_in_use(cfg, trainer_ranks, sampled[0].iteration)  # the engines hold version t meanwhile
    m = {
        "reward/mean": statistics.fmean(rewards) if rewards else math.nan,
        "reward/std": statistics.pstdev(rewards) if rewards else math.nan,
        "accuracy": statistics.fmean(c for g in sampled for c in g.correct),
        "response/len_mean": statistics.fmean(lengths), "response/len_max": max(lengths),
        "response/truncated_frac": statistics.fmean(f not in ("stop", "failed") for g in sampled
                                                    for f in g.finish_reasons),
        "tokens/trained": trained, "tokens/response": sum(lengths),
        "tokens/packed": sum(g.num_packed_tokens(cfg.algorithm.shared_prompt) for g in groups),
        "throughput/tokens_per_s": trained / wall,
        "throughput/tokens_per_s_per_device": trained / wall / devices, "throughput/devices": devices,
        "time/iteration_s": wall, "time/generate_s": gen_s, "time/train_s": train["train_busy_s"],
        "time/reward_s": sum(g.timings.get("reward_s", 0.0) for g in sampled), "time/sync_s": sync_s,
        "idle/engine_s": wall - gen_s,
        "idle/trainer_s": wall - train["train_busy_s"] - sync_s,
        # Where an async iteration loses against max(T_gen, T_train): the trainer's work left
        # when generation ends (the tail), before the barrier's weight sync.
        "time/after_generation_s": wall - sync_s - gen_s,
    }
    counts: dict[str, float] = {}  # episodes: the sums of their counters over the groups sampled
    for g in sampled:
        for k, v in g.episode_counts.items():
            counts[k] = counts.get(k, 0) + v
    if counts:
        m.update(counts)
        m["episode/tool_use_rate"] = counts["episode/used_tools"] / counts["episode/episodes"]
    for key in ("first_group_at", "threads_raised_at"):
        if train.get(key):
            m[f"time/{key.removesuffix('_at')}_s"] = train[key] - t_start
    m.update({f"train/{k}": v for k, v in train.items()
              if k not in ("train_busy_s", "first_group_at", "threads_raised_at")})
    return m


SOURCE_COLUMNS = ("source_dataset", "source_index")
"""An example's columns naming its origin (a task source's: data/reasoning_tasks.py), copied into its
rollouts and used for the per-task metrics."""


def write_rollouts(path: Path, groups: list[Group], filtered: list[Group] = (), examples: list = ()) -> None:
    """Append the iteration's groups, in the order the trainer consumed them, then those dynamic
    sampling filtered ("filtered": true, no arrival); each with its example's `SOURCE_COLUMNS`."""
    with path.open("a") as f:
        for arrival, g in [*enumerate(groups), *((None, g) for g in filtered)]:
            columns = examples[g.prompt_index].columns if g.prompt_index < len(examples) else {}
            f.write(json.dumps({"iteration": g.iteration, "version": g.version, "prompt_index": g.prompt_index,
                                "position": g.timings.get("position"), "arrival": arrival,
                                "filtered": arrival is None,
                                **{k: columns[k] for k in SOURCE_COLUMNS if k in columns},
                                "rewards": g.rewards, "advantages": g.advantages, "correct": g.correct,
                                "answer": g.answer, "texts": g.texts, "response_ids": g.response_ids,
                                "finish_reasons": g.finish_reasons,
                                **({"loss_mask": g.loss_mask} if g.loss_mask is not None else {})}) + "\n")


def per_task(groups: list[Group], examples: list) -> dict[str, float]:
    """reward/mean/NAME: the mean reward of the groups of each task (an example's source_dataset column)."""
    by_task: dict[str, list[float]] = {}
    for g in groups:
        name = examples[g.prompt_index].columns.get("source_dataset") if g.prompt_index < len(examples) else None
        if name is not None:
            by_task.setdefault(name, []).extend(r for r in g.rewards if r == r)
    return {f"reward/mean/{name}": statistics.fmean(r) for name, r in sorted(by_task.items()) if r}


class Books:
    """Everything an iteration writes: metrics (JSONL + W&B), held-out accuracy, rollouts, progress."""

    def __init__(self, cfg: RunConfig, logger: MetricsLogger, producer: Producer, trainer_ranks: int = 1,
                 push_check: PushCheck | None = None) -> None:
        self.cfg, self.out, self.logger, self.producer = cfg, Path(cfg.trainer.output_dir), logger, producer
        self.trainer_ranks, self.push_check = trainer_ranks, push_check
        self.history: list[dict] = []
        self.logged_evals: set[int] = set()
        self.bar = None
        if cfg.logging.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.trainer.iterations, desc=cfg.pipeline.mode, unit="it")

    def iteration(self, groups: list[Group], t_start: float, t_end: float, train: dict, sync_s: float,
                  completed: int, barrier_failed: bool = False) -> None:
        """The books of iteration completed-1. barrier_failed: its barrier failed after the step
        (sync_s is then the time to the failure; the row says `barrier/failed`)."""
        draws = self.producer.draws.pop(completed - 1, None)
        filtered = draws.filtered if draws is not None else []
        m = iteration_metrics(groups, t_start, t_end, train, sync_s, self.cfg, self.trainer_ranks, filtered)
        m.update(per_task(groups + filtered, self.producer.examples))
        if self.cfg.algorithm.dynamic_sampling and draws is not None:
            m.update(draws.metrics())
        if barrier_failed:
            m["barrier/failed"] = 1
        m.update(self._new_evals())
        m.update(self.producer.engine.stats())  # e.g. engine/workers, engine/worker_restarts (ray)
        m.update(reward_stats())  # reward/worker_restarts: reward worker processes replaced
        if self.push_check is not None and not barrier_failed:  # this barrier's check: probe/max_gap,
            # time/push_s, time/verify_s
            m.update(self.push_check.last)
        m["pipeline/queue_depth_max"] = self.producer.queue_depth_max  # most groups waiting for the trainer
        if self.cfg.logging.rollouts:
            write_rollouts(self.out / "rollouts.jsonl", groups, filtered, self.producer.examples)
        self.logger.log(m, step=completed)
        self.history.append({"iteration": completed - 1, **m})
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{m['reward/mean']:.3f}", tok_s=f"{m['throughput/tokens_per_s']:.0f}")

    def _new_evals(self) -> dict[str, float]:
        """Held-out results that arrived since the last call: one line each in eval.jsonl (step =
        the version evaluated = iterations completed by those weights); the newest also goes
        into the metrics as eval/* with eval/version."""
        m = {}
        for version in sorted(set(self.producer.eval_results) - self.logged_evals):
            r = self.producer.eval_results[version]
            with (self.out / "eval.jsonl").open("a") as f:
                f.write(json.dumps({"step": version, **r}) + "\n")
            self.logged_evals.add(version)
            m = {"eval/accuracy": r["accuracy"], "eval/stderr": r["stderr"], "eval/n": r["n"], "eval/version": version,
                 **{f"eval/accuracy/{name}": t["accuracy"] for name, t in r.get("tasks", {}).items()}}
        return m

    def log_new_evals(self, completed: int) -> None:
        m = self._new_evals()
        if m:
            self.logger.log(m, step=completed)

    def summary(self) -> dict:
        """The run's summary (`summary`) of the iterations kept so far."""
        return summary(self.cfg, self.history)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def summary(cfg: RunConfig, history: list[dict]) -> dict:
    """The run's summary (summary.json) from the iterations' metrics; the steady state leaves the
    first iteration (start-up) out."""
    if not history:
        return {"mode": cfg.pipeline.mode, "iterations": 0}
    steady = history[1:] or history  # the first iteration pays start-up costs
    total_tokens = sum(h["tokens/trained"] for h in steady)
    total_time = sum(h["time/iteration_s"] for h in steady)
    device_s = sum(h["time/iteration_s"] * h["throughput/devices"] for h in steady)
    devices = device_s / total_time  # time-weighted: the engine workers may change (num_workers_schedule)
    return {
        "mode": cfg.pipeline.mode, "iterations": len(history),
        "devices": round(devices) if abs(devices - round(devices)) < 1e-9 else devices,
        "tokens_per_s": total_tokens / total_time,
        "tokens_per_s_per_device": total_tokens / device_s,
        "mean_generate_s": statistics.fmean(h["time/generate_s"] for h in steady),
        "mean_train_s": statistics.fmean(h["time/train_s"] for h in steady),
        "mean_iteration_s": statistics.fmean(h["time/iteration_s"] for h in steady),
        # where an iteration goes beyond its phases: the barrier's push (+ check), the trainer's
        # wait for the first group (the head) and its work left once generation ends (the tail)
        "mean_sync_s": statistics.fmean(h["time/sync_s"] for h in steady),
        "mean_first_group_s": statistics.fmean(h.get("time/first_group_s", 0.0) for h in steady),
        "mean_after_generation_s": statistics.fmean(h["time/after_generation_s"] for h in steady),
        # the trainer thread's CPU seconds in its busy time: below mean_train_s when it waited
        # (another thread on its core, the GIL), equal when it computed throughout
        "mean_train_thread_cpu_s": statistics.fmean(h.get("train/thread_cpu_s", 0.0) for h in steady),
        # prompts drawn per iteration and groups dynamic sampling left untrained (B and 0 without it)
        "mean_drawn": statistics.fmean(h.get("dynamic/drawn", cfg.algorithm.prompts_per_iteration) for h in steady),
        "mean_filtered": statistics.fmean(h.get("dynamic/filtered", 0) for h in steady),
        # the mean loss over this run's iterations (TRL's training_loss)
        "train_loss": statistics.fmean(h.get("train/loss", float("nan")) for h in history),
        "reward_first": history[0]["reward/mean"], "reward_last": history[-1]["reward/mean"],
        "accuracy_first": history[0]["accuracy"], "accuracy_last": history[-1]["accuracy"],
    }
