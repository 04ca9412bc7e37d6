"""Shared-prompt packing and attention (the paper's shared-prompt attention): one row
[prompt | r_1 | ... | r_G] per group.

Shape letters: T packed tokens, N response (label) tokens, S responses, H heads, d head size,
D hidden size, V vocabulary.

Layout guarantees of `pack`:
- prompt tokens attend causally among themselves; response i attends to the whole prompt
  and to its own earlier tokens, never to a sibling response nor to another group;
- position ids are 0..P-1 on the prompt and restart at P for every response;
- the last prompt position predicts the first token of *each* response (its hidden state
  is gathered G times before the LM head); response tokens predict their successors;
  the last token of a response predicts nothing and is not fed as input.
With `shared=False` each sample is its own segment [prompt | r_i] (per-response packing),
the ablation baseline; both layouts produce the same flat label order, so the log-probs
of the two layouts are directly comparable.

Attention back-ends (`token_logprobs(..., backend=...)`, `AlgorithmConfig.attention_backend`):
  dense  one TxT boolean mask through the model's own attention. Works with any HF causal
         LM; the reference. O(T^2) work and memory whatever the layout.
  split  exact work, no TxT mask: per segment one causal attention over the contiguous
         [prompt | r_1], then every further response against [prompt K/V ; own K/V]
         (attention.py). Registered with transformers' `AttentionInterface` as
         "shared_prompt", so the model code is untouched. On a per-response packing it is
         varlen attention (one causal call per row), which makes shared=False a fair
         baseline. Fastest on CPU (experiments/shared_prompt_ablation.sh).
  flex   FlexAttention with a BlockMask (block-sparse, compiled; CUDA). Elsewhere it falls
         back to split with a one-time warning (torch 2.13 has no FlexAttention backward on
         CPU), and on CUDA too, once, if FlexAttention fails to compile or run.
  auto   flex on CUDA, split on any other device.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Sequence, get_args

import torch
from torch.utils.checkpoint import checkpoint

from periodic_async.attention import ATTN_IMPLEMENTATION, flex_block_mask, split_plan
from periodic_async.config import AttentionBackend

logger = logging.getLogger(__name__)

Segment = tuple[Sequence[int], Sequence[Sequence[int]]]
"""(prompt ids, [response ids, ...]): one group, or part of one, to pack."""

@dataclass
class PackedBatch:
    input_ids_1xT: torch.Tensor
    """Packed input tokens."""
    position_ids_1xT: torch.Tensor
    """Position ids (restarting at P for each response in the shared layout)."""
    segment_T: torch.Tensor
    """Segment (document) id of each packed token; tokens of different segments never attend."""
    response_T: torch.Tensor
    """Response index within its segment, or -1 for prompt tokens."""
    pred_pos_N: torch.Tensor
    """Packed position whose hidden state predicts label n."""
    labels_N: torch.Tensor
    """Label token ids, in flat order: segment by segment, response by response, token by token."""
    sample_N: torch.Tensor
    """Flat sample index (0..S-1 over all responses of all segments) of each label."""
    num_samples: int
    """S: responses in the batch."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1xT.shape[1])

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in self.__dict__.items()})


def pack(segments: Sequence[Segment], shared: bool = True) -> PackedBatch:
    """Pack groups (or parts of groups) into one row; see the module docstring for the layout."""
    ids, pos, seg, resp, pred, labels, sample = [], [], [], [], [], [], []
    s_id = 0
    n_samples = 0
    for prompt, responses in segments:
        if len(prompt) == 0:
            raise ValueError("pack: empty prompt")
        P = len(prompt)
        for i, r in enumerate(responses):
            if len(r) == 0:
                raise ValueError(f"pack: empty response {i} of segment {s_id}")
            if i == 0 or not shared:
                if not shared and i > 0:
                    s_id += 1
                start = len(ids)
                ids.extend(prompt)
                pos.extend(range(P))
                seg.extend([s_id] * P)
                resp.extend([-1] * P)
                last_prompt = start + P - 1
            r_start = len(ids)
            body = list(r[:-1])  # the last token predicts nothing
            ids.extend(body)
            pos.extend(range(P, P + len(body)))
            seg.extend([s_id] * len(body))
            resp.extend([i if shared else -1] * len(body))
            pred.append(last_prompt)
            pred.extend(range(r_start, r_start + len(body)))
            labels.extend(r)
            sample.extend([n_samples] * len(r))
            n_samples += 1
        s_id += 1
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    seg_T, resp_T = as_long(seg), as_long(resp)
    return PackedBatch(
        input_ids_1xT=as_long(ids)[None], position_ids_1xT=as_long(pos)[None],
        segment_T=seg_T, response_T=resp_T,
        pred_pos_N=as_long(pred), labels_N=as_long(labels), sample_N=as_long(sample), num_samples=n_samples,
    )


