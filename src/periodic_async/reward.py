"""Rewards: answer extraction, correctness and format scores, user reward functions.

A reward function has TRL's shape, `f(prompts, completions, **kwargs) -> list[float]`,
where kwargs carry the dataset columns (here `answer`). The producer scores each finished
group with the weighted sum of the configured functions (`combined_reward`).
Extraction order: the last '#### N', else the last '\\boxed{...}', else the last number.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from fractions import Fraction
from pathlib import Path
from typing import Callable, Sequence

RewardFn = Callable[..., list[float]]

_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


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


def normalize_answer(ans: str) -> str:
    """Canonical string of an answer: no commas/$/spaces/'+', no trailing '.0', no final '.'."""
    s = ans.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    if s in ("-0",):
        s = "0"
    return s


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: '#### N', else '\\boxed{}', else the last number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUMBER.search(tail)
        if m:
            return normalize_answer(m.group())
        tail = tail.strip().splitlines()[0].strip() if tail.strip() else ""
        return normalize_answer(tail) if tail else None
    boxed = last_boxed(text)
    if boxed is not None:
        return normalize_answer(boxed)
    nums = _NUMBER.findall(text)
    return normalize_answer(nums[-1]) if nums else None


def _as_number(s: str) -> Fraction | None:
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(pred: str | None, truth: str) -> bool:
    """Numeric equality when both parse as numbers, else canonical string equality."""
    if pred is None:
        return False
    t = normalize_answer(truth)
    a, b = _as_number(pred), _as_number(t)
    if a is not None and b is not None:
        return a == b
    return pred == t


def _math_verify(pred_text: str, truth: str) -> bool | None:
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        return bool(verify(parse(f"${truth}$"), parse(pred_text)))
    except Exception:  # math-verify raises many kinds of parse errors; fall back to ours
        return None


def correctness_reward(prompts: Sequence, completions: Sequence[str], answer: Sequence[str],
                       use_math_verify: bool = False, **kwargs) -> list[float]:
    """1.0 when the extracted answer equals the ground truth, else 0.0."""
    out = []
    for text, truth in zip(completions, answer, strict=True):
        ok = answers_match(extract_answer(text), str(truth))
        if not ok and use_math_verify:
            ok = bool(_math_verify(text, str(truth)))
        out.append(1.0 if ok else 0.0)
    return out


def math_reward(prompts: Sequence, completions: Sequence[str], answer: Sequence[str], **kwargs) -> list[float]:
    """`correctness_reward` that also asks math-verify (symbolic equivalence: fractions, LaTeX)
    when it is installed (`pip install math-verify`, in the dev extra)."""
    return correctness_reward(prompts, completions, answer, use_math_verify=True)


def format_reward(prompts: Sequence, completions: Sequence[str], **kwargs) -> list[float]:
    """1.0 when the completion ends its reasoning with '#### <number>', else 0.0."""
    return [1.0 if re.search(r"####\s*[-+]?\$?\d", c) else 0.0 for c in completions]


def load_reward_fn(spec: str) -> RewardFn:
    """Load 'package.module:function' or 'path/to/file.py:function'."""
    if ":" not in spec:
        raise ValueError(f"reward function {spec!r}: expected 'module:function' or 'file.py:function'")
    mod_name, fn_name = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise FileNotFoundError(f"reward function {spec!r}: file {mod_name!r} does not exist")
        s = importlib.util.spec_from_file_location(f"_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(s)
        s.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ImportError(f"reward function {spec!r}: cannot import {mod_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise AttributeError(f"reward function {spec!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def combined_reward(fns: Sequence[RewardFn], weights: Sequence[float]) -> RewardFn:
    """Weighted sum of reward functions; checks each returns one float per completion."""
    def reward(prompts: Sequence, completions: Sequence[str], **kwargs) -> list[float]:
        total = [0.0] * len(completions)
        for fn, w in zip(fns, weights, strict=True):
            r = fn(prompts, completions, **kwargs)
            if len(r) != len(completions):
                raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned {len(r)} "
                                 f"values for {len(completions)} completions")
            total = [t + w * float(x) for t, x in zip(total, r)]
        return total
    return reward
