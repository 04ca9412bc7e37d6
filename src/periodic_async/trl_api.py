"""TRL's GRPO interface on this pipeline: a script written for TRL 1.16's `GRPOTrainer` runs here
with its import line changed.

    from periodic_async import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=[my_reward],
                          args=GRPOConfig(output_dir="out", max_steps=10, num_generations=4), train_dataset=ds)
    trainer.train()
    trainer.save_model("out/final")

What it is: `GRPOConfig` takes TRL's field names (with TRL's defaults) and maps each to a
`RunConfig` (`GRPOConfig.run_config`; the table is docs/trl.md); `GRPOTrainer` turns the dataset
and reward functions into a `pipeline.Task` and runs `pipeline.run`: the producer-consumer
pipeline of the paper (periodic-async by default, the shared prompt on), strictly on-policy.

Guarantees:
- Nothing is silently ignored. A TRL field is either mapped, accepted with no effect here
  (`NO_EFFECT`, each with the reason: the trainer prints the ones a script set), accepted only at
  the value that means what we do (`ONLY_DEFAULT`: another value is refused), or refused
  (`REFUSED`); a name that is none of these is refused too. Every refusal is one `ConfigError`
  line naming the field and why.
- The data are TRL's: a `prompt` column holding a text (tokenized as it is) or chat messages
  (through the tokenizer's chat template, with the generation prompt); every other column reaches
  the reward functions as TRL passes them.
- The rewards are TRL's: each function is called as TRL calls it, `f(prompts=, completions=,
  completion_ids=, trainer_state=, log_extra=, log_metric=, **columns)`, with `completions` as
  [{"role": "assistant", "content": text}] lists for conversational prompts; a coroutine function
  is awaited; None means "not applicable" (NaN): the weighted sum ignores it, a sample that no
  function scored is left out of its group's baseline and gets advantage 0 (TRL 1.16).
- The loss is TRL's where TRL's is defined on the whole batch ("dapo", "dr_grpo", "grpo") and the
  advantages are TRL's ((r - mean_G) / (std_G + 1e-4), unbiased std): tests/test_trl_api.py checks
  both against TRL's own GRPOTrainer on one batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from periodic_async.config import ConfigError, RunConfig, UserError, load_config
from periodic_async.data import DataError, Example

# --- the config ------------------------------------------------------------------------------

NO_EFFECT: dict[str, str] = {
    "logging_steps": "every iteration is logged (metrics.jsonl, W&B)",
    "logging_first_step": "every iteration is logged",
    "logging_strategy": "every iteration is logged",
    "logging_dir": "logs go under output_dir",
    "log_level": "no effect on what is logged",
    "log_completions": "every completion is written to <output_dir>/rollouts.jsonl",
    "num_completions_to_print": "completions are written to rollouts.jsonl, not printed",
    "per_device_train_batch_size": "counts completions in the generation batch (see generation_batch_size); "
                                   "micro-batches are one group each in periodic-async (training starts with the "
                                   "first group), algorithm.micro_batch_tokens otherwise: the gradient is the same",
    "per_device_eval_batch_size": "held-out prompts go through the engines as one batch",
    "gradient_checkpointing": "activations are kept (memory only: the numbers are the same)",
    "dataloader_num_workers": "prompts are tokenized once, in the producer",
    "dataloader_pin_memory": "no dataloader",
    "dataloader_drop_last": "every iteration takes a full batch of prompts (epoch-wise reshuffles)",
    "dataloader_persistent_workers": "no dataloader",
    "dataloader_prefetch_factor": "no dataloader",
    "remove_unused_columns": "every column reaches the reward functions",
    "vllm_mode": "the engines are separate workers (or in-process for sync-colocated); `mode` says which",
    "vllm_gpu_memory_utilization": "the KV cache is engine.vllm_kv_cache_gib (overrides=['engine.vllm_kv_cache_gib=...'])",
    "vllm_enable_sleep_mode": "separated engines keep their memory",
    "vllm_importance_sampling_correction": "strictly on-policy: every weight push is checked by log-probs, so the "
                                           "engines' and the trainer's log-probs agree within engine.verify_atol",
    "vllm_importance_sampling_mode": "see vllm_importance_sampling_correction",
    "vllm_importance_sampling_cap": "see vllm_importance_sampling_correction",
    "vllm_importance_sampling_clip_max": "see vllm_importance_sampling_correction",
    "vllm_importance_sampling_clip_min": "see vllm_importance_sampling_correction",
    "vllm_tensor_parallel_size": "one engine per worker; scale out with num_engine_workers",
    "vllm_max_model_length": "the model's own context",
    "run_name": "the W&B run is named <mode>-<output_dir name>",
    "overwrite_output_dir": "a fresh run replaces the logs and checkpoints in output_dir",
    "save_safetensors": "checkpoints are always safetensors",
    "save_only_model": "checkpoints hold the model plus the optimizer and RNG state needed to resume exactly",
    "ddp_find_unused_parameters": "trainer ranks use their own DDP/FSDP setup (trainer.parallel)",
    "ddp_timeout": "trainer ranks use their own timeouts",
    "eval_on_start": "held-out evaluation runs at version 0 when eval_steps divides 0 (always)",
    "torch_compile": "not compiled",
    "tf32": "the trainer keeps torch's default matmul precision",
    "do_train": "train() trains",
    "do_eval": "held-out evaluation follows eval_strategy",
    "prediction_loss_only": "no prediction loop",
    "skip_memory_metrics": "no memory metrics",
    "include_num_input_tokens_seen": "tokens/trained is always logged",
}
"""TRL / transformers fields accepted with no effect here, and why (docs/trl.md lists them)."""

ONLY_DEFAULT: dict[str, tuple[Any, str]] = {
    "num_iterations": (1, "each generation batch is trained once (one optimizer pass: on-policy); use "
                          "steps_per_generation for several optimizer steps per batch"),
    "num_generations_eval": (None, "held-out evaluation is one greedy sample per prompt"),
    "importance_sampling_level": ("token", "only token-level ratios (GRPO); sequence level (GSPO) is not implemented"),
    "multi_objective_aggregation": ("sum_then_normalize", "rewards are summed, then normalised per group"),
    "mask_truncated_completions": (False, "truncated completions are trained like the others"),
    "top_entropy_quantile": (1.0, "every completion token is trained"),
    "entropy_coef": (0.0, "no entropy bonus"),
    "use_adaptive_entropy": (False, "no entropy bonus"),
    "delta": (None, "no two-sided clipping"),
    "min_p": (None, "the engines sample with temperature, top_p and top_k only"),
    "repetition_penalty": (1.0, "the engines sample with temperature, top_p and top_k only"),
    "generation_kwargs": (None, "the engines sample with temperature, top_p and top_k only"),
    "cache_implementation": (None, "the engines keep their own KV cache"),
    "sync_ref_model": (False, "the reference model is the initial policy throughout"),
    "off_policy_mask_threshold": (None, "strictly on-policy: nothing to mask"),
    "use_bias_correction_kl": (False, "on-policy: the ratio is 1 where the KL is taken"),
    "vllm_server_base_url": (None, "the pipeline starts its own engines (engine.ray_address joins a Ray cluster)"),
    "vllm_structured_outputs_regex": (None, "no structured outputs"),
    "use_transformers_continuous_batching": (False, "generation is the engines' (vLLM or the built-in batcher)"),
    "use_transformers_paged": (False, "generation is the engines'"),
    "fp16": (False, "float16 training: set overrides=['model.dtype=float16']"),
    "push_to_hub": (False, "nothing leaves this machine: save_model writes a directory"),
    "shuffle_dataset": (True, "prompts are reshuffled every epoch (a pure function of seed and iteration)"),
    "chat_template_kwargs": (None, "the chat template is applied with its defaults"),
    "max_tool_calling_iterations": (None, "no tool calling"),
    "gradient_checkpointing_kwargs": (None, "activations are kept"),
    "model_init_kwargs": (None, "the model is loaded in the run's dtype (bf16) from its directory"),
    "auto_find_batch_size": (False, "the batch is fixed"),
    "label_smoothing_factor": (0.0, "no label smoothing in RL"),
    "disable_dropout": (False, "the model's own dropout is kept (the presets and SmolLM2 have none): set its "
                               "config's dropout probabilities to 0 to train without"),
}
"""Fields accepted at one value only (TRL's default: what we do); another value is refused with the reason."""

REFUSED: dict[str, str] = {
    "deepspeed": "trainer ranks are torchrun DDP/FSDP here (overrides=['trainer.parallel=fsdp'])",
    "fsdp": "use overrides=['trainer.parallel=fsdp'] under torchrun",
    "fsdp_config": "use overrides=['trainer.parallel=fsdp'] under torchrun",
    "peft_config": "LoRA/PEFT is not supported: the engines take full weights at every barrier",
    "reward_processing_classes": "reward models (nn.Module rewards) are not supported: pass reward functions",
    "callbacks": "no Trainer callbacks: the run writes metrics.jsonl, eval.jsonl, rollouts.jsonl and W&B",
    "optimizers": "the optimizer is AdamW (learning_rate, adam_*, weight_decay, lr_scheduler_type)",
    "rollout_func": "generation is the engines' (the pipeline schedules it)",
    "environment_factory": "no environments / tool calling",
    "tools": "no tool calling",
    "use_liger_kernel": "no Liger kernels",
    "vespo_k_pos": "loss_type='vespo' is not supported",
    "sapo_temperature_pos": "loss_type='sapo' is not supported",
    "sapo_temperature_neg": "loss_type='sapo' is not supported",
    "hub_model_id": "nothing leaves this machine",
    "resume_from_checkpoint": "pass it to train(resume_from_checkpoint=...)",
}
"""Fields refused whatever their value, and why."""

LOSS_TYPES = {"dapo": "token-mean", "dr_grpo": "constant", "grpo": "seq-mean"}
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


@dataclass
class GRPOConfig:
    """TRL 1.16's GRPOConfig names and defaults for what this pipeline does, plus our own settings
    (the last block). docs/trl.md maps each field; `run_config()` gives the `RunConfig`."""

    output_dir: str | None = None
    """Where the run writes (trainer.output_dir); None: 'trainer_output', as TRL."""
    # optimiser and schedule
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    """Optimizer steps of warm-up; a value below 1 is a fraction of the run (as transformers 5)."""
    warmup_ratio: float | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch"
    max_steps: int = -1
    num_train_epochs: float = 3.0
    # batch
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    num_generations: int = 8
    # generation
    max_prompt_length: int | None = None
    """A prompt longer than this many tokens stops the run at start-up (prompts are never cut here)."""
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # loss
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str | bool = "group"
    reward_weights: list[float] | None = None
    # run
    seed: int = 42
    bf16: bool | None = None
    """None: bfloat16 on an accelerator, float32 on CPU (bf16 is many times slower on most CPUs)."""
    use_cpu: bool = False
    report_to: str | list[str] | None = None
    """'wandb' / 'all' / None: W&B (offline unless WANDB_MODE=online); 'none': no W&B."""
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    use_vllm: bool = False
    """True: every engine worker runs vLLM; False: our choice (engine.worker_backend=auto: vLLM for
    models of VLLM_MIN_PARAMETERS and more when it is installed, else the built-in batcher)."""
    # ours
    mode: str = "periodic-async"
    """pipeline.mode: 'periodic-async' (the paper's), 'sync-separated', 'sync-colocated' (TRL's schedule)."""
    shared_prompt: bool = True
    """algorithm.shared_prompt: each group packed as [prompt | r_1 | ... | r_G] (the paper's shared prompt)."""
    num_engine_workers: int = 1
    engine_threads: int = 1
    """torch threads of each engine worker on CPU (engine.threads_per_worker)."""
    trainer_threads: int = 1
    """torch threads of the trainer on CPU (trainer.threads)."""
    accuracy_function: str | Callable | None = None
    """What `accuracy` and held-out `eval/accuracy` count (scores in [0, 1]): a function called as the
    reward functions are, or its 'module:function'; None: the math correctness reward when the dataset has an
    `answer` column, else accuracy is not computed (NaN)."""
    overrides: list[str] = field(default_factory=list)
    """Any other setting of the run, as `section.key=value` (the YAML/CLI names, config.py)."""
    no_effect: dict[str, Any] = field(default_factory=dict, repr=False)
    """The NO_EFFECT fields this config was given (filled by the constructor)."""

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.loss_type not in LOSS_TYPES:
            why = ("normalises by each micro-batch's own tokens, so the gradient depends on how the batch is split; "
                   "'dapo' normalises by the whole batch's" if self.loss_type == "bnpo" else "not implemented")
            raise ConfigError(f"GRPOConfig(loss_type={self.loss_type!r}): not supported here ({why}); "
                              f"expected one of {', '.join(LOSS_TYPES)}")
        if self.scale_rewards not in ("group", "none"):
            raise ConfigError(f"GRPOConfig(scale_rewards={self.scale_rewards!r}): not supported here (groups are scored "
                              "as they finish, before the batch's std exists); expected 'group' or 'none'")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ConfigError(f"GRPOConfig(lr_scheduler_type={self.lr_scheduler_type!r}): not supported here; expected "
                              f"one of {', '.join(SCHEDULERS)}")
        if not str(self.optim).startswith("adamw"):
            raise ConfigError(f"GRPOConfig(optim={self.optim!r}): not supported here (the optimizer is AdamW)")
        if self.save_strategy not in ("steps", "no"):
            raise ConfigError(f"GRPOConfig(save_strategy={self.save_strategy!r}): expected 'steps' or 'no'")
        if self.eval_strategy not in ("no", "steps"):
            raise ConfigError(f"GRPOConfig(eval_strategy={self.eval_strategy!r}): expected 'no' or 'steps'")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GRPOConfig({name}={getattr(self, name)!r}): must be >= 1")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ConfigError("GRPOConfig: generation_batch_size and steps_per_generation cannot both be set (TRL's rule)")

    # --- the mapping ------------------------------------------------------------------------

    @property
    def completions_per_generation(self) -> int:
        """TRL's generation batch: completions sampled per generation (B x G here)."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        return self.per_device_train_batch_size * _world_size() * (self.steps_per_generation or
                                                                   self.gradient_accumulation_steps)

    def optimizer_steps_per_generation(self) -> int:
        per_step = self.per_device_train_batch_size * _world_size() * self.gradient_accumulation_steps
        n = self.completions_per_generation
        if n % per_step:
            raise ConfigError(f"GRPOConfig: the generation batch ({n} completions) is not a whole number of optimizer "
                              f"steps of {per_step} (per_device_train_batch_size x processes x "
                              "gradient_accumulation_steps)")
        return n // per_step

    def prompts_per_generation(self) -> int:
        n, g = self.completions_per_generation, self.num_generations
        if n % g:
            raise ConfigError(f"GRPOConfig: the generation batch ({n} completions: generation_batch_size, or "
                              f"per_device_train_batch_size x processes x steps_per_generation) is not divisible by "
                              f"num_generations={g}")
        return n // g

    def iterations(self, num_prompts: int) -> int:
        """Generation batches of the run: max_steps optimizer steps, else num_train_epochs over the prompts."""
        steps = self.optimizer_steps_per_generation()
        if self.max_steps > 0:
            if self.max_steps % steps:
                raise ConfigError(f"GRPOConfig(max_steps={self.max_steps}): not a whole number of generation batches "
                                  f"of {steps} optimizer steps")
            return self.max_steps // steps
        return max(1, math.ceil(self.num_train_epochs * num_prompts / self.prompts_per_generation()))

    def run_config(self, num_prompts: int, model: str = "", device: str = "auto") -> RunConfig:
        """The RunConfig this config means for a training set of `num_prompts` prompts."""
        iterations = self.iterations(num_prompts)
        steps = self.optimizer_steps_per_generation()
        total = iterations * steps
        warmup = self.warmup_steps if self.warmup_ratio is None else self.warmup_ratio
        warmup = round(warmup * total) if 0 < warmup < 1 else int(warmup)
        accel = device.split(":")[0] in ("cuda", "npu") or (device == "auto" and not self.use_cpu and _accelerator())
        dtype = "bfloat16" if (self.bf16 if self.bf16 is not None else accel) else "float32"
        report = [self.report_to] if isinstance(self.report_to, str) or self.report_to is None else self.report_to
        if any(r not in (None, "none", "wandb", "all") for r in report):
            raise ConfigError(f"GRPOConfig(report_to={self.report_to!r}): not supported here (metrics go to "
                              "metrics.jsonl and W&B); expected 'wandb', 'all' or 'none'")
        wandb = "disabled" if report == ["none"] else os.environ.get("WANDB_MODE", "offline")
        values = {
            "model.dtype": dtype, "model.seed": self.seed,
            "model.device": "cpu" if self.use_cpu else device,
            "data.seed": self.seed, "data.num_eval": 0,
            "engine.max_tokens": self.max_completion_length, "engine.temperature": self.temperature,
            "engine.top_p": self.top_p, "engine.top_k": self.top_k, "engine.num_workers": self.num_engine_workers,
            "engine.threads_per_worker": self.engine_threads,
            "engine.worker_backend": "vllm" if self.use_vllm else "auto",
            "algorithm.group_size": self.num_generations, "algorithm.prompts_per_iteration": self.prompts_per_generation(),
            "algorithm.lr": self.learning_rate, "algorithm.weight_decay": self.weight_decay,
            "algorithm.adam_betas": [self.adam_beta1, self.adam_beta2], "algorithm.adam_eps": self.adam_epsilon,
            "algorithm.lr_scheduler": SCHEDULERS[self.lr_scheduler_type], "algorithm.warmup_steps": warmup,
            "algorithm.max_grad_norm": self.max_grad_norm, "algorithm.optimizer_steps_per_iteration": steps,
            "algorithm.beta": self.beta, "algorithm.eps_low": self.epsilon,
            "algorithm.eps_high": self.epsilon if self.epsilon_high is None else self.epsilon_high,
            "algorithm.loss_norm": LOSS_TYPES[self.loss_type],
            "algorithm.advantage": "std" if self.scale_rewards == "group" else "mean", "algorithm.advantage_eps": 1e-4,
            "algorithm.shared_prompt": self.shared_prompt,
            "trainer.iterations": iterations, "trainer.threads": self.trainer_threads,
            "trainer.output_dir": self.output_dir or "trainer_output",
            "trainer.save_every": _every(self.save_steps, steps, total) if self.save_strategy == "steps" else 0,
            "pipeline.mode": self.mode, "logging.wandb_mode": wandb, "logging.progress": True,
        }
        if self.mode == "periodic-async":  # one group per micro-batch: training starts with the first group
            values.update({"algorithm.micro_batch_tokens": 0, "algorithm.micro_batch_groups": 1})
        if model:
            values["model.name_or_path"] = model
        if self.save_total_limit is not None:
            values["trainer.keep_last"] = self.save_total_limit
        if self.eval_strategy == "steps":
            values["trainer.eval_every"] = _every(self.eval_steps or 500, steps, total)
        overrides = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()]
        return load_config(RunConfig, None, overrides + list(self.overrides))


def _every(steps: float, per_iteration: int, total: int) -> int:
    """TRL's *_steps (optimizer steps, or a fraction of the run below 1) in iterations."""
    n = steps * total if 0 < steps < 1 else steps
    return max(1, round(n / per_iteration))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "npu") and torch.npu.is_available())


