"""TRL's interface on our pipeline (trl_api.py): a TRL-shaped script trains here, its reward sees
TRL's arguments, every TRL field is mapped, accepted with no effect, or refused in one line, and
the advantages and loss on one batch equal those of TRL's own GRPOTrainer."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from periodic_async import GRPOConfig, GRPOTrainer
from periodic_async.config import ConfigError
from periodic_async.data import DataError
from helpers import save_preset, teach

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """qwen2-1m (random weights, float32) with its tokenizer: a Hugging Face model directory."""
    return save_preset(tmp_path_factory.mktemp("tiny-model"), "qwen2-1m", tokenizer_dir)


def _dataset(conversational: bool, n: int = 8):
    from datasets import Dataset

    rows = []
    for i in range(n):
        q = f"Ava has {i + 1} pens. She buys {i + 2} more. How many pens?"
        rows.append({"prompt": [{"role": "user", "content": q}] if conversational else q,
                     "answer": str(2 * i + 3), "target": 4 + i % 3})
    return Dataset.from_list(rows)


# --- the config ------------------------------------------------------------------------------------

def test_config_maps_trl_fields_to_the_run():
    args = GRPOConfig(output_dir="o", learning_rate=3e-6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      num_generations=4, max_completion_length=32, max_steps=6, steps_per_generation=4, beta=0.04,
                      epsilon=0.1, epsilon_high=0.28, loss_type="dr_grpo", scale_rewards=False,
                      lr_scheduler_type="cosine",
                      warmup_ratio=0.5, temperature=0.7, top_p=0.9, seed=7, report_to="none", save_steps=2)
    cfg = args.run_config(num_prompts=100, model="m")
    a = cfg.algorithm
    # generation batch = 4 x 1 process x 4 steps = 16 completions = 4 prompts x 4; 2 optimizer steps per batch
    assert (a.prompts_per_iteration, a.group_size, a.optimizer_steps_per_iteration) == (4, 4, 2)
    assert cfg.trainer.iterations == 3 and a.warmup_steps == 3 and cfg.trainer.save_every == 1
    assert (a.lr, a.beta, a.eps_low, a.eps_high, a.loss_norm, a.advantage, a.advantage_eps, a.lr_scheduler) == \
        (3e-6, 0.04, 0.1, 0.28, "constant", "mean", 1e-4, "cosine")
    assert (cfg.engine.max_tokens, cfg.engine.temperature, cfg.engine.top_p) == (32, 0.7, 0.9)
    assert (cfg.model.seed, cfg.data.seed, cfg.logging.wandb_mode, cfg.pipeline.mode) == (7, 7, "disabled",
                                                                                          "periodic-async")
    # epochs instead of max_steps: 2 epochs x 2 whole batches of 4 of the 10 prompts (TRL's sampler)
    assert GRPOConfig(num_train_epochs=2, per_device_train_batch_size=16, num_generations=4).iterations(10) == 4
    assert GRPOConfig(overrides=["engine.num_workers=3"]).run_config(8).engine.num_workers == 3
    # a field with no effect is kept (and printed by the trainer), also through dataclasses.replace
    import dataclasses

    again = dataclasses.replace(GRPOConfig(logging_first_step=True, torch_empty_cache_steps=2), seed=1)
    assert again.no_effect == {"logging_first_step": True, "torch_empty_cache_steps": 2} and again.seed == 1
    # activation checkpointing is honoured, on by default as in TRL
    assert GRPOConfig().run_config(8).trainer.gradient_checkpointing is True
    assert GRPOConfig(gradient_checkpointing=False).run_config(8).trainer.gradient_checkpointing is False


@pytest.mark.parametrize("kwargs, names", [
    ({"num_iterations": 2}, "num_iterations=2"),
    ({"loss_type": "bnpo"}, "loss_type='bnpo'"),
    ({"scale_rewards": "batch"}, "scale_rewards='batch'"),
    ({"deepspeed": "ds.json"}, "deepspeed"),
    ({"not_a_field": 1}, "not_a_field"),
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level='sequence'"),
])
def test_unsupported_field_is_one_line(kwargs, names):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**kwargs)
    assert names in str(e.value) and "\n" not in str(e.value)


def _trl_defaults(trl) -> dict:
    """TRL 1.16's GRPOConfig fields at their defaults: the keyword arguments a script leaves out."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(trl.GRPOConfig):
        if f.init:
            out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def _other(value):
    """A value other than `value` (TRL's default) of a plausible type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    return "other"


def test_every_trl_field_is_taken_or_refused_in_one_line():
    """Each of TRL 1.16's GRPOConfig fields (its own and TrainingArguments') is mapped, taken
    with no effect (and recorded), or taken at TRL's default only: another value of an
    ONLY_DEFAULT or REFUSED field is one ConfigError line naming the field and giving the
    table's reason. TRL's default is accepted for every field, and so is every argument of
    TRL's GRPOTrainer at its default."""
    trl = pytest.importorskip("trl")
    import dataclasses
    import inspect

    from periodic_async import trl_api

    ours = {f.name for f in dataclasses.fields(GRPOConfig)} - {"no_effect"}
    defaults = _trl_defaults(trl)
    assert len(defaults) > 150
    for name, default in defaults.items():
        GRPOConfig(**{name: default})  # TRL's default is accepted, whatever the field
        kinds = [name in ours, name in trl_api.NO_EFFECT, name in trl_api.ONLY_DEFAULT, name in trl_api.REFUSED]
        assert sum(kinds) == 1, f"{name}: mapped, NO_EFFECT, ONLY_DEFAULT or REFUSED, exactly one ({kinds})"
        if name in trl_api.NO_EFFECT:
            assert GRPOConfig(**{name: _other(default)}).no_effect == {name: _other(default)}, name
        elif name in trl_api.ONLY_DEFAULT or name in trl_api.REFUSED:
            why = trl_api.ONLY_DEFAULT[name][1] if name in trl_api.ONLY_DEFAULT else trl_api.REFUSED[name]
            with pytest.raises(ConfigError) as e:
                GRPOConfig(**{name: _other(default)})
            assert f"GRPOConfig({name}=" in str(e.value) and why in str(e.value) and "\n" not in str(e.value), name
    # the trainer's arguments: ours, or refused at any value but TRL's default
    for name, p in inspect.signature(trl.GRPOTrainer.__init__).parameters.items():
        if name in ("self", "model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class",
                    "peft_config", "tools", "environment_factory"):
            continue
        assert name in trl_api.REFUSED, name
        assert p.default in (None, (None, None)), name


