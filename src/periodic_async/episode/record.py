"""The episode contract: what one multi-turn rollout (model turns and environment turns) produced.

An `Episode` is its prompt ids and its turns, each turn a list of token ids tagged with who made
them. Token in, token out: a model turn's ids are exactly the ids the engine sampled (never a
re-tokenisation of its text), and an environment turn (tool answers, feedback, the chat
template's glue around them) is appended as ids; the episode's ids are the plain concatenation
`prompt_ids + turn_1 + turn_2 + ...`, which is what the engine was asked to continue from at
every turn and what the trainer scores. `loss_mask` is 1 on model tokens and 0 on environment
tokens: the environment's tokens are in the context and out of the loss.

`EpisodeLimits` holds the per-episode limits and failure policy (`max_turns`, the token budget,
the per-call timeout, what a failure does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from periodic_async.config import UserError

MODEL, ENV = "model", "env"

Truncation = Literal["max_turns", "token_budget", "turn_length"]
"""Why an episode stopped before the model or the environment ended it: 'max_turns' (the model's
last turn called a tool or got feedback, and no model turn was left), 'token_budget' (the
completion would have outgrown `EpisodeLimits.max_tokens`), 'turn_length' (a model turn reached
`EpisodeLimits.max_turn_tokens` without ending)."""


class EpisodeError(UserError, RuntimeError):
    """Stops the run: a programming error in an environment or a tool (a tool answer that is not a
    string), or any failure when `EpisodeLimits.on_failure == 'raise'`. One line naming what failed."""


@dataclass
class EpisodeLimits:
    max_turns: int = 8
    """Most model turns per episode (TRL's max_tool_calling_iterations is max_turns - 1)."""
    max_tokens: int = 512
    """Token budget of the completion (model and environment tokens after the prompt), as TRL's
    max_completion_length: an environment turn that would leave no room for a model token is
    dropped and the episode is truncated ('token_budget')."""
    max_turn_tokens: int = 256
    """Most tokens of one model turn (the engine request's max_tokens, capped by what the budget leaves)."""
    call_timeout_s: float = 30.0
    """Wall-clock limit of every environment or tool call (reset, a tool, feedback, get_reward)."""
    on_failure: Literal["end", "raise"] = "end"
    """A timeout or an environment's exception: 'end' the episode as a counted failure, or
    'raise' an EpisodeError that stops the run."""
    tool_exceptions: Literal["answer", "fail"] = "answer"
    """A tool that raises: 'answer' gives the model the error text as the tool's answer (TRL's
    behaviour, counted in `tool_errors`); 'fail' treats it as a failure (`on_failure`)."""
    context: int = 0
    """The model's context (max_position_embeddings): an episode's budget is at most this minus
    its prompt (a prompt that leaves no room is a failure); 0: no cap."""

    def budget(self, prompt_tokens: int) -> int:
        """The token budget of an episode whose prompt has `prompt_tokens` ids."""
        return min(self.max_tokens, self.context - prompt_tokens) if self.context else self.max_tokens

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_turn_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpisodeLimits.{name}={getattr(self, name)}: must be >= 1")
        if self.context < 0:
            raise ValueError(f"EpisodeLimits.context={self.context}: must be >= 0 (0: no cap)")
        if not self.call_timeout_s > 0:
            raise ValueError(f"EpisodeLimits.call_timeout_s={self.call_timeout_s}: must be > 0")
        if self.on_failure not in ("end", "raise"):
            raise ValueError(f"EpisodeLimits.on_failure={self.on_failure!r}: expected 'end' or 'raise'")
        if self.tool_exceptions not in ("answer", "fail"):
            raise ValueError(f"EpisodeLimits.tool_exceptions={self.tool_exceptions!r}: expected 'answer' or 'fail'")


@dataclass
class Turn:
    source: Literal["model", "env"]
    token_ids: list[int]
    """The turn's ids: a model turn's sampled ids (with its eos), or an environment turn's ids."""
    logprobs: list[float] = field(default_factory=list)
    """Model turn: the engine's behaviour log-prob of each id; environment turn: empty."""
    text: str = ""
    """Model turn: its ids decoded; environment turn: the messages it renders, as text."""
    finish_reason: str = ""
    """Model turn: the engine's 'stop' or 'length'; environment turn: 'tool' (tool answers) or
    'feedback' (the environment's reply). After a model turn that stopped on a stop string rather
    than eos, the environment turn starts with the eos id that closes the model's turn."""
    version: int | None = None
    """Model turn: the weights version that sampled it."""

    def __post_init__(self) -> None:
        if self.source not in (MODEL, ENV):
            raise ValueError(f"Turn.source={self.source!r}: expected 'model' or 'env'")
        if self.source == MODEL and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"model turn: {len(self.logprobs)} log-probs for {len(self.token_ids)} tokens")
        if self.source == ENV and self.logprobs:
            raise ValueError("environment turn: environment tokens carry no log-probs")


