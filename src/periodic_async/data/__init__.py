"""Data: tasks and loaders, prompts, and the offline tokenizer.

    tasks.py       `Example`; the synthetic task; GSM8K / MATH / AIME loaders; prompts per iteration;
                   the dataset columns as reward kwargs
    prompts.py     the prompt template (configured in data.*) and chat encoding; the context-length check,
                   and a run's examples loaded and checked once per process (`load_once`)
    tokenizer.py   the small BPE tokenizer of the tiny presets (a standard HF tokenizer directory)

Dependencies point one way: tasks <- prompts <- tokenizer.
"""

from periodic_async.data.prompts import (INSTRUCTION, encode_chat, encode_chats, encode_prompts, fit_to_context,
                                        load_once, prompt_messages, reward_prompt)
from periodic_async.data.tasks import (DataError, Example, check_disjoint, few_shot_examples, iteration_prompts,
                                       load_examples, make_synthetic, make_synthetic_example, reward_kwargs)

__all__ = ["DataError", "Example", "INSTRUCTION", "check_disjoint", "encode_chat", "encode_chats", "encode_prompts",
           "few_shot_examples", "fit_to_context", "iteration_prompts", "load_examples", "load_once", "make_synthetic",
           "make_synthetic_example", "prompt_messages", "reward_kwargs", "reward_prompt"]
