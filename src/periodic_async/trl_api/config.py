"""TRL's GRPOConfig on this pipeline: TRL 1.16's field names and defaults, each mapped to a
`RunConfig` field, taken with no effect, taken at one value only, or refused (the tables below;
docs/trl.md renders them)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from periodic_async.config import ConfigError, RunConfig, load_config

NO_EFFECT: dict[str, str] = {
    "logging_first_step": "every iteration is logged",
    "logging_strategy": "every iteration is logged",
    "logging_dir": "logs go under output_dir",
    "log_level": "no effect on what is logged",
    "log_completions": "every completion is written to <output_dir>/rollouts.jsonl",
    "num_completions_to_print": "completions are written to rollouts.jsonl, not printed",
    "per_device_eval_batch_size": "held-out prompts go through the engines as one batch",
    "dataloader_num_workers": "prompts are tokenized once, in the producer",
    "dataloader_pin_memory": "no dataloader",
    "dataloader_drop_last": "every iteration takes a full batch of prompts (epoch-wise reshuffles)",
    "dataloader_persistent_workers": "no dataloader",
    "dataloader_prefetch_factor": "no dataloader",
    "remove_unused_columns": "every column reaches the reward functions",
    "vllm_mode": "the engines are separate workers (or in-process for sync-colocated); `mode` says which",
    "vllm_gpu_memory_utilization": ("the KV cache is engine.vllm_kv_cache_gib "
                                    "(overrides=['engine.vllm_kv_cache_gib=...'])"),
    "vllm_enable_sleep_mode": "separated engines keep their memory",
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
    "log_on_each_node": "rank 0 logs",
    "log_level_replica": "no effect on what is logged",
    "logging_nan_inf_filter": "every iteration's loss is logged as it is",
    "log_multimodal": "text prompts only",
    "log_unique_prompts": "every prompt and completion is written to rollouts.jsonl",
    "disable_tqdm": "the progress bar is logging.progress (overrides=['logging.progress=false'])",
    "project": "the W&B project is logging.wandb_project; no trackio",
    "trackio_space_id": "no trackio",
    "trackio_bucket_id": "no trackio",
    "trackio_static_space_id": "no trackio",
    "torch_compile_backend": "not compiled",
    "torch_compile_mode": "not compiled",
    "torch_empty_cache_steps": "the accelerator's cache is left to torch (memory only)",
    "use_cache": "the trainer's forward passes keep no KV cache; the engines keep their own",
    "liger_kernel_config": "no Liger kernels (use_liger_kernel)",
    "eval_do_concat_batches": "no prediction loop",
    "eval_use_gather_object": "no prediction loop",
    "eval_accumulation_steps": "no prediction loop",
    "include_for_metrics": "no compute_metrics: held-out evaluation reports accuracy",
    "batch_eval_metrics": "no compute_metrics: held-out evaluation reports accuracy",
    "do_predict": "no prediction loop",
    "metric_for_best_model": "no best-model selection (load_best_model_at_end)",
    "greater_is_better": "no best-model selection (load_best_model_at_end)",
    "ignore_data_skip": "a resume skips nothing: an iteration's prompts are a pure function of seed and iteration",
    "restore_callback_states_from_checkpoint": "no callbacks",
    "full_determinism": "every request's sampling seed derives from seed; the trainer keeps torch's default kernels",
    "data_seed": "the prompt order follows seed (TRL's GRPO sampler also uses seed)",
    "dataloader_multiprocessing_context": "no dataloader",
    "dataloader_in_order": "no dataloader",
    "label_names": "no labels in RL",
    "train_sampling_strategy": "prompts are reshuffled every epoch (TRL's GRPO sampler)",
    "length_column_name": "no grouping by length",
    "ddp_bucket_cap_mb": "trainer ranks use their own DDP/FSDP setup (trainer.parallel)",
    "ddp_broadcast_buffers": "trainer ranks use their own DDP/FSDP setup (trainer.parallel)",
    "ddp_static_graph": "trainer ranks use their own DDP/FSDP setup (trainer.parallel)",
    "ddp_backend": "the backend follows the device: gloo (CPU), nccl (CUDA), hccl (NPU)",
    "local_rank": "the rank comes from torchrun's environment (LOCAL_RANK)",
    "accelerator_config": "no Accelerate and no dataloader: trainer ranks are torchrun's (trainer.parallel)",
    "debug": "no debug modes",
    "ds3_gather_for_generation": "no DeepSpeed",
    "pad_to_multiple_of": "sequences are packed, not padded",
    "hub_token": "nothing is pushed (push_to_hub)",
    "hub_private_repo": "nothing is pushed (push_to_hub)",
    "hub_strategy": "nothing is pushed (push_to_hub)",
    "hub_always_push": "nothing is pushed (push_to_hub)",
    "hub_revision": "nothing is pushed (push_to_hub)",
    "vllm_server_host": "no vLLM server (vllm_server_base_url)",
    "vllm_server_port": "no vLLM server (vllm_server_base_url)",
    "vllm_server_timeout": "no vLLM server (vllm_server_base_url)",
    "vllm_group_port": "no vLLM server (vllm_server_base_url)",
    "vespo_k_pos": "only used by loss_type='vespo', which is not supported",
    "vespo_lambda_pos": "only used by loss_type='vespo', which is not supported",
    "vespo_k_neg": "only used by loss_type='vespo', which is not supported",
    "vespo_lambda_neg": "only used by loss_type='vespo', which is not supported",
    "sapo_temperature_pos": "only used by loss_type='sapo', which is not supported",
    "sapo_temperature_neg": "only used by loss_type='sapo', which is not supported",
    "ref_model_mixup_alpha": "only used with sync_ref_model (accepted at False only)",
    "ref_model_sync_steps": "only used with sync_ref_model (accepted at False only)",
    "entropy_coef_min": "only used with use_adaptive_entropy (accepted at False only)",
    "entropy_coef_max": "only used with use_adaptive_entropy (accepted at False only)",
    "entropy_coef_delta": "only used with use_adaptive_entropy (accepted at False only)",
    "entropy_target": "only used with use_adaptive_entropy (accepted at False only)",
    "transformers_continuous_batching_config": "only used with use_transformers_continuous_batching (accepted at "
                                               "False only)",
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
    "vllm_server_base_url": (None, "the pipeline starts its own engines (engine.ray_address joins a Ray cluster)"),
    "vllm_structured_outputs_regex": (None, "no structured outputs"),
    "use_transformers_continuous_batching": (False, "generation is the engines' (vLLM or the built-in batcher)"),
    "use_transformers_paged": (False, "generation is the engines'"),
    "fp16": (False, "float16 training: set overrides=['model.dtype=float16']"),
    "push_to_hub": (False, "nothing leaves this machine: save_model writes a directory"),
    "shuffle_dataset": (True, "prompts are reshuffled every epoch (a pure function of seed and iteration)"),
    "chat_template_kwargs": (None, "the chat template is applied with its defaults"),
    "gradient_checkpointing_kwargs": (None, "transformers' non-reentrant checkpointing of each decoder layer"),
    "model_init_kwargs": (None, "the model is loaded in the run's dtype (bf16) from its directory"),
    "auto_find_batch_size": (False, "the batch is fixed"),
    "label_smoothing_factor": (0.0, "no label smoothing in RL"),
    "disable_dropout": (False, "the model's own dropout is kept (the presets and SmolLM2 have none): set its "
                               "config's dropout probabilities to 0 to train without"),
    "lr_scheduler_kwargs": (None, "the schedules take no arguments (linear and cosine decay to 0)"),
    "optim_args": (None, "AdamW takes learning_rate, adam_*, weight_decay"),
    "optim_target_modules": (None, "one AdamW over every parameter"),
    "average_tokens_across_devices": (True, "the loss is normalised by the tokens of all trainer ranks (one "
                                            "all-reduce per iteration)"),
    "bf16_full_eval": (False, "held-out evaluation generates with the engines, in the run's dtype"),
    "fp16_full_eval": (False, "held-out evaluation generates with the engines, in the run's dtype"),
    "neftune_noise_alpha": (None, "no NEFTune noise"),
    "eval_delay": (0, "held-out evaluation follows eval_steps from the start"),
    "save_on_each_node": (False, "rank 0 writes the checkpoints"),
    "enable_jit_checkpoint": (False, "checkpoints follow save_steps (and a failure or signal saves the last "
                                     "completed iteration)"),
    "load_best_model_at_end": (False, "the model is the last iteration's"),
    "parallelism_config": (None, "no Accelerate: trainer ranks are torchrun's (overrides=['trainer.parallel=...'])"),
    "trust_remote_code": (False, "models and tokenizers load without remote code"),
    "router_aux_loss_coef": (None, "no router auxiliary loss (the models here are dense)"),
    "cast_lm_head_to_fp32": (False, "the lm_head runs in the model's dtype"),
    "vllm_model_impl": ("vllm", "vLLM runs its own model implementation"),
    "log_completions_hub_repo": (None, "nothing leaves this machine"),
}
"""Fields accepted at one value only (TRL's default: what we do); another value is refused with the reason."""

REFUSED: dict[str, str] = {
    "deepspeed": "trainer ranks are torchrun DDP/FSDP here (overrides=['trainer.parallel=fsdp'])",
    "fsdp": "use overrides=['trainer.parallel=fsdp'] under torchrun",
    "fsdp_config": "use overrides=['trainer.parallel=fsdp'] under torchrun",
    "reward_processing_classes": "reward models (nn.Module rewards) are not supported: pass reward functions",
    "callbacks": "no Trainer callbacks: the run writes metrics.jsonl, eval.jsonl, rollouts.jsonl and W&B",
    "optimizers": "the optimizer is AdamW (learning_rate, adam_*, weight_decay, lr_scheduler_type)",
    "rollout_func": "generation is the engines' (the pipeline schedules it)",
    "use_liger_kernel": "no Liger kernels",
    "hub_model_id": "nothing leaves this machine",
    "resume_from_checkpoint": "pass it to train(resume_from_checkpoint=...)",
    "quantization_config": "no quantized training: the engines take full weights at every barrier",
}
"""Features refused, and why: any value but the one that leaves them off (TRL's default: None,
False, '', or the trainer's optimizers=(None, None)) is refused."""

DEFAULTS_DIFFER: dict[str, str] = {
    "bf16": "None means bfloat16 on an accelerator and float32 on CPU (TRL: bfloat16 unless fp16): bfloat16 is "
            "many times slower on most CPUs",
    "use_vllm": "False lets us choose (engine.worker_backend=auto: vLLM for models of 50M parameters and more when "
                "installed, else the built-in batcher); TRL then generates with transformers",
    "save_strategy": "a checkpoint is also written at the end of the run (save_model copies it), whatever the "
                     "strategy",
}
"""Fields that both configs have whose default does something else here than in TRL 1.16, and
why (docs/trl.md lists them; tests/test_trl_api.py checks that every other default is TRL's)."""


def _off(value) -> bool:
    """Whether a REFUSED feature is left off (TRL's default for each)."""
    return value is None or value is False or value == "" or value == (None, None)


LOSS_TYPES = {"dapo": "token-mean", "dr_grpo": "constant", "grpo": "seq-mean"}
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
"""transformers' lr_scheduler_type -> algorithm.lr_scheduler; "constant" has no warm-up (transformers'
get_constant_schedule), "constant_with_warmup" has."""


def _positive(value) -> bool:
    return value >= 1


ALLOWED: dict[str, tuple[tuple | Callable[[Any], bool], str]] = {
    "loss_type": (tuple(LOSS_TYPES), "the others are not implemented; 'bnpo' normalises by each micro-batch's own "
                                     "tokens, so the gradient depends on how the batch is split ('dapo' normalises "
                                     "by the whole batch's)"),
    "scale_rewards": (("group", "none"), "groups are scored as they finish, before the batch's std exists"),
    "lr_scheduler_type": (tuple(SCHEDULERS), "transformers' other schedules are not implemented"),
    "optim": (lambda value: str(value).startswith("adamw"), "the optimizer is AdamW: any 'adamw*' name"),
    "save_strategy": (("steps", "no"), "checkpoints follow save_steps"),
    "eval_strategy": (("no", "steps"), "held-out evaluation follows eval_steps"),
    "per_device_train_batch_size": (_positive, "a count: at least 1"),
    "gradient_accumulation_steps": (_positive, "a count: at least 1"),
    "num_generations": (_positive, "a count: at least 1"),
    "max_tool_calling_iterations": (lambda v: v is None or v >= 0, "None (no limit) or a count: at least 0"),
    "tool_format": (("template", "plain", "auto"), "the tool formats of docs/episodes.md"),
}
"""Mapped fields that take only some values: field -> (the values, or a test of one; why). Another
value is one ConfigError line naming the field, the reason and the values taken."""


@dataclass(init=False)
class GRPOConfig:
    """TRL 1.16's GRPOConfig names and defaults for what this pipeline does, plus our own settings
    (the last block). docs/trl.md maps each field; `run_config()` gives the `RunConfig`. The
    constructor also takes TRL's other fields (see `__init__`)."""

    output_dir: str | None = None
    """Where the run writes (trainer.output_dir); None: 'trainer_output', as TRL."""
    # optimiser and schedule
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    """'linear', 'cosine', 'constant' (no warm-up) or 'constant_with_warmup', as transformers'."""
    warmup_steps: float = 0
    """Optimizer steps of warm-up; a value below 1 is a fraction of the run, rounded up (as transformers 5)."""
    warmup_ratio: float | None = None
    """transformers 4's name for a fraction of the run (replaces warmup_steps when set)."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch_fused"
    """Any 'adamw*': torch's AdamW."""
    max_steps: int = -1
    num_train_epochs: float = 3.0
    """Used when max_steps <= 0: epochs of whole generation batches (TRL's sampler drops an epoch's last
    partial batch): ceil(num_train_epochs x (prompts // prompts per generation)) generation batches."""
    # batch
    per_device_train_batch_size: int = 8
    """Completions per process and optimizer step: it sizes the generation batch (TRL's rule), not the
    micro-batches, which are one group each in periodic-async (training starts with the first group),
    algorithm.micro_batch_tokens otherwise: the gradient is the same for any split."""
    gradient_accumulation_steps: int = 1
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    num_generations: int = 8
    # generation
    max_prompt_length: int | None = None
    """A prompt longer than this many tokens stops the run at start-up (prompts are never cut here)."""
    max_completion_length: int = 512
    """engine.max_tokens; with tools or an environment_factory also the episode's budget (env.max_tokens):
    model and environment tokens after the prompt, as TRL counts them."""
    max_tool_calling_iterations: int | None = None
    """Tool-calling rounds per episode: env.max_turns = this + 1 model turns; None: no limit but the budget."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # loss
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    """'dapo': token-mean over the generation batch, each of its optimizer steps divided by its tokens /
    the steps (algorithm.token_mean_scope=iteration); 'dr_grpo'; 'grpo' (docs/trl.md)."""
    scale_rewards: str | bool = "group"
    use_bias_correction_kl: bool = True
    """algorithm.kl_bias_correction: the k3 KL times the importance ratio (changes the gradient when beta > 0)."""
    vllm_importance_sampling_correction: bool = True
    """With use_vllm=True (TRL's condition): algorithm.behaviour_is = vllm_importance_sampling_mode, the
    engines' vs the trainer's log-probs; otherwise 'off'."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None
    """Deprecated in TRL: replaces vllm_importance_sampling_clip_max when set."""
    reward_weights: list[float] | None = None
    # run
    seed: int = 42
    bf16: bool | None = None
    """None: bfloat16 on an accelerator, float32 on CPU (bf16 is many times slower on most CPUs)."""
    use_cpu: bool = False
    gradient_checkpointing: bool = True
    """trainer.gradient_checkpointing: the policy's decoder layers recompute their activations in the backward."""
    report_to: str | list[str] | None = "none"
    """'wandb' / 'all': W&B (offline unless WANDB_MODE=online); 'none', [] or None: no W&B."""
    logging_steps: float = 10
    """Every iteration is logged here; this only gives eval_steps its default (transformers' rule)."""
    save_strategy: str = "steps"
    save_steps: float = 500
    """Optimizer steps between checkpoints (a value below 1: a fraction of the run, rounded up), at
    the first iteration's end at or after each."""
    save_total_limit: int | None = None
    """Checkpoints kept (trainer.keep_last); None: every one (TRL)."""
    eval_strategy: str = "no"
    """'no': never evaluate, even with an eval_dataset (TRL); 'steps': every eval_steps."""
    eval_steps: float | None = None
    """As save_steps; None: logging_steps (transformers' rule)."""
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
    tool_format: str = "template"
    """env.tool_format, with tools or an environment_factory: 'template' (TRL's: the chat template's own
    tool format; a template that cannot render tools is refused), 'plain' (the plain-text call format,
    docs/episodes.md: for templates without tools, such as SmolLM2's) or 'auto' (plain where the
    template cannot render tools)."""
    accuracy_function: str | Callable | None = None
    """What `accuracy` and held-out `eval/accuracy` count (scores in [0, 1]): a function called as the
    reward functions are, or its 'module:function'; None: the math correctness reward when the dataset has an
    `answer` column, else accuracy is not computed (NaN)."""
    overrides: list[str] = field(default_factory=list)
    """Any other setting of the run, as `section.key=value` (the YAML/CLI names, config.py)."""
    no_effect: dict[str, Any] = field(default_factory=dict, repr=False)
    """The NO_EFFECT fields this config was given (filled by the constructor)."""

    def __init__(self, *args, **kwargs) -> None:
        """The fields above by keyword (or by position, in their order), each at its default when
        left out; any other TRL field is taken with no effect (kept in `no_effect`), taken at the
        one value that means what we do, or refused: one `ConfigError` line (trl_api's docstring)."""
        fields = [f for f in dataclasses.fields(self) if f.name != "no_effect"]
        if len(args) > len(fields):
            raise TypeError(f"GRPOConfig() takes at most {len(fields)} positional arguments, {len(args)} were given")
        for f, value in zip(fields, args):
            if f.name in kwargs:
                raise TypeError(f"GRPOConfig() got multiple values for argument {f.name!r}")
            kwargs[f.name] = value
        self.no_effect = dict(kwargs.pop("no_effect", None) or {})  # dataclasses.replace passes it back
        names = {f.name for f in fields}
        for name in [n for n in kwargs if n not in names]:
            value = kwargs.pop(name)
            if name in REFUSED:
                if _off(value):  # TRL's default: the feature is off
                    continue
                raise ConfigError(f"GRPOConfig({name}=...): not supported here ({REFUSED[name]})")
            if name in ONLY_DEFAULT:
                default, why = ONLY_DEFAULT[name]
                if value != default:
                    raise ConfigError(f"GRPOConfig({name}={value!r}): not supported here ({why}); leave it at "
                                      f"{default!r}")
                continue
            if name not in NO_EFFECT:
                raise ConfigError(f"GRPOConfig({name}=...): not a field we take (neither mapped nor known to have no "
                                  "effect here; docs/trl.md lists them), so it is refused rather than ignored")
            self.no_effect[name] = value
        for f in fields:
            setattr(self, f.name, kwargs[f.name] if f.name in kwargs else
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        # the values, normalised and checked
        for name in ("lr_scheduler_type", "optim", "save_strategy", "eval_strategy"):  # transformers' enums: names
            value = getattr(self, name)
            setattr(self, name, getattr(value, "value", value))
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        for name, (allowed, why) in ALLOWED.items():
            value = getattr(self, name)
            if not (allowed(value) if callable(allowed) else value in allowed):
                expected = "" if callable(allowed) else f"; expected {' or '.join(map(repr, allowed))}"
                raise ConfigError(f"GRPOConfig({name}={value!r}): not supported here ({why}){expected}")
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        try:  # TRL's rules for the importance correction, checked where our field is
            self._algorithm_values()
        except ConfigError as e:
            raise ConfigError(f"GRPOConfig(vllm_importance_sampling_*): {e}") from None
        per_step = self.per_device_train_batch_size * _world_size()
        if self.generation_batch_size is not None and self.steps_per_generation is not None and \
                self.generation_batch_size != per_step * self.steps_per_generation:
            # both set: TRL refuses; its own __post_init__ sets both, consistently (a config copied from one is taken)
            raise ConfigError(f"GRPOConfig(generation_batch_size={self.generation_batch_size}): set it or "
                              f"steps_per_generation={self.steps_per_generation}, not both (TRL's rule)")

    # --- the mapping ------------------------------------------------------------------------

    def _algorithm_values(self) -> dict[str, Any]:
        """The KL correction, the engines' importance correction and the dapo normaliser, checked
        (an AlgorithmConfig is built: ConfigError naming the algorithm field)."""
        from periodic_async.config import AlgorithmConfig

        mode = self.vllm_importance_sampling_mode if self.vllm_importance_sampling_correction else "off"
        values = {"kl_bias_correction": bool(self.use_bias_correction_kl), "behaviour_is": mode,
                  "behaviour_is_min": self.vllm_importance_sampling_clip_min,
                  "behaviour_is_max": self.vllm_importance_sampling_clip_max,
                  "token_mean_scope": "iteration" if self.loss_type == "dapo" else "step"}
        AlgorithmConfig(**values)  # TRL checks the mode and bounds whether or not vLLM is used
        if not self.use_vllm:  # TRL corrects vLLM's samples only
            values["behaviour_is"] = "off"
        return {f"algorithm.{k}": v for k, v in values.items()}

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
        batches = num_prompts // self.prompts_per_generation()  # TRL's RepeatSampler drops a partial batch
        if batches == 0:
            raise ConfigError(f"GRPOConfig(num_train_epochs={self.num_train_epochs}): the train_dataset's "
                              f"{num_prompts} prompts are fewer than one generation batch of "
                              f"{self.prompts_per_generation()} prompts (TRL drops a partial batch, so no step would "
                              "be taken): set max_steps or a smaller batch")
        return max(1, math.ceil(self.num_train_epochs * batches))

    def run_config(self, num_prompts: int, model: str = "", device: str = "auto") -> RunConfig:
        """The RunConfig this config means for a training set of `num_prompts` prompts."""
        iterations = self.iterations(num_prompts)
        steps = self.optimizer_steps_per_generation()
        total = iterations * steps
        warmup = self.warmup_steps if self.warmup_ratio is None else self.warmup_ratio
        warmup = math.ceil(warmup * total) if 0 < warmup < 1 else int(warmup)  # transformers' get_warmup_steps
        if self.lr_scheduler_type == "constant":  # transformers' constant schedule has no warm-up
            warmup = 0
        accel = device.split(":")[0] in ("cuda", "npu") or (device == "auto" and not self.use_cpu and _accelerator())
        dtype = "bfloat16" if (self.bf16 if self.bf16 is not None else accel) else "float32"
        report = [self.report_to] if isinstance(self.report_to, str) or self.report_to is None else self.report_to
        if any(r not in (None, "none", "wandb", "all") for r in report):
            raise ConfigError(f"GRPOConfig(report_to={self.report_to!r}): not supported here (metrics go to "
                              "metrics.jsonl and W&B); expected 'wandb', 'all' or 'none'")
        wandb = os.environ.get("WANDB_MODE", "offline") if {"wandb", "all"} & set(report) else "disabled"
        values = {
            "model.dtype": dtype, "model.seed": self.seed,
            "model.device": "cpu" if self.use_cpu else device,
            "data.seed": self.seed, "data.num_eval": 0,
            "engine.max_tokens": self.max_completion_length, "engine.temperature": self.temperature,
            "engine.top_p": self.top_p, "engine.top_k": self.top_k, "engine.num_workers": self.num_engine_workers,
            "engine.threads_per_worker": self.engine_threads,
            "engine.worker_backend": "vllm" if self.use_vllm else "auto",
            "algorithm.group_size": self.num_generations,
            "algorithm.prompts_per_iteration": self.prompts_per_generation(),
            "algorithm.lr": self.learning_rate, "algorithm.weight_decay": self.weight_decay,
            "algorithm.adam_betas": [self.adam_beta1, self.adam_beta2], "algorithm.adam_eps": self.adam_epsilon,
            "algorithm.lr_scheduler": SCHEDULERS[self.lr_scheduler_type], "algorithm.warmup_steps": warmup,
            "algorithm.max_grad_norm": self.max_grad_norm, "algorithm.optimizer_steps_per_iteration": steps,
            "algorithm.beta": self.beta, "algorithm.eps_low": self.epsilon,
            "algorithm.eps_high": self.epsilon if self.epsilon_high is None else self.epsilon_high,
            "algorithm.loss_norm": LOSS_TYPES[self.loss_type], **self._algorithm_values(),
            "algorithm.advantage": "std" if self.scale_rewards == "group" else "mean", "algorithm.advantage_eps": 1e-4,
            "algorithm.shared_prompt": self.shared_prompt,
            "trainer.iterations": iterations, "trainer.threads": self.trainer_threads,
            "trainer.gradient_checkpointing": self.gradient_checkpointing,
            "trainer.output_dir": self.output_dir or "trainer_output",
            "trainer.save_every": _every(self.save_steps, steps, total) if self.save_strategy == "steps" else 0,
            "pipeline.mode": self.mode, "logging.wandb_mode": wandb, "logging.progress": True,
            # episodes (GRPOTrainer's tools / environment_factory): TRL's limits
            "env.max_tokens": self.max_completion_length, "env.tool_format": self.tool_format,
            "env.max_turns": (self.max_completion_length if self.max_tool_calling_iterations is None
                              else self.max_tool_calling_iterations + 1),
        }
        if self.mode == "periodic-async":  # one group per micro-batch: training starts with the first group
            values.update({"algorithm.micro_batch_tokens": 0, "algorithm.micro_batch_groups": 1})
        if model:
            values["model.name_or_path"] = model
        values["trainer.keep_last"] = 0 if self.save_total_limit is None else self.save_total_limit  # 0: every one
        if self.eval_strategy == "steps":  # eval_steps None or 0: logging_steps (transformers)
            values["trainer.eval_every"] = _every(self.eval_steps or self.logging_steps, steps, total)
        else:  # "no": TRL never evaluates, whatever the eval_dataset
            values.update({"trainer.eval_every": 0, "trainer.eval_at_end": False})
        overrides = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()]
        return load_config(RunConfig, None, overrides + list(self.overrides))



def _every(steps: float, per_iteration: int, total: int) -> int:
    """TRL's *_steps (optimizer steps, or a fraction of the run below 1, rounded up as transformers'
    TrainerState.compute_steps) in iterations: the first iteration's end at or after them."""
    n = math.ceil(steps * total) if 0 < steps < 1 else steps
    return max(1, math.ceil(n / per_iteration))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "npu") and torch.npu.is_available())


