"""Trainer ranks over torch.distributed: data parallel (DDP-style) or FSDP2, streaming kept exact.

Launch (one node, N devices; several nodes: README)::

    torchrun --nproc-per-node=N -m periodic_async train --config ...

Who does what. Rank 0 runs the producer and the engines and trains; every rank trains. Rank 0
hands the iteration's groups out through the rendezvous store torchrun already runs: its
dispatcher thread writes group k (in the order the mode gives them: completion order in
periodic-async) under the key `<t>/<k>` as it completes, and a rank that wants work claims the
next index with one atomic `store.add` and waits for that key; an index >= B ends the
iteration for that rank. So the groups are trained in completion order by whichever rank is
free, no collective waits on a group, and a slow rank (long responses) simply takes fewer.
Why one producer on rank 0 rather than one per rank on a shard of the prompts: the engines, the
request seeds and the dispatch stay those of the single-process run (the same tokens are
sampled whatever N is), the barrier pushes one set of weights to one set of engines, and a
static shard would make every rank wait for the slowest group of its own shard.

Guarantees:
- Every group of an iteration is trained exactly once, by one rank; the ranks together check
  that B groups arrived (all-reduced count).
- Exact streaming across ranks. Each rank backpropagates un-normalised loss sums (grpo.py) with
  no communication per micro-batch. After its last micro-batch it joins ONE collective step per
  iteration: the gradient sums (flat buckets, SUM) and the token / sequence / micro-batch
  counts and metric sums are all-reduced, then the normaliser is applied once
  (`LossAccumulator.finalize_gradients`): the update is the single-process one up to
  floating-point summation order (tests/test_distributed.py, fp64). A rank that took few
  groups, or none, gives zero gradients (every parameter gets a zero `.grad` first), so no
  rank waits on a collective that another never calls. Needs one optimizer step per iteration.
- FSDP2 (`trainer.parallel=fsdp`): policy, old and ref are laid out by the same function on the
  same mesh (`fully_shard` on each decoder layer, then the root), so every parameter has the
  same placement and local shard shape in the three models and `refresh_old` is a local copy
  (no communication). FSDP gathers parameters in every forward, so the ranks step their
  micro-batches in lock-step: before each micro-step they agree (a 1-element all-reduce)
  whether any rank still has work, and a rank without work runs a zero-weight micro-step.
  Gradients are reduce-scattered as sums in each backward; counts are all-reduced once.
  Under FSDP checkpoints are not written and resume is refused (not implemented).
- Backend from the device: gloo on CPU, nccl on CUDA, hccl on NPU (torch_npu). Only gloo is
  exercised here (no GPU/NPU on the CI machine).
"""

from __future__ import annotations

import datetime
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from periodic_async.group import Group

BUCKET_BYTES = 32 << 20
"""Gradients are all-reduced in flat buffers of at most this many bytes (one per dtype run)."""
METRIC_SUMS = ("loss", "kl", "clip", "ratio", "ratio_dev", "entropy", "behaviour_gap")
"""The `LossAccumulator` sums every rank reduces, in this order (a rank without groups has none)."""
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def backend_for(device: torch.device | str) -> str:
    """The process-group backend of a device type: gloo (cpu), nccl (cuda), hccl (npu)."""
    kind = torch.device(device).type
    if kind not in BACKENDS:
        raise ValueError(f"no torch.distributed backend for device {str(device)!r}: expected cpu, cuda or npu")
    return BACKENDS[kind]