def test_defaults_are_trls_or_listed_as_differences():
    """Every field both configs have (mapped or ONLY_DEFAULT) has TRL 1.16's default here, or is
    in DEFAULTS_DIFFER with its reason; docs/trl.md lists that table."""
    trl = pytest.importorskip("trl")
    import dataclasses

    from periodic_async import trl_api

    defaults = _trl_defaults(trl)
    ours = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
            for f in dataclasses.fields(GRPOConfig)}
    ours.update({k: v for k, (v, _) in trl_api.ONLY_DEFAULT.items()})
    differ = {k: (ours[k], defaults[k]) for k in ours.keys() & defaults.keys() if ours[k] != defaults[k]}
    assert set(differ) <= set(trl_api.DEFAULTS_DIFFER), f"defaults unlike TRL's and not listed: {differ}"
    assert set(trl_api.DEFAULTS_DIFFER) <= ours.keys() & defaults.keys()
    docs = (ROOT / "docs" / "trl.md").read_text()
    for name, why in trl_api.DEFAULTS_DIFFER.items():
        assert f"| `{name}` |" in docs and why.replace("|", "\\|") in docs, \
            f"docs/trl.md lacks {name}: run python scripts/update_readme.py"


def test_trl_full_kwargs_build_a_config():
    """A config written out in full at TRL's defaults (every field passed, as a script that
    copies `dataclasses.asdict(trl.GRPOConfig(...))` does, before or after TRL's __post_init__)
    builds ours, and means what TRL's defaults mean."""
    trl = pytest.importorskip("trl")
    import dataclasses

    for kwargs in (_trl_defaults(trl), dataclasses.asdict(trl.GRPOConfig(output_dir="o", use_cpu=True))):
        kwargs["output_dir"] = "o"
        cfg = GRPOConfig(**kwargs).run_config(num_prompts=100, model="m")
        assert (cfg.algorithm.prompts_per_iteration, cfg.algorithm.group_size) == (1, 8)
        assert (cfg.trainer.eval_every, cfg.trainer.eval_at_end, cfg.logging.wandb_mode) == (0, False, "disabled")
        assert cfg.trainer.iterations == 3 * 100 and cfg.algorithm.lr == 1e-6


def test_schedule_and_intervals_follow_transformers():
    """Where transformers 5 / TRL 1.16 resolve a field, the run gets the same number: warm-up and
    *_steps fractions are the ceiling of the fraction of the run; "constant" has no warm-up
    ("constant_with_warmup" has); epochs count whole generation batches (TRL's sampler drops the
    last partial one); eval_steps=None is logging_steps; save_total_limit=None keeps every
    checkpoint; report_to=None reports nowhere."""
    def cfg(**kwargs):  # 12 optimizer steps: 12 generation batches of 1 step
        settings = dict(max_steps=12, per_device_train_batch_size=8, num_generations=2)
        settings.update(kwargs)
        return GRPOConfig(**settings).run_config(num_prompts=100)

    assert cfg(warmup_steps=0.1).algorithm.warmup_steps == 2  # ceil(1.2)
    assert cfg(warmup_ratio=0.1).algorithm.warmup_steps == 2
    assert cfg(warmup_steps=3).algorithm.warmup_steps == 3
    assert cfg(save_steps=0.1).trainer.save_every == 2  # ceil(1.2) steps
    assert cfg(eval_strategy="steps", eval_steps=0.1).trainer.eval_every == 2
    assert cfg(lr_scheduler_type="constant", warmup_steps=3).algorithm.warmup_steps == 0
    with_warmup = cfg(lr_scheduler_type="constant_with_warmup", warmup_steps=3).algorithm
    assert (with_warmup.lr_scheduler, with_warmup.warmup_steps) == ("constant", 3)
    # epochs: 10 prompts, 4 per generation batch: 2 whole batches an epoch (prompts 9, 10 dropped)
    assert GRPOConfig(num_train_epochs=2, per_device_train_batch_size=16, num_generations=4).iterations(10) == 4
    assert GRPOConfig(num_train_epochs=1.5, per_device_train_batch_size=16, num_generations=4).iterations(10) == 3
    with pytest.raises(ConfigError, match="train_dataset.*3 prompts.*4"):
        GRPOConfig(per_device_train_batch_size=16, num_generations=4).iterations(3)
    # eval_steps=None: logging_steps (TRL's default 10, or the script's)
    assert cfg(eval_strategy="steps").trainer.eval_every == 10
    assert cfg(eval_strategy="steps", logging_steps=3).trainer.eval_every == 3
    assert cfg(eval_strategy="steps", logging_steps=0.25).trainer.eval_every == 3
    assert (cfg().trainer.eval_every, cfg().trainer.eval_at_end) == (0, False)  # eval_strategy="no": never
    assert cfg().trainer.keep_last == 0 and cfg(save_total_limit=3).trainer.keep_last == 3  # 0: every one
    assert cfg().logging.wandb_mode == cfg(report_to=None).logging.wandb_mode == "disabled"
    assert cfg(report_to="wandb").logging.wandb_mode in ("offline", "online")


