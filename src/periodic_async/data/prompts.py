"""Prompts: the chat messages of one example, built from the configured template (system prompt,
few-shot examples, the problem's user turn), and the check that every prompt leaves room for
its response in the model's context.

An example given with its prompt whole (`Example.prompt`, TRL's dataset formats) bypasses the
template: a text prompt is tokenized as it is, a conversational one goes through the chat
template as it is (`encode_prompts`, what TRL's GRPOTrainer does with the same rows).

`prompt_messages` is the prompt template, all of it configuration (`data.system_prompt`,
`data.instruction`, `data.question_template`, `data.few_shot_format`, `data.shot_template`; see
config.py): the defaults reproduce the single hard-coded instruction this project started with,
token for token. The messages go through the tokenizer's own chat template (`encode_chat`), as
TRL and vLLM apply it. `fit_to_context` is checked once at start-up: a prompt that leaves no
room for the response names the example and the numbers (a `DataError`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

from periodic_async.config import DataConfig
from periodic_async.data.tasks import DataError, Example

INSTRUCTION = DataConfig.instruction
"""The default `data.instruction`."""
_DEFAULT = DataConfig()

logger = logging.getLogger(__name__)


def _fill(template: str, field: str, example: Example, **fields: str) -> str:
    """`template` with the example's dataset columns and `fields` (which win) filled in; a
    placeholder the example lacks is a `DataError` naming the field, the example and what it has."""
    values = {**example.columns, "question": example.question, **fields}
    try:
        return template.format(**{k: "" if v is None else v for k, v in values.items()})
    except KeyError as e:
        raise DataError(f"data.{field}={template!r}: example {example.id or '?'} ({example.question[:40]!r}) has no "
                        f"column {e.args[0]!r}; it has {sorted(values)}") from None


def prompt_messages(example: Example, shots: Sequence[Example] = (),
                    data: DataConfig | None = None) -> list[dict[str, str]]:
    """The chat messages of one prompt: [system], the solved examples (inline in the user turn, or
    as user/assistant turns), the problem's user turn (`data.question_template`). `data`: the
    run's DataConfig (None: the defaults). An example with conversational `prompt` messages: those."""
    if isinstance(example.prompt, list):
        return list(example.prompt)
    if isinstance(example.prompt, str):
        raise DataError(f"example {example.id or '?'}: a text prompt has no chat messages (it is tokenized as it is)")
    d = _DEFAULT if data is None else data
    ask = lambda e: _fill(d.question_template, "question_template", e, instruction=d.instruction)  # noqa: E731
    system = d.system_prompt or _task_system_prompt(d.source)
    messages = [{"role": "system", "content": system}] if system else []
    if d.few_shot_format == "turns":
        for s in shots:
            if s.solution is None:
                raise DataError(f"data.few_shot_format='turns': few-shot example {s.id or '?'} has no solution")
            messages += [{"role": "user", "content": ask(s)}, {"role": "assistant", "content": s.solution}]
        parts = []
    else:
        parts = [_fill(d.shot_template, "shot_template", s, solution=s.solution or "", answer=s.answer,
                       instruction=d.instruction) for s in shots]
    parts.append(ask(example))
    return messages + [{"role": "user", "content": "\n".join(parts)}]


def _task_system_prompt(source: str) -> str:
    """reasoning-gym's default system prompt for a task source (data/reasoning_tasks.py), else ''."""
    from periodic_async.data.reasoning_tasks import system_prompt, task_name

    return system_prompt() if task_name(source) is not None else ""


def fit_to_context(examples: list[Example], shots: list[Example], tokenizer, max_new_tokens: int,
                   context: int | None, skip: bool = False, what: str = "training",
                   data: DataConfig | None = None) -> list[Example]:
    """The examples whose prompt (chat template and few-shot prefix included) leaves room for
    `max_new_tokens` within the model's `context` (max_position_embeddings; None: no limit).
    An example that does not fit is a `DataError` naming it (index, start of the question) and
    the numbers; with `skip` (data.skip_too_long) such examples are dropped and their count is
    printed once. `data`: the prompt template (None: the defaults). Tokenizes every prompt: call
    it once, at start-up."""
    if not context or not examples:
        return list(examples)
    limit = context - max_new_tokens
    lengths = [len(ids) for ids in encode_prompts(tokenizer, examples, shots, data)]
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


_LOADED: dict[tuple, tuple[list, ...]] = {}  # the last few data sets of this process


def load_once(data: DataConfig, tokenizer, load: Callable[[], tuple[list, ...]], *depends) -> tuple[list, ...]:
    """`load()` (lists of examples, e.g. loaded and checked by `fit_to_context`), once per process
    for the same inputs: a process that runs several times on the same data (a benchmark's systems,
    resumed legs) loads and checks it once. The key is everything the result depends on: the data
    settings, the source file's size and time, the tokenizer and its chat template, and `depends`
    (the response budget and the model's context, say). The last 4 are kept; each call returns
    fresh lists."""
    source = Path(data.source)
    st = source.stat() if source.exists() else None
    key = (repr(data), (st.st_mtime_ns, st.st_size) if st else None, *depends, type(tokenizer).__name__,
           getattr(tokenizer, "name_or_path", ""), len(tokenizer), getattr(tokenizer, "chat_template", None))
    if key not in _LOADED:
        loaded = load()
        while len(_LOADED) >= 4:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = loaded
    return tuple(list(x) for x in _LOADED[key])


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` through the chat template, ending with the generation prompt."""
    return encode_chats(tokenizer, [messages])[0]


def encode_chats(tokenizer, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """`encode_chat` of each conversation, tokenized in one tokenizer call (not one per prompt:
    the start-up check and SFT encode every training prompt)."""
    if not conversations:
        return []
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
    return tokenizer(texts, add_special_tokens=False).input_ids


def reward_prompt(example: Example, shots: Sequence[Example] = (), data: DataConfig | None = None):
    """The `prompts` entry reward functions get for `example`: its `prompt` when given whole (a text,
    or chat messages, as TRL passes them), else the problem's user turn of the template."""
    if example.prompt is not None:
        return example.prompt
    return prompt_messages(example, shots, data)[-1]["content"]


def encode_prompts(tokenizer, examples: Sequence[Example], shots: Sequence[Example] = (),
                   data: DataConfig | None = None) -> list[list[int]]:
    """The prompt token ids of each example: a text `prompt` tokenized as it is (`tokenizer(text)`,
    as TRL does), messages (given, or built from the template) through the chat template."""
    chats = [(i, prompt_messages(e, shots, data)) for i, e in enumerate(examples) if not isinstance(e.prompt, str)]
    texts = [(i, e.prompt) for i, e in enumerate(examples) if isinstance(e.prompt, str)]
    out: list[list[int]] = [[] for _ in examples]
    for (i, _), ids in zip(chats, encode_chats(tokenizer, [m for _, m in chats])):
        out[i] = ids
    if texts:
        for (i, _), ids in zip(texts, tokenizer([t for _, t in texts]).input_ids):
            out[i] = list(ids)
    return out
