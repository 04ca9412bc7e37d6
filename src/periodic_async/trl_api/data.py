"""TRL's data and rewards on this pipeline: a prompt-only dataset as `Example`s, reward functions
called as TRL calls them (the package docstring says how)."""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any, Callable, Sequence

from periodic_async.data import DataError, Example


def _rows(dataset, what: str) -> list[dict]:
    """The rows of a `datasets.Dataset` (or a list of dicts) as plain dicts."""
    if dataset is None:
        return []
    if hasattr(dataset, "to_list"):
        return dataset.to_list()
    if isinstance(dataset, (list, tuple)):
        return [dict(r) for r in dataset]
    raise DataError(f"GRPOTrainer({what}=...): expected a datasets.Dataset or a list of dicts, got "
                    f"{type(dataset).__name__} (an IterableDataset is not supported: "
                    "the prompts are reshuffled per epoch)")


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
    functions called as TRL 1.16 calls them (trl_api's docstring). A function that raises or
    returns the wrong count, a non-number or a non-finite number stops the run with a RewardError
    naming it; None is "not applicable"."""
    from periodic_async.reward import RewardError

    logs = logs or _Logs()
    names = [getattr(f, "__name__", type(f).__name__) for f in funcs]

    def reward(prompts: Sequence, completions: Sequence[str], **kwargs) -> list[float]:
        conversational = _is_messages(prompts[0]) if prompts else False
        messages = kwargs.pop("completion_messages", None)  # episodes: every turn, as TRL passes them
        comps = ([list(m) for m in messages] if messages is not None else
                 [[{"role": "assistant", "content": c}] for c in completions]) if conversational else list(completions)
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

