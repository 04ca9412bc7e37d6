"""The unified tri-model (PAPER.md point 5): policy, old and reference log-probs in one micro-step.

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

API (the consumer's iteration)::

    tri = TriModel(policy, cfg.algorithm,                 # cfg.algorithm: AlgorithmConfig
                   logprob_kwargs={"backend": cfg.algorithm.attention_backend})  # optional
    acc = LossAccumulator.from_config(cfg.algorithm, cfg.engine.max_tokens)
    for mb in micro_batches:                              # batching.MicroBatch, any order
        tri.micro_step(mb.build(shared=cfg.algorithm.shared_prompt, device=...), acc)
    metrics = tri.optimizer_step(optimizer, acc)          # normalise once, clip, step, zero_grad
    tri.refresh_old()                                     # the barrier: old <- policy

Lower level: `out = tri.forward(packed)` returns a `TriLogprobs` (policy_N with grad,
old_N, ref_N or None, entropy_N); `grpo.micro_batch_loss(...)` turns it into a loss sum.
`tri.memory()` reports the parameter bytes of the three models.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from periodic_async import grpo
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


def _param_bytes(model: torch.nn.Module | None) -> int:
    if model is None:
        return 0
    unique = {id(p): p for p in model.parameters()}.values()  # tied embeddings once
    return sum(p.numel() * p.element_size() for p in unique)


class TriModel:
    """Policy / old / ref side by side; see the module docstring.

    policy: a HF causal LM (the trained module; its parameters get the gradients).
    cfg: an `AlgorithmConfig` (beta, skip_old_forward, optimizer_steps_per_iteration, loss_norm,
         eps_low, eps_high, max_grad_norm).
    logprob_kwargs: extra keyword arguments passed to `shared_prompt.token_logprobs` for all
         three models, e.g. {"backend": "split"}; none by default (token_logprobs' own default).
    """

    def __init__(self, policy: torch.nn.Module, cfg, logprob_kwargs: dict | None = None):
        self.policy, self.cfg = policy, cfg
        self.logprob_kwargs = dict(logprob_kwargs or {})
        self.skip_old = bool(cfg.skip_old_forward) and cfg.optimizer_steps_per_iteration == 1
        self.old = None if self.skip_old else _frozen_copy(policy)
        self.ref = _frozen_copy(policy) if cfg.beta > 0 else None

    def forward(self, packed: PackedBatch, with_entropy: bool = True) -> TriLogprobs:
        """Log-probs of the three models on one packed micro-batch (same input, layout, device)."""
        kw = self.logprob_kwargs
        if with_entropy:
            policy_N, entropy_N = token_logprobs(self.policy, packed, with_entropy=True, **kw)
        else:
            policy_N, entropy_N = token_logprobs(self.policy, packed, **kw), None
        with torch.no_grad():
            old_N = policy_N.detach() if self.old is None else token_logprobs(self.old, packed, **kw)
            ref_N = None if self.ref is None else token_logprobs(self.ref, packed, **kw)
        return TriLogprobs(policy_N, old_N, ref_N, entropy_N)

    def micro_step(self, inputs, acc: grpo.LossAccumulator, with_entropy: bool = True) -> dict[str, torch.Tensor]:
        """Forward the three models, backpropagate the micro-batch's un-normalised loss sum,
        record it in `acc`. inputs: a `batching.MicroBatchInputs`. Returns the metric sums."""
        out = self.forward(inputs.packed, with_entropy=with_entropy)
        w_N = grpo.token_weights(inputs.packed.sample_N, inputs.lengths_S, self.cfg.loss_norm,
                                 dtype=out.policy_N.dtype)
        loss_sum, sums = grpo.micro_batch_loss(out.policy_N, out.old_N, out.ref_N, inputs.advantages_N, w_N,
                                               self.cfg, out.entropy_N)
        loss_sum.backward()
        # Trainer vs engine log-probs of the sampled tokens (same weights): a layout or
        # alignment bug shows here first; ~1e-6 is fp noise between the two code paths.
        sums["behaviour_gap"] = (out.policy_N.detach() - inputs.behaviour_logp_N.to(out.policy_N.dtype)).abs().sum()
        acc.add(sums, num_tokens=inputs.num_tokens, num_sequences=inputs.num_samples)
        return sums

    def optimizer_step(self, optimizer: torch.optim.Optimizer, acc: grpo.LossAccumulator) -> dict[str, float]:
        """End of an accumulation: divide the gradients by the normaliser once, clip to
        cfg.max_grad_norm (0: no clipping), step, zero the gradients. Does not refresh old:
        call `refresh_old()` at the iteration barrier. Returns acc.metrics() + grad_norm."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        acc.finalize_gradients(params)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {**acc.metrics(), "grad_norm": float(grad_norm)}

    @torch.no_grad()
    def refresh_old(self) -> None:
        """The barrier: copy the policy's weights into the old model in place (no-op when skipped)."""
        if self.old is None:
            return
        for (name, p_old), (name_p, p) in zip(self.old.named_parameters(), self.policy.named_parameters()):
            assert name == name_p, (name, name_p)
            p_old.copy_(p)
        for (name, b_old), (name_p, b) in zip(self.old.named_buffers(), self.policy.named_buffers()):
            assert name == name_p, (name, name_p)
            b_old.copy_(b)

    def memory(self) -> dict[str, int]:
        """Parameter bytes of each model (tied weights once) and their total."""
        m = {"policy_bytes": _param_bytes(self.policy), "old_bytes": _param_bytes(self.old),
             "ref_bytes": _param_bytes(self.ref)}
        m["total_bytes"] = sum(m.values())
        return m
