"""The rewards of a task source (data/reasoning_tasks.py): the task's own verifier.

    task_reward     score_answer(extract_answer(completion), entry): reasoning-gym's score, its
                    partial credit kept (the default reward of a 'reasoning-gym:NAME' source)
    task_accuracy   1.0 where that score is full credit, else 0.0 (the default accuracy: held-out
                    `eval/accuracy` counts full credit only)

Both have TRL's shape and read the columns a task source gives every example: `task_spec` (the
create_dataset call) and `task_index`. They rebuild the entry from those (data/reasoning_tasks.py:
`entry`, cached) instead of receiving it, so they run in the reward worker like any function not
defined in reward/functions.py, under `reward.timeout_s`.
"""

from __future__ import annotations

from typing import Sequence


def _scores(completions: Sequence, task_spec: Sequence[str], task_index: Sequence[int]) -> list[float]:
    from reasoning_gym.utils import extract_answer

    from periodic_async.data.reasoning_tasks import dataset, entry

    out = []
    for completion, s, i in zip(completions, task_spec, task_index, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]  # TRL's chat completions
        score = dataset(s).score_answer(extract_answer(text), entry(s, i))
        out.append(0.0 if score is None else float(score))
    return out


def task_reward(prompts: Sequence, completions: Sequence, task_spec: Sequence[str], task_index: Sequence[int],
                **kwargs) -> list[float]:
    """The task's own score of each completion's <answer>...</answer> (no tag: the task's score of None)."""
    return _scores(completions, task_spec, task_index)


def task_accuracy(prompts: Sequence, completions: Sequence, task_spec: Sequence[str], task_index: Sequence[int],
                  **kwargs) -> list[float]:
    """1.0 where the task gives full credit, else 0.0."""
    return [1.0 if s >= 1.0 else 0.0 for s in _scores(completions, task_spec, task_index)]
