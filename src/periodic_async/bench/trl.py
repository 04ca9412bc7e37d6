"""The peer baseline of the paper's Table 2: TRL's GRPOTrainer on our model, prompts and reward.

    rows, prompt_len = trl_dataset(cfg, tokenizer)
    result = run_trl(cfg, trl, export_model(cfg, out / "model"), out)   # {"tokens_per_s", ...}

What TRL shares with our runs of the same `RunConfig`: model, tokenizer, prompts (our
iterations' prompts in order, unshuffled: TRL's step t trains on our iteration t's B prompts),
reward functions, B prompts per step, G samples each, max new tokens, temperature / top-p /
top-k, lr, weight decay, beta, clip range, advantage scaling, one optimizer step per
generation batch (steps_per_generation = gradient accumulation, num_iterations = 1). What it
does its own way: one static `generate` of the whole batch in its own process, one row per
response, and the settings in `trl` (the experiment's plan):

    threads              torch threads of the TRL process (its devices, on CPU)
    loss_type            TRL's loss ("dapo": token-mean over the whole batch, as ours)
    micro_batch_tokens   TRL's micro-batch: the largest divisor of B*G whose padded rows fit it

Trained tokens = sum over samples of (P + R_i), as in our runs. TRL's come from its own log
(`num_tokens`, cumulative); the reward wrapper recounts every batch from the prompt and
completion ids it sees, and `run_trl` raises if the two disagree. tokens/s leaves out the first
optimizer step (start-up), as our runs leave out their first iteration.
"""

from __future__ import annotations

import time
from pathlib import Path

from periodic_async.bench.protocol import settings_dict
from periodic_async.config import RunConfig
from periodic_async.data import few_shot_examples, iteration_prompts, load_examples, prompt_messages
from periodic_async.data.prompts import encode_chat
from periodic_async.reward import combined_reward, load_reward_fn


def export_model(cfg: RunConfig, out: Path) -> Path:
    """Model + tokenizer in one directory: TRL loads both by path (an in-memory model fails).
    Written afresh by every call, so a rebuilt warm start is never read stale."""
    from periodic_async.model import load_policy

    policy, tokenizer = load_policy(cfg.model)
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def trl_dataset(cfg: RunConfig, tokenizer) -> tuple[list[dict], dict[str, int]]:
    """Our iterations' prompts in order (TRL's step t = our iteration t) as TRL rows {prompt:
    chat messages, answer}, and each prompt's token count (keyed by its last message, the problem's user turn)."""
    examples, shots = load_examples(cfg.data, "train"), few_shot_examples(cfg.data)
    rows, prompt_len = [], {}
    for it in range(cfg.trainer.iterations):
        for _, ex in iteration_prompts(examples, it, cfg.algorithm.prompts_per_iteration, cfg.data.seed):
            msgs = prompt_messages(ex, shots, cfg.data)
            prompt_len[msgs[-1]["content"]] = len(encode_chat(tokenizer, msgs))  # the problem's turn: unique
            rows.append({"prompt": msgs, "answer": ex.answer})
    return rows, prompt_len


def trl_micro_batch(cfg: RunConfig, trl: dict, prompt_len: dict[str, int]) -> int:
    """TRL's per_device_train_batch_size: the largest divisor of B*G whose rows, padded to the
    longest prompt + max new tokens (TRL pads to the batch's longest), fit trl['micro_batch_tokens']."""
    n = cfg.algorithm.prompts_per_iteration * cfg.algorithm.group_size
    padded = max(prompt_len.values()) + cfg.engine.max_tokens
    return max(d for d in range(1, n + 1) if n % d == 0 and (d == 1 or d * padded <= trl["micro_batch_tokens"]))


