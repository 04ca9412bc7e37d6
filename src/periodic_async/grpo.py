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
- Two corrections of TRL 1.16, off by default (the paper's objective is the plain one): the
  KL times the ratio (`kl_bias_correction`) and the engines' importance ratio
  (`behaviour_is_ratio`, `AlgorithmConfig.behaviour_is`), which multiplies each token's
  surrogate. Both act per token or per sequence (a sequence is never cut between micro-batches),
  so the invariant below holds with them.

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
With k > 1 optimizer steps per iteration each step has its own accumulator; token-mean then
divides by the step's own tokens, or with `token_mean_scope='iteration'` (TRL's dapo) by the
iteration's tokens / k (`LossAccumulator.iteration_tokens`).
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

import math
from typing import Iterable, Sequence, get_args

import torch

from periodic_async.config import Advantage, ISMode, LossNorm, TokenMeanScope


def group_advantages(rewards_BxG: torch.Tensor | Sequence, mode: Advantage = "std", eps: float = 1e-6) -> torch.Tensor:
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
    if mode not in get_args(Advantage):
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
                   beta: float = 0.0, kl_bias_correction: bool = False,
                   is_ratio_N: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate plus beta * k3 KL, per token (to be minimised).

    logp_N: policy log-probs (with grad); old_logp_N: old policy log-probs (no grad);
    advantages_N: the sample's advantage broadcast over its tokens; ref_logp_N: reference
    log-probs, needed when beta > 0; is_ratio_N: the behaviour importance ratio of each token
    (`behaviour_is_ratio`, no grad) or None.
    loss_N = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) * rho + beta * k3 [* ratio],
    ratio = exp(logp - old), rho = is_ratio_N (1 when None); the KL is multiplied by the
    (unclipped, differentiated) ratio when kl_bias_correction, which changes its gradient even
    where ratio = 1 (d ratio / d logp = ratio).
    Returns (loss_N, kl_N = k3 detached (zeros when no ref), clipped_N detached bool: the token's
    surrogate gradient is cut by the clip).
    """
    ratio_N = torch.exp(logp_N - old_logp_N)
    surr_N = ratio_N * advantages_N
    surr_clip_N = torch.clamp(ratio_N, 1.0 - eps_low, 1.0 + eps_high) * advantages_N
    loss_N = -torch.minimum(surr_N, surr_clip_N)
    with torch.no_grad():
        clipped_N = surr_clip_N < surr_N
    if is_ratio_N is not None:
        loss_N = loss_N * is_ratio_N
    if beta > 0:
        if ref_logp_N is None:
            raise ValueError("per_token_loss: beta > 0 needs ref_logp_N")
        kl_N = kl_k3(logp_N, ref_logp_N)
        loss_N = loss_N + beta * (kl_N * ratio_N if kl_bias_correction else kl_N)
        kl_N = kl_N.detach()
    elif ref_logp_N is not None:
        kl_N = kl_k3(logp_N.detach(), ref_logp_N)
    else:
        kl_N = torch.zeros_like(logp_N.detach())
    return loss_N, kl_N, clipped_N


def behaviour_is_ratio(old_logp_N: torch.Tensor, behaviour_logp_N: torch.Tensor, sample_N: torch.Tensor,
                       num_samples: int, mode: ISMode, clip_min: float | None = None,
                       clip_max: float | None = None,
                       mask_N: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The behaviour importance ratio of each token (TRL 1.16's vLLM correction; no grad). (N,)

    old_logp_N: the trainer's old log-probs; behaviour_logp_N: the engines' (a NaN, a token the
    engine did not score, counts as old - behaviour = 0); sample_N: sample index 0..S-1 of each
    token, S = num_samples (all of a sample's tokens are in the micro-batch).
    rho = exp(old - behaviour) per token ('token_*'), or exp(sum over the sample's tokens) for all
    of its tokens ('sequence_*'); '*_truncate': clamp(rho, clip_min, clip_max); '*_mask': rho = 0
    outside [clip_min, clip_max] (a None bound is no bound). mask_N (episodes: 0 on environment
    tokens, which no engine sampled): those count as old - behaviour = 0 and are no unit of the
    token modes' statistics.
    Returns (rho_N, sums): detached 0-d tensors over the units U (tokens or sequences) for
    `LossAccumulator.add`: 'is_ratio' sum of rho_U, 'is_count' U, 'is_min' / 'is_max' the
    extremes of rho_U, 'is_cut' units truncated or masked.
    """
    if mode not in get_args(ISMode):
        raise ValueError(f"behaviour_is_ratio: mode {mode!r}: expected one of {get_args(ISMode)}")
    with torch.no_grad():
        diff_N = torch.nan_to_num(old_logp_N.detach() - behaviour_logp_N.to(old_logp_N.dtype), nan=0.0)
        if mask_N is not None:
            diff_N = diff_N * mask_N.to(diff_N.dtype)
        if mode.startswith("sequence"):
            diff_U = torch.zeros(num_samples, dtype=diff_N.dtype, device=diff_N.device).index_add_(0, sample_N, diff_N)
        else:
            diff_U = diff_N
        raw_U = torch.exp(diff_U)
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        outside_U = (raw_U < lo) | (raw_U > hi)
        if mode.endswith("truncate"):
            rho_U = torch.clamp(raw_U, min=clip_min, max=clip_max)
        else:
            rho_U = raw_U.masked_fill(outside_U, 0.0)
        rho_N = rho_U[sample_N] if mode.startswith("sequence") else rho_U
        if mask_N is not None and not mode.startswith("sequence"):  # the model's tokens are the units
            rho_U, outside_U = rho_U[mask_N.bool()], outside_U[mask_N.bool()]
        count = torch.tensor(float(rho_U.numel()), dtype=rho_N.dtype, device=rho_N.device)
        one = torch.ones((), dtype=rho_N.dtype, device=rho_N.device)  # extremes of no unit: neutral
        sums = {"is_ratio": rho_U.sum(), "is_count": count, "is_min": rho_U.min() if rho_U.numel() else one,
                "is_max": rho_U.max() if rho_U.numel() else one, "is_cut": outside_U.sum().to(rho_N.dtype)}
    return rho_N, sums


