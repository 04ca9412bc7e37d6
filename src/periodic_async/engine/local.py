"""In-process engine (no Ray): the co-located baseline, and the reference for tests.

Same scheduler as the Ray workers (`ContinuousBatcher`), same dispatch (`assign_workers`).
With `num_workers` > 1 it keeps one model copy per worker and steps them in turn in the
calling thread: no speed-up, but the same requests land on the same workers as in
`RayEngine`, so both back-ends produce the same tokens. It uses the process's torch thread
count (the trainer shares the process), not `threads_per_worker`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import torch

from periodic_async.engine.base import (Engine, EngineError, Feed, Request, RequestOutput, assign_workers,
                                        request_load)
from periodic_async.engine.batcher import ContinuousBatcher


class LocalEngine(Engine):
    def __init__(self, model, tokenizer, max_num_seqs: int, num_workers: int = 1):
        models = [model] + [copy.deepcopy(model) for _ in range(num_workers - 1)]
        self.workers = [ContinuousBatcher(m, tokenizer, max_num_seqs, worker=w) for w, m in enumerate(models)]

    @classmethod
    def from_config(cls, engine_cfg, model_cfg) -> "LocalEngine":
        from periodic_async.model import load_policy

        model, tokenizer = load_policy(model_cfg)
        return cls(model, tokenizer, engine_cfg.max_num_seqs, engine_cfg.num_workers)

    @property
    def version(self) -> int:
        return self.workers[0].version

    def generate(self, requests: list[Request], feed: Feed | None = None) -> Iterator[RequestOutput]:
        with self._generating():
            load = [0] * len(self.workers)  # outstanding n * max_tokens per worker: where a fed request goes
            cost: dict[str, int] = {}
            try:
                self._dispatch(requests, load, cost)
                while True:
                    if feed is not None:
                        self._dispatch(feed.take(), load, cost)
                    if not any(w.has_work for w in self.workers):
                        if feed is None or feed.drained():
                            break
                        feed.idle()
                        continue
                    for w in self.workers:
                        if w.has_work:
                            for out in w.step():
                                load[out.worker] -= cost.pop(out.request_id)
                                yield out
            except EngineError:
                raise
            except Exception as e:
                raise EngineError(f"{type(e).__name__}: {e}") from e
            finally:
                for w in self.workers:  # an abandoned iterator leaves nothing behind
                    w.reset()

    def _dispatch(self, requests: list[Request], load: list[int], cost: dict[str, int]) -> None:
        for w, r in zip(assign_workers(requests, len(self.workers), load), requests):
            cost[r.request_id] = request_load(r)
            self.workers[w].submit([r])

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        self._idle("update_weights during generate() would mix versions")
        t = time.perf_counter()
        for w in self.workers:
            w.update_weights(state_dict, version)
        return time.perf_counter() - t

    def probe_logprobs(self, token_ids: list[int]) -> dict:
        """Each worker model's log-probs of token_ids[1:] (engine/verify.py)."""
        return {w: b.probe_logprobs(token_ids) for w, b in enumerate(self.workers)}

    def close(self) -> None:
        self.workers = []
