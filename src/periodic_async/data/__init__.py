"""Data: tasks and loaders, prompts, and the offline tokenizer.

    tasks.py       `Example`; the synthetic task; GSM8K / MATH / AIME loaders; prompts per iteration
                   (and dynamic sampling's extra draws); the dataset columns as reward kwargs
    reasoning_tasks.py  task sources: reasoning-gym's tasks as training and held-out data
    sources.py     `load_examples`: the examples of any data.source (and data.eval_source)
    prompts.py     the prompt template (configured in data.*) and chat encoding; the context-length check,
                   and a run's examples loaded and checked once per process (`load_once`)
    tokenizer.py   the small BPE tokenizer of the tiny presets (a standard HF tokenizer directory)

Dependencies point one way: tasks <- reasoning_tasks <- sources, prompts <- tokenizer.
"""

from periodic_async.data.prompts import (INSTRUCTION, encode_chat, encode_chats, encode_prompts, fit_to_context,
                                        load_once, prompt_messages, reward_prompt)
from periodic_async.data.tasks import (DataError, Example, check_disjoint, extra_prompts, few_shot_examples,
                                       iteration_prompts, make_synthetic, make_synthetic_example, reward_kwargs)
from periodic_async.data.sources import load_examples

__all__ = ["DataError", "Example", "INSTRUCTION", "check_disjoint", "encode_chat", "encode_chats", "encode_prompts",
           "extra_prompts", "few_shot_examples", "fit_to_context", "iteration_prompts", "load_examples", "load_once",
           "make_synthetic", "make_synthetic_example", "prompt_messages", "reward_kwargs", "reward_prompt"]
