"""Weight sync by broadcast (`engine.weight_sync=collective`): the trainer and the Ray engine
workers join one process group, and the barrier broadcasts the weights as flat buckets.

The group: the trainer (the main trainer rank) is rank 0, worker w is rank w + 1. It is joined
once, when the engine starts (`CollectiveSync.attach`, called by `RayEngine`), through a
TCPStore the trainer hosts on a free port: reached at 127.0.0.1 with Ray on this machine alone
(started locally or joined at a loopback address: gloo then connects over the loopback), at the
trainer node's address (`ray.util.get_node_ip_address()`) when `engine.ray_address` names a
cluster of other machines. (torch's TCPStore server itself listens on every
interface; it holds only the group's rendezvous keys.) Backend from the trainer's device (`distributed.backend_for`):
gloo on CPU, nccl on CUDA, hccl on NPU; the workers' buffers live where that backend needs
them (host memory for gloo, the worker's accelerator for nccl/hccl).

The barrier:
    trainer  `publish(state_dict, version)` packs the tensors, whatever their dtype, byte-wise
             into flat uint8 buckets of at most `engine.weight_sync_bucket_mb` (each tensor at a
             64-byte aligned offset; a tied weight once), starts one broadcast per bucket and
             returns the layout (names, dtypes, shapes, offsets, and the other names of tied
             tensors: a few KiB) as the handle that Ray hands to every worker.
    worker   `receive(handle)` posts the matching broadcasts into buffers kept from the last
             sync (same layout: no allocation), waits, and returns views into them (a tied
             tensor under each of its names), which the worker loads into its model.
The broadcasts are asynchronous on the trainer: they complete while the workers receive them,
and `publish` waits for the previous barrier's before reusing its buffers. No pickling, no
numpy conversion, no object store; with nccl the weights go device to device.

nccl and hccl need one device per member of the group: the trainer and every worker on
accelerators of their own (checked by device uuid in `attach`, with an error that names who
shares which device; on a single GPU the object-store path is the one that works).

Not verified here: nccl and hccl (no accelerator on the CI machine); only gloo is tested
(tests/test_weight_sync.py). Worker restarts and elastic worker counts need a group of
changing size and are refused by the config (engine.weight_sync).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from periodic_async.config import ConfigError
from periodic_async.engine.base import WeightSync
from periodic_async.model import resolve_device
from periodic_async.parallel.distributed import backend_for

ALIGN = 64
"""Byte alignment of every tensor inside a bucket (a view of any dtype starts aligned)."""


def _process_group(store, rank: int, world_size: int, backend: str, timeout_s: float, host: str):
    """A process group outside the default one (the trainer ranks' group is another): the
    backend object itself, built on `store`. Blocks until all `world_size` members have joined.
    gloo's connections use the interface of `host` (the loopback for a local Ray cluster)."""
    prefix = dist.PrefixStore("weight_sync/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(prefix, rank, world_size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world_size, options)
    if backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(prefix, rank, world_size, options)
    raise ValueError(f"weight sync: no process-group backend {backend!r} (expected gloo, nccl or hccl)")


def _broadcast(group, buffer: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([buffer], opts)


def _accelerator_id(_actor=None, device: torch.device | None = None) -> str:
    """The physical id of `device` (a Ray worker: the first accelerator Ray gave it), which
    tells two processes on one GPU apart from two GPUs whatever each process calls its device."""
    if device is None or device.type == "cuda":
        return str(torch.cuda.get_device_properties(device if device is not None else 0).uuid)
    return f"{device.type}:{device.index or 0}@{os.uname().nodename}"  # NPU: no uuid in torch_npu


def _check_devices_apart(trainer_device: torch.device, worker_ids: list[str]) -> None:
    """nccl (and hccl) refuse two ranks of one group on one device ("Duplicate GPU detected"):
    say so before the group is formed, naming who shares what."""
    owners: dict[str, str] = {}
    for who, ident in [("the trainer", _accelerator_id(device=trainer_device))] + [
            (f"engine worker {w}", i) for w, i in enumerate(worker_ids)]:
        if ident in owners:
            raise ConfigError(
                f"engine.weight_sync=collective: {owners[ident]} and {who} are on the same accelerator ({ident}); "
                "nccl/hccl need one device per member of the group. Give each engine worker a device of its own "
                "(fewer workers, or more GPUs), or use engine.weight_sync=object_store, which works on one device.")
        owners[ident] = who


def _buffer_device(backend: str, device: torch.device) -> torch.device:
    return torch.device("cpu") if backend == "gloo" else device


def layout(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[dict]:
    """Buckets of (name, dtype, shape, offset) entries, each at most `bucket_bytes` (a larger
    tensor gets a bucket of its own); a tensor sharing another's storage (tied) is left out."""
    buckets, entries, size, seen = [], [], 0, set()
    for name, t in state_dict.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        nbytes = t.numel() * t.element_size()
        if entries and size + nbytes > bucket_bytes:
            buckets.append({"nbytes": size, "entries": entries})
            entries, size = [], 0
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), size))
        size += -(-nbytes // ALIGN) * ALIGN
    if entries:
        buckets.append({"nbytes": size, "entries": entries})
    return buckets


def aliases(state_dict: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """(name, the first name of the same tensor) for each tensor `layout` leaves out: a tied
    weight travels once and is handed to the worker under every name of the state dict (vLLM
    needs both names of a tied embedding: engine/vllm_engine.py)."""
    first: dict[tuple, str] = {}
    out = []
    for name, t in state_dict.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key in first:
            out.append((name, first[key]))
        else:
            first[key] = name
    return out


def _views(buffer: torch.Tensor, entries) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype, shape, offset in entries:
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        out[name] = buffer[offset:offset + n].view(dt).view(shape)
    return out


@dataclass
class CollectiveReceiver(WeightSync):
    """A worker's side: sent to the actor by `attach`, joined there with `join(device)`."""

    host: str
    port: int
    rank: int
    world_size: int
    backend: str
    timeout_s: float

    def join(self, device: torch.device) -> None:
        store = dist.TCPStore(self.host, self.port, None, is_master=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        self._group = _process_group(store, self.rank, self.world_size, self.backend, self.timeout_s, self.host)
        self._store, self._device = store, _buffer_device(self.backend, torch.device(device))
        self._key, self._buffers = None, []

    def publish(self, state_dict, version):
        raise RuntimeError("CollectiveReceiver: workers receive, the trainer publishes")

    def receive(self, handle) -> dict[str, torch.Tensor]:
        buckets = handle["buckets"]
        key = [(b["nbytes"], tuple(b["entries"])) for b in buckets]
        if key != self._key:  # first sync, or the layout changed: allocate once
            self._buffers = [torch.empty(b["nbytes"], dtype=torch.uint8, device=self._device) for b in buckets]
            self._key = key
        for work in [_broadcast(self._group, buf) for buf in self._buffers]:
            work.wait()
        out = {}
        for b, buf in zip(buckets, self._buffers):
            out.update(_views(buf, b["entries"]))
        for name, source in handle.get("aliases", []):
            out[name] = out[source]
        return out


class CollectiveSync(WeightSync):
    """The trainer's side: hosts the store, joins as rank 0, broadcasts at every barrier."""

    resizable = False  # the group is formed once, with the workers `attach` is given

    def __init__(self, backend: str, device: torch.device | str, bucket_bytes: int, timeout_s: float,
                 host: str | None = None) -> None:
        self.backend, self.bucket_bytes, self.timeout_s = backend, int(bucket_bytes), timeout_s
        self.host = host
        """Where the workers reach the trainer: None = this Ray node's address (a cluster)."""
        self.device = _buffer_device(backend, torch.device(device))
        self._group = None
        self._works: list = []
        self._key, self._buffers = None, []
        self.bytes_sent = 0
        """Bytes of the last barrier's buckets."""

    @classmethod
    def from_config(cls, engine_cfg, model_cfg) -> "CollectiveSync":
        device = resolve_device(model_cfg.device)
        host = "127.0.0.1" if engine_cfg.ray_on_this_machine else None  # a local Ray cluster stays on the loopback
        return cls(backend_for(device), device, engine_cfg.weight_sync_bucket_mb * 2**20, engine_cfg.timeout_s, host)

    def attach(self, workers: list) -> None:
        """Form the group with the started `workers` (Ray actor handles of `EngineWorker`)."""
        import ray

        host = self.host or ray.util.get_node_ip_address()
        if self.backend != "gloo":
            _check_devices_apart(self.device, ray.get([w.__ray_call__.remote(_accelerator_id) for w in workers],
                                                      timeout=self.timeout_s))
        self._store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
        world = len(workers) + 1
        joined = [w.set_weight_sync.remote(CollectiveReceiver(host, self._store.port, i + 1, world, self.backend,
                                                              self.timeout_s))
                  for i, w in enumerate(workers)]
        self._group = _process_group(self._store, 0, world, self.backend, self.timeout_s, host)
        ray.get(joined, timeout=self.timeout_s)

    def publish(self, state_dict: dict[str, torch.Tensor], version: int):
        if self._group is None:
            raise RuntimeError("CollectiveSync.publish before attach: the workers have not joined the group")
        for work in self._works:  # the previous barrier's broadcasts (received: its update_weights returned)
            work.wait()
        buckets = layout(state_dict, self.bucket_bytes)
        key = [(b["nbytes"], tuple(b["entries"])) for b in buckets]
        if key != self._key:
            self._buffers = [torch.empty(b["nbytes"], dtype=torch.uint8, device=self.device) for b in buckets]
            self._key = key
        with torch.no_grad():
            for b, buf in zip(buckets, self._buffers):
                for name, view in _views(buf, b["entries"]).items():
                    view.copy_(state_dict[name])
        self._works = [_broadcast(self._group, buf) for buf in self._buffers]
        self.bytes_sent = sum(b["nbytes"] for b in buckets)
        return {"version": version, "buckets": buckets, "aliases": aliases(state_dict)}

    def receive(self, handle):
        raise RuntimeError("CollectiveSync: the trainer publishes, workers receive")

    def close(self) -> None:
        self._works, self._group = [], None
