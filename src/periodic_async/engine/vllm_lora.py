"""vLLM's side of a LoRA push (model.lora.enabled on the vllm engine); the adapter itself is lora.py's.

vLLM starts with `enable_lora`, `max_loras=1` and `max_lora_rank` the smallest rank vLLM offers
>= model.lora.rank (a rank above 512 is a ConfigError before anything starts). Every push is the
adapter alone, checked against the adapter `lora.apply_lora` puts on the base
(`lora.check_adapter`) before anything is loaded. It is built in memory, no file: a
`LoRAModel.from_lora_tensors` of copies of the pushed tensors (vLLM scales lora_B in place, and
must not scale the caller's) is added to the worker's LoRA manager under a new LoRA id, the
previous adapter removed, and every request and probe from then on carries a `LoRARequest` of that
id (its path names no file: vLLM never loads it, the id is registered already). vLLM's private
names are used in `_add_adapter` alone. vLLM's own path, a LoRARequest naming a saved adapter
directory, reads the files at the first request that uses it.
"""

from __future__ import annotations

import time

import torch

from periodic_async.config import ConfigError
from periodic_async.lora import check_adapter, model_adapter_spec

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM 0.32 accepts (its MaxLoRARanks); an adapter of a smaller rank
is served in the next larger slot (zero-padded)."""
IN_MEMORY = "in-memory"
"""The lora_path of the LoRA requests of pushed adapters (vLLM requires one; no file is read)."""


def vllm_lora_rank(lora_cfg) -> int:
    """vLLM's max_lora_rank for model.lora.rank: the smallest of `VLLM_LORA_RANKS` >= it."""
    fits = [r for r in VLLM_LORA_RANKS if r >= lora_cfg.rank]
    if not fits:
        raise ConfigError(f"model.lora.rank={lora_cfg.rank}: the vllm engine cannot serve it (vLLM serves LoRA ranks "
                          f"up to {VLLM_LORA_RANKS[-1]}); use a smaller rank or the built-in engine "
                          "(engine.worker_backend=batcher)")
    return fits[0]


class VLLMAdapter:
    """The adapter one `vllm.LLM` serves. Built before vLLM starts (a rank vLLM cannot serve, or a
    target module the model lacks, is a ConfigError then); `llm_kwargs` are vLLM's start-up
    arguments; `request` is the LoRARequest every request and probe carries (None: the base, before
    the first push or after a failed one)."""

    def __init__(self, model_cfg):
        lora = model_cfg.lora
        self.llm_kwargs = dict(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(lora))
        self.spec = model_adapter_spec(model_cfg)
        self.peft_config = dict(r=lora.rank, lora_alpha=lora.alpha, bias="none",
                                target_modules=list(lora.target_modules))
        self.request = None
        self.ids = 0

    def push(self, llm, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Serve `state_dict` as the adapter of `version`, under a new LoRA id; returns the
        seconds of each step (check_s, copy_s, build_s, add_s, activate_s)."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        check_adapter(state_dict, self.spec)  # before anything is loaded
        t1 = time.perf_counter()
        tensors = {k: v.detach().to(device="cpu", copy=True) for k, v in state_dict.items()}
        t2 = time.perf_counter()
        self.ids += 1
        try:
            steps = llm.collective_rpc(_add_adapter, args=(tensors, self.peft_config, self.ids))[0]
        except Exception:  # the previous adapter may be gone already: what vLLM holds now is the base
            self.request = None
            raise
        self.request = LoRARequest(f"policy-v{version}-{self.ids}", self.ids, lora_path=IN_MEMORY)
        return dict(check_s=t1 - t0, copy_s=t2 - t1, **steps)


def _add_adapter(worker, tensors: dict[str, torch.Tensor], peft_config: dict, lora_id: int) -> dict[str, float]:
    """Runs on vLLM's worker (`collective_rpc`): build the LoRA model `lora_id` from `tensors` in
    memory, as vLLM's loader does from a directory (`WorkerLoRAManager._load_adapter`, without the
    files), then make it the only adapter: the previous one removed, this one added (vLLM packs
    q/k/v and gate/up, folds the scale into lora_B) and activated (copied into the layers' slots).
    Raises when a pushed module is one vLLM does not serve. Returns the seconds of each step."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    t0 = time.perf_counter()
    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
                                       model_vocab_size=manager.vocab_size,
                                       weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                                       skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    t1 = time.perf_counter()
    manager.remove_all_adapters()
    adapters.add_adapter(lora)
    unserved = sorted(set(lora.loras) - set(adapters.modules))
    if unserved:
        manager.remove_all_adapters()
        raise ValueError(f"vLLM has no LoRA layer for {', '.join(unserved[:3])} (model.lora.target_modules)")
    t2 = time.perf_counter()
    adapters.activate_adapter(lora.id)
    t3 = time.perf_counter()
    return dict(build_s=t1 - t0, add_s=t2 - t1, activate_s=t3 - t2)