def dense_mask(batch: PackedBatch) -> torch.Tensor:
    """Boolean 1x1xTxT mask (True = may attend) of the packed layout."""
    seg, resp = batch.segment_T, batch.response_T
    T = seg.shape[0]
    idx = torch.arange(T, device=seg.device)
    causal = idx[None, :] <= idx[:, None]
    same_seg = seg[None, :] == seg[:, None]
    visible = (resp[None, :] == -1) | (resp[None, :] == resp[:, None])
    return (causal & same_seg & visible)[None, None]


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def resolve_backend(backend: AttentionBackend, device: torch.device | str) -> str:
    """'auto' -> flex on CUDA, split elsewhere; flex off CUDA falls back to split (warned once)."""
    if backend not in get_args(AttentionBackend):
        raise ValueError(f"attention backend {backend!r}: expected one of {get_args(AttentionBackend)}")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        return "flex" if on_cuda else "split"
    if backend == "flex" and not on_cuda:
        _warn_once("flex", f"attention_backend='flex' needs CUDA (no FlexAttention backward on "
                           f"{torch.device(device).type} in torch {torch.__version__}): using 'split'")
        return "split"
    return backend


def use_shared_prompt_attention(model) -> bool:
    """Switch `model` to the "shared_prompt" attention function (idempotent, persistent).

    Harmless for everything else the model does: without a plan the function is SDPA.
    Returns False for a model that does not dispatch through transformers' AttentionInterface.
    """
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        previous = model.config._attn_implementation
        try:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        except (ValueError, KeyError, NotImplementedError) as err:
            logger.debug("set_attn_implementation failed: %s", err)
        if previous not in ("sdpa", None) and model.config._attn_implementation == ATTN_IMPLEMENTATION:
            _warn_once(f"prev:{previous}", f"attention {previous!r} -> {ATTN_IMPLEMENTATION!r} (SDPA outside "
                                           "shared-prompt forwards)")
    return model.config._attn_implementation == ATTN_IMPLEMENTATION


def attention_kwargs(model, batch: PackedBatch, backend: str = "auto") -> dict:
    """Keyword arguments of `model.base_model(...)` that apply back-end `backend` to `batch`."""
    return _attention_kwargs(model, batch, resolve_backend(backend, batch.input_ids_1xT.device))


