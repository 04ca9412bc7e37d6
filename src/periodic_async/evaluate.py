"""Held-out accuracy: greedy decoding of the evaluation prompts, scored by the accuracy function
(`reward.accuracy_function`; default the math correctness reward).

Uses Hugging Face `generate` with left-padded static batches so that it is independent of
our own engines (an evaluation must not share bugs with the code it evaluates). Prompts come
from the configured template (`data.*`, data/prompts.py) through the tokenizer's chat template,
and the accuracy function gets the reward functions' arguments (every dataset column).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from periodic_async.config import DataConfig
from periodic_async.data import Example, encode_prompts, reward_kwargs, reward_prompt
from periodic_async.model import eval_mode
from periodic_async.reward.functions import correctness_reward


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