@dataclass
class Ranks:
    """This process's place among the trainer ranks; `Ranks()` is a single process."""

    rank: int = 0
    world_size: int = 1
    parallel: str = "ddp"
    """'ddp' or 'fsdp' (trainer.parallel)."""
    store: object | None = None
    """A connection to the rendezvous store (a `torch.distributed.Store`) the groups travel through."""
    publish_store: object | None = None
    """Rank 0: a second connection, for the hand-out thread (a store connection serves one
    blocking call at a time: a claim waiting on it would hold back the publishing)."""
    device_type: str = "cpu"
    timeout_s: float = 600.0
    """How long a rank waits for a claimed group (engine.timeout_s plus a margin)."""
    groups_per_iteration: int = 0
    """B (algorithm.prompts_per_iteration): claims of index >= B end a rank's iteration."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def lockstep(self) -> bool:
        """FSDP across ranks: micro-steps are collective, so ranks take them in lock-step."""
        return self.distributed and self.parallel == "fsdp"

    # --- layout (the unified tri-model) ------------------------------------------------------

    def layout(self, model: torch.nn.Module) -> torch.nn.Module:
        """Lay `model` out for the ranks: rank 0's weights everywhere, then (fsdp) `fully_shard`
        each decoder layer and the root on one mesh. Applied alike to policy, old and ref."""
        if not self.distributed:
            return model
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        if self.parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import FSDPModule, fully_shard

            mesh = init_device_mesh(self.device_type, (self.world_size,))
            for module in model.modules():
                if type(module).__name__.endswith("DecoderLayer"):
                    fully_shard(module, mesh=mesh)
            # The root too reshards after its forward (FSDP2 would keep a root's weights gathered
            # until a backward that old and ref never run): every model stays sharded between steps.
            fully_shard(model, mesh=mesh, reshard_after_forward=True)
            for module in model.modules():  # sums, not means (the factor is per FSDP module):
                if isinstance(module, FSDPModule):  # the normaliser is applied once, later
                    module.set_gradient_divide_factor(1.0)
        return model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole state dict on every rank (fsdp: a collective gather; call it on every rank)."""
        state = model.state_dict()
        if not self.lockstep:
            return state
        return {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in state.items()}

    # --- one iteration's collectives --------------------------------------------------------

    def agree(self, has_work: bool) -> bool:
        """fsdp lock-step: True while any rank has a micro-batch left (every rank calls it once per round)."""
        flag = torch.tensor([1.0 if has_work else 0.0], device=self.device_type)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def reduce_iteration(self, params: Iterable[torch.nn.Parameter], acc, num_groups: int) -> int:
        """The iteration's one collective step: sum the un-normalised gradients (ddp; fsdp has
        reduce-scattered them in the backward passes), the counts and the metric sums of `acc`
        (updated in place) over the ranks. Returns the groups trained by all ranks together."""
        if not self.distributed:
            return num_groups
        if not self.lockstep:
            _all_reduce_gradients(params)
        ref = next(iter(acc.sums.values()), None)
        dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float64
        device = ref.device if ref is not None else torch.device(self.device_type)
        sums = [acc.sums.get(k, torch.zeros((), dtype=dtype, device=device)).to(torch.float64) for k in METRIC_SUMS]
        counts = [float(acc.num_tokens), float(acc.num_sequences), float(acc.num_micro_batches), float(num_groups)]
        flat = torch.cat([torch.stack(sums).to(device), torch.tensor(counts, dtype=torch.float64, device=device)])
        dist.all_reduce(flat)
        for i, k in enumerate(METRIC_SUMS):
            acc.sums[k] = flat[i].to(dtype)
        tokens, sequences, micro_batches, groups = (int(round(v)) for v in flat[len(METRIC_SUMS):].tolist())
        acc.num_tokens, acc.num_sequences, acc.num_micro_batches = tokens, sequences, micro_batches
        return groups

    def start(self, consumer, start_iteration: int) -> int:
        """All ranks begin where rank 0 does (after its resume): rank 0's weights, old copy,
        optimizer and scheduler state and version (ddp). Returns the first iteration."""
        if not self.distributed:
            return start_iteration
        box = [start_iteration]
        dist.broadcast_object_list(box, src=0)
        if self.parallel == "fsdp":
            if box[0] != 0:
                raise NotImplementedError("trainer.parallel=fsdp: resuming from a checkpoint is not implemented")
            return 0
        with torch.no_grad():
            for t in [*consumer.policy.parameters(), *consumer.policy.buffers()]:
                dist.broadcast(t.data, src=0)
        consumer.tri.refresh_old()
        state = [consumer.state_dict() if self.is_main else None]
        dist.broadcast_object_list(state, src=0)
        if not self.is_main:
            consumer.load_state_dict(state[0])
        consumer.version = box[0]
        return box[0]

    # --- the groups -----------------------------------------------------------------------

    def hand_out(self, received, iteration: int, version: int):
        """Rank 0: publish `received` (the mode's groups, a `pipeline._Received`) to the ranks and
        return what rank 0 itself trains: an iterable of its claims whose `.received` is every
        group of the iteration, in the mode's order. A single process gets `received` back."""
        if not self.distributed:
            return received
        return _HandOut(self, received, iteration, version)

    def claims(self, iteration: int) -> "_Claims":
        """The groups this rank trains in `iteration`, claimed one at a time; `.version` is the
        version rank 0 says sampled them."""
        return _Claims(self, iteration)

    def checkpoints(self, checkpoints):
        """What saves the run's checkpoints: rank 0's `checkpoint.Checkpoints` (ddp: rank 0 holds
        the whole state), nothing under fsdp (not implemented: weights and optimizer are sharded)."""
        if self.lockstep:
            print("[train] trainer.parallel=fsdp: checkpoints are not written (not implemented)")
            return _NoCheckpoints()
        return checkpoints

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def init_ranks(cfg) -> Ranks:
    """`Ranks()` in a single process; under torchrun (WORLD_SIZE > 1) join the default process
    group with the device's backend and pin this rank's accelerator (LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    from periodic_async.model import resolve_device

    if cfg.algorithm.optimizer_steps_per_iteration != 1:
        raise ValueError(f"algorithm.optimizer_steps_per_iteration={cfg.algorithm.optimizer_steps_per_iteration}: "
                         "trainer ranks take one optimizer step per iteration")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(local)
    elif device.type == "npu":
        torch.npu.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=cfg.engine.timeout_s + 300))
    rank = dist.get_rank()
    return Ranks(rank=rank, world_size=dist.get_world_size(), parallel=cfg.trainer.parallel,
                 store=_connect(), publish_store=_connect() if rank == 0 else None, device_type=device.type,
                 timeout_s=cfg.engine.timeout_s + 60, groups_per_iteration=cfg.algorithm.prompts_per_iteration)


def _connect():
    """A new client connection to the rendezvous store torchrun runs (MASTER_ADDR:MASTER_PORT)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master=False,
                          timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    return dist.PrefixStore("periodic_async/", store)


