"""Trainer ranks over torch.distributed: data parallel (DDP-style) or FSDP2, streaming kept exact.

Launch (one node, N devices; several nodes: docs/scaling.md)::

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
- Checkpoints (checkpoint.py) are those of a single process, whatever N and the layout: every
  rank takes part in each save (`trainer.save_every`, the end) at the same point of the loop.
  Under fsdp the whole policy and optimizer state is gathered to rank 0's CPU
  (`get_model_state_dict` / `get_optimizer_state_dict`, full_state_dict + cpu_offload; the
  optimizer state re-keyed by parameter index, tied weights once, as `save_pretrained` writes
  them); under ddp rank 0 holds it whole already. Rank 0 alone writes, and the other ranks wait
  until `checkpoint-<t>` is complete and renamed, or raise what rank 0 raised (`from_main`):
  no rank runs ahead of a checkpoint. A resume is loaded by every rank: rank 0 reads the files
  (only rank 0 needs the output directory) and `set_model_state_dict` /
  `set_optimizer_state_dict` (full_state_dict + broadcast_from_rank0) hand each rank its part;
  the scheduler state and the version travel with one broadcast. So a checkpoint written by N
  ranks (ddp or fsdp) resumes in one process, and one written by one process resumes on N
  ranks (tests/test_distributed.py: the same tokens and weights as the uninterrupted run). The RNG
  state saved and restored is rank 0's: rank 0 alone samples (producer, engines); the other
  ranks draw no random numbers. The reference is never saved: every rank rebuilds it from the
  initial weights. After a failure only ddp's rank 0 saves (alone: it holds the whole state);
  under fsdp a gather would need ranks that may never join it, so nothing is saved and the
  newest `trainer.save_every` checkpoint stays the last good one.
- Backend from the device: gloo on CPU, nccl on CUDA, hccl on NPU (torch_npu). Only gloo is
  exercised here (no GPU/NPU on the CI machine).
"""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from periodic_async.config import UserError
from periodic_async.group import Group
from periodic_async.model import resolve_device

