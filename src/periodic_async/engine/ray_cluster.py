"""Ray start-up and the placement of the engine workers of ray_engine.py (the paper's separate
inference workers: what each one holds of the cluster).

`init_ray` starts Ray on this machine (loopback only, no dashboard) or joins `engine.ray_address`,
and leaves the caller's SIGTERM handler in place. `Placement` gives every worker a placement group
of its own, one bundle {CPU: engine.cpus_per_worker, GPU: engine.gpus_per_worker}, and its cores
(engine.cpu_affinity). A bundle the cluster cannot place within engine.placement_timeout_s is an
EngineError naming the worker, the bundle and the cluster's resources, with none of the call's
groups left behind. How and why: docs/scaling.md ("Where engine workers run").

GPUs: an engine worker never lands on a GPU a trainer rank of this machine uses, unless they are
meant to share (`engine.share_trainer_gpus`: by default only in pipeline.mode=sync-colocated). Ray
started here is shown only the other GPUs (`engine_gpus`: CUDA_VISIBLE_DEVICES for its start), and
workers that need a GPU when none is left stop the run at start-up with a ConfigError. A cluster
joined by address places workers on the GPUs its nodes were started with (docs/gpu.md).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from periodic_async.config import ConfigError
from periodic_async.engine.base import EngineError
from periodic_async.parallel.affinity import engine_cores

TOKEN_BUNDLE = {"memory": float(2**20)}
"""The bundle of a worker that reserves no CPU and no GPU: 1 MiB of Ray's `memory` resource (Ray
refuses an empty bundle, and a token CPU would not fit once every CPU is reserved)."""


def offline_env() -> dict[str, str]:
    """The Hugging Face offline switches of this process, for Ray's workers."""
    return {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if k in os.environ}


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """This process's CUDA devices as CUDA_VISIBLE_DEVICES names them (its entries when set, else 0..n-1)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def trainer_gpus(device: str, env: Mapping[str, str], gpus: int) -> list[int]:
    """Indices into `visible_gpus` of the GPUs the trainer ranks of this machine use: under torchrun
    (WORLD_SIZE > 1) local ranks 0..LOCAL_WORLD_SIZE-1, each on its LOCAL_RANK (parallel/distributed.py),
    else `model.device`'s ('cuda' and 'auto': device 0). None of them when the trainer is not on CUDA."""
    kind = device.split(":")[0]
    if kind not in ("cuda", "auto") or gpus == 0:
        return []
    if int(env.get("WORLD_SIZE", "1")) > 1:
        return list(range(min(gpus, int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))))
    return [int(device.split(":")[1])] if ":" in device else [0]


def engine_gpus(engine_cfg, model_cfg, env: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs of this machine (CUDA_VISIBLE_DEVICES entries) that engine workers may take: every
    visible one when they share the trainer's (`engine.share_trainer_gpus`), else those no trainer
    rank uses (`trainer_gpus`)."""
    visible = visible_gpus(env)
    if engine_cfg.share_trainer_gpus:
        return visible
    taken = set(trainer_gpus(model_cfg.device, env, len(visible)))
    return [g for i, g in enumerate(visible) if i not in taken]


def check_engine_gpus(engine_cfg, model_cfg, gpus: float, env: Mapping[str, str] = os.environ) -> None:
    """ConfigError when workers of `gpus` GPUs each would have to share a trainer rank's GPU."""
    visible = visible_gpus(env)
    if not gpus or not visible or engine_gpus(engine_cfg, model_cfg, env):
        return
    ranks = (f"{env.get('LOCAL_WORLD_SIZE', env.get('WORLD_SIZE'))} torchrun ranks"
             if int(env.get("WORLD_SIZE", "1")) > 1 else f"model.device={model_cfg.device}")
    raise ConfigError(f"engine.gpus_per_worker={gpus:g}: no GPU is left for the engine workers: this machine's "
                      f"GPUs {','.join(visible)} run the trainer ({ranks}), and an engine worker never runs on the "
                      "same accelerator as a trainer rank outside pipeline.mode=sync-colocated. Run fewer trainer "
                      "ranks, set engine.share_trainer_gpus=true to share them, or engine.gpus_per_worker=0 to run "
                      "the workers on CPU")


def init_ray(engine_cfg, model_cfg=None) -> bool:
    """Start Ray locally (or join `engine_cfg.ray_address`) unless it is running; True if we started it.
    A local start on a machine with GPUs, given the run's `model_cfg`, shows Ray only `engine_gpus`."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts workers at nice 15: beside any busy nice-0 process (the trainer, Ray's own
    # agents) an engine worker then gets a few % of a core (generation many times slower:
    # docs/scaling.md). Inference workers are the job, not background work: same priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    common = dict(log_to_driver=False, logging_level=logging.WARNING, runtime_env={"env_vars": offline_env()})
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
            gpus, visible = {}, os.environ.get("CUDA_VISIBLE_DEVICES")
            if model_cfg is not None and visible_gpus(os.environ):  # Ray takes its GPUs from this at start
                allowed = engine_gpus(engine_cfg, model_cfg)
                gpus = dict(num_gpus=len(allowed))
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(allowed)
            try:
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                         _node_ip_address="127.0.0.1", **gpus, **common)
            finally:
                if gpus and visible is None:
                    del os.environ["CUDA_VISIBLE_DEVICES"]
                elif gpus:
                    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node
    if callable(sigterm):
        signal.signal(signal.SIGTERM, sigterm)
    return True


@dataclass
class Placement:
    """What every worker of one engine reserves (Ray must be running): its GPU share, its bundle,
    its placement group and its cores."""

    cfg: object
    """The engine config (placement_strategy, placement_timeout_s, cpus_per_worker, threads_per_worker)."""
    gpus: float
    """Each worker's GPU share (engine.gpus_per_worker, or 1 / 0 by the model's device)."""
    cores: list[list[int]] | None
    """Each worker's cores (engine.cpu_affinity), by index; None: left to the OS."""

    @classmethod
    def from_config(cls, engine_cfg, model_cfg) -> "Placement":
        gpus = engine_cfg.gpus_per_worker
        if gpus is None:
            gpus = 1 if model_cfg.device.startswith("cuda") or (
                model_cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0) else 0
        if engine_cfg.ray_on_this_machine:
            check_engine_gpus(engine_cfg, model_cfg, gpus)
        return cls(engine_cfg, float(gpus), engine_cores(engine_cfg, on_cpu=not gpus))

    def cores_of(self, w: int) -> list[int] | None:
        """Worker `w`'s cores (None: left to the OS)."""
        return self.cores[w] if self.cores and w < len(self.cores) else None

    def bundle(self, n: int) -> dict[str, float]:
        """The placement-group bundle of each of `n` workers about to start."""
        cpus = self.cfg.cpus_per_worker
        if cpus is None:  # all threads if the cluster has them free for all n, else share the cores
            threads = self.cfg.threads_per_worker
            cpus = threads if ray.available_resources().get("CPU", 0) >= threads * n else 0
        bundle = {"CPU": float(cpus)} if cpus else {}
        if self.gpus:
            bundle["GPU"] = self.gpus
        return bundle or dict(TOKEN_BUNDLE)

    def place(self, indices: list[int], bundle: dict[str, float]) -> dict[int, PlacementGroup]:
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
                remove_group(g)
            raise EngineError(message, w)
        return groups


def actor_options(bundle: dict[str, float], group: PlacementGroup) -> dict:
    """The Ray actor options that run a worker inside `group` with the resources of `bundle`."""
    return dict(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), memory=bundle.get("memory"),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0))


def remove_group(group) -> None:
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
