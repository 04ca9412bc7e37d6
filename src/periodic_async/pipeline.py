"""The training loop, the same for every mode (the paper's Figure 1; method points 1-4).

    begin: push version 0 to the engines, start generating iteration 0
    for each iteration t:
        the trainer consumes the iteration's groups (micro-batches, gradient accumulation)
        and takes one optimizer step
        the barrier: once nothing is in flight on the engines (the iteration's requests, the
            held-out ones), version t+1 is pushed to every engine, and the push is checked (the
            engines' log-probs of a probe sequence against the trainer's: engine/verify.py)
        the next iteration starts generating; the books are kept meanwhile

What differs between modes lives in `modes.py` (the order the trainer takes groups, which
version sampled them, whether the next batch is prefetched); where the engines run is
configuration (`engine.backend`, workers, threads):

    sync-colocated   engines and trainer take turns on the same devices: generate the whole
                     batch, then train (what verl's hybrid engine and TRL do). With
                     engine.backend=local the engine runs in the trainer's process and threads;
                     with ray workers they idle while the trainer trains.
    sync-separated   separate engine workers and trainer; training waits for the whole
                     batch and takes it in dataset order (the paper's Figure 1a).
    periodic-async   separate engine workers and trainer; the trainer takes groups in
                     completion order while the rest are still generating (Figure 1b).
    async-offpolicy  the one-step-stale baseline the paper argues against (see modes.py).
In the on-policy modes every sample of iteration t comes from the policy of version t, and
from one seed the sync and async modes sample the same tokens and reach the same weights
(tests/test_pipeline.py).

Held-out evaluation (`trainer.eval_every`) runs through the engines beside the generation
(producer.py); each result is one line of eval.jsonl, {"step": version evaluated, accuracy,
n, stderr}, and also appears in metrics.jsonl as eval/* with eval/version. The books (metrics,
rollouts, the summary, and what they mean) are books.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from periodic_async import checkpoint
from periodic_async.books import Books
from periodic_async.config import RunConfig, sharing_resolved
from periodic_async.consumer import Consumer
from periodic_async.data import few_shot_examples, fit_to_context, load_examples, load_once
from periodic_async.engine import Engine, make_engine
from periodic_async.engine.verify import PushCheck
from periodic_async.group import Group
from periodic_async.model import load_policy, resolve_model_path
from periodic_async.modes import make_mode
from periodic_async.parallel import affinity
from periodic_async.parallel.distributed import Ranks, init_ranks
from periodic_async.producer import Producer
from periodic_async.records import remove_logs, save_run_info, truncate_logs, update_run_info
from periodic_async.reward import make_reward, set_worker_cpus
from periodic_async.trace import MetricsLogger, Tracer


def build_engine(cfg: RunConfig) -> Engine:
    """The engines of `cfg` (a hub id in model.name_or_path: its snapshot directory, which they load)."""
    model = dataclasses.replace(cfg.model, name_or_path=resolve_model_path(cfg.model.name_or_path))
    return make_engine(sharing_resolved(cfg), model)


@dataclass
class Task:
    """What a run learns from, given in code instead of by `cfg.data` and `cfg.reward` (the
    TRL-shaped API, trl_api/): the training and held-out examples, the reward and accuracy
    functions (the producer's shape, f(prompts, completions, **columns)), the few-shot examples.
    Prompts are checked against the model's context as `cfg.data` ones are."""

    examples: list
    evals: list = field(default_factory=list)
    reward_fn: Callable[..., list[float]] | None = None
    accuracy_fn: Callable[..., list[float]] | None = None
    shots: list = field(default_factory=list)
    environments: object = None
    """An `episode.Environments` (TRL's environment_factory and tools): every group is G episodes,
    under `cfg.env`'s limits; None: `cfg.env`'s own factory and tools, if any."""


def run(cfg: RunConfig, engine: Engine | None = None, task: Task | None = None) -> dict:
    """Train for `cfg.trainer.iterations`; returns a summary. Writes under trainer.output_dir:
    config.yaml, run_info.json, metrics.jsonl, eval.jsonl, rollouts.jsonl, trace.jsonl,
    trace.chrome.json, checkpoint-<t>/ (+ the `checkpoint` link; checkpoint.py), summary.json.
    `engine` lets tests and benchmarks share one started engine; `task` replaces the data and
    reward of `cfg` (`Task`). Whatever stops the run (an
    error, a signal, a failure while starting), what was started is released: the producer
    thread, the engine when the run built it (Ray with it), W&B, the progress bar.

    Under torchrun every trainer rank runs this same loop (parallel/distributed.py): rank 0 holds
    the engines, the producer and the books (`_Generation`); the other ranks train the groups
    they claim and join rank 0's collectives at the same points of the loop (`_Follower`), and
    return {"rank", "first_iteration", "groups_trained", "train_loss"}.

    Cores (parallel/affinity.py): the reward, accuracy and math-verify worker processes the run
    starts (and restarts) are on the producer's cores, never the pinned trainer's."""
    ranks = init_ranks(cfg)  # trainer ranks under torchrun; one process otherwise
    pinned = affinity.Pinned(affinity.plan(cfg, ranks.distributed))  # the trainer's and producer's cores (checked here)
    set_worker_cpus(pinned.plan.producer)  # before any reward worker starts (make_reward starts one)
    try:
        return _run(cfg, engine, task, ranks, pinned)
    finally:
        set_worker_cpus(None)


def _run(cfg: RunConfig, engine: Engine | None, task: Task | None, ranks: Ranks, pinned: affinity.Pinned) -> dict:
    out = Path(cfg.trainer.output_dir)
    if ranks.is_main:
        save_run_info(cfg, out)  # as given (a hub id stays an id); what it resolves to goes to the run's info
    model_path = resolve_model_path(cfg.model.name_or_path)  # a hub id: its snapshot in the local cache
    if model_path != cfg.model.name_or_path:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=model_path))
        if ranks.is_main:
            update_run_info(out, model_path=model_path)
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.model.seed)
    policy, tokenizer = load_policy(cfg.model)
    reference = checkpoint.reference_hash(policy) if ranks.is_main else None  # the initial weights = the ref
    data = _load_data(cfg, policy, tokenizer, task) if ranks.is_main else None  # rank 0 alone samples
    tracer = Tracer(enabled=cfg.logging.trace, path=out / "trace.jsonl") if ranks.is_main else Tracer(enabled=False)
    consumer = Consumer(policy, cfg, tracer, ranks=ranks, pinned=pinned)  # tri-model's ref = the initial weights
    ckpt = checkpoint.resume(cfg, consumer, reference)  # trainer ranks: every rank loads rank 0's checkpoint
    if ranks.is_main and ckpt is not None:
        print(f"[train] resumed from {ckpt} at iteration {consumer.version}")
        truncate_logs(out, consumer.version)  # the logs resume where the weights do
    elif ranks.is_main:  # a fresh run does not append to an earlier run's logs, nor resume its checkpoints
        remove_logs(out)
        checkpoint.remove_all(out)
    start = ranks.start(consumer, consumer.version)  # every rank at rank 0's iteration
    # trainer ranks: every rank saves with us (rank 0 writes)
    checkpoints = checkpoint.Checkpoints(cfg, policy, tokenizer if ranks.is_main else None, consumer, reference)
    completed = start  # iterations whose optimizer step is done
    with contextlib.ExitStack() as started:  # closed in reverse order, whatever happens
        started.callback(ranks.close)
        if ranks.is_main:
            started.callback(tracer.write, out)
            if engine is None:
                engine = started.enter_context(build_engine(cfg))
        started.enter_context(pinned)  # after the engine: Ray's threads in this process are sorted too
        if ranks.is_main:
            update_run_info(out, cpu_affinity=pinned.report(engine))
            push_check = PushCheck.from_config(cfg.engine, cfg.model, policy, copy=ranks.lockstep)  # engine.verify_push
            side = _Generation(cfg, engine, tokenizer, data, tracer, ranks, started, push_check, pinned.plan.producer)
        else:
            side = _Follower(ranks)
        try:
            side.begin(consumer, start, cfg.trainer.iterations)  # version `start` on the engines; generate
            for iteration in range(start, cfg.trainer.iterations):  # the paper's Figure 1
                groups, version = side.groups(iteration)  # in the mode's order, as they come
                train = consumer.train_iteration(groups, iteration, version, engines_idle=side.generation_done)
                completed = consumer.version  # t+1: the policy's version, whatever happens at the barrier
                side.barrier(consumer, iteration, train)  # version t+1 to every engine; the next generation
                checkpoints.every(completed)
            side.end(completed)
            checkpoints.save(completed)
        except BaseException:
            if ranks.is_main:
                checkpoints.after_failure()  # the weights of the last completed iteration, under its label
            raise
    return side.summary(completed)


