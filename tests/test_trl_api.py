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

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """qwen2-1m (random weights, float32) with its tokenizer: a Hugging Face model directory."""
    from periodic_async.config import ModelConfig
    from periodic_async.model import load_policy

    out = tmp_path_factory.mktemp("tiny-model")
    policy, tokenizer = load_policy(ModelConfig(name_or_path="qwen2-1m", tokenizer=str(tokenizer_dir), seed=1))
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


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
                      epsilon=0.1, epsilon_high=0.28, loss_type="dr_grpo", scale_rewards=False, lr_scheduler_type="cosine",
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
    # epochs instead of max_steps: ceil(2 epochs x 10 prompts / 4 prompts per batch)
    assert GRPOConfig(num_train_epochs=2, per_device_train_batch_size=16, num_generations=4).iterations(10) == 5
    assert GRPOConfig(overrides=["engine.num_workers=3"]).run_config(8).engine.num_workers == 3
    # a field with no effect is kept (and printed by the trainer), also through dataclasses.replace
    import dataclasses

    again = dataclasses.replace(GRPOConfig(logging_steps=5, gradient_checkpointing=True), seed=1)
    assert again.no_effect == {"logging_steps": 5, "gradient_checkpointing": True} and again.seed == 1


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


def test_every_trl_field_is_taken_or_refused_in_one_line():
    """Each of TRL 1.16's own GRPOConfig fields, at TRL's default, builds a config (mapped or no
    effect) or is refused in one line; none is taken silently at another value."""
    trl = pytest.importorskip("trl")
    import dataclasses

    from periodic_async import trl_api

    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = [f for f in dataclasses.fields(trl.GRPOConfig) if f.name in vars(trl.GRPOConfig)["__annotations__"]]
    assert len(own) > 60
    taken = refused = 0
    for f in own:
        default = f.default if f.default is not dataclasses.MISSING else None
        try:
            GRPOConfig(**{f.name: default})
            taken += 1
            assert f.name in ours or f.name in trl_api.NO_EFFECT or f.name in trl_api.ONLY_DEFAULT
        except ConfigError as e:
            refused += 1
            assert f.name in str(e) and "\n" not in str(e)
    assert taken > 30 and refused > 0


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


def test_bad_dataset_and_reward_are_one_line(tmp_path, model_dir):
    from datasets import Dataset

    with pytest.raises(DataError, match="row 1: no 'prompt' column"):
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path),
                    train_dataset=Dataset.from_list([{"prompt": "a"}, {"question": "b"}]))
    with pytest.raises(ConfigError, match="accuracy"):  # held-out evaluation needs an accuracy
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path),
                    train_dataset=Dataset.from_list([{"prompt": "a"}]), eval_dataset=Dataset.from_list([{"prompt": "b"}]))
    with pytest.raises(DataError, match="max_prompt_length=3"):  # checked at start-up, never cut
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path, max_prompt_length=3),
                    train_dataset=_dataset(False)).train()
    with pytest.raises(ConfigError, match="peft_config"):
        GRPOTrainer(model=str(model_dir), reward_funcs=len, args=_args(tmp_path), train_dataset=_dataset(False),
                    peft_config={"r": 8})


# --- the same numbers as TRL ---------------------------------------------------------------------

@pytest.mark.parametrize("loss_type, scale_rewards, beta", [("dapo", "group", 0.0), ("dr_grpo", "none", 0.05),
                                                          ("grpo", "group", 0.0)])
