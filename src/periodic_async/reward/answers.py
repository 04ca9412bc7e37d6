"""Answer parsing and comparison: the final answer of a completion and whether it equals the truth.

Extraction order: the last '#### N', else the last '\\boxed{...}', else the last number.
Comparison: numeric equality when both parse as numbers, else canonical string equality;
`math_verify_equal` adds math-verify's symbolic equivalence (fractions, LaTeX), bounded in a
worker process (see below). Pure functions except that one; `last_boxed` (data/tasks.py, where
the MATH loader reads ground truths with it) finds a boxed answer.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import threading
from fractions import Fraction

from periodic_async.data.tasks import last_boxed  # one parser of \boxed{} for ground truths and completions
from periodic_async.reward.worker import TimedWorker, WorkerDied

logger = logging.getLogger(__name__)

_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


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


# --- math-verify, off the main thread, with a hard timeout ------------------------------------
#
# Rewards are computed in the producer *thread*. math-verify bounds its sympy work with
# signal.alarm, which only works in the main thread (elsewhere it raises, and math-verify's
# own error handling then returns "not equal": a silent fallback to string matching). So we
# switch its signal timeouts off and run it in a worker process instead: a call that exceeds
# MATH_VERIFY_TIMEOUT_S kills the worker (a fresh one starts on the next call), so a
# pathological expression cannot hang the run. Errors and timeouts score 0, are counted
# (`math_verify_stats()`) and logged, never swallowed. A worker that dies is replaced and the
# comparison sent again (worker.py); one that dies MAX_DEATHS times in a row raises
# `WorkerDied`, which `correctness_reward` turns into the run's `RewardError`.

MATH_VERIFY_TIMEOUT_S = 5.0
"""Wall-clock bound of one math-verify comparison (parse both answers, verify)."""

def verify_math(pred_text: str, truth: str) -> bool:
    """math-verify's equivalence with its signal-based timeouts disabled (any thread, no bound:
    call it through a `TimedWorker`). Raises on math-verify errors."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": we bound it ourselves
    gold = parse(f"${truth}$", parsing_timeout=None, raise_on_error=True)
    pred = parse(pred_text, parsing_timeout=None, raise_on_error=True)
    return bool(verify(gold, pred, timeout_seconds=None, raise_on_error=True))


_math_worker: TimedWorker | None = None
_math_stats = {"calls": 0, "equal": 0, "errors": 0, "timeouts": 0}
_math_lock = threading.Lock()


def math_verify_stats() -> dict[str, int]:
    """Counts of math-verify comparisons in this process: calls, equal, errors, timeouts."""
    with _math_lock:
        return dict(_math_stats)


def _count(key: str) -> int:
    with _math_lock:
        _math_stats[key] += 1
        return _math_stats[key]


def math_verify_equal(pred_text: str, truth: str, timeout_s: float | None = None) -> bool:
    """math-verify's symbolic equivalence of a completion and the ground truth, from any thread;
    `WorkerDied` if its worker process keeps dying."""
    global _math_worker
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError("math_reward needs math-verify: pip install 'periodic-async[math]'")
    with _math_lock:
        if _math_worker is None:
            _math_worker = TimedWorker(warmup=[("importlib:import_module", ["math_verify"])])
    _count("calls")
    timeout_s = MATH_VERIFY_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        ok = _math_worker.call("periodic_async.reward.answers:verify_math", pred_text, truth, timeout_s=timeout_s)
    except TimeoutError:
        n = _count("timeouts")
        logger.warning("math-verify timed out after %.1f s (scored 0; %d timeouts so far): answer %r, "
                       "completion %r", timeout_s, n, truth, pred_text[-200:])
        return False
    except WorkerDied:  # it died MAX_DEATHS times in a row: the run's end (correctness_reward says so)
        raise
    except RuntimeError as e:  # WorkerError (math-verify raised) or a worker that did not start
        n = _count("errors")
        if n <= 10 or n % 100 == 0:
            logger.warning("math-verify raised %s: %s (scored 0; %d errors so far): answer %r, completion %r",
                           type(e).__name__, e, n, truth, pred_text[-200:])
        return False
    if ok:
        _count("equal")
    return ok
