"""Causal LMs: tiny Qwen2/Qwen3/Llama presets built from a config (random init), or any Hugging
Face causal LM from a local directory (a real one: `python -m periodic_async prepare-model
smollm2-135m`, prepare.py); device and dtype from config, nothing hard-codes CUDA.

Presets (vocabulary from the tokenizer, ~512 for ours; parameter counts with that vocab):
    qwen2-micro hidden 32, 2 layers   (~30K: fast tests, e.g. of bf16 on CPUs without bf16 units)
    qwen2-1m   hidden 128, 4 layers   (~0.9M)
    qwen2-5m   hidden 256, 6 layers   (~4.5M)
    qwen3-25m  hidden 512, 8 layers   (~24M, Qwen3 architecture with q/k norm)
    llama-micro hidden 48, 2 layers   (~70K: SmolLM2-135M's architecture down-scaled, Llama with 3:1
                                       grouped-query attention, RoPE theta 1e5, tied embeddings;
                                       the exactness tests of the real model's layout)
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from periodic_async.config import ConfigError, ModelConfig
from periodic_async.data.tokenizer import ensure_tokenizer, load_tokenizer
from periodic_async.lora import apply_lora

PRESETS: dict[str, dict] = {
    "qwen2-micro": dict(model_type="qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=64),
    "qwen2-1m": dict(model_type="qwen2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=384),
    "qwen2-5m": dict(model_type="qwen2", hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=704),
    "qwen3-25m": dict(model_type="qwen3", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, intermediate_size=1408),
    # SmolLM2-135M-Instruct: llama, hidden 576, 30 layers, 9 heads / 3 kv heads of 64, MLP 1536,
    # rope_theta 1e5, rms_norm_eps 1e-5, tied; here the same ratios at toy size
    "llama-micro": dict(model_type="llama", hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                        num_key_value_heads=1, head_dim=16, intermediate_size=128, rope_theta=100000.0,
                        rms_norm_eps=1e-5),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def resolve_device(name: str) -> torch.device:
    """'auto' picks cuda, then npu (torch_npu), then cpu."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "npu") and torch.npu.is_available():  # registered by torch_npu
        return torch.device("npu")
    return torch.device("cpu")


