"""A random micro-batch for the cost benchmarks of the trainer (experiments/trimodel_cost.py,
experiments/lora_trimodel.py): `groups` groups of `group_size` responses, each group one prompt.

    inputs = make_micro_batch(vocab, groups=2, group_size=4, prompt_len=128, response_len=64).build(shared=True)

Token ids are drawn from [4, vocab) (above the special tokens), rewards from {0, 1}, advantages
as GRPO computes them; the old log-probs are placeholders (-1). The same seed, the same batch.
"""

from __future__ import annotations

import random

from periodic_async import grpo
from periodic_async.batching import GroupSlice, MicroBatch
from periodic_async.group import Group


def make_micro_batch(vocab: int, groups: int, group_size: int, prompt_len: int, response_len: int,
                     seed: int = 0) -> MicroBatch:
    """B=`groups` prompts of P=`prompt_len` tokens, G=`group_size` responses of R=`response_len` tokens each."""
    rng = random.Random(seed)
    slices = []
    for b in range(groups):
        responses = [[rng.randrange(4, vocab) for _ in range(response_len)] for _ in range(group_size)]
        rewards = [float(rng.randint(0, 1)) for _ in range(group_size)]
        g = Group(b, 0, 0, [rng.randrange(4, vocab) for _ in range(prompt_len)], responses,
                  [[-1.0] * response_len] * group_size, rewards, grpo.group_advantages(rewards).tolist())
        slices.append(GroupSlice(g, tuple(range(group_size))))
    return MicroBatch(slices)
