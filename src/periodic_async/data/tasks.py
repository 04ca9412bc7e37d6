"""Datasets of math problems with exact answers: GSM8K / MATH (DeepScaleR) / AIME loaders and a
built-in synthetic task sized for a tiny model on a CPU.

Every source becomes a list of `Example(question, answer, solution)` that also keeps the
record's columns; prompts.py turns one into the chat messages the engines see, and
`reward_kwargs` hands every column to the reward functions (TRL's convention).
The synthetic task is GSM8K-like arithmetic word problems, generated deterministically
from a seed, with a difficulty knob (steps, operand size) and an optional few-shot prefix
that gives the long prompts of the paper's shared-prompt setting.

Bad input fails clearly, as a `DataError`: a malformed line, a missing or mistyped field
names the file and its 1-based line (JSONL) or row (JSON list, parquet, dataset split); an
empty source names the source.
Data files are only parsed (JSON, parquet, `datasets`), never executed.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from periodic_async.config import DataConfig, UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One problem: `answer` is the ground truth the reward compares to; `solution` (optional)
    is a worked solution ending in '#### answer', the target of supervised warm start;
    `columns` is the record it came from, every column (the synthetic task's: question, answer,
    solution, id), for the prompt template's placeholders and the reward functions' kwargs.
    `prompt` is a prompt given whole (TRL's dataset formats): a text, tokenized as it is (no chat
    template), or chat messages, through the chat template as they are; None (our datasets): the
    prompt is built from the configured template (data/prompts.py)."""

    question: str
    answer: str
    solution: str | None = None
    id: str = ""
    columns: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    prompt: str | list[dict[str, Any]] | None = field(default=None, compare=False, repr=False)


RESERVED_COLUMNS = frozenset({"prompt", "prompts", "completion", "completions", "completion_ids"})
"""Columns not passed to reward functions: the positional arguments' names and TRL's own keys."""


def reward_kwargs(examples: Sequence[Example]) -> dict[str, list]:
    """The keyword arguments of a reward call for completions of `examples` (one example per
    completion): TRL's convention, every dataset column as a list with one value per completion
    (None where a record lacks it), except `RESERVED_COLUMNS`. `answer` is always there and is
    the parsed ground truth (GSM8K's answer column, a worked solution, becomes its final number),
    except for examples given with their prompt whole (TRL's datasets): their columns go as they are."""
    names = dict.fromkeys(k for e in examples for k in e.columns if k not in RESERVED_COLUMNS)
    kwargs = {k: [e.columns.get(k) for e in examples] for k in names}
    if any(e.prompt is None for e in examples):
        kwargs["answer"] = [e.answer for e in examples]
    return kwargs


# --- synthetic arithmetic word problems --------------------------------------------------

_NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena",
          "Milo", "Nora", "Omar", "Pia", "Quin", "Rosa", "Sam", "Tara"]
_ITEMS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cookies", "stickers"]
_ADD = ["buys {n} more {item}", "finds {n} more {item}", "gets {n} more {item}"]
_SUB = ["gives away {n} {item}", "loses {n} {item}", "sells {n} {item}"]
_MUL = ["doubles the {item}", "triples the {item}"]


