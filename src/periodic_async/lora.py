"""LoRA (`model.lora`): low-rank adapters trained on the frozen policy, in one room. The model,
checkpoints, the consumer, the engines and the TRL shim call into this module; vLLM's side of a
push is engine/vllm_lora.py.

    policy = apply_lora(model, cfg.model.lora, seed)   # a peft PeftModel: the base frozen, the adapter trains
    state = adapter_state(policy)                      # a push: the adapter alone, in peft's names
    load_adapter(engine_model, state)                  # an engine takes it (checked first)
    weights = merge_lora(policy, policy.state_dict())  # the plain model's weights (checkpoint, merged push)

Guarantees:
- Trainer and engines build the same adapter: its initialisation (peft's: A random, B zero, so
  the adapted policy starts as the base) draws from a generator seeded with `model.seed`, the
  global RNG untouched. A target module the model lacks is one ConfigError line.
- A push is the adapter alone, named as `peft.get_peft_model_state_dict` names it. An engine
  checks the names, shapes and dtypes against its own adapter before it copies anything
  (`check_adapter`: one AdapterError line), then copies into the adapter's parameters in place.
- `merge_lora` is peft's `merge_and_unload` without touching the policy (tests/test_lora.py).
- TRL's `peft_config` maps onto `model.lora` field by field (`from_peft`); another peft method
  or LoRA variant is one ConfigError line naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable

import torch

from periodic_async.config import ConfigError, LoRAConfig


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft `PeftModel` (a LoRA policy); False when peft was never imported."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


# --- building, applying, merging -------------------------------------------------------------

def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The last name components of the model's `nn.Linear` modules, the output layer (lm_head)
    excluded: what `model.lora.target_modules` may name (peft's 'all-linear')."""
    inner = model.get_base_model() if is_lora(model) else model
    out = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, m in inner.named_modules()
             if isinstance(m, torch.nn.Linear) and m is not out and name}
    return sorted(names)


def peft_config(cfg: LoRAConfig):
    """The `peft.LoraConfig` of `cfg` (task CAUSAL_LM, bias 'none', peft's default initialisation:
    A random, B zero, so the adapted policy starts as the base model)."""
    from peft import LoraConfig, TaskType

    targets = "all-linear" if list(cfg.target_modules) == ["all-linear"] else list(cfg.target_modules)
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=targets, bias="none")


def apply_lora(model, cfg: LoRAConfig, seed: int = 0):
    """`model` wrapped as a `peft.PeftModel` with LoRA adapters on `cfg.target_modules`: the base
    weights frozen, the adapters trainable (float32 on a bfloat16/float16 base: peft's
    `autocast_adapter_dtype`; the base's dtype otherwise). The adapters' random initialisation
    draws from a generator seeded with `seed`, the global RNG untouched, so trainer and engines
    build the same adapter. A target module the model lacks is a ConfigError naming the field."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise ConfigError("model.lora.enabled=True: LoRA needs the peft package (pip install -e '.[lora]')") from None
    linear = linear_module_names(model)
    missing = [t for t in cfg.target_modules if t not in linear and t != "all-linear"]
    if missing:
        raise ConfigError(f"model.lora.target_modules={list(cfg.target_modules)!r}: the model has no linear module "
                          f"named {', '.join(missing)}; its linear modules are {', '.join(linear)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(cfg))


def merge_lora(policy, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged policy's weights, named as the plain model names them, from `state` (the
    PeftModel's whole state dict): each adapted weight W becomes W + scaling * B A (scaling =
    alpha / r, peft's, read from each layer), computed in float32 or wider and stored in W's
    dtype; the adapter tensors are left out. What `merge_and_unload()` gives, without touching
    the policy (tests/test_lora.py compares the two). What a checkpoint's model directory holds,
    and what a push carries with model.lora.push='merged' (`state` then a trainer rank's full
    state dict of the policy)."""
    from peft.tuners.lora import LoraLayer

    inner = policy.base_model.model  # the HF model, its LoRA layers injected
    adapter = policy.active_adapter
    prefix = "base_model.model."
    out = {}
    for name, t in state.items():
        if ".lora_" in name:
            continue
        name = name[len(prefix):] if name.startswith(prefix) else name
        out[name.replace(".base_layer.", ".")] = t
    for module_name, module in inner.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            a = state[f"{prefix}{module_name}.lora_A.{adapter}.weight"]
            b = state[f"{prefix}{module_name}.lora_B.{adapter}.weight"]
            w = out[f"{module_name}.weight"]
            wide = torch.promote_types(w.dtype, torch.float32)
            delta = module.scaling[adapter] * (b.to(wide) @ a.to(wide))
            out[f"{module_name}.weight"] = (w.to(wide) + delta.to(w.device)).to(w.dtype)
    return out