# --- the trainer -----------------------------------------------------------------------------------

def _args(out, **kwargs):
    settings = dict(output_dir=str(out), max_steps=2, per_device_train_batch_size=8, num_generations=2,
                    max_completion_length=12, learning_rate=1e-3, report_to="none",
                    overrides=["engine.backend=local", "logging.progress=false"])
    settings.update(kwargs)
    return GRPOConfig(**settings)


@pytest.mark.parametrize("conversational", [True, False])
def test_trl_script_trains_two_steps_and_saves(tmp_path, model_dir, conversational):
    seen = []

    def length_reward(prompts, completions, completion_ids, trainer_state, target, **kwargs):
        seen.append({"prompt": prompts[0], "completion": completions[0], "ids": completion_ids[0],
                     "step": trainer_state.global_step, "target": target, "answer": kwargs["answer"]})
        texts = [c[0]["content"] for c in completions] if conversational else completions
        return [-abs(len(t) - k) / 10 for t, k in zip(texts, target)]

    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    evals = dict(eval_dataset=_dataset(True, n=3), args=_args(tmp_path / "run", eval_strategy="steps", eval_steps=1)) \
        if conversational else dict(args=_args(tmp_path / "run"))
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[length_reward, not_applicable],
                          train_dataset=_dataset(conversational), **evals)
    out = trainer.train()
    assert out.global_step == 2 and math.isfinite(out.training_loss)
    assert out.metrics["iterations"] == 2 and out.metrics["mode"] == "periodic-async"
    # TRL's arguments: the prompt as given, completions as messages (conversational) or text, the columns
    assert len(seen) == 2 * 4 and {s["step"] for s in seen} == {0, 1}
    s = seen[0]
    if conversational:
        assert s["prompt"][0]["role"] == "user" and s["completion"][0]["role"] == "assistant"
    else:
        assert isinstance(s["prompt"], str) and isinstance(s["completion"], str)
    assert all(isinstance(t, int) for t in s["ids"]) and len(s["target"]) == 2 and s["answer"][0].isdigit()
    # the accuracy counts the `answer` column (the correctness reward); the weights moved; round trip
    metrics = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "train/loss" in line]
    assert len(metrics) == 2 and '"accuracy": NaN' not in metrics[0]
    if conversational:  # eval_steps=1: the held-out accuracy of versions 0, 1 and 2 (the end)
        held_out = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
        assert [h["step"] for h in held_out] == [0, 1, 2] and all(h["n"] == 3 for h in held_out)
    saved = trainer.save_model(tmp_path / "final")
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    assert set(before) == set(after) and any(not torch.equal(before[k], after[k]) for k in before)
    assert (saved / "tokenizer_config.json").is_file()


# --- tools and environments (TRL's tools=, environment_factory) ----------------------------------------

def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


class MultiplyEnv:
    """TRL's environment protocol: reset(**row), a public method as a tool, get_reward()."""

    def reset(self, **row):
        self.row, self.calls = row, 0
        return None

    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        self.calls += 1
        return str(a * b)

    def get_reward(self) -> float:
        return float(self.calls > 0)


def _tool_dataset(n: int = 4):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i + 3} times 4?"}],
                               "answer": str(4 * (i + 3))} for i in range(n)])


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory, tokenizer_dir):
    """A model directory whose chat template renders tools (Qwen2.5's, TRL's copy, on the test
    tokenizer with its turn tokens): qwen2-micro taught in 100 Adam steps to answer the tool
    dataset's questions with <tool_call>{"name": "multiply", ...}</tool_call>, and after the tool's
    answer to write <answer>12</answer>."""
    trl = pytest.importorskip("trl")
    from periodic_async.config import ModelConfig
    from periodic_async.data.tokenizer import load_tokenizer
    from periodic_async.episode import Environments
    from periodic_async.episode.formats import TemplateFormat
    from periodic_async.model import build_model

    tok = load_tokenizer(tokenizer_dir)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    policy = build_model(ModelConfig(name_or_path="qwen2-micro", dtype="float32", seed=1), tok)
    fmt, schemas = TemplateFormat(tok), Environments(tools=[multiply]).schemas()
    eos = [tok.eos_token_id]
    call = tok('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>').input_ids + eos
    answer = tok("<answer>12</answer>").input_ids + eos
    prompts = [fmt.prompt_ids(row["prompt"], schemas) for row in _tool_dataset()]
    tool_turn = fmt.env_ids(fmt.answer_messages([("multiply", "12")]), "multiply")
    batch = [(p, call) for p in prompts] + [(prompts[0] + call + tool_turn, answer)]
    teach(policy, batch, tok.pad_token_id, steps=100)
    out = tmp_path_factory.mktemp("tool-model")
    policy.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("how", ["tools", "environment_factory"])