def _load_data(cfg: RunConfig, policy, tokenizer, task: Task | None = None) -> tuple:
    """Rank 0's (training examples, held-out examples, few-shot examples, reward function, accuracy
    function, environments (None: single-turn), the model's context); every prompt + its response
    budget (engine.max_tokens; episodes: env's token budget) is checked once against the model's
    context (examples skipped as too long, data.skip_too_long, are reported then): `cfg.data`'s
    loaded once per process (`data.load_once`), a `task`'s checked, never cached."""
    context = getattr(policy.config, "max_position_embeddings", None)
    environments = task.environments if task is not None else None
    episodes = environments is not None or cfg.env.enabled
    budget = cfg.env.budget(cfg.engine) if episodes else cfg.engine.max_tokens

    def fit(examples: list, evals: list, shots: list) -> tuple[list, list, list]:
        return (*(fit_to_context(e, shots, tokenizer, budget, context, cfg.data.skip_too_long, what,
                                 cfg.data) for e, what in ((examples, "training"), (evals, "held-out"))), list(shots))

    if task is None:
        data = cfg.data
        loaded = load_once(data, tokenizer, lambda: fit(load_examples(data, "train"), load_examples(data, "eval"),
                                                        few_shot_examples(data)), budget, context)
        return (*loaded, make_reward(cfg.reward), None, None, context)
    fitted = fit(task.examples, task.evals, task.shots)
    return (*fitted, make_reward(cfg.reward) if task.reward_fn is None else task.reward_fn, task.accuracy_fn,
            environments, context)