def test_advantages_and_loss_match_trl(tmp_path, model_dir, loss_type, scale_rewards, beta, monkeypatch):
    """One batch (2 prompts x 4 fixed completions, fixed rewards with one None) through TRL 1.16's
    GRPOTrainer (its rollout_func hook hands it the completions) and through ours: the same
    advantages, loss and gradient within fp32 tolerance."""
    trl = pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from periodic_async import batching, grpo, trimodel
    from periodic_async.data import encode_prompts
    from periodic_async.data.tokenizer import load_tokenizer
    from periodic_async.group import Group
    from periodic_async.model import load_policy
    from periodic_async.trl_api import to_examples, trl_reward

    G, max_tokens = 4, 8
    ds = _dataset(True, n=2)
    examples = to_examples(ds)
    tok = load_tokenizer(model_dir)
    prompt_ids = encode_prompts(tok, examples)
    assert len({len(p) for p in prompt_ids}) == 1  # equal lengths: TRL left-pads, positions would shift
    gen = torch.Generator().manual_seed(0)
    completions = [[torch.randint(5, len(tok), (n,), generator=gen).tolist() for n in (3, 8, 5, 1)] for _ in prompt_ids]
    completions[0][1][-1] = tok.eos_token_id
    table = {tuple(c): r for cs, rs in zip(completions, [[1.0, 0.0, 0.5, 1.0], [0.2, 0.2, 0.9, None]])
             for c, r in zip(cs, rs)}

    def fixed_reward(completions, completion_ids, **kwargs):
        return [table[tuple(c)] for c in completion_ids]

    def rollout(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        taken = {}
        for p in prompts:
            i = next(k for k, e in enumerate(examples) if e.prompt == p)
            c = completions[i][taken.get(i, 0)]
            taken[i] = taken.get(i, 0) + 1
            out["prompt_ids"].append(prompt_ids[i])
            out["completion_ids"].append(c)
            out["logprobs"].append([0.0] * len(c))
        return out

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                          per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=max_tokens,
                          loss_type=loss_type, scale_rewards=scale_rewards, beta=beta, gradient_checkpointing=False)
    theirs = trl.GRPOTrainer(model=str(model_dir), reward_funcs=fixed_reward, args=args, train_dataset=ds,
                             rollout_func=rollout)
    theirs.model.train()
    if not hasattr(theirs, "current_gradient_accumulation_steps"):
        theirs.current_gradient_accumulation_steps = 1
    batch = theirs._generate_and_score_completions([ds[i] for i in range(len(ds)) for _ in range(G)])
    their_loss = theirs._compute_loss(theirs.model, batch)
    their_loss.backward()
    their_grads = {n: p.grad.clone() for n, p in theirs.model.named_parameters()}

    # ours: the reward adapter, group advantages, and the tri-model's streamed loss
    ours_cfg = GRPOConfig(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=max_tokens,
                          loss_type=loss_type, scale_rewards=scale_rewards, beta=beta, report_to="none", use_cpu=True)
    cfg = ours_cfg.run_config(2, str(model_dir))
    reward = trl_reward([fixed_reward], [1.0])
    groups = []
    for i, e in enumerate(examples):
        rewards = reward([e.prompt] * G, ["x"] * G, completion_ids=completions[i])
        adv = grpo.group_advantages(rewards, cfg.algorithm.advantage, eps=cfg.algorithm.advantage_eps).tolist()
        groups.append(Group(prompt_index=i, iteration=0, version=0, prompt_ids=prompt_ids[i],
                            response_ids=completions[i], behaviour_logprobs=[[0.0] * len(c) for c in completions[i]],
                            rewards=rewards, advantages=adv))
    ours_adv = torch.tensor([a for g in groups for a in g.advantages])
    torch.testing.assert_close(ours_adv, batch["advantages"].float(), atol=1e-6, rtol=1e-5)
    assert ours_adv[-1] == 0.0  # the sample no function scored

    policy, _ = load_policy(cfg.model)
    tri = trimodel.TriModel(policy, cfg.algorithm, logprob_kwargs={"temperature": 1.0})
    acc = grpo.LossAccumulator.from_config(cfg.algorithm, max_tokens=max_tokens)
    batcher = batching.MicroBatcher.from_config(cfg.algorithm)
    for g in groups:
        for mb in batcher.add(g):
            tri.micro_step(mb.build(shared=True), acc)
    for mb in batcher.flush():
        tri.micro_step(mb.build(shared=True), acc)
    acc.finalize_gradients(policy.parameters())
    assert acc.metrics()["loss"] == pytest.approx(their_loss.item(), rel=1e-5, abs=1e-7)
    for n, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, their_grads[n], atol=1e-6, rtol=1e-4, msg=n)


@pytest.mark.slow  # ~2 min: vLLM start-up (covered by default: test_trl_script_trains_two_steps_and_saves)
def test_trl_quickstart_script_on_smollm2(tmp_path):
    """examples/trl_grpo.py, a script in TRL's shape, trains two steps on SmolLM2-135M-Instruct
    with its import line switched to TRL's and back (the same file, one line changed)."""
    model = ROOT / "artifacts" / "smollm2-135m-instruct"
    if not (model / "config.json").is_file():
        pytest.skip("run `python -m periodic_async prepare-model smollm2-135m` first")
    script = (ROOT / "examples" / "trl_grpo.py").read_text()
    assert "from periodic_async import GRPOConfig, GRPOTrainer" in script
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--model", str(model),
                          "--output-dir", str(tmp_path / "run"), "--max-steps", "2"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "global_step=2" in out.stdout and (tmp_path / "run" / "final" / "model.safetensors").is_file()


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
