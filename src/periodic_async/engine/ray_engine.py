"""Inference workers as Ray actors (the paper's producer: engines apart from the trainer), each a
continuous-batching engine, its groups streamed back as they finish, its weights pushed at the barrier.

`generate` dispatches each request at submit time (`assign_workers`) and multiplexes one Ray
streaming generator per worker (`_Call`), so every group reaches the caller as soon as its worker
finishes it. Guarantees: no push, probe or resize while a generate() is open (`Engine._idle`);
every output carries the engine's version, and a worker started later (restarted, added) loads
that version before any request; a worker that dies, raises or stays silent for engine.timeout_s
is an `EngineError` naming it and the requests it held, unless it died and engine.restart_workers
allows a restart at the same index with its requests re-sent (per-request seeds: the same tokens).
Workers run the built-in batcher or vLLM (engine.worker_backend); weights travel through the object
store (`ObjectStoreSync`) or a broadcast (collective.py). Start-up and placement: ray_cluster.py;
for users: docs/scaling.md ("Where engine workers run").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray.util.placement_group import PlacementGroup

from periodic_async.engine.base import (Engine, EngineError, Feed, Request, RequestOutput, WeightSync,
                                        assign_workers, numpy_to_state, request_load, state_to_numpy)
from periodic_async.engine import resolve_worker_backend
from periodic_async.engine.ray_cluster import Placement, actor_options, init_ray, offline_env, remove_group
from periodic_async.parallel.affinity import available_cores, pin_process

log = logging.getLogger(__name__)

PING_AFTER_S = 2.0
"""A worker silent this long gets a liveness ping (a dead actor fails it at once)."""


class ObjectStoreSync(WeightSync):
    """One `ray.put` of numpy arrays; workers receive the (zero-copy) arrays as the handle."""

    def publish(self, state_dict, version):
        return ray.put(state_to_numpy(state_dict))

    def receive(self, handle) -> dict[str, torch.Tensor]:
        return numpy_to_state(handle)


def make_batcher(backend: str, model_cfg, max_num_seqs: int, worker: int, gpus: float = 1.0,
                 kv_cache_gib: float = 1.0):
    """A worker's scheduler: the built-in `ContinuousBatcher` ('batcher') or vLLM ('vllm'), both
    with submit / has_work / step / reset / update_weights / probe_logprobs / version / device."""
    if backend == "vllm":
        from periodic_async.engine.vllm_engine import VLLMBatcher

        return VLLMBatcher(model_cfg, max_num_seqs, worker=worker, kv_cache_gib=kv_cache_gib, gpu_share=gpus)
    from periodic_async.engine.batcher import ContinuousBatcher
    from periodic_async.model import load_policy

    model, tokenizer = load_policy(model_cfg)
    return ContinuousBatcher(model, tokenizer, max_num_seqs, worker=worker)


class EngineWorker:
    """Actor body: one batcher (`make_batcher`). max_concurrency=2 lets `abort`, `info`, `add` and
    `finish` run beside `generate`; a lock keeps a new `generate` (or `update_weights`) from
    overlapping the tail of an aborted one, and `abort` names the call it stops so it cannot hit a
    later one. An open call (a generate() with a feed) takes the requests `add`ed to it between
    steps, and ends once `finish`ed with nothing left: its requests were all returned, so nothing
    `add`ed to it is in flight (the driver finishes a call only then)."""

    def __init__(self, model_cfg, max_num_seqs: int, worker: int, threads: int, backend: str = "batcher",
                 gpus: float = 0.0, kv_cache_gib: float = 1.0, cores: list[int] | None = None):
        pin_process(cores)  # engine.cpu_affinity (parallel/affinity.py): before any compute thread starts
        torch.set_num_threads(threads)
        self.batcher = make_batcher(backend, model_cfg, max_num_seqs, worker, gpus, kv_cache_gib)
        self.sync = ObjectStoreSync()
        self._lock = threading.Lock()
        self._aborted = -1
        self._inbox = threading.Condition()  # an open call's added requests and its end
        self._added: dict[int, list[Request]] = {}
        self._finished: set[int] = set()

    def info(self) -> dict:
        """pid, version, threads, device, the cores it may run on (cpu_affinity), and the Ray node
        it runs on (node_id, node_ip)."""
        return dict(pid=os.getpid(), version=self.batcher.version, threads=torch.get_num_threads(),
                    cpu_affinity=available_cores(),
                    device=str(self.batcher.device), node_id=ray.get_runtime_context().get_node_id(),
                    node_ip=ray.util.get_node_ip_address())

    def generate(self, requests: list[Request], call: int, open_call: bool = False):
        with self._lock:
            self.batcher.submit(requests)
            try:
                while self._aborted != call:
                    if open_call:
                        with self._inbox:
                            if not self.batcher.has_work and not self._added.get(call) and call not in self._finished:
                                self._inbox.wait(0.05)
                            more, finished = self._added.pop(call, []), call in self._finished
                        if more:
                            self.batcher.submit(more)
                    if not self.batcher.has_work:
                        if not open_call or finished:
                            break
                        continue
                    for out in self.batcher.step():  # (Ray drives the generator with send(): no `yield from` a list)
                        yield out
            finally:
                self.batcher.reset()
                with self._inbox:
                    self._added.pop(call, None)
                    self._finished.discard(call)

    def add(self, requests: list[Request], call: int) -> None:
        """Requests joining the open call `call` (taken at its next step)."""
        with self._inbox:
            self._added.setdefault(call, []).extend(requests)
            self._inbox.notify_all()

    def finish(self, call: int) -> None:
        """No more requests for the open call `call`: it ends once it has nothing left."""
        with self._inbox:
            self._finished.add(call)
            self._inbox.notify_all()

    def abort(self, call: int) -> None:
        self._aborted = call
        with self._inbox:
            self._inbox.notify_all()

    def set_weight_sync(self, sync) -> None:
        """Receive weights through `sync` from now on (engine/collective.py joins its group here)."""
        sync.join(self.batcher.device)
        self.sync = sync

    def update_weights(self, handle, version: int) -> float:
        with self._lock:
            t = time.perf_counter()
            self.batcher.update_weights(self.sync.receive(handle), version)
            return time.perf_counter() - t

    def probe_logprobs(self, token_ids: list[int]):
        """The worker's log-probs of token_ids[1:] (engine/verify.py), as float64 numpy."""
        with self._lock:
            return self.batcher.probe_logprobs(token_ids)


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


