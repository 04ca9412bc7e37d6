"""The one setting of the LoRA experiments (experiments/lora_*.py and async_speedup.py's `lora`
setting): SmolLM2-135M-Instruct in fp32 on the CPU, LoRA r=16 (alpha 32) on all seven linear
projections, against full fine-tuning of the same model.

    cfg = model_config(MODEL, lora=True)                  # a ModelConfig, for in-process measurements
    load_config(RunConfig, yaml, RUN_OVERRIDES + [...])   # the same adapter in a pipeline run

RUN_OVERRIDES push the merged model (model.lora.push=merged): vLLM's CPU build samples far slower
through an adapter than without (gen_tok_s in results/lora_push.csv), and the samples are the same.
"""

from __future__ import annotations

from periodic_async.config import LoRAConfig, ModelConfig

MODEL = "artifacts/smollm2-135m-instruct"
"""`python -m periodic_async prepare-model smollm2-135m` writes it."""
RANK, ALPHA = 16, 32.0
RUN_OVERRIDES = ["model.lora.enabled=true", "model.lora.push=merged", f"model.lora.rank={RANK}",
                 f"model.lora.alpha={ALPHA}"]
"""LoRA in a pipeline run (`section.key=value` for `load_config`), the merged push."""


def model_config(path: str, lora: bool) -> ModelConfig:
    """The policy of a measurement in this process: `path` in fp32 on the CPU, with the adapter or without."""
    return ModelConfig(name_or_path=path, tokenizer=path, device="cpu", dtype="float32",
                       lora=LoRAConfig(enabled=lora, rank=RANK, alpha=ALPHA))
