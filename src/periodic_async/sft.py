"""Supervised warm start: the base policy of the RL experiments.

A randomly initialised preset cannot solve anything, so every RL reward would be zero.
This trains it on worked solutions of the training problems (loss on the response tokens
only, through the same chat template the RL prompts use) for a few CPU minutes, reports
held-out greedy accuracy before and after, and saves a standard Hugging Face model
directory (model + tokenizer) that `model.name_or_path` can point at. With `model.lora.enabled`
only the adapter trains; the directory then holds the base with the adapter merged in, and
the adapter alone in adapter/ (PEFT's format).

With `sft.episodes` it trains on finished multi-turn episodes instead (a JSONL of chat messages
with tool calls, tool answers and feedback: the warm start that teaches a small model a tool's
call format before RL on episodes), rendered as the RL episodes are (episode/formats.py
`encode_conversation`), the model's turns learnt and the environment's turns context only.

    python -m periodic_async sft --config experiments/sft.yaml [section.key=value ...]
    python -m periodic_async sft sft.episodes=tool_episodes.jsonl env.tool_format=plain env.factory=...
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch

from periodic_async.config import SFTRunConfig
from periodic_async.data import encode_chats, few_shot_examples, load_examples, prompt_messages
from periodic_async.evaluate import evaluate
from periodic_async.lora import is_lora
from periodic_async.model import load_policy, num_parameters
from periodic_async.records import save_run_info
from periodic_async.reward import make_accuracy
from periodic_async.trace import MetricsLogger


def tokenize_sft(tokenizer, examples, shots, data=None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids ending in eos) of every example that has a solution; `data`: the
    prompt template (a DataConfig; None: the defaults)."""
    solved = [e for e in examples if e.solution is not None]
    prompts = encode_chats(tokenizer, [prompt_messages(e, shots, data) for e in solved])
    targets = tokenizer([e.solution for e in solved], add_special_tokens=False).input_ids if solved else []
    out = [(p, t + [tokenizer.eos_token_id]) for p, t in zip(prompts, targets)]
    if not out:
        raise ValueError("supervised warm start: no training example has a worked solution")
    return out


def tokenize_episodes(tokenizer, path: str | Path, env) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, the rest, its loss mask) of every episode in the JSONL file `path`
    (`SFTConfig.episodes`), rendered as the RL episodes of the `env` section (an EnvConfig) are."""
    from periodic_async.config import ConfigError
    from periodic_async.episode import ProtocolError, encode_conversation, make_format
    from periodic_async.episode.protocol import load_environments

    envs = load_environments(env)
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(f"sft.episodes: {path}:{n}: not JSON ({e.msg})") from None
    if not rows:
        raise ConfigError(f"sft.episodes: {path} holds no episodes")
    shows_tools = envs.has_tools or any(r.get("tools") for _, r in rows)
    fmt = make_format(tokenizer, env.tool_format, needs_tools=shows_tools)
    out = []
    for n, row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise ConfigError(f"sft.episodes: {path}:{n}: a row needs a 'messages' list (TRL's conversational format)")
        try:
            schemas = row.get("tools") or envs.schemas(envs.name_for(row, f"{path}:{n}"))
            out.append(encode_conversation(fmt, row["messages"], schemas))
        except (ProtocolError, KeyError, TypeError) as e:
            raise ConfigError(f"sft.episodes: {path}:{n}: {e}") from None
    return out


def sft_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int,
             masks: list[list[int]] | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over the target tokens of a right-padded batch. `masks`, one
    per item and as long as its target: 1 where a target token is learnt, 0 where it is context
    only (an environment's turn inside an episode)."""
    device = next(model.parameters()).device
    width = max(len(p) + len(t) for p, t in batch)
    ids_BxL = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels_BxL = torch.full((len(batch), width), -100, dtype=torch.long)
    mask_BxL = torch.zeros((len(batch), width), dtype=torch.long)
    for b, (p, t) in enumerate(batch):
        n = len(p) + len(t)
        ids_BxL[b, :n] = torch.tensor(p + t)
        labels_BxL[b, len(p):n] = torch.tensor(t if masks is None else [x if k else -100 for x, k in zip(t, masks[b])])
        mask_BxL[b, :n] = 1
    logits_BxLxV = model(input_ids=ids_BxL.to(device), attention_mask=mask_BxL.to(device)).logits
    return torch.nn.functional.cross_entropy(
        logits_BxLxV[:, :-1].flatten(0, 1).float(), labels_BxL[:, 1:].flatten().to(device), ignore_index=-100)


