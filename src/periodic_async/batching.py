"""Micro-batches from groups: by packed-token budget (dynamic) or by a fixed number of groups.

A micro-batch is a list of `GroupSlice`s (a group and some of its sample indices). With a
token budget the unit is the *sample*, so a large group may be cut across micro-batches;
each part then repeats its prompt (the cost is counted). Cutting a group is harmless for
the loss: advantages were computed per group before packing, and the GRPO normalisation
is applied once per iteration (grpo.py), so the iteration's gradient does not depend on
where the cuts fall.

Packed cost, as `Group.num_packed_tokens`: a slice of k samples costs P + sum R_i with the
shared-prompt layout, k * P + sum R_i without. (The packed row holds one token fewer per
sample, since a response's last token is not fed; the budget is therefore an upper bound.)
A micro-batch exceeds the budget only when a single sample alone does.

Streaming (the consumer receives groups one at a time)::

    batcher = MicroBatcher.from_config(cfg.algorithm)
    for group in stream:                       # completion order
        for mb in batcher.add(group):          # zero or more full micro-batches
            tri.micro_step(mb.build(shared=cfg.algorithm.shared_prompt), acc)
    for mb in batcher.flush():                 # the iteration's last, partial one
        ...

`split_groups(groups, ...)` is the same on a complete list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from periodic_async.group import Group
from periodic_async.shared_prompt import PackedBatch, Segment, pack


@dataclass(frozen=True)
class GroupSlice:
    group: Group
    samples: tuple[int, ...]
    """Indices (into group.response_ids) of the samples in this slice, in packing order."""

    @property
    def num_response_tokens(self) -> int:
        return sum(len(self.group.response_ids[i]) for i in self.samples)

    def num_packed_tokens(self, shared: bool) -> int:
        p = len(self.group.prompt_ids)
        return (p if shared else len(self.samples) * p) + self.num_response_tokens

    def segment(self) -> Segment:
        return self.group.prompt_ids, [self.group.response_ids[i] for i in self.samples]


@dataclass
class MicroBatchInputs:
    """Everything one micro-step needs, in the flat label order of `packed` (S samples, N tokens)."""

    packed: PackedBatch
    advantages_N: torch.Tensor
    """The advantage of each label's sample."""
    behaviour_logp_N: torch.Tensor
    """Log-probs the sampling engine reported (for engine/trainer mismatch metrics)."""
    lengths_S: torch.Tensor
    """The loss tokens of each sample (long): R_i, or its model tokens in an episode (at least 1:
    seq-mean divides by it; a failed episode's mask is all 0)."""
    loss_mask_N: torch.Tensor | None = None
    """Episodes: 1 on model tokens, 0 on environment tokens (float); None: every token is the model's."""

    @property
    def num_tokens(self) -> int:
        """The tokens that carry a loss (the token-mean normaliser counts these)."""
        if self.loss_mask_N is not None:
            return int(self.loss_mask_N.sum())
        return int(self.packed.labels_N.shape[0])

    @property
    def num_samples(self) -> int:
        return self.packed.num_samples

    def to(self, device: torch.device | str) -> "MicroBatchInputs":
        return MicroBatchInputs(self.packed.to(device), self.advantages_N.to(device),
                                self.behaviour_logp_N.to(device), self.lengths_S.to(device),
                                None if self.loss_mask_N is None else self.loss_mask_N.to(device))


