"""Chunked logits (`trainer.logits_chunk_tokens`, `shared_prompt.label_logprobs`): the log-probs and
entropies of every label, the micro-step's loss and its gradients are today's unchunked ones (fp64,
shared-prompt packing, SmolLM2's tied embeddings, a temperature, the old and ref forwards without
gradient, LoRA); the LM head really runs chunk by chunk, again in the backward for the policy
only; and a micro-step's peak memory is lower when the vocabulary dominates."""

import pytest
import torch
from helpers import groups, micro_steps
from transformers import AutoModelForCausalLM

from periodic_async import grpo
from periodic_async.batching import split_groups
from periodic_async.bench.memory import peak_bytes
from periodic_async.config import AlgorithmConfig, LoRAConfig, ModelConfig
from periodic_async.lora import apply_lora
from periodic_async.model import build_model, preset_config
from periodic_async.shared_prompt import pack, token_logprobs
from periodic_async.trimodel import TriModel


def head_calls(model) -> list[int]:
    """A counter of the LM head's calls (pre-hook: a recomputation that stops early still counts)."""
    calls = [0]
    model.get_output_embeddings().register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_chunked_logprobs_equal_unchunked(tokenizer):
    """llama-micro (tied embeddings), fp64, two shared-prompt groups, temperature 0.7: per-label
    log-probs and entropies with chunks of 1, 5 and 7 labels equal the unchunked ones to 1e-12,
    with and without gradient, and the head runs ceil(N / chunk) times."""
    model = build_model(ModelConfig(name_or_path="llama-micro", dtype="float64", device="cpu"), tokenizer)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    batch = pack([(g.prompt_ids, g.response_ids) for g in groups(len(tokenizer))], shared=True)
    N = len(batch.labels_N)
    ref_N, ref_ent_N = token_logprobs(model, batch, with_entropy=True, backend="split", temperature=0.7)
    calls = head_calls(model)
    for chunk in (1, 5, 7):
        for grad in (True, False):
            calls[0] = 0
            with torch.set_grad_enabled(grad):
                logp_N, ent_N = token_logprobs(model, batch, with_entropy=True, backend="split", temperature=0.7,
                                               logits_chunk_tokens=chunk)
            assert calls[0] == -(-N // chunk) and logp_N.requires_grad == grad
            torch.testing.assert_close(logp_N, ref_N, rtol=0, atol=1e-12)
            torch.testing.assert_close(ent_N, ref_ent_N, rtol=0, atol=1e-12)


@pytest.mark.parametrize("lora", [False, True])
def test_chunked_micro_step_has_the_same_loss_and_gradients(tokenizer, lora):
    """The tri-model micro-step (beta > 0, the old forward run, shared-prompt micro-batches, fp64):
    loss sums and every gradient agree to 1e-12 with chunks of 4 labels and without; the head runs
    in chunks for the three forwards and again, chunk by chunk, in the policy's backward alone."""
    cfg = AlgorithmConfig(beta=0.05, skip_old_forward=False, max_grad_norm=0.0)
    inputs = [mb.build(shared=True, dtype=torch.float64) for mb in split_groups(groups(len(tokenizer)), max_tokens=24)]
    out = {}
    for chunk in (0, 4):
        policy = build_model(ModelConfig(name_or_path="llama-micro", dtype="float64", device="cpu", seed=0), tokenizer)
        if lora:
            policy = apply_lora(policy, LoRAConfig(enabled=True, rank=4, target_modules=["q_proj", "v_proj"]), seed=1)
        tri = TriModel(policy, cfg, logprob_kwargs={"backend": "split", "temperature": 0.7,
                                                    "logits_chunk_tokens": chunk})
        calls = head_calls(tri.lm)
        out[chunk] = (*micro_steps(tri, inputs), calls[0])
    (loss0, grads0, _), (loss4, grads4, calls4) = out[0], out[4]
    assert grads0 and grads0.keys() == grads4.keys()
    assert loss4 == pytest.approx(loss0, rel=0, abs=1e-12)
    for name in grads0:
        torch.testing.assert_close(grads4[name], grads0[name], rtol=0, atol=1e-12, msg=name)
    chunks = sum(-(-len(mb.packed.labels_N) // 4) for mb in inputs)
    # policy, old and ref forwards, plus the policy's recomputation (LoRA: old and ref run through the same head)
    assert calls4 == (4 if lora else 2) * chunks


def test_chunked_logits_lower_the_peak_memory_of_a_micro_step(tokenizer):
    """qwen2-micro widened to a 16,384-token vocabulary (fp32), one group of 8 x 128 labels: the
    micro-step's peak allocation with chunks of 64 labels is under a third of the unchunked one
    (the N x V logits, their log-softmax and its gradient dominate)."""
    conf = preset_config("qwen2-micro", tokenizer)
    conf.vocab_size = 16384
    cfg = AlgorithmConfig(beta=0.0, max_grad_norm=0.0)
    (mb,) = split_groups(groups(conf.vocab_size, n=1, G=8, P=16, R=(128, 128)), max_tokens=0, groups_per_micro_batch=1)
    inputs = mb.build(shared=True)
    peak = {}
    for chunk in (0, 64):
        torch.manual_seed(0)
        policy = AutoModelForCausalLM.from_config(conf)
        tri = TriModel(policy, cfg, logprob_kwargs={"backend": "split", "logits_chunk_tokens": chunk})
        acc = grpo.LossAccumulator.from_config(cfg)
        tri.micro_step(inputs, acc)  # warm-up: the gradients exist, so both measure the same step
        peak[chunk] = peak_bytes(lambda: tri.micro_step(inputs, acc))
    print(f"micro-step peak: {peak[0] / 2**20:.1f} MiB unchunked, {peak[64] / 2**20:.1f} MiB in chunks of 64")
    assert peak[64] < peak[0] / 3, peak