@dataclass
class Episode:
    prompt_ids: list[int]
    """The prompt: chat template applied, tools rendered, reset()'s observation in the last user turn."""
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The completion as chat messages (assistant turns with their parsed tool_calls, tool and
    feedback turns), what TRL passes its reward functions as a conversational completion."""
    index: int = 0
    """k: the episode's place in its group (0..G-1)."""
    environment: Any = None
    """The environment instance that served it (None without environment_factory)."""
    environment_name: str | None = None
    """Its name in a dict environment_factory (None for a single factory)."""
    env_reward: float | None = None
    """The environment's get_reward() at the end (None: it has none, or the episode failed)."""
    tool_calls: int = 0
    """Tool calls the model made (bad ones included)."""
    bad_calls: int = 0
    """Calls answered with an error: unparsable, an unknown tool, arguments that do not fit."""
    tool_errors: int = 0
    """Calls whose tool raised (answered with the error text, `EpisodeLimits.tool_exceptions='answer'`)."""
    feedback_turns: int = 0
    """Environment turns started by the environment's feedback() on a model reply."""
    truncated: Truncation | None = None
    failure: str | None = None
    """One line: the timeout or exception that ended the episode (None: no failure)."""

    @property
    def completion_ids(self) -> list[int]:
        """Every turn's ids, in order: what follows the prompt."""
        return [t for turn in self.turns for t in turn.token_ids]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def loss_mask(self) -> list[int]:
        """Per completion token: 1 for a model token, 0 for an environment token."""
        return [int(turn.source == MODEL) for turn in self.turns for _ in turn.token_ids]

    @property
    def logprobs(self) -> list[float]:
        """Per completion token: the behaviour log-prob of a model token, 0.0 for an environment token."""
        return [lp for turn in self.turns
                for lp in (turn.logprobs if turn.source == MODEL else [0.0] * len(turn.token_ids))]

    @property
    def num_model_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns if t.source == MODEL)

    @property
    def num_env_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns if t.source == ENV)

    @property
    def num_turns(self) -> int:
        """Model turns."""
        return sum(t.source == MODEL for t in self.turns)

    @property
    def versions(self) -> set[int]:
        """The weights versions that sampled its model turns (one, on-policy)."""
        return {t.version for t in self.turns if t.source == MODEL}

    @property
    def text(self) -> str:
        """The model's turns' text, joined: the completion a text reward function reads."""
        return "".join(t.text for t in self.turns if t.source == MODEL)

    def metrics(self) -> dict[str, float]:
        """Counters for the iteration's metrics (summed or averaged over episodes by the caller)."""
        return {"episode/model_tokens": self.num_model_tokens, "episode/env_tokens": self.num_env_tokens,
                "episode/turns": self.num_turns, "episode/tool_calls": self.tool_calls,
                "episode/bad_calls": self.bad_calls, "episode/tool_errors": self.tool_errors,
                "episode/feedback_turns": self.feedback_turns, "episode/truncated": float(self.truncated is not None),
                "episode/failed": float(self.failure is not None)}
