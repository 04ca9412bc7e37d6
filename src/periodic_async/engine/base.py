"""The engine contract: requests in, completed groups out, versioned weights.

A `Request` is one prompt asking for `n` samples (a GRPO group). An `Engine` streams back
one `RequestOutput` per request as soon as its n samples are done, in completion order
(the paper's producer), tagged with the weights `version` that sampled every token. The trainer
pushes new weights with `update_weights` at the iteration barrier, never while a
`generate` iterator is open, so no request ever mixes versions. A `Feed` adds requests to a
running `generate` (dynamic sampling's extra draws join the call as soon as they are drawn, in
the slots that free up, instead of waiting for its last output).

Behaviour log-probs: `Sample.logprobs[i]` is log_softmax(logits / T)[token_i], the log-prob
of the sampled token under the tempered distribution (T = the request's temperature, 1 for
greedy), before top-k / top-p truncation. That is the distribution the trainer scores
(`shared_prompt.token_logprobs(..., temperature=T)`), so the two can be compared, and an
off-policy trainer can use them as its old log-probs. Why un-truncated: see
`batcher.sample_next`.
"""

from __future__ import annotations

import copy
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import numpy as np
import torch

from periodic_async.config import Sampling
from periodic_async.lora import is_lora, load_adapter


class EngineError(RuntimeError):
    """A worker died, raised, or went silent; names the worker and the request ids it held."""

    def __init__(self, message: str, worker: int | None = None, request_ids: list[str] | None = None):
        self.message = message
        self.worker = worker
        self.request_ids = list(request_ids or [])
        where = f"worker {worker}" if worker is not None else "engine"
        ids = ", ".join(self.request_ids[:8]) + (" ..." if len(self.request_ids) > 8 else "")
        super().__init__(f"{where} failed (requests: {ids or 'none'}): {message}")

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return (EngineError, (self.message, self.worker, self.request_ids))


@dataclass
class SamplingParams(Sampling):
    """How one request is sampled: `config.Sampling`'s fields (engine.max_tokens, temperature,
    top_p, top_k, stop), max_tokens required here, and `ignore_eos`. A bad value is a ConfigError
    (a ValueError) naming SamplingParams.<field>."""

    max_tokens: int
    ignore_eos: bool = False
    """Keep generating past eos (benchmarks: make every sample exactly max_tokens long)."""

    def __post_init__(self) -> None:
        self.check_sampling("SamplingParams")

    @classmethod
    def of(cls, sampling: Sampling) -> "SamplingParams":
        """The params of `sampling`'s fields (the run's `engine` section), each copied."""
        return cls(**{f.name: copy.copy(getattr(sampling, f.name)) for f in fields(Sampling)})


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    """P prompt tokens."""
    n: int
    """G samples of this prompt."""
    params: SamplingParams
    seed: int
    """Sample k draws from its own generator seeded from (seed, k)."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.n < 1:
            raise ValueError(f"request {self.request_id}: n={self.n} must be >= 1")
        if self.seed < 0:
            raise ValueError(f"request {self.request_id}: seed={self.seed} must be >= 0")


@dataclass
class Sample:
    token_ids: list[int]
    """R response tokens; include the eos token when the sample stopped on it."""
    logprobs: list[float]
    """R behaviour log-probs, log_softmax(logits / T) (see the module docstring)."""
    text: str
    """Decoded response (special tokens skipped, cut before a stop string)."""
    finish_reason: str
    """'stop' (eos or stop string) or 'length' (max_tokens)."""


@dataclass
class RequestOutput:
    request_id: str
    samples: list[Sample]
    """n samples, in sample order k = 0..n-1."""
    version: int
    """Weights version that generated every token of every sample."""
    worker: int
    """Index of the worker that served the request."""
    events: list[dict]
    """One dict per sample: slot, admitted, first_token, finished (time.time() stamps), worker."""


class Engine(ABC):
    """Continuous-batching inference behind one interface (local, Ray, vLLM)."""

    _active = False
    """True while a generate() iterator is open (`_generating`); the barrier's calls refuse to run then."""

    def _idle(self, message: str) -> None:
        """Raise RuntimeError(message) while a generate() iterator is open: a push, probe or resize
        then would mix versions in one iteration (a real check: python -O keeps it)."""
        if self._active:
            raise RuntimeError(message)

    @contextmanager
    def _generating(self) -> Iterator[None]:
        """Hold the engine busy for one generate() iterator, until it ends, fails or is closed."""
        self._idle("one generate() at a time")
        self._active = True
        try:
            yield
        finally:
            self._active = False

    @abstractmethod
    def generate(self, requests: list[Request], feed: "Feed | None" = None) -> Iterator[RequestOutput]:
        """Yield each request once its n samples are done, in completion order. The work is
        dispatched when iteration starts; closing the iterator early cancels what is left. With a
        `feed`, what is put on it is dispatched at the next step (the same version: no push can
        happen while the call is open), and the call ends when the feed is closed and every request
        is done; with nothing to generate and the feed open it calls `feed.idle()`."""

    @abstractmethod
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Load `state_dict` on every worker and set `version`; returns the seconds it took. An
        engine built with model.lora.enabled takes the adapter alone (`lora.load_adapter`)."""

    @property
    @abstractmethod
    def version(self) -> int:
        """Version of the weights every worker holds."""

    @abstractmethod
    def close(self) -> None:
        """Stop the workers and free their resources."""

    def stats(self) -> dict[str, float]:
        """Counters logged with each iteration's metrics (e.g. workers, restarts); none by default."""
        return {}

    def info(self) -> list[dict]:
        """What each worker reports about itself (pid, version, threads, device, cores, node); none by default."""
        return []

    def probe_logprobs(self, token_ids: list[int]) -> "dict[int, np.ndarray] | None":
        """{worker: the L-1 log-probs log_softmax(logits)[i, token_ids[i+1]] (temperature 1) of the
        weights it holds}, for the after-push check (engine/verify.py); between generate() calls
        only. None: this engine cannot be probed."""
        return None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Feed:
    """Requests added to a running `generate` call: `put` them at any time (from any thread),
    `close` once nothing more will come; the call ends when the feed is closed and its last request
    is done. An engine with nothing left to generate calls `idle()`: a waiting feed
    (`wait=True`: episodes, whose next turns wait on environments) blocks until a request comes or
    it is closed; otherwise the feed's owner iterates the call itself (the producer), so an open
    feed with nothing to generate can never be fed again: an error, not a hang."""

    def __init__(self, wait: bool = False) -> None:
        self.wait = wait
        self._cond = threading.Condition()
        self._requests: list[Request] = []
        self.closed = False

    def put(self, requests: list[Request]) -> None:
        with self._cond:
            if self.closed:
                raise RuntimeError("Feed.put after close()")
            self._requests.extend(requests)
            self._cond.notify_all()

    def take(self) -> list[Request]:
        """The requests put since the last take."""
        with self._cond:
            out, self._requests = self._requests, []
            return out

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def drained(self) -> bool:
        """Closed, and every request put was taken: the call may end once its requests are done."""
        with self._cond:
            return self.closed and not self._requests

    def idle(self) -> None:
        """The engine has nothing to generate and the feed is open: wait for a request or the close
        (a waiting feed), or raise."""
        with self._cond:
            if not self.wait and not self._requests and not self.closed:
                raise RuntimeError("generate(): the feed is still open and nothing is left to generate "
                                   "(close the feed once no more requests will come)")
            while not self._requests and not self.closed:
                self._cond.wait()


def request_load(r: Request) -> int:
    """A request's cost in dispatch: its samples times their token budget."""
    return r.n * r.params.max_tokens


def assign_workers(requests: list[Request], num_workers: int, load: list[int] | None = None) -> list[int]:
    """Deterministic dispatch at submit time: each request, in order, goes to the least-loaded
    worker (load = sum of n * max_tokens already assigned, starting from `load`, which it updates;
    ties go to the lowest index)."""
    load = [0] * num_workers if load is None else load
    out = []
    for r in requests:
        w = min(range(num_workers), key=lambda i: (load[i], i))
        load[w] += request_load(r)
        out.append(w)
    return out


# --- weights ----------------------------------------------------------------------------

def state_to_numpy(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """CPU numpy copies (name -> (array, torch dtype name)). numpy, not torch tensors, because
    Ray's object store hands numpy arrays to readers zero-copy (a torch tensor is unpickled, a
    copy each time). bf16/fp16 travel as int16 bit patterns (numpy has no bfloat16)."""
    out = {}
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        out[name] = (t.numpy(), dtype)
    return out


def numpy_to_state(arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    """Inverse of `state_to_numpy`; the tensors share memory with (read-only) arrays."""
    import warnings

    out = {}
    with warnings.catch_warnings():  # read-only object-store buffers: we only read them
        warnings.simplefilter("ignore", UserWarning)
        for name, (arr, dtype) in arrays.items():
            t = torch.from_numpy(arr)
            if dtype in ("bfloat16", "float16"):
                t = t.view(getattr(torch, dtype))
            out[name] = t
    return out


@torch.no_grad()
def load_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                 spec: dict[str, tuple[int, ...]] | None = None) -> None:
    """Copy `state_dict` into `model` in place (same names as `model.state_dict()`).
    Unknown names raise; every parameter must be covered (a tied weight once is enough).
    A peft model (model.lora.enabled) takes its adapter alone (`lora.load_adapter`, `spec` its shapes)."""
    if is_lora(model):
        return load_adapter(model, state_dict, spec)
    own = model.state_dict(keep_vars=True)
    unknown = sorted(set(state_dict) - set(own))
    if unknown:
        raise KeyError(f"update_weights: names not in the model: {unknown[:5]}")
    covered = set()
    for name, value in state_dict.items():
        target = own[name]
        if target.shape != value.shape:
            raise ValueError(f"update_weights: {name} has shape {tuple(value.shape)}, "
                             f"model expects {tuple(target.shape)}")
        target.data.copy_(value)
        covered.add(id(target))
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise KeyError(f"update_weights: parameters missing from the state dict: {missing[:5]}")


class WeightSync(ABC):
    """How new weights travel from the trainer to the workers at the barrier.

    `publish` runs once on the trainer side and returns a handle that is sent to every worker;
    `receive` runs on each worker and returns the tensors to load. Two implementations
    (`engine.weight_sync`): `ObjectStoreSync` (ray_engine.py; the handle is a Ray object-store
    reference) and `CollectiveSync` (collective.py; `publish` starts broadcasts from the
    trainer's rank in a process group shared with the workers, the handle is the metadata:
    names, shapes, dtypes, offsets; `receive` posts the matching broadcasts into kept buffers).
    """

    resizable = True
    """Workers may join after `attach` (restarted or added ones); a collective group cannot."""

    def attach(self, workers: list) -> None:
        """Trainer side, once the engine's workers (Ray actor handles) have started; nothing by default."""

    def close(self) -> None:
        """Trainer side: release what the sync holds; nothing by default."""

    @abstractmethod
    def publish(self, state_dict: dict[str, torch.Tensor], version: int):
        """Trainer side: make the weights available; returns a handle for `receive`."""

    @abstractmethod
    def receive(self, handle) -> dict[str, torch.Tensor]:
        """Worker side: the state dict behind `handle`."""