def trl_settings(cfg: RunConfig, trl: dict, tokenizer) -> dict:
    """The settings a benchmark row records for TRL: what it shares with `cfg`, what it does
    instead (its own `generate` of the whole batch, per-response rows) and its own settings."""
    settings = settings_dict(cfg)
    n = cfg.algorithm.prompts_per_iteration * cfg.algorithm.group_size
    settings["engine"].update(backend="transformers.generate", num_workers=1, threads_per_worker=trl["threads"],
                              max_num_seqs=n)
    settings["algorithm"].pop("micro_batch_tokens")  # TRL's own is trl.per_device_train_batch_size
    settings["algorithm"]["shared_prompt"] = False
    settings["pipeline"] = {"mode": "trl-grpo"}
    settings["trainer"].update(threads=trl["threads"], threads_after_generation=0)
    _, prompt_len = trl_dataset(cfg, tokenizer)
    settings["trl"] = {**trl, "per_device_train_batch_size": trl_micro_batch(cfg, trl, prompt_len)}
    return settings


def run_trl(cfg: RunConfig, trl: dict, model_dir: Path, out_dir: Path) -> dict:
    """One TRL GRPOTrainer run of `cfg.trainer.iterations` optimizer steps on CPU. Returns
    tokens_per_s (from TRL's logged `num_tokens` over steps 2..N), devices (its threads),
    micro_batch, mean_iteration_s and token_check: (TRL's count, our recount) per step."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    a, B, G = cfg.algorithm, cfg.algorithm.prompts_per_iteration, cfg.algorithm.group_size
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows, prompt_len = trl_dataset(cfg, tokenizer)  # counted before the clock starts
    mb = trl_micro_batch(cfg, trl, prompt_len)
    reward_fn = combined_reward([load_reward_fn(f) for f in cfg.reward.functions], cfg.reward.weights)
    recount: list[int] = []  # ours: sum of P + R_i of each generation batch TRL scored

    def reward(prompts, completions, completion_ids, answer, **kwargs):
        recount.append(sum(prompt_len[p[-1]["content"]] + len(c) for p, c in zip(prompts, completion_ids)))
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return reward_fn(prompts, texts, answer=answer)

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_end, self.logged = [], []

        def on_step_end(self, args, state, control, **kw):
            self.step_end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "num_tokens" in logs:
                self.logged.append(int(logs["num_tokens"]))

    steps = B * G // mb
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, use_vllm=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=cfg.model.seed, data_seed=cfg.data.seed,
        max_steps=cfg.trainer.iterations, shuffle_dataset=False, dataloader_num_workers=0,
        num_generations=G, per_device_train_batch_size=mb, gradient_accumulation_steps=steps,
        steps_per_generation=steps, num_iterations=1, max_completion_length=cfg.engine.max_tokens,
        temperature=cfg.engine.temperature, top_p=cfg.engine.top_p, top_k=cfg.engine.top_k,
        learning_rate=a.lr, lr_scheduler_type="constant", weight_decay=a.weight_decay, beta=a.beta,
        epsilon=a.eps_low, epsilon_high=a.eps_high, loss_type=trl["loss_type"],
        scale_rewards="group" if a.advantage == "std" else "none", max_grad_norm=a.max_grad_norm,
        gradient_checkpointing=False,  # TRL's default recomputes activations: memory is no issue here
        model_init_kwargs={"dtype": cfg.model.dtype, "attn_implementation": cfg.model.attn_implementation})
    clock = Clock()
    torch.set_num_threads(trl["threads"])
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    logged, t = clock.logged, clock.step_end
    if len(logged) != cfg.trainer.iterations or len(t) != cfg.trainer.iterations:
        raise RuntimeError(f"TRL logged {len(logged)} num_tokens and {len(t)} steps, expected {cfg.trainer.iterations}")
    per_step = [logged[0]] + [y - x for x, y in zip(logged, logged[1:])]
    if per_step != recount:
        raise AssertionError(f"TRL num_tokens per step {per_step} != our recount of the same batches {recount}")
    seconds = t[-1] - t[0]  # steps 2..N: the first step (start-up) is excluded, as in our runs
    return {"tokens_per_s": sum(per_step[1:]) / seconds, "devices": trl["threads"], "micro_batch": mb,
            "mean_iteration_s": seconds / (len(t) - 1), "token_check": list(zip(per_step, recount))}
