"""A timed worker process: 'module:function' calls with JSON arguments and a wall-clock timeout.

User reward functions and math-verify run here, off the producer thread that scores each group
as it completes (the paper's producer, Sec. 3), so a hanging or crashing reward cannot hang or
crash the run. It bounds time only and isolates nothing: the process runs as the same user,
with the same files, network and environment as the run. What it runs is named by its caller
(`warmup` and each call's 'module:function'); it names no module of this package but its own.
Guarantees of `TimedWorker.call`:

- timeout: a call that overruns kills the process and raises `TimeoutError`; the next call
  starts a new one.
- death: a worker found dead (it exited, crashed or was killed, between calls or during one)
  is replaced and the call is sent again to the new one; after `MAX_DEATHS` deaths in a row
  with no reply between them the call raises `WorkerDied`, one line with the last exit code.
  Every start after a worker's first is a restart, counted process-wide (`worker_restarts()`).
- protocol: requests and replies travel on descriptors of their own. In the worker, fd 0 reads
  /dev/null and fd 1 is stderr, so whatever called code prints (Python, C, subprocesses) goes
  to stderr, never into a reply. Each request carries a call id that the reply echoes; a line
  that is not JSON or carries another id kills the worker, which counts as a death (the call is
  sent again): a reply is never taken for another call's.
- imports: the worker imports with the caller's `sys.path` (this package first), never adding
  its own working directory, and reports ready only after its warm-up calls, so import time is
  not part of any call's budget.
- CPUs: `cpus` (else the process-wide `set_worker_cpus`) pins the process at every start,
  restarts included, before it imports anything.
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

MAX_DEATHS = 3
"""Deaths in a row (no reply between them) after which a call gives up with `WorkerDied`."""

_reply = None  # in the worker: the reply channel (a test writes a stray line onto it)


def _worker_main(warmup: Sequence[tuple[str, list]] = ()) -> None:
    """The worker process: JSON lines in ({"id", "fn": "module:function", "args"}), JSON lines
    out ({"id", "result"} or {"id", "error"}). The channels are moved off fd 0 and 1 first (see
    the module's docstring); `warmup` calls run before it reports ready."""
    global _reply
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")  # dup'ed descriptors are not inherited
    _reply = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # fd 1 (C code, subprocesses) and sys.stdout now write to stderr
    sys.stdout = sys.stderr

    def resolve(spec: str):
        module, name = spec.split(":")
        return getattr(importlib.import_module(module), name)

    for fn, args in warmup:
        resolve(fn)(*args)
    _reply.write('{"id": 0, "ready": true}\n')
    _reply.flush()
    for line in requests:
        msg = json.loads(line)
        try:
            reply = json.dumps({"id": msg["id"], "result": resolve(msg["fn"])(*msg["args"])})
        except Exception as e:  # reported to the caller, which counts and logs it
            reply = json.dumps({"id": msg["id"], "error": f"{type(e).__name__}: {e}"})
        _reply.write(reply + "\n")
        _reply.flush()


def cpu_affinity() -> list[int]:
    """The CPUs this process may run on (a call a worker can answer: what it is pinned to)."""
    return sorted(os.sched_getaffinity(0))


def _pump(stream, lines: queue.Queue) -> None:
    """Reader thread: the worker's reply lines onto a queue (None at its end), so the caller
    can wait for a reply with a timeout."""
    for line in stream:
        lines.put(line)
    lines.put(None)
    stream.close()


class WorkerError(RuntimeError):
    """The function raised in the worker (its type and message are in the text)."""


class WorkerDied(RuntimeError):
    """The worker died on `MAX_DEATHS` attempts in a row; one line with the last exit."""


class _Died(RuntimeError):
    """One death of the worker (the call is sent again unless it was the last allowed)."""


_restarts = 0
_default_cpus: list[int] | None = None
_stats_lock = threading.Lock()


def worker_restarts() -> int:
    """Worker processes started in this process to replace one (dead, killed on a timeout, or
    broken protocol), over all `TimedWorker`s."""
    with _stats_lock:
        return _restarts


def _checked_cpus(cpus: Sequence[int] | None) -> list[int] | None:
    if cpus is None:
        return None
    cpus = list(cpus)
    if not cpus or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus):
        raise ValueError(f"worker cpus={cpus!r}: expected a non-empty list of CPU ids (ints >= 0) or None")
    return sorted(set(cpus))


def set_worker_cpus(cpus: Sequence[int] | None) -> None:
    """The CPUs of every `TimedWorker` created without `cpus` (user rewards, accuracy and
    math-verify workers), from its next start on; None: the caller's own CPUs (the default).
    Workers running now are left as they are: set this before the reward functions are made."""
    global _default_cpus
    _default_cpus = _checked_cpus(cpus)


