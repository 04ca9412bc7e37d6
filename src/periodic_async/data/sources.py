"""Which examples a `DataConfig` names: `load_examples`, over every kind of data.source.

    reasoning-gym:NAME                 data/reasoning_tasks.py (the task's entries)
    synthetic, a file, a HF dataset    data/tasks.py
    data.eval_source                   the held-out set from elsewhere: a task source's held-out
                                       entries or a file's first data.num_eval records, checked
                                       disjoint from the training (and few-shot) questions
"""

from __future__ import annotations

from periodic_async.config import DataConfig
from periodic_async.data import tasks
from periodic_async.data.reasoning_tasks import task_examples, task_name
from periodic_async.data.tasks import Example


def load_examples(cfg: DataConfig, split: str = "train") -> list[Example]:
    """The examples of `split` ('train' or 'eval') of `cfg`; held-out never overlaps training
    (see data/tasks.py and data/reasoning_tasks.py for how each source guarantees it)."""
    if split == "eval" and cfg.num_eval and cfg.eval_source:
        evals = task_examples(cfg, "eval", source=cfg.eval_source) if task_name(cfg.eval_source) is not None \
            else tasks.eval_file_examples(cfg)
        tasks.check_disjoint(load_examples(cfg, "train") + tasks.few_shot_examples(cfg), evals, cfg.eval_source)
        return evals
    if task_name(cfg.source) is not None and split in ("train", "eval"):
        return task_examples(cfg, split) if split == "train" or cfg.num_eval else []
    return tasks.load_examples(cfg, split)
