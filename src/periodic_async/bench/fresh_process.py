"""One call in a fresh interpreter: a measurement that needs a process of its own (one vLLM
engine per process, a peak resident set that counts one model's memory alone).

    out = in_fresh_process(push_one, "vllm", "lora", 6, path)   # push_one(...) in a new process

The function is a module-level function (an experiment script's own, too: the new interpreter
imports the script as `__mp_main__`, its `if __name__ == "__main__"` block not run); its
arguments and return value travel pickled. The process is spawned, not forked: it starts with
none of this process's memory, threads or engines, and its /proc/self/status counts its own.
An exception in it is raised here, with its traceback.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a new spawned interpreter that exits after it; its return value."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