class _Generation:
    """Rank 0's part of the loop: the engines, the producer thread, the mode's hooks (what differs
    between modes: modes.py) and the books. Each iteration's clock starts when the trainer asks
    for its groups and stops when the weight sync of the barrier ends."""

    def __init__(self, cfg: RunConfig, engine: Engine, tokenizer, data, tracer: Tracer, ranks: Ranks,
                 started: contextlib.ExitStack, push_check: PushCheck | None = None,
                 producer_cores: list[int] | None = None) -> None:
        examples, self.evals, shots, reward_fn, accuracy_fn, environments, context = data
        self.cfg, self.engine, self.tracer, self.ranks = cfg, engine, tracer, ranks
        self.push_check = push_check
        self.producer = Producer(engine, tokenizer, examples, shots, reward_fn, cfg, tracer, eval_examples=self.evals,
                                 accuracy_fn=accuracy_fn, cores=producer_cores, environments=environments,
                                 context=context)
        started.callback(self.producer.close)
        out = Path(cfg.trainer.output_dir)
        logger = MetricsLogger(out, cfg, mode=cfg.logging.wandb_mode, project=cfg.logging.wandb_project,
                               name=f"{cfg.pipeline.mode}-{out.name}")
        started.callback(logger.close)
        self.books = Books(cfg, logger, self.producer, ranks.world_size, push_check)
        started.callback(self.books.close)
        self.mode = make_mode(cfg.pipeline.mode)
        self.generation_done = self.producer.generation_done

    def begin(self, consumer: Consumer, first: int, last: int) -> None:
        _barrier(self.engine, consumer, first, self.tracer, self.push_check)  # the engines start from our weights
        self.mode.begin(self.producer, first, last)

    def groups(self, iteration: int):
        """The groups the trainer consumes (under trainer ranks: rank 0's claims) and the version
        that sampled them."""
        self.t_start = time.time()
        version = self.mode.sampled_by(iteration)
        a = self.cfg.algorithm
        received = _Received(self.mode.groups(self.producer, iteration), iteration, a.draws_cap,
                             (lambda: self.producer.draws[iteration].kept) if a.dynamic_sampling else None)
        self.received = received  # what the trainer got, whatever happens to the hand-out
        self.handed = self.ranks.hand_out(received, iteration, version)
        return self.handed, version

    def barrier(self, consumer: Consumer, iteration: int, train: dict) -> None:
        """Push version t+1 once nothing is in flight on the engines. The trainer may be done
        before the engines are: under trainer ranks rank 0 leaves the iteration once every group
        is claimed, while the hand-out may still be streaming and the held-out requests
        (`trainer.eval_every`) still generating. So the barrier first waits for the whole stream
        (`received`) and for the producer's thread to end (its generation and evaluation
        returned), in every mode: a single process's stream ends only after both anyway."""
        completed = consumer.version
        t0 = time.time()
        try:
            self.mode.before_barrier(self.producer, iteration)
            _ = self.handed.received  # the hand-out's end (ranks: joins its thread, raises its error)
            self.producer.wait_idle()
            sync_s = _barrier(self.engine, consumer, completed, self.tracer, self.push_check)
        except BaseException:
            # The iteration was trained and stepped, and the checkpoint saved after the failure
            # holds its weights: its books are kept too (marked), so a resume finds it logged.
            with contextlib.suppress(Exception):
                self.books.iteration(self.received.received, self.t_start, time.time(), train,
                                     time.time() - t0, completed, barrier_failed=True)
            raise
        t_end = time.time()
        self.mode.after_barrier(self.producer, completed)  # the next iteration generates while we keep the books
        self.books.iteration(self.received.received, self.t_start, t_end, train, sync_s, completed)

    def end(self, completed: int) -> None:
        if self.cfg.trainer.eval_at_end and self.evals and completed not in self.producer.eval_results:
            self.producer.evaluate_now(completed)
        self.books.log_new_evals(completed)

    def summary(self, completed: int) -> dict:
        summary = self.books.summary()
        if completed in self.producer.eval_results:
            summary["eval_accuracy"] = self.producer.eval_results[completed]["accuracy"]
        (Path(self.cfg.trainer.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


class _Follower:
    """Ranks > 0: no engines, producer or books. A follower trains the groups it claims from rank
    0 and joins rank 0's collectives where rank 0 makes them: the weight gather of each barrier
    (under fsdp), the one reduction per iteration (inside `train_iteration`), the checkpoints."""

    generation_done = None

    def __init__(self, ranks: Ranks) -> None:
        self.ranks, self.taken, self.first, self.losses = ranks, [], None, []

    def begin(self, consumer: Consumer, first: int, last: int) -> None:
        self.first = first
        consumer.engine_state_dict()  # rank 0's first barrier

    def groups(self, iteration: int):
        self.claims = self.ranks.claims(iteration)
        return self.claims, self.claims.version

    def barrier(self, consumer: Consumer, iteration: int, train: dict) -> None:
        consumer.engine_state_dict()
        self.taken.append(self.claims.taken)
        self.losses.append(train["loss"])  # all-reduced: every rank's is the iteration's loss

    def end(self, completed: int) -> None:
        pass

    def summary(self, completed: int) -> dict:
        return {"rank": self.ranks.rank, "first_iteration": self.first, "groups_trained": self.taken,
                "train_loss": statistics.fmean(self.losses) if self.losses else float("nan")}


def _barrier(engine: Engine, consumer: Consumer, version: int, tracer: Tracer,
             push_check: PushCheck | None = None) -> float:
    """Push the policy's weights (in the engines' dtype) to every engine as `version`, then (as
    engine.verify_push says) prove they arrived: the engines' probe log-probs against the
    trainer's (engine/verify.py; a gap stops the run with an EngineError). Returns the push's
    seconds (the check is traced apart, as verify_push)."""
    t = time.time()
    state = consumer.engine_state_dict()
    push_s = engine.update_weights(state, version)
    t_end = time.time()
    tracer.add("weight_sync", "trainer", t, t_end, version=version)
    if push_check is not None:
        push_check.after_push(engine, version, push_s, state)
        tracer.add("verify_push", "trainer", t_end, time.time(), version=version)
    return t_end - t


class _Received:
    """Passes an iteration's groups to the trainer and keeps them, in the order consumed.
    Guarantees what the consumer's count cannot: the groups are the iteration's B distinct
    positions (each request once), each tagged with `iteration`; anything else is a
    RuntimeError before the group reaches the trainer (or, for a missing position, before the
    iteration can end). With dynamic sampling: distinct positions below the draws' cap (`batch`),
    as many as the producer kept (`kept()`, asked once the stream has ended)."""

    def __init__(self, groups: Iterable[Group], iteration: int, batch: int,
                 kept: Callable[[], int] | None = None) -> None:
        self.groups, self.received = groups, []
        self.iteration, self.batch, self.kept = iteration, batch, kept

    def __iter__(self) -> Iterator[Group]:
        seen: set[int] = set()
        for g in self.groups:
            position = g.timings.get("position")
            if g.iteration != self.iteration:
                raise RuntimeError(f"iteration {self.iteration}: got the group at position {position} (prompt "
                                   f"{g.prompt_index}) of iteration {g.iteration}")
            if position in seen or position not in range(self.batch):
                raise RuntimeError(f"iteration {self.iteration}: position {position} (prompt {g.prompt_index}) "
                                   f"{'twice' if position in seen else f'outside 0..{self.batch - 1}'}")
            seen.add(position)
            self.received.append(g)
            yield g
        expected = self.batch if self.kept is None else self.kept()
        if len(seen) != expected:
            missing = sorted(set(range(expected)) - seen) if self.kept is None else sorted(seen)
            raise RuntimeError(f"iteration {self.iteration}: the stream ended with {len(seen)} groups of {expected}: "
                               f"positions {missing} {'missing' if self.kept is None else 'received'}")

