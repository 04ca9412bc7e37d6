"""A group of finished episodes as the trainer consumes it: one shared prompt, G responses, a loss mask.

The tri-model scores whole episodes with shared-prompt packing (`shared_prompt.pack`): the
group's shared prompt is the longest common prefix of its G episodes' ids (the whole prompt
when every reset() said the same; shorter when they differed), and each episode's response is
the rest of its ids: any prompt ids past the shared prefix, then its turns. Environment tokens
stay in the response, so later model tokens attend to them, but their loss mask is 0: they are
out of the loss and get no gradient (tests/test_episode_pack.py). In `pack`'s flat label order
(group by group, response by response, token by token) the mask is `loss_mask_N`, which
multiplies the token weights of the GRPO loss; behaviour log-probs are 0.0 at masked positions.

A failed episode is kept in the packing (its G-slot) with its whole mask 0 (`exclude_failed`),
so it takes no part in the loss; each response keeps at least one token (the shared prefix
stops one token short of the shortest episode), masked when it is not a model token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from periodic_async.episode.record import Episode
from periodic_async.shared_prompt import Segment


@dataclass
class EpisodeGroup:
    prompt_ids: list[int]
    """P shared ids: the longest common prefix of the episodes' prompts (cut to leave each >= 1 more id)."""
    response_ids: list[list[int]]
    """G responses: each episode's ids after the shared prefix (R_i >= 1)."""
    loss_mask: list[list[int]]
    """G lists of R_i: 1 on model tokens, 0 on environment tokens (and on a failed episode's)."""
    behaviour_logprobs: list[list[float]]
    """G lists of R_i: the engine's log-prob of each model token, 0.0 where the mask is 0."""

    def segment(self) -> Segment:
        return self.prompt_ids, self.response_ids

    @property
    def num_loss_tokens(self) -> list[int]:
        """G: the tokens of each response that carry a loss (its length for seq-mean normalisation)."""
        return [sum(m) for m in self.loss_mask]


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = seqs[0][i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def episode_group(episodes: Sequence[Episode], exclude_failed: bool = True) -> EpisodeGroup:
    """The trainer's view of one group's episodes (module docstring)."""
    if not episodes:
        raise ValueError("episode_group: no episodes")
    ids = [ep.token_ids for ep in episodes]
    # never past a prompt (model tokens all G episodes share stay in the loss), and >= 1 token each left
    p = min(_common_prefix(ids), min(len(ep.prompt_ids) for ep in episodes), min(len(s) for s in ids) - 1)
    if p < 1:
        raise ValueError("episode_group: the episodes share no prompt token")
    responses, masks, logprobs = [], [], []
    for ep, full in zip(episodes, ids):
        extra = len(ep.prompt_ids) - p  # this episode's prompt ids past the shared prefix
        mask = [0] * extra + ep.loss_mask
        lps = [0.0] * extra + ep.logprobs
        if exclude_failed and ep.failure is not None:
            mask = [0] * len(mask)
        responses.append(full[p:])
        masks.append(mask)
        logprobs.append([lp if m else 0.0 for lp, m in zip(lps, mask)])
    return EpisodeGroup(ids[0][:p], responses, masks, logprobs)


def loss_mask_N(groups: Sequence[EpisodeGroup], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The loss mask in `shared_prompt.pack([g.segment() for g in groups])`'s flat label order. (N,)"""
    return torch.tensor([m for g in groups for mask in g.loss_mask for m in mask], dtype=dtype)