def make_synthetic_example(rng: random.Random, cfg: DataConfig, idx: int = 0) -> Example:
    """One word problem with `min_steps..max_steps` operations on numbers in 1..max_operand."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    value = rng.randint(1, cfg.max_operand)
    sentences = [f"{name} has {value} {item}."]
    lines = []
    for _ in range(rng.randint(cfg.min_steps, cfg.max_steps)):
        op = rng.choice(["add", "sub", "mul"] if value <= 2 * cfg.max_operand else ["add", "sub"])
        if op == "sub" and value < 2:
            op = "add"
        if op == "add":
            n = rng.randint(1, cfg.max_operand)
            sentences.append(f"Then {name} " + rng.choice(_ADD).format(n=n, item=item) + ".")
            lines.append(f"{value}+{n}={value + n}")
            value += n
        elif op == "sub":
            n = rng.randint(1, min(cfg.max_operand, value - 1))
            sentences.append(f"Then {name} " + rng.choice(_SUB).format(n=n, item=item) + ".")
            lines.append(f"{value}-{n}={value - n}")
            value -= n
        else:
            k = rng.choice([2, 3])
            sentences.append(f"Then {name} " + _MUL[k - 2].format(item=item) + ".")
            lines.append(f"{value}*{k}={value * k}")
            value *= k
    sentences.append(f"How many {item} does {name} have?")
    solution = "\n".join(lines) + f"\n#### {value}"
    return _synthetic(" ".join(sentences), str(value), solution, f"syn-{idx}")


def _synthetic(question: str, answer: str, solution: str, id: str) -> Example:
    """A synthetic problem, its columns those of a GSM8K-like record."""
    return Example(question, answer, solution, id,
                   columns={"question": question, "answer": answer, "solution": solution, "id": id})


def make_synthetic(n: int, cfg: DataConfig, seed: int) -> list[Example]:
    """`n` problems, a pure function of (`n`, difficulty, `seed`)."""
    rng = random.Random(seed)
    return [make_synthetic_example(rng, cfg, i) for i in range(n)]


# --- real datasets ------------------------------------------------------------------------

class DataError(UserError, ValueError):
    """A data source is unusable; the message names the file and the 1-based line (JSONL) or
    row (JSON list, parquet, dataset split), or the source when it is empty."""


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j].strip()
    return None


def _gsm8k_final(answer: str) -> str:
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####': {answer[:80]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


def _text(rec: dict, *keys: str, required: bool = True, numbers: bool = False) -> str | None:
    """The first of `keys` present in `rec`, as text; a missing required field or a value of the
    wrong type (not a string, or a number where `numbers`) is a ValueError naming the field."""
    for k in keys:
        if k in rec and rec[k] is not None:
            v = rec[k]
            if isinstance(v, str) or (numbers and isinstance(v, (int, float)) and not isinstance(v, bool)):
                return str(v)
            raise ValueError(f"field {k!r} is {type(v).__name__} {v!r:.60}: expected "
                             f"{'a string or a number' if numbers else 'a string'}")
    if required:
        raise ValueError(f"missing field {'/'.join(repr(k) for k in keys)}")
    return None


def _record_to_example(rec: dict, fmt: str, where: str, i: int) -> Example:
    """One record as an Example; errors are `DataError`s prefixed with `where` (file and line/row)."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected an object with question/answer fields, got {type(rec).__name__} "
                        f"{rec!r:.60}")
    keys = set(rec)
    if fmt == "auto":
        if {"question", "answer"} <= keys and "####" in str(rec["answer"]):
            fmt = "gsm8k"
        elif {"problem", "answer"} <= keys or {"Problem", "Answer"} <= keys:
            fmt = "aime"
        elif {"problem", "solution"} <= keys:
            fmt = "math"
        else:
            raise DataError(f"{where}: cannot tell the format from keys {sorted(keys)}; "
                            "set data.format to gsm8k, math or aime")
    try:
        if fmt == "gsm8k":
            question = _text(rec, "question")
            sol = re.sub(r"<<[^>]*>>", "", _text(rec, "answer"))
            return Example(question, _gsm8k_final(sol), sol.strip(), str(rec.get("id", i)), columns=dict(rec))
        if fmt in ("math", "aime"):
            q = _text(rec, "problem", "Problem")
            sol = _text(rec, "solution", "Solution", required=False)
            ans = _text(rec, "answer", "Answer", required=False, numbers=True)
            if ans is None and sol is not None:
                ans = last_boxed(sol)
                if ans is None:
                    raise ValueError("no 'answer' field and no \\boxed{} in the solution")
            if ans is None:
                raise ValueError("missing field 'answer'/'Answer' (or a solution with \\boxed{})")
            return Example(q, ans.strip(), sol, str(rec.get("id", i)), columns=dict(rec))
    except ValueError as e:
        raise DataError(f"{where} (format {fmt}): {e}") from None
    raise DataError(f"unknown format {fmt!r}")


