"""Continuous batching for one worker: slots, per-slot KV buffers, prefill once per group.

This is the scheduler every built-in engine runs (in-process `LocalEngine`, and one per Ray
actor in `RayEngine`). Up to `max_num_seqs` samples decode together, one token each per
step; when a sample finishes (eos, stop string or max_tokens) its slot takes the next
waiting sample at the next step (the paper's Figure 1b).

KV cache: `SlotCache` owns one preallocated buffer per layer, K_SxHxLxD (S slots, H kv heads,
L capacity, D head dim), and is a transformers `Cache` whose `update` writes each row's new
key/value at that row's own position. The model gets explicit `position_ids` and a 4D
additive mask (row r sees keys 0..length_r), so any HF causal LM whose attention calls
`cache.update(k, v, layer_idx)` works unchanged: no forked model code.

Prefill: a request's prompt runs once (batch 1, no padding); its KV is copied into each of
its n slots, and its last logits give every sample's first token (like vLLM with n > 1).

LoRA (model.lora.enabled): the model is the peft model `lora.apply_lora(base)` and runs as the
trainer's PeftModel does, the adapter unmerged (base(x) + scale * B(A(x)) in every adapted
linear: the same arithmetic as the trainer, so float64 log-probs agree bitwise; merging B A into
the base weights would round differently and need the base kept to unmerge at the next push).
`update_weights` then takes the adapter alone (`lora.load_adapter`).

Reproducibility: sample k of a request draws its uniforms from its own Philox generator
seeded from (seed, k), and one uniform per token picks the token by inverse CDF, so the
draws do not depend on the batch. The arithmetic is made batch-invariant where the CPU
kernels allow it: prefill runs alone; decode always feeds at least `MIN_ROWS` rows (MKL's
GEMM takes a different path for 1-3 rows) and pads the key length to a multiple of
`KV_ALIGN` (the SDPA kernel's vector width). With one torch thread (Ray workers' default)
this made a request's tokens and log-probs bitwise identical alone, in a crowd, in any slot
and on any worker on our AVX-512 CPU (tests/test_engine.py checks it). With several threads
the GEMM splits work by batch size and results can differ in the last bits; scheduling is
still deterministic (dispatch at submit time, FIFO admission, lock-step decoding), so the
same inputs give identical tokens run after run.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache

from periodic_async.engine.base import EngineError, Request, RequestOutput, Sample, load_weights
from periodic_async.lora import adapter_spec, is_lora

MIN_ROWS = 4
"""Decode at least this many rows (dummies fill the rest): keeps GEMMs on one kernel path."""
KV_ALIGN = 16
"""Key length is padded to a multiple of this (masked): keeps SDPA reductions on one path."""


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class _CaptureCache(Cache):
    """Prefill: records each layer's prompt keys/values and returns them unchanged."""

    def __init__(self):
        super().__init__(layers=[])
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv[layer_idx] = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class SlotCache(Cache):
    """Per-slot KV buffers. Before a decode step `set_step` says which rows run (0..R-1), where
    each writes its new key/value, and how many keys (a prefix of the buffer) attention reads."""

    def __init__(self, rows: int):
        super().__init__(layers=[])
        self.rows = rows
        self.keys: list[torch.Tensor] = []  # per layer: S x H x L x D
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self._num_rows = 0
        self._row_idx: torch.Tensor | None = None
        self._write_pos: torch.Tensor | None = None
        self._kv_len = 0

    def ensure(self, prompt_kv: dict[int, tuple[torch.Tensor, torch.Tensor]], capacity: int) -> None:
        """Allocate (shapes from a prefill) or grow the buffers to hold `capacity` positions."""
        capacity = _round_up(capacity, KV_ALIGN)
        if self.keys and capacity <= self.capacity:
            return
        capacity = max(capacity, 2 * self.capacity)
        grow = bool(self.keys)
        for i in range(len(prompt_kv)):
            k, v = prompt_kv[i]
            new_k = k.new_zeros((self.rows, k.shape[1], capacity, k.shape[3]))
            new_v = v.new_zeros((self.rows, v.shape[1], capacity, v.shape[3]))
            if grow:
                new_k[:, :, : self.capacity] = self.keys[i]
                new_v[:, :, : self.capacity] = self.values[i]
                self.keys[i], self.values[i] = new_k, new_v
            else:
                self.keys.append(new_k)
                self.values.append(new_v)
        self.capacity = capacity

    def load_prompt(self, row: int, prompt_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy a prefilled prompt's keys/values into slot `row` (positions 0..P-1)."""
        for i, (k, v) in prompt_kv.items():
            p = k.shape[2]
            self.keys[i][row, :, :p] = k[0]
            self.values[i][row, :, :p] = v[0]

    def set_step(self, num_rows: int, write_pos: torch.Tensor, kv_len: int) -> None:
        self._num_rows = num_rows
        self._row_idx = torch.arange(num_rows, device=write_pos.device)
        self._write_pos = write_pos
        self._kv_len = kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: R x H x 1 x D, row r written at position write_pos[r].
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[self._row_idx, :, self._write_pos] = key_states[:, :, 0]
        v[self._row_idx, :, self._write_pos] = value_states[:, :, 0]
        return k[: self._num_rows, :, : self._kv_len], v[: self._num_rows, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len


def sample_next(logits_BxV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor,
                top_k_B: torch.Tensor, u_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour log-prob, log_softmax(logits / T)[token].

    Row b is greedy (argmax) when temperature_B[b] == 0; otherwise tokens are sorted by
    probability (stable), cut by top-k then top-p (a kept prefix), and the token is the first
    whose cumulative probability exceeds u_B[b] * kept mass (inverse CDF, u in [0, 1)).
    Everything is row-wise, so a row's result does not depend on the other rows.

    The behaviour log-prob is that of the *tempered, un-truncated* distribution
    softmax(logits / T) (T = 1 for greedy rows), the distribution the trainer scores
    (`shared_prompt.token_logprobs(..., temperature=T)`), as verl and TRL do. Why not the
    truncated one we actually draw from: the policy being trained is the full tempered
    softmax; top-k / top-p renormalise over a kept set that itself depends on the weights,
    so a ratio, gradient or KL on the truncated distribution would refer to a support that
    moves with every update (and is not differentiable in where it cuts). The sampled token
    is always inside the kept set, so its tempered log-prob is finite. The price: with
    top_p < 1 or top_k > 0 the samples come from a slightly narrower distribution than the
    one trained (usual practice, and why RL runs tend to keep top_p = 1, top_k = 0).
    """
    logits_BxV = logits_BxV.float()
    tokens_B = logits_BxV.argmax(dim=-1)
    sampled = temperature_B > 0
    scaled = logits_BxV / torch.where(sampled, temperature_B, 1.0)[:, None]
    logp_BxV = torch.log_softmax(scaled, dim=-1)
    if bool(sampled.any()):
        V = logits_BxV.shape[-1]
        sorted_BxV, order_BxV = torch.sort(scaled, dim=-1, descending=True, stable=True)
        rank_V = torch.arange(V, device=logits_BxV.device)
        keep = (top_k_B[:, None] == 0) | (rank_V[None, :] < top_k_B[:, None])
        probs = torch.softmax(sorted_BxV.masked_fill(~keep, float("-inf")), dim=-1).double()
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        keep &= before < top_p_B[:, None].double()
        probs = probs * keep
        cdf = probs.cumsum(dim=-1)
        target = (u_B.double() * cdf[:, -1])[:, None]
        pick = torch.searchsorted(cdf, target, right=True)[:, 0]
        pick = torch.minimum(pick, keep.sum(dim=-1) - 1)
        drawn = order_BxV.gather(1, pick[:, None])[:, 0]
        tokens_B = torch.where(sampled, drawn, tokens_B)
    return tokens_B, logp_BxV.gather(1, tokens_B[:, None])[:, 0]


def sample_rng(seed: int, k: int) -> np.random.Generator:
    """The generator of sample k of a request with `seed` (independent of worker and slot)."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, k])))


@dataclass
class _Group:
    """A request in flight: its prompt KV until every sample has a slot, and finished samples."""
    request: Request
    samples: list = field(default_factory=list)
    events: list = field(default_factory=list)
    admitted: int = 0
    done: int = 0
    prompt_kv: dict | None = None
    prompt_logits: torch.Tensor | None = None


@dataclass
class _Seq:
    """One sample occupying a slot."""
    group: _Group
    k: int
    rng: np.random.Generator
    length: int  # tokens whose KV is in the cache
    pending: int  # last sampled token, fed at the next step
    tokens: list[int]
    logprobs: list[float]
    event: dict


class ContinuousBatcher:
    """One worker's scheduler: `submit` requests (FIFO), call `step` until `has_work` is False."""

    def __init__(self, model, tokenizer, max_num_seqs: int, worker: int = 0, version: int = 0):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.worker = worker
        self.version = version
        self.max_num_seqs = max_num_seqs
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        rows = max(max_num_seqs, MIN_ROWS)
        self.cache = SlotCache(rows)
        self.slots: list[_Seq | None] = [None] * max_num_seqs
        self.waiting: deque[tuple[_Group, int]] = deque()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_ids = set(eos) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        # a peft model (model.lora.enabled) runs as the trainer's does, adapters unmerged; its
        # forward hands the cache and logits_to_keep on to the model inside (whose signature counts)
        inner = model.get_base_model() if is_lora(model) else model
        fwd = inspect.signature(inner.forward).parameters
        self._cache_kw = "cache" if "cache" in fwd else "past_key_values"
        self._keep_kw = "logits_to_keep" in fwd
        self._adapter = adapter_spec(model) if is_lora(model) else None  # what every push must be (LoRA)
        self.steps = 0

    # --- public -----------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def submit(self, requests: list[Request]) -> None:
        for r in requests:
            g = _Group(r, samples=[None] * r.n, events=[None] * r.n)
            self.waiting.extend((g, k) for k in range(r.n))

    def step(self) -> list[RequestOutput]:
        """Admit waiting samples into free slots, then decode one token for every active slot."""
        done: list[RequestOutput] = []
        with torch.inference_mode():
            self._admit(done)
            if any(s is not None for s in self.slots):
                self._decode(done)
        self.steps += 1
        return done

    def run(self, requests: list[Request]):
        """Generator: submit and step until done, yielding requests as they complete."""
        self.submit(requests)
        while self.has_work:
            yield from self.step()

    def reset(self) -> None:
        """Drop all queued and running work (an abandoned generate)."""
        self.waiting.clear()
        self.slots = [None] * self.max_num_seqs

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self.has_work:  # a real check: python -O keeps it
            raise RuntimeError("update_weights while requests are in flight would mix versions")
        load_weights(self.model, state_dict, self._adapter)
        self.version = version

    def probe_logprobs(self, token_ids: list[int]) -> np.ndarray:
        """The model's float64 log-probs of token_ids[1:] (engine/verify.py), as `VLLMBatcher`'s."""
        from periodic_async.engine.verify import model_logprobs

        return model_logprobs(self.model, token_ids)

    # --- scheduling ---------------------------------------------------------------------
    def _admit(self, done: list[RequestOutput]) -> None:
        row = 0
        while self.waiting:
            while row < self.max_num_seqs and self.slots[row] is not None:
                row += 1
            if row == self.max_num_seqs:
                return
            g, k = self.waiting.popleft()
            admitted = time.time()
            if g.prompt_kv is None:
                self._prefill(g)
            self.cache.load_prompt(row, g.prompt_kv)
            g.admitted += 1
            logits = g.prompt_logits
            if g.admitted == g.request.n:
                g.prompt_kv = g.prompt_logits = None  # every sample has its copy
            p = g.request.params
            rng = sample_rng(g.request.seed, k)
            tok, lp = sample_next(logits, torch.tensor([p.temperature], device=self.device),
                                  torch.tensor([p.top_p], device=self.device),
                                  torch.tensor([p.top_k], device=self.device),
                                  torch.tensor([rng.random()], dtype=torch.float64, device=self.device))
            event = dict(slot=row, admitted=admitted, first_token=time.time(), finished=None, worker=self.worker)
            seq = _Seq(g, k, rng, len(g.request.prompt_ids), int(tok), [int(tok)], [float(lp)], event)
            if not self._maybe_finish(seq, done):
                self.slots[row] = seq

    def _prefill(self, g: _Group) -> None:
        r = g.request
        try:
            ids = torch.tensor([r.prompt_ids], device=self.device)
            P = ids.shape[1]
            causal = torch.full((P, P), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device).triu(1)
            capture = _CaptureCache()
            kwargs = {self._cache_kw: capture}
            if self._keep_kw:
                kwargs["logits_to_keep"] = 1
            out = self.model(input_ids=ids, position_ids=torch.arange(P, device=self.device)[None],
                             attention_mask=causal[None, None], use_cache=True, **kwargs)
        except Exception as e:  # bad token ids, out of memory, ...
            raise EngineError(f"prefill: {type(e).__name__}: {e}", self.worker, [r.request_id]) from e
        g.prompt_kv = {i: (k.clone(), v.clone()) for i, (k, v) in capture.kv.items()}
        g.prompt_logits = out.logits[:, -1]
        self.cache.ensure(g.prompt_kv, P + r.params.max_tokens)

    def _decode(self, done: list[RequestOutput]) -> None:
        hi = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        R = max(hi, min(MIN_ROWS, self.cache.rows))
        active = [(i, s) for i, s in enumerate(self.slots[:hi]) if s is not None]
        lengths = [0] * R  # dummy rows: write and read position 0 of a free row
        pending = [self.pad_id] * R
        for i, s in active:
            lengths[i], pending[i] = s.length, s.pending
        dev = self.device
        pos_R = torch.tensor(lengths, device=dev)
        kv_len = min(_round_up(max(lengths) + 1, KV_ALIGN), self.cache.capacity)
        visible = torch.arange(kv_len, device=dev)[None, :] <= pos_R[:, None]
        mask = torch.zeros((R, 1, 1, kv_len), dtype=self.dtype, device=dev)
        mask.masked_fill_(~visible[:, None, None, :], torch.finfo(self.dtype).min)
        self.cache.set_step(R, pos_R, kv_len)
        try:
            out = self.model(input_ids=torch.tensor(pending, device=dev)[:, None], position_ids=pos_R[:, None],
                             attention_mask=mask, use_cache=True, **{self._cache_kw: self.cache})
            rows = torch.tensor([i for i, _ in active], device=dev)
            params = [s.group.request.params for _, s in active]
            tokens, logprobs = sample_next(
                out.logits[rows, -1],
                torch.tensor([p.temperature for p in params], device=dev),
                torch.tensor([p.top_p for p in params], device=dev),
                torch.tensor([p.top_k for p in params], device=dev),
                torch.tensor([s.rng.random() for _, s in active], dtype=torch.float64, device=dev))
        except Exception as e:
            ids = [s.group.request.request_id for _, s in active]
            raise EngineError(f"decode: {type(e).__name__}: {e}", self.worker, ids) from e
        for (i, s), tok, lp in zip(active, tokens.tolist(), logprobs.tolist()):
            s.length += 1
            s.pending = tok
            s.tokens.append(tok)
            s.logprobs.append(lp)
            if self._maybe_finish(s, done):
                self.slots[i] = None

    def _maybe_finish(self, s: _Seq, done: list[RequestOutput]) -> bool:
        p = s.group.request.params
        text = None
        if s.tokens[-1] in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif p.stop and (cut := self._stop_cut(s.tokens, p.stop)) is not None:
            reason, text = "stop", cut
        elif len(s.tokens) >= p.max_tokens:
            reason = "length"
        else:
            return False
        if text is None:
            text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
        s.event["finished"] = time.time()
        g = s.group
        g.samples[s.k] = Sample(s.tokens, s.logprobs, text, reason)
        g.events[s.k] = s.event
        g.done += 1
        if g.done == g.request.n:
            done.append(RequestOutput(g.request.request_id, g.samples, self.version, self.worker, g.events))
        return True

    def _stop_cut(self, tokens: list[int], stops: list[str]) -> str | None:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s and s in text]
        return text[: min(hits)] if hits else None