BUCKET_BYTES = 32 << 20
"""Gradients are all-reduced in flat buffers of at most this many bytes (one per dtype run)."""
METRIC_SUMS = ("loss", "kl", "clip", "ratio", "ratio_dev", "entropy", "behaviour_gap")
"""The `LossAccumulator` sums every rank reduces, in this order (a rank without groups has none)."""
DRAIN_S = 0.1
"""Ranks.close: how long the collectives' worker threads get the GIL to release their tensors."""
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
        """All ranks begin at rank 0's iteration: a check (the weights came from rank 0 through
        `layout`, a resume through `checkpoint.resume`, which every rank joins). Returns it."""
        if not self.distributed:
            return start_iteration
        at = torch.tensor([start_iteration, -start_iteration], dtype=torch.float64, device=self.device_type)
        dist.all_reduce(at, op=dist.ReduceOp.MAX)
        if at[0].item() != -at[1].item():
            raise RuntimeError(f"rank {self.rank}: the ranks start at different iterations "
                               f"({-at[1].item():.0f} to {at[0].item():.0f}): all must resume the same checkpoint")
        return start_iteration

    def from_main(self, fn):
        """`fn()` run on rank 0, its (picklable) result returned on every rank, which waits for
        it: a barrier behind rank 0's work. What `fn` raises on rank 0 is raised there, and on
        the other ranks as a RuntimeError naming it. A single process just calls `fn`."""
        if not self.distributed:
            return fn()
        box, error = [None], None
        if self.is_main:
            try:
                box = [(True, fn())]
            except BaseException as e:  # noqa: BLE001 - the other ranks must not wait forever
                error, box = e, [(False, f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        ok, value = box[0]
        if not ok:
            raise RuntimeError(f"rank {self.rank}: rank 0 failed: {value}")
        return value

    # --- checkpoints: the whole state on rank 0, and back to every rank ---------------------------

    def checkpoint_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """(weights, optimizer state) whole, in a single process's format, on rank 0; (None, None)
        on the other ranks. weights None on rank 0: `model.state_dict()` is whole (one process,
        ddp). fsdp: gathered to rank 0's CPU, one tensor at a time (a collective: every rank
        calls it), tied weights once; the optimizer state keyed by parameter index."""
        if not self.lockstep:
            return None, (optimizer.state_dict() if self.is_main else None)
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        # Before the first step there is no state to gather (and get_optimizer_state_dict would
        # create some with a zero-lr step, which counts as a step for Adam's bias correction).
        optim = get_optimizer_state_dict(model, optimizer, options=options) if optimizer.state else None
        if not self.is_main:
            return None, None
        aliases = _aliases(model)
        weights = {k: v for k, v in weights.items() if k not in aliases}
        return weights, (optimizer.state_dict() if optim is None else _by_index(optim, _param_names(model, optimizer)))

    def load_checkpoint_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              weights: dict | None, optimizer_state: dict | None,
                              trainable_only: bool = False) -> None:
        """Every rank: load rank 0's whole `weights` (tied weights may appear once, as in a
        safetensors checkpoint) and `optimizer_state` (keyed by parameter index, as
        `optimizer.state_dict()`) into this rank's model and optimizer, each rank taking its
        part (ddp: all of it); the other ranks pass None. A collective. `trainable_only` (LoRA):
        `weights` holds the trainable parameters (the adapters) alone; the frozen rest stays."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        names = _param_names(model, optimizer)

        def check() -> bool:
            nonlocal weights, optimizer_state
            weights = dict(weights)
            for alias, name in _aliases(model).items():
                if alias not in weights and name in weights:
                    weights[alias] = weights[name]
            expected = ({n for n, p in model.named_parameters() if p.requires_grad} if trainable_only
                        else set(model.state_dict()))
            missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
            if missing or unexpected:
                raise ValueError(f"the checkpoint's weights do not fit the policy: missing {missing}, "
                                 f"unexpected {unexpected}")
            indices = {i for g in optimizer_state["param_groups"] for i in g["params"]}
            if len(indices) != len(names):
                raise ValueError(f"the checkpoint's optimizer state has {len(indices)} parameters, "
                                 f"the policy {len(names)}")
            optimizer_state = _by_name(optimizer_state, names)
            return bool(optimizer_state["state"])

        has_state = self.from_main(check)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not trainable_only)
        set_model_state_dict(model, weights if self.is_main else {}, options=options)
        if has_state:  # else the fresh optimizer is the saved one (a checkpoint before any step)
            set_optimizer_state_dict(model, optimizer, optimizer_state if self.is_main else {}, options=options)

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

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
            # A gloo worker thread may still hold the last reference to a tensor of the last
            # collective, and releasing it takes the GIL. Should the interpreter start finalizing
            # before that thread gets the GIL, the thread is stopped inside a destructor and the
            # process aborts ("terminate called without an active exception") after a run that
            # succeeded. Sleeping hands the GIL over while the interpreter is whole.
            time.sleep(DRAIN_S)


def init_ranks(cfg) -> Ranks:
    """`Ranks()` in a single process; under torchrun (WORLD_SIZE > 1) join the default process
    group with the device's backend and pin this rank's accelerator (LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()

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


WRITE_TIMEOUT_S = 1800.0
"""How long a rank waits for rank 0's writes in `on_main_process` (transformers' ddp_timeout default)."""
_WRITES = itertools.count()  # every rank makes the same calls in the same order: the n-th is one key


def on_main_process(write: Callable[[], None], what: str) -> None:
    """`write()` on the main process only (rank 0); under torchrun (WORLD_SIZE > 1) the other
    ranks wait until it is done, and raise a UserError naming `what` if it failed. They wait on
    torchrun's rendezvous store (MASTER_ADDR:MASTER_PORT), which is there before a run joins the
    process group and after the run closes it. Every rank makes the same calls in the same order."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        write()
        return
    store = _connect()
    store.set_timeout(datetime.timedelta(seconds=WRITE_TIMEOUT_S))
    key, rank = f"on_main_process/{next(_WRITES)}", int(os.environ.get("RANK", "0"))
    if rank == 0:
        try:
            write()
        except BaseException as e:
            store.set(key, f"{type(e).__name__}: {e}")
            raise
        store.set(key, "")
        return
    error = store.get(key).decode()  # blocks until rank 0 has set it
    if error:
        raise UserError(f"rank {rank}: rank 0 failed to {what}: {error}")


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



def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its order (= the index
    `optimizer.state_dict()` gives it)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """{second name: first name} of the parameters registered twice (tied embeddings: lm_head.weight
    -> model.embed_tokens.weight), the names `save_pretrained` leaves out."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _by_index(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter name (torch.distributed.checkpoint's) keyed by
    index instead (`optimizer.state_dict()`'s), `names` giving the order."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def _by_name(state: dict, names: list[str]) -> dict:
    """The inverse of `_by_index`."""
    return {"state": {names[int(i)]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