_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)} - {"no_effect"}
_dataclass_init = GRPOConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs) -> None:
    no_effect = dict(kwargs.pop("no_effect", None) or {})  # dataclasses.replace passes it back
    for name in list(kwargs):
        if name in _FIELDS:
            continue
        value = kwargs.pop(name)
        if name in REFUSED:
            raise ConfigError(f"GRPOConfig({name}=...): not supported here ({REFUSED[name]})")
        if name in ONLY_DEFAULT:
            default, why = ONLY_DEFAULT[name]
            if value != default:
                raise ConfigError(f"GRPOConfig({name}={value!r}): not supported here ({why}); leave it at {default!r}")
            continue
        if name not in NO_EFFECT:
            raise ConfigError(f"GRPOConfig({name}=...): not a field we take (neither mapped nor known to have no "
                              "effect here; docs/trl.md lists them), so it is refused rather than ignored")
        no_effect[name] = value
    _dataclass_init(self, *args, no_effect=no_effect, **kwargs)


GRPOConfig.__init__ = _init


# --- data and rewards ------------------------------------------------------------------------

def _rows(dataset, what: str) -> list[dict]:
    """The rows of a `datasets.Dataset` (or a list of dicts) as plain dicts."""
    if dataset is None:
        return []
    if hasattr(dataset, "to_list"):
        return dataset.to_list()
    if isinstance(dataset, (list, tuple)):
        return [dict(r) for r in dataset]
    raise DataError(f"GRPOTrainer({what}=...): expected a datasets.Dataset or a list of dicts, got "
                    f"{type(dataset).__name__} (an IterableDataset is not supported: the prompts are reshuffled per epoch)")


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def to_examples(dataset, what: str = "train_dataset") -> list[Example]:
    """TRL's prompt-only dataset formats as Examples: a `prompt` text or a `prompt` list of chat
    messages; every column kept for the reward functions (TRL passes all but `prompt`). A row
    without `prompt`, or with one of neither form, is a DataError naming the row."""
    examples = []
    for i, row in enumerate(_rows(dataset, what)):
        if row.get("prompt") is None:  # a datasets.Dataset fills a row's missing column with None
            raise DataError(f"{what} row {i}: no 'prompt' column (TRL's formats: a 'prompt' text or a list of chat "
                            f"messages); it has {sorted(row)}")
        prompt = row["prompt"]
        if isinstance(prompt, str):
            question = prompt
        elif _is_messages(prompt) and prompt:
            prompt = [dict(m) for m in prompt]
            question = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), str(prompt[-1]["content"]))
        else:
            raise DataError(f"{what} row {i}: 'prompt' is {type(prompt).__name__} {prompt!r:.80}: expected a text or a "
                            "list of {'role', 'content'} messages")
        answer = row.get("answer")
        examples.append(Example(str(question), "" if answer is None else str(answer), id=str(row.get("id", i)),
                                columns=dict(row), prompt=prompt))
    return examples