def _attention_kwargs(model, batch: PackedBatch, name: str) -> dict:
    layer_types = getattr(model.config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise NotImplementedError(f"shared-prompt packing needs full attention in every layer, got {set(layer_types)}")
    if name != "dense" and not use_shared_prompt_attention(model):
        _warn_once("dense", f"{type(model).__name__} does not use transformers' AttentionInterface: "
                            f"attention_backend={name!r} falls back to 'dense'")
        name = "dense"
    if name == "dense":
        mask = dense_mask(batch)
        if model.config._attn_implementation == "eager":  # eager adds the mask to the scores
            dtype = model.get_input_embeddings().weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        return {"attention_mask": mask}
    plan = split_plan(batch.segment_T, batch.response_T)
    if name == "flex":
        plan.block_mask = flex_block_mask(batch.segment_T, batch.response_T)
    # A 4D mask makes transformers skip building its own (TxT) mask. NaN: any attention
    # function that ignored the plan and used it would poison the output, not hide the bug.
    placeholder = torch.full((1, 1, 1, 1), float("nan"), device=batch.input_ids_1xT.device)
    return {"attention_mask": placeholder, "shared_prompt_plan": plan}


def _is_fsdp(model) -> bool:
    """A model sharded with FSDP2 `fully_shard` (trainer ranks, distributed.py)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, FSDPModule)


_flex_failed = False
"""Set when FlexAttention raised once in this process: later calls go straight to split."""


def causal_lm(model):
    """The HF causal LM to drive: a peft `PeftModel` (a LoRA policy) gives the model inside it,
    whose layers carry the adapters (and obey `disable_adapter()`); any other model is itself."""
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def token_logprobs(model, batch: PackedBatch, with_entropy: bool = False, backend: str = "auto",
                   temperature: float = 1.0, logits_chunk_tokens: int = 0):
    """Per-label log-probs `logp_N` (and detached entropies `entropy_N`) of a HF causal LM,
    under the tempered distribution softmax(logits / temperature).

    `backend`: 'auto' | 'dense' | 'split' | 'flex' (see the module docstring). 'split' and
    'flex' switch the model to the "shared_prompt" attention function on first use.
    `temperature`: the engines' sampling temperature (`engine.temperature`); 0 (greedy)
    scores at 1. The trained policy is the tempered softmax, un-truncated by top-k / top-p,
    exactly what the engines report as behaviour log-probs (see `engine.batcher.sample_next`
    for why truncation is left out); the entropy is that of the same distribution.
    `logits_chunk_tokens` (`trainer.logits_chunk_tokens`): > 0 computes the LM head and the
    log-softmax that many labels at a time (`label_logprobs`); 0 all at once.
    """
    global _flex_failed
    if temperature < 0:
        raise ValueError(f"token_logprobs: temperature={temperature} must be >= 0")
    model = causal_lm(model)

    def forward(name):
        kwargs = dict(input_ids=batch.input_ids_1xT, position_ids=batch.position_ids_1xT, use_cache=False,
                      **_attention_kwargs(model, batch, name))
        if _is_fsdp(model):  # FSDP2 gathers the root's weights (embeddings, tied lm_head) in its own forward only
            if logits_chunk_tokens:
                _warn_once("chunk-fsdp", "trainer.logits_chunk_tokens: not applied under trainer.parallel=fsdp "
                                         "(the root's forward computes the logits of every label at once)")
            logits_NxV = model(**kwargs, logits_to_keep=batch.pred_pos_N).logits[0]
            return label_logprobs(torch.nn.Identity(), logits_NxV, batch.labels_N, temperature, with_entropy)
        h_NxD = model.base_model(**kwargs).last_hidden_state[0, batch.pred_pos_N]
        return label_logprobs(model.get_output_embeddings(), h_NxD, batch.labels_N, temperature, with_entropy,
                              logits_chunk_tokens)

    name = resolve_backend(backend, batch.input_ids_1xT.device)
    if name == "flex" and _flex_failed:
        name = "split"
    try:
        logp_N, entropy_N = forward(name)
    except Exception as err:  # FlexAttention compiles: a compiler failure must not stop training
        if name != "flex":
            raise
        _flex_failed = True
        _warn_once("flex-failed", f"FlexAttention failed ({type(err).__name__}: {str(err)[:200]}): using 'split'")
        logp_N, entropy_N = forward("split")
    return (logp_N, entropy_N) if with_entropy else logp_N


def _head_logprobs(head, h_NxD: torch.Tensor, labels_N: torch.Tensor, temperature: float, with_entropy: bool):
    """(logp_N, entropy_N or None) of the labels: LM head, fp32 log-softmax over V, gather."""
    logits_NxV = head(h_NxD)
    if logits_NxV.dtype in (torch.bfloat16, torch.float16):
        logits_NxV = logits_NxV.float()
    if temperature not in (0, 1):
        logits_NxV = logits_NxV / temperature
    logprobs_NxV = torch.log_softmax(logits_NxV, dim=-1)
    logp_N = logprobs_NxV.gather(1, labels_N[:, None])[:, 0]
    if not with_entropy:
        return logp_N, None
    with torch.no_grad():
        return logp_N, -(logprobs_NxV.exp() * logprobs_NxV).sum(-1)


def label_logprobs(head, h_NxD: torch.Tensor, labels_N: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, chunk_tokens: int = 0):
    """(logp_N, entropy_N or None): the log-probs of `labels_N` under softmax(head(h_NxD) / temperature),
    the LM head `head` applied to the hidden states `h_NxD` that predict them.

    Chunked logits (`chunk_tokens` > 0, `trainer.logits_chunk_tokens`): the head, the log-softmax
    and the gather run on `chunk_tokens` labels at a time, each chunk under `torch.utils.checkpoint`
    (non-reentrant, autocast kept) when a gradient is wanted, so that neither the forward nor the
    backward holds more than one chunk's N x V logits (the backward recomputes the chunk's logits:
    one more LM-head matmul per label). Without a gradient (the old and ref forwards) the chunks
    are simply computed in turn. Log-probs, entropies and gradients equal the unchunked ones up to
    rounding (fp64: 1e-12, tests/test_chunked_logits.py)."""
    N = labels_N.shape[0]
    if chunk_tokens <= 0 or N <= chunk_tokens:
        return _head_logprobs(head, h_NxD, labels_N, temperature, with_entropy)
    grad = torch.is_grad_enabled() and (h_NxD.requires_grad or any(p.requires_grad for p in head.parameters()))
    parts = []
    for h_CxD, labels_C in zip(h_NxD.split(chunk_tokens), labels_N.split(chunk_tokens)):
        if grad:
            parts.append(checkpoint(_head_logprobs, head, h_CxD, labels_C, temperature, with_entropy,
                                    use_reentrant=False))
        else:
            parts.append(_head_logprobs(head, h_CxD, labels_C, temperature, with_entropy))
    logp_N = torch.cat([logp for logp, _ in parts])
    return logp_N, torch.cat([ent for _, ent in parts]) if with_entropy else None
