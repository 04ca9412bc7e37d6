"""Reward functions: correctness and format scores, user reward functions, their weighted sum.

A reward function has TRL's shape, `f(prompts, completions, **kwargs) -> list[float]`,
where kwargs carry every column of the dataset, one value per completion (`data.reward_kwargs`;
`answer` is always there, the parsed ground truth), `completion_ids` and `trainer_state`
(`TrainerState`). Episodes (env.*) add `environments` (each episode's environment instance, as
TRL passes them; to functions that run in this process only, `reward.timeout_s=0`) and
`completion_messages` (each episode's turns as chat messages); `completions` are then the
model's turns' text, joined. The producer scores each finished group
with the weighted sum of the configured functions (`combined_reward`), and its accuracy with
`reward.accuracy_function` (`make_accuracy`, scores in [0, 1]; held-out evaluation uses it too).
Answers are parsed and compared in answers.py; user functions run in worker.py's timed worker process.

Guarantees: a user reward function (any not defined in this module) runs in a worker process
with a wall-clock bound per call (`reward.timeout_s`): one that hangs is killed and the run
stops with a `RewardError` naming it; one that raises, returns a non-number, the wrong count
or a NaN/inf stops the run with a `RewardError` naming it and the value (the producer adds
the iteration and prompt). A worker that dies (a crash, `os._exit`, killed from outside) is
replaced and the call sent again; only one that dies `worker.MAX_DEATHS` (3) times in a row
stops the run, with a `RewardError` naming the function; restarts are counted in the run's
metrics (`reward_stats`). Reward code is loaded only from the module or file the user names
in `reward.functions`; the worker resolves imports with the caller's `sys.path`, never adding
its own working directory.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import re
import threading
import weakref
from pathlib import Path
from typing import Callable, Sequence

from periodic_async.config import RewardConfig, UserError
from periodic_async.reward.answers import answers_match, extract_answer, math_verify_equal
from periodic_async.reward.worker import TimedWorker, WorkerDied, WorkerError, worker_restarts

RewardFn = Callable[..., list[float]]


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """The `trainer_state` reward functions get (TRL passes its TrainerState; these are the fields
    a reward that shapes itself by training progress reads): the optimizer steps taken before the
    samples were drawn, the run's total, and the epoch (prompts taken / training prompts)."""

    global_step: int
    max_steps: int
    epoch: float


_worker_reward_fns: dict[str, "RewardFn"] = {}


def worker_reward_fn(spec: str) -> "RewardFn":
    """In the worker process: the reward function `spec`, loaded once."""
    if spec not in _worker_reward_fns:
        _worker_reward_fns[spec] = load_reward_fn(spec)
    return _worker_reward_fns[spec]


def call_reward_fn(spec: str, prompts: list, completions: list[str], kwargs: dict) -> list[float]:
    """In the worker process: `spec`(prompts, completions, **kwargs) as a list of floats (NaN and
    inf included: the caller checks them and names the function)."""
    if isinstance(kwargs.get("trainer_state"), dict):  # sent as JSON by `combined_reward`
        kwargs["trainer_state"] = TrainerState(**kwargs["trainer_state"])
    r = worker_reward_fn(spec)(prompts, completions, **kwargs)
    try:
        return [float(x) for x in r]
    except (TypeError, ValueError) as e:
        raise TypeError(f"returned {r!r:.200}: expected a list of numbers ({e})") from None


def reward_stats() -> dict[str, int]:
    """Counters of this process's reward workers, logged with each iteration's metrics:
    reward/worker_restarts, the worker processes started to replace one (user rewards, accuracy,
    math-verify; dead, killed on a timeout, or broken protocol), since the process started."""
    return {"reward/worker_restarts": worker_restarts()}


def correctness_reward(prompts: Sequence, completions: Sequence[str], answer: Sequence[str],
                       use_math_verify: bool = False, **kwargs) -> list[float]:
    """1.0 when the extracted answer equals the ground truth, else 0.0."""
    out = []
    for text, truth in zip(completions, answer, strict=True):
        ok = answers_match(extract_answer(text), str(truth))
        if not ok and use_math_verify:
            try:
                ok = math_verify_equal(text, str(truth))
            except WorkerDied as e:  # math-verify's worker keeps dying: the run stops
                raise RewardError(f"math-verify: {e}") from None
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