def _all_reduce_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """SUM every gradient over the ranks in flat buckets; a missing gradient is zeros first."""
    unique = list({id(p): p for p in params if p.requires_grad}.values())
    for p in unique:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    for g in [p.grad for p in unique] + [None]:
        if bucket and (g is None or g.dtype != bucket[0].dtype or g.device != bucket[0].device
                       or sum(b.numel() for b in bucket) * bucket[0].element_size() >= BUCKET_BYTES):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket = []
        if g is not None:
            bucket.append(g)


class _NoCheckpoints:
    def save(self, iteration: int) -> None:
        pass

    def every(self, completed: int) -> None:
        pass

    def after_failure(self) -> None:
        pass


class _Failed:
    """Written in place of the groups rank 0 could not publish: the other ranks raise it."""

    def __init__(self, message: str) -> None:
        self.message = message


class _Claims:
    """The groups one rank trains in an iteration, claimed from the store in completion order."""

    def __init__(self, ranks: Ranks, iteration: int) -> None:
        self.ranks, self.iteration = ranks, iteration
        self.store, self.prefix = ranks.store, f"{iteration}/"
        self.taken = 0
        """Groups this rank has claimed so far."""

    @property
    def version(self) -> int:
        return int(self._get("version"))

    def _get(self, key: str) -> bytes:
        self.store.wait([self.prefix + key], datetime.timedelta(seconds=self.ranks.timeout_s))
        return self.store.get(self.prefix + key)

    def __iter__(self) -> Iterator[Group]:
        while True:
            k = self.store.add(self.prefix + "claimed", 1) - 1
            if k >= self.ranks.groups_per_iteration:
                return
            item = pickle.loads(self._get(str(k)))
            self.store.delete_key(self.prefix + str(k))
            if isinstance(item, _Failed):
                self._failed(k, item)
            self.taken += 1
            yield item

    def _failed(self, k: int, item: _Failed) -> None:
        raise RuntimeError(f"iteration {self.iteration}: rank 0 could not hand out group {k}: {item.message}")


class _HandOut(_Claims):
    """Rank 0: a thread publishes the mode's groups as they come; rank 0 claims like the others."""

    def __init__(self, ranks: Ranks, received, iteration: int, version: int) -> None:
        super().__init__(ranks, iteration)
        self.source = received
        self._error: BaseException | None = None
        self.store.set(self.prefix + "version", str(version))
        self._thread = threading.Thread(target=self._publish, name=f"hand-out-{iteration}", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        k, store = 0, self.ranks.publish_store
        try:
            for group in self.source:
                store.set(self.prefix + str(k), pickle.dumps(group))
                k += 1
            if k < self.ranks.groups_per_iteration:
                raise RuntimeError(f"iteration {self.iteration}: the producer gave {k} groups, "
                                   f"expected {self.ranks.groups_per_iteration}")
        except BaseException as e:  # noqa: BLE001 - the other ranks must not wait forever
            self._error = e
            for j in range(k, self.ranks.groups_per_iteration):
                store.set(self.prefix + str(j), pickle.dumps(_Failed(f"{type(e).__name__}: {e}")))

    def _failed(self, k: int, item: _Failed) -> None:
        self._thread.join()
        raise self._error  # rank 0 raises what the producer raised

    @property
    def received(self) -> list[Group]:
        """Every group of the iteration, in the mode's order (once every rank has claimed)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.source.received


def follow(cfg, ranks: Ranks) -> dict:
    """The loop of ranks > 0: no engines, producer, books or checkpoints; the same collectives as
    rank 0's `pipeline.run`, in the same order (start, barrier weights, one reduction per iteration)."""
    from periodic_async.consumer import Consumer
    from periodic_async.model import load_policy

    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.model.seed)
    policy, _ = load_policy(cfg.model)
    consumer = Consumer(policy, cfg, ranks=ranks)
    taken = []
    try:
        start = ranks.start(consumer, 0)
        consumer.engine_state_dict()  # rank 0's first barrier (a gather under fsdp)
        for iteration in range(start, cfg.trainer.iterations):
            claims = ranks.claims(iteration)
            consumer.train_iteration(claims, iteration, claims.version)
            consumer.engine_state_dict()  # the barrier
            taken.append(claims.taken)
    finally:
        ranks.close()
    return {"rank": ranks.rank, "first_iteration": start, "groups_trained": taken}