@dataclass
class Worker:
    """One engine worker as the driver keeps it (replaced whole when the worker is restarted)."""

    index: int
    actor: ray.actor.ActorHandle
    """The `EngineWorker` actor."""
    group: PlacementGroup | None
    """Its placement group (None once removed)."""
    cores: list[int] | None
    """The cores it may run on (engine.cpu_affinity); None: left to the OS."""
    pid: int = 0
    """Its OS process id, once started."""


class RayEngine(Engine):
    def __init__(self, engine_cfg, model_cfg, sync: WeightSync | None = None):
        if engine_cfg.worker_backend == "auto":  # the rule: engine/__init__.py's resolve_worker_backend
            chosen = resolve_worker_backend(engine_cfg, model_cfg)
            log.info("engine.worker_backend=auto: %s for %s", chosen, model_cfg.name_or_path)
            engine_cfg = dataclasses.replace(engine_cfg, worker_backend=chosen)
        if engine_cfg.worker_backend == "vllm" and model_cfg.lora.enabled:  # before any worker starts
            from periodic_async.engine.vllm_lora import vllm_lora_rank

            vllm_lora_rank(model_cfg.lora)
        self.cfg = engine_cfg
        self.timeout_s = engine_cfg.timeout_s
        self._owns_ray = init_ray(engine_cfg, model_cfg)
        self.sync = sync or ObjectStoreSync()
        self._version = 0
        self._weights = None  # handle of the weights of `_version`: restarted and added workers load it
        self._calls = 0
        self.last_sync: dict[str, float] = {}
        self.restarts_left = engine_cfg.restart_workers
        self.restarts: list[dict] = []
        """One record per restarted worker: worker, old_pid, new_pid, version, resent (request ids), reason."""
        self._schedule = dict(sorted(engine_cfg.num_workers_schedule.items()))
        self._scheduled_through = -1  # schedule entries up to this version have been applied
        self.placement = Placement.from_config(engine_cfg, model_cfg)
        threads = engine_cfg.threads_per_worker
        self._actor = ray.remote(EngineWorker)
        env = {**offline_env(), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        if engine_cfg.worker_backend == "vllm":
            # vLLM's engine core inside the actor's process: its reload and probes reach the model,
            # and the forward runs on the worker's torch threads (no OpenMP binding of vLLM's own)
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
            from periodic_async.engine.vllm_engine import warn_truncated_logprobs

            warn_truncated_logprobs(engine_cfg)
        self._actor_options = dict(max_concurrency=2, max_restarts=0, runtime_env={"env_vars": env})
        cfg = _absolute_paths(model_cfg)
        if self.placement.gpus:  # Ray shows each actor its own GPU (or its share of one) as cuda:0
            cfg = dataclasses.replace(cfg, device="cuda")
        elif cfg.device.startswith("cuda"):  # gpus_per_worker=0: the workers hold no GPU
            cfg = dataclasses.replace(cfg, device="cpu")
        self._model_cfg = cfg
        self.workers: list[Worker] = []
        try:
            self._start(range(engine_cfg.num_workers), None, 0)
            self.sync.attach([w.actor for w in self.workers])  # a collective sync forms its group here
        except BaseException:  # an EngineError, or a ConfigError from attach: no actor outlives the failure
            self.close()
            raise

    @property
    def version(self) -> int:
        return self._version

    def info(self) -> list[dict]:
        """pid, version, threads, device and Ray node (node_id, node_ip) of every worker."""
        return ray.get([w.actor.info.remote() for w in self.workers], timeout=self.timeout_s)

    def stats(self) -> dict[str, float]:
        return {"engine/workers": len(self.workers), "engine/worker_restarts": len(self.restarts),
                "engine/requests_resent": sum(len(r["resent"]) for r in self.restarts)}

    # --- workers: start, restart, add, remove ---------------------------------------------

    def _start(self, indices, handle, version: int) -> None:
        """Start workers at `indices` (replacing what is there: its placement group is removed
        first) and load `handle` as `version` (None: the initial weights, version 0) before they
        take any request."""
        indices = list(indices)
        if not indices:
            return
        for w in indices:
            if w < len(self.workers):
                remove_group(self.workers[w].group)
                self.workers[w].group = None
        bundle = self.placement.bundle(len(indices))
        groups = self.placement.place(indices, bundle)
        for w in indices:
            cores = self.placement.cores_of(w)
            actor = self._actor.options(**self._actor_options, **actor_options(bundle, groups[w])).remote(
                self._model_cfg, self.cfg.max_num_seqs, w, self.cfg.threads_per_worker, self.cfg.worker_backend,
                self.placement.gpus, self.cfg.vllm_kv_cache_gib, cores)
            worker = Worker(w, actor, groups[w], cores)
            if w < len(self.workers):
                self.workers[w] = worker
            else:
                self.workers.append(worker)
        startup_s = max(self.timeout_s, STARTUP_TIMEOUT_S)  # importing torch on a loaded machine is slow
        for w in indices:
            worker = self.workers[w]
            try:
                worker.pid = ray.get(worker.actor.info.remote(), timeout=startup_s)["pid"]
                if handle is not None:
                    ray.get(worker.actor.update_weights.remote(handle, version), timeout=self.timeout_s)
            except Exception as e:
                raise EngineError(f"did not start: {_describe(e)}", w) from e

    def _restart(self, w: int, reason: str, resent: list[str]) -> None:
        """Replace dead worker `w` by a new one holding the current version; the caller re-sends
        `resent`. Raises EngineError when no restart is left."""
        if self.restarts_left <= 0:
            raise EngineError(reason, w, resent)
        if not self.sync.resizable:  # a collective sync's process group cannot take a new member
            raise EngineError(f"{reason}; not restarted: restarts need the object-store weight sync", w, resent)
        self.restarts_left -= 1
        old_pid = self.workers[w].pid
        try:
            ray.kill(self.workers[w].actor)
        except Exception:
            pass
        self._start([w], self._weights, self._version)
        new_pid = self.workers[w].pid
        self.restarts.append(dict(worker=w, old_pid=old_pid, new_pid=new_pid, version=self._version,
                                  resent=list(resent), reason=reason))
        log.warning("engine: worker %d (pid %d) %s; restarted as pid %d at version %d, re-sending %d requests: %s "
                    "(%d restarts left)", w, old_pid, reason, new_pid, self._version, len(resent),
                    ", ".join(resent[:8]) + (" ..." if len(resent) > 8 else ""), self.restarts_left)

    def add_workers(self, n: int) -> None:
        """Start `n` more workers holding the current version (between iterations only)."""
        self._idle("add_workers during generate(): resize at an iteration boundary")
        if n < 0:
            raise ValueError(f"add_workers({n}): n must be >= 0")
        if n and not self.sync.resizable:
            raise RuntimeError("add_workers needs the object-store weight sync (a collective group is fixed)")
        self._start(range(len(self.workers), len(self.workers) + n), self._weights, self._version)
        log.info("engine: %d workers (added %d at version %d)", len(self.workers), n, self._version)

    def remove_workers(self, n: int) -> None:
        """Stop the `n` highest-numbered workers (between iterations only); one always stays."""
        self._idle("remove_workers during generate(): resize at an iteration boundary")
        if not 0 <= n < len(self.workers):
            raise ValueError(f"remove_workers({n}): must leave at least one of {len(self.workers)} workers")
        for _ in range(n):
            worker = self.workers.pop()
            ray.kill(worker.actor)
            remove_group(worker.group)
        log.info("engine: %d workers (removed %d at version %d)", len(self.workers), n, self._version)

    def scheduled_workers(self, version: int) -> int:
        """Workers for `version`: the last `engine.num_workers_schedule` entry that comes due with
        it (an entry at v is due at the first push of a version >= v), else today's count, so
        a resize by `add_workers` / `remove_workers` stands until the schedule says otherwise."""
        due = [n for v, n in self._schedule.items() if self._scheduled_through < v <= version]
        return due[-1] if due else len(self.workers)

    # --- generation ----------------------------------------------------------------------

    def generate(self, requests: list[Request], feed: Feed | None = None) -> Iterator[RequestOutput]:
        with self._generating():
            self._calls += 1
            call = _Call(self, requests, self._calls, feed)
            try:
                yield from call.outputs()
            finally:
                call.abort()

    # --- the barrier ---------------------------------------------------------------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Resize to `scheduled_workers(version)` (new workers load these weights), load them on
        every worker; a worker found dead here is restarted if `restart_workers` allows."""
        self._idle("update_weights during generate() would mix versions")
        t = time.perf_counter()
        handle = self.sync.publish(state_dict, version)
        t_pub = time.perf_counter()
        target = self.scheduled_workers(version)
        self._scheduled_through = version
        if target < len(self.workers):
            self.remove_workers(len(self.workers) - target)
        refs = [w.actor.update_weights.remote(handle, version) for w in self.workers]
        load_s = []
        for w, ref in enumerate(refs):
            try:
                load_s.append(ray.get(ref, timeout=self.timeout_s))
            except ray.exceptions.RayActorError as e:
                self._restart(w, f"update_weights: {_describe(e)}", [])  # the new worker loads `handle` below
                ray.get(self.workers[w].actor.update_weights.remote(handle, version), timeout=self.timeout_s)
            except Exception as e:
                raise EngineError(f"update_weights: {_describe(e)}", w) from e
        self._version, self._weights = version, handle
        if target > len(self.workers):
            self.add_workers(target - len(self.workers))
        total = time.perf_counter() - t
        self.last_sync = dict(publish_s=t_pub - t, load_s=max(load_s, default=0.0), total_s=total)
        return total

    def probe_logprobs(self, token_ids: list[int]) -> dict:
        """{worker: its log-probs of token_ids[1:]} (engine/verify.py); a worker that fails or
        does not answer within timeout_s raises an EngineError naming it."""
        self._idle("probe_logprobs during generate()")
        refs = [w.actor.probe_logprobs.remote(list(token_ids)) for w in self.workers]
        out = {}
        for w, ref in enumerate(refs):
            try:
                out[w] = ray.get(ref, timeout=self.timeout_s)
            except Exception as e:
                raise EngineError(f"probe after the push of version {self._version}: {_describe(e)}", w) from e
        return out

    def close(self) -> None:
        for worker in self.workers:
            try:
                ray.kill(worker.actor)
            except Exception:
                pass
            remove_group(worker.group)
        self.workers = []
        self._weights = None
        self.sync.close()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


class _Call:
    """One generate() call: per worker, the requests it has not returned yet, its result stream,
    the seconds it has been silent and the liveness ping in flight. With a feed, the call is open
    on every worker it streams from: a fed request goes to the least-loaded worker (outstanding
    n * max_tokens), `add`ed to its open stream or in a new one; once the feed is closed and
    nothing is held, each open stream is `finish`ed and read to its end."""

    def __init__(self, engine: RayEngine, requests: list[Request], call: int, feed: Feed | None = None):
        self.engine, self.call, self.feed = engine, call, feed
        self.held: dict[int, dict[str, Request]] = {}
        for w, r in zip(assign_workers(requests, len(engine.workers)), requests):
            self.held.setdefault(w, {})[r.request_id] = r
        self.streams = {w: self._stream(w) for w in self.held}
        self.silent = dict.fromkeys(self.streams, 0.0)  # seconds spent waiting on each worker since its last result
        self.pinged: dict[int, tuple[float, ray.ObjectRef]] = {}  # liveness pings in flight

    def _stream(self, w: int):
        actor = self.engine.workers[w].actor
        return actor.generate.options(num_returns="streaming").remote(list(self.held[w].values()), self.call,
                                                                      self.feed is not None)

    def _take_feed(self) -> None:
        """Dispatch what was put on the feed since the last output."""
        more = self.feed.take() if self.feed is not None else []
        if not more:
            return
        load = [sum(request_load(r) for r in self.held.get(w, {}).values()) for w in range(len(self.engine.workers))]
        by_worker: dict[int, list[Request]] = {}
        for w, r in zip(assign_workers(more, len(load), load), more):
            self.held.setdefault(w, {})[r.request_id] = r
            by_worker.setdefault(w, []).append(r)
        for w, rs in by_worker.items():
            if w in self.streams:
                self.engine.workers[w].actor.add.remote(rs, self.call)
            else:  # its stream ended (nothing held) or it had none: a new one, open
                self.streams[w] = self._stream(w)
                self.silent[w] = 0.0

    def _finish(self) -> None:
        """Feed closed, nothing held: end every open stream (each ends without another output)."""
        for w, stream in list(self.streams.items()):
            self.engine.workers[w].actor.finish.remote(self.call)
            deadline = time.perf_counter() + self.engine.timeout_s
            while True:
                ready, _ = ray.wait([stream], num_returns=1, timeout=0.5)
                if ready:
                    try:
                        out = ray.get(next(stream))
                    except StopIteration:
                        break
                    except ray.exceptions.RayActorError:  # died after returning its requests: the next push finds it
                        break
                    except Exception as e:
                        raise EngineError(_describe(e), w) from e
                    raise EngineError(f"output {out.request_id} after its call was finished", w, [out.request_id])
                if time.perf_counter() > deadline:
                    raise EngineError(f"open call not ended {self.engine.timeout_s:.0f} s after finish", w)
            del self.streams[w]

    def outputs(self) -> Iterator[RequestOutput]:
        """Each request's output as its worker streams it back, in completion order."""
        engine = self.engine
        while True:
            self._take_feed()
            if self.feed is None:
                if not self.streams:
                    break
            elif not any(self.held.values()):
                if self.feed.drained():
                    self._finish()
                    break
                self.feed.idle()
                continue
            t = time.perf_counter()
            # a waiting feed's requests come from another thread: look at it often
            ready, _ = ray.wait(list(self.streams.values()), num_returns=1,
                                timeout=0.02 if self.feed is not None and self.feed.wait else 0.5)
            waited = time.perf_counter() - t
            for w, stream in list(self.streams.items()):
                if stream not in ready:
                    self.silent[w] += waited if self.held.get(w) else 0.0  # an open call's idle worker is not late
                    continue
                try:
                    out = ray.get(next(stream))
                except StopIteration:
                    del self.streams[w]
                    if self.held[w]:
                        raise EngineError("stream ended before all requests were done", w, list(self.held[w]))
                    continue
                except Exception as e:
                    self._died(w, e)
                    continue
                if out.version != engine.version:
                    raise EngineError(f"version {out.version} != engine version {engine.version}", w,
                                      [out.request_id])
                del self.held[w][out.request_id]
                self.silent[w] = 0.0
                self.pinged.pop(w, None)
                yield out
                self._take_feed()
            self._check_alive()

    def _died(self, w: int, e: Exception) -> None:
        """Worker w failed with e: restart it and re-send what it held, or raise. A worker that
        died after returning all its requests ends its stream: the next push or generate finds
        it dead (and restarts or names it)."""
        if not isinstance(e, ray.exceptions.RayActorError):
            raise EngineError(_describe(e), w, list(self.held[w])) from e
        if not self.held[w]:
            log.warning("engine: worker %d (pid %d) %s after returning all its requests", w,
                        self.engine.workers[w].pid, _describe(e))
            del self.streams[w]
            return
        try:
            self.engine._restart(w, _describe(e), list(self.held[w]))
        except EngineError as err:
            raise err from e
        self.streams[w] = self._stream(w)
        self.silent[w] = 0.0
        self.pinged.pop(w, None)

    def _check_alive(self) -> None:
        """Timeout, and actor death not yet reported on the stream: a dead actor fails a ping at once."""
        timeout_s = self.engine.timeout_s
        for w in list(self.streams):
            if not self.held.get(w):  # nothing asked of it (an open call between requests)
                self.pinged.pop(w, None)
                continue
            if self.silent[w] > timeout_s:
                raise EngineError(f"no result for {timeout_s:.0f} s (timeout_s)", w, list(self.held[w]))
            if w in self.pinged:
                sent_at, ref = self.pinged[w]
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    try:
                        ray.get(ref)
                    except Exception as e:
                        self._died(w, e)
                        continue
                    if self.silent[w] - sent_at > PING_AFTER_S:
                        del self.pinged[w]  # alive; ping again later
            elif self.silent[w] > PING_AFTER_S:
                self.pinged[w] = (self.silent[w], self.engine.workers[w].actor.info.remote())

    def abort(self) -> None:
        """Stop what the workers still run for this call (abandoned or failed; best effort)."""
        for w in self.streams:
            try:
                self.engine.workers[w].actor.abort.remote(self.call)
            except Exception:
                pass


def _describe(e: Exception) -> str:
    if isinstance(e, ray.exceptions.GetTimeoutError):
        return "no answer within engine.timeout_s (hung or overloaded)"
    if isinstance(e, ray.exceptions.RayActorError):
        if getattr(e, "actor_init_failed", False):  # its constructor raised: the last line names the error
            lines = [ln.strip() for ln in str(getattr(e, "error_msg", e)).splitlines() if ln.strip()]
            return f"raised while starting: {lines[-1] if lines else type(e).__name__}"
        return f"worker process died ({type(e).__name__})"
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        return f"raised {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return f"{type(e).__name__}: {e}"