def load_reward_fn(spec: str, what: str = "reward function") -> RewardFn:
    """Load 'package.module:function' (imported through `sys.path`) or 'path/to/file.py:function'
    (exactly that file). Nothing else is imported. Raises `RewardError` naming the spec (as `what`:
    the same loader takes environments and tools, env.factory and env.tools)."""
    if ":" not in spec:
        raise RewardError(f"{what} {spec!r}: expected 'module:function' or 'file.py:function'")
    mod_name, fn_name = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise RewardError(f"{what} {spec!r}: file {mod_name!r} does not exist")
        s = importlib.util.spec_from_file_location(f"_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(s)
        try:
            s.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"{what} {spec!r}: loading {mod_name!r} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise RewardError(f"{what} {spec!r}: cannot import {mod_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"{what} {spec!r}: {mod_name!r} has no callable {fn_name!r}")
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


def _start_quietly(worker: TimedWorker) -> None:
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
    one worker process (`TimedWorker`, started now in the background), each call bounded by
    `timeout_s`: a call that overruns kills the worker and raises `RewardError` saying so; a
    worker that dies is replaced (see the module's docstring). Its CPUs: `worker.set_worker_cpus`.
    Specs are loaded here too, so a bad one fails at start-up. Callables and this module's
    functions run in the calling thread. The worker stops when the returned function is
    garbage-collected, at exit, or on its `close()`."""
    entries: list[tuple[str, RewardFn | None, str | None]] = []  # (name, in-process fn, worker spec)
    remote: list[str] = []
    for f in fns:
        if isinstance(f, str):
            fn = load_reward_fn(f)
            if timeout_s > 0 and getattr(fn, "__module__", None) != __name__:  # any but this module's
                entries.append((f, None, f))
                remote.append(f)
            else:
                entries.append((f, fn, None))
        else:
            entries.append((getattr(f, "__name__", repr(f)), f, None))
    # the worker loads the specs before it reports ready, so their import is no call's budget
    warmup = [("periodic_async.reward.functions:worker_reward_fn", [spec]) for spec in remote]
    worker = TimedWorker(warmup=warmup) if remote else None
    if worker is not None:
        threading.Thread(target=_start_quietly, args=(worker,), daemon=True, name="reward-worker-start").start()

    def call_remote(name: str, spec: str, prompts: Sequence, completions: Sequence[str], kwargs: dict):
        try:
            worker.start()
        except (TimeoutError, RuntimeError) as e:
            raise RewardError(f"reward function {name!r}: its worker process did not start ({e}); "
                              "its error is printed above") from None
        try:
            if isinstance(kwargs.get("trainer_state"), TrainerState):  # the worker speaks JSON
                kwargs = {**kwargs, "trainer_state": dataclasses.asdict(kwargs["trainer_state"])}
            kwargs = {k: v for k, v in kwargs.items() if k != "environments"}  # live objects stay here
            return worker.call("periodic_async.reward.functions:call_reward_fn", spec, list(prompts), list(completions),
                               kwargs, timeout_s=timeout_s)
        except TimeoutError:
            raise RewardError(f"reward function {name!r} timed out: no result after {timeout_s:g} s "
                              "(reward.timeout_s); its worker process was killed") from None
        except WorkerError as e:
            raise RewardError(f"reward function {name!r} raised {e}") from None
        except RuntimeError as e:  # WorkerDied: it died MAX_DEATHS times in a row; or it did not restart
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


def make_accuracy(cfg: RewardConfig) -> RewardFn:
    """The run's accuracy score: `reward.accuracy_function` (the reward functions' shape and
    arguments), run as they are (a user function in a timed worker, `reward.timeout_s`), each
    value checked to be in [0, 1]: a `RewardError` naming the function and the value otherwise.
    Per-iteration `accuracy` and held-out `eval/accuracy` are the means of these scores."""
    name = cfg.accuracy_function
    score = combined_reward([name], [1.0], timeout_s=cfg.timeout_s)

    def accuracy(prompts: Sequence, completions: Sequence[str], **kwargs) -> list[float]:
        values = score(prompts, completions, **kwargs)
        bad = [(i, v) for i, v in enumerate(values) if not 0.0 <= v <= 1.0]
        if bad:
            raise RewardError(f"accuracy function {name!r} (reward.accuracy_function) returned "
                              f"{', '.join(f'{v} (completion {i})' for i, v in bad[:4])}: expected scores in [0, 1]")
        return values

    accuracy.close = score.close
    return accuracy
