"""Micro-batching: the token budget holds, every sample is trained exactly once, streaming
gives the same micro-batches as the whole list, and the flat tensors line up with `pack`."""

import random

import pytest
import torch

from periodic_async.batching import GroupSlice, MicroBatch, MicroBatcher, split_groups
from periodic_async.group import Group
from periodic_async.shared_prompt import pack


def make_groups(rng: random.Random, num: int, g_max: int = 5, p_max: int = 12, r_max: int = 9) -> list[Group]:
    groups = []
    for b in range(num):
        G = rng.randint(1, g_max)
        responses = [[rng.randrange(4, 400) for _ in range(rng.randint(1, r_max))] for _ in range(G)]
        groups.append(Group(
            prompt_index=b, iteration=0, version=0,
            prompt_ids=[rng.randrange(4, 400) for _ in range(rng.randint(1, p_max))],
            response_ids=responses,
            behaviour_logprobs=[[-rng.random() for _ in r] for r in responses],
            rewards=[float(rng.randint(0, 1)) for _ in range(G)],
            advantages=[rng.uniform(-2, 2) for _ in range(G)],
        ))
    return groups


def covered(mbs: list[MicroBatch]) -> list[tuple[int, int]]:
    return [(s.group.prompt_index, i) for mb in mbs for s in mb.slices for i in s.samples]


@pytest.mark.parametrize("shared", [True, False])
def test_token_budget_respects_budget_and_covers_each_sample_once(shared):
    """Every (group, sample) appears exactly once, in arrival order; a micro-batch exceeds
    the budget only if it is a single sample; the packed row is never longer than the cost."""
    rng = random.Random(0)
    cut_seen = False
    for trial in range(30):
        groups = make_groups(rng, rng.randint(1, 8))
        budget = rng.choice([1, 8, 15, 25, 40, 80, 1000])
        mbs = split_groups(groups, max_tokens=budget, shared=shared)
        expected = [(g.prompt_index, i) for g in groups for i in range(g.size)]
        assert covered(mbs) == expected
        for mb in mbs:
            cost = mb.num_packed_tokens(shared)
            assert cost <= budget or mb.num_samples == 1, (budget, cost)
            assert pack(mb.segments(), shared=shared).num_tokens <= cost
            assert len({id(s.group) for s in mb.slices}) == len(mb.slices)  # a group once per micro-batch
        parts = {}
        for mb in mbs:
            for s in mb.slices:
                parts[s.group.prompt_index] = parts.get(s.group.prompt_index, 0) + 1
        cut_seen |= any(n > 1 for n in parts.values())
    assert cut_seen, "no trial cut a group: the test does not exercise sample granularity"


def test_budget_is_filled_greedily():
    """A hand case: P=10, four responses of 5 tokens, budget 20 (shared): [P+5+5], [P+5+5]."""
    g = Group(0, 0, 0, list(range(4, 14)), [[4] * 5] * 4, [[-1.0] * 5] * 4, [0.0] * 4, [0.0] * 4)
    mbs = split_groups([g], max_tokens=20, shared=True)
    assert [[s.samples for s in mb.slices] for mb in mbs] == [[(0, 1)], [(2, 3)]]
    assert [mb.num_packed_tokens(True) for mb in mbs] == [20, 20]
    # whole group, shared: the cost is Group.num_packed_tokens
    assert GroupSlice(g, (0, 1, 2, 3)).num_packed_tokens(True) == g.num_packed_tokens(True) == 30
    assert GroupSlice(g, (0, 1, 2, 3)).num_packed_tokens(False) == g.num_packed_tokens(False) == 60
    # without sharing each sample pays its prompt: 15 tokens, one sample per micro-batch
    assert [mb.num_samples for mb in split_groups([g], max_tokens=20, shared=False)] == [1, 1, 1, 1]


def test_fixed_groups_per_micro_batch():
    """micro_batch_tokens == 0: whole groups, `groups` per micro-batch, the remainder last."""
    groups = make_groups(random.Random(2), 7)
    mbs = split_groups(groups, max_tokens=0, groups_per_micro_batch=3)
    assert [len(mb.slices) for mb in mbs] == [3, 3, 1]
    assert all(s.samples == tuple(range(s.group.size)) for mb in mbs for s in mb.slices)
    assert covered(mbs) == [(g.prompt_index, i) for g in groups for i in range(g.size)]


@pytest.mark.parametrize("max_tokens,groups", [(30, 1), (0, 2)])
def test_streaming_equals_whole_list(max_tokens, groups):
    """Feeding groups one at a time (+ flush) yields the micro-batches of `split_groups`,
    and each micro-batch is released as soon as it is full (before the flush)."""
    groups_list = make_groups(random.Random(3), 9)
    batcher = MicroBatcher(max_tokens, groups, shared=True)
    streamed, released_before_flush = [], 0
    for g in groups_list:
        ready = batcher.add(g)
        released_before_flush += len(ready)
        streamed += ready
    streamed += batcher.flush()
    assert batcher.flush() == []
    whole = split_groups(groups_list, max_tokens, groups, shared=True)
    assert [[(s.group.prompt_index, s.samples) for s in mb.slices] for mb in streamed] == \
           [[(s.group.prompt_index, s.samples) for s in mb.slices] for mb in whole]
    assert released_before_flush >= len(whole) - 1


@pytest.mark.parametrize("shared", [True, False])
def test_build_lays_out_tensors_in_pack_order(shared):
    """advantages_N / behaviour_logp_N / lengths_S follow the flat label order of `pack`,
    also for a slice with non-contiguous, reordered samples."""
    g1, g2 = make_groups(random.Random(4), 2, g_max=4)
    mb = MicroBatch([GroupSlice(g1, tuple(reversed(range(g1.size)))), GroupSlice(g2, (g2.size - 1,))])
    inp = mb.build(shared=shared, dtype=torch.float64)
    order = [(g1, i) for i in reversed(range(g1.size))] + [(g2, g2.size - 1)]
    assert inp.num_samples == len(order)
    assert inp.lengths_S.tolist() == [len(g.response_ids[i]) for g, i in order]
    assert inp.packed.labels_N.tolist() == [t for g, i in order for t in g.response_ids[i]]
    assert inp.advantages_N.tolist() == [g.advantages[i] for g, i in order for _ in g.response_ids[i]]
    assert inp.behaviour_logp_N.tolist() == [x for g, i in order for x in g.behaviour_logprobs[i]]
    assert inp.advantages_N.dtype == torch.float64 and inp.num_tokens == mb.num_response_tokens