def resolve_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def preset_config(name: str, tokenizer: PreTrainedTokenizerBase, dtype: str = "float32"):
    """The transformers config of preset `name`, sized to `tokenizer`."""
    if name not in PRESETS:
        raise ConfigError(_not_a_model(name))
    spec = dict(PRESETS[name])
    model_type = spec.pop("model_type")
    spec = {"max_position_embeddings": 8192, "rope_theta": 10000.0, **spec}  # a preset may set its own
    return AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, torch_dtype=dtype, **spec,
    )


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A preset with random weights (seeded), or the HF model at `cfg.name_or_path`."""
    dtype, device = resolve_dtype(cfg.dtype), resolve_device(cfg.device)
    if Path(cfg.name_or_path).is_dir():
        model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, dtype=dtype,
                                                     attn_implementation=cfg.attn_implementation)
    else:
        conf = preset_config(cfg.name_or_path, tokenizer, cfg.dtype)
        conf._attn_implementation = cfg.attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(f"model {cfg.name_or_path!r} has vocab_size {model.config.vocab_size} < "
                         f"tokenizer size {len(tokenizer)} ({cfg.tokenizer!r})")
    if dtype == torch.float64:
        norms_in_input_dtype(model)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(device)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def norms_in_input_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """HF RMSNorms upcast to float32 and round back, which caps fp64 exactness at ~1e-8; in
    float64 models compute them in float64 (exactness tests, sync/async equivalence)."""
    import types

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_forward, module)
    return model


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
"""What a causal LM and its tokenizer need from a hub repository (weights as safetensors)."""


def _not_a_model(name_or_path: str, why: str = "") -> str:
    return (f"model.name_or_path={name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            f"nor an existing model directory (looked in {Path(name_or_path).resolve()}){why}")


def _hub_id(name: str) -> bool:
    """'name' or 'org/name' as the hub spells repository ids; a path ('./x', '/x', 'a/b/c') is not one."""
    import re

    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not name.startswith(".") and ".." not in name


def resolve_model_path(name_or_path: str) -> str:
    """What `model.name_or_path` loads: a preset name or an existing directory as it is; a Hugging
    Face hub id ('org/name', as TRL users pass) as the directory of its snapshot in the local
    Hugging Face cache, downloaded first (model and tokenizer files, `HUB_FILES`) when the hub is
    reachable and HF_HUB_OFFLINE is not set. Anything else is a ConfigError in one line that names
    the presets, the directory looked in and, for a hub id, why the cache could not serve it."""
    if name_or_path in PRESETS or Path(name_or_path).is_dir():
        return name_or_path
    if not _hub_id(name_or_path):
        raise ConfigError(_not_a_model(name_or_path))
    from huggingface_hub import constants, snapshot_download

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        path = snapshot_download(name_or_path, allow_patterns=HUB_FILES, local_files_only=offline)
    except Exception as e:  # noqa: BLE001 - not found, offline, gated, incomplete: one line for the user
        where = (f"not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1" if offline
                 else f"the hub did not serve it ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        raise ConfigError(_not_a_model(name_or_path, f", nor a hub model: {where}")) from None
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(_not_a_model(name_or_path, f", nor a hub model: its snapshot {path} has no config.json"))
    return str(path)


def load_policy(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Tokenizer and model of `cfg`. A model directory without `cfg.tokenizer` uses its own tokenizer;
    a hub id loads from its snapshot (`resolve_model_path`). With `cfg.lora.enabled` the model is a
    `peft.PeftModel` around it (`lora.apply_lora`, adapters initialised from `cfg.seed`)."""
    path = resolve_model_path(cfg.name_or_path)  # before a tokenizer is built for a model that is not there
    if path != cfg.name_or_path:
        cfg = dataclasses.replace(cfg, name_or_path=path)
    tokenizer = policy_tokenizer(cfg)
    model = build_model(cfg, tokenizer)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora, seed=cfg.seed)
    return model, tokenizer


def policy_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer `load_policy` gives: a model directory's own, else `cfg.tokenizer`."""
    model_dir = Path(resolve_model_path(cfg.name_or_path))
    if model_dir.is_dir() and (model_dir / "tokenizer_config.json").is_file():
        return load_tokenizer(model_dir)
    return ensure_tokenizer(cfg.tokenizer)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """`model` in eval mode inside the block, each module's own mode restored after it. Only the
    modules in training mode are switched: a model already in eval mode costs nothing, where
    `model.eval()` and `model.train()` walk every module (an adapter's peft layers add some 2,000). The
    flag is set as the plain attribute it is, past `Module.__setattr__`'s parameter and buffer checks."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        object.__setattr__(m, "training", False)
    try:
        yield model
    finally:
        for m in training:
            object.__setattr__(m, "training", True)


def checkpoint_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Activation checkpointing (`trainer.gradient_checkpointing`) of a HF causal LM: transformers'
    non-reentrant checkpointing of each decoder layer turned on (`activation_checkpointing_enable`
    in transformers 5.2x, `gradient_checkpointing_enable` before). Returns the checkpointed layers:
    transformers recomputes a layer in the backward only while the layer's own `training` flag is
    set, which `TriModel` sets for the policy's forward alone (no module's dropout is switched)."""
    import inspect

    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"trainer.gradient_checkpointing=true: {type(model).__name__} does not support "
                          "activation checkpointing")
    if "gradient_checkpointing_kwargs" in inspect.signature(enable).parameters:
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable()
    return [m for m in model.modules()
            if getattr(m, "gradient_checkpointing", False) is True and not isinstance(m, PreTrainedModel)]


def num_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