# --- the adapter's parameters and names ------------------------------------------------------

def trainable(policy) -> list[tuple[str, torch.nn.Parameter]]:
    """The policy's trainable (adapter) parameters, by the policy's names."""
    return [(n, p) for n, p in policy.named_parameters() if p.requires_grad]


_ADAPTER_PARAMETERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter] | None:
    """Name (as `peft.get_peft_model_state_dict` names it) -> the peft model's adapter
    parameter, found once per model (the parameter objects outlive `.to()`), so that a push reads
    and an engine writes the adapter without peft walking the whole model each time; None when
    a tensor peft hands back is not a parameter's storage (a copy into it would not reach the model)
    or storages cannot tell parameters apart (a model on the meta device: every address is 0)."""
    if model not in _ADAPTER_PARAMETERS:
        from peft import get_peft_model_state_dict

        own = {p.data_ptr(): p for p in model.parameters()}
        state = get_peft_model_state_dict(model)
        params = {n: own.get(t.data_ptr()) for n, t in state.items()}
        found = len(own) == sum(1 for _ in model.parameters()) and all(
            p is not None and p.shape == state[n].shape for n, p in params.items())
        _ADAPTER_PARAMETERS[model] = params if found else {}
    return _ADAPTER_PARAMETERS[model] or None


def adapter_names(policy) -> dict[str, str]:
    """{name in the adapter files (`get_peft_model_state_dict`'s): the policy's parameter name}
    of every trainable (adapter) parameter."""
    from peft import get_peft_model_state_dict

    params = dict(trainable(policy))
    by_id = {id(p): n for n, p in params.items()}
    files = get_peft_model_state_dict(policy, state_dict=params, save_embedding_layers=False)
    return {f: by_id[id(t)] for f, t in files.items()}


def adapter_state(policy, gathered: bool = False) -> dict[str, torch.Tensor]:
    """What a push carries: the adapter tensors of peft model `policy` alone, named as
    `peft.get_peft_model_state_dict` names them, copied to the CPU in their training dtype.
    `gathered`: the policy is sharded over trainer ranks (fsdp) and each tensor is gathered
    whole, a collective every rank joins."""
    if not gathered and (params := adapter_parameters(policy)) is not None:
        return {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
    from peft import get_peft_model_state_dict

    adapter = {n: p.detach() for n, p in trainable(policy)}
    if gathered:
        adapter = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in adapter.items()}
    state = get_peft_model_state_dict(policy, state_dict=adapter, save_embedding_layers=False)
    return {n: t.to("cpu", copy=True) for n, t in state.items()}


@contextlib.contextmanager
def swapped_in(policy, tensors: dict[str, torch.Tensor]):
    """`tensors` (by `trainable`'s names) in the policy's adapter for the duration: copied in, and
    the policy's own copied back after. Exact; no autograd graph may hold the adapter meanwhile
    (the tri-model's old forward)."""
    with torch.no_grad():
        adapter = trainable(policy)
        held = [p.detach().clone() for _, p in adapter]
        for n, p in adapter:
            p.copy_(tensors[n])
        try:
            yield
        finally:
            for (_, p), h in zip(adapter, held):
                p.copy_(h)