class _Logs:
    """What reward functions hand to `log_metric(name, value)` and `log_extra(column, values)`."""

    def __init__(self) -> None:
        self.metrics: list[tuple[str, float]] = []
        self.extra: list[tuple[str, list]] = []

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.append((name, float(value)))

    def log_extra(self, column: str, values: list) -> None:
        self.extra.append((column, list(values)))


def trl_reward(funcs: Sequence[Callable], weights: Sequence[float], logs: _Logs | None = None) -> Callable:
    """The producer's reward (f(prompts, completions, **columns) -> list of floats) from reward
    functions called as TRL 1.16 calls them (see the module docstring). A function that raises or
    returns the wrong count, a non-number or a non-finite number stops the run with a RewardError
    naming it; None is "not applicable"."""
    from periodic_async.reward import RewardError

    logs = logs or _Logs()
    names = [getattr(f, "__name__", type(f).__name__) for f in funcs]

    def reward(prompts: Sequence, completions: Sequence[str], **kwargs) -> list[float]:
        conversational = _is_messages(prompts[0]) if prompts else False
        comps = [[{"role": "assistant", "content": c}] for c in completions] if conversational else list(completions)
        kwargs.setdefault("log_extra", logs.log_extra)
        kwargs.setdefault("log_metric", logs.log_metric)
        total = [math.nan] * len(completions)
        for f, name, w in zip(funcs, names, weights, strict=True):
            out = f(prompts=list(prompts), completions=comps, **kwargs)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            try:
                values = [math.nan if v is None else float(v) for v in out]
            except (TypeError, ValueError) as e:
                raise RewardError(f"reward function {name!r} returned {out!r:.200}: expected numbers or None ({e})") \
                    from None
            if len(values) != len(completions):
                raise RewardError(f"reward function {name!r} returned {len(values)} rewards for {len(completions)} "
                                  "completions")
            if any(math.isinf(v) for v in values):
                raise RewardError(f"reward function {name!r} returned an infinite reward: {values}")
            total = [t if math.isnan(v) else (0.0 if math.isnan(t) else t) + w * v for t, v in zip(total, values)]
        return total

    return reward