@dataclass
class MicroBatch:
    slices: list[GroupSlice] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(len(s.samples) for s in self.slices)

    @property
    def num_response_tokens(self) -> int:
        return sum(s.num_response_tokens for s in self.slices)

    def num_packed_tokens(self, shared: bool) -> int:
        return sum(s.num_packed_tokens(shared) for s in self.slices)

    def segments(self) -> list[Segment]:
        return [s.segment() for s in self.slices]

    def build(self, shared: bool = True, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> MicroBatchInputs:
        """Pack the slices (`shared_prompt.pack`) and lay out advantages / lengths / behaviour
        log-probs (and, when a group has one, the loss mask) in the same flat order; float
        tensors in `dtype`."""
        packed = pack(self.segments(), shared=shared)
        adv_S, lengths_S, behaviour, mask = [], [], [], []
        masked = any(s.group.loss_mask is not None for s in self.slices)
        for s in self.slices:
            for i in s.samples:
                adv_S.append(s.group.advantages[i])
                lengths_S.append(max(1, s.group.num_loss_tokens_of(i)))
                behaviour.extend(s.group.behaviour_logprobs[i])
                if masked:
                    mask.extend(s.group.loss_mask[i] if s.group.loss_mask is not None
                                else [1] * len(s.group.response_ids[i]))
        adv_S_t = torch.tensor(adv_S, dtype=dtype)
        out = MicroBatchInputs(packed, adv_S_t[packed.sample_N], torch.tensor(behaviour, dtype=dtype),
                               torch.tensor(lengths_S, dtype=torch.long),
                               torch.tensor(mask, dtype=dtype) if masked else None)
        return out.to(device) if device is not None else out


class MicroBatcher:
    """Accepts groups one at a time; yields full micro-batches; `flush()` at iteration end.

    max_tokens > 0: token budget at sample granularity (a group may be cut);
    max_tokens == 0: `groups` whole groups per micro-batch.
    """

    def __init__(self, max_tokens: int = 0, groups: int = 1, shared: bool = True):
        if max_tokens < 0 or groups < 1:
            raise ValueError(f"MicroBatcher: max_tokens={max_tokens} must be >= 0, groups={groups} >= 1")
        self.max_tokens, self.groups, self.shared = max_tokens, groups, shared
        self._slices: list[GroupSlice] = []
        self._tokens = 0

    @classmethod
    def from_config(cls, cfg) -> "MicroBatcher":
        """From an `AlgorithmConfig` (micro_batch_tokens, micro_batch_groups, shared_prompt)."""
        return cls(cfg.micro_batch_tokens, cfg.micro_batch_groups, cfg.shared_prompt)

    def _close(self) -> MicroBatch:
        mb = MicroBatch(self._slices)
        self._slices, self._tokens = [], 0
        return mb

    def add(self, group: Group) -> list[MicroBatch]:
        """Take one group; return the micro-batches it completed (possibly none)."""
        out: list[MicroBatch] = []
        if self.max_tokens == 0:
            self._slices.append(GroupSlice(group, tuple(range(group.size))))
            if len(self._slices) >= self.groups:
                out.append(self._close())
            return out
        P = len(group.prompt_ids)
        current: list[int] = []  # samples of `group` in the open micro-batch
        for i, r in enumerate(group.response_ids):
            cost = len(r) + (0 if (current and self.shared) else P)
            if (self._slices or current) and self._tokens + cost > self.max_tokens:
                if current:
                    self._slices.append(GroupSlice(group, tuple(current)))
                    current = []
                out.append(self._close())
                cost = len(r) + P
            current.append(i)
            self._tokens += cost
            if self._tokens >= self.max_tokens:
                self._slices.append(GroupSlice(group, tuple(current)))
                current = []
                out.append(self._close())
        if current:
            self._slices.append(GroupSlice(group, tuple(current)))
        return out

    def flush(self) -> list[MicroBatch]:
        """The open, partial micro-batch (if any): call at the end of the iteration."""
        return [self._close()] if self._slices else []


def split_groups(groups: Sequence[Group], max_tokens: int = 0, groups_per_micro_batch: int = 1,
                 shared: bool = True) -> list[MicroBatch]:
    """Micro-batches of a complete list of groups, in order (see `MicroBatcher`)."""
    batcher = MicroBatcher(max_tokens, groups_per_micro_batch, shared)
    out = [mb for g in groups for mb in batcher.add(g)]
    return out + batcher.flush()
