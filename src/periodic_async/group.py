"""`Group`: the whole producer -> consumer contract (one prompt, its G responses, their scores).

The producer builds a Group when the last of its G samples finishes; the consumer trains
on it. `version` is the policy version that sampled every response: the consumer refuses
a group whose version is not the current one (the paper's on-policy guarantee).
Response token lists include the final eos token when the sample stopped on it.

An episode (multi-turn, with tools: episode/) is a response too: its model turns and the
environment's turns between them, as ids. `loss_mask` then says which tokens the model sampled
(1) and which the environment wrote (0): environment tokens are in the context and out of the
loss (batching.py lays the mask out, trimodel.py multiplies the token weights by it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Group:
    prompt_index: int
    """Index of the prompt's example in the training set."""
    iteration: int
    """Iteration that requested this group."""
    version: int
    """Policy version (weights) that sampled every response."""
    prompt_ids: list[int]
    """P prompt tokens (chat template applied)."""
    response_ids: list[list[int]]
    """G responses, each R_i >= 1 tokens."""
    behaviour_logprobs: list[list[float]]
    """Per-token log-probs of the sampling engine (G lists of R_i)."""
    rewards: list[float]
    """G scalar rewards."""
    advantages: list[float]
    """G group-normalised advantages (one per response, broadcast over its tokens)."""
    texts: list[str] = field(default_factory=list)
    """G decoded responses."""
    finish_reasons: list[str] = field(default_factory=list)
    """G reasons: 'stop' (eos / stop string) or 'length'."""
    answer: str = ""
    """Ground-truth answer of the prompt."""
    correct: list[float] = field(default_factory=list)
    """G correctness scores (1.0 / 0.0), for accuracy metrics; the reward may differ."""
    timings: dict[str, float] = field(default_factory=dict)
    """Wall-clock stamps (time.time()) and durations of the group's life: submitted, finished, scored."""
    loss_mask: list[list[int]] | None = None
    """Episodes: G lists of R_i, 1 on model tokens, 0 on environment tokens (behaviour log-prob 0.0
    there); None: every token is the model's (single-turn)."""
    episode_counts: dict[str, float] = field(default_factory=dict)
    """Episodes: the sums of `Episode.metrics()` over the G episodes, with `episode/episodes` (G) and
    `episode/used_tools` (episodes that called a tool); empty for single-turn groups."""

    def __post_init__(self) -> None:
        g = len(self.response_ids)
        if g == 0:
            raise ValueError(f"group of prompt {self.prompt_index}: no responses")
        for name in ("behaviour_logprobs", "rewards", "advantages"):
            if len(getattr(self, name)) != g:
                raise ValueError(f"group of prompt {self.prompt_index}: {name} has "
                                 f"{len(getattr(self, name))} entries for {g} responses")
        if any(len(r) == 0 for r in self.response_ids):
            raise ValueError(f"group of prompt {self.prompt_index}: an empty response")
        lengths = [len(r) for r in self.response_ids]
        if self.loss_mask is not None and [len(m) for m in self.loss_mask] != lengths:
            raise ValueError(f"group of prompt {self.prompt_index}: loss_mask lengths "
                             f"{[len(m) for m in self.loss_mask]} != response lengths {lengths}")

    @property
    def size(self) -> int:
        """G."""
        return len(self.response_ids)

    @property
    def num_response_tokens(self) -> int:
        """sum_i R_i: the response tokens (the model's and, in episodes, the environment's)."""
        return sum(len(r) for r in self.response_ids)

    def num_loss_tokens_of(self, i: int) -> int:
        """Tokens of response i that carry a loss: its model tokens (R_i without a mask)."""
        return len(self.response_ids[i]) if self.loss_mask is None else sum(self.loss_mask[i])

    @property
    def num_loss_tokens(self) -> int:
        """The tokens that carry a loss: sum_i R_i, model tokens only in episodes."""
        return sum(self.num_loss_tokens_of(i) for i in range(self.size))

    def num_packed_tokens(self, shared_prompt: bool) -> int:
        """Input tokens of this group once packed: P + sum R_i (shared) or G*P + sum R_i."""
        p = len(self.prompt_ids)
        return (p if shared_prompt else self.size * p) + self.num_response_tokens