# --- the spec, its check, loading ------------------------------------------------------------

def adapter_spec(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """name -> shape of the LoRA adapter of peft model `model`, named as
    `peft.get_peft_model_state_dict` names it (what the trainer pushes with model.lora.enabled)."""
    from peft import get_peft_model_state_dict

    params = adapter_parameters(model) or get_peft_model_state_dict(model)  # the first: found once per model
    return {k: tuple(v.shape) for k, v in params.items()}


def model_adapter_spec(model_cfg) -> dict[str, tuple[int, ...]]:
    """name -> shape of the adapter `apply_lora` puts on the model in `model_cfg.name_or_path`:
    what every push must carry to an engine that holds no peft model (vLLM). Built on the meta
    device (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_cfg.name_or_path)
    with torch.device("meta"):
        return adapter_spec(apply_lora(AutoModelForCausalLM.from_config(config), model_cfg.lora))


def served_model(model_cfg):
    """The model config the engines build: `model_cfg` when they serve a LoRA adapter, else the
    plain model's (no LoRA settings: without LoRA, or with model.lora.push='merged', where the
    engines hold the plain model and take the merged weights). Equal for every run whose engines
    hold the same thing."""
    if model_cfg.lora.enabled and model_cfg.lora.push == "adapter":
        return model_cfg
    return dataclasses.replace(model_cfg, lora=type(model_cfg.lora)())


def _names(names, k: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:k]) + (f" (and {len(names) - k} more)" if len(names) > k else "")


class AdapterError(ValueError):
    """A push to an engine serving LoRA adapters that is not its adapter (one line, names what)."""


def check_adapter(state_dict: dict[str, torch.Tensor], spec: dict[str, tuple[int, ...]]) -> None:
    """Raise an AdapterError, one line, unless `state_dict` is exactly the adapter `spec`
    describes: the same names, the same shapes, floating-point tensors."""
    unknown, missing = set(state_dict) - set(spec), set(spec) - set(state_dict)
    if unknown or missing:
        parts = ([f"{len(unknown)} names not in the adapter: {_names(unknown)}"] if unknown else []) + \
                ([f"{len(missing)} adapter tensors missing: {_names(missing)}"] if missing else [])
        raise AdapterError("update_weights: the engine serves LoRA adapters (model.lora.enabled) and the pushed "
                           f"state dict is not this engine's LoRA adapter ({len(spec)} tensors named as "
                           "peft.get_peft_model_state_dict names them): " + "; ".join(parts))
    for name, t in state_dict.items():
        if tuple(t.shape) != spec[name]:
            raise AdapterError(f"update_weights: not this engine's LoRA adapter: {name} has shape {tuple(t.shape)}, "
                               f"the engine's adapter {spec[name]} (model.lora.rank and target_modules must match "
                               "the trainer's)")
        if not t.is_floating_point():
            raise AdapterError(f"update_weights: not this engine's LoRA adapter: {name} is {t.dtype}, "
                               "not a float tensor")


@torch.no_grad()
def load_adapter(model: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                 spec: dict[str, tuple[int, ...]] | None = None) -> None:
    """Copy the LoRA adapter `state_dict` (names of `peft.get_peft_model_state_dict`) into peft
    model `model` in place, after `check_adapter` (against `spec`, default `adapter_spec(model)`):
    a payload that is not the model's adapter raises before anything is copied. The copy goes
    straight into the adapter's parameters (found once per model), not through
    `peft.set_peft_model_state_dict`, which walks the whole model's state dict at every push. The
    adapter stays unmerged: the model computes base(x) + scale * B(A(x)) as the trainer's
    PeftModel does."""
    check_adapter(state_dict, adapter_spec(model) if spec is None else spec)
    params = adapter_parameters(model)
    if params is None:  # peft's own loader (a peft version whose state dict is not views)
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state_dict)
        if result.unexpected_keys:
            raise AdapterError(f"update_weights: peft did not load {_names(result.unexpected_keys)}")
        return
    for name, value in state_dict.items():
        params[name].copy_(value)


# --- TRL's peft_config -----------------------------------------------------------------------

PEFT_FIELDS = {"r": "model.lora.rank", "lora_alpha": "model.lora.alpha", "lora_dropout": "model.lora.dropout",
               "target_modules": "model.lora.target_modules"}
"""peft.LoraConfig fields mapped to model.lora (the others must be left at peft's defaults, or be
the bookkeeping fields in `PEFT_IGNORED`)."""
PEFT_IGNORED = ("task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                "inference_mode", "bias", "runtime_config")
"""peft.LoraConfig fields with nothing to map: bookkeeping, or checked on their own (bias 'none',
task_type None or CAUSAL_LM)."""


def from_peft(config, model_type: Callable[[], str | None]) -> LoRAConfig:
    """TRL's `peft_config` (a `peft.LoraConfig`) as `model.lora`: r, lora_alpha, lora_dropout and
    target_modules (a list of module names, 'all-linear', or None: peft's default for the model's
    architecture, `model_type()`, called only then). Anything else is one ConfigError line naming
    peft_config: another peft method, bias other than 'none', a task other than CAUSAL_LM, or a
    LoRA variant (any other field away from peft's default: DoRA, rsLoRA, other initialisations,
    modules_to_save, ...)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ConfigError("GRPOTrainer(peft_config=...): LoRA needs the peft package (pip install -e '.[lora]')") \
            from None
    name = type(config).__name__
    if not isinstance(config, LoraConfig):
        raise ConfigError(f"GRPOTrainer(peft_config=<{name}>): not supported here: only peft.LoraConfig (LoRA "
                          "adapters, which the engines take at every push)")
    if config.bias != "none":
        raise ConfigError(f"GRPOTrainer(peft_config=LoraConfig(bias={config.bias!r})): not supported here: "
                          "bias must be 'none' (only the LoRA matrices train)")
    task = getattr(config.task_type, "value", config.task_type)
    if task not in (None, "CAUSAL_LM"):
        raise ConfigError(f"GRPOTrainer(peft_config=LoraConfig(task_type={task!r})): expected 'CAUSAL_LM'")
    default = LoraConfig()
    for f in dataclasses.fields(config):
        if f.name in PEFT_FIELDS or f.name in PEFT_IGNORED:
            continue
        value, want = getattr(config, f.name), getattr(default, f.name)
        if value != want:
            raise ConfigError(f"GRPOTrainer(peft_config=LoraConfig({f.name}={value!r})): not supported here (LoRA "
                              f"takes r, lora_alpha, lora_dropout and target_modules); leave it at {want!r}")
    targets = config.target_modules
    if targets is None:
        targets = _default_targets(model_type())
    elif isinstance(targets, str):
        if targets != "all-linear":
            raise ConfigError(f"GRPOTrainer(peft_config=LoraConfig(target_modules={targets!r})): a regular expression "
                              "is not supported here: give a list of module names or 'all-linear'")
        targets = ["all-linear"]
    try:
        return LoRAConfig(enabled=True, rank=int(config.r), alpha=float(config.lora_alpha),
                          dropout=float(config.lora_dropout), target_modules=sorted(targets))
    except ConfigError as e:
        raise ConfigError(f"GRPOTrainer(peft_config=...): {e}") from None


def _default_targets(model_type: str | None) -> list[str]:
    """peft's default LoRA target modules for the architecture `model_type`, as peft picks them
    when target_modules is None."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    if model_type not in DEFAULTS:
        raise ConfigError(f"GRPOTrainer(peft_config=LoraConfig(target_modules=None)): peft has no default target "
                          f"modules for model type {model_type!r}: give target_modules (names, or 'all-linear')")
    return list(DEFAULTS[model_type])
