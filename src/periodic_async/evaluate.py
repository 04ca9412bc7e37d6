"""Held-out accuracy: greedy decoding of the evaluation prompts, scored by the accuracy function
(`reward.accuracy_function`; default the math correctness reward; a task source's: full credit
of the task's own verifier), with its standard error, overall and per task.

    python -m periodic_async eval --config runs/x/config.yaml eval.checkpoint=runs/x eval.max_tokens=256

Uses Hugging Face `generate` with left-padded static batches so that it is independent of
our own engines (an evaluation must not share bugs with the code it evaluates). Prompts come
from the configured template (`data.*`, data/prompts.py) through the tokenizer's chat template,
and the accuracy function gets the reward functions' arguments (every dataset column).
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import torch

from periodic_async.config import DataConfig, EvalRunConfig
from periodic_async.data import Example, encode_prompts, reward_kwargs, reward_prompt
from periodic_async.model import eval_mode
from periodic_async.reward.functions import correctness_reward


def accuracy_stats(scores: Sequence[float]) -> dict:
    """{'accuracy': the mean score, 'n', 'stderr': sqrt(var / n)} (sqrt(p (1 - p) / n) for 0/1 scores)."""
    n = len(scores)
    if not n:
        return {"accuracy": float("nan"), "n": 0, "stderr": float("nan")}
    acc = sum(scores) / n
    return {"accuracy": acc, "n": n, "stderr": (sum((c - acc) ** 2 for c in scores) / n / n) ** 0.5}


def per_task(scores: Sequence[float], examples: Sequence[Example]) -> dict[str, dict]:
    """`accuracy_stats` of each task (an example's `source_dataset` column); {} when none has one."""
    by_task: dict[str, list[float]] = {}
    for c, e in zip(scores, examples, strict=True):
        if e.columns.get("source_dataset") is not None:
            by_task.setdefault(e.columns["source_dataset"], []).append(c)
    return {name: accuracy_stats(c) for name, c in sorted(by_task.items())}


@torch.no_grad()
def evaluate(model, tokenizer, examples: Sequence[Example], shots: Sequence[Example] = (),
             max_tokens: int = 64, batch_size: int = 64, data: DataConfig | None = None,
             accuracy_fn: Callable[..., list[float]] | None = None) -> dict:
    """Greedy accuracy on `examples`: {'accuracy', 'n', 'mean_response_tokens', 'samples'}.
    data: the prompt template (None: the defaults); accuracy_fn: TRL-shaped, one score in [0, 1]
    per completion (None: `correctness_reward`; a run passes `reward.make_accuracy(cfg.reward)`)."""
    if not examples:
        return {"accuracy": float("nan"), "n": 0, "mean_response_tokens": 0.0, "samples": []}
    with eval_mode(model):
        device = next(model.parameters()).device
        pad = tokenizer.pad_token_id
        prompt_ids = encode_prompts(tokenizer, examples, list(shots), data)
        texts, lengths = [], []
        for i in range(0, len(examples), batch_size):
            prompts = prompt_ids[i: i + batch_size]
            width = max(len(p) for p in prompts)
            ids_BxL = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
            mask_BxL = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            out_BxL = model.generate(input_ids=ids_BxL, attention_mask=mask_BxL, max_new_tokens=max_tokens,
                                     do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
            for row in out_BxL[:, width:].tolist():
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id) + 1]
                lengths.append(len(row))
                texts.append(tokenizer.decode(row, skip_special_tokens=True))
    score = correctness_reward if accuracy_fn is None else accuracy_fn
    rewards = score([reward_prompt(e, list(shots), data) for e in examples], texts, **reward_kwargs(list(examples)))
    samples = [{"question": e.question, "answer": e.answer, "completion": t, "correct": r}
               for e, t, r in zip(examples, texts, rewards)]
    return {"accuracy": sum(rewards) / len(rewards), "n": len(rewards),
            "mean_response_tokens": sum(lengths) / len(lengths), "samples": samples}


def run_eval(cfg: EvalRunConfig) -> dict:
    """The `eval` command: greedy accuracy of `eval.checkpoint` (a run, a checkpoint or a model
    directory; default model.name_or_path) on the held-out examples of `cfg.data` (data.eval_source
    if set), at most eval.max_tokens each (0: engine.max_tokens). Returns, and writes to eval.output
    as CSV, the accuracy with its standard error, overall ('all') and per task."""
    from periodic_async.data import few_shot_examples, load_examples
    from periodic_async.model import load_policy
    from periodic_async.reward import make_accuracy

    path = cfg.model.name_or_path
    if cfg.eval.checkpoint:
        p = Path(cfg.eval.checkpoint)
        if not p.is_dir():
            raise FileNotFoundError(f"eval.checkpoint={cfg.eval.checkpoint!r}: no such directory")
        path = str(p / "checkpoint" if (p / "checkpoint").is_dir() else p)  # a run: its newest checkpoint
    model, tokenizer = load_policy(dataclasses.replace(cfg.model, name_or_path=path,
                                                       lora=dataclasses.replace(cfg.model.lora, enabled=False)))
    examples, shots = load_examples(cfg.data, "eval"), few_shot_examples(cfg.data)
    max_tokens = cfg.eval.max_tokens or cfg.engine.max_tokens
    accuracy_fn = make_accuracy(cfg.reward)
    try:
        r = evaluate(model, tokenizer, examples, shots, max_tokens=max_tokens, batch_size=cfg.eval.batch_size,
                     data=cfg.data, accuracy_fn=accuracy_fn)
    finally:
        accuracy_fn.close()
    scores = [s["correct"] for s in r["samples"]]
    summary = {"model": path, "max_tokens": max_tokens, **accuracy_stats(scores),
               "mean_response_tokens": r["mean_response_tokens"], "tasks": per_task(scores, examples)}
    if cfg.eval.output:
        out = Path(cfg.eval.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["task", "accuracy", "n", "stderr", "model", "max_tokens"])
            for name, t in [("all", summary), *summary["tasks"].items()]:
                w.writerow([name, t["accuracy"], t["n"], t["stderr"], path, max_tokens])
    return summary
