"""The unified tri-model (the paper's tri-model): policy, old and reference log-probs in one micro-step.

A synchronous trainer computes old and ref log-probs in separate passes over the whole
batch before training; a streaming consumer cannot, so the three models sit side by side
(same device, dtype and layout) and every micro-step runs them on the same packed input:

    policy  the trained model (log-probs with gradient)
    old     theta_t, a frozen copy of the policy taken at the iteration start; refreshed at
            the barrier by copying the policy's weights in place (`refresh_old`), no re-load
    ref     the frozen initial weights (k3 KL anchor)

Two shortcuts, both exact:
- one optimizer step per iteration (`optimizer_steps_per_iteration == 1`) means old ==
  policy throughout the iteration and the ratio is exactly 1; with
  `cfg.skip_old_forward` the old forward is skipped (old log-probs = policy log-probs,
  detached) and the old copy is not even allocated. With several optimizer steps per
  iteration the flag is ignored: the old forward is required there. (Without the skip the
  old forward is bit-identical to the policy's at the iteration start, given a deterministic
  forward: no dropout, which the HF Qwen presets do not have.)
- beta == 0: no reference forward and no reference copy.

Log-probs are those of the tempered distribution softmax(logits / engine.temperature), the one
the engines report (`logprob_kwargs["temperature"]`; see `engine.batcher.sample_next`).
Mixed precision (`autocast_dtype`): float32 parameters and optimizer state, forwards under
`torch.autocast`, as HF Trainer / TRL do with bf16=True; a pure-bf16 parameter would lose
most updates (an AdamW step of lr ~ 1e-5 is below half a bf16 ulp of a weight of 0.01).

API (the consumer's iteration)::

    tri = TriModel(policy, cfg.algorithm,                 # cfg.algorithm: AlgorithmConfig
                   logprob_kwargs={"backend": cfg.algorithm.attention_backend,  # optional
                                   "temperature": cfg.engine.temperature})      # score what was sampled
    acc = LossAccumulator.from_config(cfg.algorithm, cfg.engine.max_tokens)
    for mb in micro_batches:                              # batching.MicroBatch, any order
        tri.micro_step(mb.build(shared=cfg.algorithm.shared_prompt, device=...), acc)
    metrics = tri.optimizer_step(optimizer, acc)          # normalise once, clip, step, zero_grad
    tri.refresh_old()                                     # the barrier: old <- policy

LoRA (`model.lora`, a peft `PeftModel` policy): the base weights are held once. The policy is the
base with its adapter; ref is the same base with the adapter disabled (`policy.disable_adapter()`,
no copy); old is a frozen copy of the adapter tensors alone, swapped into the adapter (copied in
place, and back) for the old forward, which runs, with the ref forward, before the policy's in
the micro-step, so that no autograd graph holds the swapped tensors. Only the adapters train (the
optimizer holds them alone); under mixed precision they are the float32 masters and the frozen
base stays in `model.dtype`.

Lower level: `out = tri.forward(packed)` returns a `TriLogprobs` (policy_N with grad,
old_N, ref_N or None, entropy_N); `grpo.micro_batch_loss(...)` turns it into a loss sum.
`tri.memory()` reports the parameter bytes of the three models (with LoRA: the base once, in
policy_bytes; old_bytes the adapter copy; ref_bytes 0).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable

import torch

from periodic_async import grpo
from periodic_async.lora import is_lora, swapped_in, trainable
from periodic_async.model import checkpoint_layers
from periodic_async.shared_prompt import PackedBatch, token_logprobs


@dataclass
class TriLogprobs:
    """Per-label log-probs of one packed micro-batch (N labels, flat `pack` order)."""

    policy_N: torch.Tensor
    """Policy log-probs, with gradient."""
    old_N: torch.Tensor
    """Old-policy log-probs (detached; = policy_N.detach() when the old forward is skipped)."""
    ref_N: torch.Tensor | None
    """Reference log-probs (detached); None when beta == 0."""
    entropy_N: torch.Tensor | None
    """Policy entropy per label position (detached); None unless requested."""


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    frozen = copy.deepcopy(model)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def _param_bytes(model: torch.nn.Module | dict | None) -> int:
    if model is None:
        return 0
    tensors = model.values() if isinstance(model, dict) else model.parameters()
    unique = {id(p): p for p in tensors}.values()  # tied embeddings once
    return sum(p.numel() * p.element_size() for p in unique)


class TriModel:
    """Policy / old / ref side by side; see the module docstring.

    policy: a HF causal LM (the trained module; its parameters get the gradients).
    cfg: an `AlgorithmConfig` (beta, skip_old_forward, optimizer_steps_per_iteration, loss_norm,
         eps_low, eps_high, max_grad_norm, kl_bias_correction, behaviour_is and its bounds: the
         behaviour importance ratio is taken against the old log-probs, as TRL's).
    logprob_kwargs: extra keyword arguments passed to `shared_prompt.token_logprobs` for all
         three models, e.g. {"backend": "split"}; none by default (token_logprobs' own default).
    layout: applied in place to policy, old and ref alike after the copies are taken (trainer
         ranks: `distributed.Ranks.layout`, e.g. FSDP2 sharding), so the three keep one layout.
    old_from_behaviour: take the old log-probs from the engines' behaviour log-probs instead
         (the off-policy mode, whose samples come from an earlier version than the policy's).
    autocast_dtype: None (the forwards run in the parameters' dtype) or torch.bfloat16 /
         torch.float16: mixed precision. The parameters (the optimizer's master weights, and
         its state) must then be float32; the three forwards run under `torch.autocast` in
         that dtype, the log-softmax in float32. float16 adds dynamic loss scaling
         (`torch.amp.GradScaler`): its gradients would otherwise underflow.
    gradient_checkpointing: the policy's decoder layers keep only their inputs in the forward and
         recompute the rest in the backward (`model.checkpoint_layers`; `trainer.gradient_checkpointing`):
         the same loss and gradients, less activation memory, about one more forward of compute.
    """

    def __init__(self, policy: torch.nn.Module, cfg, logprob_kwargs: dict | None = None,
                 old_from_behaviour: bool = False, autocast_dtype: torch.dtype | None = None,
                 layout: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                 gradient_checkpointing: bool = False):
        self.policy, self.cfg = policy, cfg
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"TriModel: autocast_dtype={autocast_dtype}: expected None, bfloat16 or float16")
        self.lora = is_lora(policy)
        self.lm = policy.get_base_model() if self.lora else policy
        """The HF causal LM the log-probs are computed on (with LoRA: the one inside the PeftModel,
        its adapters injected)."""
        self.checkpointed = checkpoint_layers(self.lm) if gradient_checkpointing else []
        """The policy's decoder layers that recompute their activations in the backward (`_recompute`)."""
        trained = [p for p in policy.parameters() if p.requires_grad] if self.lora else list(policy.parameters())
        if autocast_dtype is not None and any(p.dtype != torch.float32 for p in trained):
            raise ValueError(f"TriModel: mixed precision ({autocast_dtype}) needs float32 master weights; "
                             f"the policy has {next(p.dtype for p in trained if p.dtype != torch.float32)} "
                             f"{'adapter ' if self.lora else ''}parameters")
        self.autocast_dtype = autocast_dtype
        device_type = next(policy.parameters()).device.type
        # Loss sums (not means) are backpropagated: per-token gradients are O(1), so start the
        # scale at 2^8, not torch's 2^16 (which overflowed and skipped the first iterations).
        self.scaler = (torch.amp.GradScaler(device_type, init_scale=2.0**8, growth_interval=100)
                       if autocast_dtype == torch.float16 else None)
        self.logprob_kwargs = dict(logprob_kwargs or {})
        self.old_from_behaviour = old_from_behaviour
        self.skip_old = (bool(cfg.skip_old_forward) and cfg.optimizer_steps_per_iteration == 1) or old_from_behaviour
        if self.lora:  # ref: the adapter disabled; old: the adapter tensors, laid out as the policy's
            self.ref = None
            if layout is not None:  # the HF model inside (fsdp: its root runs the forwards, token_logprobs)
                layout(self.lm)
            self.old = None if self.skip_old else {n: p.detach().clone() for n, p in trainable(policy)}
            return
        self.old = None if self.skip_old else _frozen_copy(policy)
        self.ref = _frozen_copy(policy) if cfg.beta > 0 else None
        if layout is not None:  # the same layout for the three (distributed.Ranks.layout): refresh_old stays local
            for model in (policy, self.old, self.ref):
                if model is not None:
                    layout(model)

    def forward(self, packed: PackedBatch, with_entropy: bool = True) -> TriLogprobs:
        """Log-probs of the three models on one packed micro-batch (same input, layout, device)."""
        kw = self.logprob_kwargs
        with self._autocast():
            old_N = ref_N = None
            if self.lora:  # old and ref first: they run through the policy's own modules
                with torch.no_grad():
                    if self.old is not None:
                        with swapped_in(self.policy, self.old):
                            old_N = token_logprobs(self.lm, packed, **kw)
                    if self.cfg.beta > 0:
                        with self.policy.disable_adapter():
                            ref_N = token_logprobs(self.lm, packed, **kw)
            with self._recompute():
                if with_entropy:
                    policy_N, entropy_N = token_logprobs(self.lm, packed, with_entropy=True, **kw)
                else:
                    policy_N, entropy_N = token_logprobs(self.lm, packed, **kw), None
            if not self.lora:
                with torch.no_grad():
                    old_N = None if self.old is None else token_logprobs(self.old, packed, **kw)
                    ref_N = None if self.ref is None else token_logprobs(self.ref, packed, **kw)
            if old_N is None:
                old_N = policy_N.detach()
        return TriLogprobs(policy_N, old_N, ref_N, entropy_N)

    @contextlib.contextmanager
    def _recompute(self):
        """Activation checkpointing: the checkpointed layers in training mode for the policy's forward
        (transformers checkpoints a layer only then; the old and ref forwards keep nothing to recompute)."""
        modes = [m.training for m in self.checkpointed]
        for m in self.checkpointed:
            object.__setattr__(m, "training", True)
        try:
            yield
        finally:
            for m, mode in zip(self.checkpointed, modes):
                object.__setattr__(m, "training", mode)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(next(self.policy.parameters()).device.type, dtype=self.autocast_dtype)

    def micro_step(self, inputs, acc: grpo.LossAccumulator, with_entropy: bool = True) -> dict[str, torch.Tensor]:
        """Forward the three models, backpropagate the micro-batch's un-normalised loss sum,
        record it in `acc`. inputs: a `batching.MicroBatchInputs`; its `loss_mask_N` (episodes)
        multiplies the token weights: environment tokens carry no loss, no gradient and no
        metric, and are not counted in `acc`'s tokens. Returns the metric sums."""
        out = self.forward(inputs.packed, with_entropy=with_entropy)
        if self.old_from_behaviour:  # off-policy: PPO's old policy is the one that sampled
            out.old_N = inputs.behaviour_logp_N.to(out.policy_N.dtype)
        mask_N = inputs.loss_mask_N  # episodes: environment tokens out of the loss (None: single-turn)
        w_N = grpo.token_weights(inputs.packed.sample_N, inputs.lengths_S, self.cfg.loss_norm,
                                 dtype=out.policy_N.dtype)
        is_N, is_sums = None, {}
        if self.cfg.behaviour_is != "off":  # engines vs trainer (old) on the sampled tokens
            is_N, is_sums = grpo.behaviour_is_ratio(out.old_N, inputs.behaviour_logp_N, inputs.packed.sample_N,
                                                    inputs.num_samples, self.cfg.behaviour_is,
                                                    self.cfg.behaviour_is_min, self.cfg.behaviour_is_max, mask_N)
        loss_sum, sums = grpo.micro_batch_loss(out.policy_N, out.old_N, out.ref_N, inputs.advantages_N, w_N,
                                               self.cfg, out.entropy_N, is_ratio_N=is_N, mask_N=mask_N)
        sums.update(is_sums)
        (loss_sum if self.scaler is None else self.scaler.scale(loss_sum)).backward()
        # Trainer vs engine log-probs of the sampled tokens (same weights): a layout or
        # alignment bug shows here first; ~1e-6 is fp noise between the two code paths.
        gap_N = (out.policy_N.detach() - inputs.behaviour_logp_N.to(out.policy_N.dtype)).abs()
        sums["behaviour_gap"] = (gap_N if mask_N is None else gap_N * mask_N.to(gap_N.dtype)).sum()
        acc.add(sums, num_tokens=inputs.num_tokens, num_sequences=inputs.num_samples)
        return sums

    def optimizer_step(self, optimizer: torch.optim.Optimizer, acc: grpo.LossAccumulator) -> dict[str, float]:
        """End of an accumulation: divide the gradients by the normaliser once, clip to
        cfg.max_grad_norm (0: no clipping), step, zero the gradients. Does not refresh old:
        call `refresh_old()` at the iteration barrier. Returns acc.metrics() + grad_norm + lr
        (the learning rate this step used). With float16 loss scaling, a step whose gradients
        overflowed is skipped (and the scale lowered), as torch.amp does; `grad_scale` reports it."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # true gradients before normalising and clipping
        acc.finalize_gradients(params)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        lr = float(optimizer.param_groups[0]["lr"])
        extra = {}
        if self.scaler is None:
            if not bool(torch.isfinite(grad_norm)):  # never step (nor push) NaN/inf weights
                optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(f"non-finite gradient norm {float(grad_norm)} (loss sum "
                                         f"{float(acc.sums.get('loss', float('nan')))}): the step was not taken")
            optimizer.step()
        else:
            extra["grad_scale"] = float(self.scaler.get_scale())
            self.scaler.step(optimizer)
            self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return {**acc.metrics(), "grad_norm": float(grad_norm), "lr": lr, **extra}

    @torch.no_grad()
    def refresh_old(self) -> None:
        """The barrier: copy the policy's weights into the old model in place (no-op when skipped)."""
        if self.old is None:
            return
        if self.lora:  # the adapter tensors alone: the base is shared and frozen
            for name, p in trainable(self.policy):
                self.old[name].copy_(p)
            return
        for (name, p_old), (name_p, p) in zip(self.old.named_parameters(), self.policy.named_parameters()):
            if name != name_p:
                raise RuntimeError(f"refresh_old: old and policy parameters differ ({name} vs {name_p})")
            p_old.copy_(p)
        for (name, b_old), (name_p, b) in zip(self.old.named_buffers(), self.policy.named_buffers()):
            if name != name_p:
                raise RuntimeError(f"refresh_old: old and policy buffers differ ({name} vs {name_p})")
            b_old.copy_(b)

    def memory(self) -> dict[str, int]:
        """Parameter bytes of each model (tied weights once) and their total. With LoRA the base is
        counted once, in policy_bytes (base and adapter); old_bytes is the adapter copy, ref_bytes 0
        (the base with the adapter disabled). Not counted: the policy's adapter held aside during
        the old forward (one more adapter copy, freed after it)."""
        m = {"policy_bytes": _param_bytes(self.policy), "old_bytes": _param_bytes(self.old),
             "ref_bytes": _param_bytes(self.ref)}
        m["total_bytes"] = sum(m.values())
        return m
