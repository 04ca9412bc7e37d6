"""vLLM adapter (extra `[vllm]`): one `vllm.LLM` behind the continuous batcher's interface
(`VLLMBatcher`: submit / has_work / step / reset / update_weights), used in two places: in the
trainer's process (`VLLMEngine`, `engine.backend=vllm`) and inside each Ray worker on its own
GPU share (`engine.backend=ray engine.worker_backend=vllm`, ray_engine.py), where it gets the
weights through the same `WeightSync` handles and streams through the same actor code.

NOT EXERCISED ON CPU CI: vLLM ships CUDA wheels only and cannot be installed on the CPU
machines this project is tested on; tests/test_engine.py skips its vLLM tests when the import
fails (on CPU only a Ray worker's start-up failure without vLLM is tested). The code follows
vLLM's V1 offline API (0.8 - 0.17) and the weight-loading path that verl and TRL use; check
it on a GPU before relying on it.

- Streaming: requests go to `llm.llm_engine.add_request` (one per group, `n` samples,
  `output_kind=FINAL_ONLY`) and `llm.llm_engine.step()` runs vLLM's own continuous
  batching; a group is returned by `step` (and yielded) as soon as vLLM reports it finished.
- Behaviour log-probs: `logprobs=0` returns the sampled token's log-prob. vLLM's default
  `logprobs_mode="raw_logprobs"` is log_softmax of the raw logits (temperature 1); we start
  vLLM with `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2), the log_softmax after
  temperature, which is what the trainer scores (base.py). vLLM computes it after top-k /
  top-p as well, i.e. renormalised over the kept tokens: with top_p < 1 or top_k > 0 its
  value exceeds ours by -log(kept mass), and the trainer's `behaviour_logp_gap` shows that
  difference (warned once); with top_p = 1 and top_k = 0 (RL's usual setting) they agree.
- Weights: `model.load_weights(iter((name, tensor)))` on the model inside the engine (HF
  names), then `reset_prefix_cache()` so no KV computed with old weights is reused. The
  engine core must live in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here).
- Reproducibility: vLLM takes one seed per request (ours); its samples are not drawn from
  our per-(seed, k) generators and its batches are not batch-invariant unless vLLM's own
  batch-invariant mode is enabled. Events carry times seen where vLLM runs, and slot -1.
- In-process: one `vllm.LLM` per engine; `num_workers` must be 1. In Ray workers: one per
  worker, on at most one GPU (`engine.gpus_per_worker` <= 1; a fraction shares the GPU and
  scales vLLM's `gpu_memory_utilization`, 0.9 x the share).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import torch

from periodic_async.engine.base import Engine, EngineError, Request, RequestOutput, Sample

logger = logging.getLogger(__name__)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(f"the vllm engine needs the package 'vllm' (GPU only; pip install "
                          f"'periodic-async[vllm]'), which is not importable here: {e}") from e
    return vllm


def warn_truncated_logprobs(engine_cfg) -> None:
    if engine_cfg.top_p < 1 or engine_cfg.top_k > 0:
        logger.warning("vLLM's processed log-probs are renormalised over the top-p/top-k set "
                       "(engine.top_p=%s, engine.top_k=%s): behaviour log-probs exceed the trainer's "
                       "tempered, un-truncated ones by -log(kept mass)", engine_cfg.top_p, engine_cfg.top_k)


class VLLMBatcher:
    """One `vllm.LLM` with `ContinuousBatcher`'s interface: `submit` requests, call `step` while
    `has_work`; `step` returns the groups vLLM finished, tagged with `version` and `worker`."""

    def __init__(self, model_cfg, max_num_seqs: int, worker: int = 0, version: int = 0, **llm_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # model reachable in-process
        vllm = _import_vllm()
        if not os.path.isdir(model_cfg.name_or_path):
            raise ValueError("the vllm engine loads a local HF model directory, not a preset: "
                             f"model.name_or_path={model_cfg.name_or_path!r}")
        self._vllm = vllm
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")  # tempered, like the trainer
        self.llm = vllm.LLM(model=model_cfg.name_or_path, dtype=model_cfg.dtype, seed=model_cfg.seed,
                            max_num_seqs=max_num_seqs, enable_prefix_caching=True, **llm_kwargs)
        self.worker, self.version = worker, version
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self._pending: dict[str, float] = {}  # request id -> submit time, until vLLM finishes it

    @property
    def has_work(self) -> bool:
        return bool(self._pending)

    def submit(self, requests: list[Request]) -> None:
        for r in requests:
            self.llm.llm_engine.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_ids)}, self._params(r))
            self._pending[r.request_id] = time.time()

    def step(self) -> list[RequestOutput]:
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished and out.request_id in self._pending:
                done.append(self._convert(out, self._pending.pop(out.request_id)))
        return done

    def reset(self) -> None:
        """Abort what is still running (an abandoned or failed generate)."""
        if self._pending:
            self.llm.llm_engine.abort_request(sorted(self._pending))
            self._pending.clear()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self.has_work:  # a real check: python -O keeps it
            raise RuntimeError("update_weights while requests are in flight would mix versions")
        self.model.load_weights(weights=((n, w) for n, w in state_dict.items()))
        self.llm.reset_prefix_cache()  # cached prompt KV belongs to the old weights
        self.version = version

    @property
    def model(self):
        """The model inside vLLM (HF names in `load_weights`)."""
        engine = self.llm.llm_engine
        paths = (lambda: engine.model_executor.driver_worker.worker.model_runner.model,
                 lambda: engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model,
                 lambda: engine.model_executor.driver_worker.model_runner.model)
        for path in paths:
            try:
                return path()
            except AttributeError:
                continue
        raise EngineError("cannot reach the model inside vLLM (is VLLM_ENABLE_V1_MULTIPROCESSING=0?)", self.worker)

    def _params(self, r: Request):
        from vllm.sampling_params import RequestOutputKind

        p = r.params
        return self._vllm.SamplingParams(
            n=r.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=p.max_tokens, stop=list(p.stop) or None, ignore_eos=p.ignore_eos, seed=r.seed,
            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)

    def _convert(self, out, submitted: float) -> RequestOutput:
        now = time.time()
        samples, events = [], []
        for c in sorted(out.outputs, key=lambda c: c.index):
            lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs or [])]
            samples.append(Sample(list(c.token_ids), lps, c.text, "stop" if c.finish_reason == "stop" else "length"))
            events.append(dict(slot=-1, admitted=submitted, first_token=None, finished=now, worker=self.worker))
        return RequestOutput(out.request_id, samples, self.version, self.worker, events)


class VLLMEngine(Engine):
    def __init__(self, engine_cfg, model_cfg, **llm_kwargs):
        if engine_cfg.num_workers != 1:
            raise ValueError("engine.num_workers must be 1 for the vllm backend (one LLM per engine)")
        warn_truncated_logprobs(engine_cfg)
        self.batcher = VLLMBatcher(model_cfg, engine_cfg.max_num_seqs, **llm_kwargs)
        self._active = False

    @property
    def llm(self):
        return self.batcher.llm

    @property
    def version(self) -> int:
        return self.batcher.version

    def generate(self, requests: list[Request]) -> Iterator[RequestOutput]:
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("one generate() at a time")
        self._active = True
        try:
            self.batcher.submit(requests)
            while self.batcher.has_work:
                yield from self.batcher.step()
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"vLLM: {type(e).__name__}: {e}", 0, [r.request_id for r in requests]) from e
        finally:
            self.batcher.reset()  # abandoned or failed: free vLLM's slots
            self._active = False

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("update_weights during generate() would mix versions")
        t = time.perf_counter()
        self.batcher.update_weights(state_dict, version)
        return time.perf_counter() - t

    def close(self) -> None:
        self.batcher = None
