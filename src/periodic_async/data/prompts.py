"""Prompts: the chat messages of one example (few-shot prefix, question, instruction), and the
check that every prompt leaves room for its response in the model's context.

`prompt_messages` is the prompt template (what the reward parses: a final '#### N');
`fit_to_context` is checked once at start-up: a prompt that leaves no room for the response
names the example and the numbers (a `DataError`).
"""

from __future__ import annotations

import logging

from periodic_async.data.tasks import DataError, Example
INSTRUCTION = "Solve step by step and give the final answer after ####."

logger = logging.getLogger(__name__)


def prompt_messages(example: Example, shots: list[Example] = ()) -> list[dict[str, str]]:
    """The chat messages of one prompt: optional solved examples, the question, the instruction."""
    parts = [f"{s.question}\n{s.solution}\n" for s in shots]
    parts.append(f"{example.question}\n{INSTRUCTION}")
    return [{"role": "user", "content": "\n".join(parts)}]


def fit_to_context(examples: list[Example], shots: list[Example], tokenizer, max_new_tokens: int,
                   context: int | None, skip: bool = False, what: str = "training") -> list[Example]:
    """The examples whose prompt (chat template and few-shot prefix included) leaves room for
    `max_new_tokens` within the model's `context` (max_position_embeddings; None: no limit).
    An example that does not fit is a `DataError` naming it (index, start of the question) and
    the numbers; with `skip` (data.skip_too_long) such examples are dropped and their count is
    printed once. Tokenizes every prompt: call it once, at start-up."""
    if not context or not examples:
        return list(examples)
    limit = context - max_new_tokens
    lengths = [len(encode_chat(tokenizer, prompt_messages(e, shots))) for e in examples]
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    if not too_long:
        return list(examples)
    i = too_long[0]
    prefix = f"chat template and {len(shots)} few-shot examples" if shots else "chat template"
    first = (f"{what} example {i} ({examples[i].question[:60]!r}): prompt of {lengths[i]} tokens ({prefix}) + "
             f"engine.max_tokens={max_new_tokens} = {lengths[i] + max_new_tokens} > the model's context of "
             f"{context} tokens (max_position_embeddings)")
    if not skip or len(too_long) == len(examples):
        raise DataError(f"{len(too_long)} of {len(examples)} {what} prompts do not fit the model's context; "
                        f"the first: {first}. Shorten them, lower engine.max_tokens or data.few_shot"
                        f"{'' if skip else ', or set data.skip_too_long=true to skip them'}")
    msg = (f"[data] skipped {len(too_long)} of {len(examples)} {what} examples too long for the model's context "
           f"(data.skip_too_long); the first: {first}")
    print(msg)
    logger.info(msg)
    dropped = set(too_long)
    return [e for k, e in enumerate(examples) if k not in dropped]


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` through the chat template, ending with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids
