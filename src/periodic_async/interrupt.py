"""Stopping on SIGINT / SIGTERM the way a failure stops a run: cleanly, keeping what was trained.

`install()` (the CLI calls it, in the main thread only) turns SIGINT and SIGTERM
into `Interrupted`, a KeyboardInterrupt raised in the main thread. `pipeline.run`'s failure
path then runs as for any exception: it saves the checkpoint of the last completed iteration,
stops the producer thread, closes the engines (Ray is shut down when the run started it), the
W&B run and the progress bar. The CLI exits with 128 + the signal number (130 for SIGINT,
143 for SIGTERM). A further signal while stopping is ignored (SIGKILL still kills).

Inside `deferred()` a signal waits for the block to end: the optimizer step and the version
that labels it change together, and a checkpoint is not left half written by our own hand.
Without `install()` / `handle_signals()` (library use) nothing changes: Python's defaults apply.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the run; `exit_code` is the conventional 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    installed = False
    depth = 0  # nesting of deferred() blocks
    pending: int | None = None  # a signal that arrived inside deferred()
    raised = False  # Interrupted was raised: the run is stopping


def _handler(signum: int, frame) -> None:
    if _State.raised:
        print(f"[train] {signal.Signals(signum).name} ignored: already stopping (SIGKILL forces it)",
              file=sys.stderr, flush=True)
        return
    if _State.depth:
        _State.pending = _State.pending or signum
        return
    _State.raised = True
    raise Interrupted(signum)


def install() -> dict:
    """From now on SIGINT and SIGTERM raise `Interrupted` in the main thread (the CLI calls it
    once); returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("interrupt.install: signal handlers can only be installed in the main thread")
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    _State.installed, _State.pending, _State.raised = True, None, False
    return previous


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """`install()` for the duration of the block, then the previous handlers again."""
    previous = install()
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _State.installed = False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal arriving inside the block is raised (as `Interrupted`) when it ends."""
    if not _State.installed or threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only; without our handler nothing is deferred
        return
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        if _State.depth == 0 and _State.pending is not None and not _State.raised:
            signum, _State.pending, _State.raised = _State.pending, None, True
            raise Interrupted(signum)
