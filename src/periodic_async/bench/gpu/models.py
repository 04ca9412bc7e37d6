"""The models the GPU check builds: random-weight Qwen2.5 architectures (`common.ARCHS`, shrunk
with --toy) on the device, with our tokenizer's special ids, and their FLOPs per token (the MFU's
numerator, as the package docstring defines it)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from periodic_async.bench.gpu.common import ARCHS, TOY_ARCH
from periodic_async.data.tokenizer import ensure_tokenizer
from periodic_async.model import num_parameters


def tokenizer_at(work: Path):
    """Our tokenizer, built once under the work directory (`--work`)."""
    return ensure_tokenizer(work / "tokenizer")


def arch_config(name: str, tokenizer, toy: bool):
    """The transformers Qwen2Config of architecture `name` (shrunk with toy), our tokenizer's special ids."""
    if name not in ARCHS:
        raise ValueError(f"architecture {name!r}: expected one of {sorted(ARCHS)}")
    spec = {**ARCHS[name], **(TOY_ARCH if toy else {})}
    if spec["vocab_size"] < len(tokenizer):
        raise ValueError(f"{name}: vocab_size {spec['vocab_size']} < tokenizer size {len(tokenizer)}")
    conf = AutoConfig.for_model("qwen2", pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                bos_token_id=None, **spec)
    conf._attn_implementation = "sdpa"
    return conf


def arch_model(name: str, tokenizer, device: torch.device, dtype: torch.dtype, toy: bool, seed: int = 0):
    """A random-weight model of architecture `name`, initialised directly on `device`."""
    conf = arch_config(name, tokenizer, toy)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(device)


def body_parameters(model) -> int:
    """Parameters outside the (tied or not) embedding and LM head matrices."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return num_parameters(model) - emb.numel() - (0 if head is emb else head.numel())


def forward_flops(model, tokens: int, labels: int) -> float:
    """Model FLOPs of one forward (package docstring): 2 x body params x tokens + 2 x D x V x labels."""
    D, V = model.config.hidden_size, model.config.vocab_size
    return 2.0 * body_parameters(model) * tokens + 2.0 * D * V * labels