async def _awaited(awaitable):
    return await awaitable


def _nan_accuracy(prompts: Sequence, completions: Sequence[str], **kwargs) -> list[float]:
    """No accuracy function applies (no `answer` column, no GRPOConfig.accuracy_function): NaN."""
    return [math.nan] * len(completions)


# --- the trainer -----------------------------------------------------------------------------

@dataclass
class TrainOutput:
    """What `train()` returns, as transformers' TrainOutput: the optimizer steps taken, the mean
    training loss over them, and the run's summary metrics."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


class GRPOTrainer:
    """TRL's `GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class)`
    on this pipeline; see the module docstring.

    model: a Hugging Face model directory, a preset name (config.py) or a `PreTrainedModel` (saved
    to <output_dir>/initial_model with its tokenizer: the engines load weights from a directory).
    reward_funcs: a function, a 'module:function' name, or a list of them (TRL's signature).
    processing_class: the tokenizer; None: the model directory's own.
    """

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, **kwargs) -> None:
        for name, value in kwargs.items():
            if value is not None and value != (None, None):  # TRL's optimizers=(None, None)
                raise ConfigError(f"GRPOTrainer({name}=...): not supported here "
                                  f"({REFUSED.get(name, 'not an argument we take')})")
        self.args = args or GRPOConfig()
        if self.args.no_effect:
            print(f"[GRPOConfig] no effect here: {', '.join(sorted(self.args.no_effect))} (docs/trl.md says why)")
        self.output_dir = Path(self.args.output_dir or "trainer_output")
        self.model_path = self._model_path(model, processing_class)
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ConfigError("GRPOTrainer(reward_funcs=[]): at least one reward function is needed")
        self.reward_funcs = [self._reward_fn(f) for f in funcs]
        weights = self.args.reward_weights or [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ConfigError(f"GRPOConfig(reward_weights={weights}): {len(weights)} weights for "
                              f"{len(self.reward_funcs)} reward functions")
        self.logs = _Logs()
        self.reward = trl_reward(self.reward_funcs, weights, self.logs)
        if train_dataset is None:
            raise ConfigError("GRPOTrainer(train_dataset=None): a training dataset is needed")
        self.train_examples = to_examples(train_dataset, "train_dataset")
        if not self.train_examples:
            raise DataError("GRPOTrainer(train_dataset=...): the dataset is empty")
        self.eval_examples = to_examples(eval_dataset, "eval_dataset")
        self.accuracy = self._accuracy_fn()
        if self.eval_examples and self.accuracy is _nan_accuracy:
            raise ConfigError("GRPOTrainer(eval_dataset=...): held-out evaluation reports accuracy, and none applies: "
                              "give the dataset an 'answer' column or set GRPOConfig(accuracy_function=...)")
        self.state = None  # the run's summary once trained
        self._model = None

    def _model_path(self, model, processing_class) -> str:
        """A directory (or preset name) the trainer and the engines load; see the class docstring."""
        if isinstance(model, (str, os.PathLike)):
            path = str(model)
            if processing_class is not None:
                own = Path(path) / "tokenizer_config.json"
                if not own.is_file() or not _same_tokenizer(processing_class, path):
                    raise ConfigError(f"GRPOTrainer(processing_class=...): differs from the tokenizer of {path!r} "
                                      "(the engines decode with the model directory's own): save it there "
                                      "(processing_class.save_pretrained(...)) or pass processing_class=None")
            return path
        if not hasattr(model, "save_pretrained"):
            raise ConfigError(f"GRPOTrainer(model=...): expected a model directory, a preset name or a PreTrainedModel, "
                              f"got {type(model).__name__}")
        out = self.output_dir / "initial_model"
        if out.exists():
            shutil.rmtree(out)
        model.save_pretrained(out)
        tokenizer = processing_class
        if tokenizer is None:
            from transformers import AutoTokenizer

            source = getattr(model, "name_or_path", "")
            try:
                tokenizer = AutoTokenizer.from_pretrained(source)
            except Exception as e:  # noqa: BLE001 - one line: the user passes processing_class
                raise ConfigError(f"GRPOTrainer(model=<{type(model).__name__}>): no processing_class given and its "
                                  f"tokenizer cannot be loaded from {source!r} ({type(e).__name__}); pass "
                                  "processing_class=tokenizer") from None
        tokenizer.save_pretrained(out)
        return str(out)

    def _reward_fn(self, f):
        if isinstance(f, str):
            from periodic_async.reward import load_reward_fn

            if ":" not in f:
                raise ConfigError(f"GRPOTrainer(reward_funcs={f!r}): reward models are not supported here; pass a "
                                  "function or 'module:function'")
            return load_reward_fn(f)
        if not callable(f) or hasattr(f, "forward"):
            raise ConfigError(f"GRPOTrainer(reward_funcs=<{type(f).__name__}>): reward models are not supported here; "
                              "pass reward functions")
        return f

    def _accuracy_fn(self):
        from periodic_async.config import RewardConfig
        from periodic_async.reward import make_accuracy

        spec = self.args.accuracy_function
        if spec is not None:  # called as the reward functions are (TRL's arguments)
            return trl_reward([self._reward_fn(spec)], [1.0])
        if all("answer" in e.columns for e in self.train_examples + self.eval_examples):
            return make_accuracy(RewardConfig())
        return _nan_accuracy

    def run_config(self) -> RunConfig:
        """The run's RunConfig (GRPOConfig.run_config on this dataset and model)."""
        return self.args.run_config(len(self.train_examples), self.model_path)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run the pipeline; returns TrainOutput(global_step, training_loss, metrics)."""
        from periodic_async import pipeline

        cfg = self.run_config()
        if resume_from_checkpoint:
            cfg.trainer.resume = "auto" if resume_from_checkpoint is True else str(resume_from_checkpoint)
        if self.args.max_prompt_length is not None:
            self._check_prompt_lengths(cfg)
        task = pipeline.Task(self.train_examples, self.eval_examples, self.reward, self.accuracy)
        summary = pipeline.run(cfg, task=task)
        self.state = summary
        self._model = None
        history = [json.loads(line) for line in (self.output_dir / "metrics.jsonl").read_text().splitlines()
                   if '"train/loss"' in line]
        losses = [h["train/loss"] for h in history]
        steps = len(history) * cfg.algorithm.optimizer_steps_per_iteration
        return TrainOutput(global_step=steps, training_loss=sum(losses) / len(losses) if losses else math.nan,
                           metrics=summary)

    def _check_prompt_lengths(self, cfg: RunConfig) -> None:
        from periodic_async.data import encode_prompts
        from periodic_async.data.tokenizer import ensure_tokenizer, load_tokenizer

        model_dir = Path(cfg.model.name_or_path)  # the tokenizer the run uses (model.load_policy's rule)
        tokenizer = load_tokenizer(model_dir) if (model_dir / "tokenizer_config.json").is_file() else \
            ensure_tokenizer(cfg.model.tokenizer)
        limit = self.args.max_prompt_length
        for what, examples in (("train_dataset", self.train_examples), ("eval_dataset", self.eval_examples)):
            for i, ids in enumerate(encode_prompts(tokenizer, examples)):
                if len(ids) > limit:
                    raise DataError(f"{what} row {i}: prompt of {len(ids)} tokens > max_prompt_length={limit} (prompts "
                                    "are not cut here: shorten it or raise max_prompt_length)")

    @property
    def model(self):
        """The trained policy (loaded from the last checkpoint), or the initial one before train()."""
        if self._model is None:
            from transformers import AutoModelForCausalLM

            ckpt = self.output_dir / "checkpoint"
            self._model = AutoModelForCausalLM.from_pretrained(ckpt if ckpt.exists() else self.model_path)
        return self._model

    def save_model(self, output_dir: str | None = None) -> Path:
        """Write the trained policy and its tokenizer as a Hugging Face directory
        (`AutoModelForCausalLM.from_pretrained(output_dir)` loads it)."""
        from periodic_async import checkpoint

        out = Path(output_dir or self.output_dir)
        ckpt = checkpoint.latest(self.output_dir)
        if ckpt is None:
            raise UserError(f"GRPOTrainer.save_model: no checkpoint in {str(self.output_dir)!r}: call train() first")
        out.mkdir(parents=True, exist_ok=True)
        for f in ckpt.iterdir():
            if f.is_file() and f.name not in ("trainer_state.pt", "rng_state.pt", "checkpoint.json", "complete"):
                shutil.copy2(f, out / f.name)
        return out


def _same_tokenizer(tokenizer, path: str) -> bool:
    from periodic_async.data.tokenizer import load_tokenizer

    own = load_tokenizer(path)
    return own.get_vocab() == tokenizer.get_vocab() and getattr(own, "chat_template", None) == \
        getattr(tokenizer, "chat_template", None)
