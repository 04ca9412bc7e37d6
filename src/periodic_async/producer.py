"""The producer (the paper's method point 2, its "temporary data generator"): a background thread that
turns an iteration's prompts into scored `Group`s on a queue.

At the start of iteration t, once version t is on every engine, `start(t)` takes the
iteration's B prompts (`data.iteration_prompts`: deterministic and resumable), submits
B requests of G samples each to the engine at once (continuous batching does the rest),
and as each group completes scores it with the reward function, computes its group
advantages and puts it on a bounded queue, tagged with the engine's version.

Held-out evaluation runs through the same engines: when `trainer.eval_every` divides the
engines' version, `start(t)` appends one greedy request per held-out prompt after the
iteration's requests (FIFO admission puts them in the slots that free up at the end of the
generation, where the engines would otherwise idle). They are scored with the accuracy
function (`reward.accuracy_function`, default the correctness reward) into
`eval_results[version]`, never queued for training: the trainer keeps training
while they run, and the iteration ends when both are done.

Dynamic sampling (`algorithm.dynamic_sampling`, DAPO): a group whose rewards are all equal is
filtered (kept in `draws[iteration]` for the books, never queued), and the iteration draws one
more prompt (`data.extra_prompts`) for each, at once: the request joins the running generate()
call through a `Feed` (engine/base.py), so it takes the first slot that frees up, with the same
version, until B informative groups are queued or `algorithm.max_draws_per_iteration` prompts
were drawn (`_Draws`). Under periodic asynchrony the extra draws generate while the trainer
trains the groups already queued. Episodes do the same: a filtered group's replacement starts
its episodes at once, beside the groups still running.

Episodes (the run has an environment or tools: `env.*`, or the TRL drop-in's `tools=` /
`environment_factory`): the iteration's groups and the held-out ones (one greedy episode
each) run concurrently as multi-turn episodes (episode/runner.py) through one
continuer (one generate() call on the engines, fed as turns arrive: episode/continuer.py), closed
before the thread ends and so before the barrier's push. A group is scored and queued as its G
episodes finish: every model turn must carry the iteration's version (else the run stops), the
rewards are the reward functions' plus each environment's get_reward(), a failed episode's is
NaN, and the trainer gets `episode_group`'s shared prompt, responses and loss mask.

`generation_done` is set once the engines have returned every request of the iteration
(before the last group is queued): from then on the engines' devices are free until the
barrier, and the consumer may take them (`trainer.threads_after_generation`).

Reward and accuracy functions get TRL's arguments: the prompts (the example's own `prompt` when
the dataset gives it whole, text or messages; else the template's user turn), the completions,
`completion_ids`, `trainer_state` (`TrainerState`: the step that sampled them) and every column
of the example's dataset record as keyword lists (`data.reward_kwargs`; `answer` always, the
parsed ground truth).

Guarantees: every request of the iteration is delivered exactly once (the consumer counts
the groups; the pipeline checks they are the iteration's B distinct positions, tagged with
the iteration; with dynamic sampling, the positions of its kept groups); a request's sampling
seed is a pure function of (run seed, iteration, position in the iteration), so every pipeline
mode samples the same tokens, keeps the same groups, and a prompt drawn twice in one
iteration gives two groups; an exception in the thread is re-raised in
the consumer by `stream()`, which never blocks forever (engine timeouts bound generation).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Callable, Iterator, Sequence

from periodic_async import grpo
from periodic_async.config import RunConfig
from periodic_async.parallel.affinity import pin_thread, starting_on
from periodic_async.data import (Example, encode_prompts, extra_prompts, iteration_prompts, reward_kwargs,
                                 reward_prompt)
from periodic_async.engine import Engine, Feed, Request, RequestOutput, SamplingParams
from periodic_async.episode import Environments, Episode, episode_group
from periodic_async.episode.protocol import load_environments
from periodic_async.episode.sampler import EpisodeSampler, episode_reward
from periodic_async.episode.runner import gather
from periodic_async.evaluate import accuracy_stats, per_task
from periodic_async.group import Group
from periodic_async.reward import RewardError, TrainerState, make_accuracy
from periodic_async.trace import Tracer


class _Done:
    """End of an iteration's stream."""


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Stopped(Exception):
    """The producer was closed while episodes ran: the thread ends without finishing the iteration."""


