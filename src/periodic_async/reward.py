"""Rewards: answer extraction, correctness and format scores, user reward functions.

A reward function has TRL's shape, `f(prompts, completions, **kwargs) -> list[float]`,
where kwargs carry the dataset columns (here `answer`). The producer scores each finished
group with the weighted sum of the configured functions (`combined_reward`).
Extraction order: the last '#### N', else the last '\\boxed{...}', else the last number.

Guarantees: a user reward function (any not defined in this module) runs in a worker process
with a wall-clock bound per call (`reward.timeout_s`): one that hangs is killed and the run
stops with a `RewardError` naming it; one that raises, returns a non-number, the wrong count
or a NaN/inf stops the run with a `RewardError` naming it and the value (the producer adds
the iteration and prompt). Reward code is loaded only from the module or file the user names
in `reward.functions`; the worker resolves imports with the caller's `sys.path`, never adding
its own working directory.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import logging
import math
import os
import queue
import re
import subprocess
import sys
import threading
import weakref
from fractions import Fraction
from pathlib import Path
from typing import Callable, Sequence

from periodic_async.config import RewardConfig, UserError

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


# --- math-verify, off the main thread, with a hard timeout ------------------------------------
#
# Rewards are computed in the producer *thread*. math-verify bounds its sympy work with
# signal.alarm, which only works in the main thread (elsewhere it raises, and math-verify's
# own error handling then returns "not equal": a silent fallback to string matching). So we
# switch its signal timeouts off and run it in a worker process instead: a call that exceeds
# MATH_VERIFY_TIMEOUT_S kills the worker (a fresh one starts on the next call), so a
# pathological expression cannot hang the run. Errors and timeouts score 0, are counted
# (`math_verify_stats()`) and logged, never swallowed.

MATH_VERIFY_TIMEOUT_S = 5.0
"""Wall-clock bound of one math-verify comparison (parse both answers, verify)."""

logger = logging.getLogger(__name__)


def verify_math(pred_text: str, truth: str) -> bool:
    """math-verify's equivalence with its signal-based timeouts disabled (any thread, no bound:
    call it through a `BoundedWorker`). Raises on math-verify errors."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": we bound it ourselves
    gold = parse(f"${truth}$", parsing_timeout=None, raise_on_error=True)
    pred = parse(pred_text, parsing_timeout=None, raise_on_error=True)
    return bool(verify(gold, pred, timeout_seconds=None, raise_on_error=True))


def _worker_main(preload: str, reward_specs: Sequence[str] = ()) -> None:
    """The worker process: JSON lines in ({"fn": "module:function", "args": [...]}), JSON lines out.
    `preload` (a module) and `reward_specs` are loaded before it reports ready, so their import
    time is not part of any call's budget."""
    import json
    import sys

    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints of called code must not corrupt the protocol
    if preload:
        importlib.import_module(preload)
    for spec in reward_specs:
        _worker_reward_fn(spec)
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        module, name = msg["fn"].split(":")
        try:
            reply = json.dumps({"result": getattr(importlib.import_module(module), name)(*msg["args"])})
        except Exception as e:  # reported to the caller, which counts and logs it
            reply = json.dumps({"error": f"{type(e).__name__}: {e}"})
        out.write(reply + "\n")
        out.flush()


_worker_reward_fns: dict[str, "RewardFn"] = {}


def _worker_reward_fn(spec: str) -> "RewardFn":
    """In the worker process: the reward function `spec`, loaded once."""
    if spec not in _worker_reward_fns:
        _worker_reward_fns[spec] = load_reward_fn(spec)
    return _worker_reward_fns[spec]


def call_reward_fn(spec: str, prompts: list, completions: list[str], kwargs: dict) -> list[float]:
    """In the worker process: `spec`(prompts, completions, **kwargs) as a list of floats (NaN and
    inf included: the caller checks them and names the function)."""
    r = _worker_reward_fn(spec)(prompts, completions, **kwargs)
    try:
        return [float(x) for x in r]
    except (TypeError, ValueError) as e:
        raise TypeError(f"returned {r!r:.200}: expected a list of numbers ({e})") from None


def _pump(stream, lines: queue.Queue) -> None:
    """Reader thread: the worker's output lines onto a queue (None at its end), so the caller
    can wait for a reply with a timeout."""
    for line in stream:
        lines.put(line)
    lines.put(None)


class WorkerError(RuntimeError):
    """The function raised in the worker (its type and message are in the text)."""


