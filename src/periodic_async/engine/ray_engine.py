"""Inference workers as Ray actors: continuous batching per actor, streamed results, weight sync
through the object store.

Each worker is an `EngineWorker` actor holding its own model and `ContinuousBatcher`.
`generate` splits the requests at submit time (`assign_workers`: least-loaded, deterministic)
and opens one Ray streaming generator per worker (`num_returns="streaming"`); the driver
multiplexes them with `ray.wait`, so every group reaches the caller as soon as its worker
finishes it, not per batch. Failures surface as `EngineError` naming the worker and the
requests it still held: an actor that dies (Ray reports it on the stream, or on a liveness
ping sent after `PING_AFTER_S` of silence), raises, or stays silent for `timeout_s`.

Weights: `ObjectStoreSync` puts one dict of numpy arrays in the object store (numpy is read
zero-copy by the workers, torch tensors are not: ~1 ms against 0.4-1.1 s for 256 MiB); each worker copies them into
its model. Ray starts locally unless `engine_cfg.ray_address` names a cluster.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import ray
import torch

from periodic_async.engine.base import (Engine, EngineError, Request, RequestOutput, WeightSync, assign_workers,
                                        numpy_to_state, state_to_numpy)

PING_AFTER_S = 2.0
"""A worker silent this long gets a liveness ping (a dead actor fails it at once)."""


def _offline_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if k in os.environ}


def init_ray(engine_cfg) -> bool:
    """Start Ray locally (or join `engine_cfg.ray_address`) unless it is running; True if we started it."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts workers at nice 15: beside any busy nice-0 process (the trainer, Ray's own
    # agents) an engine worker then gets a few % of a core (we measured 25-30x slower
    # generation). Inference workers are the job, not background work: same priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    common = dict(log_to_driver=False, logging_level=logging.WARNING, runtime_env={"env_vars": _offline_env()})
    # ray.init replaces the driver's SIGTERM handler with sys.exit: keep the caller's (the CLI's
    # `interrupt.install`, which stops the run cleanly and saves its checkpoint).
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    if engine_cfg.ray_address:
        ray.init(address=engine_cfg.ray_address, **common)
    else:
        need = engine_cfg.num_workers * engine_cfg.threads_per_worker
        ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, **common)
    if callable(sigterm):
        signal.signal(signal.SIGTERM, sigterm)
    return True


class ObjectStoreSync(WeightSync):
    """One `ray.put` of numpy arrays; workers receive the (zero-copy) arrays as the handle."""

    def publish(self, state_dict, version):
        return ray.put(state_to_numpy(state_dict))

    def receive(self, handle) -> dict[str, torch.Tensor]:
        return numpy_to_state(handle)


class EngineWorker:
    """Actor body: one model, one batcher. max_concurrency=2 lets `abort` and `info` run beside
    `generate`; a lock keeps a new `generate` (or `update_weights`) from overlapping the tail of
    an aborted one, and `abort` names the call it stops so it cannot hit a later one."""

    def __init__(self, model_cfg, max_num_seqs: int, worker: int, threads: int):
        from periodic_async.engine.batcher import ContinuousBatcher
        from periodic_async.model import load_policy

        torch.set_num_threads(threads)
        model, tokenizer = load_policy(model_cfg)
        self.batcher = ContinuousBatcher(model, tokenizer, max_num_seqs, worker=worker)
        self.sync = ObjectStoreSync()
        self._lock = threading.Lock()
        self._aborted = -1

    def info(self) -> dict:
        return dict(pid=os.getpid(), version=self.batcher.version, threads=torch.get_num_threads(),
                    device=str(self.batcher.device))

    def generate(self, requests: list[Request], call: int):
        with self._lock:
            self.batcher.submit(requests)
            try:
                while self.batcher.has_work and self._aborted != call:
                    for out in self.batcher.step():  # (Ray drives the generator with send(): no `yield from` a list)
                        yield out
            finally:
                self.batcher.reset()

    def abort(self, call: int) -> None:
        self._aborted = call

    def update_weights(self, handle, version: int) -> float:
        with self._lock:
            t = time.perf_counter()
            self.batcher.update_weights(self.sync.receive(handle), version)
            return time.perf_counter() - t


def _absolute_paths(model_cfg):
    """Workers may start in another directory: make local paths absolute."""
    changes = {}
    for name in ("name_or_path", "tokenizer"):
        p = Path(getattr(model_cfg, name))
        if p.exists() or name == "tokenizer":
            changes[name] = str(p.resolve())
    return dataclasses.replace(model_cfg, **changes)


STARTUP_TIMEOUT_S = 300.0
"""How long a new worker may take to import its libraries and build its model."""