def request_seed(run_seed: int, iteration: int, position: int) -> int:
    """The sampling seed of the request at `position` (0..B-1, dataset order) of `iteration`:
    identical in every pipeline mode and on resume (the position, like the prompt there, is a
    pure function of the iteration). Seeded by position, not by prompt: an iteration that spans
    two epochs may draw a prompt twice, and the two requests must sample two groups, not one
    group twice. (TRL instead drops the last partial batch of each epoch; keeping the epoch-wise
    draw changes only the seeds.)"""
    return (run_seed * 1_000_003 + iteration * 100_003 + position) % (2**31 - 1)


class _Draws:
    """The prompts one iteration drew and what became of their groups. Dynamic sampling
    (algorithm.dynamic_sampling, DAPO): a group whose rewards are all equal is filtered (kept
    here for the books, never queued) and replaced by one more draw at once, up to `cap` in
    all. So the positions drawn are a prefix 0..N-1 of the iteration's draws, and the last one
    drawn is informative unless the cap is reached (a filtered group always brings one more):
    N is the first count holding B informative groups (or the cap), and the groups trained are
    those B, a pure function of the iteration and its seeds, whatever the completion order
    (every mode trains the same groups)."""

    def __init__(self, iteration: int, batch: int, cap: int) -> None:
        self.iteration, self.batch, self.cap = iteration, batch, cap
        self.drawn, self.kept = 0, 0
        self.filtered: list[Group] = []

    def add(self, group: Group, dynamic: bool) -> bool:
        """Record `group`; whether it is trained (without dynamic sampling: always)."""
        if dynamic and not informative(group.rewards):
            self.filtered.append(group)
            return False
        self.kept += 1
        return True

    def more(self) -> int:
        """The draws that replace a filtered group: one, within the cap."""
        return 1 if self.drawn < self.cap else 0

    @property
    def cap_reached(self) -> bool:
        return self.kept < self.batch

    def metrics(self) -> dict[str, float]:
        return {"dynamic/drawn": self.drawn, "dynamic/kept": self.kept, "dynamic/filtered": len(self.filtered),
                "dynamic/cap_reached": int(self.cap_reached)}


def informative(rewards: Sequence[float]) -> bool:
    """Whether a group teaches anything: its rewards differ (NaN, scored by no function, aside)."""
    return len({r for r in rewards if r == r}) > 1


