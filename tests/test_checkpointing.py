"""Activation checkpointing (`trainer.gradient_checkpointing`; TRL's `gradient_checkpointing`): the
tri-model micro-step gives the same loss and gradients with it on and off (fp64, shared-prompt
packing, the reference and old forwards, SmolLM2's tied layout, LoRA); the policy's decoder layers
really run again in the backward (the old and ref forwards do not); and the micro-step's peak
memory is lower (torch's own allocation record, `bench.memory.peak_bytes`)."""

import pytest
import torch
from helpers import groups, micro_steps
from transformers.modeling_layers import GradientCheckpointingLayer

from periodic_async import grpo
from periodic_async.batching import split_groups
from periodic_async.bench.memory import peak_bytes
from periodic_async.config import AlgorithmConfig, LoRAConfig, ModelConfig
from periodic_async.lora import apply_lora
from periodic_async.model import build_model
from periodic_async.trimodel import TriModel


def layer_calls(model) -> list[int]:
    """A counter of the decoder layers' forward calls (a recomputation in the backward is one more; a
    pre-hook, since the recomputation stops once it has what the backward needs)."""
    calls = [0]
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("preset, lora", [("llama-micro", False), ("qwen2-1m", True)])
def test_same_loss_and_gradients_with_checkpointing(tokenizer, preset, lora):
    """fp64: loss sums and every gradient agree to 1e-12 with checkpointing on and off (shared-prompt
    micro-batches, beta > 0, the old forward run), and each decoder layer runs exactly once more per
    micro-step with it on: the policy's recomputation, none for the old and ref forwards."""
    cfg = AlgorithmConfig(beta=0.05, skip_old_forward=False, max_grad_norm=0.0)
    inputs = [mb.build(shared=True, dtype=torch.float64) for mb in split_groups(groups(len(tokenizer)), max_tokens=24)]
    out = {}
    for on in (False, True):
        policy = build_model(ModelConfig(name_or_path=preset, dtype="float64", device="cpu", seed=0), tokenizer)
        if lora:
            policy = apply_lora(policy, LoRAConfig(enabled=True, rank=4, target_modules=["q_proj", "v_proj"]), seed=1)
        tri = TriModel(policy, cfg, logprob_kwargs={"backend": "split"}, gradient_checkpointing=on)
        layers = sum(isinstance(m, GradientCheckpointingLayer) for m in policy.modules())
        assert len(tri.checkpointed) == (layers if on else 0)
        calls = layer_calls(policy)
        out[on] = (*micro_steps(tri, inputs), calls[0])
    (loss_off, grads_off, calls_off), (loss_on, grads_on, calls_on) = out[False], out[True]
    assert len(inputs) > 1 and grads_off and grads_off.keys() == grads_on.keys()
    assert loss_on == pytest.approx(loss_off, rel=0, abs=1e-12)
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=0, atol=1e-12, msg=name)
    assert calls_on - calls_off == len(inputs) * layers  # the policy's layers ran again in each backward


def test_checkpointing_lowers_the_peak_memory_of_a_micro_step(tokenizer):
    """One group of 8 x 96 tokens through qwen2-5m (fp32, 6 layers, beta = 0): the micro-step's peak
    allocation with checkpointing is under half of that without (the layers' activations dominate)."""
    cfg = AlgorithmConfig(beta=0.0, max_grad_norm=0.0)
    (mb,) = split_groups(groups(len(tokenizer), n=1, G=8, P=64, R=(96, 96)), max_tokens=0, groups_per_micro_batch=1)
    inputs = mb.build(shared=True)
    peak = {}
    for on in (False, True):
        policy = build_model(ModelConfig(name_or_path="qwen2-5m", device="cpu", seed=0), tokenizer)
        tri = TriModel(policy, cfg, logprob_kwargs={"backend": "split"}, gradient_checkpointing=on)
        acc = grpo.LossAccumulator.from_config(cfg)
        tri.micro_step(inputs, acc)  # warm-up: the gradients exist, so both measure the same step
        peak[on] = peak_bytes(lambda: tri.micro_step(inputs, acc))
    print(f"micro-step peak: {peak[False] / 2**20:.1f} MiB without checkpointing, {peak[True] / 2**20:.1f} MiB with")
    assert peak[True] < 0.5 * peak[False], peak


def test_a_run_with_checkpointing_and_chunked_logits_follows_the_plain_run(tokenizer_dir, tmp_path):
    """The trainer honours both settings (trainer.gradient_checkpointing, trainer.logits_chunk_tokens=5):
    a 3-iteration periodic-async run (fp64, in-process engine, beta > 0) samples the same tokens as the
    run without them and ends within 1e-10 of its weights."""
    from helpers import by_prompt, checkpoint_weights, max_abs_diff, read_rollouts, tiny_run_config

    from periodic_async.consumer import Consumer
    from periodic_async.engine import make_engine
    from periodic_async.model import load_policy
    from periodic_async.pipeline import run

    runs = {}
    for name, extra in (("plain", {}), ("lean", {"trainer.gradient_checkpointing": True,
                                                 "trainer.logits_chunk_tokens": 5})):
        cfg = tiny_run_config(tmp_path / name, tokenizer_dir, **{"engine.backend": "local", **extra})
        with make_engine(cfg.engine, cfg.model) as engine:
            run(cfg, engine=engine)
        runs[name] = (by_prompt(read_rollouts(cfg.trainer.output_dir)),
                      checkpoint_weights(f"{cfg.trainer.output_dir}/checkpoint"))
    assert runs["lean"][0] == runs["plain"][0] and len(runs["plain"][0]) == 3 * 6
    assert max_abs_diff(runs["lean"][1], runs["plain"][1]) <= 1e-10
    tri = Consumer(load_policy(cfg.model)[0], cfg).tri  # the last config: the settings reached the tri-model
    assert tri.checkpointed and tri.logprob_kwargs["logits_chunk_tokens"] == 5
