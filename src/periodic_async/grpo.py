"""GRPO core: group advantages, the clipped surrogate with a k3 KL penalty, and a loss
normalisation that stays exact when an iteration arrives as a stream of micro-batches.

Shape letters: B prompts (groups), G samples per prompt, N response (label) tokens of a
micro-batch in the flat order of `shared_prompt.pack`, S samples of a micro-batch.

Departures from textbook GRPO, on purpose:
- `std` advantages use the unbiased group std (as TRL and verl do); a group whose rewards
  are all equal (including G = 1) gets exactly zero advantages, never NaN or eps noise.
- The loss is a *sum* per micro-batch; the normaliser is applied once, to the gradients,
  at the end of the iteration (the paper's equivalence argument). The consumer does not know how many
  tokens the iteration has until its last group arrives.

Invariant (tested in tests/test_grpo.py::test_microbatch_split_matches_full_batch): the
gradient of an iteration does not depend on how its groups are split into micro-batches
(including splits that cut a group between micro-batches) nor on the order in which they
arrive, up to floating-point summation order. It holds because every micro-batch
backpropagates  sum_n w_n * loss_n  with token weights w_n that depend only on the token's
own sample (1, or 1/R_i for seq-mean), and the gradients are divided once by
    token-mean: total tokens of the iteration   (DAPO)
    seq-mean:   total sequences of the iteration (mean per sequence, then over sequences)
    constant:   B * G * max_tokens              (Dr. GRPO)
before clipping and the optimizer step. Dividing by each micro-batch's own token count
(what naive gradient accumulation does) breaks it: see `test_naive_token_mean_differs`.
Caveat for exactness tests: HF's Qwen2RMSNorm computes in float32 even in a float64 model,
so its backward rounds activation gradients to fp32 and split gradients then agree only to
~1e-7 relative; the test patches the norms to compute in the input dtype (then ~3e-16).

Use, one iteration (one optimizer step; see `trimodel.TriModel.micro_step` for the glue):

    acc = LossAccumulator.from_config(cfg, max_tokens=engine_cfg.max_tokens)
    for mb in micro_batches:                                  # any split, any order
        w_N = token_weights(mb.packed.sample_N, mb.lengths_S, cfg.loss_norm)
        loss_sum, sums = micro_batch_loss(logp_N, old_N, ref_N, mb.advantages_N, w_N, cfg, entropy_N)
        loss_sum.backward()
        acc.add(sums, num_tokens=N, num_sequences=S)
    acc.finalize_gradients(policy.parameters())               # divide by the normaliser once
    clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad(); tri.refresh_old()
    log(acc.metrics())
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

LOSS_NORMS = ("token-mean", "seq-mean", "constant")


def group_advantages(rewards_BxG: torch.Tensor | Sequence, mode: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages from the rewards of each group (last dimension = G).

    rewards_BxG: (..., G) rewards; a flat list of G floats is one group.
    mode: 'std'  -> (r - mean_G) / (std_G + eps), std unbiased;
          'mean' -> r - mean_G (Dr. GRPO).
    Returns (..., G) advantages in the rewards' float dtype (float32 for int/list input).
    A group whose rewards are all equal gets exactly 0 (also for G = 1).
    A NaN reward (TRL's convention for a sample no reward function scored) is left out of its
    group's mean and std and gets advantage 0.
    """
    r = torch.as_tensor(rewards_BxG)
    if not r.is_floating_point():
        r = r.to(torch.float32)
    if mode not in ("std", "mean"):
        raise ValueError(f"advantage mode {mode!r}: expected 'std' or 'mean'")
    if r.shape[-1] == 1:
        return torch.zeros_like(r)
    scored = ~torch.isnan(r)
    if not scored.all():
        return _nan_group_advantages(r, scored, mode, eps)
    centered = r - r.mean(dim=-1, keepdim=True)
    adv = centered / (r.std(dim=-1, keepdim=True) + eps) if mode == "std" else centered
    all_equal = (r == r[..., :1]).all(dim=-1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(adv), adv)


