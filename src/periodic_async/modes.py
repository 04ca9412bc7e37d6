"""What differs between the training modes, as small named pieces of one loop.

The iteration loop (`pipeline.run`, the paper's Figure 1) is the same for every mode:

    mode.begin(producer, first, last)                 # the first generation
    for t in first .. last-1:
        groups = mode.groups(producer, t)              # what the trainer consumes, in which order
        consumer.train_iteration(groups, t, mode.sampled_by(t))   # one optimizer step
        mode.before_barrier(producer, t)
        barrier: push version t+1 to every engine
        mode.after_barrier(producer, t + 1)            # the next generation

A mode decides three things only:
    order       completion order (streamed while generating) or dataset order (whole batch)
    sampled_by  the policy version that sampled iteration t's groups (the consumer refuses
                any other): t for the on-policy modes, t-1 for the one-step-off-policy mode
    prefetch    whether the engines generate the next iteration's batch during training

    sync-colocated / sync-separated   dataset order, sampled_by t, no prefetch (Figure 1a)
    periodic-async                     completion order, sampled_by t, no prefetch (Figure 1b)
    async-offpolicy                    dataset order, sampled_by t-1, prefetch: while the
                                       trainer trains on batch t (sampled by theta_{t-1}) the
                                       engines generate batch t+1 with theta_t (verl's one-step-off
                                       trainer, AReaL with staleness 1). What the paper argues
                                       against; here as the measured baseline.

In the off-policy mode the trainer's old log-probs are the engines' behaviour log-probs
(PPO's old policy is the policy that sampled), so the importance ratio and its clip
fraction show the staleness. Resuming it restarts the prefetch: the first resumed
iteration is sampled by the resumed weights (staleness 0 once), so a resumed off-policy run
is not bitwise the uninterrupted one; the on-policy modes are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, get_args

from periodic_async.config import Mode, SyncMode
from periodic_async.group import Group

if TYPE_CHECKING:  # for annotations only: producer and consumer stand side by side (the paper's Figure 1)
    from periodic_async.producer import Producer


class OnPolicy:
    """Generate iteration t with version t after the barrier; train on it; no prefetch."""

    def begin(self, producer: Producer, first: int, last: int) -> None:
        self.last = last
        if first < last:
            producer.start(first)

    def groups(self, producer: Producer, iteration: int) -> Iterable[Group]:
        return sorted(producer.stream(), key=lambda g: g.timings["position"])

    def sampled_by(self, iteration: int) -> int:
        return iteration

    def before_barrier(self, producer: Producer, iteration: int) -> None:
        pass

    def after_barrier(self, producer: Producer, next_iteration: int) -> None:
        if next_iteration < self.last:
            producer.start(next_iteration)


class Synchronous(OnPolicy):
    """sync-colocated and sync-separated: the trainer waits for the whole batch, dataset order."""


class PeriodicAsync(OnPolicy):
    """The paper's mode: the trainer takes groups in completion order while the rest generate."""

    def groups(self, producer: Producer, iteration: int) -> Iterable[Group]:
        return producer.stream()


class OneStepOffPolicy(OnPolicy):
    """async-offpolicy: batch t+1 is generated with theta_t while the trainer trains on batch t."""

    def begin(self, producer: Producer, first: int, last: int) -> None:
        super().begin(producer, first, last)
        self.first = first
        self.prefetched: list[Group] = []

    def groups(self, producer: Producer, iteration: int) -> Iterable[Group]:
        if iteration == self.first:  # nothing prefetched yet: wait for batch `first`, then prefetch
            batch = super().groups(producer, iteration)
            if iteration + 1 < self.last:
                producer.start(iteration + 1)
            return batch
        return self.prefetched

    def sampled_by(self, iteration: int) -> int:
        return iteration if iteration == self.first else iteration - 1

    def before_barrier(self, producer: Producer, iteration: int) -> None:
        # The engines must finish the prefetched batch before they take new weights.
        self.prefetched = super().groups(producer, iteration + 1) if iteration + 1 < self.last else []

    def after_barrier(self, producer: Producer, next_iteration: int) -> None:
        if next_iteration + 1 < self.last:
            producer.start(next_iteration + 1)


def make_mode(name: Mode) -> OnPolicy:
    """The mode object of `pipeline.mode`."""
    if name in get_args(SyncMode):
        return Synchronous()
    if name == "periodic-async":
        return PeriodicAsync()
    if name == "async-offpolicy":
        return OneStepOffPolicy()
    raise ValueError(f"pipeline.mode={name!r}: expected sync-colocated, sync-separated, periodic-async "
                     "or async-offpolicy")
