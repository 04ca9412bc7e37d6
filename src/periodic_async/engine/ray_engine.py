"""Inference workers as Ray actors: continuous batching per actor, streamed results, weight sync
through the object store.

Each worker is an `EngineWorker` actor holding its own model and `ContinuousBatcher`.
`generate` splits the requests at submit time (`assign_workers`: least-loaded, deterministic)
and opens one Ray streaming generator per worker (`num_returns="streaming"`); the driver
multiplexes them with `ray.wait`, so every group reaches the caller as soon as its worker
finishes it, not per batch. Failures surface as `EngineError` naming the worker and the
requests it still held: an actor that dies (Ray reports it on the stream, or on a liveness
ping sent after `PING_AFTER_S` of silence), raises, or stays silent for `timeout_s`. A killed
worker process is reported on its stream at once (measured: under 0.1 s after SIGKILL).

Restarts (`engine.restart_workers` > 0): a worker whose process died is replaced, at the
same index, by a new actor that first loads the weights of the current version (the
iteration's: every sample of iteration t still comes from version t), then gets the
requests the dead one had not returned. Each request carries its own seed and sample k
draws from its own generator (batcher.py), so with one torch thread per worker the re-sent
requests give the tokens an uninterrupted run gives. Each restart is logged (worker, pids,
re-sent request ids), kept in `restarts` and counted in `stats()`. A worker that raises or
times out is not restarted (re-sending would fail again). The pipeline's loop knows none of it.

Elastic engines: `add_workers(n)` / `remove_workers(n)` between iterations; new workers load
the current version before any request. `engine.num_workers_schedule` ({version: workers})
applies them at the barrier that pushes that version (once; a manual resize stands until the
next entry comes due). Dispatch is by request, and a
request's tokens do not depend on the worker, so resizing does not change what is sampled.

Weights: `ObjectStoreSync` puts one dict of numpy arrays in the object store (numpy is read
zero-copy by the workers, torch tensors are not: ~1 ms against 0.4-1.1 s for 256 MiB); each worker copies them into
its model. Ray starts locally unless `engine_cfg.ray_address` (or RAY_ADDRESS) names a cluster.

Placement: every worker runs in a placement group of its own, one bundle
{"CPU": engine.cpus_per_worker, "GPU": engine.gpus_per_worker} (GPU left out at 0; fractions
share a GPU), created when the worker starts and removed when it is removed, restarted or the
engine closes, so a worker's resources are reserved on one node for exactly its lifetime. A
bundle the cluster cannot place within `engine.placement_timeout_s` fails the start-up with an
EngineError naming the worker, the bundle and the cluster's available and total resources
(instead of waiting out the start-up timeout).

What a worker runs (`engine.worker_backend`): the built-in `ContinuousBatcher`, or a vLLM
engine (`vllm_engine.VLLMBatcher`, the same submit / step / update_weights interface) on the
worker's CPU threads (`threads_per_worker`; vLLM's own OpenMP binding is off) or GPU share,
its KV cache `engine.vllm_kv_cache_gib`, fed by the same weight syncs (object store or
broadcast) and streamed, restarted and timed out the same way (tests/test_vllm.py, on CPU). A
worker that cannot start (vLLM missing on its node, an unsupported model, a KV cache that does
not fit) fails with an EngineError naming the worker and the one-line cause its constructor
raised; the engine's other workers are stopped with it.

LoRA (model.lora.enabled): every worker builds `apply_lora(base)` (the built-in batcher) or a
vLLM engine with LoRA on (vllm_engine.py), and every push, through either weight sync, carries the
adapter alone (a few MB instead of the model; the object store and the broadcast treat it as any
state dict). A model.lora.rank vLLM cannot serve is refused before any worker starts.

After-push probe: `probe_logprobs(token_ids)` asks every worker for its log-probs of a token
sequence (vLLM's prompt log-probs, or a forward of the batcher's model), which engine/verify.py
compares with the trainer's at the barrier.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from periodic_async.engine.base import (Engine, EngineError, Request, RequestOutput, WeightSync, assign_workers,
                                        numpy_to_state, state_to_numpy)
from periodic_async.parallel.affinity import available_cores, engine_cores, pin_process

log = logging.getLogger(__name__)

PING_AFTER_S = 2.0
"""A worker silent this long gets a liveness ping (a dead actor fails it at once)."""
TOKEN_BUNDLE = {"memory": float(2**20)}
"""The bundle of a worker that reserves no CPU and no GPU: 1 MiB of Ray's `memory` resource (Ray
refuses an empty bundle, and a token CPU would not fit once every CPU is reserved)."""


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
    # Ray on this machine alone (a local start, or a cluster joined at a loopback address) stays on
    # the loopback interface, with no dashboard: nothing on this machine's network can reach its
    # object store or submit work to it. Ray turns a loopback address into the machine's own
    # unless its multi-node mode is off (as on macOS), so it is off while Ray starts or connects.
    from ray._private import ray_constants

    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = multi_node and not engine_cfg.ray_on_this_machine
    try:
        if engine_cfg.ray_address:
            ray.init(address=engine_cfg.ray_address, **common)
        else:
            per_worker = (engine_cfg.threads_per_worker if engine_cfg.cpus_per_worker is None
                          else engine_cfg.cpus_per_worker)
            need = math.ceil(engine_cfg.num_workers * per_worker)
            # address="local": a new local instance even when a `ray start` cluster runs on this
            # machine (ray.init() would join that one, and refuse num_cpus).
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                     _node_ip_address="127.0.0.1", **common)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node
    if callable(sigterm):
        signal.signal(signal.SIGTERM, sigterm)
    return True


class ObjectStoreSync(WeightSync):
    """One `ray.put` of numpy arrays; workers receive the (zero-copy) arrays as the handle."""

    def publish(self, state_dict, version):
        return ray.put(state_to_numpy(state_dict))

    def receive(self, handle) -> dict[str, torch.Tensor]:
        return numpy_to_state(handle)


def make_batcher(backend: str, model_cfg, max_num_seqs: int, worker: int, gpus: float = 1.0,
                 kv_cache_gib: float = 1.0):
    """A worker's scheduler: the built-in `ContinuousBatcher` ('batcher') or vLLM ('vllm'), both
    with submit / has_work / step / reset / update_weights / version / device."""
    if backend == "vllm":
        from periodic_async.engine.vllm_engine import VLLMBatcher

        return VLLMBatcher(model_cfg, max_num_seqs, worker=worker, kv_cache_gib=kv_cache_gib, gpu_share=gpus)
    from periodic_async.engine.batcher import ContinuousBatcher
    from periodic_async.model import load_policy

    model, tokenizer = load_policy(model_cfg)
    return ContinuousBatcher(model, tokenizer, max_num_seqs, worker=worker)


class EngineWorker:
    """Actor body: one batcher (`make_batcher`). max_concurrency=2 lets `abort` and `info` run
    beside `generate`; a lock keeps a new `generate` (or `update_weights`) from overlapping the
    tail of an aborted one, and `abort` names the call it stops so it cannot hit a later one."""

    def __init__(self, model_cfg, max_num_seqs: int, worker: int, threads: int, backend: str = "batcher",
                 gpus: float = 0.0, kv_cache_gib: float = 1.0, cores: list[int] | None = None):
        pin_process(cores)  # engine.cpu_affinity (parallel/affinity.py): before any compute thread starts
        torch.set_num_threads(threads)
        self.batcher = make_batcher(backend, model_cfg, max_num_seqs, worker, gpus, kv_cache_gib)
        self.sync = ObjectStoreSync()
        self._lock = threading.Lock()
        self._aborted = -1

    def info(self) -> dict:
        """pid, version, threads, device, the cores it may run on (cpu_affinity), and the Ray node
        it runs on (node_id, node_ip)."""
        return dict(pid=os.getpid(), version=self.batcher.version, threads=torch.get_num_threads(),
                    cpu_affinity=available_cores(),
                    device=str(self.batcher.device), node_id=ray.get_runtime_context().get_node_id(),
                    node_ip=ray.util.get_node_ip_address())

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
            probe = getattr(self.batcher, "probe_logprobs", None)
            if probe is not None:
                return probe(token_ids)
            from periodic_async.engine.verify import model_logprobs

            return model_logprobs(self.batcher.model, token_ids)


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
        if engine_cfg.worker_backend == "auto":  # the rule: vllm_engine.resolve_worker_backend
            from periodic_async.engine.vllm_engine import resolve_worker_backend

            chosen = resolve_worker_backend(engine_cfg, model_cfg)
            log.info("engine.worker_backend=auto: %s for %s", chosen, model_cfg.name_or_path)
            engine_cfg = dataclasses.replace(engine_cfg, worker_backend=chosen)
        if engine_cfg.worker_backend == "vllm" and model_cfg.lora.enabled:  # before any worker starts
            from periodic_async.engine.vllm_engine import vllm_lora_rank

            vllm_lora_rank(model_cfg.lora)
        self.cfg = engine_cfg
        self.timeout_s = engine_cfg.timeout_s
        self._owns_ray = init_ray(engine_cfg)
        self.sync = sync or ObjectStoreSync()
        self._version = 0
        self._weights = None  # handle of the weights of `_version`: restarted and added workers load it
        self._active = False
        self._calls = 0
        self.last_sync: dict[str, float] = {}
        self.restarts_left = engine_cfg.restart_workers
        self.restarts: list[dict] = []
        """One record per restarted worker: worker, old_pid, new_pid, version, resent (request ids), reason."""
        self._schedule = dict(sorted(engine_cfg.num_workers_schedule.items()))
        self._scheduled_through = -1  # schedule entries up to this version have been applied
        gpus = engine_cfg.gpus_per_worker
        if gpus is None:
            gpus = 1 if model_cfg.device.startswith("cuda") or (
                model_cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0) else 0
        self.gpus = float(gpus)
        self.cores = engine_cores(engine_cfg, on_cpu=not gpus)
        """Each worker's cores (engine.cpu_affinity), by index; None: left to the OS."""
        threads = engine_cfg.threads_per_worker
        self._actor = ray.remote(EngineWorker)
        env = {**_offline_env(), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        if engine_cfg.worker_backend == "vllm":
            # vLLM's engine core inside the actor's process: its reload and probes reach the model,
            # and the forward runs on the worker's torch threads (no OpenMP binding of vLLM's own)
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
            from periodic_async.engine.vllm_engine import warn_truncated_logprobs

            warn_truncated_logprobs(engine_cfg)
        self._actor_options = dict(max_concurrency=2, max_restarts=0, runtime_env={"env_vars": env})
        cfg = _absolute_paths(model_cfg)
        if gpus:  # Ray shows each actor its own GPU (or its share of one) as cuda:0
            cfg = dataclasses.replace(cfg, device="cuda")
        elif cfg.device.startswith("cuda"):  # gpus_per_worker=0: the workers hold no GPU
            cfg = dataclasses.replace(cfg, device="cpu")
        self._model_cfg = cfg
        self.workers: list = []
        self.pids: list[int] = []
        """OS process id of each worker (updated when one is restarted)."""
        self.groups: list = []
        """The placement group of each worker (None once removed)."""
        try:
            self._start(range(engine_cfg.num_workers), None, 0)
            if hasattr(self.sync, "attach"):  # a collective sync forms its process group with the workers
                self.sync.attach(self.workers)
        except BaseException:  # an EngineError, or a ConfigError from attach: no actor outlives the failure
            self.close()
            raise

    @property
    def version(self) -> int:
        return self._version

    def info(self) -> list[dict]:
        """pid, version, threads, device and Ray node (node_id, node_ip) of every worker."""
        return ray.get([w.info.remote() for w in self.workers], timeout=self.timeout_s)

    def stats(self) -> dict[str, float]:
        return {"engine/workers": len(self.workers), "engine/worker_restarts": len(self.restarts),
                "engine/requests_resent": sum(len(r["resent"]) for r in self.restarts)}

    # --- workers: start, restart, add, remove ---------------------------------------------

    def _bundle(self, n: int) -> dict[str, float]:
        """The placement-group bundle of each of `n` workers about to start."""
        cpus = self.cfg.cpus_per_worker
        if cpus is None:  # all threads if the cluster has them free for all n, else share the cores
            threads = self.cfg.threads_per_worker
            cpus = threads if ray.available_resources().get("CPU", 0) >= threads * n else 0
        bundle = {"CPU": float(cpus)} if cpus else {}
        if self.gpus:
            bundle["GPU"] = self.gpus
        return bundle or dict(TOKEN_BUNDLE)

    def _place(self, indices: list[int], bundle: dict[str, float]) -> dict:
        """One placement group per worker, placed within `placement_timeout_s`, or EngineError
        naming the first worker left unplaced (all of this call's groups are then removed)."""
        strategy, timeout = self.cfg.placement_strategy, self.cfg.placement_timeout_s
        groups = {w: placement_group([bundle], strategy=strategy) for w in indices}
        ready = {g.ready(): w for w, g in groups.items()}
        done, _ = ray.wait(list(ready), num_returns=len(ready), timeout=timeout)
        if len(done) < len(ready):
            w = min(w for ref, w in ready.items() if ref not in done)
            message = (f"did not start: its placement group (bundle {bundle}, strategy {strategy}) was not placed "
                       f"within {timeout:g} s (engine.placement_timeout_s); the cluster has {_resources(bundle)}. "
                       "Lower engine.gpus_per_worker / cpus_per_worker or num_workers, or add nodes")
            for g in groups.values():
                _remove_group(g)
            raise EngineError(message, w)
        return groups

    def _start(self, indices, handle, version: int) -> None:
        """Start workers at `indices` (replacing what is there: its placement group is removed
        first) and load `handle` as `version` (None: the initial weights, version 0) before they
        take any request."""
        threads = self.cfg.threads_per_worker
        indices = list(indices)
        if not indices:
            return
        for w in indices:
            if w < len(self.groups):
                _remove_group(self.groups[w])
                self.groups[w] = None
        bundle = self._bundle(len(indices))
        groups = self._place(indices, bundle)
        options = dict(self._actor_options, num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                       memory=bundle.get("memory"))
        new = {w: self._actor.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(groups[w], 0))
               .remote(self._model_cfg, self.cfg.max_num_seqs, w, threads, self.cfg.worker_backend, self.gpus,
                       self.cfg.vllm_kv_cache_gib, self.cores[w] if self.cores and w < len(self.cores) else None)
               for w in indices}
        for w in indices:
            if w < len(self.workers):
                self.workers[w], self.groups[w] = new[w], groups[w]
            else:
                self.workers.append(new[w])
                self.groups.append(groups[w])
                self.pids.append(0)
        startup_s = max(self.timeout_s, STARTUP_TIMEOUT_S)  # importing torch on a loaded machine is slow
        for w in indices:
            try:
                self.pids[w] = ray.get(new[w].info.remote(), timeout=startup_s)["pid"]
                if handle is not None:
                    ray.get(new[w].update_weights.remote(handle, version), timeout=self.timeout_s)
            except Exception as e:
                raise EngineError(f"did not start: {_describe(e)}", w) from e

    def _restart(self, w: int, reason: str, resent: list[str]) -> None:
        """Replace dead worker `w` by a new one holding the current version; the caller re-sends
        `resent`. Raises EngineError when no restart is left."""
        if self.restarts_left <= 0:
            raise EngineError(reason, w, resent)
        if hasattr(self.sync, "attach"):  # a collective sync's process group cannot take a new member
            raise EngineError(f"{reason}; not restarted: restarts need the object-store weight sync", w, resent)
        self.restarts_left -= 1
        old_pid = self.pids[w]
        try:
            ray.kill(self.workers[w])
        except Exception:
            pass
        self._start([w], self._weights, self._version)
        self.restarts.append(dict(worker=w, old_pid=old_pid, new_pid=self.pids[w], version=self._version,
                                  resent=list(resent), reason=reason))
        log.warning("engine: worker %d (pid %d) %s; restarted as pid %d at version %d, re-sending %d requests: %s "
                    "(%d restarts left)", w, old_pid, reason, self.pids[w], self._version, len(resent),
                    ", ".join(resent[:8]) + (" ..." if len(resent) > 8 else ""), self.restarts_left)

    def add_workers(self, n: int) -> None:
        """Start `n` more workers holding the current version (between iterations only)."""
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("add_workers during generate(): resize at an iteration boundary")
        if n < 0:
            raise ValueError(f"add_workers({n}): n must be >= 0")
        if n and hasattr(self.sync, "attach"):
            raise RuntimeError("add_workers needs the object-store weight sync (a collective group is fixed)")
        self._start(range(len(self.workers), len(self.workers) + n), self._weights, self._version)
        log.info("engine: %d workers (added %d at version %d)", len(self.workers), n, self._version)

    def remove_workers(self, n: int) -> None:
        """Stop the `n` highest-numbered workers (between iterations only); one always stays."""
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("remove_workers during generate(): resize at an iteration boundary")
        if not 0 <= n < len(self.workers):
            raise ValueError(f"remove_workers({n}): must leave at least one of {len(self.workers)} workers")
        for _ in range(n):
            worker = self.workers.pop()
            self.pids.pop()
            ray.kill(worker)
            _remove_group(self.groups.pop())
        log.info("engine: %d workers (removed %d at version %d)", len(self.workers), n, self._version)

    def scheduled_workers(self, version: int) -> int:
        """Workers for `version`: the last `engine.num_workers_schedule` entry that comes due with
        it (an entry at v is due at the first push of a version >= v), else today's count, so
        a resize by `add_workers` / `remove_workers` stands until the schedule says otherwise."""
        due = [n for v, n in self._schedule.items() if self._scheduled_through < v <= version]
        return due[-1] if due else len(self.workers)

    # --- generation ----------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> Iterator[RequestOutput]:
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("one generate() at a time")
        self._active = True
        call = self._calls = self._calls + 1
        streams: dict = {}
        try:
            held: dict[int, dict[str, Request]] = {}  # per worker, the requests it has not returned yet
            for w, r in zip(assign_workers(requests, len(self.workers)), requests):
                held.setdefault(w, {})[r.request_id] = r
            streams = {w: self._stream(w, rs, call) for w, rs in held.items()}
            silent = dict.fromkeys(streams, 0.0)  # seconds spent waiting on each worker since its last result
            pinged: dict[int, tuple[float, ray.ObjectRef]] = {}  # liveness pings in flight

            def died(w: int, e: Exception) -> None:
                """Worker w failed with e: restart it and re-send what it held, or raise. A worker
                that died after returning all its requests ends its stream: the next push or
                generate finds it dead (and restarts or names it)."""
                if not isinstance(e, ray.exceptions.RayActorError):
                    raise EngineError(_describe(e), w, list(held[w])) from e
                if not held[w]:
                    log.warning("engine: worker %d (pid %d) %s after returning all its requests", w, self.pids[w],
                                _describe(e))
                    del streams[w]
                    return
                try:
                    self._restart(w, _describe(e), list(held[w]))
                except EngineError as err:
                    raise err from e
                streams[w] = self._stream(w, held[w], call)
                silent[w] = 0.0
                pinged.pop(w, None)

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
                        if held[w]:
                            raise EngineError("stream ended before all requests were done", w, list(held[w]))
                        continue
                    except Exception as e:
                        died(w, e)
                        continue
                    if out.version != self._version:
                        raise EngineError(f"version {out.version} != engine version {self._version}", w,
                                          [out.request_id])
                    del held[w][out.request_id]
                    silent[w] = 0.0
                    pinged.pop(w, None)
                    yield out
                self._check_alive(streams, silent, pinged, held, died)
        finally:
            for w in streams:  # abandoned or failed: stop the others (best effort)
                try:
                    self.workers[w].abort.remote(call)
                except Exception:
                    pass
            self._active = False

    def _stream(self, w: int, requests: dict[str, Request], call: int):
        return self.workers[w].generate.options(num_returns="streaming").remote(list(requests.values()), call)

    def _check_alive(self, streams, silent, pinged, held, died) -> None:
        """Timeout, and actor death not yet reported on the stream: a dead actor fails a ping at once."""
        for w in list(streams):
            if silent[w] > self.timeout_s:
                raise EngineError(f"no result for {self.timeout_s:.0f} s (timeout_s)", w, list(held[w]))
            if w in pinged:
                sent_at, ref = pinged[w]
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    try:
                        ray.get(ref)
                    except Exception as e:
                        died(w, e)
                        continue
                    if silent[w] - sent_at > PING_AFTER_S:
                        del pinged[w]  # alive; ping again later
            elif silent[w] > PING_AFTER_S:
                pinged[w] = (silent[w], self.workers[w].info.remote())

    # --- the barrier ---------------------------------------------------------------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Resize to `scheduled_workers(version)` (new workers load these weights), load them on
        every worker; a worker found dead here is restarted if `restart_workers` allows."""
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("update_weights during generate() would mix versions")
        t = time.perf_counter()
        handle = self.sync.publish(state_dict, version)
        t_pub = time.perf_counter()
        target = self.scheduled_workers(version)
        self._scheduled_through = version
        if target < len(self.workers):
            self.remove_workers(len(self.workers) - target)
        refs = [w.update_weights.remote(handle, version) for w in self.workers]
        load_s = []
        for w, ref in enumerate(refs):
            try:
                load_s.append(ray.get(ref, timeout=self.timeout_s))
            except ray.exceptions.RayActorError as e:
                self._restart(w, f"update_weights: {_describe(e)}", [])  # the new worker loads `handle` below
                ray.get(self.workers[w].update_weights.remote(handle, version), timeout=self.timeout_s)
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
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("probe_logprobs during generate()")
        refs = [w.probe_logprobs.remote(list(token_ids)) for w in self.workers]
        out = {}
        for w, ref in enumerate(refs):
            try:
                out[w] = ray.get(ref, timeout=self.timeout_s)
            except Exception as e:
                raise EngineError(f"probe after the push of version {self._version}: {_describe(e)}", w) from e
        return out

    def close(self) -> None:
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w)
            except Exception:
                pass
        for g in getattr(self, "groups", []):
            _remove_group(g)
        self.workers, self.groups = [], []
        self._weights = None
        if hasattr(self.sync, "close"):
            self.sync.close()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def _remove_group(group) -> None:
    """Remove a placement group (its actors die with it); best effort: None, removed or Ray gone."""
    if group is None or not ray.is_initialized():
        return
    try:
        remove_placement_group(group)
    except Exception:
        pass


def _resources(bundle: dict[str, float]) -> str:
    """The cluster's available and total CPUs, GPUs and custom resources (not memory, nodes,
    groups), the bundle's own resources always included (0 where the cluster has none)."""
    def keep(res: dict) -> dict:
        return {k: round(v, 3) for k, v in res.items()
                if "memory" not in k and not k.startswith("node:") and "_group_" not in k}

    total, free = keep(ray.cluster_resources()), keep(ray.available_resources())
    return ", ".join(f"{k} {free.get(k, 0):g} available of {total.get(k, 0):g}" for k in sorted({*total, *bundle}))


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