def _nan_group_advantages(r: torch.Tensor, scored: torch.Tensor, mode: str, eps: float) -> torch.Tensor:
    """`group_advantages` over the scored (non-NaN) rewards of each group; 0 for the others."""
    zero = torch.zeros_like(r)
    n = scored.sum(dim=-1, keepdim=True)
    mean = torch.where(scored, r, zero).sum(dim=-1, keepdim=True) / n.clamp(min=1)
    centered = torch.where(scored, r - mean, zero)
    std = ((centered ** 2).sum(dim=-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    adv = centered / (std + eps) if mode == "std" else centered
    lo = torch.where(scored, r, torch.full_like(r, float("inf"))).amin(dim=-1, keepdim=True)
    hi = torch.where(scored, r, torch.full_like(r, float("-inf"))).amax(dim=-1, keepdim=True)
    return torch.where(scored & (n > 1) & (lo != hi), adv, zero)


def kl_k3(logp_N: torch.Tensor, ref_logp_N: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0. (N,)"""
    d_N = ref_logp_N - logp_N
    return torch.exp(d_N) - d_N - 1.0


def per_token_loss(logp_N: torch.Tensor, old_logp_N: torch.Tensor, advantages_N: torch.Tensor,
                   eps_low: float, eps_high: float, ref_logp_N: torch.Tensor | None = None,
                   beta: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate plus beta * k3 KL, per token (to be minimised).

    logp_N: policy log-probs (with grad); old_logp_N: old policy log-probs (no grad);
    advantages_N: the sample's advantage broadcast over its tokens; ref_logp_N: reference
    log-probs, needed when beta > 0.
    loss_N = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * k3,
    ratio = exp(logp - old).
    Returns (loss_N, kl_N detached (zeros when no ref), clipped_N detached bool: the token's
    surrogate gradient is cut by the clip).
    """
    ratio_N = torch.exp(logp_N - old_logp_N)
    surr_N = ratio_N * advantages_N
    surr_clip_N = torch.clamp(ratio_N, 1.0 - eps_low, 1.0 + eps_high) * advantages_N
    loss_N = -torch.minimum(surr_N, surr_clip_N)
    with torch.no_grad():
        clipped_N = surr_clip_N < surr_N
    if beta > 0:
        if ref_logp_N is None:
            raise ValueError("per_token_loss: beta > 0 needs ref_logp_N")
        kl_N = kl_k3(logp_N, ref_logp_N)
        loss_N = loss_N + beta * kl_N
        kl_N = kl_N.detach()
    elif ref_logp_N is not None:
        kl_N = kl_k3(logp_N.detach(), ref_logp_N)
    else:
        kl_N = torch.zeros_like(logp_N.detach())
    return loss_N, kl_N, clipped_N


def token_weights(sample_N: torch.Tensor, lengths_S: torch.Tensor, loss_norm: str,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight of each token in the un-normalised micro-batch sum. (N,)

    sample_N: sample index 0..S-1 of each label (`PackedBatch.sample_N`); lengths_S: R_i.
    token-mean and constant: 1; seq-mean: 1 / R_i of the token's sample. A weight depends on
    its own sample only, which is what keeps the sum split-invariant.
    """
    if loss_norm not in LOSS_NORMS:
        raise ValueError(f"loss_norm {loss_norm!r}: expected one of {LOSS_NORMS}")
    if loss_norm == "seq-mean":
        return 1.0 / lengths_S.to(dtype)[sample_N]
    return torch.ones(sample_N.shape, dtype=dtype, device=sample_N.device)


def normaliser(loss_norm: str, num_tokens: int, num_sequences: int, constant: float | None = None) -> float:
    """The iteration's divisor: total tokens (token-mean), total sequences (seq-mean) or
    `constant` = B * G * max_tokens (constant)."""
    if loss_norm == "token-mean":
        value = num_tokens
    elif loss_norm == "seq-mean":
        value = num_sequences
    elif loss_norm == "constant":
        if constant is None:
            raise ValueError("loss_norm 'constant' needs constant = B * G * max_tokens")
        value = constant
    else:
        raise ValueError(f"loss_norm {loss_norm!r}: expected one of {LOSS_NORMS}")
    if value <= 0:
        raise ValueError(f"normaliser of {loss_norm!r} is {value}: an empty iteration?")
    return float(value)


def micro_batch_loss(logp_N: torch.Tensor, old_logp_N: torch.Tensor, ref_logp_N: torch.Tensor | None,
                     advantages_N: torch.Tensor, weights_N: torch.Tensor, cfg,
                     entropy_N: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The un-normalised loss sum of one micro-batch, and detached metric sums.

    cfg: an `AlgorithmConfig` (eps_low, eps_high, beta). weights_N from `token_weights`.
    Returns (loss_sum: scalar with grad = sum_n w_n * loss_n, call `.backward()` on it;
    sums: {'loss': sum w*loss, 'kl': sum kl, 'clip': clipped tokens, 'ratio': sum of the
    importance ratios, 'ratio_dev': sum |ratio - 1| (0 on-policy: the staleness shows here),
    'entropy': sum entropy}
    as detached 0-d tensors, to hand to `LossAccumulator.add`).
    """
    advantages_N = advantages_N.to(logp_N.dtype)
    weights_N = weights_N.to(logp_N.dtype)
    loss_N, kl_N, clipped_N = per_token_loss(logp_N, old_logp_N, advantages_N, cfg.eps_low, cfg.eps_high,
                                             ref_logp_N, cfg.beta)
    loss_sum = (weights_N * loss_N).sum()
    with torch.no_grad():
        ratio_N = torch.exp(logp_N.detach() - old_logp_N)
    sums = {"loss": loss_sum.detach(), "kl": kl_N.sum(), "clip": clipped_N.sum().to(kl_N.dtype),
            "ratio": ratio_N.sum(), "ratio_dev": (ratio_N - 1).abs().sum(),
            "entropy": entropy_N.detach().sum() if entropy_N is not None else torch.zeros((), dtype=kl_N.dtype)}
    return loss_sum, sums


def finalize_gradients(params: Iterable[torch.nn.Parameter], normaliser: float) -> None:
    """Divide every gradient once by the iteration's normaliser (tied parameters once)."""
    seen: set[int] = set()
    for p in params:
        if id(p) in seen or p.grad is None:
            continue
        seen.add(id(p))
        p.grad.div_(normaliser)


class LossAccumulator:
    """Totals of one optimizer step's worth of micro-batches (one iteration by default).

    `add` after each micro-batch's backward; `finalize_gradients` once at the end; then
    `metrics()`: loss normalised like the gradient (the objective actually optimised);
    kl, clip_frac and entropy as token means over the iteration, whatever the loss_norm.
    With optimizer_steps_per_iteration > 1 use one accumulator per optimizer step.
    """

    def __init__(self, loss_norm: str, constant: float | None = None):
        if loss_norm not in LOSS_NORMS:
            raise ValueError(f"loss_norm {loss_norm!r}: expected one of {LOSS_NORMS}")
        if loss_norm == "constant" and not constant:
            raise ValueError("loss_norm 'constant' needs constant = B * G * max_tokens")
        self.loss_norm, self.constant = loss_norm, constant
        self.num_tokens = 0
        self.num_sequences = 0
        self.num_micro_batches = 0
        self.sums: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, cfg, max_tokens: int | None = None) -> "LossAccumulator":
        """From an `AlgorithmConfig`; max_tokens (EngineConfig.max_tokens) sets the constant,
        B * G * max_tokens per optimizer step (B / optimizer_steps_per_iteration prompts each)."""
        constant = None
        if cfg.loss_norm == "constant":
            if not max_tokens:
                raise ValueError("loss_norm 'constant' needs max_tokens (engine.max_tokens)")
            steps = cfg.optimizer_steps_per_iteration
            constant = cfg.prompts_per_iteration * cfg.group_size * max_tokens / steps
        return cls(cfg.loss_norm, constant)

    def add(self, sums: dict[str, torch.Tensor], num_tokens: int, num_sequences: int) -> None:
        """Record one micro-batch: its metric sums, N label tokens and S whole sequences."""
        for k, v in sums.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.num_tokens += int(num_tokens)
        self.num_sequences += int(num_sequences)
        self.num_micro_batches += 1

    @property
    def normaliser(self) -> float:
        return normaliser(self.loss_norm, self.num_tokens, self.num_sequences, self.constant)

    def finalize_gradients(self, params: Iterable[torch.nn.Parameter]) -> float:
        """Rescale the accumulated gradients by 1 / normaliser; returns the normaliser."""
        z = self.normaliser
        finalize_gradients(params, z)
        return z

    def metrics(self) -> dict[str, float]:
        """Normalised metrics of the iteration (python floats)."""
        n = max(self.num_tokens, 1)
        out = {"loss": float(self.sums.get("loss", 0.0)) / self.normaliser if self.num_tokens else 0.0}
        for k, name in (("kl", "kl"), ("clip", "clip_frac"), ("entropy", "entropy"),
                        ("behaviour_gap", "behaviour_logp_gap"), ("ratio", "ratio_mean"),
                        ("ratio_dev", "ratio_abs_dev")):
            out[name] = float(self.sums.get(k, 0.0)) / n
        out.update(tokens=float(self.num_tokens), sequences=float(self.num_sequences),
                   micro_batches=float(self.num_micro_batches))
        return out