def test_trl_tool_scripts_train(tmp_path, tool_model_dir, how):
    """A TRL script with `tools=[multiply]`, and one with `environment_factory=MultiplyEnv` (whose
    get_reward is the only reward), train here as written for TRL: the model calls the tool in the
    template's own format, the tool answers, the episode goes on; the reward functions get TRL's
    arguments (completions as the episode's messages, `environments`), reset gets the whole row;
    environment tokens are counted apart and out of the loss; max_tool_calling_iterations=1 allows
    two model turns."""
    seen = []

    def used_the_tool(prompts, completions, **kwargs):
        seen.append({"completions": completions, "environments": kwargs.get("environments")})
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    extra = dict(tools=[multiply], reward_funcs=[used_the_tool]) if how == "tools" else \
        dict(environment_factory=MultiplyEnv)
    trainer = GRPOTrainer(model=str(tool_model_dir), train_dataset=_tool_dataset(),
                          args=_args(tmp_path / "run", per_device_train_batch_size=4, max_completion_length=200,
                                     max_tool_calling_iterations=1, temperature=0.3), **extra)
    out = trainer.train()
    assert out.global_step == 2 and math.isfinite(out.training_loss)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if "train/loss" in line]
    assert len(metrics) == 2
    for m in metrics:
        assert m["episode/tool_calls"] > 0 and m["episode/env_tokens"] > 0 and m["episode/turns"] <= 2 * 4
        assert m["train/tokens"] == m["episode/model_tokens"] < m["tokens/response"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert any(r > 0 for row in rows for r in row["rewards"])
    if how == "tools":
        completion = next(c for s in seen for c in s["completions"] if len(c) > 1)
        assert completion[0]["role"] == "assistant" and completion[0]["tool_calls"][0]["function"]["name"] == \
            "multiply" and completion[1] == {"role": "tool", "name": "multiply", "content": "12"}
        assert all(s["environments"] == [None, None] for s in seen)


def test_trl_bad_tools_and_environments_are_one_line(tmp_path, tool_model_dir):
    """TRL's start-up checks, in one line each: an environment without reset, a tool without a
    docstring, a dict factory whose rows lack `environment`, a template that cannot render tools."""
    class NoReset:
        def multiply(self, a: int, b: int) -> str:
            """Multiply.

            Args:
                a: a
                b: b
            """
            return str(a * b)

    def undocumented(a: int) -> str:
        return str(a)

    cases = [(dict(environment_factory=NoReset), "environment_factory: NoReset has no reset() method"),
             (dict(tools=[undocumented]), "undocumented: Cannot generate JSON schema"),
             (dict(environment_factory={"calc": MultiplyEnv}), "train_dataset row 0: environment_factory is a dict")]
    for extra, words in cases:
        with pytest.raises(Exception) as e:
            GRPOTrainer(model=str(tool_model_dir), reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                        train_dataset=_tool_dataset(), args=_args(tmp_path / "run"), **extra)
        assert words in str(e.value) and "\n" not in str(e.value), (words, str(e.value))


def test_bad_dataset_and_reward_are_one_line(tmp_path, model_dir):
    from datasets import Dataset

    with pytest.raises(DataError, match="row 1: no 'prompt' column"):
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path),
                    train_dataset=Dataset.from_list([{"prompt": "a"}, {"question": "b"}]))
    with pytest.raises(ConfigError, match="accuracy"):  # held-out evaluation needs an accuracy
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path, eval_strategy="steps"),
                    train_dataset=Dataset.from_list([{"prompt": "a"}]),
                    eval_dataset=Dataset.from_list([{"prompt": "b"}]))
    with pytest.raises(DataError, match="max_prompt_length=3"):  # checked at start-up, never cut
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path, max_prompt_length=3),
                    train_dataset=_dataset(False)).train()
    with pytest.raises(ConfigError, match="peft_config"):
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path), train_dataset=_dataset(False),
                    peft_config={"r": 8})


# --- LoRA: peft_config ---------------------------------------------------------------------------

def test_peft_config_sets_model_lora(tmp_path, model_dir):
    """TRL's peft_config (a peft.LoraConfig) becomes model.lora: r, lora_alpha, lora_dropout and
    target_modules (names, 'all-linear', or None: peft's default for the architecture, q_proj and
    v_proj for Qwen2); without it the full model trains."""
    peft = pytest.importorskip("peft")
    from periodic_async.config import LoRAConfig

    def lora_of(**kw):
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path),
                              train_dataset=_dataset(False), peft_config=peft.LoraConfig(**kw) if kw else None)
        return trainer.run_config().model.lora

    assert lora_of() == LoRAConfig() and not lora_of().enabled
    assert lora_of(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["v_proj", "q_proj"],
                   task_type="CAUSAL_LM") == \
        LoRAConfig(enabled=True, rank=4, alpha=8.0, dropout=0.05, target_modules=["q_proj", "v_proj"])
    assert lora_of(r=16, lora_alpha=32, target_modules="all-linear").target_modules == ["all-linear"]
    assert lora_of(r=16, lora_alpha=32).target_modules == ["q_proj", "v_proj"]
    assert lora_of(r=8, lora_alpha=16, target_modules={"o_proj", "down_proj"}).target_modules == ["down_proj", "o_proj"]