class BoundedWorker:
    """One worker process that runs 'module:function' calls (JSON arguments and result) with a
    wall-clock timeout; on a timeout the worker is killed and the next call starts a new one.
    A plain subprocess (`python -c`), so it works from any thread and whatever the main script.
    Calls are serialised: a timeout measures the call itself, not a queue."""

    def __init__(self, preload: str = "", start_timeout_s: float = 120.0, reward_specs: Sequence[str] = ()):
        self.preload, self.start_timeout_s, self.reward_specs = preload, start_timeout_s, list(reward_specs)
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def start(self) -> None:
        """Start the worker now (else the first call does); its start-up is not part of any call's budget."""
        with self._lock:
            if self._proc is None:
                self._start()

    def _start(self) -> None:
        # The child imports with this process's sys.path (this package first), not with the
        # working directory `python -c` would put in front of it: it loads what we would load.
        path = [str(Path(__file__).resolve().parents[1])] + [os.path.abspath(p) for p in sys.path]
        code = (f"import sys; sys.path[:] = {path!r}; from periodic_async.reward import _worker_main; "
                f"_worker_main({self.preload!r}, {self.reward_specs!r})")
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, bufsize=1)
        self._lines = queue.Queue()
        threading.Thread(target=_pump, args=(self._proc.stdout, self._lines), daemon=True,
                         name="bounded-worker-reader").start()
        self._read(self.start_timeout_s, "start-up")  # start-up is not part of any call's budget

    def _read(self, timeout_s: float, what: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            raise TimeoutError(f"{what} exceeded {timeout_s} s; worker killed") from None
        if line is None:
            code = self._proc.wait()
            self._proc = None
            raise RuntimeError(f"worker process exited (code {code}) during {what}")
        return json.loads(line)

    def call(self, fn: str, *args, timeout_s: float):
        """fn(*args) in the worker ('module:function'); TimeoutError after `timeout_s`, WorkerError
        if fn raised."""
        with self._lock:
            if self._proc is None:
                self._start()
            self._proc.stdin.write(json.dumps({"fn": fn, "args": list(args)}) + "\n")
            self._proc.stdin.flush()
            reply = self._read(timeout_s, fn)
        if "error" in reply:
            raise WorkerError(reply["error"])
        return reply["result"]

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()


_math_worker: BoundedWorker | None = None
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


def _math_verify(pred_text: str, truth: str, timeout_s: float | None = None) -> bool:
    """math-verify's symbolic equivalence of a completion and the ground truth, from any thread."""
    global _math_worker
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError("math_reward needs math-verify: pip install 'periodic-async[math]'")
    with _math_lock:
        if _math_worker is None:
            _math_worker = BoundedWorker(preload="math_verify")
    _count("calls")
    timeout_s = MATH_VERIFY_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        ok = _math_worker.call("periodic_async.reward:verify_math", pred_text, truth, timeout_s=timeout_s)
    except TimeoutError:
        n = _count("timeouts")
        logger.warning("math-verify timed out after %.1f s (scored 0; %d timeouts so far): answer %r, "
                       "completion %r", timeout_s, n, truth, pred_text[-200:])
        return False
    except RuntimeError as e:  # WorkerError (math-verify raised) or a dead worker: not the run's end
        n = _count("errors")
        if n <= 10 or n % 100 == 0:
            logger.warning("math-verify raised %s: %s (scored 0; %d errors so far): answer %r, completion %r",
                           type(e).__name__, e, n, truth, pred_text[-200:])
        return False
    if ok:
        _count("equal")
    return ok


def correctness_reward(prompts: Sequence, completions: Sequence[str], answer: Sequence[str],
                       use_math_verify: bool = False, **kwargs) -> list[float]:
    """1.0 when the extracted answer equals the ground truth, else 0.0."""
    out = []
    for text, truth in zip(completions, answer, strict=True):
        ok = answers_match(extract_answer(text), str(truth))
        if not ok and use_math_verify:
            ok = _math_verify(text, str(truth))
        out.append(1.0 if ok else 0.0)
    return out


def math_reward(prompts: Sequence, completions: Sequence[str], answer: Sequence[str], **kwargs) -> list[float]:
    """`correctness_reward` that also asks math-verify (symbolic equivalence: fractions, LaTeX)
    when our own comparison fails. Needs math-verify (`pip install 'periodic-async[math]'`);
    works from any thread (the producer's) with a hard timeout per comparison, see above."""
    return correctness_reward(prompts, completions, answer, use_math_verify=True)


def format_reward(prompts: Sequence, completions: Sequence[str], **kwargs) -> list[float]:
    """1.0 when the completion ends its reasoning with '#### <number>', else 0.0."""
    return [1.0 if re.search(r"####\s*[-+]?\$?\d", c) else 0.0 for c in completions]


def load_reward_fn(spec: str) -> RewardFn:
    """Load 'package.module:function' (imported through `sys.path`) or 'path/to/file.py:function'
    (exactly that file). Nothing else is imported. Raises `RewardError` naming the spec."""
    if ":" not in spec:
        raise RewardError(f"reward function {spec!r}: expected 'module:function' or 'file.py:function'")
    mod_name, fn_name = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise RewardError(f"reward function {spec!r}: file {mod_name!r} does not exist")
        s = importlib.util.spec_from_file_location(f"_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(s)
        try:
            s.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"reward function {spec!r}: loading {mod_name!r} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise RewardError(f"reward function {spec!r}: cannot import {mod_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


class RewardError(UserError, ValueError):
    """A reward function could not be loaded, failed, timed out, or returned something that is not
    one finite number per completion; the message names it."""


def _checked(name: str, r, n: int) -> list[float]:
    """`r` as n finite floats, else `RewardError` naming the function `name` and the bad value."""
    try:
        values = [float(x) for x in r]
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward function {name!r} returned {r!r:.200}: expected a list of numbers ({e})") from None
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} completions")
    bad = [(i, v) for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardError(f"reward function {name!r} returned non-finite reward(s) "
                          f"{', '.join(f'{v} (completion {i})' for i, v in bad[:4])}")
    return values


def _start_quietly(worker: BoundedWorker) -> None:
    """Start the worker in the background; a failure is reported by the first call, which retries."""
    try:
        worker.start()
    except Exception:  # noqa: BLE001 - the first reward call starts it again and raises RewardError
        pass


def combined_reward(fns: Sequence[RewardFn | str], weights: Sequence[float], timeout_s: float = 0.0) -> RewardFn:
    """Weighted sum of reward functions, given as callables or as specs for `load_reward_fn`.

    Checks each returns one finite number per completion and raises `RewardError` naming the
    function and the bad value otherwise (a NaN reward would otherwise become NaN advantages,
    gradients and weights). With `timeout_s` > 0 every spec not defined in this module runs in
    one worker process (`BoundedWorker`, started now in the background), each call bounded by
    `timeout_s`: a call that overruns kills the worker and raises `RewardError` saying so.
    Specs are loaded here too, so a bad one fails at start-up. Callables and this module's
    functions run in the calling thread. The worker stops when the returned function is
    garbage-collected, at exit, or on its `close()`."""
    entries: list[tuple[str, RewardFn | None, str | None]] = []  # (name, in-process fn, worker spec)
    remote: list[str] = []
    for f in fns:
        if isinstance(f, str):
            fn = load_reward_fn(f)
            if timeout_s > 0 and f.rsplit(":", 1)[0] != __name__:
                entries.append((f, None, f))
                remote.append(f)
            else:
                entries.append((f, fn, None))
        else:
            entries.append((getattr(f, "__name__", repr(f)), f, None))
    worker = BoundedWorker(reward_specs=remote) if remote else None
    if worker is not None:
        threading.Thread(target=_start_quietly, args=(worker,), daemon=True, name="reward-worker-start").start()

    def call_remote(name: str, spec: str, prompts: Sequence, completions: Sequence[str], kwargs: dict):
        try:
            worker.start()
        except (TimeoutError, RuntimeError) as e:
            raise RewardError(f"reward function {name!r}: its worker process did not start ({e}); "
                              "its error is printed above") from None
        try:
            return worker.call("periodic_async.reward:call_reward_fn", spec, list(prompts), list(completions),
                               kwargs, timeout_s=timeout_s)
        except TimeoutError:
            raise RewardError(f"reward function {name!r} timed out: no result after {timeout_s:g} s "
                              "(reward.timeout_s); its worker process was killed") from None
        except WorkerError as e:
            raise RewardError(f"reward function {name!r} raised {e}") from None
        except RuntimeError as e:  # the worker process died (os._exit, a crash)
            raise RewardError(f"reward function {name!r}: {e}") from None

    def reward(prompts: Sequence, completions: Sequence[str], **kwargs) -> list[float]:
        total = [0.0] * len(completions)
        for (name, fn, spec), w in zip(entries, weights, strict=True):
            r = fn(prompts, completions, **kwargs) if spec is None else \
                call_remote(name, spec, prompts, completions, kwargs)
            total = [t + w * v for t, v in zip(total, _checked(name, r, len(completions)))]
        return total

    if worker is not None:
        weakref.finalize(reward, worker.close)
        reward.close = worker.close
    else:
        reward.close = lambda: None
    return reward


def make_reward(cfg: RewardConfig) -> RewardFn:
    """The run's reward: `reward.functions` weighted by `reward.weights`, user functions bounded
    by `reward.timeout_s` (see `combined_reward`)."""
    return combined_reward(cfg.functions, cfg.weights, timeout_s=cfg.timeout_s)
