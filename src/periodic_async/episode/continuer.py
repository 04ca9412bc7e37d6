"""What episodes need from an engine: "continue from these ids", awaited.

The interface (`Continuer`) is the engine's own contract, one request at a time:
`await continuer(request) -> RequestOutput`, where `request.prompt_ids` is the episode so far
(prompt, model turns, environment turns: ids), `request.n` its samples (G for a group's first
turn, 1 after) and `request.seed` the seed of its samples. The output carries the sampled ids,
their behaviour log-probs, finish reasons and the weights version, as for single-turn groups.
Every engine already takes prompts as token ids (`Request.prompt_ids`), so no engine change is
needed to continue an episode; two adapters drive the engines as they are:

- `WaveContinuer(engine)`: any `Engine` through `engine.generate`. A turn that becomes ready
  while a generate() call runs waits for it to end and goes with the next wave: environment
  latency still overlaps generation, but a short turn can wait for a long one.
- `FeedContinuer(engine)`: an engine whose generate() takes a `Feed` (built-in, vLLM, Ray):
  one generate() call from `open()` to `close()`, each request put on its waiting feed as it
  comes and admitted at the engine's next step (a Ray worker's call stays open). It holds the
  engine busy (no weight push, as during generate()) until closed.

Both run the engine in a thread of their own and resolve each request's future on the caller's
event loop; an engine error fails every request it held. The built-in engine's samples do not
depend on the batch (batcher.py), so both give the same tokens; vLLM's prefix cache makes a
turn's prefill cost only its new ids, the built-in engine prefills the whole context again.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Protocol

from periodic_async.engine.base import Engine, Feed, Request, RequestOutput


class Continuer(Protocol):
    async def __call__(self, request: Request) -> RequestOutput:
        """The engine's output for `request` (its n samples continue `request.prompt_ids`)."""


def _settle(fut: asyncio.Future, out: RequestOutput | None, error: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(out)


class _Driver:
    """A thread that serves requests queued from any event loop; subclasses say how (`_serve`)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._pending: list[tuple[Request, asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.requests = 0
        """Requests served (turns, counting a group's first turn once)."""

    def open(self) -> "_Driver":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._thread = None

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    async def __call__(self, request: Request) -> RequestOutput:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._wake:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            if self._error is not None:
                raise RuntimeError(f"{type(self).__name__} stopped on an engine error: {self._error}")
            self._pending.append((request, fut, loop))
            self.requests += 1
            self._wake.notify_all()
        self.open()
        return await fut

    def _take(self, block: bool) -> list | None:
        """The queued requests (waiting for one when `block`); None once closed."""
        with self._wake:
            while block and not self._pending and not self._closed:
                self._wake.wait()
            if self._closed and not self._pending:
                return None
            batch, self._pending = self._pending, []
            return batch

    @staticmethod
    def _resolve(waiting: dict, out: RequestOutput | None = None, error: BaseException | None = None,
                 request_id: str | None = None) -> None:
        for rid in [request_id] if request_id is not None else list(waiting):
            fut, loop = waiting.pop(rid)
            try:
                loop.call_soon_threadsafe(_settle, fut, out, error)
            except RuntimeError:  # the caller's loop has closed
                pass

    def _fail(self, waiting: dict, error: BaseException) -> None:
        """A fatal engine error: fail what is waiting and queued, and every later request."""
        with self._wake:
            self._error = error
            queued, self._pending = self._pending, []
        waiting.update({r.request_id: (fut, loop) for r, fut, loop in queued})
        self._resolve(waiting, error=error)

    def _loop(self) -> None:
        raise NotImplementedError


class WaveContinuer(_Driver):
    """Any engine, through `engine.generate` (module docstring)."""

    def _loop(self) -> None:
        while (batch := self._take(block=True)) is not None:
            waiting = {r.request_id: (fut, loop) for r, fut, loop in batch}
            try:
                for out in self.engine.generate([r for r, _, _ in batch]):
                    self._resolve(waiting, out, request_id=out.request_id)
                if waiting:
                    raise RuntimeError(f"the engine finished without requests {sorted(waiting)[:5]}")
            except BaseException as e:  # noqa: BLE001 - every waiting episode hears of it
                self._resolve(waiting, error=e)


class FeedContinuer(_Driver):
    """One generate() call fed as requests come (module docstring)."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        if "feed" not in inspect.signature(engine.generate).parameters:
            raise TypeError(f"FeedContinuer: {type(engine).__name__}.generate takes no feed; use WaveContinuer")
        self._feed = Feed(wait=True)
        self._waiting: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}

    async def __call__(self, request: Request) -> RequestOutput:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._wake:
            if self._closed:
                raise RuntimeError("FeedContinuer is closed")
            if self._error is not None:
                raise RuntimeError(f"FeedContinuer stopped on an engine error: {self._error}")
            self._waiting[request.request_id] = (fut, loop)
            self.requests += 1
        self._feed.put([request])
        self.open()
        return await fut

    def close(self) -> None:
        self._feed.close()  # the call ends once what it holds is done
        super().close()

    def _loop(self) -> None:
        try:
            for out in self.engine.generate([], self._feed):
                with self._wake:
                    entry = self._waiting.pop(out.request_id, None)
                if entry is not None:
                    self._resolve({out.request_id: entry}, out)
        except BaseException as e:  # noqa: BLE001 - every waiting episode hears of it
            with self._wake:
                self._error = e
                waiting, self._waiting = self._waiting, {}
            self._resolve(waiting, error=e)