@pytest.mark.parametrize("make, names", [
    (lambda peft: {"r": 8}, "peft_config=<dict>"),
    (lambda peft: peft.LoHaConfig(target_modules=["q_proj"]), "peft_config=<LoHaConfig>"),
    (lambda peft: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
     "peft_config=<PromptTuningConfig>"),
    (lambda peft: peft.LoraConfig(bias="all"), "peft_config=LoraConfig(bias='all')"),
    (lambda peft: peft.LoraConfig(use_dora=True), "peft_config=LoraConfig(use_dora=True)"),
    (lambda peft: peft.LoraConfig(use_rslora=True), "peft_config=LoraConfig(use_rslora=True)"),
    (lambda peft: peft.LoraConfig(modules_to_save=["lm_head"]), "peft_config=LoraConfig(modules_to_save=['lm_head'])"),
    (lambda peft: peft.LoraConfig(task_type="SEQ_CLS"), "peft_config=LoraConfig(task_type='SEQ_CLS')"),
    (lambda peft: peft.LoraConfig(target_modules=".*proj"), "peft_config=LoraConfig(target_modules='.*proj')"),
    (lambda peft: peft.LoraConfig(target_modules=["q_proj", "qkv"]), "model.lora.target_modules"),
    (lambda peft: peft.LoraConfig(lora_dropout=1.0, target_modules=["q_proj"]), "model.lora.dropout=1.0"),
])
def test_unsupported_peft_config_is_one_line(tmp_path, model_dir, make, names):
    """Another peft method, bias, task or LoRA variant, a regular expression of target modules, a
    module the model lacks, a bad value: one ConfigError line naming peft_config's field (or the
    model.lora field it maps to); nothing starts."""
    peft = pytest.importorskip("peft")
    with pytest.raises(ConfigError) as e:
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path), train_dataset=_dataset(False),
                    peft_config=make(peft)).train()
    assert names in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_peft_model_as_model_is_one_line(tmp_path, model_dir):
    """A PeftModel as the model: one line asking for the base model and peft_config."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    wrapped = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                  peft.LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match=r"GRPOTrainer\(model=<PeftModel>\): pass the base model"):
        GRPOTrainer(model=wrapped, reward_funcs=len, args=_args(tmp_path), train_dataset=_dataset(False))


def test_trl_script_with_peft_config_saves_the_adapter(tmp_path, model_dir):
    """A TRL script with peft_config trains LoRA adapters: save_model writes what TRL writes for a
    PEFT model (adapter_config.json, adapter_model.safetensors, the tokenizer; no full weights), and
    `PeftModel.from_pretrained(base, dir)` gives the trained policy's log-probs (the last
    checkpoint's merged weights), which training moved off the base's; `trainer.model` is that
    PeftModel."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from periodic_async.shared_prompt import pack, token_logprobs

    trainer = GRPOTrainer(model=str(model_dir),
                          reward_funcs=lambda completions, **kw: [len(c) / 10 for c in completions],
                          args=_args(tmp_path / "run"), train_dataset=_dataset(False),
                          peft_config=peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear",
                                                      task_type="CAUSAL_LM"))
    assert trainer.train().global_step == 2
    saved = trainer.save_model(tmp_path / "final")
    names = {p.name for p in saved.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= names
    assert not names & {"model.safetensors", "config.json"}
    batch = pack([([5, 9, 11, 7], [[12, 30, 8], [40, 41]])])
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), saved)
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint")  # the merged policy
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        got, want, start = (token_logprobs(m, batch) for m in (loaded, trained, base))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert (got - start).abs().max() > 1e-4, "training must move the policy"
        assert isinstance(trainer.model, peft.PeftModel)
        torch.testing.assert_close(token_logprobs(trainer.model, batch), want, rtol=0, atol=1e-5)


# --- the same numbers as TRL ---------------------------------------------------------------------

def _move_off_reference(model: torch.nn.Module, scale: float = 0.03) -> None:
    """Add scale x N(0, 1) noise to every parameter, drawn per parameter name from a fixed seed:
    the same move for TRL's model and ours, which leaves both references (the directory's
    weights) behind, so the KL and its gradient are not zero."""
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters(), key=lambda np_: np_[0])):
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 + i), dtype=torch.float64)
            p.add_(scale * noise.to(p.dtype))


