"""Prompts as groups of episodes: what the producer (the paper's method point 2) needs to run an
iteration's requests as multi-turn episodes, so that producer.py only schedules, checks versions
and scores.

`EpisodeSampler` holds a run's episode settings (the `env` section's limits and tool format, the
environments, the few-shot prefix and prompt template) and turns them into the runner's inputs:
one `GroupSpec` per request (the request's id, G and seed unchanged: a group of episodes is seeded
as its single-turn request would be), the continuer on an engine (one generate() call fed as turns
arrive, else waves of generate()), and an `EpisodeRunner` per sampling setting.

Guarantees: the tool format is checked against the chat template at construction, and every
example by `check` before the first episode (chat messages; under a dict factory, the
`environment` column), each a one-line error naming the example.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from periodic_async.config import RunConfig
from periodic_async.data import DataError, Example, prompt_messages
from periodic_async.engine.base import Engine, SamplingParams
from periodic_async.episode.continuer import Continuer, FeedContinuer, WaveContinuer
from periodic_async.episode.formats import make_format
from periodic_async.episode.protocol import Environments
from periodic_async.episode.record import Episode, EpisodeLimits
from periodic_async.episode.runner import EpisodeRunner, GroupSpec


def episode_row(example: Example) -> dict:
    """What an environment's reset(**row) gets: the dataset row (TRL's datasets: the row as given,
    `prompt` included), with the parsed `question` and `answer` for ours."""
    if example.prompt is not None:
        return dict(example.columns)
    return {**example.columns, "question": example.question, "answer": example.answer}


def episode_reward(reward: float, episode: Episode) -> float:
    """An episode's reward: the reward functions' `reward` plus its environment's get_reward() (weight 1,
    TRL's extra reward source; NaN, scored by no function, counts as 0 beside it); NaN when it failed."""
    if episode.failure is not None:
        return math.nan
    if episode.env_reward is None:
        return reward
    return episode.env_reward + (0.0 if math.isnan(reward) else reward)


class EpisodeSampler:
    """A run's episodes; see the module docstring.

    tokenizer: the policy's; environments: `Environments` (the `env` section's: `load_environments`,
    or the TRL drop-in's); cfg: the run's config (env, engine, data); shots: the few-shot prefix;
    context: the model's context length (None: no cap on an episode's budget).
    """

    def __init__(self, tokenizer, environments: Environments, cfg: RunConfig, shots: Sequence[Example] = (),
                 context: int | None = None) -> None:
        env = cfg.env
        self.tokenizer, self.environments, self.shots, self.data = tokenizer, environments, list(shots), cfg.data
        self.limits = EpisodeLimits(max_turns=env.max_turns, max_tokens=env.budget(cfg.engine),
                                    max_turn_tokens=cfg.engine.max_tokens, call_timeout_s=env.call_timeout_s,
                                    on_failure=env.on_failure, tool_exceptions=env.tool_exceptions,
                                    context=context or 0)
        self.tool_format = env.tool_format
        make_format(tokenizer, self.tool_format, needs_tools=environments.has_tools)

    def check(self, examples: Sequence[Example], what: str) -> None:
        """Every example has chat messages and, under a dict factory, an environment (one line each)."""
        for i, e in enumerate(examples):
            if isinstance(e.prompt, str):
                raise DataError(f"{what} example {i}: a text prompt; episodes need chat messages (a "
                                "conversational 'prompt', or the prompt template's)")
            self.environments.name_for(episode_row(e), where=f"{what} example {i}")

    @staticmethod
    def continuer(engine: Engine) -> Continuer:
        """How episodes reach `engine`: one generate() call fed as turns arrive (the built-in, vLLM
        and Ray engines), else waves of generate() (an engine whose generate takes no feed). A
        context manager: close it before the engine's weights change."""
        try:
            return FeedContinuer(engine)
        except TypeError:
            return WaveContinuer(engine)

    def runner(self, continuer: Continuer, params: SamplingParams) -> EpisodeRunner:
        return EpisodeRunner(self.tokenizer, continuer, self.environments, params, self.limits, self.tool_format)

    def spec(self, key: Any, request_id: str, example: Example, n: int, seed: int) -> GroupSpec:
        """The group of one request: `n` episodes of `example`, seeded `seed`."""
        return GroupSpec(key, prompt_messages(example, self.shots, self.data), episode_row(example), n, seed,
                         request_id)

    def greedy_specs(self, prefix: str, examples: Sequence[Example]) -> list[GroupSpec]:
        """One greedy episode per example, keyed by its index, seeded by it (as single-turn held-out
        requests are)."""
        return [self.spec(i, f"{prefix}-{i}", e, 1, i) for i, e in enumerate(examples)]

    def greedy(self, engine: Engine, examples: Sequence[Example], params: SamplingParams,
               prefix: str = "eval") -> list[Episode]:
        """One episode per example with `params` (greedy: temperature 0), in order, run from the
        calling thread (one that runs no event loop)."""
        with self.continuer(engine) as continuer:
            episodes = self.runner(continuer, params).run(self.greedy_specs(prefix, examples))
        return [episodes[i][0] for i in range(len(examples))]
