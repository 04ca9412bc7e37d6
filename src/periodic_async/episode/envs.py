"""Built-in environments: a calculator with a verifier, and the long-tailed latency they take.

`Latency`: a tool's wall time drawn from a lognormal distribution given by its median and 99th
percentile (defaults: median 0.2 s, p99 3 s, like a code sandbox; sigma = ln(p99 / median) / z_0.99),
times `scale` (tests use a small one). A draw is a pure function of the seed and a key (what the
call is: its question, its arguments, how many calls came before), so a rerun waits the same
times, and episodes that say different things wait different times.

`CalculatorEnv`: TRL's environment protocol for arithmetic tasks (reasoning-gym's
basic_arithmetic, chain_sum, ...: any row with an `answer` column, which reset() takes). Its one
tool, `calculator(expression)`, evaluates +, -, *, /, //, %, ** and parentheses on numbers (no
names, no calls: nothing else is evaluated). Its `feedback(reply)` is a verifier that answers
every reply that calls no tool: it reads the answer (`<answer>...</answer>`, reasoning-gym's
format, else the reply's last number), and while the answer is wrong and attempts remain it says
so and the model tries again; `get_reward()` is 1.0 for a correct final answer, else 0.0. Both
the tool and the verifier take a `Latency` draw.

    from periodic_async.episode.envs import CalculatorEnv, Latency
    factory = CalculatorEnv.factory(latency=Latency(), attempts=3)   # environment_factory=factory
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import re
import time
import zlib
from dataclasses import dataclass

import numpy as np

Z99 = 2.3263478740408408
"""The standard normal's 99th percentile."""


@dataclass(frozen=True)
class Latency:
    median_s: float = 0.2
    p99_s: float = 3.0
    scale: float = 1.0
    """Multiplies every draw (1: the stated distribution)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.median_s <= self.p99_s:
            raise ValueError(f"Latency: need 0 < median_s ({self.median_s}) <= p99_s ({self.p99_s})")
        if self.scale < 0:
            raise ValueError(f"Latency.scale={self.scale}: must be >= 0")

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.median_s) / Z99

    def draw(self, *key) -> float:
        """Seconds for the call named by `key` (any values; their str() is hashed)."""
        words = [zlib.crc32(str(k).encode()) for k in key]
        z = np.random.default_rng(np.random.SeedSequence([self.seed, *words])).standard_normal()
        return self.scale * self.median_s * math.exp(self.sigma * z)

    def wait(self, *key) -> float:
        seconds = self.draw(*key)
        if seconds > 0:
            time.sleep(seconds)
        return seconds


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION = 200
MAX_MAGNITUDE = 1e100


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError (one line) for anything else or too large."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            try:
                out = _OPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
                raise ValueError("result out of range")
            return out
        raise ValueError(f"not an arithmetic expression: {ast.unparse(node)[:40]!r}")

    return value(tree)


def format_number(x: int | float) -> str:
    """An integer as such, a float to 10 significant digits."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.10g}"


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(reply: str) -> str | None:
    """The reply's answer: its last <answer>...</answer>, else its last number, else None."""
    tags = _ANSWER.findall(reply)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(reply)
    return numbers[-1] if numbers else None


def answers_match(given: str | None, truth: str) -> bool:
    """Numerically equal when both are numbers (1e-6), else equal as stripped text."""
    if given is None:
        return False
    try:
        return abs(float(given.replace(",", "")) - float(str(truth).replace(",", ""))) < 1e-6
    except ValueError:
        return given.strip() == str(truth).strip()


class CalculatorEnv:
    """Arithmetic with a calculator tool and a verifier (module docstring)."""

    def __init__(self, latency: Latency | dict | None = None, attempts: int = 1, answer_column: str = "answer"):
        """latency: a `Latency`, or its fields as a mapping (env.factory_kwargs); None: no wait."""
        if attempts < 1:
            raise ValueError(f"CalculatorEnv: attempts={attempts} must be >= 1")
        self.latency = Latency(**latency) if isinstance(latency, dict) else latency or Latency(scale=0.0)
        self.attempts, self.answer_column = attempts, answer_column
        self._reset_state("", "")

    @classmethod
    def factory(cls, latency: Latency | dict | None = None, attempts: int = 1, answer_column: str = "answer"):
        """An environment_factory (no arguments) making such environments."""
        return functools.partial(cls, latency=latency, attempts=attempts, answer_column=answer_column)

    def _reset_state(self, question: str, answer: str) -> None:
        self.question, self.answer = question, answer
        self.calls, self.tries, self.correct = 0, 0, False

    def reset(self, **row) -> None:
        if self.answer_column not in row:
            raise KeyError(f"CalculatorEnv: the row has no {self.answer_column!r} column ({', '.join(sorted(row))})")
        self._reset_state(str(row.get("question", "")), str(row[self.answer_column]))
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "3 * (4 + 5)".
        """
        self.latency.wait("calculator", self.question, self.calls, expression)
        self.calls += 1
        try:
            return format_number(evaluate(expression))
        except ValueError as e:
            return f"error: {e}"

    def feedback(self, reply: str) -> str | None:
        """The verifier: None (the episode ends) once the answer is right or no attempt is left."""
        self.latency.wait("verify", self.question, self.tries, reply)
        self.tries += 1
        self.correct = answers_match(extract_answer(reply), self.answer)
        if self.correct or self.tries >= self.attempts:
            return None
        return f"That is not correct ({self.attempts - self.tries} attempts left). Try again."

    def get_reward(self) -> float:
        return 1.0 if self.correct else 0.0