def token_weights(sample_N: torch.Tensor, lengths_S: torch.Tensor, loss_norm: LossNorm,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight of each token in the un-normalised micro-batch sum. (N,)

    sample_N: sample index 0..S-1 of each label (`PackedBatch.sample_N`); lengths_S: R_i.
    token-mean and constant: 1; seq-mean: 1 / R_i of the token's sample. A weight depends on
    its own sample only, which is what keeps the sum split-invariant.
    """
    if loss_norm not in get_args(LossNorm):
        raise ValueError(f"loss_norm {loss_norm!r}: expected one of {get_args(LossNorm)}")
    if loss_norm == "seq-mean":
        return 1.0 / lengths_S.to(dtype)[sample_N]
    return torch.ones(sample_N.shape, dtype=dtype, device=sample_N.device)


def normaliser(loss_norm: LossNorm, num_tokens: int, num_sequences: int, constant: float | None = None) -> float:
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
        raise ValueError(f"loss_norm {loss_norm!r}: expected one of {get_args(LossNorm)}")
    if value <= 0:
        raise ValueError(f"normaliser of {loss_norm!r} is {value}: an empty iteration?")
    return float(value)


def micro_batch_loss(logp_N: torch.Tensor, old_logp_N: torch.Tensor, ref_logp_N: torch.Tensor | None,
                     advantages_N: torch.Tensor, weights_N: torch.Tensor, cfg,
                     entropy_N: torch.Tensor | None = None, is_ratio_N: torch.Tensor | None = None,
                     mask_N: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The un-normalised loss sum of one micro-batch, and detached metric sums.

    cfg: an `AlgorithmConfig` (eps_low, eps_high, beta, kl_bias_correction). weights_N from
    `token_weights`; is_ratio_N from `behaviour_is_ratio` (None: no behaviour correction);
    mask_N (episodes: 1 on model tokens, 0 on environment tokens; None: all 1) multiplies the
    weights, so masked tokens carry no loss and no gradient, and keeps them out of the metric sums.
    Returns (loss_sum: scalar with grad = sum_n w_n * loss_n, call `.backward()` on it;
    sums: {'loss': sum w*loss, 'kl': sum kl, 'clip': clipped tokens, 'ratio': sum of the
    importance ratios, 'ratio_dev': sum |ratio - 1| (0 on-policy: the staleness shows here),
    'entropy': sum entropy}
    as detached 0-d tensors, to hand to `LossAccumulator.add`).
    """
    advantages_N = advantages_N.to(logp_N.dtype)
    weights_N = weights_N.to(logp_N.dtype)
    loss_N, kl_N, clipped_N = per_token_loss(logp_N, old_logp_N, advantages_N, cfg.eps_low, cfg.eps_high,
                                             ref_logp_N, cfg.beta, cfg.kl_bias_correction,
                                             None if is_ratio_N is None else is_ratio_N.to(logp_N.dtype))
    if mask_N is not None:
        mask_N = mask_N.to(logp_N.dtype)
        weights_N = weights_N * mask_N
    loss_sum = (weights_N * loss_N).sum()
    with torch.no_grad():
        ratio_N = torch.exp(logp_N.detach() - old_logp_N)
        m = (lambda x_N: x_N) if mask_N is None else (lambda x_N: x_N * mask_N)  # noqa: E731
        sums = {"loss": loss_sum.detach(), "kl": m(kl_N).sum(), "clip": m(clipped_N.to(kl_N.dtype)).sum(),
                "ratio": m(ratio_N).sum(), "ratio_dev": m((ratio_N - 1).abs()).sum(),
                "entropy": m(entropy_N.detach()).sum() if entropy_N is not None else torch.zeros((), dtype=kl_N.dtype)}
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
    With optimizer_steps_per_iteration = k > 1 use one accumulator per optimizer step; with
    token-mean over the 'iteration' (steps = k, TRL's dapo) the caller sets `iteration_tokens`
    (the tokens of all k steps) before `finalize_gradients`: each step is divided by
    iteration_tokens / k instead of its own count.
    """

    def __init__(self, loss_norm: LossNorm, constant: float | None = None, steps: int = 1,
                 scope: TokenMeanScope = "step"):
        if loss_norm not in get_args(LossNorm):
            raise ValueError(f"loss_norm {loss_norm!r}: expected one of {get_args(LossNorm)}")
        if loss_norm == "constant" and not constant:
            raise ValueError("loss_norm 'constant' needs constant = B * G * max_tokens")
        if scope not in get_args(TokenMeanScope):
            raise ValueError(f"scope {scope!r}: expected 'step' or 'iteration'")
        self.loss_norm, self.constant = loss_norm, constant
        self.steps = steps
        self.scope = scope if loss_norm == "token-mean" and steps > 1 else "step"
        """'iteration': the token-mean normaliser is iteration_tokens / steps (see the class docstring)."""
        self.iteration_tokens: int | None = None
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
        return cls(cfg.loss_norm, constant, cfg.optimizer_steps_per_iteration, cfg.token_mean_scope)

    def add(self, sums: dict[str, torch.Tensor], num_tokens: int, num_sequences: int) -> None:
        """Record one micro-batch: its metric sums (keys ending in _min / _max: extremes), N label
        tokens and S whole sequences."""
        for k, v in sums.items():
            if k not in self.sums:
                self.sums[k] = v
            elif k.endswith("_min"):
                self.sums[k] = torch.minimum(self.sums[k], v)
            elif k.endswith("_max"):
                self.sums[k] = torch.maximum(self.sums[k], v)
            else:
                self.sums[k] = self.sums[k] + v
        self.num_tokens += int(num_tokens)
        self.num_sequences += int(num_sequences)
        self.num_micro_batches += 1

    @property
    def normaliser(self) -> float:
        if self.num_sequences and not self.num_tokens and self.loss_norm == "token-mean":
            return 1.0  # every token masked (failed episodes): the gradients are zero, nothing to divide
        if self.scope == "iteration":
            if self.iteration_tokens is None:
                raise ValueError("token-mean over the iteration: set iteration_tokens (the tokens of all "
                                 f"{self.steps} optimizer steps) before normalising")
            return normaliser(self.loss_norm, self.iteration_tokens, self.num_sequences) / self.steps
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
        count = float(self.sums.get("is_count", 0.0))
        if count > 0:  # the behaviour importance ratio over its units (tokens or sequences)
            out.update(is_ratio_mean=float(self.sums["is_ratio"]) / count, is_ratio_min=float(self.sums["is_min"]),
                       is_ratio_max=float(self.sums["is_max"]), is_ratio_cut=float(self.sums["is_cut"]) / count)
        out.update(tokens=float(self.num_tokens), sequences=float(self.num_sequences),
                   micro_batches=float(self.num_micro_batches))
        return out