# TRL's defaults where a field is not named: use_bias_correction_kl=True and, with vLLM, the
# importance correction in 'sequence_mask' mode with C_max = 3.
PARITY_CASES = {
    "dapo-two-steps-token_truncate": dict(
        loss_type="dapo", scale_rewards="group", beta=0.04, steps=2, vllm=True,
        trl=dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.5,
                 vllm_importance_sampling_clip_max=2.0)),
    "dr_grpo-sequence_mask": dict(loss_type="dr_grpo", scale_rewards="none", beta=0.05, steps=1, vllm=True, trl={}),
    "grpo-without-vllm": dict(loss_type="grpo", scale_rewards="group", beta=0.0, steps=1, vllm=False, trl={}),
    "grpo-sequence_truncate-plain-kl": dict(
        loss_type="grpo", scale_rewards="none", beta=0.03, steps=1, vllm=True,
        trl=dict(use_bias_correction_kl=False, vllm_importance_sampling_mode="sequence_truncate",
                 vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_advantages_and_loss_match_trl(tmp_path, model_dir, case, monkeypatch):
    """One generation batch (2 prompts x 4 fixed completions of unequal lengths, fixed rewards with
    one None, engine log-probs that differ from the policy's) through TRL 1.16's GRPOTrainer (its
    rollout_func hook hands it the completions and log-probs) and through ours: the same
    advantages and, at each optimizer step of the batch, the same loss and gradient within fp32
    tolerance. Both policies are moved off their reference (KL > 0, bias-corrected or not); with
    two steps per generation the second runs after the same parameter move in both (ratio != 1).
    TRL applies its vLLM importance correction only with use_vllm=True and vLLM is not installed
    here: its trainer is built without and `use_vllm` is set afterwards (the correction reads
    nothing of vLLM; the rollout_func stands in for its generation)."""
    c = PARITY_CASES[case]
    trl = pytest.importorskip("trl")
    from trl.trainer.utils import split_tensor_dict

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from periodic_async import batching, grpo, trimodel
    from periodic_async.data import encode_prompts
    from periodic_async.data.tokenizer import load_tokenizer
    from periodic_async.group import Group
    from periodic_async.model import load_policy
    from periodic_async.shared_prompt import pack, token_logprobs
    from periodic_async.trl_api import to_examples, trl_reward

    G, max_tokens, steps = 4, 8, c["steps"]
    ds = _dataset(True, n=2)
    examples = to_examples(ds)
    tok = load_tokenizer(model_dir)
    prompt_ids = encode_prompts(tok, examples)
    assert len({len(p) for p in prompt_ids}) == 1  # equal lengths: TRL left-pads, positions would shift
    gen = torch.Generator().manual_seed(0)
    lengths = [(3, 8, 5, 1), (6, 2, 8, 7)]  # 17 and 23 tokens: the two optimizer steps' own counts differ
    completions = [[torch.randint(5, len(tok), (n,), generator=gen).tolist() for n in ns] for ns in lengths]
    completions[0][1][-1] = tok.eos_token_id
    table = {tuple(c): r for cs, rs in zip(completions, [[1.0, 0.0, 0.5, 1.0], [0.2, 0.2, 0.9, None]])
             for c, r in zip(cs, rs)}

    def fixed_reward(completions, completion_ids, **kwargs):
        return [table[tuple(c)] for c in completion_ids]

    # ours: TRL's fields through our GRPOConfig; the policy moved off its reference (old = the moved policy)
    fields = dict(per_device_train_batch_size=2 * G // steps, steps_per_generation=steps, num_generations=G,
                  max_completion_length=max_tokens, loss_type=c["loss_type"], scale_rewards=c["scale_rewards"],
                  beta=c["beta"], **c["trl"])
    cfg = GRPOConfig(**fields, use_vllm=c["vllm"], report_to="none", use_cpu=True).run_config(2, str(model_dir))
    assert (cfg.algorithm.prompts_per_iteration, cfg.algorithm.optimizer_steps_per_iteration) == (2, steps)
    policy, _ = load_policy(cfg.model)
    tri = trimodel.TriModel(policy, cfg.algorithm, logprob_kwargs={"temperature": 1.0})
    _move_off_reference(policy)
    tri.refresh_old()

    # the engines' log-probs: the moved policy's minus a per-token offset d_i / R_i + zero-mean noise,
    # so exp(old - behaviour) is exp(d_i) per sequence and spreads around it per token
    d = torch.tensor([-1.5, 0.4, 1.3, -0.2, 0.9, -0.7, 1.6, 0.1], dtype=torch.float64)
    behaviour = []
    with torch.no_grad():
        for i, p in enumerate(prompt_ids):
            packed = pack([(p, completions[i])])
            logp = token_logprobs(policy, packed).double()
            rows = []
            for j, resp in enumerate(completions[i]):
                u = torch.rand(len(resp), generator=gen, dtype=torch.float64)
                offset = d[G * i + j] / len(resp) + 1.6 * (u - u.mean())
                rows.append((logp[packed.sample_N == j] - offset).tolist())
            behaviour.append(rows)

    def rollout(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        taken = {}
        for p in prompts:
            i = next(k for k, e in enumerate(examples) if e.prompt == p)
            j = taken.get(i, 0)
            taken[i] = j + 1
            out["prompt_ids"].append(prompt_ids[i])
            out["completion_ids"].append(completions[i][j])
            out["logprobs"].append(behaviour[i][j])
        return out

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                          gradient_checkpointing=False, **fields)
    theirs = trl.GRPOTrainer(model=str(model_dir), reward_funcs=fixed_reward, args=args, train_dataset=ds,
                             rollout_func=rollout)
    theirs.use_vllm, theirs._last_loaded_step = c["vllm"], theirs.state.global_step
    _move_off_reference(theirs.model)
    theirs.model.train()
    if not hasattr(theirs, "current_gradient_accumulation_steps"):
        theirs.current_gradient_accumulation_steps = 1
    batch = theirs._generate_and_score_completions([ds[i] for i in range(len(ds)) for _ in range(G)])

    reward = trl_reward([fixed_reward], [1.0])
    groups = []
    for i, e in enumerate(examples):
        rewards = reward([e.prompt] * G, ["x"] * G, completion_ids=completions[i])
        adv = grpo.group_advantages(rewards, cfg.algorithm.advantage, eps=cfg.algorithm.advantage_eps).tolist()
        groups.append(Group(prompt_index=i, iteration=0, version=0, prompt_ids=prompt_ids[i],
                            response_ids=completions[i], behaviour_logprobs=behaviour[i], rewards=rewards,
                            advantages=adv))
    ours_adv = torch.tensor([a for g in groups for a in g.advantages])
    torch.testing.assert_close(ours_adv, batch["advantages"].float(), atol=1e-6, rtol=1e-5)
    assert ours_adv[-1] == 0.0  # the sample no function scored

    # each optimizer step: TRL's loss on its share of the batch, ours streamed group by group
    iteration_tokens = sum(len(r) for g in groups for r in g.response_ids)
    per_step = len(groups) // steps
    for s, chunk in enumerate(split_tensor_dict(batch, steps)):
        theirs.model.zero_grad(set_to_none=True)
        their_loss = theirs._compute_loss(theirs.model, chunk)
        their_loss.backward()
        their_grads = {n: p.grad.clone() for n, p in theirs.model.named_parameters()}

        policy.zero_grad(set_to_none=True)
        acc = grpo.LossAccumulator.from_config(cfg.algorithm, max_tokens=max_tokens)
        batcher = batching.MicroBatcher.from_config(cfg.algorithm)
        for g in groups[s * per_step:(s + 1) * per_step]:
            for mb in batcher.add(g):
                tri.micro_step(mb.build(shared=True), acc)
        for mb in batcher.flush():
            tri.micro_step(mb.build(shared=True), acc)
        acc.iteration_tokens = iteration_tokens  # the consumer's, once the batch's last group is in
        acc.finalize_gradients(policy.parameters())
        metrics = acc.metrics()
        assert metrics["loss"] == pytest.approx(their_loss.item(), rel=1e-5, abs=1e-7), f"step {s}"
        for n, p in policy.named_parameters():
            torch.testing.assert_close(p.grad, their_grads[n], atol=1e-6, rtol=1e-4,
                                       msg=lambda m, n=n: f"step {s}, {n}: {m}")
        # what this case claims to exercise
        assert (metrics["kl"] > 1e-3) == (c["beta"] > 0)
        if c["vllm"]:
            assert 0 < metrics["is_ratio_cut"] < 1 and metrics["is_ratio_min"] < 1 < metrics["is_ratio_max"]
        else:
            assert "is_ratio_mean" not in metrics
        if s > 0:
            assert metrics["ratio_abs_dev"] > 1e-4  # old != policy after the first step
        # the same move of both policies between two steps (TRL's gradient, scaled)
        norm = torch.sqrt(sum((g ** 2).sum() for g in their_grads.values()))
        with torch.no_grad():
            for model in (theirs.model, policy):
                for n, p in model.named_parameters():
                    p.sub_(0.5 / norm * their_grads[n])


@pytest.mark.slow  # ~2 min each: vLLM start-up (covered by default: test_trl_script_trains_two_steps_and_saves,
# test_trl_script_with_peft_config_saves_the_adapter)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trl_quickstart_script_on_smollm2(tmp_path, lora):
    """examples/trl_grpo.py, a script in TRL's shape whose one import line names us, trains two
    steps on SmolLM2-135M-Instruct through vLLM; with
    --lora (peft_config=LoraConfig(...)) it saves the adapter, which PeftModel loads on the base and
    which moved from its start (lora_B starts at zero)."""
    model = ROOT / "artifacts" / "smollm2-135m-instruct"
    if not (model / "config.json").is_file():
        pytest.skip("run `python -m periodic_async prepare-model smollm2-135m` first")
    script = (ROOT / "examples" / "trl_grpo.py").read_text()
    assert "from periodic_async import GRPOConfig, GRPOTrainer" in script
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--model", str(model),
                          "--output-dir", str(tmp_path / "run"), "--max-steps", "2", *(["--lora"] if lora else [])],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    final = tmp_path / "run" / "final"
    assert "global_step=2" in out.stdout
    if not lora:
        assert (final / "model.safetensors").is_file()
        return
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), final)
    lora_b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 7 * loaded.config.num_hidden_layers  # all-linear: the seven projections of every layer
    assert max(p.abs().max().item() for p in lora_b) > 0, "two steps must move the adapter"