def _exit_text(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


class TimedWorker:
    """One worker process that runs 'module:function' calls (JSON arguments and result) with a
    wall-clock timeout, replaced when it dies (see the module's docstring for the guarantees).
    A plain subprocess (`python -c`), so it works from any thread and whatever the main script.
    Calls are serialised: a timeout measures the call itself, not a queue.

    warmup: ('module:function', args) calls run in the worker before it reports ready, at every
    start (e.g. ("importlib:import_module", ["math_verify"])); their results are discarded.
    cpus: the CPU ids the process is pinned to (`os.sched_setaffinity` on its pid right after it
    is created, at every start); None: `set_worker_cpus`'s, else the caller's CPUs."""

    def __init__(self, start_timeout_s: float = 120.0, warmup: Sequence[tuple[str, Sequence]] = (),
                 cpus: Sequence[int] | None = None):
        self.start_timeout_s = start_timeout_s
        self.warmup = [(fn, list(args)) for fn, args in warmup]
        self.cpus = _checked_cpus(cpus)
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._starts = self._deaths = self._call_id = 0
        atexit.register(self.close)

    @property
    def pid(self) -> int | None:
        """The worker process's id (None before its start and after it is killed)."""
        proc = self._proc
        return None if proc is None else proc.pid

    def start(self) -> None:
        """Start the worker now (else the first call does); its start-up is not part of any call's budget."""
        with self._lock:
            if self._proc is None:
                self._start()

    def _start(self) -> None:
        global _restarts
        if self._starts:
            with _stats_lock:
                _restarts += 1
        self._starts += 1
        # The child imports with this process's sys.path (this package first), not with the
        # working directory `python -c` would put in front of it: it loads what we would load.
        path = [str(Path(__file__).resolve().parents[2])] + [os.path.abspath(p) for p in sys.path]
        code = (f"import sys; sys.path[:] = {path!r}; from periodic_async.reward.worker import _worker_main; "
                f"_worker_main({self.warmup!r})")
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, bufsize=1)
        cpus = self.cpus if self.cpus is not None else _default_cpus
        if cpus is not None:  # before the interpreter is up: every thread it starts inherits it
            try:
                os.sched_setaffinity(self._proc.pid, cpus)
            except OSError as e:
                self._kill()
                raise ValueError(f"worker cpus={cpus}: cannot pin the worker process to them ({e})") from None
        self._lines = queue.Queue()
        threading.Thread(target=_pump, args=(self._proc.stdout, self._lines), daemon=True,
                         name="timed-worker-reader").start()
        try:
            self._read(self.start_timeout_s, "start-up", 0)  # start-up is not part of any call's budget
        except _Died as e:
            raise RuntimeError(str(e)) from None  # not a death to retry: it would fail again

    def _read(self, timeout_s: float, what: str, call_id: int) -> dict:
        """The reply to `call_id`; TimeoutError (worker killed) after `timeout_s`; `_Died` when the
        worker exited or sent anything else (then it is killed)."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            raise TimeoutError(f"{what} exceeded {timeout_s} s; worker killed") from None
        if line is None:
            code = self._proc.wait()
            self._proc = None
            raise _Died(f"worker process exited ({_exit_text(code)}) during {what}")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or reply.get("id") != call_id:
            self._kill()
            raise _Died(f"worker sent {line.strip()[:100]!r} during {what}, not the reply to call {call_id}; "
                        "worker killed")
        return reply

    def call(self, fn: str, *args, timeout_s: float):
        """fn(*args) in the worker ('module:function'); TimeoutError after `timeout_s`, WorkerError
        if fn raised, WorkerDied if the worker died `MAX_DEATHS` times in a row."""
        with self._lock:
            while True:
                if self._proc is None:
                    self._start()
                self._call_id += 1
                request = json.dumps({"id": self._call_id, "fn": fn, "args": list(args)}) + "\n"
                try:
                    if self._proc.poll() is not None:
                        raise _Died(f"worker process had exited ({_exit_text(self._proc.returncode)}) before {fn}")
                    try:
                        self._proc.stdin.write(request)
                        self._proc.stdin.flush()
                    except BrokenPipeError:
                        code = self._proc.wait()
                        raise _Died(f"worker process exited ({_exit_text(code)}) before {fn}") from None
                    reply = self._read(timeout_s, fn, self._call_id)
                except _Died as e:
                    self._kill()
                    self._deaths += 1
                    if self._deaths < MAX_DEATHS:
                        continue  # a new worker, the same call
                    self._deaths = 0
                    raise WorkerDied(f"worker process died {MAX_DEATHS} times in a row; last: {e}") from None
                self._deaths = 0
                break
        if "error" in reply:
            raise WorkerError(reply["error"])
        return reply["result"]

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            try:
                proc.stdin.close()
            except OSError:  # a request still buffered for the dead process
                pass

    def close(self) -> None:
        with self._lock:
            self._kill()
