"""Rewards: answer parsing, the built-in reward functions, and user functions in a timed worker process.

    answers.py     the final answer of a completion and whether it equals the truth
    functions.py   reward functions (TRL's shape), loading user functions, their weighted sum
    tasks.py       the rewards of a task source (reasoning-gym): the task's own verifier
    worker.py      the worker process user functions and math-verify run in, each call bounded in time

Built-in functions are named `periodic_async.reward:<name>` in `reward.functions`.
"""

from periodic_async.reward.answers import (answers_match, extract_answer, last_boxed, math_verify_stats,
                                           normalize_answer, verify_math)
from periodic_async.reward.functions import (RewardError, RewardFn, TrainerState, call_reward_fn, combined_reward,
                                             correctness_reward, format_reward, load_reward_fn, make_accuracy,
                                             make_reward, math_reward, reward_stats)
from periodic_async.reward.tasks import task_accuracy, task_reward
from periodic_async.reward.worker import TimedWorker, WorkerDied, WorkerError, set_worker_cpus

__all__ = ["TimedWorker", "RewardError", "RewardFn", "TrainerState", "WorkerDied", "WorkerError", "answers_match",
           "call_reward_fn", "combined_reward", "correctness_reward", "extract_answer", "format_reward", "last_boxed",
           "load_reward_fn", "make_accuracy", "make_reward", "math_reward", "math_verify_stats", "normalize_answer",
           "reward_stats", "set_worker_cpus", "task_accuracy", "task_reward", "verify_math"]