def test_in_memory_model_and_its_tokenizer_are_written_for_the_engines(tmp_path, model_dir):
    """A PreTrainedModel is saved (with processing_class) to <output_dir>/initial_model, which the
    run then loads; a processing_class that is not the model directory's own tokenizer is refused."""
    from transformers import AutoModelForCausalLM

    from periodic_async.data.tokenizer import load_tokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), load_tokenizer(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=len, args=_args(tmp_path / "run"), train_dataset=_dataset(False),
                          processing_class=tok)
    path = Path(trainer.model_path)
    assert path == tmp_path / "run" / "initial_model" and (path / "config.json").is_file()
    assert load_tokenizer(path).get_vocab() == tok.get_vocab()
    assert trainer.run_config().model.name_or_path == str(path)
    other = load_tokenizer(model_dir)
    other.chat_template = "{{ messages[0]['content'] }}"
    with pytest.raises(ConfigError, match="processing_class"):
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path / "r2"), train_dataset=_dataset(False),
                    processing_class=other)


def test_processing_class_without_a_saved_tokenizer_says_so(tmp_path, model_dir):
    """A model directory without tokenizer_config.json: the refusal says the tokenizer was not
    saved with the model (not that the two differ)."""
    import shutil

    from periodic_async.data.tokenizer import load_tokenizer

    bare = tmp_path / "bare-model"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    with pytest.raises(ConfigError) as e:
        GRPOTrainer(model=str(bare), reward_funcs=len, args=_args(tmp_path / "run"), train_dataset=_dataset(False),
                    processing_class=load_tokenizer(model_dir))
    assert f"the tokenizer was not saved with the model: {bare} has no tokenizer_config.json" in str(e.value)
    assert "differs" not in str(e.value) and "\n" not in str(e.value)


def test_checkpoints_and_evaluation_follow_trl(tmp_path, model_dir):
    """save_total_limit=None keeps every checkpoint (TRL keeps all); eval_strategy='no' with an
    eval_dataset never evaluates (nor needs an accuracy); train() reports the steps and the mean
    loss of the run."""
    from periodic_async import checkpoint

    no_answer = [{"prompt": "What is 2 + 2?"}, {"prompt": "What is 3 + 4?"}]
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **kw: [len(c) for c in completions],
                          args=_args(tmp_path / "run", max_steps=3, save_steps=1), train_dataset=_dataset(False),
                          eval_dataset=no_answer)
    out = trainer.train()
    assert list(checkpoint.complete_checkpoints(tmp_path / "run")) == [1, 2, 3]
    assert not (tmp_path / "run" / "eval.jsonl").exists() or not (tmp_path / "run" / "eval.jsonl").read_text()
    losses = [json.loads(line)["train/loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert out.global_step == 3 and out.training_loss == pytest.approx(sum(losses) / 3)


# --- under torchrun: rank 0 writes, the other ranks wait ------------------------------------------

def _build_and_save(model_dir: str, out: str) -> tuple:
    """What a trainer rank of a TRL script does here: build a GRPOTrainer from an in-memory model
    on the shared output_dir and save the model. Returns every file write and removal this
    process made, the model path, the saved path and is_world_process_zero()."""
    import shutil

    from transformers import AutoModelForCausalLM

    from periodic_async.data.tokenizer import load_tokenizer

    writes = []

    def counted(what, fn):
        def wrapper(*args, **kwargs):
            writes.append(what)
            return fn(*args, **kwargs)
        return wrapper

    rmtree, copy2 = shutil.rmtree, shutil.copy2
    shutil.rmtree, shutil.copy2 = counted("rmtree", rmtree), counted("copy2", copy2)
    try:
        model, tok = AutoModelForCausalLM.from_pretrained(model_dir), load_tokenizer(model_dir)
        model.save_pretrained = counted("model.save_pretrained", model.save_pretrained)
        tok.save_pretrained = counted("tokenizer.save_pretrained", tok.save_pretrained)
        args = GRPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=2, num_generations=2,
                          report_to="none")
        trainer = GRPOTrainer(model=model, reward_funcs=len, args=args, processing_class=tok,
                              train_dataset=[{"prompt": "a"}, {"prompt": "b"}])
        saved = trainer.save_model(Path(out) / "final")
    finally:
        shutil.rmtree, shutil.copy2 = rmtree, copy2
    return writes, trainer.model_path, str(saved), trainer.is_world_process_zero()


def _torchrun_env(rank: int, port: int) -> dict:
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))