class Producer:
    """Background generation for one iteration at a time; see the module docstring.

    engine: any `Engine`; examples: training set; shots: few-shot prefix;
    reward_fn: TRL-shaped f(prompts, completions, **columns) -> list[float];
    accuracy_fn: the same shape, scores in [0, 1] (None: `make_accuracy(cfg.reward)`).
    """

    def __init__(self, engine: Engine, tokenizer, examples: Sequence[Example], shots: Sequence[Example],
                 reward_fn: Callable[..., list[float]], cfg: RunConfig, tracer: Tracer | None = None,
                 eval_examples: Sequence[Example] = (),
                 accuracy_fn: Callable[..., list[float]] | None = None, cores: list[int] | None = None,
                 environments: Environments | None = None, context: int | None = None) -> None:
        self.engine, self.tokenizer, self.examples = engine, tokenizer, examples
        self.cores = cores
        """The cores of the producer's thread (parallel/affinity.py: off the trainer's); None: any."""
        self.accuracy_fn = make_accuracy(cfg.reward) if accuracy_fn is None else accuracy_fn
        self.eval_examples = list(eval_examples)
        self.draws: dict[int, _Draws] = {}
        """What each iteration drew (dynamic sampling: the filtered groups; the books pop it)."""
        self.eval_results: dict[int, dict] = {}
        """Greedy held-out accuracy per evaluated version: {'accuracy', 'n', 'stderr', 'iteration',
        'correct' (the accuracy score per held-out example, in order, 0/1 for the default: paired
        comparisons between versions)}."""
        self._eval_prompt_ids: list[list[int]] | None = None
        self.generation_done = threading.Event()
        self.shots, self.reward_fn = list(shots), reward_fn
        self.tracer = tracer or Tracer(enabled=False)
        self.queue_depth_max = 0
        self.queue: queue.Queue = queue.Queue(
            maxsize=cfg.pipeline.queue_size or cfg.algorithm.prompts_per_iteration + 1)
        self._thread: threading.Thread | None = None
        self._prompt_ids: dict[int, list[int]] = {}
        self._stop = threading.Event()
        # what it reads of the run's config from here on: data, algorithm, trainer and, of engine, the
        # sampling (every request's; the held-out requests' greedy one) and how long the barrier waits
        self.data, self.algorithm, self.trainer = cfg.data, cfg.algorithm, cfg.trainer
        self.params = SamplingParams.of(cfg.engine)
        self.greedy = SamplingParams(max_tokens=cfg.engine.max_tokens, temperature=0.0, stop=list(cfg.engine.stop))
        self.timeout_s = cfg.engine.timeout_s
        if environments is None and cfg.env.enabled:
            environments = load_environments(cfg.env)
        self.episodes = None if environments is None else EpisodeSampler(tokenizer, environments, cfg, shots, context)
        """Episodes (env.*, or the TRL drop-in's environment_factory and tools): every group is G
        episodes (episode/sampler.py); None: single-turn groups."""
        if self.episodes is not None:
            self.episodes.check(self.examples, "training")
            self.episodes.check(self.eval_examples, "held-out")

    def prompt_ids(self, index: int) -> list[int]:
        if index not in self._prompt_ids:
            self._prompt_ids[index] = encode_prompts(self.tokenizer, [self.examples[index]], self.shots,
                                                     self.data)[0]
        return self._prompt_ids[index]

    def start(self, iteration: int) -> None:
        """Begin generating iteration `iteration` with the engine's current version (and the
        held-out requests when `trainer.eval_every` divides that version)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("producer: previous iteration still running")
        self.generation_done.clear()
        self._thread = threading.Thread(target=self._run, args=(iteration,), name=f"producer-{iteration}",
                                        daemon=True)
        with starting_on(self.cores):  # never a moment on the trainer's cores
            self._thread.start()

    def stream(self, poll_s: float = 1.0) -> Iterator[Group]:
        """Groups of the current iteration in completion order; re-raises producer errors.
        `queue_depth_max` is then the most groups found waiting for the trainer during the stream."""
        self.queue_depth_max = 0
        while True:
            try:
                item = self.queue.get(timeout=poll_s)
            except queue.Empty:
                if self._thread is not None and self._thread.is_alive():
                    continue
                try:  # its last items may have landed between the time-out and the look at the thread
                    item = self.queue.get_nowait()
                except queue.Empty:
                    raise RuntimeError("producer thread ended without finishing the iteration") from None
            self.queue_depth_max = max(self.queue_depth_max, self.queue.qsize() + 1)
            if isinstance(item, _Done):
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Return once the producer's thread has ended: none of its requests (the iteration's,
        the held-out ones) is on the engines any more, so new weights may be pushed. Call it
        after the stream has ended (the thread ends right after queueing the end of the
        iteration); a thread still alive after `timeout_s` (default engine.timeout_s) raises."""
        if self._thread is None:
            return
        self._thread.join(self.timeout_s if timeout_s is None else timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"producer: {self._thread.name} still generating at the barrier")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # --- the thread -------------------------------------------------------------------------

    def _run(self, iteration: int) -> None:
        try:
            pin_thread(self.cores)  # receiving and scoring: off the trainer's cores (reward workers: run())
            version = self.engine.version
            draws = _Draws(iteration, self.algorithm.prompts_per_iteration, self.algorithm.draws_cap)
            self.draws[iteration] = draws
            first = self.iteration_requests(iteration)
            draws.drawn = len(first)
            every = self.trainer.eval_every
            evaluate = bool(every and version % every == 0 and version not in self.eval_results and self.eval_examples)
            if self.episodes is None:
                self._single_turn_groups(iteration, version, draws, first, evaluate)
            else:
                self._episode_groups(iteration, version, draws, first, evaluate)
            self.queue.put(_Done())
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - every failure must reach the consumer
            self.queue.put(_Failed(e))

    def _single_turn_groups(self, iteration: int, version: int, draws: _Draws, first: list, evaluate: bool) -> None:
        """Single-turn groups: one engine request of G samples per prompt, in one generate() call;
        dynamic sampling's extra draws join that call through a `Feed` as groups are filtered."""
        requests, by_id = self._requests(first, 0)
        evals = self._eval_requests(iteration) if evaluate else {}
        requests += [r for r, _ in evals.values()]
        eval_texts: dict[int, str] = {}
        submitted = time.time()
        feed = Feed() if self.algorithm.dynamic_sampling else None
        for out in self.engine.generate(requests, feed) if feed else self.engine.generate(requests):
            if self._stop.is_set():
                raise _Stopped
            kept = None
            if out.request_id in evals:
                eval_texts[evals.pop(out.request_id)[1]] = out.samples[0].text
            else:
                position, index, example = by_id.pop(out.request_id)
                group = self._score(out, index, example, iteration, version, submitted)
                group.timings["position"] = position  # draw (dataset) order, for the sync modes
                if draws.add(group, self.algorithm.dynamic_sampling):
                    kept = group
                elif extra := self.extra_requests(iteration, draws.drawn, draws.more()):  # filtered: one more draw
                    more, more_by_id = self._requests(extra, draws.drawn)
                    by_id.update(more_by_id)
                    draws.drawn += len(extra)
                    feed.put(more)
            if not by_id and not evals:
                self.generation_done.set()
                if feed:
                    feed.close()
            if kept is not None:
                self.queue.put(kept)
        if by_id or evals:
            raise RuntimeError(f"producer: engine finished without requests {sorted(by_id) + sorted(evals)}")
        self.generation_done.set()
        if eval_texts:
            self._score_eval(eval_texts, iteration, version)

    # --- episodes -----------------------------------------------------------------------------

    def _episode_groups(self, iteration: int, version: int, draws: _Draws, first: list, evaluate: bool) -> None:
        """Episodes: every group (dynamic sampling's replacements too, started as groups are
        filtered) and the held-out episodes run concurrently on one event loop through one
        continuer, closed before the thread ends (so before the barrier's push); each group is
        scored and queued as it finishes."""
        submitted = time.time()
        sampler = self.episodes
        by_id: dict[str, tuple[int, int, Example]] = {}

        def specs(batch: list, start: int) -> list:
            by_id.update({r.request_id: (start + k, i, e) for k, (r, i, e) in enumerate(batch)})
            return [sampler.spec(r.request_id, r.request_id, e, r.n, r.seed) for r, _, e in batch]

        def on_group(key, episodes: list[Episode]) -> list:
            if self._stop.is_set():
                raise _Stopped
            position, index, example = by_id.pop(key)
            group = self._score_episodes(episodes, key, index, example, iteration, version, submitted)
            group.timings["position"] = position
            if draws.add(group, self.algorithm.dynamic_sampling):
                self.queue.put(group)
                return []
            extra = self.extra_requests(iteration, draws.drawn, draws.more())  # filtered: one more draw
            more = specs(extra, draws.drawn)
            draws.drawn += len(extra)
            return more

        with sampler.continuer(self.engine) as continuer:
            runner, greedy = sampler.runner(continuer, self.params), sampler.runner(continuer, self.greedy)
            evals = sampler.greedy_specs(f"eval{iteration}", self.eval_examples) if evaluate else []
            _, held_out = asyncio.run(gather([runner.run_groups(specs(first, 0), on_group), greedy.run_groups(evals)]))
        self.generation_done.set()
        if held_out:
            self._score_eval({i: eps[0].text for i, eps in held_out.items()}, iteration, version)

    def _score_episodes(self, episodes: list[Episode], key: str, index: int, example: Example, iteration: int,
                        version: int, submitted: float) -> Group:
        """The Group of one prompt's G episodes: the on-policy check (every model turn sampled by
        `version`), the rewards (the reward functions on the model's text, TRL's arguments plus
        `environments`, and each environment's get_reward() at weight 1; a failed episode's reward is
        NaN: out of its group's baseline), the accuracy, the advantages, the episodes' counts."""
        versions = set().union(*(ep.versions for ep in episodes))
        if versions - {version}:
            raise RuntimeError(f"producer: group {key} has model turns sampled by versions {sorted(versions)}; "
                               f"iteration {iteration} samples with version {version} only (an episode may not "
                               "span weight versions)")
        t0 = time.time()
        n, packed = len(episodes), episode_group(episodes)
        texts = [ep.text for ep in episodes]
        prompts = [self._prompt(example)] * n
        columns = {**reward_kwargs([example] * n), "completion_ids": [ep.completion_ids for ep in episodes],
                   "trainer_state": self.trainer_state(iteration), "environments": [ep.environment for ep in episodes],
                   "completion_messages": [ep.messages for ep in episodes]}
        try:
            scores = self.reward_fn(prompts, texts, **columns)
            correct = self.accuracy_fn(prompts, texts, **columns)
        except Exception as e:
            raise RewardError(f"iteration {iteration}, prompt {index} (group {key}): {type(e).__name__}: {e}") from e
        rewards = [episode_reward(float(r), ep) for r, ep in zip(scores, episodes, strict=True)]
        advantages = grpo.group_advantages(rewards, mode=self.algorithm.advantage,
                                           eps=self.algorithm.advantage_eps).tolist()
        counts: dict[str, float] = {"episode/episodes": n,
                                    "episode/used_tools": sum(ep.tool_calls > 0 for ep in episodes)}
        for ep in episodes:
            for k, v in ep.metrics().items():
                counts[k] = counts.get(k, 0) + v
        t1 = time.time()
        self.tracer.add("reward", "producer", t0, t1, request=key)
        return Group(
            prompt_index=index, iteration=iteration, version=version, prompt_ids=packed.prompt_ids,
            response_ids=packed.response_ids, behaviour_logprobs=packed.behaviour_logprobs, rewards=rewards,
            advantages=advantages, texts=texts,
            finish_reasons=["failed" if ep.failure else ep.truncated or "stop" for ep in episodes],
            answer=example.answer, correct=correct, loss_mask=packed.loss_mask, episode_counts=counts,
            timings={"submitted": submitted, "finished": t0, "scored": t1, "reward_s": t1 - t0, "worker": 0})

    @staticmethod
    def _requests(draws: list[tuple[Request, int, Example]], first: int) -> tuple[list[Request], dict]:
        """The requests of `draws` and {request id: (position, prompt index, example)}, positions from `first`."""
        return [r for r, _, _ in draws], {r.request_id: (first + k, i, e) for k, (r, i, e) in enumerate(draws)}

    def iteration_requests(self, iteration: int) -> list[tuple[Request, int, Example]]:
        """The iteration's B requests in dataset order (position 0..B-1), each with the index of
        its prompt in the training set and the example: a pure function of the iteration."""
        a, seed = self.algorithm, self.data.seed
        batch = iteration_prompts(self.examples, iteration, a.prompts_per_iteration, seed)
        return [self._request(iteration, position, index) for position, (index, _) in enumerate(batch)]

    def extra_requests(self, iteration: int, first: int, count: int) -> list[tuple[Request, int, Example]]:
        """Dynamic sampling's draws at positions first..first+count-1 of `iteration`: the prompts of
        `data.extra_prompts` (a pure function of the iteration, as the first B are)."""
        if count <= 0:
            return []
        B = self.algorithm.prompts_per_iteration
        indices = extra_prompts(self.examples, iteration, B, self.data.seed, first - B + count)
        return [self._request(iteration, first + k, indices[first - B + k]) for k in range(count)]

    def _request(self, iteration: int, position: int, index: int) -> tuple[Request, int, Example]:
        a, seed = self.algorithm, self.data.seed
        return (Request(f"it{iteration}-p{index}-{position}", self.prompt_ids(index), a.group_size,
                        self.params, request_seed(seed, iteration, position)), index, self.examples[index])

    def evaluate_now(self, iteration: int) -> dict:
        """Held-out greedy accuracy of the engines' current version, in the calling thread
        (the end of a run, when no iteration is generating)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("producer: evaluate_now while an iteration is generating")
        if self.episodes is not None:
            episodes = self.episodes.greedy(self.engine, self.eval_examples, self.greedy, f"eval{iteration}")
            return self._score_eval(dict(enumerate(ep.text for ep in episodes)), iteration, self.engine.version)
        evals = self._eval_requests(iteration)
        texts = {evals[out.request_id][1]: out.samples[0].text
                 for out in self.engine.generate([r for r, _ in evals.values()])}
        return self._score_eval(texts, iteration, self.engine.version)

    def _eval_requests(self, iteration: int) -> dict[str, tuple[Request, int]]:
        if self._eval_prompt_ids is None:
            self._eval_prompt_ids = encode_prompts(self.tokenizer, self.eval_examples, self.shots, self.data)
        return {f"eval{iteration}-{i}": (Request(f"eval{iteration}-{i}", ids, 1, self.greedy, seed=i), i)
                for i, ids in enumerate(self._eval_prompt_ids)}

    def _score_eval(self, texts: dict[int, str], iteration: int, version: int) -> dict:
        order = sorted(texts)
        examples = [self.eval_examples[i] for i in order]
        try:
            correct = self.accuracy_fn([self._prompt(e) for e in examples], [texts[i] for i in order],
                                       **reward_kwargs(examples))
        except Exception as e:
            raise RewardError(f"held-out evaluation of version {version}: {type(e).__name__}: {e}") from e
        tasks = per_task(correct, examples)
        self.eval_results[version] = {**accuracy_stats(correct), "iteration": iteration,
                                      "correct": [int(c) if float(c).is_integer() else c for c in correct],
                                      **({"tasks": tasks} if tasks else {})}
        return self.eval_results[version]

    def _prompt(self, example: Example):
        return reward_prompt(example, self.shots, self.data)

    def trainer_state(self, iteration: int) -> TrainerState:
        """What reward functions get as `trainer_state` for the samples of `iteration`."""
        steps = self.algorithm.optimizer_steps_per_iteration
        return TrainerState(global_step=iteration * steps, max_steps=self.trainer.iterations * steps,
                            epoch=iteration * self.algorithm.prompts_per_iteration / len(self.examples))

    def _score(self, out: RequestOutput, index: int, example: Example, iteration: int, version: int,
               submitted: float) -> Group:
        if out.version != version:
            raise RuntimeError(f"producer: request {out.request_id} came back with version {out.version}, "
                               f"expected {version}")
        for k, ev in enumerate(out.events):
            self.tracer.add("generate", f"worker{ev.get('worker', out.worker)}/slot{ev['slot']:02d}",
                            ev["admitted"], ev["finished"], request=out.request_id, sample=k, prompt=index,
                            tokens=len(out.samples[k].token_ids), first_token=ev.get("first_token"))
        t0 = time.time()
        texts = [s.text for s in out.samples]
        prompts = [self._prompt(example)] * len(texts)
        columns = {**reward_kwargs([example] * len(texts)), "completion_ids": [s.token_ids for s in out.samples],
                   "trainer_state": self.trainer_state(iteration)}
        try:
            rewards = self.reward_fn(prompts, texts, **columns)
            correct = self.accuracy_fn(prompts, texts, **columns)
        except Exception as e:
            raise RewardError(f"iteration {iteration}, prompt {index} (request {out.request_id}): "
                              f"{type(e).__name__}: {e}") from e
        advantages = grpo.group_advantages([float(r) for r in rewards], mode=self.algorithm.advantage,
                                           eps=self.algorithm.advantage_eps).tolist()
        t1 = time.time()
        self.tracer.add("reward", "producer", t0, t1, request=out.request_id)
        return Group(
            prompt_index=index, iteration=iteration, version=out.version, prompt_ids=self.prompt_ids(index),
            response_ids=[s.token_ids for s in out.samples], behaviour_logprobs=[s.logprobs for s in out.samples],
            rewards=[float(r) for r in rewards], advantages=advantages, texts=texts,
            finish_reasons=[s.finish_reason for s in out.samples], answer=example.answer, correct=correct,
            timings={"submitted": submitted, "finished": max(e["finished"] for e in out.events),
                     "scored": t1, "reward_s": t1 - t0, "worker": out.worker},
        )