class RayEngine(Engine):
    def __init__(self, engine_cfg, model_cfg, sync: WeightSync | None = None):
        self.cfg = engine_cfg
        self.timeout_s = engine_cfg.timeout_s
        self._owns_ray = init_ray(engine_cfg)
        self.sync = sync or ObjectStoreSync()
        self._version = 0
        self._active = False
        self._calls = 0
        self.last_sync: dict[str, float] = {}
        gpus = 1 if model_cfg.device.startswith("cuda") or (
            model_cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0) else 0
        threads = engine_cfg.threads_per_worker
        cpus = threads if ray.available_resources().get("CPU", 0) >= threads * engine_cfg.num_workers else 0
        actor = ray.remote(EngineWorker).options(
            num_cpus=cpus, num_gpus=gpus, max_concurrency=2, max_restarts=0,
            scheduling_strategy="SPREAD" if engine_cfg.ray_address else "DEFAULT",
            runtime_env={"env_vars": {**_offline_env(), "OMP_NUM_THREADS": str(threads),
                                      "TOKENIZERS_PARALLELISM": "false"}})
        cfg = _absolute_paths(model_cfg)
        if gpus:  # Ray shows each actor its own GPU as cuda:0
            cfg = dataclasses.replace(cfg, device="cuda")
        self.workers = [actor.remote(cfg, engine_cfg.max_num_seqs, w, threads) for w in range(engine_cfg.num_workers)]
        startup_s = max(self.timeout_s, STARTUP_TIMEOUT_S)  # importing torch on a loaded machine is slow
        for w, ref in enumerate([a.info.remote() for a in self.workers]):
            try:
                ray.get(ref, timeout=startup_s)
            except Exception as e:
                self.close()
                raise EngineError(f"did not start: {e}", w) from e

    @property
    def version(self) -> int:
        return self._version

    def info(self) -> list[dict]:
        """pid, version, threads and device of every worker."""
        return ray.get([w.info.remote() for w in self.workers], timeout=self.timeout_s)

    def generate(self, requests: list[Request]) -> Iterator[RequestOutput]:
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("one generate() at a time")
        self._active = True
        call = self._calls = self._calls + 1
        streams: dict = {}
        try:
            per_worker: dict[int, list[Request]] = {}
            for w, r in zip(assign_workers(requests, len(self.workers)), requests):
                per_worker.setdefault(w, []).append(r)
            pending = {w: [r.request_id for r in rs] for w, rs in per_worker.items()}
            streams = {w: self.workers[w].generate.options(num_returns="streaming").remote(rs, call)
                       for w, rs in per_worker.items()}
            silent = dict.fromkeys(streams, 0.0)  # seconds spent waiting on each worker since its last result
            pinged: dict[int, tuple[float, ray.ObjectRef]] = {}  # liveness pings in flight
            while streams:
                t = time.perf_counter()
                ready, _ = ray.wait(list(streams.values()), num_returns=1, timeout=0.5)
                waited = time.perf_counter() - t
                for w, stream in list(streams.items()):
                    if stream not in ready:
                        silent[w] += waited
                        continue
                    try:
                        out = ray.get(next(stream))
                    except StopIteration:
                        del streams[w]
                        if pending[w]:
                            raise EngineError("stream ended before all requests were done", w, pending[w])
                        continue
                    except Exception as e:
                        raise EngineError(_describe(e), w, pending[w]) from e
                    if out.version != self._version:
                        raise EngineError(f"version {out.version} != engine version {self._version}", w,
                                          [out.request_id])
                    pending[w].remove(out.request_id)
                    silent[w] = 0.0
                    pinged.pop(w, None)
                    yield out
                self._check_alive(streams, silent, pinged, pending)
        finally:
            for w in streams:  # abandoned or failed: stop the others (best effort)
                try:
                    self.workers[w].abort.remote(call)
                except Exception:
                    pass
            self._active = False

    def _check_alive(self, streams, silent, pinged, pending) -> None:
        """Timeout, and actor death not yet reported on the stream: a dead actor fails a ping at once."""
        for w in streams:
            if silent[w] > self.timeout_s:
                raise EngineError(f"no result for {self.timeout_s:.0f} s (timeout_s)", w, pending[w])
            if w in pinged:
                sent_at, ref = pinged[w]
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    try:
                        ray.get(ref)
                    except Exception as e:
                        raise EngineError(_describe(e), w, pending[w]) from e
                    if silent[w] - sent_at > PING_AFTER_S:
                        del pinged[w]  # alive; ping again later
            elif silent[w] > PING_AFTER_S:
                pinged[w] = (silent[w], self.workers[w].info.remote())

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("update_weights during generate() would mix versions")
        t = time.perf_counter()
        handle = self.sync.publish(state_dict, version)
        t_pub = time.perf_counter()
        try:
            load_s = ray.get([w.update_weights.remote(handle, version) for w in self.workers], timeout=self.timeout_s)
        except Exception as e:
            raise EngineError(f"update_weights: {_describe(e)}") from e
        self._version = version
        total = time.perf_counter() - t
        self.last_sync = dict(publish_s=t_pub - t, load_s=max(load_s), total_s=total)
        return total

    def close(self) -> None:
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w)
            except Exception:
                pass
        self.workers = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def _describe(e: Exception) -> str:
    if isinstance(e, ray.exceptions.RayActorError):
        return f"worker process died ({type(e).__name__})"
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        return f"raised {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return f"{type(e).__name__}: {e}"