def _rank_one(port: int, model_dir: str, out: str, results) -> None:
    """Rank 1, as torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    import os
    import traceback

    os.environ.update(_torchrun_env(1, port))
    torch.set_num_threads(1)
    try:
        results.put((_build_and_save(model_dir, out), None))
    except BaseException:
        results.put((None, traceback.format_exc()))


def test_under_torchrun_rank_zero_alone_writes(tmp_path, model_dir, monkeypatch):
    """Two trainer ranks, real processes (rank 0 this one, rank 1 spawned; this test also plays
    torchrun's agent and runs its rendezvous store), build GRPOTrainer from an in-memory model on
    the same output_dir and call save_model: rank 0 alone writes <output_dir>/initial_model and
    the saved model, rank 1 waits for it and writes nothing (TRL's is_world_process_zero), and
    both return the same paths."""
    import queue
    import shutil
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from periodic_async import checkpoint

    out = tmp_path / "run"
    ckpt = out / "checkpoint-2"  # what a run leaves: a complete checkpoint
    ckpt.mkdir(parents=True)
    for f in model_dir.iterdir():
        shutil.copy(f, ckpt / f.name)
    (ckpt / checkpoint.MARKER).write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)  # torchrun's agent store
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rank1 = ctx.Process(target=_rank_one, args=(port, str(model_dir), str(out), results), daemon=True)
    rank1.start()
    try:
        for k, v in _torchrun_env(0, port).items():
            monkeypatch.setenv(k, v)
        w0, path0, saved0, zero0 = _build_and_save(str(model_dir), str(out))
        while True:
            try:
                got, error = results.get(timeout=5)
                break
            except queue.Empty:
                assert rank1.is_alive(), f"rank 1 died (exit code {rank1.exitcode})"
        assert error is None, f"rank 1 raised:\n{error}"
    finally:
        rank1.kill()
        rank1.join()
        del store
    w1, path1, saved1, zero1 = got
    assert (zero0, zero1) == (True, False)
    assert "model.save_pretrained" in w0 and "tokenizer.save_pretrained" in w0 and "copy2" in w0
    assert w1 == [], f"rank 1 wrote: {w1}"
    assert path0 == path1 == str(out / "initial_model") and saved0 == saved1 == str(out / "final")
    assert set(AutoModelForCausalLM.from_pretrained(out / "initial_model").state_dict()) == \
        set(AutoModelForCausalLM.from_pretrained(out / "final").state_dict())


@pytest.mark.slow  # ~30 s: torchrun, two ranks importing torch and training (the default test covers the writes)
def test_torchrun_trains_a_trl_script_on_two_ranks(tmp_path, model_dir):
    """`torchrun --nproc-per-node=2` of a TRL-shaped script: both ranks train (rank 0 runs the
    engine), read the steps and loss from the run (metrics.jsonl is rank 0's alone) and agree on
    them, and rank 0 alone saves the model."""
    import socket

    script = tmp_path / "script.py"
    script.write_text(f"""
import math, sys
from transformers import AutoModelForCausalLM
from periodic_async import GRPOConfig, GRPOTrainer
from periodic_async.data.tokenizer import load_tokenizer

model_dir = {str(model_dir)!r}
args = GRPOConfig(output_dir={str(tmp_path / "run")!r}, max_steps=2, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=8, learning_rate=1e-3, report_to="none", use_cpu=True,
                  overrides=["engine.backend=local", "logging.progress=false"])
trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), processing_class=load_tokenizer(model_dir),
                      reward_funcs=lambda completions, **kw: [len(c) / 10 for c in completions], args=args,
                      train_dataset=[{{"prompt": f"What is {{i}} + {{i}}?"}} for i in range(8)])
out = trainer.train()
trainer.save_model({str(tmp_path / "final")!r})
assert out.global_step == 2 and math.isfinite(out.training_loss), out
print("RESULT", trainer.is_world_process_zero(), out.global_step, repr(out.training_loss))
""")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port",
                           str(port), str(script)], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = sorted(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert [r[0] for r in results] == ["False", "True"] and results[0][1:] == results[1][1:], results
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_hub_id_in_the_local_cache_trains(tmp_path, model_dir, monkeypatch):
    """GRPOTrainer(model='org/name'), as TRL scripts pass it, with the model in the local Hugging Face
    cache and the hub offline: the run loads the cached snapshot (its tokenizer as processing_class
    too) and trains."""
    import shutil

    import huggingface_hub.constants
    from transformers import AutoTokenizer

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-qwen"
    shutil.copytree(model_dir, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    trainer = GRPOTrainer(model="someone/tiny-qwen", reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=_args(tmp_path / "out", max_steps=1),
                          processing_class=AutoTokenizer.from_pretrained(repo / "snapshots" / rev),
                          train_dataset=_dataset(False))
    assert trainer.run_config().model.name_or_path == str(repo / "snapshots" / rev)
    assert trainer.train().global_step == 1