def run_sft(cfg: SFTRunConfig) -> dict:
    """Train, evaluate before/after, save the model directory; returns the summary dict."""
    torch.set_num_threads(cfg.sft.threads)
    torch.manual_seed(cfg.model.seed)
    out = Path(cfg.sft.output_dir)
    save_run_info(cfg, out)
    model, tokenizer = load_policy(cfg.model)
    shots = few_shot_examples(cfg.data)
    if cfg.sft.episodes:  # (prompt, rest, mask): the environment's turns are context only
        train = tokenize_episodes(tokenizer, cfg.sft.episodes, cfg.env)
        eval_examples = []
    else:
        train = [(p, t, None) for p, t in tokenize_sft(tokenizer, load_examples(cfg.data, "train"), shots, cfg.data)]
        eval_examples = load_examples(cfg.data, "eval")
    logger = MetricsLogger(out, cfg, mode=cfg.logging.wandb_mode, project=cfg.logging.wandb_project,
                           name=f"sft-{out.name}")
    accuracy_fn = make_accuracy(cfg.reward)

    def held_out() -> dict:
        if not eval_examples:  # episodes: the single-turn accuracy would not say how the episodes go
            return {"accuracy": float("nan"), "n": 0, "samples": []}
        return evaluate(model, tokenizer, eval_examples, shots, data=cfg.data, accuracy_fn=accuracy_fn)

    before = held_out()
    print(f"[sft] {cfg.model.name_or_path}: {num_parameters(model) / 1e6:.2f}M parameters, "
          + (f"{len(train)} training episodes" if cfg.sft.episodes else
             f"{len(train)} training examples, held-out accuracy before {before['accuracy']:.3f}"))

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng = random.Random(cfg.data.seed)
    budget_s = cfg.sft.max_minutes * 60
    t0 = time.time()
    step, order = 0, []
    model.train()
    while step < cfg.sft.max_steps and time.time() - t0 < budget_s:
        if len(order) < cfg.sft.batch_size:
            order += rng.sample(range(len(train)), len(train))
        batch = [train[i] for i in order[: cfg.sft.batch_size]]
        del order[: cfg.sft.batch_size]
        # Warm-up then cosine decay over the step budget: the time cap only stops a run early, so a
        # loaded machine trains the same steps at the same learning rates.
        progress = step / cfg.sft.max_steps
        lr = cfg.sft.lr * min(1.0, (step + 1) / cfg.sft.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr
        masks = None if cfg.sft.episodes == "" else [m for _, _, m in batch]
        loss = sft_loss(model, [(p, t) for p, t, _ in batch], tokenizer.pad_token_id, masks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            logger.log({"sft/loss": loss.item(), "sft/lr": lr, "sft/elapsed_s": time.time() - t0}, step=step)
    train_s = time.time() - t0
    after = held_out()
    if is_lora(model):  # the adapter in PEFT's format, then the merged model the RL runs load
        model.save_pretrained(out / "adapter")
        model = model.merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {"model": cfg.model.name_or_path, "parameters": num_parameters(model), "steps": step,
               "train_seconds": round(train_s, 1), "examples_seen": step * cfg.sft.batch_size,
               "eval_n": after["n"], "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
               "final_loss": loss.item() if step else float("nan"), "output_dir": str(out)}
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    (out / "eval_samples.jsonl").write_text("\n".join(json.dumps(s) for s in after["samples"][:50]) + "\n")
    logger.log({"sft/accuracy_before": before["accuracy"], "sft/accuracy_after": after["accuracy"]}, step=step)
    logger.close()
    accuracy = f"held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} (n={after['n']}); " \
        if eval_examples else ""
    print(f"[sft] {step} steps in {train_s:.0f} s; {accuracy}saved {out}")
    return summary
