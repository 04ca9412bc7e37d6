"""TRL's GRPOTrainer on this pipeline: the model, the dataset and the reward functions become a
`pipeline.Task` and a `RunConfig`; `train()` runs `pipeline.run` (the package docstring says what
it guarantees)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from periodic_async.config import ConfigError, RunConfig, UserError
from periodic_async.data import DataError
from periodic_async.trl_api.config import REFUSED, GRPOConfig
from periodic_async.trl_api.data import _Logs, _nan_accuracy, to_examples, trl_reward


@dataclass
class TrainOutput:
    """What `train()` returns, as transformers' TrainOutput: the optimizer steps taken, the mean
    training loss over them, and the run's summary metrics."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


class GRPOTrainer:
    """TRL's `GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class)`
    on this pipeline; see trl_api's docstring.

    model: a Hugging Face model directory, a hub id ('org/name': its snapshot in the local Hugging Face
    cache, downloaded when the hub is reachable), a preset name (config.py) or a `PreTrainedModel` (saved
    to <output_dir>/initial_model with its tokenizer, by rank 0 under torchrun: the engines load
    weights from a directory).
    reward_funcs: a function, a 'module:function' name, or a list of them (TRL's signature).
    processing_class: the tokenizer; None: the model directory's own.
    peft_config: a `peft.LoraConfig`: LoRA adapters train on the frozen model (model.lora; `lora.from_peft`
    says what is taken); `save_model` then writes the adapter, as TRL does for a PEFT model.
    tools, environment_factory: TRL's (functions with type hints and docstrings; a callable making an
    environment with reset(**row), its public methods as tools and an optional get_reward(), or a
    dict of them selected by the rows' `environment` column): every group is G episodes
    (docs/episodes.md), checked here as TRL checks them; an environment's get_reward() is a reward
    source of weight 1, so reward_funcs may then be left out. `args.max_tool_calling_iterations` and
    `args.max_completion_length` bound each episode; `args.tool_format` picks the plain-text call
    format for chat templates that cannot render tools.
    """

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, peft_config=None, tools=None, environment_factory=None,
                 **kwargs) -> None:
        for name, value in kwargs.items():
            if value is not None and value != (None, None):  # TRL's optimizers=(None, None)
                raise ConfigError(f"GRPOTrainer({name}=...): not supported here "
                                  f"({REFUSED.get(name, 'not an argument we take')})")
        self.args = args or GRPOConfig()
        if self.args.no_effect:
            print(f"[GRPOConfig] no effect here: {', '.join(sorted(self.args.no_effect))} (docs/trl.md says why)")
        self.output_dir = Path(self.args.output_dir or "trainer_output")
        from periodic_async.lora import from_peft, is_lora  # torch: imported when a trainer is built

        if is_lora(model):
            raise ConfigError("GRPOTrainer(model=<PeftModel>): pass the base model and the adapter's settings as "
                              "peft_config=LoraConfig(...) (the engines load the base and take the adapter at each "
                              "push)")
        self.lora = None if peft_config is None else from_peft(peft_config, lambda: _model_type(model))
        """model.lora of the run (from TRL's peft_config), or None: the full model trains."""
        self.model_path = self._model_path(model, processing_class)
        self.environments = None
        """The episodes' `Environments` (tools / environment_factory), or None: single-turn groups."""
        if tools or environment_factory is not None:
            from periodic_async.episode import Environments

            self.environments = Environments(environment_factory, tools or [])
        funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        if not funcs and not (self.environments is not None and self.environments.has_reward):
            raise ConfigError("GRPOTrainer(reward_funcs=...): at least one reward function is needed (or an "
                              "environment_factory whose environment has get_reward())")
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
        if self.environments is not None and self.environments.multi:  # each row picks its environment
            for i, e in enumerate(self.train_examples):
                self.environments.name_for(e.columns, where=f"train_dataset row {i}")
        # eval_strategy='no': TRL never evaluates, so the eval_dataset is not used (nor needs an accuracy)
        self.eval_examples = to_examples(eval_dataset if self.args.eval_strategy != "no" else None, "eval_dataset")
        self.accuracy = self._accuracy_fn()
        if self.eval_examples and self.accuracy is _nan_accuracy:
            raise ConfigError("GRPOTrainer(eval_dataset=...): held-out evaluation reports accuracy, and none applies: "
                              "give the dataset an 'answer' column or set GRPOConfig(accuracy_function=...)")
        self.state = None  # the run's summary once trained
        self._model = None

    def _model_path(self, model, processing_class) -> str:
        """A directory (or preset name) the trainer and the engines load; see the class docstring."""
        if isinstance(model, (str, os.PathLike)):
            from periodic_async.model import resolve_model_path

            path = resolve_model_path(str(model))  # a hub id ('org/name', as TRL takes): its cached snapshot
            if processing_class is not None:
                if not (Path(path) / "tokenizer_config.json").is_file():
                    wrong = f"the tokenizer was not saved with the model: {path} has no tokenizer_config.json"
                elif not _same_tokenizer(processing_class, path):
                    wrong = f"differs from the tokenizer saved with the model in {path}"
                else:
                    return path
                raise ConfigError(f"GRPOTrainer(processing_class=...): {wrong} (the engines decode with the model "
                                  "directory's own): save it there (processing_class.save_pretrained(...)) or pass "
                                  "processing_class=None")
            return path
        if not hasattr(model, "save_pretrained"):
            raise ConfigError(f"GRPOTrainer(model=...): expected a model directory, a preset name or a "
                              f"PreTrainedModel, got {type(model).__name__}")
        out = self.output_dir / "initial_model"
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

        def write() -> None:
            if out.exists():
                shutil.rmtree(out)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)

        from periodic_async.parallel.distributed import on_main_process

        on_main_process(write, f"write {out}")
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
        """The run's RunConfig (GRPOConfig.run_config on this dataset and model; model.lora from peft_config)."""
        cfg = self.args.run_config(len(self.train_examples), self.model_path)
        if self.lora is not None:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=self.lora))
        return cfg

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run the pipeline; returns TrainOutput(global_step, training_loss, metrics), from the run's
        summary (the same steps and loss on every rank under torchrun)."""
        from periodic_async import pipeline

        cfg = self.run_config()
        if resume_from_checkpoint:
            cfg.trainer.resume = "auto" if resume_from_checkpoint is True else str(resume_from_checkpoint)
        if self.args.max_prompt_length is not None:
            self._check_prompt_lengths(cfg)
        task = pipeline.Task(self.train_examples, self.eval_examples, self.reward, self.accuracy,
                             environments=self.environments)
        summary = pipeline.run(cfg, task=task)  # on every rank under torchrun (the other ranks' summary is short)
        self.state = summary
        self._model = None
        steps = cfg.trainer.iterations * cfg.algorithm.optimizer_steps_per_iteration  # the run ends there
        return TrainOutput(global_step=steps, training_loss=summary.get("train_loss", math.nan), metrics=summary)

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process (rank 0 under torchrun), the one that writes (TRL's name)."""
        return int(os.environ.get("RANK", "0")) == 0

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
        """The trained policy (loaded from the last checkpoint), or the initial one before train().
        With peft_config: a `peft.PeftModel` (the base and the trained adapter), as TRL's."""
        if self._model is None:
            ckpt = self.output_dir / "checkpoint"
            if self.lora is not None:
                from periodic_async.config import LoRAConfig
                from periodic_async.lora import apply_lora
                from periodic_async.model import load_policy

                cfg = self.run_config()
                base, _ = load_policy(dataclasses.replace(cfg.model, lora=LoRAConfig()))
                if ckpt.exists():
                    from peft import PeftModel

                    from periodic_async.checkpoint import ADAPTER

                    self._model = PeftModel.from_pretrained(base, ckpt / ADAPTER)
                else:
                    self._model = apply_lora(base, self.lora, seed=cfg.model.seed)
            else:
                from transformers import AutoModelForCausalLM

                self._model = AutoModelForCausalLM.from_pretrained(ckpt if ckpt.exists() else self.model_path)
        return self._model

    def save_model(self, output_dir: str | None = None) -> Path:
        """Write the trained policy and its tokenizer as a Hugging Face directory
        (`AutoModelForCausalLM.from_pretrained(output_dir)` loads it). With peft_config, as TRL
        writes a PEFT model: the adapter (adapter_config.json, adapter_model.safetensors) and the
        tokenizer, which `peft.PeftModel.from_pretrained(base, output_dir)` loads."""
        from periodic_async import checkpoint

        out = Path(output_dir or self.output_dir)
        model_files = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")

        def write() -> None:
            ckpt = checkpoint.latest(self.output_dir)
            if ckpt is None:
                raise UserError(f"GRPOTrainer.save_model: no checkpoint in {str(self.output_dir)!r}: call train() "
                                "first")
            lora = (ckpt / checkpoint.ADAPTER).is_dir()
            out.mkdir(parents=True, exist_ok=True)
            for f in ckpt.iterdir():
                if f.is_file() and f.name not in ("trainer_state.pt", "rng_state.pt", "checkpoint.json", "complete"):
                    if lora and (f.name in model_files or f.name.startswith("model-")):
                        continue  # the merged policy: a PEFT model is saved as its adapter
                    shutil.copy2(f, out / f.name)
            if lora:
                for f in (ckpt / checkpoint.ADAPTER).iterdir():
                    shutil.copy2(f, out / f.name)

        from periodic_async.parallel.distributed import on_main_process

        on_main_process(write, f"save the model to {out}")
        return out


def _same_tokenizer(tokenizer, path: str) -> bool:
    from periodic_async.data.tokenizer import load_tokenizer

    own = load_tokenizer(path)
    return own.get_vocab() == tokenizer.get_vocab() and getattr(own, "chat_template", None) == \
        getattr(tokenizer, "chat_template", None)


def _model_type(model) -> str | None:
    """The architecture (config.json's model_type) of `model`: a preset name, a model directory or
    hub id, or a PreTrainedModel."""
    from periodic_async.model import PRESETS, resolve_model_path

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None and isinstance(model, (str, os.PathLike)):
        path = resolve_model_path(str(model))
        if path in PRESETS:
            model_type = PRESETS[path]["model_type"]
        elif (Path(path) / "config.json").is_file():
            model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    return model_type