def _utf8(raw: bytes, source: str, line: int | None = None) -> str:
    """`raw` decoded as UTF-8; else a DataError naming the file, the line (`line`, or counted in
    `raw`) and the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        ln = line if line is not None else raw[:e.start].count(b"\n") + 1
        raise DataError(f"{source}:{ln}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r}: {e.reason}); "
                        "save the file as UTF-8") from None


def _read_records(source: str, split: str) -> list[tuple[str, object]]:
    """The records of `source`, each with where it came from: 'file:LINE' (JSONL, 1-based),
    'file row N' (JSON list, parquet) or "source[split] row N" (a datasets split)."""
    p = Path(source)
    if p.suffix in (".jsonl", ".json", ".parquet") and not p.is_file():
        raise FileNotFoundError(f"data.source {source!r} does not exist")
    if p.suffix == ".jsonl":
        out = []
        with p.open("rb") as f:
            for ln, raw in enumerate(f, 1):
                line = _utf8(raw, source, ln)
                if line.strip():
                    try:
                        out.append((f"{source}:{ln}", json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{source}:{ln}: invalid JSON ({e})") from None
        return out
    if p.suffix == ".json":
        raw = p.read_bytes()
        try:
            data = json.loads(_utf8(raw, source))
        except json.JSONDecodeError as e:
            raise DataError(f"{source}:{e.lineno}: invalid JSON ({e})") from None
        if not isinstance(data, list):
            raise DataError(f"{source}: expected a JSON list of records, got {type(data).__name__}")
        return [(f"{source} row {i}", r) for i, r in enumerate(data, 1)]
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow's errors name neither the file nor the problem in our terms
            raise DataError(f"{source}: not a readable parquet file ({type(e).__name__}: {e})") from None
        return [(f"{source} row {i}", r) for i, r in enumerate(rows, 1)]
    import datasets  # a Hugging Face dataset name or directory (data only: datasets runs no dataset scripts)

    try:
        rows = datasets.load_dataset(source, split=split)
    except Exception as e:  # datasets' messages name neither the source nor the setting
        raise DataError(f"data.source {source!r} (data.split {split!r}) cannot be loaded: {type(e).__name__}: "
                        f"{e}") from e
    return [(f"{source}[{split}] row {i}", r) for i, r in enumerate(rows, 1)]


def load_examples(cfg: DataConfig, split: str = "train") -> list[Example]:
    """The examples of `split` ('train' or 'eval'). The held-out set never overlaps the training
    set nor the few-shot examples (same question text): synthetic eval draws from its own seed
    and skips problems the training set has; a file's eval is its tail, checked against its
    head; any overlap is a ValueError naming the source."""
    if split not in ("train", "eval"):
        raise ValueError(f"load_examples: split={split!r}: expected 'train' or 'eval'")
    if split == "eval" and not cfg.num_eval:
        return []
    if cfg.source == "synthetic":
        train = make_synthetic(cfg.num_train, cfg, seed=cfg.seed)
        if split == "train":
            return train
        evals = _synthetic_eval(cfg, exclude=train + few_shot_examples(cfg))
    else:
        records = _read_records(cfg.source, cfg.split)
        if not records:
            raise DataError(f"data.source {cfg.source!r} (split {cfg.split!r}) has no examples")
        examples = [_record_to_example(r, cfg.format, where, i) for i, (where, r) in enumerate(records)]
        train = examples[: cfg.num_train] if cfg.num_train else examples
        if split == "train":
            return train
        n_train = cfg.num_train or len(examples)
        if n_train + cfg.num_eval > len(examples):  # eval: the tail, after the training head
            raise DataError(
                f"data.source {cfg.source!r} (split {cfg.split!r}) has {len(examples)} examples: the training head "
                f"(data.num_train={cfg.num_train}, i.e. {n_train}) and the held-out tail (data.num_eval="
                f"{cfg.num_eval}) would share {n_train + cfg.num_eval - len(examples)}; lower one of them")
        evals = examples[-cfg.num_eval:]
    check_disjoint(train + few_shot_examples(cfg), evals, cfg.source)
    return evals


def eval_file_examples(cfg: DataConfig) -> list[Example]:
    """The first data.num_eval records of the file or dataset `data.eval_source` (data/sources.py
    checks them against the training questions)."""
    records = _read_records(cfg.eval_source, cfg.split)[: cfg.num_eval]
    if not records:
        raise DataError(f"data.eval_source {cfg.eval_source!r} (split {cfg.split!r}) has no examples")
    return [_record_to_example(r, cfg.format, where, i) for i, (where, r) in enumerate(records)]


def _key(example: Example) -> str:
    """What makes two problems the same: the question text, whitespace-normalised."""
    return " ".join(example.question.split())


def check_disjoint(train: list[Example], evals: list[Example], source: str) -> None:
    """Raise ValueError (naming `source`, how many and which) if a held-out question is also a
    training (or few-shot) question."""
    seen = {_key(e) for e in train}
    overlap = [e for e in evals if _key(e) in seen]
    if overlap:
        shown = "; ".join(f"{e.id or '?'}: {e.question[:60]!r}" for e in overlap[:3])
        raise DataError(f"data.source {source!r}: {len(overlap)} of {len(evals)} held-out examples also appear "
                         f"in the training data (or the few-shot prefix), e.g. {shown}")


def _synthetic_eval(cfg: DataConfig, exclude: list[Example]) -> list[Example]:
    """`num_eval` problems from the eval seed, skipping any whose question is in `exclude` (the
    training set and the few-shot prefix): short problems collide by chance."""
    taken = {_key(e) for e in exclude}
    rng = random.Random(cfg.seed + 1_000_003)
    out, draws = [], 0
    while len(out) < cfg.num_eval:
        draws += 1
        if draws > 20 * cfg.num_eval + 10_000:
            raise DataError(f"data.source 'synthetic': only {len(out)} of data.num_eval={cfg.num_eval} held-out "
                             f"problems outside the {cfg.num_train} training problems after {draws - 1} draws; "
                             "make the task larger (data.max_operand, data.max_steps) or data.num_train smaller")
        ex = make_synthetic_example(rng, cfg, draws - 1)
        if _key(ex) not in taken:
            out.append(_synthetic(ex.question, ex.answer, ex.solution, f"syn-eval-{draws - 1}"))
    return out


def few_shot_examples(cfg: DataConfig) -> list[Example]:
    """The fixed solved examples of the few-shot prefix (same for every prompt)."""
    if cfg.few_shot == 0:
        return []
    return make_synthetic(cfg.few_shot, cfg, seed=cfg.seed + 7_777_777)


def iteration_prompts(examples: list[Example], iteration: int, batch: int, seed: int) -> list[tuple[int, Example]]:
    """The `batch` prompts of `iteration`: epoch-wise shuffles, a pure function of its
    arguments, so a resumed run takes exactly the prompts it would have taken."""
    n = len(examples)
    if n == 0:
        raise DataError("no training examples")
    out = []
    for k in range(iteration * batch, (iteration + 1) * batch):
        epoch, pos = divmod(k, n)
        index = _epoch_order(n, seed, epoch)[pos]
        out.append((index, examples[index]))
    return out


def extra_prompts(examples: list[Example], iteration: int, batch: int, seed: int, count: int) -> list[int]:
    """The indices of dynamic sampling's first `count` extra draws of `iteration` (after its `batch`
    prompts): a shuffle of the training set of its own per iteration, without the iteration's
    prompts (cycled if `count` is larger). A pure function of its arguments, so the later
    iterations' prompts and a resume are unchanged by how many an iteration drew."""
    taken = frozenset(i for i, _ in iteration_prompts(examples, iteration, batch, seed))
    rest = _extra_order(len(examples), seed, iteration, taken)
    return [rest[k % len(rest)] for k in range(count)]


@functools.lru_cache(maxsize=4)
def _extra_order(n: int, seed: int, iteration: int, taken: frozenset[int]) -> tuple[int, ...]:
    """The iteration's shuffle without its prompts: computed once, not at every filtered group."""
    order = list(range(n))
    random.Random(f"extra-draws:{seed}:{iteration}").shuffle(order)
    return tuple(i for i in order if i not in taken) or tuple(order)


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)
