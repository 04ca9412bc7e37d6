"""vLLM adapter (extra `[vllm]`): the `Engine` interface over one in-process `vllm.LLM`.

NOT EXERCISED ON CPU CI: vLLM ships CUDA wheels only and cannot be installed on the CPU
machines this project is tested on; tests/test_engine.py skips its vLLM test when the import
fails. The code follows vLLM's V1 offline API (0.8 - 0.17) and the weight-loading path that
verl and TRL use; check it on a GPU before relying on it.

- Streaming: requests go to `llm.llm_engine.add_request` (one per group, `n` samples,
  `output_kind=FINAL_ONLY`) and `llm.llm_engine.step()` runs vLLM's own continuous
  batching; a group is yielded as soon as vLLM reports it finished.
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
  batch-invariant mode is enabled. Events carry times seen by the driver and slot -1.
- One `vllm.LLM` per engine (use tensor parallelism inside it); `num_workers` must be 1.
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
        raise ImportError("the 'vllm' backend needs vLLM (GPU only): pip install 'periodic-async[vllm]'") from e
    return vllm


class VLLMEngine(Engine):
    def __init__(self, engine_cfg, model_cfg, **llm_kwargs):
        if engine_cfg.num_workers != 1:
            raise ValueError("engine.num_workers must be 1 for the vllm backend (one LLM per engine)")
        if not os.path.isdir(model_cfg.name_or_path):
            raise ValueError("the vllm backend loads a local HF model directory, not a preset: "
                             f"model.name_or_path={model_cfg.name_or_path!r}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # model reachable in-process
        vllm = _import_vllm()
        self._vllm = vllm
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")  # tempered, like the trainer
        if engine_cfg.top_p < 1 or engine_cfg.top_k > 0:
            logger.warning("vLLM's processed log-probs are renormalised over the top-p/top-k set "
                           "(engine.top_p=%s, engine.top_k=%s): behaviour log-probs exceed the trainer's "
                           "tempered, un-truncated ones by -log(kept mass)", engine_cfg.top_p, engine_cfg.top_k)
        self.llm = vllm.LLM(model=model_cfg.name_or_path, dtype=model_cfg.dtype, seed=model_cfg.seed,
                            max_num_seqs=engine_cfg.max_num_seqs, enable_prefix_caching=True, **llm_kwargs)
        self._version = 0
        self._active = False

    @property
    def version(self) -> int:
        return self._version

    def _params(self, r: Request):
        from vllm.sampling_params import RequestOutputKind

        p = r.params
        return self._vllm.SamplingParams(
            n=r.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=p.max_tokens, stop=list(p.stop) or None, ignore_eos=p.ignore_eos, seed=r.seed,
            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)

    def generate(self, requests: list[Request]) -> Iterator[RequestOutput]:
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("one generate() at a time")
        self._active = True
        engine = self.llm.llm_engine
        submitted: dict[str, float] = {}
        remaining: set[str] = set()
        try:
            for r in requests:
                engine.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_ids)}, self._params(r))
                submitted[r.request_id] = time.time()
                remaining.add(r.request_id)
            while remaining:
                for out in engine.step():
                    if not out.finished or out.request_id not in remaining:
                        continue
                    remaining.discard(out.request_id)
                    yield self._convert(out, submitted[out.request_id])
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"vLLM: {type(e).__name__}: {e}", 0, sorted(submitted)) from e
        finally:
            if remaining:  # abandoned or failed: free vLLM's slots
                engine.abort_request(sorted(remaining))
            self._active = False

    def _convert(self, out, submitted: float) -> RequestOutput:
        now = time.time()
        samples, events = [], []
        for c in sorted(out.outputs, key=lambda c: c.index):
            lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs or [])]
            samples.append(Sample(list(c.token_ids), lps, c.text, "stop" if c.finish_reason == "stop" else "length"))
            events.append(dict(slot=-1, admitted=submitted, first_token=None, finished=now, worker=0))
        return RequestOutput(out.request_id, samples, self._version, 0, events)

    def _model(self):
        engine = self.llm.llm_engine
        paths = (lambda: engine.model_executor.driver_worker.worker.model_runner.model,
                 lambda: engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model,
                 lambda: engine.model_executor.driver_worker.model_runner.model)
        for path in paths:
            try:
                return path()
            except AttributeError:
                continue
        raise EngineError("cannot reach the model inside vLLM (is VLLM_ENABLE_V1_MULTIPROCESSING=0?)", 0)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        if self._active:  # a real check: python -O keeps it
            raise RuntimeError("update_weights during generate() would mix versions")
        t = time.perf_counter()
        self._model().load_weights(weights=((n, w) for n, w in state_dict.items()))
        self.llm.reset_prefix_cache()  # cached prompt KV belongs to the old weights
        self._version = version
        return time.perf_counter() - t

    def close(self) -> None:
        self.llm = None
