"""A bounded worker process: 'module:function' calls with JSON arguments and a wall-clock timeout.

User reward functions and math-verify run here, off the producer thread: a call that overruns
kills the process (the next call starts a new one), so a hanging reward cannot hang the run.
The worker imports with the caller's `sys.path` (this package first), never adding its own
working directory, and reports ready only after its preloads, so import time is not part of
any call's budget.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence


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
    for spec in reward_specs:  # the reward functions' own module, loaded by name in the child only
        importlib.import_module("periodic_async.reward.functions").worker_reward_fn(spec)
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
        path = [str(Path(__file__).resolve().parents[2])] + [os.path.abspath(p) for p in sys.path]
        code = (f"import sys; sys.path[:] = {path!r}; from periodic_async.reward.sandbox import _worker_main; "
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
